//! A TCP proxy in front of the API server that can be frozen: while frozen, connections stay
//! open but carry nothing — the silent hang that a watch must survive. Unfreezing closes the
//! frozen connections and lets new ones through.

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
    task: JoinHandle<()>,
}

impl Proxy {
    /// Starts a proxy to `upstream` on a free loopback port.
    pub async fn start(upstream: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (frozen, _) = watch::channel(false);
        let tx = frozen.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let rx = tx.subscribe();
                tokio::spawn(relay(client, upstream, rx));
            }
        });
        Ok(Self { addr, frozen, task })
    }

    /// Stops forwarding; connections hang.
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    /// Closes the hung connections and forwards again.
    pub fn unfreeze(&self) {
        self.frozen.send_replace(false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(mut client: TcpStream, upstream: SocketAddr, mut frozen: watch::Receiver<bool>) {
    if *frozen.borrow_and_update() {
        let _ = frozen.wait_for(|f| !*f).await;
        return;
    }
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let mut thaw = frozen.clone();
    let froze = tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => false,
        r = frozen.wait_for(|f| *f) => r.is_ok(),
    };
    if froze {
        // Hold both sockets open without moving a byte until unfrozen, then drop them.
        let _ = thaw.wait_for(|f| !*f).await;
    }
}
