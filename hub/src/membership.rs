//! Membership: the MemberCluster watch and agents' heartbeats.
//!
//! The watch keeps the MemberCluster store, ends the sessions of clusters whose
//! credential was revoked or rotated (or that were deleted), tells the status board
//! which clusters are Ready, and says when the registered clusters changed, so that apps
//! are planned again (capacity changes debounced).
//!
//! Heartbeats keep a cluster alive in the leading hub's memory; the MemberCluster status
//! is written only when what it shows changes: `Ready` turns True (a session starts) or
//! False (no heartbeat for the grace period; a disconnect alone does not flip it, and a
//! hub that just took the lead declares no cluster gone before a grace period), the
//! agent's or Kubernetes' version or the cluster's UID change, a collection is held
//! back, or the capacity moved by a quantum (at most once per capacity interval). A
//! heartbeat alone is never a write; `lastHeartbeatTime` is the latest heartbeat as of
//! the last write. A fleet of 1,000 quiet clusters costs the host no write at all.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use flotilla_common::coalesce::Pending;
use flotilla_crds::MemberCluster;
use flotilla_crds::condition;
use flotilla_crds::member::{ClusterCapacity, MemberClusterStatus};
use flotilla_plan::placement::{Members, registered_of};
use futures::{Stream, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Resource as _, ResourceExt};
use parking_lot::Mutex;
use serde_json::Value;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use self::fleet::Fleet;
use crate::auth::{self, MemberLookup as _};
use crate::convert::{HELLO_STRING_MAX as AGENT_STRING_MAX, capped};
use crate::dispatch::Dispatcher;
use crate::server;
use crate::status::StatusBoard;
use crate::writes::{self, Failure, Tracker, Write, WriteMetrics};

/// The `kind` label of this writer's metrics.
const KIND: &str = "membercluster";
/// A capacity-only change re-plans the Capacity apps at most this often.
pub const CAPACITY_REPLAN_EVERY: Duration = Duration::from_secs(10);
/// The hub writes one cluster's capacity at most this often, by default.
pub const CAPACITY_WRITE_INTERVAL: Duration = Duration::from_secs(60);
/// Writes of one cluster's status at once, then [`CLUSTER_WRITES_PER_SECOND`]: an agent
/// that reconnects in a loop, saying another version each time, made one host write per
/// reconnect (review M2; 100 reconnects in 7 s made 96). A quiet cluster writes a few
/// times an hour; what waits is written, coalesced, when the bucket refills.
const CLUSTER_WRITE_BURST: u32 = 5;
const CLUSTER_WRITES_PER_SECOND: f64 = 0.1;

/// Registered clusters (labels, cordon, readiness, capacity), leaving out those being
/// deleted, as the store holds them now ([`registered_of`]).
pub fn registered(members: &Store<MemberCluster>) -> Members {
    registered_of(members.state().iter().map(|m| &**m))
}

/// Counts of changes to the registered clusters: of anything placement reads (names,
/// labels, cordon, readiness), and of capacity only (which only `Capacity` apps read).
///
/// Capacity changes are few by construction: agents report a capacity only when it
/// moved by a quantum ([`ClusterCapacity::moved`]), the hub writes one cluster's at most
/// once per capacity interval (a minute by default), and `capacity` is bumped at most
/// once per [`CAPACITY_REPLAN_EVERY`] (the first change at once, the rest together at
/// the end of that time).
///
/// For the planner: a capacity change can affect only the apps with
/// `replicaScheduling.mode: Capacity` whose placement includes a cluster whose capacity
/// changed. Placement reads no capacity, so the placed clusters stay the same; within
/// such an app the division of all its clusters may change (each cluster's share is its
/// room against the others'). Every other app plans exactly as before.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemberChanges {
    pub clusters: u64,
    pub capacity: u64,
}

