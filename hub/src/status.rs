//! Status: what agents report, folded into `FederatedMyApp.status`.
//!
//! Reports land on a board in memory; a writer patches each FederatedMyApp whose status
//! changed at most once per window, however many reports arrived, so that the host
//! apiserver sees one write per app per window rather than one per report. The board
//! also knows which clusters have a live agent session: it hears every connect and
//! disconnect.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use flotilla_common::coalesce::Pending;
use flotilla_crds::FederatedMyApp;
use flotilla_crds::condition;
use flotilla_crds::federated::{ClusterStatus, FederatedMyAppStatus};
use flotilla_proto::v1 as pb;
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use parking_lot::Mutex;
use serde_json::Value;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::index::{AppKey, Held};
use crate::render::ClusterError;
use crate::schedule::{self, Schedule};

/// How one cluster's rendering of an app came out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Rendered; the agent should report this hash (shared by the clusters that got the
    /// same bytes).
    Rendered { hash: Arc<str> },
    /// Not sent: why, in words for the user.
    Failed { message: String },
    /// NotReady past the failover grace period: its share runs elsewhere, its copy is
    /// left as it was. Not an error, and not counted as placed.
    FailedOver,
}

/// What the hub decided for one app at one generation.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    pub generation: Option<i64>,
    /// Placed clusters and named unknown ones.
    pub clusters: BTreeMap<String, Outcome>,
    /// The placement as a whole is invalid.
    pub placement_error: Option<String>,
    /// The app is being deleted and these clusters have not confirmed it.
    pub deleting_on: Option<Vec<String>>,
    /// Replicas per cluster and why, for `status.clusters[].replicas`.
    pub schedule: Option<Schedule>,
}

/// What an agent last said about one MyApp: the wire's `StatusReport`, as the hub
/// reads it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Report {
    /// The content hash of the MyApp the status belongs to.
    pub hash: String,
    pub exists: bool,
    pub ready: bool,
    pub ready_replicas: i32,
    pub observed_generation: i64,
    pub generation: i64,
    /// The MyApp's `Degraded` condition, when True: reason and message.
    pub degraded: Option<(String, String)>,
    /// Why the agent could not apply (or remove) it; it retries by itself.
    pub apply_error: Option<String>,
}

impl From<pb::StatusReport> for Report {
    fn from(r: pb::StatusReport) -> Self {
        let degraded = r
            .conditions
            .into_iter()
            .find(|c| c.r#type == "Degraded" && c.status == "True")
            .map(|c| (c.reason, c.message));
        Self {
            hash: r.hash,
            exists: r.exists,
            ready: r.ready,
            ready_replicas: r.ready_replicas,
            observed_generation: r.observed_generation,
            generation: r.generation,
            degraded,
            apply_error: Some(r.apply_error).filter(|e| !e.is_empty()),
        }
    }
}

impl Report {
    pub fn held(&self) -> Held {
        match (&self.apply_error, self.exists) {
            (Some(_), _) => Held::Failed,
            (None, true) => Held::Present,
            (None, false) => Held::Absent,
        }
    }

    fn not_ready_reason(&self) -> String {
        if self.observed_generation < self.generation {
            return "the operator has not observed the latest spec yet".into();
        }
        match &self.degraded {
            Some((reason, message)) => format!("{reason}: {message}"),
            None => format!("{} replica(s) ready", self.ready_replicas),
        }
    }
}

/// Why a cluster's MyApp is not propagated, most urgent first: errors a user must fix
/// before states that pass by themselves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    RenderFailed,
    ApplyFailed,
    AgentDisconnected,
    Pending,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::RenderFailed => "RenderFailed",
            Reason::ApplyFailed => "ApplyFailed",
            Reason::AgentDisconnected => "AgentDisconnected",
            Reason::Pending => "Pending",
        }
    }
}

/// Everything the status of one app is computed from.
pub struct Inputs<'a> {
    pub plan: &'a Plan,
    pub reports: Option<&'a BTreeMap<String, Report>>,
    /// Clusters with a live agent session.
    pub connected: &'a HashSet<String>,
}

