//! Server: the tonic `Federation` service. Authenticates each stream as one member
//! cluster, feeds its queue to the agent and its reports to the status board.
//!
//! A credential is `<cluster>.<secret>`, sent as `authorization: Bearer …` over TLS; the
//! MemberCluster of that name stores the SHA-256 of the whole token, never the token.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use flotilla_crds::MemberCluster;
use flotilla_proto::v1::federation_server::Federation;
use flotilla_proto::v1::{self as pb, agent_message};
use kube::runtime::reflector::Store;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{info, warn};

use crate::dispatch::Dispatcher;
use crate::index::AppKey;
use crate::membership::{self, Membership};
use crate::status::StatusBoard;

/// Messages buffered towards one agent beyond its queue: small, since the queue itself
/// collapses superseded versions and a full buffer is how backpressure reaches it.
const STREAM_BUFFER: usize = 64;
const BATCH: usize = 64;
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

pub struct FederationService {
    pub dispatcher: Arc<Dispatcher>,
    pub status: Arc<StatusBoard>,
    pub membership: Arc<Membership>,
    pub members: Store<MemberCluster>,
    /// Opens once every FederatedMyApp has been rendered: before that, an agent's
    /// SyncComplete would list too little and it would collect MyApps that are wanted.
    pub ready: tokio::sync::watch::Receiver<bool>,
}

pub fn token_sha256(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// The cluster a bearer token belongs to, if the token is current.
pub fn authenticate(
    members: &Store<MemberCluster>,
    authorization: Option<&str>,
) -> Result<String, Status> {
    let token = authorization
        .and_then(|h| h.strip_prefix("Bearer "))
        .ok_or_else(|| {
            Status::unauthenticated("missing bearer token (authorization: Bearer <token>)")
        })?;
    let (cluster, _) = token.rsplit_once('.').ok_or_else(|| {
        Status::unauthenticated(
            "malformed token: expected <cluster>.<secret> as issued by flotilla-hub join",
        )
    })?;
    let refused = || {
        Status::unauthenticated(format!(
            "unknown or revoked credential for cluster {cluster:?}"
        ))
    };
    let member = membership::member(members, cluster).ok_or_else(refused)?;
    // Comparing digests, not secrets: timing reveals nothing usable about the token.
    match member.spec.token_sha256.as_deref() {
        Some(stored)
            if stored == token_sha256(token) && member.metadata.deletion_timestamp.is_none() =>
        {
            Ok(cluster.to_owned())
        }
        _ => Err(refused()),
    }
}

/// The cluster whose token hash the MemberCluster no longer carries, so its session must
/// end.
pub fn revoked(members: &Store<MemberCluster>, cluster: &str, token_hash: &str) -> bool {
    membership::member(members, cluster).is_none_or(|m| {
        m.spec.token_sha256.as_deref() != Some(token_hash)
            || m.metadata.deletion_timestamp.is_some()
    })
}

fn key(k: Option<pb::ObjectKey>) -> Option<AppKey> {
    k.filter(|k| !k.namespace.is_empty() && !k.name.is_empty())
        .map(|k| AppKey::new(k.namespace, k.name))
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
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let cluster = authenticate(&self.members, authorization.as_deref())?;
        let token_hash = token_sha256(
            authorization
                .as_deref()
                .unwrap_or_default()
                .trim_start_matches("Bearer "),
        );
        let mut inbound = request.into_inner();
        let hello = match tokio::time::timeout(HELLO_TIMEOUT, inbound.message()).await {
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
        let mut ready = self.ready.clone();
        if ready.wait_for(|r| *r).await.is_err() {
            return Err(Status::unavailable("the hub is shutting down"));
        }
        let managed: HashMap<AppKey, String> = hello
            .managed
            .into_iter()
            .filter_map(|m| Some((key(m.key)?, m.hash)))
            .collect();
        info!(%cluster, agent = %hello.agent_version, kubernetes = %hello.kubernetes_version, managed = managed.len(), "agent connected");
        let queue = self.dispatcher.connect(&cluster, &token_hash, &managed);
        self.membership
            .hello(&cluster, &hello.agent_version, &hello.kubernetes_version);
        self.status.touch_cluster(&cluster);

        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let (dispatcher, members) = (self.dispatcher.clone(), self.members.clone());
        let sender_queue = queue.clone();
        tokio::spawn(async move {
            let q = sender_queue;
            loop {
                let batch = tokio::select! {
                    _ = q.closed.cancelled() => {
                        let why = if revoked(&members, &q.cluster, &q.token_hash) {
                            Status::unauthenticated(format!("credential for cluster {:?} was revoked", q.cluster))
                        } else {
                            Status::aborted("replaced by a newer session of the same cluster")
                        };
                        let _ = tx.send(Err(why)).await;
                        return;
                    }
                    batch = q.next_batch(BATCH) => batch,
                };
                for message in batch {
                    dispatcher.metrics.sent(&q.cluster, &message);
                    if tx.send(Ok(message)).await.is_err() {
                        return;
                    }
                }
                dispatcher.metrics.queue_depth(&q.cluster, q.depth());
            }
        });

        let (dispatcher, status, membership) = (
            self.dispatcher.clone(),
            self.status.clone(),
            self.membership.clone(),
        );
        tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    _ = queue.closed.cancelled() => break,
                    m = inbound.message() => m,
                };
                match message {
                    Ok(Some(pb::AgentMessage {
                        kind: Some(agent_message::Kind::Status(report)),
                    })) => {
                        let Some(k) = key(report.key.clone()) else {
                            continue;
                        };
                        if dispatcher.report(&cluster, &k, report.exists) {
                            status.report(&cluster, &k, report);
                        } else {
                            warn!(%cluster, app = %k, "status for a MyApp not placed on this cluster ignored");
                        }
                    }
                    Ok(Some(pb::AgentMessage {
                        kind: Some(agent_message::Kind::Heartbeat(_)),
                    })) => membership.heartbeat(&cluster),
                    Ok(Some(_)) => warn!(%cluster, "unexpected message ignored"),
                    Ok(None) => break,
                    Err(e) => {
                        info!(%cluster, error = %e, "agent stream ended");
                        break;
                    }
                }
            }
            queue.closed.cancel();
            dispatcher.disconnect(&queue);
            status.touch_cluster(&cluster);
            info!(%cluster, "agent disconnected");
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
