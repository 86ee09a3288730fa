//! A TCP proxy for the fault suite: it sits between an agent and the hub and can
//! blackhole the link on demand. Blackholed, it stops moving bytes both ways (they wait,
//! as on a cut link, and TCP's own backpressure stops the senders) and lets new
//! connections in without reaching the hub; healed, everything flows again. It can also
//! be pointed at another upstream, for new connections, as a Service follows its
//! endpoints.

use std::net::SocketAddr;

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

pub struct Proxy {
    /// Where clients connect: `127.0.0.1:PORT`.
    pub addr: SocketAddr,
    /// `true` while bytes flow.
    open: watch::Sender<bool>,
    /// Where new connections go.
    upstream: watch::Sender<String>,
    task: JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards every connection to `upstream`.
    pub async fn start(upstream: &str) -> Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the proxy")?;
        let addr = listener.local_addr()?;
        let (open, _) = watch::channel(true);
        let rx = open.subscribe();
        let (upstream, to) = watch::channel(upstream.to_string());
        let task = tokio::spawn(async move {
            // Dropped with the accept loop, so aborting it ends every connection too.
            let mut conns = JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let to = to.borrow().clone();
                conns.spawn(relay(client, to, rx.clone()));
            }
        });
        Ok(Proxy {
            addr,
            open,
            upstream,
            task,
        })
    }

    /// Sends new connections to `upstream`; those already open stay where they are.
    pub fn retarget(&self, upstream: &str) {
        self.upstream.send_replace(upstream.to_string());
    }

    /// The upstream's handle, for a task that keeps retargeting the proxy.
    pub fn upstream(&self) -> watch::Sender<String> {
        self.upstream.clone()
    }

    /// Stops moving bytes.
    pub fn blackhole(&self) {
        self.open.send_replace(false);
    }

    /// Moves bytes again.
    pub fn heal(&self) {
        self.open.send_replace(true);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn wait_open(open: &mut watch::Receiver<bool>) -> bool {
    open.wait_for(|o| *o).await.is_ok()
}

/// Resolves when the link is cut (or the proxy is gone).
async fn cut(open: &mut watch::Receiver<bool>) {
    let _ = open.wait_for(|o| !*o).await;
}

async fn relay(client: TcpStream, upstream: String, mut open: watch::Receiver<bool>) {
    if !wait_open(&mut open).await {
        return;
    }
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return;
    };
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    tokio::join!(pump(cr, sw, open.clone()), pump(sr, cw, open));
}

async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut open: watch::Receiver<bool>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if !wait_open(&mut open).await {
            return;
        }
        // A read is cancel-safe: when the link is cut while it waits, nothing is lost.
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => n,
            },
            _ = cut(&mut open) => continue,
        };
        if !wait_open(&mut open).await || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn roundtrip(s: &mut TcpStream, msg: &[u8], within: Duration) -> Option<Vec<u8>> {
        s.write_all(msg).await.unwrap();
        let mut got = vec![0; msg.len()];
        tokio::time::timeout(within, s.read_exact(&mut got))
            .await
            .ok()?
            .ok()?;
        Some(got)
    }

    #[tokio::test]
    async fn forwards_blackholes_and_heals() {
        let upstream = echo_server().await;
        let proxy = Proxy::start(&upstream.to_string()).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        let short = Duration::from_millis(300);
        assert_eq!(
            roundtrip(&mut s, b"one", Duration::from_secs(5))
                .await
                .unwrap(),
            b"one"
        );

        proxy.blackhole();
        assert_eq!(
            roundtrip(&mut s, b"two", short).await,
            None,
            "bytes went through a blackhole"
        );
        // A new connection gets in but reaches nobody.
        let mut late = TcpStream::connect(proxy.addr).await.unwrap();
        assert_eq!(roundtrip(&mut late, b"hi", short).await, None);

        proxy.heal();
        // What waited arrives, in order, then the link works as before.
        let mut got = vec![0; 3];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, b"two");
        let mut got = vec![0; 2];
        tokio::time::timeout(Duration::from_secs(5), late.read_exact(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, b"hi");
        assert_eq!(
            roundtrip(&mut s, b"three", Duration::from_secs(5))
                .await
                .unwrap(),
            b"three"
        );
    }

    /// A server that greets every connection with `name`, then echoes.
    async fn named_server(name: &'static [u8]) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    s.write_all(name).await.unwrap();
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn greeting(s: &mut TcpStream) -> Vec<u8> {
        let mut got = vec![0; 3];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got))
            .await
            .unwrap()
            .unwrap();
        got
    }

    #[tokio::test]
    async fn new_connections_follow_a_retarget_and_old_ones_stay() {
        let (one, two) = (named_server(b"one").await, named_server(b"two").await);
        let proxy = Proxy::start(&one.to_string()).await.unwrap();
        let mut old = TcpStream::connect(proxy.addr).await.unwrap();
        assert_eq!(greeting(&mut old).await, b"one");
        proxy.retarget(&two.to_string());
        let mut new = TcpStream::connect(proxy.addr).await.unwrap();
        assert_eq!(greeting(&mut new).await, b"two");
        let within = Duration::from_secs(5);
        assert_eq!(
            roundtrip(&mut old, b"still", within).await.unwrap(),
            b"still"
        );
    }

    #[tokio::test]
    async fn dropping_the_proxy_ends_its_connections() {
        let upstream = echo_server().await;
        let proxy = Proxy::start(&upstream.to_string()).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        roundtrip(&mut s, b"x", Duration::from_secs(5))
            .await
            .unwrap();
        drop(proxy);
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("the connection was closed")
            .unwrap_or(0);
        assert_eq!(n, 0);
    }
}
