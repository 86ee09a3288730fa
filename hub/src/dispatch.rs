//! Dispatch: one queue per connected agent, fed by the index.
//!
//! A queue holds at most one pending message per MyApp: a newer version of an object
//! replaces the older one in place, so a slow agent costs memory bounded by the number
//! of its objects, never by the rate of changes, and never stalls the others. The
//! session drains its queue into a bounded gRPC stream.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use flotilla_proto::v1::{self as pb, hub_message::Kind};
use indexmap::IndexMap;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::index::{AppKey, Change, Desired, Index, Push};

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Slot {
    Object(AppKey),
    SyncComplete,
}

/// The pending messages of one agent session.
pub struct ClusterQueue {
    pub cluster: String,
    /// SHA-256 of the credential the session authenticated with, to notice revocation.
    pub token_hash: String,
    id: u64,
    pending: Mutex<IndexMap<Slot, pb::HubMessage>>,
    notify: Notify,
    /// Fired when the session must end: a newer session of the same cluster, or its
    /// credential was revoked.
    pub closed: CancellationToken,
}

impl ClusterQueue {
    fn push(&self, slot: Slot, message: pb::HubMessage) {
        lock(&self.pending).insert(slot, message);
        self.notify.notify_one();
    }

    /// Waits for pending messages and takes up to `max` of them, oldest first.
    pub async fn next_batch(&self, max: usize) -> Vec<pb::HubMessage> {
        loop {
            {
                let mut pending = lock(&self.pending);
                if !pending.is_empty() {
                    let n = pending.len().min(max);
                    return pending.drain(..n).map(|(_, m)| m).collect();
                }
            }
            self.notify.notified().await;
        }
    }

    pub fn depth(&self) -> usize {
        lock(&self.pending).len()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SentLabels {
    cluster: String,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClusterLabels {
    cluster: String,
}

/// The hub's own figures, beside controller-runtime's.
#[derive(Clone, Default)]
pub struct DispatchMetrics {
    sent: Family<SentLabels, Counter>,
    depth: Family<ClusterLabels, Gauge>,
    pairs: Gauge,
}

impl DispatchMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "flotilla_hub_messages_sent",
            "Messages sent to agents, by cluster and kind (apply, delete, sync_complete)",
            self.sent.clone(),
        );
        registry.register(
            "flotilla_hub_queue_depth",
            "Messages waiting for an agent",
            self.depth.clone(),
        );
        registry.register(
            "flotilla_hub_desired_pairs",
            "(cluster, MyApp) pairs with a rendered MyApp",
            self.pairs.clone(),
        );
    }

    pub fn sent(&self, cluster: &str, message: &pb::HubMessage) {
        let kind = match message.kind {
            Some(Kind::Apply(_)) => "apply",
            Some(Kind::Delete(_)) => "delete",
            Some(Kind::SyncComplete(_)) => "sync_complete",
            None => "empty",
        };
        self.sent
            .get_or_create(&SentLabels {
                cluster: cluster.to_owned(),
                kind,
            })
            .inc();
    }

    pub fn queue_depth(&self, cluster: &str, depth: usize) {
        self.depth
            .get_or_create(&ClusterLabels {
                cluster: cluster.to_owned(),
            })
            .set(depth as i64);
    }
}

#[derive(Default)]
struct State {
    index: Index,
    sessions: HashMap<String, Arc<ClusterQueue>>,
}

/// The index and the sessions, behind one lock so that a connecting agent's initial
/// diff and the changes that follow it can neither overlap nor leave a gap.
#[derive(Default)]
pub struct Dispatcher {
    state: Mutex<State>,
    next_id: AtomicU64,
    pub metrics: DispatchMetrics,
}

impl Dispatcher {
    pub fn set_app(&self, key: &AppKey, plan: BTreeMap<String, Desired>) {
        let mut state = lock(&self.state);
        let pushes = state.index.set_app(key, plan);
        self.metrics.pairs.set(state.index.applied_pairs() as i64);
        route(&state, pushes);
    }

    /// Pushes the deletion and returns the clusters still holding the app.
    pub fn delete_app(&self, key: &AppKey, orphan: bool, placed: &[String]) -> Vec<String> {
        let mut state = lock(&self.state);
        let pushes = state.index.delete_app(key, orphan, placed);
        self.metrics.pairs.set(state.index.applied_pairs() as i64);
        route(&state, pushes);
        state.index.deletion_waiting_on(key)
    }

    pub fn forget(&self, key: &AppKey) {
        lock(&self.state).index.forget(key);
    }

    /// Registers a session after its Hello; any older session of the cluster is closed.
    /// The queue starts with what the agent lacks, then SyncComplete.
    pub fn connect(
        &self,
        cluster: &str,
        token_hash: &str,
        managed: &HashMap<AppKey, String>,
    ) -> Arc<ClusterQueue> {
        let queue = Arc::new(ClusterQueue {
            cluster: cluster.to_owned(),
            token_hash: token_hash.to_owned(),
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            pending: Mutex::default(),
            notify: Notify::new(),
            closed: CancellationToken::new(),
        });
        let mut state = lock(&self.state);
        if let Some(old) = state.sessions.insert(cluster.to_owned(), queue.clone()) {
            old.closed.cancel();
        }
        let (pushes, desired) = state.index.connect(cluster, managed);
        route(&state, pushes);
        let desired = desired.into_iter().map(key_pb).collect();
        queue.push(
            Slot::SyncComplete,
            message(Kind::SyncComplete(pb::SyncComplete { desired })),
        );
        queue
    }

