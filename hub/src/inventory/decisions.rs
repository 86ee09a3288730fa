//! PlacementDecisions: the clusters each FederatedMyApp is placed on, in the cluster
//! inventory API, for the tools that follow a scheduler's choices (Argo CD, Kueue). One
//! decision per app, in the app's namespace, in slices of at most 100 clusters linked by
//! the `decision-key` label (the app's UID); each names the cluster's ClusterProfile and
//! why it was chosen (its share of replicas and the reason).
//!
//! Written when the chosen clusters change. An app whose placement cannot be planned, or
//! that is being deleted, keeps its last decision: a consumer must never read a mistake
//! as "no cluster" and remove what runs. The owner reference removes the slices with the
//! app.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use flotilla_crds::inventory::{
    ClusterDecision, ClusterProfile, DECISION_INDEX_LABEL, DECISION_KEY_LABEL, DECISIONS_PER_SLICE,
    PLACEMENT_KEY_LABEL, PlacementDecision,
};
use flotilla_crds::{FederatedMyApp, MANAGED_BY_LABEL, MANAGED_BY_VALUE, SOURCE_ANNOTATION};
use flotilla_plan::index::AppKey;
use flotilla_plan::{AppPlan, ClusterPlan, KeepReason};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::status::StatusBoard;
use crate::writes::{Failure, Tracker, WriteMetrics};

const KIND: &str = "placementdecision";
const FIELD_MANAGER: &str = "flotilla-hub-inventory";
/// Changes of several apps' placements are taken together over this window.
const WINDOW: Duration = Duration::from_secs(1);
/// Every app is compared with the host this often, whatever changed.
const RESYNC: Duration = Duration::from_secs(300);
// A failed write is tried again with the writers' backoff (0.5 s doubling to 60 s).
/// Slices written per round at most; the rest wait for the next round.
const WRITES_PER_ROUND: usize = 100;
/// What Flotilla calls itself as a scheduler.
const SCHEDULER: &str = "flotilla";
/// Longest object name.
const NAME_MAX: usize = 253;
/// Longest label value.
const LABEL_VALUE_MAX: usize = 63;

/// The clusters the app is placed on, by name, each with why: those sent a MyApp, those
/// whose MyApp cannot be rendered and those a rollout has not reached yet (placed all
/// the same). Not a cluster that failed over, nor one kept because the app as a whole
/// could not be planned or because its namespace is not granted it, nor an unknown name.
pub fn chosen(plan: &AppPlan) -> Vec<(String, String)> {
    let why = |cluster: &str| match plan.schedule.as_ref().and_then(|s| s.clusters.get(cluster)) {
        Some(a) => format!("{:?}: {} replica(s)", a.reason, a.replicas),
        None => "placed".to_owned(),
    };
    plan.clusters
        .iter()
        .filter_map(|(cluster, p)| match p {
            ClusterPlan::Apply(_) => Some((cluster.to_string(), why(cluster))),
            ClusterPlan::Keep(KeepReason::RenderFailed(_)) => Some((
                cluster.to_string(),
                format!("{}; its MyApp cannot be rendered", why(cluster)),
            )),
            ClusterPlan::Keep(KeepReason::Held { .. }) => Some((
                cluster.to_string(),
                format!("{}; the rollout has not reached it yet", why(cluster)),
            )),
            ClusterPlan::Keep(
                KeepReason::FailedOver | KeepReason::Unplanned | KeepReason::NotGranted { .. },
            )
            | ClusterPlan::Unknown => None,
        })
        .collect()
}

/// The name of slice `index` of `app`'s decision: the app's name, a digest of its UID
/// (so that no other app's slice can take the name), the index; within the name limit.
fn slice_name(app: &str, uid: &str, index: usize) -> String {
    let digest = Sha256::digest(uid.as_bytes());
    let tag: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
    let suffix = format!("-{tag}-{index}");
    let mut stem = app.to_owned();
    stem.truncate(NAME_MAX - suffix.len());
    let stem = stem.trim_end_matches(['-', '.']);
    format!("{stem}{suffix}")
}

