//! Membership: the MemberCluster watch and agents' heartbeats.
//!
//! The watch keeps the MemberCluster store, ends the sessions of clusters whose
//! credential was revoked or rotated (or that were deleted), and says when the set of
//! registered clusters changed, so that every app is planned again. Heartbeats become
//! `MemberCluster.status` (`Ready`, last heartbeat, versions): a cluster is Ready while
//! heartbeats arrive within the grace period; a disconnect alone does not flip it, since
//! a restarting hub or agent reconnects within seconds.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use flotilla_common::coalesce::Pending;
use flotilla_crds::MemberCluster;
use flotilla_crds::condition;
use flotilla_crds::member::{ClusterCapacity, MemberClusterStatus};
use flotilla_plan::placement::{self, Members, registered_of};
use futures::{Stream, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::Store;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::auth;
use crate::dispatch::Dispatcher;
use crate::status::status_patch;

/// Registered clusters (labels, cordon, readiness, capacity), leaving out those being
/// deleted, as the store holds them now ([`registered_of`]).
pub fn registered(members: &Store<MemberCluster>) -> Members {
    registered_of(members.state().iter().map(|m| &**m))
}

/// Counts of changes to the registered clusters: of anything placement reads (names,
/// labels, cordon, readiness), and of capacity only (which only `Capacity` apps read).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemberChanges {
    pub clusters: u64,
    pub capacity: u64,
}

/// What placement and scheduling read of each cluster besides its capacity. Readiness
/// counts as ready or not: how long a cluster has been NotReady moves with the clock,
/// and each plan asks to be looked at again when a grace period ends.
fn shape(members: &Members) -> Vec<(String, placement::Labels, bool, bool)> {
    members
        .iter()
        .map(|(name, m)| {
            let not_ready = m.not_ready_for.is_some();
            (name.clone(), m.labels.clone(), m.unschedulable, not_ready)
        })
        .collect()
}

fn capacity(members: &Members) -> Vec<Option<ClusterCapacity>> {
    members.values().map(|m| m.capacity.clone()).collect()
}

/// Why an agent in the physical cluster `uid` may not speak for `member`: the
/// credential was first used from another cluster (its pinned `kube-system` UID).
pub fn foreign_cluster(member: &MemberCluster, uid: &str) -> Option<String> {
    let pinned = member.status.as_ref()?.cluster_uid.as_deref()?;
    (!uid.is_empty() && pinned != uid).then(|| {
        format!(
            "the credential of cluster {:?} is bound to the cluster whose kube-system namespace has UID {pinned}; this agent runs in {uid}",
            member.name_any()
        )
    })
}

