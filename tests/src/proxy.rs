//! A TCP proxy in front of the API server that can be frozen: while frozen, connections stay
//! open but carry nothing — the silent hang that a watch must survive. Unfreezing closes the
//! frozen connections and lets new ones through; [`Proxy::hold`] keeps them hung even after
//! that (a dead connection a client must give up on by itself), and [`Proxy::refuse`] makes
//! the API server unreachable (the port is closed and open connections are cut) until
//! [`Proxy::accept`].

use std::net::SocketAddr;

use anyhow::Result;
use tokio::{
    net::{TcpListener, TcpStream},
    sync::watch,
    task::JoinHandle,
};

/// A running proxy.
pub struct Proxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    frozen: watch::Sender<bool>,
    held: watch::Sender<bool>,
    refusing: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Proxy {
    /// Starts a proxy to `upstream` on a free loopback port.
    pub async fn start(upstream: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (frozen, _) = watch::channel(false);
        let (held, _) = watch::channel(false);
        let (refusing, _) = watch::channel(false);
        let tx = frozen.clone();
        let (held_tx, refusing_tx) = (held.clone(), refusing.clone());
        let task = tokio::spawn(async move {
            let mut listener = Some(listener);
            let mut refused = refusing_tx.subscribe();
            loop {
                let Some(l) = listener.as_ref() else {
                    if refused.wait_for(|r| !*r).await.is_err() {
                        return;
                    }
                    // The same port again, as a restarted API server would have it.
                    listener = TcpListener::bind(addr).await.ok();
                    if listener.is_none() {
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                    continue;
                };
                tokio::select! {
                    accepted = l.accept() => match accepted {
                        Ok((client, _)) => {
                            let links = Links { frozen: tx.subscribe(), held: held_tx.subscribe(), refusing: refusing_tx.subscribe() };
                            tokio::spawn(relay(client, upstream, links));
                        }
                        Err(_) => return,
                    },
                    r = refused.wait_for(|r| *r) => {
                        if r.is_err() {
                            return;
                        }
                        listener = None;
                    }
                }
            }
        });
        Ok(Self {
            addr,
            frozen,
            held,
            refusing,
            task,
        })
    }

    /// Stops forwarding; connections hang.
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    /// Closes the hung connections and forwards again.
    pub fn unfreeze(&self) {
        self.frozen.send_replace(false);
    }

    /// Makes connections that hang from now on stay hung after [`Proxy::unfreeze`], until the
    /// proxy is dropped: only a client-side timeout gets a request on them to end.
    pub fn hold(&self) {
        self.held.send_replace(true);
    }

    /// Closes the port and cuts every open connection: connecting is refused.
    pub fn refuse(&self) {
        self.refusing.send_replace(true);
    }

    /// Opens the port again.
    pub fn accept(&self) {
        self.refusing.send_replace(false);
    }
}

/// What a relayed connection follows.
struct Links {
    frozen: watch::Receiver<bool>,
    held: watch::Receiver<bool>,
    refusing: watch::Receiver<bool>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(mut client: TcpStream, upstream: SocketAddr, links: Links) {
    let Links {
        mut frozen,
        held,
        mut refusing,
    } = links;
    if *frozen.borrow_and_update() {
        let _ = frozen.wait_for(|f| !*f).await;
        hold_if_asked(&held, &frozen).await;
        return;
    }
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let mut thaw = frozen.clone();
    let froze = tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => false,
        r = frozen.wait_for(|f| *f) => r.is_ok(),
        _ = refusing.wait_for(|r| *r) => false,
    };
    if froze {
        // Hold both sockets open without moving a byte until unfrozen, then drop them.
        let _ = thaw.wait_for(|f| !*f).await;
        hold_if_asked(&held, &thaw).await;
    }
}

/// With [`Proxy::hold`], waits until the proxy is gone.
async fn hold_if_asked(held: &watch::Receiver<bool>, frozen: &watch::Receiver<bool>) {
    if *held.borrow() {
        let mut gone = frozen.clone();
        let _ = gone.wait_for(|_| false).await;
    }
}
