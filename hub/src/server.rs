//! Server: the tonic `Federation` service. Authenticates each stream as one member
//! cluster, admits it once the index is planned for that cluster, feeds its queue to the
//! agent and its reports to the index and the status board.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use flotilla_plan::index::{AppKey, Scope};
use flotilla_proto::WireKey;
use flotilla_proto::client::MAX_AGENT_MESSAGE;
use flotilla_proto::v1::federation_server::Federation;
use flotilla_proto::v1::{self as pb, agent_message};
use futures::StreamExt as _;
use k8s_openapi::jiff::Timestamp;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::{info, warn};

use crate::auth::{self, AuthError};
use crate::convert::{capacity_from_pb, hello_from_pb, report_from_pb};
use crate::dispatch::{ClusterQueue, Dispatcher};
use crate::edge::{self, Admissions, EdgeLimits, Refusal, RefusalMetrics};
use crate::membership::{self, Membership};
use crate::renew::Renewer;
use crate::status::StatusBoard;

/// Messages buffered towards one agent beyond its queue: small, since the queue itself
/// collapses superseded versions and a full buffer is how backpressure reaches it.
const STREAM_BUFFER: usize = 64;
const BATCH: usize = 64;
/// An agent's reason for not storing a renewed token is cut to this before it is logged.
const RENEWAL_ERROR_MAX: usize = 1024;
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a session waits for the index to be planned for its cluster (a MemberCluster
/// just created): past it, the agent is told to retry.
const PLANNED_TIMEOUT: Duration = Duration::from_secs(10);

/// What the service needs of the host cluster: the MemberClusters (tokens, identity) and
/// Warning Events on them. The hub's is [`membership::HostMembers`]; behind a trait so
/// that the service is served, and tested, without a host.
#[tonic::async_trait]
pub trait Host: auth::MemberLookup {
    /// Publishes `warning` on `cluster`'s MemberCluster, if there is one. Best effort: a
    /// failure is logged, never returned.
    async fn warn(&self, cluster: &str, warning: Warning);
}

/// A Warning Event on a MemberCluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub reason: &'static str,
    pub action: &'static str,
    pub note: String,
}

pub struct FederationService {
    pub dispatcher: Arc<Dispatcher>,
    pub status: Arc<StatusBoard>,
    pub membership: Arc<Membership>,
    /// MemberClusters, and Events on them (an expired token, a held-back collection).
    pub host: Arc<dyn Host>,
    /// Only the leading hub serves agents.
    pub leading: tokio::sync::watch::Receiver<bool>,
    /// One session per cluster being admitted, checked before its Hello is read.
    pub admissions: Arc<Admissions>,
    pub refusals: RefusalMetrics,
    /// Renews sessions' tokens; hears the agents' answers.
    pub renewer: Arc<Renewer>,
}

/// Binds `addr` and serves agents until `shutdown`; then ends every session at once so
/// that agents reconnect to the next hub instead of holding on to this one.
pub async fn serve(
    addr: SocketAddr,
    tls: Arc<rustls::ServerConfig>,
    limits: EdgeLimits,
    service: FederationService,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener =
        edge::listen(addr).with_context(|| format!("binding the gRPC address {addr}"))?;
    info!(grpc = %addr, "serving agents");
    let dispatcher = service.dispatcher.clone();
    let refusals = service.refusals.clone();
    let mut leading = service.leading.clone();
    let stop = async move {
        // Sessions end when the hub stops, and when it stops leading: its agents must
        // reconnect to the new leader.
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                changed = leading.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    if !*leading.borrow_and_update() {
                        info!("no longer leading: closing every agent session");
                        dispatcher.close_all();
                    }
                }
            }
        }
        dispatcher.close_all();
    };
    edge::server(&limits)
        .add_service(edge::federation(service))
        .serve_with_incoming_shutdown(edge::incoming(listener, &limits, tls, refusals), stop)
        .await
        .with_context(|| format!("serving gRPC on {addr}"))
}

