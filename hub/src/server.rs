//! Server: the tonic `Federation` service. Authenticates each stream as one member
//! cluster, admits it once the index is planned for that cluster, feeds its queue to the
//! agent and its reports to the index and the status board.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_crds::MemberCluster;
use flotilla_plan::index::AppKey;
use flotilla_proto::WireKey;
use flotilla_proto::client::MAX_MESSAGE;
use flotilla_proto::v1::federation_server::{Federation, FederationServer};
use flotilla_proto::v1::{self as pb, agent_message};
use kube::Resource;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};
use tracing::{info, warn};

use crate::auth::{self, AuthError};
use crate::convert::{capacity_from_pb, report_from_pb};
use crate::dispatch::{ClusterQueue, Dispatcher};
use crate::membership::{self, Membership};
use crate::status::StatusBoard;

/// Messages buffered towards one agent beyond its queue: small, since the queue itself
/// collapses superseded versions and a full buffer is how backpressure reaches it.
const STREAM_BUFFER: usize = 64;
const BATCH: usize = 64;
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a session waits for the index to be planned for its cluster (a MemberCluster
/// just created): past it, the agent is told to retry.
const PLANNED_TIMEOUT: Duration = Duration::from_secs(10);
/// A ping after this long without traffic; a connection that does not answer within
/// the same time is dropped, so a vanished agent frees its cluster's session.
const KEEPALIVE: Duration = Duration::from_secs(10);

pub struct FederationService {
    pub dispatcher: Arc<Dispatcher>,
    pub status: Arc<StatusBoard>,
    pub membership: Arc<Membership>,
    pub members: Store<MemberCluster>,
    /// Only the leading hub serves agents.
    pub leading: tokio::sync::watch::Receiver<bool>,
    /// Events on MemberClusters (a held-back collection).
    pub recorder: Recorder,
}

/// Binds `addr` and serves agents until `shutdown`; then ends every session at once so
/// that agents reconnect to the next hub instead of holding on to this one.
pub async fn serve(
    addr: SocketAddr,
    tls: Identity,
    service: FederationService,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the gRPC address {addr}"))?;
    info!(grpc = %addr, "serving agents");
    let dispatcher = service.dispatcher.clone();
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
    Server::builder()
        .tls_config(ServerTlsConfig::new().identity(tls))
        .context("configuring TLS")?
        .http2_keepalive_interval(Some(KEEPALIVE))
        .http2_keepalive_timeout(Some(KEEPALIVE))
        .add_service(
            FederationServer::new(service)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        )
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop)
        .await
        .with_context(|| format!("serving gRPC on {addr}"))
}

fn refused(e: AuthError) -> Status {
    Status::unauthenticated(e.to_string())
}

