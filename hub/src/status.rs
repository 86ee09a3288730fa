//! Status: the board of plans and agents' reports, and the writer of
//! `FederatedMyApp.status` (the status itself is `flotilla_plan::status::compute`).
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
use flotilla_crds::federated::FederatedMyAppStatus;
use flotilla_plan::AppPlan;
use flotilla_plan::index::AppKey;
use flotilla_plan::status::{Inputs, Report, compute};
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use parking_lot::Mutex;
use serde_json::Value;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

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

/// One app's plan as the board holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Planned {
    pub plan: AppPlan,
    /// The app is being deleted and these clusters have not confirmed it.
    pub deleting_on: Option<Vec<String>>,
}

impl Planned {
    /// The clusters its status reports on.
    fn clusters(&self) -> impl Iterator<Item = &String> {
        self.plan.reported().map(|(c, _)| c)
    }

    /// What a user must fix: the app's error and each cluster's, in words.
    fn errors(&self) -> (Option<String>, Vec<(String, String)>) {
        let failed = self
            .plan
            .reported()
            .filter_map(|(c, p)| Some((c.clone(), p.error()?)));
        (
            self.plan.placement_error.as_ref().map(ToString::to_string),
            failed.collect(),
        )
    }
}

#[derive(Default)]
struct Board {
    plans: HashMap<AppKey, Planned>,
    /// cluster → apps whose plan names it, so that a connect or disconnect finds them
    /// without scanning every plan. One shared key per app.
    apps_on: HashMap<String, HashSet<Arc<AppKey>>>,
    reports: HashMap<AppKey, BTreeMap<String, Report>>,
    connected: HashSet<String>,
}

impl Board {
    /// Makes `plan` the app's plan, moving the app between the clusters' sets.
    fn insert_plan(&mut self, key: &AppKey, plan: Planned) {
        let shared = Arc::new(key.clone());
        for cluster in plan.clusters() {
            self.apps_on
                .entry(cluster.clone())
                .or_default()
                .replace(shared.clone());
        }
        if let Some(previous) = self.plans.insert(key.clone(), plan) {
            let now: HashSet<&String> = self.plans[key].clusters().collect();
            let left = previous.clusters().filter(|c| !now.contains(c));
            remove_from(&mut self.apps_on, left, key);
        }
    }

    fn remove_plan(&mut self, key: &AppKey) {
        if let Some(plan) = self.plans.remove(key) {
            remove_from(&mut self.apps_on, plan.clusters(), key);
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
    pub fn set_plan(&self, key: &AppKey, plan: Planned) -> bool {
        let mut b = self.board.lock();
        let before = b.plans.get(key).map(Planned::errors).unwrap_or_default();
        let changed = before != plan.errors();
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
                let planned = b.plans.get(&key)?;
                let current = apps.get(&ObjectRef::new(&key.name).within(&key.namespace))?;
                let previous = current.status.as_ref();
                let inputs = Inputs {
                    plan: &planned.plan,
                    deleting_on: planned.deleting_on.as_deref(),
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
    use flotilla_plan::render::RenderedMyApp;
    use flotilla_plan::{ClusterPlan, KeepReason};
    use serde_json::Value;

    fn rendered(hash: &str) -> ClusterPlan {
        let hash = hash.into();
        ClusterPlan::Apply(Arc::new(RenderedMyApp {
            hash,
            ..Default::default()
        }))
    }

    fn plan(entries: &[(&str, ClusterPlan)]) -> Planned {
        let clusters = entries.iter().map(|(c, p)| (c.to_string(), p.clone()));
        let plan = AppPlan {
            clusters: clusters.collect(),
            ..Default::default()
        };
        Planned {
            plan,
            deleting_on: None,
        }
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
        assert!(board.set_plan(&key, plan(&[("c1", ClusterPlan::Unknown)])));
        assert!(!board.set_plan(&key, plan(&[("c1", ClusterPlan::Unknown)])));
    }

    #[test]
    fn an_empty_cluster_list_is_cleared_by_the_patch() {
        let planned = plan(&[]);
        let inputs = Inputs {
            plan: &planned.plan,
            deleting_on: None,
            reports: None,
            connected: &HashSet::new(),
        };
        let s = compute(&inputs, None, &Time(Timestamp::now()));
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

    /// A cluster kept only because the app could not be planned is not one its status
    /// reports on, so its connects and disconnects do not touch the app.
    #[test]
    fn the_board_knows_the_apps_on_each_cluster_as_its_plans_name_them() {
        let board = StatusBoard::default();
        let (a, b) = (AppKey::new("ns", "a"), AppKey::new("ns", "b"));
        let failed = || ClusterPlan::Unknown;
        let check = || {
            let b = board.board.lock();
            for cluster in ["c1", "c2", "c3", "c4"] {
                let scanned: HashSet<&AppKey> = b
                    .plans
                    .iter()
                    .filter(|(_, p)| p.clusters().any(|c| c == cluster))
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
            plan(&[
                ("c2", rendered("h")),
                ("c3", ClusterPlan::Keep(KeepReason::FailedOver)),
                ("c4", ClusterPlan::Keep(KeepReason::Unplanned)),
            ]),
        );
        check();
        assert!(!board.board.lock().apps_on.contains_key("c4"));
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
