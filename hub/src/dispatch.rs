//! Dispatch: one queue per connected agent, fed by the index.
//!
//! A queue holds at most one pending message per MyApp: a newer version of an object
//! replaces the older one in place, so a slow agent costs memory bounded by the number
//! of its objects, never by the rate of changes, and never stalls the others. The
//! session drains its queue into a bounded gRPC stream.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use flotilla_plan::index::compact::CompactIndex;
use flotilla_plan::index::{AppKey, Change, Desired, Held, Push, Scope};
use flotilla_plan::placement::ClusterName;
use flotilla_proto::WireKey;
use flotilla_proto::v1::{self as pb, hub_message::Kind};
use indexmap::IndexMap;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::auth::Identity;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Slot {
    /// The index's shared handle of the app's key.
    Object(Arc<AppKey>),
    SyncComplete,
    RenewToken,
}

/// What waits in a slot. An object's change becomes its message only when it is sent, so
/// that a queued Apply holds the shared rendered MyApp rather than a copy of its key and
/// hash. The rare messages are boxed, so that a queued pair is a few words (the queue's
/// `a_queued_pair_is_six_words`).
enum Queued {
    Change(Change),
    /// The desired keys as the index held them then, and the collections confirmed.
    SyncComplete {
        desired: Box<[Arc<AppKey>]>,
        confirmed: u32,
    },
    RenewToken(Box<pb::RenewToken>),
}

impl Queued {
    fn into_message(self, slot: Slot) -> pb::HubMessage {
        let kind = match (self, slot) {
            (Queued::SyncComplete { desired, confirmed }, _) => {
                Kind::SyncComplete(pb::SyncComplete {
                    desired: desired.iter().map(|k| k.to_wire()).collect(),
                    confirmed_collection: confirmed,
                })
            }
            (Queued::RenewToken(renew), _) => Kind::RenewToken(*renew),
            (Queued::Change(Change::Apply(r)), Slot::Object(key)) => Kind::Apply(pb::Apply {
                key: Some(key.to_wire()),
                hash: r.hash.clone(),
                manifest: r.json.clone(),
            }),
            (Queued::Change(Change::Delete { orphan }), Slot::Object(key)) => {
                Kind::Delete(pb::Delete {
                    key: Some(key.to_wire()),
                    orphan,
                })
            }
            (Queued::Change(_), Slot::SyncComplete | Slot::RenewToken) => {
                unreachable!("a change is queued in its object's slot")
            }
        };
        pb::HubMessage { kind: Some(kind) }
    }
}

/// What waits for one session, in the order it is sent: its initial diff, then the rest.
/// Pushing to an object that waits replaces its message where it stands.
#[derive(Default)]
struct Pending {
    /// The diff the session started with, by key, sent first. A fleet connecting at once
    /// queues every pair here: a plain list of (key, change), three words each, where an
    /// entry of `queued` takes six and the map's table and growth besides
    /// (heaptrack: 93 MiB of the peak at 1,000,000 pairs).
    initial: VecDeque<(Arc<AppKey>, Change)>,
    /// Everything pushed since (and whatever of the initial diff was out of key order).
    queued: IndexMap<Slot, Queued>,
}

impl Pending {
    /// Starts a session: its own pushes that are in strictly increasing key order from the
    /// first (the index lists its diff so) become `initial`; the rest are queued after
    /// them, as though each had been pushed in turn.
    fn start(&mut self, pushes: Vec<(Arc<AppKey>, Change)>) {
        let ordered = 1
            + (pushes.windows(2))
                .take_while(|pair| pair[0].0 < pair[1].0)
                .count();
        let mut pushes = pushes.into_iter();
        self.initial = VecDeque::with_capacity(ordered);
        self.initial.extend(pushes.by_ref().take(ordered));
        for (key, change) in pushes {
            self.push(Slot::Object(key), Queued::Change(change));
        }
    }

    fn push(&mut self, slot: Slot, queued: Queued) {
        let (slot, queued) = match (slot, queued) {
            (Slot::Object(key), Queued::Change(change)) => {
                match (self.initial).binary_search_by(|(k, _)| (**k).cmp(&*key)) {
                    Ok(i) => {
                        self.initial[i].1 = change;
                        return;
                    }
                    Err(_) => (Slot::Object(key), Queued::Change(change)),
                }
            }
            other => other,
        };
        self.queued.insert(slot, queued);
    }

    fn len(&self) -> usize {
        self.initial.len() + self.queued.len()
    }