/// Why an agent that says it runs in the cluster with `kube-system` UID `uid` and
/// states the cluster ID `id` (its About API ClusterProperty; empty: none) may not speak
/// for `member`. The hub pins both, as the first agents sent them; an agent is accepted
/// when it matches either pin (and `Membership::hello` then pins what it sent): so a
/// cluster pinned by its UID that gains a ClusterProperty keeps its registration, as
/// does a cluster rebuilt under the same ClusterProperty. Once something is pinned, an
/// agent that matches neither pin, or sends neither, is refused: otherwise a copied
/// token would pass by leaving them out. The pin guards against a token copied by
/// mistake; what the agent says is no proof of where it runs.
pub fn foreign_cluster(member: &MemberCluster, uid: &str, id: &str) -> Option<String> {
    let status = member.status.as_ref()?;
    fn pinned(p: &Option<String>) -> Option<&str> {
        p.as_deref().filter(|p| !p.is_empty())
    }
    let (pinned_uid, pinned_id) = (pinned(&status.cluster_uid), pinned(&status.cluster_id));
    let bound = match (pinned_uid, pinned_id) {
        (None, None) => return None,
        (Some(u), Some(i)) => format!(
            "the cluster whose kube-system namespace has UID {u} or whose ClusterProperty cluster.clusterset.k8s.io is {i:?}"
        ),
        (Some(u), None) => format!("the cluster whose kube-system namespace has UID {u}"),
        (None, Some(i)) => {
            format!("the cluster whose ClusterProperty cluster.clusterset.k8s.io is {i:?}")
        }
    };
    let matches = |pin: Option<&str>, sent: &str| !sent.is_empty() && pin == Some(sent);
    if matches(pinned_uid, uid) || matches(pinned_id, id) {
        return None;
    }
    let bound = format!(
        "the credential of cluster {:?} is bound to {bound}",
        member.name_any()
    );
    Some(match (uid.is_empty(), id.is_empty()) {
        (true, true) => {
            format!("{bound}; this agent sent no cluster UID (can it get namespace kube-system?)")
        }
        (false, true) => format!("{bound}; this agent runs in {uid}"),
        (true, false) => format!("{bound}; this agent runs in the cluster whose ID is {id:?}"),
        (false, false) => format!("{bound}; this agent runs in {uid}, whose ID is {id:?}"),
    })
}

/// Lets a signal through at once, then at most once per `every`: what comes meanwhile
/// goes out together when that time is up.
#[derive(Debug)]
struct Debounce {
    every: Duration,
    last: Option<Instant>,
    pending: bool,
}

impl Debounce {
    fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            pending: false,
        }
    }

    /// A signal at `now`: whether it goes out now (else it is held).
    fn hit(&mut self, now: Instant) -> bool {
        if self
            .last
            .is_some_and(|at| now.duration_since(at) < self.every)
        {
            self.pending = true;
            return false;
        }
        self.fired(now);
        true
    }

    /// When the held signal is due.
    fn due(&self) -> Option<Instant> {
        self.pending.then(|| self.last.map(|at| at + self.every))?
    }

    fn fired(&mut self, now: Instant) {
        (self.last, self.pending) = (Some(now), false);
    }
}