fn refused(e: AuthError) -> Status {
    Status::unauthenticated(e.to_string())
}

/// tonic ends a stream with OUT_OF_RANGE, before buffering it, when a message's length
/// prefix is over the decoding limit.
fn too_large(e: &Status) -> bool {
    e.code() == tonic::Code::OutOfRange
}

fn message_too_large() -> Status {
    Status::resource_exhausted(format!(
        "a message over the hub's limit of {MAX_AGENT_MESSAGE} bytes ends the session"
    ))
}

impl FederationService {
    /// Authenticated before the Hello and plan waits, the credential was revoked during
    /// them.
    fn revoked_while_admitted(&self, cluster: &str) -> Status {
        self.refusals.count(Refusal::RevokedWhileAdmitted);
        warn!(%cluster, "credential revoked while its session was being admitted");
        Status::unauthenticated(format!("credential for cluster {cluster:?} was revoked"))
    }
}

/// What a session's channel carries to its agent's stream, the message boxed: tokio
/// allocates a channel's slots in blocks of 32 and keeps its blocks for reuse while it
/// lives, and [`STREAM_BUFFER`] messages in flight span three; of 104 B messages that
/// held ~10 KiB per open session (heaptrack, 10,000 sessions), of 16 B slots 1.5 KiB.
type Outbound = Result<Box<pb::HubMessage>, Status>;

fn unbox(outbound: Outbound) -> Result<pb::HubMessage, Status> {
    outbound.map(|message| *message)
}

#[tonic::async_trait]
impl Federation for FederationService {
    type SessionStream = futures::stream::Map<
        ReceiverStream<Outbound>,
        fn(Outbound) -> Result<pb::HubMessage, Status>,
    >;

