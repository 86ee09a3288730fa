//! Status: what agents report, folded into `FederatedMyApp.status`.
//!
//! Reports land on a board in memory; a writer patches each FederatedMyApp whose status
//! changed at most once per window, however many reports arrived, so that the host
//! apiserver sees one write per app per window rather than one per report.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use flotilla_crds::FederatedMyApp;
use flotilla_crds::federated::{ClusterStatus, FederatedMyAppStatus};
use flotilla_proto::v1 as pb;
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::index::AppKey;

/// How one cluster's rendering of an app came out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Rendered; the agent should report this hash.
    Rendered { hash: String },
    /// Not sent: why, in words for the user.
    Failed { message: String },
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
}

/// Everything the status of one app is computed from.
pub struct Inputs<'a> {
    pub plan: &'a Plan,
    pub reports: Option<&'a BTreeMap<String, pb::StatusReport>>,
    pub connected: &'a dyn Fn(&str) -> bool,
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
    let mut not_propagated: Vec<(String, &'static str, String)> = Vec::new();
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
        let (reason, message) = match outcome {
            Outcome::Failed { message } => (Some("RenderFailed"), message.clone()),
            Outcome::Rendered { hash } => {
                placed += 1;
                match report {
                    _ if !(inputs.connected)(name) => (Some("AgentDisconnected"), "the cluster's agent is not connected; its last applied MyApp keeps running".to_owned()),
                    Some(r) if !r.apply_error.is_empty() => (Some("ApplyFailed"), format!("applying the MyApp failed: {}", r.apply_error)),
                    Some(r) if r.exists && &r.hash == hash => {
                        entry.ready = r.ready && r.observed_generation >= r.generation;
                        if entry.ready {
                            ready_count += 1;
                        } else {
                            not_ready.push(format!("{name}: {}", not_ready_reason(r)));
                        }
                        entry.message = if entry.ready { String::new() } else { not_ready_reason(r) };
                        (None, String::new())
                    }
                    _ => (Some("Pending"), "waiting for the agent to apply the latest version".to_owned()),
                }
            }
        };
        if let Some(reason) = reason {
            entry.message = message.clone();
            not_propagated.push((name.clone(), reason, message));
        }
        clusters.push(entry);
    }
    let propagated = match (&plan.placement_error, &plan.deleting_on) {
        (_, Some(waiting)) => condition(
            "Propagated",
            false,
            "Deleting",
            &format!("waiting for {} to confirm deletion", list_or_none(waiting)),
            now,
        ),
        (Some(e), _) => condition("Propagated", false, "InvalidPlacement", e, now),
        (None, None) if not_propagated.is_empty() => condition(
            "Propagated",
            true,
            "Propagated",
            &format!("applied on {placed} cluster(s)"),
            now,
        ),
        (None, None) => {
            let reason = not_propagated
                .iter()
                .map(|(_, r, _)| *r)
                .min_by_key(|r| severity(r))
                .unwrap_or("Pending");
            let message = not_propagated
                .iter()
                .map(|(c, _, m)| format!("{c}: {m}"))
                .collect::<Vec<_>>()
                .join("; ");
            condition("Propagated", false, reason, &message, now)
        }
    };
    let ready = if placed == 0 {
        condition(
            "Ready",
            false,
            "NoClusters",
            "the placement selects no registered cluster",
            now,
        )
    } else if ready_count == placed {
        condition(
            "Ready",
            true,
            "Ready",
            &format!("ready on all {placed} cluster(s)"),
            now,
        )
    } else {
        let mut message = format!("{ready_count} of {placed} cluster(s) ready");
        if !not_ready.is_empty() {
            message = format!("{message}; {}", not_ready.join("; "));
        }
        condition("Ready", false, "NotReady", &message, now)
    };
    let conditions = [propagated, ready]
        .into_iter()
        .map(|c| keep_transition_time(c, previous))
        .collect();
    FederatedMyAppStatus {
        observed_generation: plan.generation,
        conditions,
        placed_clusters: placed,
        ready_clusters: ready_count,
        clusters,
        ..Default::default()
    }
}

/// The first reason a user should act on: errors before waiting.
fn severity(reason: &str) -> u8 {
    match reason {
        "RenderFailed" => 0,
        "ApplyFailed" => 1,
        "AgentDisconnected" => 2,
        _ => 3,
    }
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() {
        "no cluster".into()
    } else {
        names.join(", ")
    }
}