    fn is_empty(&self) -> bool {
        self.initial.is_empty() && self.queued.is_empty()
    }

    /// Takes up to `max` messages, oldest first.
    fn take(&mut self, max: usize) -> Vec<pb::HubMessage> {
        let from_initial = self.initial.len().min(max);
        let mut batch: Vec<pb::HubMessage> = (self.initial.drain(..from_initial))
            .map(|(key, change)| Queued::Change(change).into_message(Slot::Object(key)))
            .collect();
        if self.initial.is_empty() {
            // Its room is not kept for the session's life.
            self.initial = VecDeque::new();
        }
        let from_queued = self.queued.len().min(max - batch.len());
        batch.extend(
            (self.queued.drain(..from_queued)).map(|(slot, queued)| queued.into_message(slot)),
        );
        batch
    }
}

/// The pending messages of one agent session.
pub struct ClusterQueue {
    cluster: String,
    /// The hash of the token the agent holds: the one it authenticated with, then the
    /// renewed one once it acknowledged that.
    token_hash: Mutex<String>,
    /// Its Hello said it stores a renewed token.
    renews_token: AtomicBool,
    id: u64,
    since: Instant,
    pending: Mutex<Pending>,
    notify: Notify,
    /// Fired when the session must end: a newer session of the same cluster, or its
    /// credential was revoked.
    pub closed: CancellationToken,
}

impl ClusterQueue {
    fn push(&self, slot: Slot, queued: Queued) {
        if self.closed.is_cancelled() {
            return;
        }
        self.pending.lock().push(slot, queued);
        self.notify.notify_one();
    }

    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// The cluster and the token the agent holds now.
    pub fn identity(&self) -> Identity {
        Identity {
            cluster: self.cluster.clone(),
            token_hash: self.token_hash.lock().clone(),
        }
    }

    /// The agent proved it holds the token of hash `hash`.
    pub fn set_token_hash(&self, hash: &str) {
        hash.clone_into(&mut self.token_hash.lock());
    }

    pub fn renews_token(&self) -> bool {
        self.renews_token.load(Ordering::Relaxed)
    }

    pub fn set_renews_token(&self, renews: bool) {
        self.renews_token.store(renews, Ordering::Relaxed);
    }

    /// This session, as opposed to an earlier or later one of the same cluster.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Sends the agent a renewed token (replacing one not yet sent).
    pub fn renew_token(&self, renew: pb::RenewToken) {
        self.push(Slot::RenewToken, Queued::RenewToken(Box::new(renew)));
    }

    /// Waits for pending messages and takes up to `max` of them, oldest first.
    pub async fn next_batch(&self, max: usize) -> Vec<pb::HubMessage> {
        loop {
            {
                let mut pending = self.pending.lock();
                if !pending.is_empty() {
                    return pending.take(max);
                }
            }
            self.notify.notified().await;
        }
    }

    pub fn depth(&self) -> usize {
        self.pending.lock().len()
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
    blocked: Family<ClusterLabels, Gauge>,
    drift_repairs: Family<ClusterLabels, Counter>,
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
        registry.register(
            "flotilla_hub_collection_blocked",
            "Orphan collections an agent's circuit breaker holds back, awaiting confirmation",
            self.blocked.clone(),
        );
        registry.register(
            "flotilla_hub_drift_repairs",
            "MyApps changed in a member since they were applied (drift), sent again, by cluster",
            self.drift_repairs.clone(),
        );
    }

    /// One session's handles on its cluster's series, looked up once: sending a message
    /// then costs an atomic add, not a label `String` and a map lookup.
    pub fn session(&self, cluster: &str) -> SessionMetrics {
        let sent = |kind| {
            let labels = SentLabels {
                cluster: cluster.to_owned(),
                kind,
            };
            self.sent.get_or_create(&labels).clone()
        };
        let labels = ClusterLabels {
            cluster: cluster.to_owned(),
        };
        SessionMetrics {
            apply: sent("apply"),
            delete: sent("delete"),
            sync_complete: sent("sync_complete"),
            sent: self.sent.clone(),
            cluster: cluster.to_owned(),
            depth: self.depth.get_or_create(&labels).clone(),
        }
    }

    pub fn collection_blocked(&self, cluster: &str, would_collect: u32) {
        self.blocked
            .get_or_create(&ClusterLabels {
                cluster: cluster.to_owned(),
            })
            .set(i64::from(would_collect));
    }

