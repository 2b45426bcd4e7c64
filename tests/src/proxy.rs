//! A TCP proxy in front of the API server that injects network faults.
//!
//! Frozen, connections stay open but carry nothing — the silent hang that a watch must
//! survive; unfreezing closes the frozen connections and lets new ones through. The other
//! faults ([`Fault`]): connections refused (the port stops listening), reset (open ones are
//! closed with a TCP RST, new ones reset at once), delayed (every chunk in both directions
//! waits), and half-closed (the proxy stops sending to the client and closes that direction,
//! while the client's requests still reach the server). [`Proxy::hold`] keeps frozen
//! connections hung even after the fault clears (a dead connection a client must give up on by
//! itself); [`Proxy::refuse`] makes the API server unreachable (the port is closed and open
//! connections are cut) until [`Proxy::accept`].

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream, tcp::OwnedReadHalf, tcp::OwnedWriteHalf},
    sync::watch,
    task::JoinHandle,
};

use crate::testenv::TestEnv;

/// A fault the proxy injects.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fault {
    /// None: bytes flow.
    #[default]
    None,
    /// Connections hang without moving a byte; clearing the fault closes them.
    Frozen,
    /// The port does not listen: new connections are refused.
    Refused,
    /// Open and new connections are reset (RST).
    Reset,
    /// Every chunk waits this long before it is forwarded.
    Delayed(Duration),
    /// The proxy closes its sending side towards the client (the client reads EOF) and keeps
    /// forwarding the client's bytes to the server.
    HalfClosed,
}

/// A running proxy.
pub struct Proxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    fault: watch::Sender<Fault>,
    held: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Proxy {
    /// Starts a proxy in front of `env`'s API server and writes a copy of its kubeconfig that
    /// talks through the proxy; returns the proxy and that kubeconfig's path. Every test that
    /// cuts the controller off from the API server sets itself up this way, so the kubeconfig
    /// rewrite lives here once.
    pub async fn in_front_of(env: &TestEnv) -> Result<(Self, PathBuf)> {
        let kubeconfig = std::fs::read_to_string(&env.kubeconfig)?;
        let server = kubeconfig
            .lines()
            .find_map(|l| l.trim().strip_prefix("server: https://"))
            .context("no server in the kubeconfig")?
            .to_owned();
        let upstream: SocketAddr = server.parse()?;
        let proxy = Self::start(upstream).await?;
        let proxied = env.scratch().join("proxied.kubeconfig");
        std::fs::write(&proxied, kubeconfig.replace(&server, &proxy.addr.to_string()))?;
        Ok((proxy, proxied))
    }

    /// Starts a proxy to `upstream` on a free loopback port.
    pub async fn start(upstream: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (fault, _) = watch::channel(Fault::None);
        let (held, _) = watch::channel(false);
        let tx = fault.clone();
        let held_tx = held.clone();
        let task = tokio::spawn(async move {
            let mut listener = Some(listener);
            let mut faults = tx.subscribe();
            loop {
                let refused = *faults.borrow_and_update() == Fault::Refused;
                if refused {
                    // Stop listening until the fault changes, then listen on the same port.
                    listener = None;
                    if faults.changed().await.is_err() {
                        return;
                    }
                    continue;
                }
                let Some(l) = listener.as_ref() else {
                    match TcpListener::bind(addr).await {
                        Ok(l) => listener = Some(l),
                        Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                    }
                    continue;
                };
                tokio::select! {
                    accepted = l.accept() => match accepted {
                        Ok((client, _)) => {
                            tokio::spawn(relay(client, upstream, tx.subscribe(), held_tx.subscribe()));
                        }
                        Err(_) => return,
                    },
                    changed = faults.changed() => if changed.is_err() { return },
                }
            }
        });
        Ok(Self {
            addr,
            fault,
            held,
            task,
        })
    }

    /// Injects `fault` (or clears it with [`Fault::None`]).
    pub fn set(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// Stops forwarding; connections hang.
    pub fn freeze(&self) {
        self.set(Fault::Frozen);
    }

    /// Closes the hung connections and forwards again.
    pub fn unfreeze(&self) {
        self.set(Fault::None);
    }

    /// Makes connections that hang from now on stay hung after [`Proxy::unfreeze`], until the
    /// proxy is dropped: only a client-side timeout gets a request on them to end.
    pub fn hold(&self) {
        self.held.send_replace(true);
    }

    /// Closes the port and cuts every open connection: connecting is refused.
    pub fn refuse(&self) {
        self.set(Fault::Refused);
    }

    /// Opens the port again.
    pub fn accept(&self) {
        self.set(Fault::None);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// With [`Proxy::hold`], waits until the proxy is gone.
async fn hold_if_asked(held: &watch::Receiver<bool>, faults: &watch::Receiver<Fault>) {
    if *held.borrow() {
        let mut gone = faults.clone();
        let _ = gone.wait_for(|_| false).await;
    }
}

/// Resets a connection: closes it with SO_LINGER 0, which sends an RST.
fn reset(stream: TcpStream) {
    linger_zero(&stream);
    drop(stream);
}

/// Sets SO_LINGER to 0: the close that follows sends an RST at once (a zero linger never
/// blocks, which is what the deprecation of `set_linger` warns about).
#[allow(deprecated)]
fn linger_zero(stream: &TcpStream) {
    let _ = stream.set_linger(Some(Duration::ZERO));
}

async fn relay(
    client: TcpStream,
    upstream: SocketAddr,
    mut faults: watch::Receiver<Fault>,
    held: watch::Receiver<bool>,
) {
    let fault = *faults.borrow_and_update();
    match fault {
        Fault::Frozen => {
            let _ = faults.wait_for(|f| *f != Fault::Frozen).await;
            hold_if_asked(&held, &faults).await;
            drop(client);
            return;
        }
        Fault::Reset | Fault::Refused => return reset(client),
        _ => {}
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return reset(client);
    };
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = tokio::spawn(pump(
        client_read,
        server_write,
        faults.clone(),
        held.clone(),
        false,
    ));
    let down = tokio::spawn(pump(server_read, client_write, faults, held, true));
    let _ = (up.await, down.await);
}

/// Copies `from` to `to` under the current fault, until either side closes or a fault ends
/// the connection. On a reset, the socket behind `to` is set to linger 0 and its write half
/// is let go without a FIN, so that dropping the read halves sends an RST and nothing else.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut faults: watch::Receiver<Fault>,
    held: watch::Receiver<bool>,
    towards_client: bool,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let fault = *faults.borrow_and_update();
        match fault {
            Fault::Frozen => {
                // Hold the connection without moving a byte; close it when unfrozen (or,
                // with `hold`, when the proxy is gone).
                let _ = faults.wait_for(|f| *f != Fault::Frozen).await;
                hold_if_asked(&held, &faults).await;
                return;
            }
            // The server went away: open connections are cut.
            Fault::Refused => return,
            Fault::Reset => {
                // An RST only: dropping a write half would send a FIN first, which the client
                // would read as an orderly end before the reset.
                linger_zero(to.as_ref());
                to.forget();
                return;
            }
            Fault::HalfClosed if towards_client => {
                let _ = to.shutdown().await;
                // Keep reading (and dropping) what the server sends until the fault clears.
                let _ = faults.wait_for(|f| *f != Fault::HalfClosed).await;
                return;
            }
            _ => {}
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => n,
            },
            changed = faults.changed() => {
                if changed.is_err() {
                    return;
                }
                continue;
            }
        };
        let delay = match *faults.borrow() {
            Fault::Delayed(d) => Some(d),
            _ => None,
        };
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