fn not_ready_reason(r: &pb::StatusReport) -> String {
    if r.observed_generation < r.generation {
        return "the operator has not observed the latest spec yet".into();
    }
    let degraded = r
        .conditions
        .iter()
        .find(|c| c.r#type == "Degraded" && c.status == "True");
    match degraded {
        Some(c) => format!("{}: {}", c.reason, c.message),
        None => format!("{} replica(s) ready", r.ready_replicas),
    }
}

fn condition(type_: &str, ok: bool, reason: &str, message: &str, now: &Time) -> Condition {
    Condition {
        type_: type_.into(),
        status: if ok { "True" } else { "False" }.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: now.clone(),
        observed_generation: None,
    }
}

fn keep_transition_time(mut c: Condition, previous: Option<&FederatedMyAppStatus>) -> Condition {
    let before = previous.and_then(|p| p.conditions.iter().find(|p| p.type_ == c.type_));
    if let Some(before) = before.filter(|b| b.status == c.status) {
        c.last_transition_time = before.last_transition_time.clone();
    }
    c
}

#[derive(Default)]
struct Board {
    plans: HashMap<AppKey, Plan>,
    reports: HashMap<AppKey, BTreeMap<String, pb::StatusReport>>,
    dirty: HashSet<AppKey>,
}

/// Plans and reports of every app, and the apps whose status must be rewritten.
#[derive(Default)]
pub struct StatusBoard {
    board: Mutex<Board>,
    wake: Notify,
}

impl StatusBoard {
    /// Records the plan; true when its errors differ from the previous plan's (worth an
    /// Event).
    pub fn set_plan(&self, key: &AppKey, plan: Plan) -> bool {
        let mut b = self.lock();
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
        b.plans.insert(key.clone(), plan);
        self.mark(b, key);
        changed
    }

    pub fn report(&self, cluster: &str, key: &AppKey, report: pb::StatusReport) {
        let mut b = self.lock();
        let reports = b.reports.entry(key.clone()).or_default();
        if reports.get(cluster) == Some(&report) {
            return;
        }
        reports.insert(cluster.to_owned(), report);
        self.mark(b, key);
    }

    /// A cluster connected or went away: every app placed there may read differently.
    pub fn touch_cluster(&self, cluster: &str) {
        let mut b = self.lock();
        let keys: Vec<AppKey> = b
            .plans
            .iter()
            .filter(|(_, p)| p.clusters.contains_key(cluster))
            .map(|(k, _)| k.clone())
            .collect();
        b.dirty.extend(keys);
        drop(b);
        self.wake.notify_one();
    }

    pub fn forget(&self, key: &AppKey) {
        let mut b = self.lock();
        b.plans.remove(key);
        b.reports.remove(key);
        b.dirty.remove(key);
    }

    fn mark(&self, mut b: MutexGuard<'_, Board>, key: &AppKey) {
        b.dirty.insert(key.clone());
        drop(b);
        self.wake.notify_one();
    }

    fn lock(&self) -> MutexGuard<'_, Board> {
        self.board.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Patches the status of changed apps, one patch per app per `window`, until
    /// `shutdown`.
    pub async fn write_loop(
        self: Arc<Self>,
        client: kube::Client,
        apps: Store<FederatedMyApp>,
        connected: Arc<dyn Fn(&str) -> bool + Send + Sync>,
        window: Duration,
        shutdown: CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.wake.notified() => {}
            }
            tokio::time::sleep(window).await;
            let now = Time(Timestamp::now());
            let patches: Vec<(AppKey, FederatedMyAppStatus)> = {
                let mut b = self.lock();
                let dirty: Vec<AppKey> = b.dirty.drain().collect();
                dirty
                    .into_iter()
                    .filter_map(|key| {
                        let plan = b.plans.get(&key)?;
                        let current =
                            apps.get(&ObjectRef::new(&key.name).within(&key.namespace))?;
                        let previous = current.status.as_ref();
                        let inputs = Inputs {
                            plan,
                            reports: b.reports.get(&key),
                            connected: &*connected,
                        };
                        let status = compute(&inputs, previous, &now);
                        (previous != Some(&status)).then_some((key, status))
                    })
                    .collect()
            };
            let board = &self;
            futures::stream::iter(patches)
                .for_each_concurrent(8, |(key, status)| {
                    let api: Api<FederatedMyApp> = Api::namespaced(client.clone(), &key.namespace);
                    async move {
                        let patch = Patch::Merge(serde_json::json!({ "status": status }));
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
                                board.lock().dirty.insert(key);
                                board.wake.notify_one();
                            }
                        }
                    }
                })
                .await;
        }
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

    fn report(hash: &str, ready: bool, replicas: i32) -> pb::StatusReport {
        pb::StatusReport {
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

    fn run(
        plan: &Plan,
        reports: &[(&str, pb::StatusReport)],
        connected: &[&str],
    ) -> FederatedMyAppStatus {
        let reports: BTreeMap<String, pb::StatusReport> = reports
            .iter()
            .map(|(c, r)| ((*c).into(), r.clone()))
            .collect();
        let connected = |c: &str| connected.contains(&c);
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
        failed.apply_error = "admission webhook denied".into();
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
        let mut r = report("h1", false, 1);
        r.conditions.push(pb::Condition {
            r#type: "Degraded".into(),
            status: "True".into(),
            reason: "ImageMissing".into(),
            message: "spec.image is not set".into(),
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
        let reports: BTreeMap<String, pb::StatusReport> =
            [("c1".to_owned(), report("h1", true, 3))].into();
        let connected = |_: &str| true;
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
}