    /// Ends a session, unless a newer one of the same cluster already replaced it.
    pub fn disconnect(&self, queue: &ClusterQueue) {
        let mut state = lock(&self.state);
        if state
            .sessions
            .get(&queue.cluster)
            .is_some_and(|q| q.id == queue.id)
        {
            state.sessions.remove(&queue.cluster);
            state.index.disconnect(&queue.cluster);
        }
    }

    /// Closes the cluster's session, e.g. because its credential was revoked.
    pub fn close(&self, cluster: &str) {
        if let Some(q) = lock(&self.state).sessions.get(cluster) {
            q.closed.cancel();
        }
    }

    /// The connected sessions.
    pub fn sessions(&self) -> Vec<Arc<ClusterQueue>> {
        lock(&self.state).sessions.values().cloned().collect()
    }

    /// Records an agent's report; false when the app is not this cluster's to report.
    pub fn report(&self, cluster: &str, key: &AppKey, exists: bool) -> bool {
        let mut state = lock(&self.state);
        if !state.index.is_placed(cluster, key) {
            return false;
        }
        state.index.report(cluster, key, exists);
        true
    }

    pub fn is_connected(&self, cluster: &str) -> bool {
        lock(&self.state).sessions.contains_key(cluster)
    }

    pub fn deletion_waiting_on(&self, key: &AppKey) -> Vec<String> {
        lock(&self.state).index.deletion_waiting_on(key)
    }
}

fn route(state: &State, pushes: Vec<Push>) {
    for (cluster, key, change) in pushes {
        let Some(queue) = state.sessions.get(&cluster) else {
            continue;
        };
        let kind = match change {
            Change::Apply(r) => Kind::Apply(pb::Apply {
                key: Some(key_pb(key.clone())),
                hash: r.hash.clone(),
                manifest: r.json.clone(),
            }),
            Change::Delete { orphan } => Kind::Delete(pb::Delete {
                key: Some(key_pb(key.clone())),
                orphan,
            }),
        };
        queue.push(Slot::Object(key), message(kind));
    }
}

fn message(kind: Kind) -> pb::HubMessage {
    pb::HubMessage { kind: Some(kind) }
}

pub fn key_pb(key: AppKey) -> pb::ObjectKey {
    pb::ObjectKey {
        namespace: key.namespace,
        name: key.name,
    }
}

/// A poisoned lock means a panic elsewhere mid-update; the maps are still usable and the
/// hub must keep serving the other clusters.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::RenderedMyApp;
    use bytes::Bytes;

    fn apply(hash: &str) -> Desired {
        Desired::Apply(Arc::new(RenderedMyApp {
            hash: hash.into(),
            json: Bytes::from_static(b"{}"),
        }))
    }

    fn describe(m: &pb::HubMessage) -> String {
        match m.kind.as_ref().unwrap() {
            Kind::Apply(a) => format!("apply {} {}", a.key.as_ref().unwrap().name, a.hash),
            Kind::Delete(d) => format!("delete {}", d.key.as_ref().unwrap().name),
            Kind::SyncComplete(s) => format!("sync {}", s.desired.len()),
        }
    }

    async fn drain(q: &ClusterQueue) -> Vec<String> {
        q.next_batch(100).await.iter().map(describe).collect()
    }

    #[tokio::test]
    async fn superseded_versions_collapse_in_place() {
        let d = Dispatcher::default();
        let q = d.connect("c1", "", &HashMap::new());
        assert_eq!(drain(&q).await, ["sync 0"]);
        let key = AppKey::new("ns", "a");
        for h in ["h1", "h2", "h3"] {
            d.set_app(&key, [("c1".to_owned(), apply(h))].into());
        }
        d.set_app(
            &AppKey::new("ns", "b"),
            [("c1".to_owned(), apply("hb"))].into(),
        );
        assert_eq!(q.depth(), 2);
        assert_eq!(drain(&q).await, ["apply a h3", "apply b hb"]);
    }

    #[tokio::test]
    async fn initial_diff_precedes_sync_complete_and_disconnected_clusters_queue_nothing() {
        let d = Dispatcher::default();
        d.set_app(
            &AppKey::new("ns", "a"),
            [
                ("c1".to_owned(), apply("h1")),
                ("c2".to_owned(), apply("h2")),
            ]
            .into(),
        );
        let q = d.connect("c1", "", &HashMap::new());
        assert_eq!(drain(&q).await, ["apply a h1", "sync 1"]);
        assert!(!d.is_connected("c2"));
    }

    #[tokio::test]
    async fn a_newer_session_closes_the_older_and_the_old_disconnect_is_ignored() {
        let d = Dispatcher::default();
        let old = d.connect("c1", "", &HashMap::new());
        let new = d.connect("c1", "", &HashMap::new());
        assert!(old.closed.is_cancelled());
        d.disconnect(&old);
        assert!(d.is_connected("c1"), "the newer session stays");
        d.disconnect(&new);
        assert!(!d.is_connected("c1"));
    }

    #[test]
    fn reports_for_apps_not_placed_on_the_cluster_are_refused() {
        let d = Dispatcher::default();
        d.set_app(
            &AppKey::new("ns", "a"),
            [("c1".to_owned(), apply("h"))].into(),
        );
        d.connect("c1", "", &HashMap::new());
        d.connect("c2", "", &HashMap::new());
        assert!(d.report("c1", &AppKey::new("ns", "a"), true));
        assert!(!d.report("c2", &AppKey::new("ns", "a"), true));
    }
}
