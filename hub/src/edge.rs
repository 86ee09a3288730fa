//! Edge: what a peer can hold on the hub's gRPC port. Before it proves who it is: a TLS
//! handshake deadline, a bound on connections and on HTTP/2 streams per connection.
//! After: one session per cluster being admitted, checked before its Hello is read, and
//! agent messages far smaller than the hub's own. Every refusal or clamp is counted by reason.

use std::collections::HashSet;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use flotilla_proto::client::{MAX_AGENT_MESSAGE, MAX_MESSAGE};
use flotilla_proto::v1::federation_server::{Federation, FederationServer};
use futures::Stream;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tonic::transport::Server;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tracing::{debug, warn};

/// A ping after this long without traffic; a connection that does not answer within
/// the same time is dropped, so a vanished agent frees its cluster's session.
const KEEPALIVE: Duration = Duration::from_secs(10);

pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// 10,000 members, each with one connection, plus half again for reconnects that
/// overlap a connection not yet found dead by keepalive (after a hub failover, all of
/// them at once).
pub const MAX_AGENT_CONNECTIONS: usize = 15_000;
/// Connections the kernel holds for the hub before it accepts them (capped by
/// `net.core.somaxconn`). When a fleet dials at once (a hub failover), TLS handshakes
/// keep the runtime busy and the accept loop falls behind; past tokio's default of
/// 1024, the kernel drops the SYNs and each of those agents waits for a retransmit
/// (1 s, then 3 s, 7 s, 15 s, ...).
pub const ACCEPT_BACKLOG: u32 = 16_384;
/// An agent opens one session stream per connection; a few more let a reconnect on the
/// same connection overlap the old stream's end.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 4;

/// The bounds on the gRPC port (flags of `flotilla-hub run`).
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
pub struct EdgeLimits {
    /// A peer that has not finished its TLS handshake after this long is dropped.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub tls_handshake_timeout: Duration,
    /// Connections held at once, handshaking or not; beyond it new ones wait in the
    /// kernel's accept queue until one ends.
    #[arg(long, default_value_t = MAX_AGENT_CONNECTIONS)]
    pub max_agent_connections: usize,
    /// HTTP/2 streams a connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS).
    #[arg(long, default_value_t = MAX_STREAMS_PER_CONNECTION)]
    pub max_streams_per_connection: u32,
}

impl Default for EdgeLimits {
    fn default() -> Self {
        Self {
            tls_handshake_timeout: TLS_HANDSHAKE_TIMEOUT,
            max_agent_connections: MAX_AGENT_CONNECTIONS,
            max_streams_per_connection: MAX_STREAMS_PER_CONNECTION,
        }
    }
}

/// Raises the soft limit on open files to the hard one, as every Go program does: each
/// agent holds a connection, and a container runtime may start the hub at a soft limit
/// of 1024. Returns the limit now, and warns when it cannot hold
/// `max_agent_connections` and the hub's own files beside.
pub fn raise_open_files_limit(limits: &EdgeLimits) -> io::Result<u64> {
    let raised = rlimit::increase_nofile_limit(u64::MAX)?;
    let wanted = limits.max_agent_connections as u64 + OWN_FILES;
    if raised < wanted {
        warn!(
            open_files = raised,
            wanted,
            "the open-files limit is below --max-agent-connections plus {OWN_FILES}: agents past it are refused at accept; raise the container's or the unit's LimitNOFILE"
        );
    }
    Ok(raised)
}

/// Files the hub holds besides agents' connections: its apiserver connections, the
/// metrics port, logs, with room to spare.
const OWN_FILES: u64 = 1024;

/// Binds the gRPC port with a backlog of [`ACCEPT_BACKLOG`].
pub fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    // As tokio's `TcpListener::bind` does: a restarted hub binds again at once.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(ACCEPT_BACKLOG)
}

/// The transport the hub serves agents with over [`incoming`]'s TLS connections: few
/// streams per connection, HTTP/2 keepalive.
pub fn server(limits: &EdgeLimits) -> Server {
    Server::builder()
        .max_concurrent_streams(limits.max_streams_per_connection)
        .http2_keepalive_interval(Some(KEEPALIVE))
        .http2_keepalive_timeout(Some(KEEPALIVE))
}