/// Runs the MemberCluster watch (`events` drives the store): closes sessions that lost
/// their credential, carries a user's confirmation of a held-back collection to the
/// cluster's agent, tells the status board which clusters are Ready, and bumps `changed`
/// whenever the registered clusters change. A watch never ends by itself; if it does,
/// the hub must stop.
///
/// The store shows a (re-)list only at its `InitDone`, all at once: what the store holds
/// is read after an `Apply`, a `Delete` or an `InitDone`, never after an `InitApply`
/// (the first list would otherwise leave the board with no Ready cluster, and a quiet
/// fleet sends no later event to correct it).
pub async fn watch_members(
    events: impl Stream<Item = Result<watcher::Event<MemberCluster>, watcher::Error>>,
    members: Store<MemberCluster>,
    dispatcher: Arc<Dispatcher>,
    membership: Arc<Membership>,
    changed: watch::Sender<MemberChanges>,
    client: kube::Client,
) -> anyhow::Result<()> {
    let api: Api<MemberCluster> = Api::all(client);
    let (mut fleet, mut listed) = (Fleet::default(), false);
    let mut replan = Debounce::new(CAPACITY_REPLAN_EVERY);
    let mut used_at: HashMap<String, String> = HashMap::new();
    let mut events = std::pin::pin!(events);
    loop {
        let held = async {
            match replan.due() {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let event = tokio::select! {
            event = events.next() => event,
            _ = held => {
                replan.fired(Instant::now());
                changed.send_modify(|c| c.capacity += 1);
                continue;
            }
        };
        let event = match event {
            Some(Ok(event)) => event,
            Some(Err(e)) => {
                warn!(error = %e, "watching MemberClusters");
                continue;
            }
            None => break,
        };
        if let watcher::Event::Apply(member) | watcher::Event::InitApply(member) = &event
            && let Some(confirmed) = member.annotations().get(CONFIRM_COLLECTION_ANNOTATION)
        {
            let name = member.name_any();
            let version = member.resource_version().unwrap_or_default();
            // One use per version of the object: a removal that failed is no standing
            // approval for the next event.
            if used_at.get(&name) != Some(&version) {
                let decision = confirmation(confirmed, membership.blocked(&name));
                if confirm_collection(&api, &dispatcher, &name, confirmed, decision).await {
                    membership.collection_confirmed(&name);
                    used_at.insert(name, version);
                }
            }
        }
        // The one cluster the event is about; `None` after a (re-)list, which may have
        // changed any of them. The work per event is that cluster's, not the fleet's: a
        // fleet-wide change is one event per cluster.
        let (moved, named) = match &event {
            watcher::Event::Init | watcher::Event::InitApply(_) => continue,
            watcher::Event::InitDone => {
                let relisted = Fleet::of(&members);
                let mut moved = relisted.moved_since(&fleet);
                // The first list is news to the planner even when the fleet is empty.
                moved.shape |= !listed;
                (fleet, listed) = (relisted, true);
                (moved, None)
            }
            watcher::Event::Apply(member) => (fleet.apply(member), Some(member.name_any())),
            watcher::Event::Delete(member) => {
                let name = member.name_any();
                (fleet.delete(&name), Some(name))
            }
        };
        // A credential revoked or rotated, or its MemberCluster deleted, is an event of
        // that cluster's own; one that expires with time is the renewer's (its tick
        // ends such sessions, `renew.rs`).
        let sessions = match &named {
            Some(name) => dispatcher.session(name).into_iter().collect(),
            None => dispatcher.sessions(),
        };
        for session in sessions {
            if auth::revoked(&members, &session.identity()) {
                info!(cluster = %session.cluster(), "credential revoked or rotated, or MemberCluster deleted: closing its session");
                dispatcher.close(session.cluster());
            }
        }
        if let Some(status) = membership.status.as_ref().filter(|_| moved.ready) {
            match &named {
                Some(name) => status.set_ready(name, fleet.ready().contains(name)),
                None => status.set_reachable(fleet.ready().clone()),
            }
        }
        if moved.shape {
            changed.send_modify(|c| c.clusters += 1);
        } else if moved.capacity && replan.hit(Instant::now()) {
            changed.send_modify(|c| c.capacity += 1);
        }
    }
    bail!("the MemberCluster watch ended")
}

/// What a user's `flotilla.io/confirm-collection` asks, against what the cluster's agent
/// holds back.
#[derive(Debug, PartialEq, Eq)]
pub enum Confirmation {
    /// The count the agent holds back, exactly: pass it on.
    Confirm(u32),
    /// Nothing held back (yet: after a hub restart the agent says so again when it
    /// reconnects): left in place, unused.
    Wait,
    /// Not a count, or another count than the one held back: removed unused, so that it
    /// cannot confirm a later, different mass deletion.
    Refuse(String),
}

/// Reads a confirmation: only the exact count held back confirms anything.
pub fn confirmation(value: &str, blocked: Option<(u32, u32)>) -> Confirmation {
    let Ok(count) = value.trim().parse::<u32>() else {
        return Confirmation::Refuse(format!("{value:?} is not the number of MyApps to collect"));
    };
    match blocked {
        None => Confirmation::Wait,
        Some((would_collect, _)) if would_collect == count => Confirmation::Confirm(count),
        Some((would_collect, _)) => Confirmation::Refuse(format!(
            "it confirms {count}, but the agent holds back {would_collect}: confirm the number the CollectionBlocked condition shows"
        )),
    }
}

/// Carries out `decision` on the annotation holding `value`: sends the cluster's agent a
/// SyncComplete that confirms the count, then removes the annotation (only if it still
/// holds `value`: a JSON patch that tests it first), or removes a refused one. Returns
/// whether the confirmation reached the agent (it is connected).
async fn confirm_collection(
    api: &Api<MemberCluster>,
    dispatcher: &Dispatcher,
    cluster: &str,
    value: &str,
    decision: Confirmation,
) -> bool {
    let used = match decision {
        Confirmation::Wait => return false,
        Confirmation::Refuse(why) => {
            warn!(
                cluster,
                "{CONFIRM_COLLECTION_ANNOTATION} ignored and removed: {why}"
            );
            false
        }
        // Held until the agent is connected: it is the one waiting for the word.
        Confirmation::Confirm(count) if !dispatcher.resync(cluster, count) => return false,
        Confirmation::Confirm(count) => {
            info!(
                cluster,
                count, "collection confirmed by a user; the agent may collect"
            );
            true
        }
    };
    let path = format!(
        "/metadata/annotations/{}",
        CONFIRM_COLLECTION_ANNOTATION
            .replace('~', "~0")
            .replace('/', "~1")
    );
    let patch = serde_json::json!([
        {"op": "test", "path": path, "value": value},
        {"op": "remove", "path": path},
    ]);
    if let Err(e) = api
        .patch(
            cluster,
            &PatchParams::default(),
            &Patch::Json::<()>(crate::writes::json_patch(patch)),
        )
        .await
    {
        warn!(cluster, error = %e, "removing {CONFIRM_COLLECTION_ANNOTATION} failed");
    }
    used
}

/// What a held-back collection means and how to confirm it (condition and Event).
pub fn collection_blocked_message(cluster: &str, would_collect: u32, managed: u32) -> String {
    format!(
        "the agent holds back deleting {would_collect} of its {managed} managed MyApps that the hub no longer wants; \
         if that is intended, confirm with: kubectl annotate membercluster {cluster} {CONFIRM_COLLECTION_ANNOTATION}={would_collect} \
         (as someone granted the verb confirm-collection on memberclusters, e.g. by the ClusterRole flotilla-fleet-admin)"
    )
}

pub use flotilla_crds::CONFIRM_COLLECTION_ANNOTATION;

/// The host as the agent service sees it ([`server::Host`]): the hub's MemberCluster
/// store, and Events on them through the hub's recorder.
pub struct HostMembers {
    pub members: Store<MemberCluster>,
    pub recorder: Recorder,
}

impl auth::MemberLookup for HostMembers {
    fn member(&self, name: &str) -> Option<Arc<MemberCluster>> {
        self.members.member(name)
    }
}

#[tonic::async_trait]
impl server::Host for HostMembers {
    async fn warn(&self, cluster: &str, warning: server::Warning) {
        let Some(member) = self.members.member(cluster) else {
            return;
        };
        let event = Event {
            type_: EventType::Warning,
            reason: warning.reason.into(),
            note: Some(warning.note),
            action: warning.action.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &member.object_ref(&())).await {
            warn!(%cluster, error = %e, reason = warning.reason, "publishing an Event on the MemberCluster failed");
        }
    }
}

/// One cluster's CollectionBlocked Events are published at most this often.
pub const COLLECTION_BLOCKED_EVENT_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Default)]
struct Member {
    last_heartbeat: Option<(Instant, Timestamp)>,
    agent_version: Option<String>,
    kubernetes_version: Option<String>,
    /// The namespaces the agent's Hello covers (empty for all); `None` before a Hello.
    scope: Option<Vec<String>>,
    cluster_uid: Option<String>,
    /// The ID the cluster states (its About API ClusterProperty), if it states one.
    cluster_id: Option<String>,
    /// The agent's circuit breaker held back this many collections (of so many managed).
    blocked: Option<(u32, u32)>,
    /// When the last CollectionBlocked Event was published for the cluster.
    blocked_event: Option<Instant>,
    /// What the agent last reported (it sends only moves of a quantum, rate-limited).
    capacity: Option<ClusterCapacity>,
    /// When this hub last wrote the cluster's capacity.
    capacity_written: Option<Instant>,
}