    async fn session(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        if !*self.leading.borrow() {
            return Err(Status::unavailable(
                "this hub is a standby; the leading hub serves agents",
            ));
        }
        let identity = match auth::authenticate(&*self.host, authorization, Timestamp::now()) {
            Ok(identity) => identity,
            Err(e @ AuthError::Expired { .. }) => {
                self.refusals.count(Refusal::TokenExpired);
                warn!(error = %e, "an expired token refused");
                if let AuthError::Expired { cluster, .. } = &e {
                    self.host.warn(cluster, token_expired(&e)).await;
                }
                return Err(refused(e));
            }
            Err(e) => return Err(refused(e)),
        };
        let cluster = identity.cluster.clone();
        // Before anything is read: one credential decodes at most one Hello at a time.
        // Held until `connect` has registered the session (or it is refused); a live
        // session refuses the next one at `connect`, after the identity checks.
        let Some(_admitted) = self.admissions.admit(&cluster) else {
            self.refusals.count(Refusal::SecondSession);
            warn!(%cluster, "a second session of a cluster being admitted, refused before its Hello");
            return Err(Status::already_exists(format!(
                "cluster {cluster:?} has an agent session being admitted; a second agent with the same identity is refused"
            )));
        };
        let mut inbound = request.into_inner();
        let hello = match tokio::time::timeout(HELLO_TIMEOUT, inbound.message()).await {
            Ok(Ok(Some(pb::AgentMessage {
                kind: Some(agent_message::Kind::Hello(h)),
            }))) => h,
            Ok(Err(e)) if too_large(&e) => {
                self.refusals.count(Refusal::MessageTooLarge);
                warn!(%cluster, "a Hello over the message limit, refused");
                return Err(message_too_large());
            }
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(Status::deadline_exceeded("no Hello within 10s")),
            Ok(_) => {
                return Err(Status::invalid_argument(
                    "the first message of a session must be Hello",
                ));
            }
        };
        let mut hello = match hello_from_pb(hello) {
            Ok(hello) => {
                if let Some(refusal) = hello.refused {
                    self.refusals.count(refusal);
                    warn!(%cluster, "the agent's versions are too long; cut");
                }
                hello.value
            }
            Err(refusal) => {
                self.refusals.count(refusal);
                warn!(%cluster, "a Hello whose cluster name, UID or scope is too long, refused");
                return Err(Status::invalid_argument(
                    "Hello: the cluster name, UID, ID or a scope namespace is longer than any real one (or a scope namespace is empty)",
                ));
            }
        };
        if hello.cluster != cluster {
            return Err(Status::permission_denied(format!(
                "this credential is for cluster {cluster:?}, not {:?}",
                hello.cluster
            )));
        }
        if let Some(why) = self
            .host
            .member(&cluster)
            .and_then(|m| membership::foreign_cluster(&m, &hello.cluster_uid, &hello.cluster_id))
        {
            warn!(%cluster, "{why}");
            return Err(Status::permission_denied(why));
        }
        if !self
            .dispatcher
            .wait_planned(&cluster, PLANNED_TIMEOUT)
            .await
        {
            return Err(Status::unavailable(format!(
                "the hub has not planned the apps of cluster {cluster:?} yet; retry"
            )));
        }
        let managed: HashMap<AppKey, String> = std::mem::take(&mut hello.managed)
            .into_iter()
            .filter_map(|m| Some((AppKey::from_wire(m.key)?, m.hash)))
            .collect();
        if auth::revoked(&*self.host, &identity) {
            return Err(self.revoked_while_admitted(&cluster));
        }
        let queue = self
            .dispatcher
            .connect(&identity, &managed, Scope::of(hello.scope.clone()))
            .map_err(|busy| {
                self.refusals.count(Refusal::SecondSession);
                warn!(%cluster, "{busy}");
                Status::already_exists(busy.to_string())
            })?;
        // Leading was checked before the waits above. A hub that stopped meanwhile has
        // closed its sessions (or will, after the change seen here), and must not keep
        // one opened since: its agent would never look for the leader.
        if !*self.leading.borrow() {
            self.dispatcher.disconnect(&queue);
            return Err(Status::unavailable(
                "this hub stopped leading; the leading hub serves agents",
            ));
        }
        // Checked again after `connect`: a revocation after this check finds the session
        // registered, and the revocation sweep closes it.
        if auth::revoked(&*self.host, &identity) {
            self.dispatcher.disconnect(&queue);
            return Err(self.revoked_while_admitted(&cluster));
        }
        info!(%cluster, agent = %hello.agent_version, kubernetes = %hello.kubernetes_version, managed = managed.len(), scope = ?hello.scope, "agent connected");
        queue.set_renews_token(hello.renews_token);
        self.membership.hello(&cluster, &hello);
        self.dispatcher.metrics.collection_blocked(&cluster, 0);

        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        tokio::spawn(send_loop(
            queue.clone(),
            self.dispatcher.clone(),
            self.host.clone(),
            tx.clone(),
        ));
        tokio::spawn(receive_loop(
            Inbound {
                refused: Refused::new(&cluster, self.refusals.clone()),
                queue,
                stream: inbound,
                ended: tx,
            },
            self.dispatcher.clone(),
            self.status.clone(),
            self.membership.clone(),
            self.host.clone(),
            self.renewer.clone(),
        ));
        Ok(Response::new(
            ReceiverStream::new(rx).map(unbox as fn(_) -> _),
        ))
    }
}

/// `kubectl describe membercluster` and event pipelines see the held-back collection
/// beside the condition.
fn collection_blocked(cluster: &str, blocked: &pb::CollectionBlocked) -> Warning {
    Warning {
        reason: "CollectionBlocked",
        action: "Collect",
        note: membership::collection_blocked_message(
            cluster,
            blocked.would_collect,
            blocked.managed,
        ),
    }
}