/// The slices `app`'s decision should have: at least one (an empty one says "no
/// cluster"). `None` for an app the host has not given a UID yet.
pub fn slices(
    app: &FederatedMyApp,
    chosen: &[(String, String)],
    inventory_namespace: &str,
) -> Option<Vec<PlacementDecision>> {
    let (name, uid) = (app.name_any(), app.uid()?);
    let namespace = app.namespace().unwrap_or_else(|| "default".into());
    let chunks: Vec<&[(String, String)]> = match chosen.is_empty() {
        true => vec![&[]],
        false => chosen.chunks(DECISIONS_PER_SLICE).collect(),
    };
    let slices = chunks.into_iter().enumerate().map(|(index, chunk)| {
        let mut labels = BTreeMap::from([
            (MANAGED_BY_LABEL.to_owned(), MANAGED_BY_VALUE.to_owned()),
            (DECISION_KEY_LABEL.to_owned(), uid.clone()),
            (DECISION_INDEX_LABEL.to_owned(), index.to_string()),
        ]);
        if name.len() <= LABEL_VALUE_MAX {
            labels.insert(PLACEMENT_KEY_LABEL.to_owned(), name.clone());
        }
        let decisions = chunk.iter().map(|(cluster, reason)| ClusterDecision {
            cluster_profile_ref: ObjectReference {
                api_version: Some(ClusterProfile::api_version(&()).into_owned()),
                kind: Some(ClusterProfile::kind(&()).into_owned()),
                namespace: Some(inventory_namespace.to_owned()),
                name: Some(cluster.clone()),
                ..Default::default()
            },
            reason: Some(reason.clone()),
        });
        let mut slice = PlacementDecision {
            decisions: decisions.collect(),
            scheduler_name: Some(SCHEDULER.into()),
            ..Default::default()
        };
        let meta = &mut slice.metadata;
        meta.name = Some(slice_name(&name, &uid, index));
        meta.namespace = Some(namespace.clone());
        meta.labels = Some(labels);
        let source = format!("{namespace}/{name}");
        meta.annotations = Some(BTreeMap::from([(SOURCE_ANNOTATION.to_owned(), source)]));
        meta.owner_references = app.owner_ref(&()).map(|r| vec![r]);
        slice
    });
    Some(slices.collect())
}

/// Whether the host's `existing` slice says what `want` does (others' labels aside).
fn current(existing: &PlacementDecision, want: &PlacementDecision) -> bool {
    let has = existing.labels();
    want.labels().iter().all(|(k, v)| has.get(k) == Some(v))
        && (want.owner_references().iter()).all(|o| existing.owner_references().contains(o))
        && existing.decisions == want.decisions
        && existing.scheduler_name == want.scheduler_name
}

/// What to do for one app: slices to apply, and its slices that are no longer wanted
/// (name, uid).
#[derive(Debug, Default, PartialEq)]
pub struct Work {
    pub apply: Vec<PlacementDecision>,
    pub delete: Vec<(String, String)>,
}

/// Compares an app's wanted slices with those the host has (`existing`: the slices of
/// its decision key). Pure.
pub fn work(want: Vec<PlacementDecision>, existing: &[Arc<PlacementDecision>]) -> Work {
    let by_name: HashMap<String, &PlacementDecision> = existing
        .iter()
        .map(|e| (e.name_any(), e.as_ref()))
        .collect();
    let wanted: std::collections::HashSet<String> = want.iter().map(|w| w.name_any()).collect();
    let delete = existing
        .iter()
        .filter(|e| !wanted.contains(&e.name_any()))
        .filter_map(|e| Some((e.name_any(), e.uid()?)))
        .collect();
    let apply = want
        .into_iter()
        .filter(|w| !by_name.get(&w.name_any()).is_some_and(|e| current(e, w)))
        .collect();
    Work { apply, delete }
}