pub struct Membership {
    members: Mutex<HashMap<String, Member>>,
    dirty: Pending<String>,
    grace: Duration,
    capacity_interval: Duration,
    /// Told which clusters are Ready and which agents it heard.
    status: Option<Arc<StatusBoard>>,
    metrics: WriteMetrics,
    /// Each cluster's write budget, and the clusters whose write waits for it.
    budgets: Mutex<(HashMap<String, writes::Budget>, HashSet<String>)>,
}

impl Membership {
    pub fn new(grace: Duration) -> Self {
        Self {
            members: Mutex::default(),
            dirty: Pending::default(),
            grace,
            capacity_interval: CAPACITY_WRITE_INTERVAL,
            status: None,
            metrics: WriteMetrics::default(),
            budgets: Mutex::default(),
        }
    }

    /// Whether `cluster`'s budget allows a write now; if not, it is looked at again at
    /// the writer's next round.
    fn budget_allows(&self, cluster: &str, now: Instant) -> bool {
        let mut budgets = self.budgets.lock();
        let (buckets, waiting) = &mut *budgets;
        let bucket = buckets.entry(cluster.to_owned()).or_insert_with(|| {
            writes::Budget::new(CLUSTER_WRITES_PER_SECOND, CLUSTER_WRITE_BURST, now)
        });
        let allowed = bucket.try_take(now);
        if allowed {
            waiting.remove(cluster);
        } else if waiting.insert(cluster.to_owned()) {
            debug!(
                cluster,
                "MemberCluster status write deferred: the cluster's write budget is spent"
            );
        }
        allowed
    }