/// Said on the MemberCluster an expired token was presented for.
fn token_expired(error: &AuthError) -> Warning {
    Warning {
        reason: "TokenExpired",
        action: "Authenticate",
        note: error.to_string(),
    }
}

/// Drains the session's queue into the stream until the session is closed.
async fn send_loop(
    q: Arc<ClusterQueue>,
    dispatcher: Arc<Dispatcher>,
    host: Arc<dyn Host>,
    tx: mpsc::Sender<Outbound>,
) {
    let metrics = dispatcher.metrics.session(q.cluster());
    loop {
        let batch = tokio::select! {
            // Closing wins over pending messages: nothing is sent on a session that was
            // closed (revoked, cluster removed, hub stopping).
            biased;
            _ = q.closed.cancelled() => {
                let why = if auth::revoked(&*host, &q.identity()) {
                    Status::unauthenticated(format!("credential for cluster {:?} was revoked", q.cluster()))
                } else {
                    Status::unavailable("the hub closed the session; reconnect")
                };
                let _ = tx.send(Err(why)).await;
                return;
            }
            batch = q.next_batch(BATCH) => batch,
        };
        for message in batch {
            metrics.sent(&message);
            if tx.send(Ok(Box::new(message))).await.is_err() {
                return;
            }
        }
        metrics.queue_depth(q.depth());
    }
}

/// Counts what the hub refused or cut from one cluster's agent, and logs each reason once
/// per session: an agent cannot flood the log.
struct Refused {
    cluster: String,
    metrics: RefusalMetrics,
    logged: HashSet<Refusal>,
}

impl Refused {
    fn new(cluster: &str, metrics: RefusalMetrics) -> Self {
        Self {
            cluster: cluster.to_owned(),
            metrics,
            logged: HashSet::new(),
        }
    }

    fn note(&mut self, refusal: Option<Refusal>) {
        let Some(refusal) = refusal else { return };
        self.metrics.count(refusal);
        if self.logged.insert(refusal) {
            warn!(cluster = %self.cluster, reason = refusal.label(), "agent input refused or clamped (logged once per session and reason)");
        }
    }
}

/// What one session's receive loop owns.
struct Inbound {
    queue: Arc<ClusterQueue>,
    stream: Streaming<pb::AgentMessage>,
    refused: Refused,
    /// Tells the agent why the hub ended its session.
    ended: mpsc::Sender<Outbound>,
}