/// The status as a pure function of the inputs; `previous` keeps condition transition
/// times stable while a condition's status does not change.
pub fn compute(
    inputs: &Inputs<'_>,
    previous: Option<&FederatedMyAppStatus>,
    now: &Time,
) -> FederatedMyAppStatus {
    let plan = inputs.plan;
    let mut clusters = Vec::new();
    let (mut placed, mut ready_count) = (0, 0);
    let mut not_propagated: Vec<(String, Reason, String)> = Vec::new();
    let mut not_ready: Vec<String> = Vec::new();
    for (name, outcome) in &plan.clusters {
        let report = inputs.reports.and_then(|r| r.get(name));
        let mut entry = ClusterStatus {
            name: name.clone(),
            ..Default::default()
        };
        if let Some(r) = report.filter(|r| r.exists) {
            entry.ready_replicas = r.ready_replicas;
            entry.observed_generation = Some(r.observed_generation);
        }
        let problem = match outcome {
            Outcome::Failed { message } => Some((Reason::RenderFailed, message.clone())),
            Outcome::FailedOver => {
                entry.message = ClusterError::FailedOver.to_string();
                None
            }
            Outcome::Rendered { hash } => {
                placed += 1;
                match report {
                    _ if !inputs.connected.contains(name) => Some((
                        Reason::AgentDisconnected,
                        "the cluster's agent is not connected; its last applied MyApp keeps running".to_owned(),
                    )),
                    Some(Report { apply_error: Some(e), .. }) => Some((
                        Reason::ApplyFailed,
                        format!("applying the MyApp failed (the agent retries): {e}"),
                    )),
                    Some(r) if r.exists && r.hash == **hash => {
                        entry.ready = r.ready && r.observed_generation >= r.generation;
                        if entry.ready {
                            ready_count += 1;
                        } else {
                            entry.message = r.not_ready_reason();
                            not_ready.push(format!("{name}: {}", entry.message));
                        }
                        None
                    }
                    _ => Some((
                        Reason::Pending,
                        "waiting for the agent to apply the latest version".to_owned(),
                    )),
                }
            }
        };
        if let Some((reason, message)) = problem {
            entry.message = message.clone();
            not_propagated.push((name.clone(), reason, message));
        }
        clusters.push(entry);
    }
    let generation = plan.generation;
    let cond = |type_: &str, ok: bool, reason: &str, message: String| {
        condition::new(type_, ok, reason, message, generation, now)
    };
    let propagated = match (&plan.placement_error, &plan.deleting_on) {
        (_, Some(waiting)) => cond(
            "Propagated",
            false,
            "Deleting",
            format!("waiting for {} to confirm deletion", list_or_none(waiting)),
        ),
        (Some(e), _) => cond("Propagated", false, "InvalidPlacement", e.clone()),
        (None, None) => match not_propagated.iter().map(|(_, r, _)| *r).min() {
            None => cond(
                "Propagated",
                true,
                "Propagated",
                format!("applied on {placed} cluster(s)"),
            ),
            Some(reason) => {
                let message = not_propagated
                    .iter()
                    .map(|(c, _, m)| format!("{c}: {m}"))
                    .collect::<Vec<_>>()
                    .join("; ");
                cond("Propagated", false, reason.as_str(), message)
            }
        },
    };
    let ready = if placed == 0 {
        cond(
            "Ready",
            false,
            "NoClusters",
            "the placement selects no registered cluster".into(),
        )
    } else if ready_count == placed {
        cond(
            "Ready",
            true,
            "Ready",
            format!("ready on all {placed} cluster(s)"),
        )
    } else {
        let mut message = format!("{ready_count} of {placed} cluster(s) ready");
        if !not_ready.is_empty() {
            message = format!("{message}; {}", not_ready.join("; "));
        }
        cond("Ready", false, "NotReady", message)
    };
    let before: &[Condition] = previous.map_or(&[], |p| &p.conditions);
    let mut status = FederatedMyAppStatus {
        observed_generation: plan.generation,
        conditions: [propagated, ready]
            .into_iter()
            .map(|c| condition::settle(c, before))
            .collect(),
        placed_clusters: placed,
        ready_clusters: ready_count,
        clusters,
        ..Default::default()
    };
    if let Some(schedule) = &plan.schedule {
        schedule::annotate(&mut status, schedule);
    }
    status
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() {
        "no cluster".into()
    } else {
        names.join(", ")
    }
}