    pub fn queue_depth(&self, cluster: &str, depth: usize) {
        self.depth
            .get_or_create(&ClusterLabels {
                cluster: cluster.to_owned(),
            })
            .set(depth as i64);
    }
}

/// A session's counters of messages sent, by kind, and its queue depth.
pub struct SessionMetrics {
    apply: Counter,
    delete: Counter,
    sync_complete: Counter,
    /// Kinds a session sends rarely, looked up (and their series made) when it does.
    sent: Family<SentLabels, Counter>,
    cluster: String,
    depth: Gauge,
}

impl SessionMetrics {
    pub fn sent(&self, message: &pb::HubMessage) {
        let counter = match message.kind {
            Some(Kind::Apply(_)) => &self.apply,
            Some(Kind::Delete(_)) => &self.delete,
            Some(Kind::SyncComplete(_)) => &self.sync_complete,
            Some(Kind::RenewToken(_)) => return self.sent_rare("renew_token"),
            None => return self.sent_rare("empty"),
        };
        counter.inc();
    }

    fn sent_rare(&self, kind: &'static str) {
        let labels = SentLabels {
            cluster: self.cluster.clone(),
            kind,
        };
        self.sent.get_or_create(&labels).inc();
    }

    pub fn queue_depth(&self, depth: usize) {
        self.depth.set(depth as i64);
    }
}

struct State {
    index: CompactIndex,
    sessions: HashMap<String, Arc<ClusterQueue>>,
}

/// A cluster already has a live session: a second agent with the same credential is
/// refused rather than allowed to take over (two agents would undo each other's work).
#[derive(Debug, thiserror::Error)]
#[error(
    "cluster {cluster:?} already has a live agent session (connected {age:?} ago); a second agent with the same identity is refused"
)]
pub struct Busy {
    pub cluster: String,
    pub age: Duration,
}

/// The index and the sessions, behind one lock so that a connecting agent's initial
/// diff and the changes that follow it can neither overlap nor leave a gap.
pub struct Dispatcher {
    state: Mutex<State>,
    next_id: AtomicU64,
    /// The registered clusters every app was last planned for: an agent is admitted only
    /// once its cluster is in it, so that its SyncComplete reflects the current
    /// membership (rule 2: nothing is planned from a store that has not listed).
    planned: watch::Sender<Arc<BTreeSet<String>>>,
    pub metrics: DispatchMetrics,
}

impl Default for Dispatcher {
    fn default() -> Self {
        Self::with_index(CompactIndex::default())
    }
}

impl Dispatcher {
    /// A dispatcher whose deletions wait `claim_wait` for a cluster that only claims the
    /// app ([`CompactIndex::with_claim_wait`]).
    pub fn with_claim_wait(claim_wait: Duration) -> Self {
        Self::with_index(CompactIndex::with_claim_wait(claim_wait))
    }

    fn with_index(index: CompactIndex) -> Self {
        Self {
            state: Mutex::new(State {
                index,
                sessions: HashMap::new(),
            }),
            next_id: AtomicU64::new(0),
            planned: watch::Sender::new(Arc::default()),
            metrics: DispatchMetrics::default(),
        }
    }

    /// Makes `plan` the app's desired state; false while the deletion of an earlier
    /// object of the same name holds it back ([`CompactIndex::set_app`]).
    pub fn set_app(
        &self,
        key: &AppKey,
        generation: Option<i64>,
        plan: BTreeMap<ClusterName, Desired>,
    ) -> bool {
        let mut state = self.state.lock();
        if state.index.is_deleting(key) {
            return false;
        }
        let pushes = state.index.set_app(key, generation, plan);
        self.metrics.pairs.set(state.index.applied_pairs() as i64);
        route(&state, pushes);
        true
    }

    /// Pushes the deletion; returns the clusters still holding the app (each named with
    /// the reason when it is its agent's scope), and those that only claimed it whose
    /// wait ended now (the deletion goes on without them).
    pub fn delete_app(
        &self,
        key: &AppKey,
        orphan: bool,
        placed: &[String],
    ) -> (Vec<String>, Vec<String>) {
        let mut state = self.state.lock();
        let pushes = state.index.delete_app(key, orphan, placed, Instant::now());
        self.metrics.pairs.set(state.index.applied_pairs() as i64);
        route(&state, pushes);
        let unheeded = unheeded_claims(&mut state.index, key);
        let waiting = (state.index.deletion_waiting_on(key).into_iter())
            .map(|cluster| match state.index.scope_excludes(&cluster, key) {
                Some(scope) => outside_scope(cluster, key, scope),
                None => cluster,
            })
            .collect();
        (waiting, unheeded)
    }