    /// The clusters whose write waits for their budget.
    fn deferred(&self) -> Vec<String> {
        self.budgets.lock().1.iter().cloned().collect()
    }

    /// Tells `status` which clusters are Ready (from the watch) and whose agents this
    /// hub heard (their heartbeats).
    pub fn with_status(mut self, status: Arc<StatusBoard>) -> Self {
        self.status = Some(status);
        self
    }

    /// Writes a cluster's capacity at most once per `interval`.
    pub fn with_capacity_interval(mut self, interval: Duration) -> Self {
        self.capacity_interval = interval;
        self
    }

    pub fn with_metrics(mut self, metrics: WriteMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// A session started: looked at at once, so that a new agent shows Ready in well
    /// under a second; written only if it changes what the status shows.
    pub fn hello(&self, cluster: &str, hello: &flotilla_proto::v1::Hello) {
        let uid = Some(hello.cluster_uid.clone()).filter(|u| !u.is_empty());
        let uid = match uid {
            Some(u) if u.len() > AGENT_STRING_MAX => {
                warn!(%cluster, bytes = u.len(), "the agent's cluster UID is not a UID; not pinned");
                None
            }
            uid => uid,
        };
        // The server refused a longer one before the session began.
        let id =
            Some(hello.cluster_id.clone()).filter(|i| !i.is_empty() && i.len() <= AGENT_STRING_MAX);
        let mut members = self.members.lock();
        let m = members.entry(cluster.to_owned()).or_default();
        m.cluster_id = id;
        m.agent_version = Some(capped(hello.agent_version.clone(), AGENT_STRING_MAX));
        m.kubernetes_version = Some(capped(hello.kubernetes_version.clone(), AGENT_STRING_MAX));
        // Bounded by the server before the session began.
        m.scope = Some(hello.scope.clone());
        m.cluster_uid = uid;
        m.blocked = None;
        m.last_heartbeat = Some((Instant::now(), Timestamp::now()));
        drop(members);
        self.dirty.mark(cluster.to_owned());
    }

    /// A heartbeat keeps the cluster alive, in memory only: it is no write. The agent
    /// sends it after its reports, so the status board has heard this cluster.
    pub fn heartbeat(&self, cluster: &str) {
        let mut members = self.members.lock();
        let m = members.entry(cluster.to_owned()).or_default();
        m.last_heartbeat = Some((Instant::now(), Timestamp::now()));
        drop(members);
        if let Some(status) = &self.status {
            status.heard(cluster);
        }
    }

    /// The agent held back a collection; shown on the MemberCluster until it connects
    /// again (and collects, or is held back again).
    /// Whether to publish a CollectionBlocked Event now: at most one per cluster every
    /// [`COLLECTION_BLOCKED_EVENT_EVERY`], across its sessions (review M2: an agent
    /// repeating the message made one host write each). The condition always shows the
    /// latest figures.
    pub fn collection_blocked(
        &self,
        cluster: &str,
        (would_collect, managed): (u32, u32),
        now: Instant,
    ) -> bool {
        let mut members = self.members.lock();
        let m = members.entry(cluster.to_owned()).or_default();
        m.blocked = Some((would_collect, managed));
        let event = (m.blocked_event)
            .is_none_or(|at| now.saturating_duration_since(at) >= COLLECTION_BLOCKED_EVENT_EVERY);
        if event {
            m.blocked_event = Some(now);
        }
        drop(members);
        self.dirty.mark(cluster.to_owned());
        event
    }

    /// The cluster's room for more pods, for `replicaScheduling.mode: Capacity`: written
    /// when it moved by a quantum, at most once per capacity interval.
    pub fn capacity(&self, cluster: &str, capacity: ClusterCapacity) {
        let mut members = self.members.lock();
        let m = members.entry(cluster.to_owned()).or_default();
        if m.capacity.as_ref() == Some(&capacity) {
            return;
        }
        m.capacity = Some(capacity);
        drop(members);
        self.dirty.mark(cluster.to_owned());
    }

    /// What the cluster's agent holds back, if anything: (would collect, managed).
    pub fn blocked(&self, cluster: &str) -> Option<(u32, u32)> {
        self.members.lock().get(cluster).and_then(|m| m.blocked)
    }

    /// A user confirmed the held-back collection and the agent got the word: the
    /// condition clears (the agent says so again if the count no longer covers it).
    pub fn collection_confirmed(&self, cluster: &str) {
        if let Some(m) = self.members.lock().get_mut(cluster) {
            m.blocked = None;
        }
        self.dirty.mark(cluster.to_owned());
    }

    /// Whether a heartbeat arrived within the grace period.
    fn alive(&self, m: Option<&Member>, now: Instant) -> bool {
        m.and_then(|m| m.last_heartbeat)
            .is_some_and(|(at, _)| now.duration_since(at) <= self.grace)
    }

    /// The capacity to write now, if the one reported moved by a quantum from what the
    /// status shows and the capacity interval has passed since this hub last wrote it.
    fn capacity_due<'a>(
        &self,
        m: Option<&'a Member>,
        shown: Option<&ClusterCapacity>,
        now: Instant,
    ) -> Option<&'a ClusterCapacity> {
        let m = m?;
        let reported = m.capacity.as_ref()?;
        let moved = shown.is_none_or(|shown| ClusterCapacity::moved(shown, reported));
        let recent = m
            .capacity_written
            .is_some_and(|at| now.duration_since(at) < self.capacity_interval);
        (moved && !recent).then_some(reported)
    }

    /// The writes due now: for each cluster marked, whose readiness shown differs from
    /// the truth, or whose capacity is due, the status it should show, when that differs
    /// from what it shows. Before one grace period has passed `since` this hub began
    /// writing, an agent may still be reconnecting: no cluster is declared gone.
    fn due(
        &self,
        marked: &HashSet<String>,
        store: &Store<MemberCluster>,
        since: Instant,
        tracker: &mut Tracker<String>,
    ) -> Vec<(Write<String>, bool)> {
        let now = Instant::now();
        let settled = now.duration_since(since) > self.grace;
        let members = self.members.lock();
        let mut due = Vec::new();
        for mc in store.state() {
            let name = mc.name_any();
            let m = members.get(&name);
            let previous = mc.status.as_ref();
            let shown = previous.and_then(|s| condition::is_true(&s.conditions, "Ready"));
            let alive = self.alive(m, now);
            let judged = alive || settled;
            let ready = if judged {
                alive
            } else {
                shown.unwrap_or(false)
            };
            let capacity = self.capacity_due(m, previous.and_then(|p| p.capacity.as_ref()), now);
            let turned = judged && shown != Some(ready);
            if !marked.contains(&name) && !turned && capacity.is_none() {
                continue;
            }
            let version = mc.resource_version().unwrap_or_default();
            if !tracker.may_write(&name, &version, now) {
                continue;
            }
            let mut status = self.status(&name, m, ready, previous, mc.metadata.generation);
            status.capacity = capacity
                .or(previous.and_then(|p| p.capacity.as_ref()))
                .cloned();
            let old = to_value(previous);
            if to_value(Some(&status)) == old {
                tracker.unchanged(&name);
                self.budgets.lock().1.remove(&name);
                continue;
            }
            // Readiness turning is written at once: it moves placement (failover), and
            // an agent can turn it at most once per grace period.
            if !turned && !self.budget_allows(&name, now) {
                self.metrics.result(KIND, "deferred");
                continue;
            }
            let beat = m.and_then(|m| m.last_heartbeat).map(|(_, t)| Time(t));
            status.last_heartbeat_time = beat.or(status.last_heartbeat_time);
            let new = to_value(Some(&status));
            due.extend(
                tracker
                    .patch(&name, &old, &new, &version)
                    .map(|w| (w, capacity.is_some())),
            );
        }
        due
    }

    /// Keeps every MemberCluster's status current while this hub leads, until
    /// `shutdown`. A hub that just took the lead has heard no agent yet: it declares no
    /// cluster gone before one grace period has passed.
    pub async fn write_loop(
        &self,
        client: kube::Client,
        store: Store<MemberCluster>,
        leading: watch::Receiver<bool>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let (client, store, shutdown_ref) = (&client, &store, &shutdown);
        let work = || self.write_while_leading(client, store, Instant::now(), shutdown_ref);
        writes::while_leading(leading, &shutdown, work, || {}).await
    }

    async fn write_while_leading(
        &self,
        client: &kube::Client,
        store: &Store<MemberCluster>,
        since: Instant,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        let api: Api<MemberCluster> = Api::all(client.clone());
        let mut tracker = Tracker::default();
        let tick = (self.grace / 4).max(Duration::from_millis(250));
        loop {
            let next = tracker.next(Instant::now()).map_or(tick, |r| r.min(tick));
            let Some(marked) = self.dirty.take(Duration::ZERO, Some(next), shutdown).await else {
                return Ok(());
            };
            let mut marked: HashSet<String> = marked.into_iter().collect();
            marked.extend(tracker.due(Instant::now()));
            marked.extend(self.deferred());
            let due = self.due(&marked, store, since, &mut tracker);
            self.metrics.backlog(KIND, due.len());
            for (write, capacity) in due {
                let (name, url) = (write.key.clone(), api.resource_url());
                let answer = writes::send(client, url, &name, &write.patch).await;
                match tracker.settle(write, answer, Instant::now()) {
                    Ok(bytes) => self.written(&name, bytes, capacity),
                    Err((failure, retry_in)) => self.failed(&name, failure, retry_in),
                }
            }
        }
    }

    fn written(&self, cluster: &str, bytes: usize, capacity: bool) {
        debug!(cluster, bytes, "MemberCluster status written");
        self.metrics.written(KIND, bytes);
        if capacity && let Some(m) = self.members.lock().get_mut(cluster) {
            m.capacity_written = Some(Instant::now());
        }
    }

    fn failed(&self, cluster: &str, failure: Failure, retry_in: Option<Duration>) {
        self.metrics.result(KIND, failure.label());
        match failure {
            Failure::Gone => {}
            Failure::Conflict => debug!(
                cluster,
                ?retry_in,
                "MemberCluster status conflict; retrying"
            ),
            Failure::Transient(error) => {
                warn!(cluster, %error, ?retry_in, "writing MemberCluster status failed; retrying")
            }
            Failure::Rejected(error) => {
                warn!(cluster, %error, "the apiserver rejects this MemberCluster status; it is sent again only once it changes")
            }
        }
    }

    /// The status a cluster should show (its capacity and heartbeat time aside).
    fn status(
        &self,
        name: &str,
        m: Option<&Member>,
        ready: bool,
        previous: Option<&MemberClusterStatus>,
        generation: Option<i64>,
    ) -> MemberClusterStatus {
        let now = Time(Timestamp::now());
        let (reason, message) = if ready {
            (
                "AgentHeartbeating",
                "the cluster's agent is connected and heartbeating".to_owned(),
            )
        } else {
            (
                "AgentSilent",
                format!(
                    "no heartbeat from the cluster's agent for over {}s",
                    self.grace.as_secs()
                ),
            )
        };
        let before = previous.map_or(&[][..], |p| &p.conditions);
        let ready_condition = condition::new("Ready", ready, reason, message, generation, &now);
        if condition::is_true(before, "Ready") != Some(ready) {
            info!(cluster = name, ready, "MemberCluster readiness changed");
        }
        let blocked = match m.and_then(|m| m.blocked) {
            Some((would_collect, managed)) => condition::new(
                "CollectionBlocked",
                true,
                "CircuitBreakerOpen",
                collection_blocked_message(name, would_collect, managed),
                generation,
                &now,
            ),
            None => condition::new(
                "CollectionBlocked",
                false,
                "NothingHeld",
                "",
                generation,
                &now,
            ),
        };
        let remembered = |mine: Option<&String>, shown: Option<&String>| mine.or(shown).cloned();
        MemberClusterStatus {
            conditions: [ready_condition, blocked]
                .into_iter()
                .map(|c| condition::settle(c, before))
                .collect(),
            cluster_uid: remembered(
                m.and_then(|m| m.cluster_uid.as_ref()),
                previous.and_then(|p| p.cluster_uid.as_ref()),
            ),
            cluster_id: remembered(
                m.and_then(|m| m.cluster_id.as_ref()),
                previous.and_then(|p| p.cluster_id.as_ref()),
            ),
            last_heartbeat_time: previous.and_then(|p| p.last_heartbeat_time.clone()),
            agent_version: remembered(
                m.and_then(|m| m.agent_version.as_ref()),
                previous.and_then(|p| p.agent_version.as_ref()),
            ),
            kubernetes_version: remembered(
                m.and_then(|m| m.kubernetes_version.as_ref()),
                previous.and_then(|p| p.kubernetes_version.as_ref()),
            ),
            agent_namespaces: match m.and_then(|m| m.scope.as_ref()) {
                Some(heard) => heard.clone(),
                None => previous
                    .map(|p| p.agent_namespaces.clone())
                    .unwrap_or_default(),
            },
            capacity: None,
        }
    }
}

fn to_value(status: Option<&MemberClusterStatus>) -> Value {
    status.map_or(Value::Object(Default::default()), |s| {
        serde_json::to_value(s).expect("a status serializes")
    })
}

mod fleet;
#[cfg(test)]
mod tests;