/// The merge patch that makes `status` the object's status: lists that became empty are
/// cleared (they are left out when serialized, which a merge patch would read as "keep").
pub fn status_patch(status: &impl serde::Serialize, lists: &[&str]) -> Value {
    let mut value = serde_json::to_value(status).expect("a status serializes");
    if let Value::Object(map) = &mut value {
        for list in lists {
            map.entry(*list).or_insert(Value::Null);
        }
    }
    serde_json::json!({ "status": value })
}

#[derive(Default)]
struct Board {
    plans: HashMap<AppKey, Plan>,
    /// cluster → apps whose plan names it, so that a connect or disconnect finds them
    /// without scanning every plan. One shared key per app.
    apps_on: HashMap<String, HashSet<Arc<AppKey>>>,
    reports: HashMap<AppKey, BTreeMap<String, Report>>,
    connected: HashSet<String>,
}

impl Board {
    /// Makes `plan` the app's plan, moving the app between the clusters' sets.
    fn insert_plan(&mut self, key: &AppKey, plan: Plan) {
        let shared = Arc::new(key.clone());
        for cluster in plan.clusters.keys() {
            self.apps_on
                .entry(cluster.clone())
                .or_default()
                .replace(shared.clone());
        }
        if let Some(previous) = self.plans.insert(key.clone(), plan) {
            let now = &self.plans[key].clusters;
            let left = previous.clusters.keys().filter(|c| !now.contains_key(*c));
            remove_from(&mut self.apps_on, left, key);
        }
    }

    fn remove_plan(&mut self, key: &AppKey) {
        if let Some(plan) = self.plans.remove(key) {
            remove_from(&mut self.apps_on, plan.clusters.keys(), key);
        }
    }
}

fn remove_from<'a>(
    apps_on: &mut HashMap<String, HashSet<Arc<AppKey>>>,
    clusters: impl Iterator<Item = &'a String>,
    key: &AppKey,
) {
    for cluster in clusters {
        if let Some(apps) = apps_on.get_mut(cluster) {
            apps.remove(key);
            if apps.is_empty() {
                apps_on.remove(cluster);
            }
        }
    }
}

/// Plans and reports of every app, and the apps whose status must be rewritten.
#[derive(Default)]
pub struct StatusBoard {
    board: Mutex<Board>,
    dirty: Pending<AppKey>,
}

impl StatusBoard {
    /// Records the plan; true when its errors differ from the previous plan's (worth an
    /// Event).
    pub fn set_plan(&self, key: &AppKey, plan: Plan) -> bool {
        let mut b = self.board.lock();
        let errors = |p: &Plan| {
            let failed = p
                .clusters
                .iter()
                .filter(|(_, o)| matches!(o, Outcome::Failed { .. }));
            (
                p.placement_error.clone(),
                failed
                    .map(|(c, o)| (c.clone(), o.clone()))
                    .collect::<Vec<_>>(),
            )
        };
        let changed = errors(b.plans.get(key).unwrap_or(&Plan::default())) != errors(&plan);
        b.insert_plan(key, plan);
        drop(b);
        self.dirty.mark(key.clone());
        changed
    }

    pub fn report(&self, cluster: &str, key: &AppKey, report: Report) {
        let mut b = self.board.lock();
        let reports = b.reports.entry(key.clone()).or_default();
        if reports.get(cluster) == Some(&report) {
            return;
        }
        reports.insert(cluster.to_owned(), report);
        drop(b);
        self.dirty.mark(key.clone());
    }

    pub fn connected(&self, cluster: &str) {
        self.connectivity(cluster, true);
    }

    pub fn disconnected(&self, cluster: &str) {
        self.connectivity(cluster, false);
    }

    /// Every app placed on the cluster may read differently now.
    fn connectivity(&self, cluster: &str, up: bool) {
        let mut b = self.board.lock();
        let changed = if up {
            b.connected.insert(cluster.to_owned())
        } else {
            b.connected.remove(cluster)
        };
        if !changed {
            return;
        }
        let keys: Vec<AppKey> = b
            .apps_on
            .get(cluster)
            .map(|apps| apps.iter().map(|k| AppKey::clone(k)).collect())
            .unwrap_or_default();
        drop(b);
        self.dirty.mark_all(keys);
    }