    /// The app's object left the host; `replaced`: another of the same name is listed
    /// ([`CompactIndex::drop_app`], [`CompactIndex::replace_app`]).
    pub fn drop_app(&self, key: &AppKey, orphan: bool, replaced: bool) {
        let mut state = self.state.lock();
        let now = Instant::now();
        let pushes = match replaced {
            true => state.index.replace_app(key, orphan, now),
            false => state.index.drop_app(key, orphan, now),
        };
        self.metrics.pairs.set(state.index.applied_pairs() as i64);
        route(&state, pushes);
        unheeded_claims(&mut state.index, key);
    }

    /// Every app has been planned for exactly these registered clusters: clusters that
    /// left are no longer waited for, and agents of these clusters may be admitted.
    pub fn planned_for(&self, registered: BTreeSet<String>) {
        self.state.lock().index.retain_clusters(&registered);
        self.planned.send_replace(Arc::new(registered));
    }

    /// Waits until every app has been planned with `cluster` registered; false after
    /// `timeout`.
    pub async fn wait_planned(&self, cluster: &str, timeout: Duration) -> bool {
        let mut planned = self.planned.subscribe();
        tokio::time::timeout(timeout, planned.wait_for(|p| p.contains(cluster)))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Registers a session after its Hello, unless the cluster already has one. The
    /// queue starts with what the agent lacks, then SyncComplete.
    pub fn connect(
        &self,
        identity: &Identity,
        managed: &HashMap<AppKey, String>,
        scope: Scope,
    ) -> Result<Arc<ClusterQueue>, Busy> {
        let cluster = identity.cluster.as_str();
        let mut state = self.state.lock();
        if let Some(live) = state.sessions.get(cluster) {
            return Err(Busy {
                cluster: cluster.to_owned(),
                age: live.since.elapsed(),
            });
        }
        let queue = Arc::new(ClusterQueue {
            cluster: identity.cluster.clone(),
            token_hash: Mutex::new(identity.token_hash.clone()),
            renews_token: AtomicBool::new(false),
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            since: Instant::now(),
            pending: Mutex::default(),
            notify: Notify::new(),
            closed: CancellationToken::new(),
        });
        state.sessions.insert(cluster.to_owned(), queue.clone());
        let (pushes, desired) = state.index.connect(cluster, managed, scope);
        let (own, others): (Vec<Push>, Vec<Push>) =
            pushes.into_iter().partition(|(c, _, _)| c == cluster);
        (queue.pending.lock()).start(own.into_iter().map(|(_, k, c)| (k, c)).collect());
        route(&state, others);
        queue.push(
            Slot::SyncComplete,
            Queued::SyncComplete {
                desired: desired.into(),
                confirmed: 0,
            },
        );
        Ok(queue)
    }

    /// Sends the cluster's live session a new SyncComplete confirming `confirmed`
    /// collections past the agent's circuit breaker; false without a live session.
    pub fn resync(&self, cluster: &str, confirmed: u32) -> bool {
        let state = self.state.lock();
        let Some(queue) = state.sessions.get(cluster) else {
            return false;
        };
        queue.push(
            Slot::SyncComplete,
            Queued::SyncComplete {
                desired: state.index.desired_shared(cluster).into(),
                confirmed,
            },
        );
        true
    }

    /// Ends a session (its stream ended), unless it was already closed or replaced.
    pub fn disconnect(&self, queue: &ClusterQueue) {
        let mut state = self.state.lock();
        remove_session(&mut state, queue.cluster(), Some(queue.id));
    }

    /// Closes the cluster's session at once: nothing more is routed to it.
    pub fn close(&self, cluster: &str) {
        remove_session(&mut self.state.lock(), cluster, None);
    }

    /// Closes every session (the hub is shutting down): agents reconnect elsewhere.
    pub fn close_all(&self) {
        let mut state = self.state.lock();
        let clusters: Vec<String> = state.sessions.keys().cloned().collect();
        for cluster in clusters {
            remove_session(&mut state, &cluster, None);
        }
    }

    /// The cluster's connected session.
    pub fn session(&self, cluster: &str) -> Option<Arc<ClusterQueue>> {
        self.state.lock().sessions.get(cluster).cloned()
    }

    /// The connected sessions.
    pub fn sessions(&self) -> Vec<Arc<ClusterQueue>> {
        self.state.lock().sessions.values().cloned().collect()
    }

    /// Records what a session's agent reported about an app; true when its status is
    /// for the status board: false when the session was replaced, or the app is not
    /// this cluster's to report. An app the agent only said it holds (in its Hello, never
    /// placed there by this hub) is heard by the index, so that "gone" clears the claim,
    /// but its status is not kept (review H1: a Hello could claim thousands of keys whose
    /// reports then stayed on the board for good).
    pub fn report(&self, queue: &ClusterQueue, key: &AppKey, held: Held) -> bool {
        let mut state = self.state.lock();
        let cluster = queue.cluster();
        if state.sessions.get(cluster).is_none_or(|q| q.id != queue.id)
            || !state.index.is_placed(cluster, key)
        {
            return false;
        }
        let for_status = state.index.is_assigned(cluster, key);
        let pushes = state.index.report(cluster, key, held);
        if held == Held::Drifted && !pushes.is_empty() {
            let labels = ClusterLabels {
                cluster: cluster.to_owned(),
            };
            self.metrics.drift_repairs.get_or_create(&labels).inc();
            debug!(cluster, app = %key, "the MyApp was changed in the member (drift): sending it again");
        }
        route(&state, pushes);
        for_status
    }
}

/// The clusters whose claim on `app` stopped being waited for, each logged: the
/// cluster's agent said it holds an app this hub never placed or sent there, and did not
/// confirm its Delete in time.
fn unheeded_claims(index: &mut CompactIndex, app: &AppKey) -> Vec<String> {
    let unheeded = index.take_unheeded_claims(app);
    for cluster in &unheeded {
        warn!(%app, %cluster, "the deletion goes on without a cluster that only claimed the MyApp (never placed or sent there) and did not confirm its Delete within --claim-wait");
    }
    unheeded
}

fn remove_session(state: &mut State, cluster: &str, id: Option<u64>) {
    if let Some(q) = state.sessions.get(cluster)
        && id.is_none_or(|id| q.id == id)
    {
        q.closed.cancel();
        state.sessions.remove(cluster);
        state.index.disconnect(cluster);
    }
}

/// A cluster a deletion waits for because its agent does not watch the app's namespace
/// (`--allowed-namespace`), with what it does watch: it cannot say the MyApp is gone.
fn outside_scope(cluster: String, key: &AppKey, scope: &BTreeSet<String>) -> String {
    const SHOWN: usize = 3;
    let mut watched: Vec<&str> = scope.iter().take(SHOWN).map(String::as_str).collect();
    if scope.len() > SHOWN {
        watched.push("…");
    }
    format!(
        "{cluster} (its agent watches only namespaces {}, not {})",
        watched.join(", "),
        key.namespace
    )
}

fn route(state: &State, pushes: Vec<Push>) {
    for (cluster, key, change) in pushes {
        if let Some(queue) = state.sessions.get(&cluster) {
            queue.push(Slot::Object(key), Queued::Change(change));
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use flotilla_plan::render::RenderedMyApp;

    use super::*;

    /// A pushed change is an entry of the session's `IndexMap` (its hash, slot and what
    /// waits): when a slot held a copy of the key and the rare messages were inline
    /// (96 B), 48 B now; the initial diff, which a fleet connecting at once queues for
    /// every pair, takes 24 B a pair.
    #[test]
    fn a_queued_pair_is_six_words() {
        assert_eq!(size_of::<Slot>(), 16);
        assert_eq!(size_of::<Queued>(), 24);
        assert!(size_of::<(u64, Slot, Queued)>() <= 48);
        assert_eq!(size_of::<(Arc<AppKey>, Change)>(), 24);
    }

    fn apply(hash: &str) -> Desired {
        Desired::Apply(Arc::new(RenderedMyApp {
            hash: hash.into(),
            json: Bytes::from_static(b"{}"),
        }))
    }

    fn id(cluster: &str) -> Identity {
        Identity {
            cluster: cluster.into(),
            token_hash: String::new(),
        }
    }

    fn describe(m: &pb::HubMessage) -> String {
        match m.kind.as_ref().unwrap() {
            Kind::Apply(a) => format!("apply {} {}", a.key.as_ref().unwrap().name, a.hash),
            Kind::Delete(d) => format!("delete {}", d.key.as_ref().unwrap().name),
            Kind::SyncComplete(s) => format!("sync {}", s.desired.len()),
            Kind::RenewToken(r) => format!("renew {}", r.expires_at_unix),
        }
    }

    /// A renewal waits in its own slot: a newer one replaces one not yet sent, and no
    /// object's message displaces it.
    #[tokio::test]
    async fn a_renewed_token_replaces_one_not_yet_sent() {
        let d = Dispatcher::default();
        let q = d.connect(&id("c1"), &HashMap::new(), Scope::All).unwrap();
        assert_eq!(drain(&q).await, ["sync 0"]);
        for at in [1, 2] {
            q.renew_token(pb::RenewToken {
                token: format!("c1.t{at}"),
                expires_at_unix: at,
            });
        }
        d.set_app(
            &AppKey::new("ns", "a"),
            None,
            [("c1".into(), apply("h1"))].into(),
        );
        assert_eq!(drain(&q).await, ["renew 2", "apply a h1"]);
        assert_eq!(q.identity(), id("c1"));
        q.set_token_hash("h2");
        assert_eq!(q.identity().token_hash, "h2");
    }

    async fn drain(q: &ClusterQueue) -> Vec<String> {
        q.next_batch(100).await.iter().map(describe).collect()
    }

    #[tokio::test]
    async fn superseded_versions_collapse_in_place() {
        let d = Dispatcher::default();
        let q = d.connect(&id("c1"), &HashMap::new(), Scope::All).unwrap();
        assert_eq!(drain(&q).await, ["sync 0"]);
        let key = AppKey::new("ns", "a");
        for h in ["h1", "h2", "h3"] {
            d.set_app(&key, None, [("c1".into(), apply(h))].into());
        }
        d.set_app(
            &AppKey::new("ns", "b"),
            None,
            [("c1".into(), apply("hb"))].into(),
        );
        assert_eq!(q.depth(), 2);
        assert_eq!(drain(&q).await, ["apply a h3", "apply b hb"]);
    }

    #[tokio::test]
    async fn initial_diff_precedes_sync_complete_and_disconnected_clusters_queue_nothing() {
        let d = Dispatcher::default();
        d.set_app(
            &AppKey::new("ns", "a"),
            None,
            [("c1".into(), apply("h1")), ("c2".into(), apply("h2"))].into(),
        );
        let q = d.connect(&id("c1"), &HashMap::new(), Scope::All).unwrap();
        assert_eq!(drain(&q).await, ["apply a h1", "sync 1"]);
        assert_eq!(d.sessions().len(), 1);
    }

    #[tokio::test]
    async fn a_second_live_session_is_refused_and_a_stale_disconnect_is_ignored() {
        let d = Dispatcher::default();
        let first = d.connect(&id("c1"), &HashMap::new(), Scope::All).unwrap();
        let busy = d
            .connect(&id("c1"), &HashMap::new(), Scope::All)
            .err()
            .unwrap();
        assert!(
            busy.to_string()
                .contains("already has a live agent session")
        );
        assert!(!first.closed.is_cancelled(), "the live session is kept");
        d.disconnect(&first);
        let second = d.connect(&id("c1"), &HashMap::new(), Scope::All).unwrap();
        d.disconnect(&first);
        assert_eq!(
            d.sessions().len(),
            1,
            "the old session's late disconnect is ignored"
        );
        d.close("c1");
        assert!(second.closed.is_cancelled());
        assert!(d.sessions().is_empty());
    }

    #[tokio::test]
    async fn a_closed_session_gets_nothing_more() {
        let d = Dispatcher::default();
        let q = d.connect(&id("c1"), &HashMap::new(), Scope::All).unwrap();
        assert_eq!(drain(&q).await, ["sync 0"]);
        d.close_all();
        d.set_app(
            &AppKey::new("ns", "a"),
            None,
            [("c1".into(), apply("h"))].into(),
        );
        assert_eq!(q.depth(), 0);
    }

    #[test]
    fn reports_for_apps_not_placed_on_the_cluster_or_from_replaced_sessions_are_refused() {
        let d = Dispatcher::default();
        let a = AppKey::new("ns", "a");
        d.set_app(&a, None, [("c1".into(), apply("h"))].into());
        let q1 = d.connect(&id("c1"), &HashMap::new(), Scope::All).unwrap();
        let q2 = d.connect(&id("c2"), &HashMap::new(), Scope::All).unwrap();
        assert!(d.report(&q1, &a, Held::Present));
        assert!(!d.report(&q2, &a, Held::Present));
        d.disconnect(&q1);
        let q1b = d.connect(&id("c1"), &HashMap::new(), Scope::All).unwrap();
        assert!(
            !d.report(&q1, &a, Held::Absent),
            "a replaced session's late report"
        );
        assert!(d.report(&q1b, &a, Held::Present));
    }

    /// A SyncComplete is the index's desired keys when it was queued, in order, built
    /// into wire keys only when sent; a resync carries the confirmed collections.
    #[tokio::test]
    async fn a_sync_complete_lists_the_desired_keys_as_they_were_when_queued() {
        let d = Dispatcher::default();
        for name in ["b", "a"] {
            let desired = [("c1".into(), apply("h"))].into();
            d.set_app(&AppKey::new("ns", name), None, desired);
        }
        let sync = |m: &pb::HubMessage| match m.kind.as_ref() {
            Some(Kind::SyncComplete(s)) => Some(s.clone()),
            _ => None,
        };
        let q = d.connect(&id("c1"), &HashMap::new(), Scope::All).unwrap();
        d.set_app(
            &AppKey::new("ns", "c"),
            None,
            [("c1".into(), apply("h"))].into(),
        );
        let sent: Vec<pb::SyncComplete> = q.next_batch(100).await.iter().filter_map(sync).collect();
        let names = |s: &pb::SyncComplete| -> Vec<String> {
            s.desired
                .iter()
                .map(|k| format!("{}/{}", k.namespace, k.name))
                .collect()
        };
        assert_eq!(sent.len(), 1);
        assert_eq!(
            names(&sent[0]),
            ["ns/a", "ns/b"],
            "the keys when it was queued"
        );
        assert_eq!(sent[0].confirmed_collection, 0);
        assert!(d.resync("c1", 3));
        let sent: Vec<pb::SyncComplete> = q.next_batch(100).await.iter().filter_map(sync).collect();
        assert_eq!(names(&sent[0]), ["ns/a", "ns/b", "ns/c"]);
        assert_eq!(sent[0].confirmed_collection, 3);
    }

    /// Review H1: keys a Hello only claims never reach the status board.
    #[test]
    fn reports_for_keys_a_hello_only_claimed_are_not_for_status() {
        let d = Dispatcher::default();
        let claimed: HashMap<AppKey, String> = (0..100_000)
            .map(|i| (AppKey::new("other", format!("app{i}")), "h".to_owned()))
            .collect();
        let q = d.connect(&id("c1"), &claimed, Scope::All).unwrap();
        let one = AppKey::new("other", "app7");
        assert!(!d.report(&q, &one, Held::Present));
        // Its "gone" still clears the claim: a deletion no longer waits for it.
        assert!(!d.report(&q, &one, Held::Absent));
        let (waiting, _) = d.delete_app(&one, false, &[]);
        assert!(waiting.is_empty(), "{waiting:?}");
    }

    /// A deletion waiting for an agent that cannot see the namespace says so.
    #[test]
    fn a_deletion_names_the_scope_that_keeps_a_cluster_from_confirming() {
        let d = Dispatcher::default();
        d.planned_for(["c1".to_owned()].into());
        let key = AppKey::new("shop", "web");
        d.set_app(&key, None, BTreeMap::from([("c1".into(), Desired::Keep)]));
        let scope = Scope::of(["a", "b", "c", "d"].map(String::from));
        let _q = d.connect(&id("c1"), &HashMap::new(), scope).unwrap();
        let (waiting, _) = d.delete_app(&key, false, &[]);
        assert_eq!(
            waiting,
            ["c1 (its agent watches only namespaces a, b, c, …, not shop)"]
        );
    }

    #[tokio::test]
    async fn agents_wait_until_their_cluster_is_planned() {
        let d = Arc::new(Dispatcher::default());
        assert!(!d.wait_planned("c1", Duration::from_millis(20)).await);
        let waiter = {
            let d = d.clone();
            tokio::spawn(async move { d.wait_planned("c1", Duration::from_secs(5)).await })
        };
        d.planned_for(["c1".to_owned()].into());
        assert!(waiter.await.unwrap());
    }
}

/// The session's queue against the one it replaced, a single `IndexMap` into which the
/// initial diff was pushed in turn: the same messages in the same order, after any
/// start and any interleaving of pushes and takes.
#[cfg(test)]
mod pending_model {
    use bytes::Bytes;
    use flotilla_plan::render::RenderedMyApp;
    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        Push(u8, Option<u8>),
        Sync(u32),
        Renew(i64),
        Take(usize),
    }

    fn key(k: u8) -> Arc<AppKey> {
        Arc::new(AppKey::new(
            ["a", "b"][usize::from(k % 2)],
            format!("app{}", k / 2),
        ))
    }

    /// `None`: a Delete; the hash, an Apply.
    fn change(hash: Option<u8>) -> Change {
        match hash {
            Some(h) => Change::Apply(Arc::new(RenderedMyApp {
                hash: format!("h{h}"),
                json: Bytes::new(),
            })),
            None => Change::Delete { orphan: false },
        }
    }

    fn message(op: &Op) -> Option<(Slot, Queued)> {
        Some(match *op {
            Op::Push(k, hash) => (Slot::Object(key(k)), Queued::Change(change(hash))),
            Op::Sync(confirmed) => (
                Slot::SyncComplete,
                Queued::SyncComplete {
                    desired: Box::new([key(0)]),
                    confirmed,
                },
            ),
            Op::Renew(at) => (
                Slot::RenewToken,
                Queued::RenewToken(Box::new(pb::RenewToken {
                    token: String::new(),
                    expires_at_unix: at,
                })),
            ),
            Op::Take(_) => return None,
        })
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..12u8, proptest::option::of(0..3u8)).prop_map(|(k, h)| Op::Push(k, h)),
            1 => (0..3u32).prop_map(Op::Sync),
            1 => (0..3i64).prop_map(Op::Renew),
            2 => (1..5usize).prop_map(Op::Take),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn the_initial_list_sends_what_one_map_would(
            // Mostly in key order, as the index lists it; sometimes not, or repeated.
            mut initial in proptest::collection::vec((0..12u8, proptest::option::of(0..3u8)), 0..10),
            sort in any::<bool>(),
            ops in proptest::collection::vec(op(), 0..40),
        ) {
            if sort {
                initial.sort_by_key(|&(k, _)| key(k));
                initial.dedup_by_key(|&mut (k, _)| k);
            }
            let mut queue = Pending::default();
            let mut oracle: IndexMap<Slot, Queued> = IndexMap::new();
            queue.start(initial.iter().map(|&(k, h)| (key(k), change(h))).collect());
            for &(k, h) in &initial {
                oracle.insert(Slot::Object(key(k)), Queued::Change(change(h)));
            }
            for op in ops.iter().chain([&Op::Take(usize::MAX)]) {
                match (op, message(op)) {
                    (Op::Take(max), _) => {
                        let n = oracle.len().min(*max);
                        let expected: Vec<pb::HubMessage> =
                            oracle.drain(..n).map(|(slot, q)| q.into_message(slot)).collect();
                        prop_assert_eq!(queue.take(*max), expected);
                    }
                    (_, Some((slot, queued))) => {
                        queue.push(slot, queued);
                        let (slot, queued) = message(op).unwrap();
                        oracle.insert(slot, queued);
                    }
                    (_, None) => unreachable!(),
                }
                prop_assert_eq!(queue.len(), oracle.len());
            }
            prop_assert!(queue.is_empty());
            prop_assert_eq!(queue.initial.capacity(), 0, "its room is freed once sent");
        }
    }
}

#[cfg(test)]
mod session_metrics {
    use super::*;
    use prometheus_client::encoding::text::encode;

    #[test]
    fn a_sessions_handles_count_into_its_clusters_series() {
        let metrics = DispatchMetrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let session = metrics.session("c1");
        let message = |kind| pb::HubMessage { kind };
        let sync = Kind::SyncComplete(pb::SyncComplete::default());
        session.sent(&message(Some(Kind::Delete(pb::Delete::default()))));
        session.sent(&message(Some(sync.clone())));
        session.sent(&message(Some(sync)));
        session.sent(&message(Some(Kind::RenewToken(pb::RenewToken::default()))));
        session.queue_depth(7);
        // A second session of the cluster counts on in the same series.
        metrics.session("c1").sent(&message(None));
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        for line in [
            r#"flotilla_hub_messages_sent_total{cluster="c1",kind="apply"} 0"#,
            r#"flotilla_hub_messages_sent_total{cluster="c1",kind="delete"} 1"#,
            r#"flotilla_hub_messages_sent_total{cluster="c1",kind="sync_complete"} 2"#,
            r#"flotilla_hub_messages_sent_total{cluster="c1",kind="renew_token"} 1"#,
            r#"flotilla_hub_messages_sent_total{cluster="c1",kind="empty"} 1"#,
            r#"flotilla_hub_queue_depth{cluster="c1"} 7"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }
}
