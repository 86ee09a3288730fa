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
use flotilla_plan::planner::{capacity, shape};
use futures::{Stream, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use parking_lot::Mutex;
use serde_json::Value;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::auth;
use crate::convert::{HELLO_STRING_MAX as AGENT_STRING_MAX, capped};
use crate::dispatch::Dispatcher;
use crate::status::StatusBoard;
use crate::writes::{self, Failure, Tracker, Write, WriteMetrics};

/// The `kind` label of this writer's metrics.
const KIND: &str = "membercluster";
/// A capacity-only change re-plans the Capacity apps at most this often.
pub const CAPACITY_REPLAN_EVERY: Duration = Duration::from_secs(10);
/// The hub writes one cluster's capacity at most this often, by default.
pub const CAPACITY_WRITE_INTERVAL: Duration = Duration::from_secs(60);

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

/// Why an agent in the physical cluster `uid` may not speak for `member`: the
/// credential was first used from another cluster (its pinned `kube-system` UID). Once
/// pinned, an agent that sends no UID is refused too: otherwise a copied token would
/// pass by leaving it out. The pin guards against a token copied by mistake; the UID is
/// what the agent says, so it is no proof of where the agent runs.
pub fn foreign_cluster(member: &MemberCluster, uid: &str) -> Option<String> {
    let pinned = member.status.as_ref()?.cluster_uid.as_deref()?;
    let bound = format!(
        "the credential of cluster {:?} is bound to the cluster whose kube-system namespace has UID {pinned}",
        member.name_any()
    );
    if uid.is_empty() {
        Some(format!(
            "{bound}; this agent sent no cluster UID (can it get namespace kube-system?)"
        ))
    } else {
        (pinned != uid).then(|| format!("{bound}; this agent runs in {uid}"))
    }
}

/// The clusters whose MemberCluster shows `Ready=True` now.
fn ready_clusters(members: &Store<MemberCluster>) -> HashSet<String> {
    let ready = members.state().into_iter().filter(|m| {
        let conditions = m.status.as_ref().map_or(&[][..], |s| &s.conditions);
        condition::is_true(conditions, "Ready") == Some(true)
    });
    ready.map(|m| m.name_any()).collect()
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
    let (mut last_shape, mut last_capacity) = (None, None);
    let mut replan = Debounce::new(CAPACITY_REPLAN_EVERY);
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
            if confirm_collection(&api, &dispatcher, &name, confirmed).await {
                membership.collection_confirmed(&name);
            }
        }
        if matches!(event, watcher::Event::Init | watcher::Event::InitApply(_)) {
            continue;
        }
        for session in dispatcher.sessions() {
            if auth::revoked(&members, &session.identity()) {
                info!(cluster = %session.cluster(), "credential revoked or rotated, or MemberCluster deleted: closing its session");
                dispatcher.close(session.cluster());
            }
        }
        if let Some(status) = &membership.status {
            status.set_reachable(ready_clusters(&members));
        }
        let now = registered(&members);
        let (shape, capacity) = (shape(&now), capacity(&now));
        if last_shape.as_ref() != Some(&shape) {
            changed.send_modify(|c| c.clusters += 1);
        } else if last_capacity.as_ref() != Some(&capacity) && replan.hit(Instant::now()) {
            changed.send_modify(|c| c.capacity += 1);
        }
        (last_shape, last_capacity) = (Some(shape), Some(capacity));
    }
    bail!("the MemberCluster watch ended")
}

/// Sends the cluster's agent a SyncComplete that confirms `confirmed` collections, then
/// removes the annotation so that it cannot confirm a later, different mass deletion.
/// Returns whether the confirmation reached the agent (it is connected).
async fn confirm_collection(
    api: &Api<MemberCluster>,
    dispatcher: &Dispatcher,
    cluster: &str,
    confirmed: &str,
) -> bool {
    let Ok(count) = confirmed.parse::<u32>() else {
        warn!(
            cluster,
            value = confirmed,
            "{CONFIRM_COLLECTION_ANNOTATION} must be the number of MyApps to collect; ignored"
        );
        return false;
    };
    if !dispatcher.resync(cluster, count) {
        // Held until the agent is connected: it is the one waiting for the word.
        return false;
    }
    info!(
        cluster,
        count, "collection confirmed by a user; the agent may collect"
    );
    let patch =
        serde_json::json!({"metadata": {"annotations": {CONFIRM_COLLECTION_ANNOTATION: null}}});
    if let Err(e) = api
        .patch(cluster, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        warn!(cluster, error = %e, "removing {CONFIRM_COLLECTION_ANNOTATION} failed");
    }
    true
}

/// What a held-back collection means and how to confirm it (condition and Event).
pub fn collection_blocked_message(cluster: &str, would_collect: u32, managed: u32) -> String {
    format!(
        "the agent holds back deleting {would_collect} of its {managed} managed MyApps that the hub no longer wants; \
         if that is intended, confirm with: kubectl annotate membercluster {cluster} {CONFIRM_COLLECTION_ANNOTATION}={would_collect}"
    )
}

pub use flotilla_crds::CONFIRM_COLLECTION_ANNOTATION;

#[derive(Debug, Clone, Default)]
struct Member {
    last_heartbeat: Option<(Instant, Timestamp)>,
    agent_version: Option<String>,
    kubernetes_version: Option<String>,
    cluster_uid: Option<String>,
    /// The agent's circuit breaker held back this many collections (of so many managed).
    blocked: Option<(u32, u32)>,
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
        }
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
        let mut members = self.members.lock();
        let m = members.entry(cluster.to_owned()).or_default();
        m.agent_version = Some(capped(hello.agent_version.clone(), AGENT_STRING_MAX));
        m.kubernetes_version = Some(capped(hello.kubernetes_version.clone(), AGENT_STRING_MAX));
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
    pub fn collection_blocked(&self, cluster: &str, would_collect: u32, managed: u32) {
        self.members
            .lock()
            .entry(cluster.to_owned())
            .or_default()
            .blocked = Some((would_collect, managed));
        self.dirty.mark(cluster.to_owned());
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
            last_heartbeat_time: previous.and_then(|p| p.last_heartbeat_time.clone()),
            agent_version: remembered(
                m.and_then(|m| m.agent_version.as_ref()),
                previous.and_then(|p| p.agent_version.as_ref()),
            ),
            kubernetes_version: remembered(
                m.and_then(|m| m.kubernetes_version.as_ref()),
                previous.and_then(|p| p.kubernetes_version.as_ref()),
            ),
            capacity: None,
        }
    }
}

fn to_value(status: Option<&MemberClusterStatus>) -> Value {
    status.map_or(Value::Object(Default::default()), |s| {
        serde_json::to_value(s).expect("a status serializes")
    })
}

#[cfg(test)]
mod tests;