/// Carries the agent's reports and heartbeats until its stream ends or the session is
/// closed.
async fn receive_loop(
    session: Inbound,
    dispatcher: Arc<Dispatcher>,
    status: Arc<StatusBoard>,
    membership: Arc<Membership>,
    host: Arc<dyn Host>,
    renewer: Arc<Renewer>,
) {
    let Inbound {
        queue,
        stream: mut inbound,
        mut refused,
        ended,
    } = session;
    let cluster = queue.cluster().to_owned();
    let mut ignored = Throttle::new(WARN_EVERY);
    let mut blocked_said = Throttle::new(WARN_EVERY);
    loop {
        let message = tokio::select! {
            _ = queue.closed.cancelled() => break,
            m = inbound.message() => m,
        };
        match message {
            Ok(Some(pb::AgentMessage {
                kind: Some(agent_message::Kind::Status(report)),
            })) => {
                let Some(key) = AppKey::from_wire(report.key.clone()) else {
                    continue;
                };
                let report = report_from_pb(report);
                refused.note(report.refused);
                let report = report.value;
                if dispatcher.report(&queue, &key, report.held()) {
                    status.report(&cluster, &key, report);
                } else if let Some(held_back) = ignored.said(Instant::now()) {
                    // A reconnection storm brings these by the thousand: said once a
                    // while, with how many were not.
                    warn!(%cluster, app = %key, held_back, "status for a MyApp not placed on this cluster, or from a replaced session, ignored");
                }
            }
            Ok(Some(pb::AgentMessage {
                kind: Some(agent_message::Kind::Heartbeat(_)),
            })) => membership.heartbeat(&cluster),
            Ok(Some(pb::AgentMessage {
                kind: Some(agent_message::Kind::CollectionBlocked(b)),
            })) => {
                if let Some(held_back) = blocked_said.said(Instant::now()) {
                    warn!(%cluster, would_collect = b.would_collect, managed = b.managed, held_back, "the agent's circuit breaker holds back orphan collection");
                }
                dispatcher
                    .metrics
                    .collection_blocked(&cluster, b.would_collect);
                let figures = (b.would_collect, b.managed);
                if membership.collection_blocked(&cluster, figures, tokio::time::Instant::now()) {
                    host.warn(&cluster, collection_blocked(&cluster, &b)).await;
                }
            }
            Ok(Some(pb::AgentMessage {
                kind: Some(agent_message::Kind::Capacity(c)),
            })) => {
                let capacity = capacity_from_pb(&c);
                refused.note(capacity.refused);
                membership.capacity(&cluster, capacity.value);
            }
            Ok(Some(pb::AgentMessage {
                kind: Some(agent_message::Kind::TokenRenewed(mut answer)),
            })) => {
                if answer.error.len() > RENEWAL_ERROR_MAX {
                    refused.note(Some(Refusal::LongString));
                    answer
                        .error
                        .truncate(answer.error.floor_char_boundary(RENEWAL_ERROR_MAX));
                }
                // Boxed: inline, its state would widen this loop's future, which every
                // session keeps for its life, by ~2 KiB (BENCHMARKS.md, "A session's
                // receive loop").
                Box::pin(renewer.renewed(&queue, answer)).await;
            }
            Ok(Some(_)) => warn!(%cluster, "unexpected message ignored"),
            Ok(None) => break,
            Err(e) if too_large(&e) => {
                refused.note(Some(Refusal::MessageTooLarge));
                // Never waits: an agent that does not read must not hold this loop.
                let _ = ended.try_send(Err(message_too_large()));
                break;
            }
            Err(e) => {
                info!(%cluster, error = %e, "agent stream ended");
                break;
            }
        }
    }
    // Status does not hear of it: a cluster's apps turn AgentDisconnected only when its
    // MemberCluster turns NotReady (the heartbeat grace), not when a session ends.
    dispatcher.disconnect(&queue);
    info!(%cluster, "agent disconnected");
}

/// A session's repeated warning is said at most this often.
const WARN_EVERY: Duration = Duration::from_secs(30);

/// A warning said at most once per period, counting those held back in between.
struct Throttle {
    every: Duration,
    last: Option<Instant>,
    held_back: u64,
}

impl Throttle {
    fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            held_back: 0,
        }
    }

    /// Whether to say it now: `Some(held back since the last time)`, else `None`.
    fn said(&mut self, now: Instant) -> Option<u64> {
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < self.every)
        {
            self.held_back += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.held_back))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session channel's slot is two words, whatever a message holds (see [`Outbound`]).
    #[test]
    fn a_session_channel_slot_is_two_words() {
        assert_eq!(size_of::<Outbound>(), 16);
        assert!(size_of::<Result<pb::HubMessage, Status>>() > 100);
    }

    #[test]
    fn a_throttled_warning_is_said_once_a_period_with_what_it_held_back() {
        let mut t = Throttle::new(Duration::from_secs(30));
        let t0 = Instant::now();
        assert_eq!(t.said(t0), Some(0));
        assert_eq!(t.said(t0 + Duration::from_secs(1)), None);
        assert_eq!(t.said(t0 + Duration::from_secs(29)), None);
        assert_eq!(t.said(t0 + Duration::from_secs(30)), Some(2));
        assert_eq!(t.said(t0 + Duration::from_secs(31)), None);
        assert_eq!(t.said(t0 + Duration::from_secs(90)), Some(1));
    }
}