#[tonic::async_trait]
impl Federation for FederationService {
    type SessionStream = ReceiverStream<Result<pb::HubMessage, Status>>;

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
        let identity = auth::authenticate(&self.members, authorization).map_err(refused)?;
        let cluster = identity.cluster.clone();
        let mut inbound = request.into_inner();
        let mut hello = match tokio::time::timeout(HELLO_TIMEOUT, inbound.message()).await {
            Ok(Ok(Some(pb::AgentMessage {
                kind: Some(agent_message::Kind::Hello(h)),
            }))) => h,
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(Status::deadline_exceeded("no Hello within 10s")),
            Ok(_) => {
                return Err(Status::invalid_argument(
                    "the first message of a session must be Hello",
                ));
            }
        };
        if hello.cluster != cluster {
            return Err(Status::permission_denied(format!(
                "this credential is for cluster {cluster:?}, not {:?}",
                hello.cluster
            )));
        }
        if let Some(why) = auth::member(&self.members, &cluster)
            .and_then(|m| membership::foreign_cluster(&m, &hello.cluster_uid))
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
        let queue = self
            .dispatcher
            .connect(&identity, &managed)
            .map_err(|busy| {
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
        info!(%cluster, agent = %hello.agent_version, kubernetes = %hello.kubernetes_version, managed = managed.len(), "agent connected");
        self.membership.hello(&cluster, &hello);
        self.dispatcher.metrics.collection_blocked(&cluster, 0);

        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        tokio::spawn(send_loop(
            queue.clone(),
            self.dispatcher.clone(),
            self.members.clone(),
            tx,
        ));
        tokio::spawn(receive_loop(
            queue,
            inbound,
            self.dispatcher.clone(),
            self.status.clone(),
            self.membership.clone(),
            (self.recorder.clone(), self.members.clone()),
        ));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A Warning Event on the MemberCluster: `kubectl describe membercluster` and event
/// pipelines see the held-back collection beside the condition.
async fn collection_blocked_event(
    recorder: &Recorder,
    members: &Store<MemberCluster>,
    cluster: &str,
    blocked: &pb::CollectionBlocked,
) {
    let Some(member) = members.get(&ObjectRef::new(cluster)) else {
        return;
    };
    let event = Event {
        type_: EventType::Warning,
        reason: "CollectionBlocked".into(),
        note: Some(membership::collection_blocked_message(
            cluster,
            blocked.would_collect,
            blocked.managed,
        )),
        action: "Collect".into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, &member.object_ref(&())).await {
        warn!(%cluster, error = %e, "publishing the CollectionBlocked Event failed");
    }
}

/// Drains the session's queue into the stream until the session is closed.
async fn send_loop(
    q: Arc<ClusterQueue>,
    dispatcher: Arc<Dispatcher>,
    members: Store<MemberCluster>,
    tx: mpsc::Sender<Result<pb::HubMessage, Status>>,
) {
    loop {
        let batch = tokio::select! {
            // Closing wins over pending messages: nothing is sent on a session that was
            // closed (revoked, cluster removed, hub stopping).
            biased;
            _ = q.closed.cancelled() => {
                let why = if auth::revoked(&members, &q.identity) {
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
            dispatcher.metrics.sent(q.cluster(), &message);
            if tx.send(Ok(message)).await.is_err() {
                return;
            }
        }
        dispatcher.metrics.queue_depth(q.cluster(), q.depth());
    }
}

/// Carries the agent's reports and heartbeats until its stream ends or the session is
/// closed.
async fn receive_loop(
    queue: Arc<ClusterQueue>,
    mut inbound: Streaming<pb::AgentMessage>,
    dispatcher: Arc<Dispatcher>,
    status: Arc<StatusBoard>,
    membership: Arc<Membership>,
    (recorder, members): (Recorder, Store<MemberCluster>),
) {
    let cluster = queue.cluster().to_owned();
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
                if dispatcher.report(&queue, &key, report.held()) {
                    status.report(&cluster, &key, report);
                } else {
                    warn!(%cluster, app = %key, "status for a MyApp not placed on this cluster, or from a replaced session, ignored");
                }
            }
            Ok(Some(pb::AgentMessage {
                kind: Some(agent_message::Kind::Heartbeat(_)),
            })) => membership.heartbeat(&cluster),
            Ok(Some(pb::AgentMessage {
                kind: Some(agent_message::Kind::CollectionBlocked(b)),
            })) => {
                warn!(%cluster, would_collect = b.would_collect, managed = b.managed, "the agent's circuit breaker holds back orphan collection");
                dispatcher
                    .metrics
                    .collection_blocked(&cluster, b.would_collect);
                membership.collection_blocked(&cluster, b.would_collect, b.managed);
                collection_blocked_event(&recorder, &members, &cluster, &b).await;
            }
            Ok(Some(pb::AgentMessage {
                kind: Some(agent_message::Kind::Capacity(c)),
            })) => membership.capacity(&cluster, capacity_from_pb(&c)),
            Ok(Some(_)) => warn!(%cluster, "unexpected message ignored"),
            Ok(None) => break,
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