/// `service` reading agent messages up to [`MAX_AGENT_MESSAGE`] (a larger one ends its
/// session before it is buffered) and writing Applies up to [`MAX_MESSAGE`].
pub fn federation<S: Federation>(service: S) -> FederationServer<S> {
    FederationServer::new(service)
        .max_decoding_message_size(MAX_AGENT_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE)
}

/// The connections `listener` accepts, at most `limits.max_agent_connections` alive at
/// once: the next is accepted only once a slot is free, so a flood of silent peers holds
/// at most that many sockets (and the accept loop never meets the file descriptor
/// limit). Each is handed on once its TLS handshake (with `tls`, which picks the
/// certificate at every handshake) is done; one not done within
/// `limits.tls_handshake_timeout` is dropped. Handshakes run side by side.
pub fn incoming(
    listener: TcpListener,
    limits: &EdgeLimits,
    tls: Arc<rustls::ServerConfig>,
    refusals: RefusalMetrics,
) -> impl Stream<Item = io::Result<TlsStream<Counted>>> + Send + 'static {
    let slots = Arc::new(Semaphore::new(limits.max_agent_connections));
    let handshake = limits.tls_handshake_timeout;
    let acceptor = TlsAcceptor::from(tls);
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = tx.closed() => return,
                accepted = async {
                    let slot = slots
                        .clone()
                        .acquire_owned()
                        .await
                        .expect("the semaphore is never closed");
                    listener.accept().await.map(|(stream, _)| Counted {
                        stream,
                        _slot: slot,
                    })
                } => accepted,
            };
            let counted = match accepted {
                Ok(counted) => counted,
                Err(e) => {
                    if tx.send(Err(e)).await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            let (tx, acceptor, refusals) = (tx.clone(), acceptor.clone(), refusals.clone());
            let peer = counted.stream.peer_addr().ok();
            tokio::spawn(async move {
                // A failed or late handshake drops the connection (and frees its slot);
                // counted, and logged at debug only: a port scan would flood the log.
                let refusal = match tokio::time::timeout(handshake, acceptor.accept(counted)).await
                {
                    Ok(Ok(tls)) => {
                        let _ = tx.send(Ok(tls)).await;
                        return;
                    }
                    Ok(Err(error)) => {
                        debug!(?peer, %error, "TLS handshake failed: connection dropped");
                        Refusal::TlsHandshakeFailed
                    }
                    Err(_) => {
                        debug!(
                            ?peer,
                            ?handshake,
                            "TLS handshake not done in time: connection dropped"
                        );
                        Refusal::TlsHandshakeTimeout
                    }
                };
                refusals.count(refusal);
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// A connection holding one of [`incoming`]'s slots until it is dropped (closed by
/// either side, or a handshake that failed or timed out).
pub struct Counted {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
}

impl Connected for Counted {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The clusters with a session being admitted (from its first byte until the dispatcher
/// registers it): a second stream of the same cluster meanwhile is refused before its
/// Hello (up to [`MAX_AGENT_MESSAGE`]) is read, so one credential decodes at most one
/// Hello at a time. A live session refuses the next one after its Hello
/// (`Dispatcher::connect`), once the identity checks have named what is wrong with it.
#[derive(Default)]
pub struct Admissions {
    clusters: Mutex<HashSet<String>>,
}

impl Admissions {
    /// The cluster's admission, unless another session of it holds one.
    pub fn admit(self: &Arc<Self>, cluster: &str) -> Option<Admitted> {
        self.clusters
            .lock()
            .insert(cluster.to_owned())
            .then(|| Admitted {
                admissions: self.clone(),
                cluster: cluster.to_owned(),
            })
    }
}

/// Held while a session is admitted; dropping it lets the cluster's next one in.
pub struct Admitted {
    admissions: Arc<Admissions>,
    cluster: String,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.admissions.clusters.lock().remove(&self.cluster);
    }
}

/// Why the hub refused or cut something an agent sent: the label of
/// `flotilla_hub_agent_refused_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// A string past its documented length, cut.
    LongString,
    /// A number outside its range (negative, or past what a cluster can hold), clamped.
    NumberOutOfRange,
    /// A message over [`MAX_AGENT_MESSAGE`]: the session ends.
    MessageTooLarge,
    /// A second session of a cluster that has one, live or being admitted.
    SecondSession,
    /// A credential revoked while its session waited for Hello or the plan.
    RevokedWhileAdmitted,
    /// A token past its expiry.
    TokenExpired,
    /// A TLS handshake that failed (not TLS, a protocol or certificate the hub refuses).
    TlsHandshakeFailed,
    /// A TLS handshake not done within `--tls-handshake-timeout`.
    TlsHandshakeTimeout,
}

impl Refusal {
    pub fn label(self) -> &'static str {
        match self {
            Refusal::LongString => "long_string",
            Refusal::NumberOutOfRange => "number_out_of_range",
            Refusal::MessageTooLarge => "message_too_large",
            Refusal::SecondSession => "second_session",
            Refusal::RevokedWhileAdmitted => "revoked_while_admitted",
            Refusal::TokenExpired => "token_expired",
            Refusal::TlsHandshakeFailed => "tls_handshake_failed",
            Refusal::TlsHandshakeTimeout => "tls_handshake_timeout",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// `flotilla_hub_agent_refused_total{reason}`; the cluster is in the log line, not in a
/// label (10,000 clusters × reasons would be series nobody reads).
#[derive(Clone, Default)]
pub struct RefusalMetrics {
    refused: Family<ReasonLabels, Counter>,
}

impl RefusalMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "flotilla_hub_agent_refused",
            "Agent input refused or clamped at the hub's gRPC edge, by reason",
            self.refused.clone(),
        );
    }

    pub fn count(&self, refusal: Refusal) {
        self.refused
            .get_or_create(&ReasonLabels {
                reason: refusal.label(),
            })
            .inc();
    }

    pub fn get(&self, refusal: Refusal) -> u64 {
        self.refused
            .get_or_create(&ReasonLabels {
                reason: refusal.label(),
            })
            .get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlimit::Resource;

    /// A hub started at a soft limit of 256 runs at its hard limit (in a child process:
    /// lowering this one's would starve the tests beside it).
    #[test]
    fn the_open_files_limit_is_raised_to_the_hard_limit() {
        const CHILD: &str = "FLOTILLA_TEST_NOFILE_CHILD";
        let (_, hard) = Resource::NOFILE.get().unwrap();
        if std::env::var_os(CHILD).is_some() {
            Resource::NOFILE.set(256, hard).unwrap();
            let raised = raise_open_files_limit(&EdgeLimits::default()).unwrap();
            assert_eq!(
                (raised, Resource::NOFILE.get().unwrap()),
                (hard, (hard, hard))
            );
            return;
        }
        let name = "edge::tests::the_open_files_limit_is_raised_to_the_hard_limit";
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture"])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&child.stdout);
        assert!(
            child.status.success(),
            "{out}{}",
            String::from_utf8_lossy(&child.stderr)
        );
        assert!(out.contains("1 passed"), "the child ran the test: {out}");
    }

    /// A fleet that dials while the hub is busy waits in the kernel's accept queue
    /// instead of losing its SYNs: with tokio's default backlog (1024) a fan-out to
    /// 10,000 agents took 112 s of retransmits instead of 14 s (BENCHMARKS.md).
    #[tokio::test]
    async fn a_fleet_dialling_at_once_is_queued_not_dropped() {
        let somaxconn =
            std::fs::read_to_string("/proc/sys/net/core/somaxconn").expect("net.core.somaxconn");
        let somaxconn: usize = somaxconn.trim().parse().expect("a number");
        let queued = somaxconn.min(ACCEPT_BACKLOG as usize);
        let listener = listen("127.0.0.1:0".parse().unwrap()).expect("binds");
        let addr = listener.local_addr().unwrap();
        // Nothing accepts: each connection must be held in the queue.
        let dial = || tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr));
        let dials = futures::future::join_all((0..queued).map(|_| dial())).await;
        let held = dials.iter().filter(|d| matches!(d, Ok(Ok(_)))).count();
        assert_eq!(
            held, queued,
            "connections held, of {queued} (somaxconn {somaxconn})"
        );
    }
}