/// Keeps every app's PlacementDecision current while this hub leads; returns at
/// `shutdown`.
pub(super) async fn write_while_leading(
    client: &kube::Client,
    board: &StatusBoard,
    apps: &Store<FederatedMyApp>,
    decisions: &Store<PlacementDecision>,
    inventory_namespace: &str,
    metrics: &WriteMetrics,
    shutdown: &CancellationToken,
) {
    // A new leader looks at every app once: the host may lag any plan.
    board.placements.mark_all(board.apps());
    let mut retries: Tracker<AppKey> = Tracker::default();
    let mut resync = Resync::after(Instant::now());
    loop {
        let tick = resync.wait(Instant::now(), retries.next(Instant::now()));
        let Some(mut keys) = board.placements.take(WINDOW, Some(tick), shutdown).await else {
            return;
        };
        if resync.due(Instant::now()) {
            keys = board.apps();
        }
        keys.extend(retries.due(Instant::now()));
        keys.sort_unstable();
        keys.dedup();
        let mut by_key: HashMap<String, Vec<Arc<PlacementDecision>>> = HashMap::new();
        for d in decisions.state() {
            if let Some(key) = d.labels().get(DECISION_KEY_LABEL) {
                by_key.entry(key.clone()).or_default().push(d);
            }
        }
        let mut written = 0;
        let mut later = Vec::new();
        for key in keys {
            if written >= WRITES_PER_ROUND {
                later.push(key);
                continue;
            }
            let Some(app) = apps.get(&ObjectRef::new(&key.name).within(&key.namespace)) else {
                continue;
            };
            let Some(planned) = board.planned(&key) else {
                continue;
            };
            let deleting =
                app.metadata.deletion_timestamp.is_some() || planned.deleting_on.is_some();
            if deleting || planned.plan.placement_error.is_some() {
                continue;
            }
            let chosen = chosen(&planned.plan);
            let Some(want) = slices(&app, &chosen, inventory_namespace) else {
                continue;
            };
            let existing = app
                .uid()
                .and_then(|u| by_key.remove(&u))
                .unwrap_or_default();
            let work = work(want, &existing);
            let api: Api<PlacementDecision> = Api::namespaced(client.clone(), &key.namespace);
            let mut ok = true;
            for slice in work.apply {
                written += 1;
                ok &= apply(&api, &key, slice, metrics).await;
            }
            for (name, uid) in work.delete {
                ok &= delete(&api, &key, &name, uid).await;
            }
            match ok {
                true => retries.unchanged(&key),
                false => _ = retries.back_off(&key, Instant::now()),
            }
        }
        board.placements.mark_all(later);
        metrics.backlog(KIND, written);
    }
}

/// When every app is next compared with the host, whatever was marked. Only this
/// deadline recomputes them all: a round that takes no key (its wake-up's keys went
/// with the round before) compares nothing.
struct Resync {
    at: Instant,
}

impl Resync {
    fn after(now: Instant) -> Self {
        Self { at: now + RESYNC }
    }

    /// How long the loop may wait for a mark: until the resync or the first retry.
    fn wait(&self, now: Instant, retry: Option<Duration>) -> Duration {
        let until = self.at.saturating_duration_since(now);
        retry.map_or(until, |r| r.min(until))
    }

    /// Whether every app is due now; if so, the next resync is one period later.
    fn due(&mut self, now: Instant) -> bool {
        if now < self.at {
            return false;
        }
        self.at = now + RESYNC;
        true
    }
}

/// Applies one slice; false when it failed.
async fn apply(
    api: &Api<PlacementDecision>,
    key: &AppKey,
    slice: PlacementDecision,
    metrics: &WriteMetrics,
) -> bool {
    let name = slice.name_any();
    let mut body = serde_json::to_value(&slice).expect("a PlacementDecision serializes");
    body["apiVersion"] = PlacementDecision::api_version(&()).into();
    body["kind"] = PlacementDecision::kind(&()).into();
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    match api.patch(&name, &pp, &Patch::Apply(&body)).await {
        Ok(_) => {
            debug!(app = %key, slice = %name, "PlacementDecision written");
            metrics.written(KIND, body.to_string().len());
            true
        }
        Err(e) => {
            metrics.result(KIND, Failure::of(&e).label());
            warn!(app = %key, slice = %name, error = %e, "cluster inventory: writing the PlacementDecision failed");
            false
        }
    }
}

/// Deletes a slice the decision no longer needs, this object only; false when it failed.
async fn delete(api: &Api<PlacementDecision>, key: &AppKey, name: &str, uid: String) -> bool {
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..Default::default()
    };
    match api.delete(name, &dp).await {
        Ok(_) => debug!(app = %key, slice = %name, "PlacementDecision slice deleted"),
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
        Err(e) => {
            warn!(app = %key, slice = %name, error = %e, "cluster inventory: deleting a PlacementDecision slice failed");
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests;