/// Runs the MemberCluster watch (`events` drives the store): closes sessions that lost
/// their credential, carries a user's confirmation of a held-back collection to the
/// cluster's agent, and bumps `changed` whenever the registered clusters change. A watch
/// never ends by itself; if it does, the hub must stop.
pub async fn watch_members(
    events: impl Stream<Item = Result<MemberCluster, kube::runtime::watcher::Error>>,
    members: Store<MemberCluster>,
    dispatcher: Arc<Dispatcher>,
    membership: Arc<Membership>,
    changed: watch::Sender<MemberChanges>,
    client: kube::Client,
) -> anyhow::Result<()> {
    let api: Api<MemberCluster> = Api::all(client);
    let (mut last_shape, mut last_capacity) = (None, None);
    let mut events = std::pin::pin!(events);
    while let Some(event) = events.next().await {
        let member = match event {
            Ok(member) => member,
            Err(e) => {
                warn!(error = %e, "watching MemberClusters");
                continue;
            }
        };
        for session in dispatcher.sessions() {
            if auth::revoked(&members, &session.identity) {
                info!(cluster = %session.cluster(), "credential revoked or rotated, or MemberCluster deleted: closing its session");
                dispatcher.close(session.cluster());
            }
        }
        if let Some(confirmed) = member.annotations().get(CONFIRM_COLLECTION_ANNOTATION) {
            let name = member.name_any();
            if confirm_collection(&api, &dispatcher, &name, confirmed).await {
                membership.collection_confirmed(&name);
            }
        }
        let now = registered(&members);
        let (shape, capacity) = (shape(&now), capacity(&now));
        if last_shape.as_ref() != Some(&shape) {
            changed.send_modify(|c| c.clusters += 1);
        } else if last_capacity.as_ref() != Some(&capacity) {
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

/// A user's go-ahead for a collection the agent's circuit breaker held back.
pub const CONFIRM_COLLECTION_ANNOTATION: &str = "flotilla.io/confirm-collection";

#[derive(Debug, Clone, Default)]
struct Member {
    last_heartbeat: Option<(Instant, Timestamp)>,
    /// When a status with this cluster's heartbeat time was last made to be written.
    heartbeat_written: Option<Instant>,
    agent_version: Option<String>,
    kubernetes_version: Option<String>,
    cluster_uid: Option<String>,
    /// The agent's circuit breaker held back this many collections (of so many managed).
    blocked: Option<(u32, u32)>,
    /// What the agent last reported (it sends only changes, rate-limited).
    capacity: Option<ClusterCapacity>,
}

pub struct Membership {
    members: Mutex<HashMap<String, Member>>,
    dirty: Pending<String>,
    grace: Duration,
}

impl Membership {
    pub fn new(grace: Duration) -> Self {
        Self {
            members: Mutex::default(),
            dirty: Pending::default(),
            grace,
        }
    }

    /// A session started: written at once, so that a new agent shows Ready in well under
    /// a second.
    pub fn hello(&self, cluster: &str, hello: &flotilla_proto::v1::Hello) {
        let mut members = self.members.lock();
        let m = members.entry(cluster.to_owned()).or_default();
        m.agent_version = Some(hello.agent_version.clone());
        m.kubernetes_version = Some(hello.kubernetes_version.clone());
        m.cluster_uid = Some(hello.cluster_uid.clone()).filter(|u| !u.is_empty());
        m.blocked = None;
        m.last_heartbeat = Some((Instant::now(), Timestamp::now()));
        drop(members);
        self.dirty.mark(cluster.to_owned());
    }

    /// A heartbeat keeps the cluster Ready; its time is written only when the time
    /// shown is a grace period old, so that a quiet fleet costs the host one write per
    /// cluster per grace period rather than one per heartbeat.
    pub fn heartbeat(&self, cluster: &str) {
        let now = Instant::now();
        let mut members = self.members.lock();
        let m = members.entry(cluster.to_owned()).or_default();
        m.last_heartbeat = Some((now, Timestamp::now()));
        let stale = m
            .heartbeat_written
            .is_none_or(|at| now.duration_since(at) >= self.grace);
        drop(members);
        if stale {
            self.dirty.mark(cluster.to_owned());
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

    /// The cluster's room for more pods, for `replicaScheduling.mode: Capacity`.
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

    /// The statuses to write now: clusters that heartbeated, and those whose readiness
    /// shown differs from the truth. Before one grace period has passed `since` this hub
    /// began writing, an agent may still be reconnecting: no cluster is declared gone.
    fn due(
        &self,
        dirty: &[String],
        store: &Store<MemberCluster>,
        since: Instant,
    ) -> Vec<(String, MemberClusterStatus)> {
        let now = Instant::now();
        let settled = now.duration_since(since) > self.grace;
        let mut members = self.members.lock();
        store
            .state()
            .iter()
            .filter_map(|mc| {
                let name = mc.name_any();
                let m = members.get(&name);
                let alive = self.alive(m, now);
                let previous = mc.status.as_ref();
                let shown = previous.and_then(|s| condition::is_true(&s.conditions, "Ready"));
                let due = dirty.contains(&name) || (shown != Some(alive) && (alive || settled));
                if !due {
                    return None;
                }
                let status = self.status(&name, m, alive, previous, mc.metadata.generation);
                if let Some(m) = members.get_mut(&name) {
                    m.heartbeat_written = Some(now);
                }
                Some((name, status))
            })
            .collect()
    }

    /// Keeps every MemberCluster's status current while this hub leads, until
    /// `shutdown`. A hub that just took the lead has heard no agent yet: it declares no
    /// cluster gone before one grace period has passed.
    pub async fn write_loop(
        &self,
        client: kube::Client,
        store: Store<MemberCluster>,
        mut leading: watch::Receiver<bool>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let api: Api<MemberCluster> = Api::all(client);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                led = leading.wait_for(|l| *l) => { led?; }
            }
            let since = Instant::now();
            let lost = async {
                let _ = leading.wait_for(|l| !*l).await;
            };
            tokio::select! {
                _ = lost => continue,
                r = self.write_while_leading(&api, &store, since, &shutdown) => return r,
            }
        }
    }

    async fn write_while_leading(
        &self,
        api: &Api<MemberCluster>,
        store: &Store<MemberCluster>,
        since: Instant,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        let tick = (self.grace / 4).max(Duration::from_millis(250));
        while let Some(dirty) = self.dirty.take(Duration::ZERO, Some(tick), shutdown).await {
            for (name, status) in self.due(&dirty, store, since) {
                let patch = Patch::Merge(status_patch(&status, &["conditions"]));
                match api
                    .patch_status(&name, &PatchParams::default(), &patch)
                    .await
                {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => {
                        warn!(cluster = %name, error = %e, "writing MemberCluster status failed; retrying");
                        self.dirty.mark(name);
                    }
                }
            }
        }
        Ok(())
    }

    fn status(
        &self,
        name: &str,
        m: Option<&Member>,
        alive: bool,
        previous: Option<&MemberClusterStatus>,
        generation: Option<i64>,
    ) -> MemberClusterStatus {
        let now = Time(Timestamp::now());
        let (reason, message) = if alive {
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
        let ready = condition::new("Ready", alive, reason, message, generation, &now);
        if condition::is_true(before, "Ready") != Some(alive) {
            info!(
                cluster = name,
                ready = alive,
                "MemberCluster readiness changed"
            );
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
        MemberClusterStatus {
            conditions: [ready, blocked]
                .into_iter()
                .map(|c| condition::settle(c, before))
                .collect(),
            cluster_uid: m
                .and_then(|m| m.cluster_uid.clone())
                .or_else(|| previous.and_then(|p| p.cluster_uid.clone())),
            last_heartbeat_time: m
                .and_then(|m| m.last_heartbeat)
                .map(|(_, t)| Time(t))
                .or_else(|| previous.and_then(|p| p.last_heartbeat_time.clone())),
            agent_version: m
                .and_then(|m| m.agent_version.clone())
                .or_else(|| previous.and_then(|p| p.agent_version.clone())),
            kubernetes_version: m
                .and_then(|m| m.kubernetes_version.clone())
                .or_else(|| previous.and_then(|p| p.kubernetes_version.clone())),
            capacity: m
                .and_then(|m| m.capacity.clone())
                .or_else(|| previous.and_then(|p| p.capacity.clone())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::{reflector, watcher};

    fn store(names: &[(&str, Option<bool>)]) -> Store<MemberCluster> {
        let (store, mut writer) = reflector::store::<MemberCluster>();
        writer.apply_watcher_event(&watcher::Event::Init);
        for (name, ready) in names {
            let mut m = MemberCluster::new(name, Default::default());
            if let Some(ready) = ready {
                let now = Time(Timestamp::now());
                m.status = Some(MemberClusterStatus {
                    conditions: vec![condition::new("Ready", *ready, "X", "", None, &now)],
                    ..Default::default()
                });
            }
            writer.apply_watcher_event(&watcher::Event::InitApply(m));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        store
    }

    #[test]
    fn a_heartbeat_makes_a_cluster_ready_and_due() {
        let m = Membership::new(Duration::from_secs(40));
        m.hello(
            "c1",
            &flotilla_proto::v1::Hello {
                agent_version: "0.1.0".into(),
                kubernetes_version: "v1.34.4".into(),
                cluster_uid: "uid-1".into(),
                ..Default::default()
            },
        );
        let due = m.due(
            &["c1".into()],
            &store(&[("c1", None), ("c2", None)]),
            Instant::now(),
        );
        assert_eq!(
            due.len(),
            1,
            "c2 is not declared gone within the first grace period"
        );
        let (name, status) = &due[0];
        assert_eq!(name, "c1");
        assert_eq!(condition::is_true(&status.conditions, "Ready"), Some(true));
        assert_eq!(status.agent_version.as_deref(), Some("0.1.0"));
        assert_eq!(
            status.cluster_uid.as_deref(),
            Some("uid-1"),
            "the physical cluster is pinned"
        );
        assert_eq!(
            condition::is_true(&status.conditions, "CollectionBlocked"),
            Some(false)
        );
        assert!(status.last_heartbeat_time.is_some());
    }

    #[test]
    fn silence_past_the_grace_period_turns_a_cluster_not_ready() {
        let m = Membership::new(Duration::ZERO);
        let since = Instant::now();
        std::thread::sleep(Duration::from_millis(5));
        let due = m.due(
            &[],
            &store(&[("c1", Some(true)), ("c2", Some(false))]),
            since,
        );
        assert_eq!(due.len(), 1, "c2 already shows NotReady: nothing to write");
        assert_eq!(due[0].0, "c1");
        let ready = &due[0].1.conditions[0];
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "AgentSilent")
        );
    }

    /// The clusters marked for a status write by now.
    async fn marked(m: &Membership) -> Vec<String> {
        let stop = CancellationToken::new();
        m.dirty
            .take(Duration::ZERO, Some(Duration::from_millis(1)), &stop)
            .await
            .unwrap()
    }

    /// A heartbeat alone is no news: its time is written at most once per grace period
    /// (every heartbeat was a write: 100 writes/s to the host at 1,000 clusters).
    #[tokio::test]
    async fn heartbeats_are_written_once_per_grace_period() {
        let m = Membership::new(Duration::from_millis(300));
        let members = store(&[("c1", Some(true))]);
        m.heartbeat("c1");
        let first = marked(&m).await;
        assert_eq!(first, ["c1"], "a first heartbeat is written");
        assert_eq!(m.due(&first, &members, Instant::now()).len(), 1);
        m.heartbeat("c1");
        assert!(
            marked(&m).await.is_empty(),
            "a heartbeat just written is not written again"
        );
        tokio::time::sleep(Duration::from_millis(350)).await;
        m.heartbeat("c1");
        assert_eq!(
            marked(&m).await,
            ["c1"],
            "a grace period later, it is refreshed"
        );
    }

    #[test]
    fn an_unchanged_ready_cluster_is_not_rewritten() {
        let m = Membership::new(Duration::from_secs(40));
        m.heartbeat("c1");
        assert!(
            m.due(&[], &store(&[("c1", Some(true))]), Instant::now())
                .is_empty()
        );
    }

    #[test]
    fn a_capacity_report_is_written_once_and_kept_across_hub_restarts() {
        use flotilla_crds::member::Resources;
        let m = Membership::new(Duration::from_secs(40));
        let room = ClusterCapacity {
            nodes: 3,
            allocatable: Resources {
                cpu_millis: 6000,
                memory_bytes: 12 << 30,
            },
            ..Default::default()
        };
        m.heartbeat("c1");
        m.capacity("c1", room.clone());
        let due = m.due(
            &["c1".into()],
            &store(&[("c1", Some(true))]),
            Instant::now(),
        );
        assert_eq!(due[0].1.capacity.as_ref(), Some(&room));
        // A hub that restarted has heard nothing yet: it keeps what the status shows.
        let restarted = Membership::new(Duration::from_secs(40));
        restarted.heartbeat("c1");
        let mut shown = MemberCluster::new("c1", Default::default());
        shown.status = Some(MemberClusterStatus {
            capacity: Some(room.clone()),
            ..Default::default()
        });
        let (members, mut writer) = reflector::store::<MemberCluster>();
        writer.apply_watcher_event(&watcher::Event::Apply(shown));
        let due = restarted.due(&["c1".into()], &members, Instant::now());
        assert_eq!(due[0].1.capacity.as_ref(), Some(&room));
    }

    #[test]
    fn a_held_back_collection_shows_how_to_confirm_it() {
        let m = Membership::new(Duration::from_secs(40));
        m.heartbeat("c1");
        m.collection_blocked("c1", 7, 10);
        let due = m.due(
            &["c1".into()],
            &store(&[("c1", Some(true))]),
            Instant::now(),
        );
        let blocked = due[0]
            .1
            .conditions
            .iter()
            .find(|c| c.type_ == "CollectionBlocked")
            .unwrap();
        assert_eq!(blocked.status, "True");
        assert!(
            blocked
                .message
                .contains("kubectl annotate membercluster c1 flotilla.io/confirm-collection=7"),
            "{}",
            blocked.message
        );
        // Confirmed and passed on to the agent: the condition clears.
        m.collection_confirmed("c1");
        let due = m.due(
            &["c1".into()],
            &store(&[("c1", Some(true))]),
            Instant::now(),
        );
        let blocked = due[0]
            .1
            .conditions
            .iter()
            .find(|c| c.type_ == "CollectionBlocked");
        assert_eq!(blocked.unwrap().status, "False");
    }

    #[test]
    fn an_agent_in_another_physical_cluster_is_foreign() {
        let mut mc = MemberCluster::new("c1", Default::default());
        assert_eq!(foreign_cluster(&mc, "uid-2"), None, "nothing pinned yet");
        mc.status = Some(MemberClusterStatus {
            cluster_uid: Some("uid-1".into()),
            ..Default::default()
        });
        assert_eq!(foreign_cluster(&mc, "uid-1"), None);
        assert!(
            foreign_cluster(&mc, "uid-2")
                .unwrap()
                .contains("bound to the cluster whose kube-system namespace has UID uid-1")
        );
        assert_eq!(
            foreign_cluster(&mc, ""),
            None,
            "an agent that cannot read kube-system is not refused"
        );
    }
}