    pub fn forget(&self, key: &AppKey) {
        let mut b = self.board.lock();
        b.remove_plan(key);
        b.reports.remove(key);
        self.dirty.forget(key);
    }

    /// The statuses that differ from what the apps show.
    fn changed(
        &self,
        keys: Vec<AppKey>,
        apps: &Store<FederatedMyApp>,
    ) -> Vec<(AppKey, FederatedMyAppStatus)> {
        let now = Time(Timestamp::now());
        let b = self.board.lock();
        keys.into_iter()
            .filter_map(|key| {
                let plan = b.plans.get(&key)?;
                let current = apps.get(&ObjectRef::new(&key.name).within(&key.namespace))?;
                let previous = current.status.as_ref();
                let inputs = Inputs {
                    plan,
                    reports: b.reports.get(&key),
                    connected: &b.connected,
                };
                let status = compute(&inputs, previous, &now);
                (previous != Some(&status)).then_some((key, status))
            })
            .collect()
    }

    /// Patches the status of changed apps, one patch per app per `window`, while this
    /// hub leads, until `shutdown`. On taking the lead every app is looked at once.
    pub async fn write_loop(
        self: Arc<Self>,
        client: kube::Client,
        apps: Store<FederatedMyApp>,
        window: Duration,
        mut leading: watch::Receiver<bool>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                led = leading.wait_for(|l| *l) => { led?; }
            }
            let all: Vec<AppKey> = self.board.lock().plans.keys().cloned().collect();
            self.dirty.mark_all(all);
            let lost = async {
                let _ = leading.wait_for(|l| !*l).await;
            };
            tokio::select! {
                _ = lost => continue,
                r = self.write_while_leading(&client, &apps, window, &shutdown) => return r,
            }
        }
    }

    async fn write_while_leading(
        &self,
        client: &kube::Client,
        apps: &Store<FederatedMyApp>,
        window: Duration,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        while let Some(keys) = self.dirty.take(window, None, shutdown).await {
            let patches = self.changed(keys, apps);
            let board = self;
            futures::stream::iter(patches)
                .for_each_concurrent(8, |(key, status)| {
                    let api: Api<FederatedMyApp> = Api::namespaced(client.clone(), &key.namespace);
                    async move {
                        let patch =
                            Patch::Merge(status_patch(&status, &["clusters", "conditions"]));
                        match api
                            .patch_status(&key.name, &PatchParams::default(), &patch)
                            .await
                        {
                            Ok(app) => {
                                debug!(app = %key, rv = ?app.resource_version(), "status written")
                            }
                            Err(kube::Error::Api(e)) if e.code == 404 => {}
                            Err(e) => {
                                warn!(app = %key, error = %e, "writing status failed; retrying");
                                board.dirty.mark(key);
                            }
                        }
                    }
                })
                .await;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> Time {
        Time(Timestamp::from_second(1_700_000_000).unwrap())
    }

    fn rendered(h: &str) -> Outcome {
        Outcome::Rendered { hash: h.into() }
    }

    fn report(hash: &str, ready: bool, replicas: i32) -> Report {
        Report {
            hash: hash.into(),
            exists: true,
            ready,
            ready_replicas: replicas,
            observed_generation: 1,
            generation: 1,
            ..Default::default()
        }
    }

    fn plan(entries: &[(&str, Outcome)]) -> Plan {
        Plan {
            generation: Some(4),
            clusters: entries
                .iter()
                .map(|(c, o)| ((*c).into(), o.clone()))
                .collect(),
            ..Default::default()
        }
    }

    fn run(plan: &Plan, reports: &[(&str, Report)], connected: &[&str]) -> FederatedMyAppStatus {
        let reports: BTreeMap<String, Report> = reports
            .iter()
            .map(|(c, r)| ((*c).into(), r.clone()))
            .collect();
        let connected = connected.iter().map(|c| c.to_string()).collect();
        compute(
            &Inputs {
                plan,
                reports: Some(&reports),
                connected: &connected,
            },
            None,
            &now(),
        )
    }

    fn cond<'a>(s: &'a FederatedMyAppStatus, t: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn all_ready() {
        let p = plan(&[("c1", rendered("h1")), ("c2", rendered("h2"))]);
        let s = run(
            &p,
            &[("c1", report("h1", true, 3)), ("c2", report("h2", true, 5))],
            &["c1", "c2"],
        );
        assert_eq!((s.placed_clusters, s.ready_clusters), (2, 2));
        assert_eq!(s.observed_generation, Some(4));
        assert_eq!(cond(&s, "Propagated").status, "True");
        assert_eq!(cond(&s, "Ready").status, "True");
        assert_eq!(
            s.clusters[1],
            ClusterStatus {
                name: "c2".into(),
                ready: true,
                ready_replicas: 5,
                observed_generation: Some(1),
                message: String::new(),
                ..Default::default()
            }
        );
    }

    #[test]
    fn the_division_shows_per_cluster_and_a_failed_over_cluster_is_no_error() {
        use crate::schedule::Assignment;
        use flotilla_crds::federated::SchedulingReason;
        let mut p = plan(&[
            ("c1", rendered("h1")),
            ("c2", rendered("h2")),
            ("c3", Outcome::FailedOver),
        ]);
        let assign = |replicas, reason| Assignment { replicas, reason };
        p.schedule = Some(Schedule {
            divided: true,
            clusters: [
                ("c1".into(), assign(8, SchedulingReason::Weight)),
                ("c2".into(), assign(4, SchedulingReason::Failover)),
                ("c3".into(), assign(3, SchedulingReason::FailedOver)),
            ]
            .into(),
            recheck_after: None,
        });
        let s = run(
            &p,
            &[
                ("c1", report("h1", true, 8)),
                ("c2", report("h2", true, 4)),
                ("c3", report("old", true, 3)),
            ],
            &["c1", "c2"],
        );
        let c = |name: &str| s.clusters.iter().find(|c| c.name == name).unwrap();
        assert_eq!(c("c1").replicas, Some(8));
        assert_eq!(c("c2").scheduling_reason, Some(SchedulingReason::Failover));
        assert_eq!(c("c3").replicas, Some(3));
        assert!(c("c3").message.contains("failover grace period"));
        // The failed-over copy is neither placed nor an error; its replicas are not
        // counted in the desired total, its ready ones are still running.
        assert_eq!((s.placed_clusters, s.ready_clusters), (2, 2));
        assert_eq!(cond(&s, "Propagated").status, "True");
        assert_eq!(cond(&s, "Ready").status, "True");
        assert_eq!(s.replicas, Some(12));
        assert_eq!(s.ready_replicas, 15);
    }

    #[test]
    fn stale_hash_is_pending_not_ready() {
        let p = plan(&[("c1", rendered("new"))]);
        let s = run(&p, &[("c1", report("old", true, 3))], &["c1"]);
        assert_eq!(cond(&s, "Propagated").reason, "Pending");
        assert_eq!(cond(&s, "Ready").status, "False");
        assert!(!s.clusters[0].ready);
    }

    #[test]
    fn one_clusters_error_is_shown_for_that_cluster_only() {
        let p = plan(&[
            ("c1", rendered("h1")),
            (
                "c2",
                Outcome::Failed {
                    message:
                        "spec.overrides[0].clusterOverrides[0] (replace /spec/x): nothing here"
                            .into(),
                },
            ),
        ]);
        let s = run(&p, &[("c1", report("h1", true, 3))], &["c1", "c2"]);
        assert!(s.clusters[0].ready && s.clusters[0].message.is_empty());
        assert!(s.clusters[1].message.contains("/spec/x"));
        let c = cond(&s, "Propagated");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "RenderFailed")
        );
        assert!(c.message.starts_with("c2: spec.overrides[0]"));
        assert_eq!((s.placed_clusters, s.ready_clusters), (1, 1));
        assert_eq!(
            cond(&s, "Ready").status,
            "True",
            "the placed, rendered clusters are ready"
        );
    }

    #[test]
    fn disconnected_agent_and_apply_errors_are_named() {
        let p = plan(&[("c1", rendered("h1")), ("c2", rendered("h2"))]);
        let mut failed = report("h2", false, 0);
        failed.apply_error = Some("admission webhook denied".into());
        let s = run(
            &p,
            &[("c1", report("h1", true, 3)), ("c2", failed)],
            &["c2"],
        );
        assert!(s.clusters[0].message.contains("agent is not connected"));
        assert!(s.clusters[1].message.contains("admission webhook denied"));
        assert_eq!(cond(&s, "Propagated").reason, "ApplyFailed");
    }

    #[test]
    fn not_ready_explains_why() {
        let p = plan(&[("c1", rendered("h1"))]);
        let r = Report::from(pb::StatusReport {
            hash: "h1".into(),
            exists: true,
            ready_replicas: 1,
            observed_generation: 1,
            generation: 1,
            conditions: vec![
                pb::Condition {
                    r#type: "Degraded".into(),
                    status: "False".into(),
                    reason: "AsExpected".into(),
                    message: String::new(),
                },
                pb::Condition {
                    r#type: "Degraded".into(),
                    status: "True".into(),
                    reason: "ImageMissing".into(),
                    message: "spec.image is not set".into(),
                },
            ],
            ..Default::default()
        });
        let s = run(&p, &[("c1", r)], &["c1"]);
        assert_eq!(
            cond(&s, "Ready").message,
            "0 of 1 cluster(s) ready; c1: ImageMissing: spec.image is not set"
        );
        let mut r = report("h1", true, 3);
        r.generation = 2;
        let s = run(&p, &[("c1", r)], &["c1"]);
        assert!(
            !s.clusters[0].ready,
            "a status older than the spec is not ready"
        );
    }

    #[test]
    fn no_clusters_and_invalid_placement() {
        let s = run(&plan(&[]), &[], &[]);
        assert_eq!(cond(&s, "Ready").reason, "NoClusters");
        assert_eq!(cond(&s, "Propagated").status, "True");
        let mut p = plan(&[]);
        p.placement_error = Some("spec.placement.clusterSelector.matchExpressions[0]: operator In needs at least one value".into());
        let s = run(&p, &[], &[]);
        assert_eq!(cond(&s, "Propagated").reason, "InvalidPlacement");
    }

    #[test]
    fn transition_time_is_kept_while_status_holds() {
        let p = plan(&[("c1", rendered("h1"))]);
        let first = run(&p, &[("c1", report("h1", true, 3))], &["c1"]);
        let later = Time(Timestamp::from_second(1_800_000_000).unwrap());
        let reports: BTreeMap<String, Report> = [("c1".to_owned(), report("h1", true, 3))].into();
        let connected: HashSet<String> = ["c1".to_owned()].into();
        let inputs = Inputs {
            plan: &p,
            reports: Some(&reports),
            connected: &connected,
        };
        let again = compute(&inputs, Some(&first), &later);
        assert_eq!(again, first, "nothing changed, so nothing to write");
        let none = compute(
            &Inputs {
                plan: &p,
                reports: None,
                connected: &connected,
            },
            Some(&first),
            &later,
        );
        assert_eq!(cond(&none, "Ready").last_transition_time, later);
    }

    #[test]
    fn plan_error_changes_are_detected_for_events() {
        let board = StatusBoard::default();
        let key = AppKey::new("ns", "a");
        assert!(!board.set_plan(&key, plan(&[("c1", rendered("h1"))])));
        assert!(
            !board.set_plan(&key, plan(&[("c1", rendered("h2"))])),
            "a new hash is not an error"
        );
        assert!(board.set_plan(
            &key,
            plan(&[(
                "c1",
                Outcome::Failed {
                    message: "x".into()
                }
            )])
        ));
        assert!(!board.set_plan(
            &key,
            plan(&[(
                "c1",
                Outcome::Failed {
                    message: "x".into()
                }
            )])
        ));
    }

    #[test]
    fn reasons_order_by_urgency() {
        assert!(Reason::RenderFailed < Reason::ApplyFailed);
        assert!(Reason::ApplyFailed < Reason::AgentDisconnected);
        assert!(Reason::AgentDisconnected < Reason::Pending);
        let p = plan(&[("c1", rendered("h1")), ("c2", rendered("h2"))]);
        let s = run(&p, &[("c1", report("old", true, 1))], &["c1"]);
        assert_eq!(cond(&s, "Propagated").reason, "AgentDisconnected");
    }

    #[test]
    fn reports_read_as_held_present_absent_or_failed() {
        let r = |exists: bool, error: &str| {
            Report::from(pb::StatusReport {
                exists,
                apply_error: error.into(),
                ..Default::default()
            })
            .held()
        };
        assert_eq!(r(true, ""), Held::Present);
        assert_eq!(r(false, ""), Held::Absent);
        assert_eq!(r(false, "namespace \"x\" not found"), Held::Failed);
        assert_eq!(r(true, "webhook denied"), Held::Failed);
    }

    #[test]
    fn an_apply_error_clears_when_a_good_report_follows() {
        let p = plan(&[("c1", rendered("h1"))]);
        let mut failed = report("h1", false, 0);
        failed.apply_error = Some("namespace \"team\" not found".into());
        let s = run(&p, &[("c1", failed)], &["c1"]);
        assert_eq!(cond(&s, "Propagated").reason, "ApplyFailed");
        let s = run(&p, &[("c1", report("h1", true, 1))], &["c1"]);
        assert_eq!(cond(&s, "Propagated").status, "True");
        assert!(s.clusters[0].message.is_empty());
    }

    #[test]
    fn conditions_carry_the_observed_generation() {
        let s = run(&plan(&[("c1", rendered("h1"))]), &[], &["c1"]);
        assert!(
            s.conditions
                .iter()
                .all(|c| c.observed_generation == Some(4))
        );
    }

    #[test]
    fn an_empty_cluster_list_is_cleared_by_the_patch() {
        let s = run(&plan(&[]), &[], &[]);
        let patch = status_patch(&s, &["clusters", "conditions"]);
        assert_eq!(patch["status"]["clusters"], Value::Null);
        assert!(
            patch["status"]
                .as_object()
                .unwrap()
                .contains_key("clusters")
        );
        assert!(patch["status"]["conditions"].is_array());
    }

    #[test]
    fn the_board_knows_the_apps_on_each_cluster_as_its_plans_name_them() {
        let board = StatusBoard::default();
        let (a, b) = (AppKey::new("ns", "a"), AppKey::new("ns", "b"));
        let failed = || Outcome::Failed {
            message: "x".into(),
        };
        let check = || {
            let b = board.board.lock();
            for cluster in ["c1", "c2", "c3", "c4"] {
                let scanned: HashSet<&AppKey> = b
                    .plans
                    .iter()
                    .filter(|(_, p)| p.clusters.contains_key(cluster))
                    .map(|(k, _)| k)
                    .collect();
                let indexed: HashSet<&AppKey> = b
                    .apps_on
                    .get(cluster)
                    .map(|apps| apps.iter().map(|k| &**k).collect())
                    .unwrap_or_default();
                assert_eq!(indexed, scanned, "apps on {cluster}");
            }
            assert!(b.apps_on.values().all(|apps| !apps.is_empty()));
        };
        board.set_plan(&a, plan(&[("c1", rendered("h")), ("c2", failed())]));
        board.set_plan(
            &b,
            plan(&[("c2", rendered("h")), ("c3", Outcome::FailedOver)]),
        );
        check();
        board.set_plan(&a, plan(&[("c2", rendered("h")), ("c4", rendered("h"))]));
        check();
        board.set_plan(&b, plan(&[]));
        check();
        board.forget(&a);
        board.forget(&a);
        check();
        assert!(board.board.lock().apps_on.is_empty());
    }

    #[tokio::test]
    async fn a_connect_marks_the_apps_placed_on_that_cluster_only() {
        let board = StatusBoard::default();
        let (a, b) = (AppKey::new("ns", "a"), AppKey::new("ns", "b"));
        board.set_plan(&a, plan(&[("c1", rendered("h"))]));
        board.set_plan(&b, plan(&[("c2", rendered("h"))]));
        let stop = CancellationToken::new();
        board.dirty.take(Duration::ZERO, None, &stop).await;
        board.connected("c1");
        let marked = board.dirty.take(Duration::ZERO, None, &stop).await;
        assert_eq!(marked, Some(vec![a]));
    }

    #[test]
    fn the_board_tracks_connectivity_and_marks_placed_apps() {
        let board = StatusBoard::default();
        let key = AppKey::new("ns", "a");
        board.set_plan(&key, plan(&[("c1", rendered("h1"))]));
        board.dirty.forget(&key);
        board.connected("c1");
        assert!(board.board.lock().connected.contains("c1"));
        board.disconnected("c1");
        board.disconnected("c1");
        assert!(board.board.lock().connected.is_empty());
    }
}
