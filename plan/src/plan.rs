//! Plan: one FederatedMyApp and the registered clusters in, what every cluster must have
//! out. Pure: equal inputs give equal plans, byte for byte.
//!
//! Placement (which clusters) → schedule (replicas per cluster) → per placed cluster
//! with replicas: render (template + replicas + that cluster's overrides + schema check +
//! hash). The result is one [`ClusterPlan`] per cluster, so that what the index is told
//! and what status says cannot disagree: a cluster is sent a MyApp, kept as it is (and
//! why), or named but unknown. The index reads it as [`Desired`] ([`AppPlan::desired`]),
//! status as the clusters it reports on ([`AppPlan::reported`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use arcstr::ArcStr;
use flotilla_crds::FederatedMyApp;
use flotilla_crds::bounds::Bounds;
use flotilla_crds::federated::SchedulingReason;
use rayon::prelude::*;

use crate::admission::{Admission, Refusal};
use crate::grants::{Granted, Grants, NothingGranted};
use crate::index::Desired;
use crate::overrides::{Located, Targets};
use crate::placement::{self, ClusterName, Decision, Labels, Members, SelectorError};
use crate::render::{RenderError, RenderedMyApp, Share, Template};
use crate::schedule::{self, Assignment, Schedule, ScheduleError};

/// What status says of a cluster named in `spec.placement.clusters` that is not
/// registered.
pub const UNKNOWN_CLUSTER: &str =
    "cluster is named in spec.placement.clusters but is not a registered MemberCluster";
/// What status says of a cluster that failed over.
pub const FAILED_OVER: &str = "NotReady past the failover grace period: its replicas moved to other clusters; its MyApp is left as it is until the cluster is Ready again";

/// What the planner decided for one cluster. A big hub's plans hold one per (cluster,
/// app), a million of them, so it stays two words: what is rare (a render error, a
/// namespace not granted) sits behind a pointer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterPlan {
    /// Exactly this MyApp (shared by the clusters that got the same bytes).
    Apply(Arc<RenderedMyApp>),
    /// Whatever the member runs now stays: never a reason to delete it.
    Keep(KeepReason),
    /// Named in `spec.placement.clusters` but not a registered MemberCluster: nothing to
    /// send, and nothing there to keep.
    Unknown,
}

const _: () = assert!(size_of::<ClusterPlan>() <= 16);

/// A cluster a rollout holds back, as it is.
pub const HELD: ClusterPlan = ClusterPlan::Keep(KeepReason::Held { resized: None });

/// Why a cluster keeps what it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeepReason {
    /// Its MyApp cannot be rendered (an override, the schema): this cluster's error.
    RenderFailed(Box<RenderError>),
    /// NotReady past the failover grace period: its share runs elsewhere, its copy is
    /// left as it was. Not an error, and not counted as placed.
    FailedOver,
    /// Where it runs now is unknown, so it keeps what it has: every registered cluster
    /// when the app as a whole cannot be planned ([`AppPlan::placement_error`]); a
    /// cluster that takes no new replicas (NotReady within the grace period, cordoned)
    /// and is given none. Status does not report on it.
    Unplanned,
    /// A progressive rollout has not reached it yet ([`crate::rollout`]): it runs
    /// another revision, or nothing, until its wave. `resized`: the revision of the last
    /// complete rollout it runs, rendered again with its current share of replicas, sent
    /// as an Apply (a division, capacity or failover move is not held by a rollout).
    Held { resized: Option<Arc<RenderedMyApp>> },
    /// Placement chooses it, but the app's namespace is not granted it
    /// ([`crate::grants`]): nothing new goes there and what runs there stays (a grant
    /// withdrawn is not a deletion). `named`: `spec.placement.clusters` names it, and
    /// status says so; one a selector matches is left out of status.
    NotGranted { namespace: ArcStr, named: bool },
}

impl ClusterPlan {
    /// The MyApp to send, for an Apply.
    pub fn rendered(&self) -> Option<&Arc<RenderedMyApp>> {
        match self {
            ClusterPlan::Apply(r) => Some(r),
            ClusterPlan::Keep(_) | ClusterPlan::Unknown => None,
        }
    }

    /// What a user must fix for this cluster, in words (status shows it as
    /// `RenderFailed`, an Event repeats it): a failed render or an unknown cluster; or a
    /// named cluster the namespace is not granted (`NotGranted`).
    pub fn error(&self) -> Option<String> {
        match self {
            ClusterPlan::Keep(KeepReason::RenderFailed(e)) => Some(e.to_string()),
            ClusterPlan::Unknown => Some(UNKNOWN_CLUSTER.to_owned()),
            ClusterPlan::Keep(KeepReason::NotGranted {
                namespace,
                named: true,
            }) => Some(not_granted(namespace)),
            ClusterPlan::Apply(_) | ClusterPlan::Keep(_) => None,
        }
    }

    /// The reason that goes with [`ClusterPlan::error`] in status and Events.
    pub fn error_reason(&self) -> &'static str {
        match self {
            ClusterPlan::Keep(KeepReason::NotGranted { .. }) => "NotGranted",
            _ => "RenderFailed",
        }
    }

    /// Whether status reports on this cluster: not when it is kept because the app as a
    /// whole could not be planned (the app's error says why), nor when a selector
    /// matches it but the namespace is not granted it.
    pub fn is_reported(&self) -> bool {
        !matches!(
            self,
            ClusterPlan::Keep(KeepReason::Unplanned | KeepReason::NotGranted { named: false, .. })
        )
    }

    /// What the index holds for the cluster; `None`: nothing (an unknown cluster).
    pub fn desired(&self) -> Option<Desired> {
        match self {
            ClusterPlan::Apply(r)
            | ClusterPlan::Keep(KeepReason::Held {
                resized: Some(r), ..
            }) => Some(Desired::Apply(r.clone())),
            ClusterPlan::Keep(_) => Some(Desired::Keep),
            ClusterPlan::Unknown => None,
        }
    }
}

/// What status and Events say of a cluster `spec.placement.clusters` names that the
/// app's namespace is not granted.
pub fn not_granted(namespace: &str) -> String {
    format!(
        "cluster is not granted to namespace {namespace} (no ClusterGrant there names or selects it): nothing new is placed there, what runs there stays"
    )
}

/// Why nothing of an app can be planned: every cluster keeps what it has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error(transparent)]
    NotGranted(#[from] NothingGranted),
    #[error(transparent)]
    Placement(#[from] SelectorError),
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
}

impl AppError {
    /// The reason of the status condition and the Event that report it.
    pub fn reason(&self) -> &'static str {
        match self {
            AppError::Refused(r) => r.reason(),
            AppError::NotGranted(_) => "NotGranted",
            AppError::Placement(_) | AppError::Schedule(_) => "InvalidPlacement",
        }
    }
}

/// What the hub decided for one app at one generation.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AppPlan {
    pub generation: Option<i64>,
    /// The placement or the division as a whole is invalid; then every registered
    /// cluster is [`KeepReason::Unplanned`].
    pub placement_error: Option<AppError>,
    /// Replicas per placed cluster and why, for `status.clusters[].replicas`. Under
    /// Duplicated, what each rendered MyApp asks for after overrides.
    pub schedule: Option<Schedule>,
    /// Placed clusters and named unknown ones (every registered cluster when the app
    /// cannot be planned), sorted by name.
    pub clusters: BTreeMap<ClusterName, ClusterPlan>,
    /// Things the user wrote that have no effect, e.g. overrides for unplaced clusters.
    pub warnings: Vec<String>,
    /// Where a progressive rollout stands ([`crate::rollout::gate`]); `None` for type
    /// All.
    pub rollout: Option<flotilla_crds::federated::RolloutStatus>,
}

impl AppPlan {
    /// The index's view: what each cluster should have.
    pub fn desired(&self) -> BTreeMap<ClusterName, Desired> {
        self.clusters
            .iter()
            .filter_map(|(c, p)| Some((c.clone(), p.desired()?)))
            .collect()
    }

    /// The clusters status reports on ([`ClusterPlan::is_reported`]).
    pub fn reported(&self) -> impl Iterator<Item = (&ClusterName, &ClusterPlan)> {
        self.clusters.iter().filter(|(_, p)| p.is_reported())
    }
}

/// [`plan`] for each app, in order, on every core: each plan reads only its app and what
/// is passed in, and a hub planning from cold (or after a fleet-wide change) has every
/// app to plan.
pub fn plan_each<A>(
    apps: &[A],
    members: &Members,
    admission: &Admission,
    grants: &Grants,
) -> Vec<AppPlan>
where
    A: std::ops::Deref<Target = FederatedMyApp> + Sync,
{
    apps.par_iter()
        .map(|app| plan(app, members, admission, grants))
        .collect()
}

/// Admits, places, schedules and renders one FederatedMyApp. The app fails as a whole
/// only when `admission` refuses it, its namespace is granted no cluster, or the
/// placement or the division is invalid; each cluster's failure is that cluster's alone.
/// Replicas are divided among the granted clusters only.
pub fn plan(
    app: &FederatedMyApp,
    members: &Members,
    admission: &Admission,
    grants: &Grants,
) -> AppPlan {
    let generation = app.metadata.generation;
    match place_and_schedule(app, members, admission, grants) {
        Ok((decision, schedule)) => placed(app, members, decision, schedule, generation),
        Err(e) => AppPlan {
            generation,
            placement_error: Some(e),
            clusters: members
                .keys()
                .map(|c| (c.clone(), ClusterPlan::Keep(KeepReason::Unplanned)))
                .collect(),
            ..AppPlan::default()
        },
    }
}

fn place_and_schedule(
    app: &FederatedMyApp,
    members: &Members,
    admission: &Admission,
    grants: &Grants,
) -> Result<(Decision, Schedule), AppError> {
    admission.admit(app)?;
    let namespace = app.metadata.namespace.as_deref().unwrap_or("default");
    let granted = grants.granted(namespace, members)?;
    let mut decision = placement::place(&app.spec.placement, members)?;
    if let Granted::Only(_) = &granted {
        let (placed, refused) = (decision.clusters.drain(..)).partition(|c| granted.allows(c));
        (decision.clusters, decision.not_granted) = (placed, refused);
    }
    let inputs = schedule::Inputs::for_app(app, &decision.clusters, members)?;
    let schedule = schedule::schedule(&inputs)?;
    Ok((decision, schedule))
}

/// What a placed cluster gets before anything is rendered.
enum Placing {
    /// Its MyApp, rendered with its replicas.
    Render,
    /// Nothing: no replicas.
    Skip,
    /// What it runs, left as it is.
    Keep(KeepReason),
}

/// A failed-over cluster keeps its copy. One that takes no new replicas (NotReady within
/// the grace period, cordoned) and is given none keeps what it has too: its share is
/// read from the status, which may lag the plan (status writes go through a budget), and
/// a cluster that cannot take part is never planned off on a share the status did not
/// show yet.
fn placing(assigned: &Assignment) -> Placing {
    match assigned.reason {
        SchedulingReason::FailedOver => Placing::Keep(KeepReason::FailedOver),
        _ if assigned.replicas > 0 => Placing::Render,
        SchedulingReason::NotReady | SchedulingReason::Cordoned => {
            Placing::Keep(KeepReason::Unplanned)
        }
        _ => Placing::Skip,
    }
}

/// Renders each placed cluster that runs replicas, once per class of clusters that
/// render alike ([`Classes`]): most clusters have no override, so most share one render.
fn placed(
    app: &FederatedMyApp,
    members: &Members,
    decision: Decision,
    mut schedule: Schedule,
    generation: Option<i64>,
) -> AppPlan {
    let targets = Targets::of(&app.spec.overrides);
    let warnings = unplaced_overrides(&targets, members, &decision.clusters);
    let template = Template::of(app);
    let mut classes = Classes::default();
    // Gathered, then built at once: a B-tree filled by one insert after another keeps
    // its nodes about half full, and a big hub holds one entry per (cluster, app).
    let mut clusters = Vec::new();
    for cluster in &decision.clusters {
        let Some(assigned) = schedule.clusters.get_mut(cluster) else {
            continue;
        };
        match placing(assigned) {
            Placing::Render => {}
            Placing::Skip => continue,
            Placing::Keep(reason) => {
                clusters.push((cluster.clone(), ClusterPlan::Keep(reason)));
                continue;
            }
        }
        let share = share_of(schedule.divided, &schedule.bounds, cluster, assigned);
        let labels = members.get(cluster).map(|m| &m.labels);
        let ops = targets.for_cluster(cluster, labels.unwrap_or(&NO_LABELS));
        let rendered = ops
            .map_err(RenderError::from)
            .and_then(|ops| classes.render(&template, &ops, share));
        let planned = match rendered {
            Ok((rendered, asked)) => {
                if !schedule.divided {
                    assigned.replicas = asked;
                }
                ClusterPlan::Apply(rendered)
            }
            Err(e) => ClusterPlan::Keep(KeepReason::RenderFailed(Box::new(e))),
        };
        clusters.push((cluster.clone(), planned));
    }
    for cluster in decision.unknown {
        clusters.push((cluster, ClusterPlan::Unknown));
    }
    let namespace = ArcStr::from(app.metadata.namespace.as_deref().unwrap_or("default"));
    let named = app.spec.placement.clusters.is_some();
    for cluster in decision.not_granted {
        let reason = KeepReason::NotGranted {
            namespace: namespace.clone(),
            named,
        };
        clusters.push((cluster, ClusterPlan::Keep(reason)));
    }
    AppPlan {
        generation,
        placement_error: None,
        schedule: Some(schedule),
        // Placed, unknown and not granted are disjoint sets of names (`Decision`).
        clusters: BTreeMap::from_iter(clusters),
        warnings,
        rollout: None,
    }
}

/// What a placed cluster's MyApp is rendered with: under a divided mode its replicas,
/// under autoscaling its minimum and its bounds.
fn share_of(
    divided: bool,
    bounds: &BTreeMap<ClusterName, Bounds>,
    cluster: &str,
    assigned: &Assignment,
) -> Share {
    let bounds = bounds.get(cluster).copied();
    let replicas = match bounds {
        Some(b) => Some(b.min),
        None => divided.then_some(assigned.replicas),
    };
    Share { replicas, bounds }
}

/// One app's renders by class of clusters: clusters with the same override operations
/// (by content) and, under a division, the same assigned replicas render the same bytes,
/// so each class is rendered once. A class whose render fails renders each of its
/// clusters alone: the error names that cluster's own override fields. Classes that
/// happen to render the same bytes still share one copy (and hash).
#[derive(Default)]
struct Classes<'a> {
    /// Each class's render and the replicas it asks for; `None`: it fails.
    outcomes: HashMap<ClassKey<'a>, Option<(Arc<RenderedMyApp>, u32)>>,
    by_hash: HashMap<String, Arc<RenderedMyApp>>,
}

impl<'a> Classes<'a> {
    fn render(
        &mut self,
        template: &Template<'_>,
        ops: &[Located<'a>],
        share: Share,
    ) -> Result<(Arc<RenderedMyApp>, u32), RenderError> {
        let key = ClassKey::of(ops, share);
        let known = match self.outcomes.get(&key) {
            Some(Some((rendered, asked))) => return Ok((rendered.clone(), *asked)),
            Some(None) => true,
            None => false,
        };
        let result = template.render(ops, share).map(|r| {
            let shared = self.by_hash.entry(r.myapp.hash.clone());
            (
                shared.or_insert_with(|| Arc::new(r.myapp)).clone(),
                r.replicas,
            )
        });
        if !known {
            self.outcomes.insert(key, result.as_ref().ok().cloned());
        }
        result
    }
}

/// What a render depends on besides the template: the operations by content (not by
/// where they are written, which only error messages name) and the cluster's share.
#[derive(PartialEq, Eq, Hash)]
struct ClassKey<'a> {
    ops: Vec<(&'static str, &'a str, Option<String>)>,
    share: Share,
}

impl<'a> ClassKey<'a> {
    fn of(ops: &[Located<'a>], share: Share) -> Self {
        Self {
            ops: ops.iter().map(Located::key).collect(),
            share,
        }
    }
}

static NO_LABELS: Labels = Labels::new();

fn unplaced_overrides(
    targets: &Targets<'_>,
    members: &Members,
    placed: &[ClusterName],
) -> Vec<String> {
    targets.unused(placed, |c| members.get(c).map_or(&NO_LABELS, |m| &m.labels))
}

#[cfg(test)]
mod granted;

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_crds::federated::{ClusterOverrides, ClusterStatus, FederatedMyAppStatus};
    use serde_json::{Value, json};

    use crate::placement::Member;
    use crate::render::{HASH_ANNOTATION, MANAGED_BY_LABEL, MANAGED_BY_VALUE, SOURCE_ANNOTATION};

    const SEED: &str = include_str!("../../examples/federatedmyapp.yaml");

    fn app(yaml: &str) -> FederatedMyApp {
        serde_yaml::from_str(yaml).expect("valid FederatedMyApp YAML")
    }

    fn members(names: &[&str]) -> Members {
        names
            .iter()
            .map(|n| ((*n).into(), Default::default()))
            .collect()
    }

    /// The plan, or the app's error when it has one.
    fn render(app: &FederatedMyApp, members: &Members) -> Result<AppPlan, AppError> {
        let planned = plan(app, members, &Admission::default(), &Grants::default());
        match planned.placement_error {
            Some(e) => Err(e),
            None => Ok(planned),
        }
    }

    fn replicas(r: &AppPlan) -> BTreeMap<&str, Value> {
        r.clusters
            .iter()
            .filter_map(|(c, m)| Some((&**c, m.rendered()?.to_value()["spec"]["replicas"].clone())))
            .collect()
    }

    fn ok(r: &AppPlan, cluster: &str) -> Value {
        r.clusters[cluster]
            .rendered()
            .expect("cluster renders")
            .to_value()
    }

    fn err<'a>(r: &'a AppPlan, cluster: &str) -> &'a RenderError {
        match &r.clusters[cluster] {
            ClusterPlan::Keep(KeepReason::RenderFailed(e)) => e,
            other => panic!("cluster fails: {other:?}"),
        }
    }

    fn is_ok(r: &AppPlan, cluster: &str) -> bool {
        r.clusters[cluster].rendered().is_some()
    }

    fn with_overrides(overrides: &str) -> FederatedMyApp {
        app(&format!(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {{name: web, namespace: prod}}\n\
             spec:\n  placement: {{clusters: [{{name: c1}}, {{name: c2}}]}}\n  template:\n    \
             metadata: {{labels: {{team: blue}}}}\n    spec: {{replicas: 3, image: 'nginx:1.27'}}\n  \
             overrides:\n{overrides}"
        ))
    }

    #[test]
    fn seed_example_gives_cluster1_three_and_cluster2_five_replicas() {
        let r = render(&app(SEED), &members(&["cluster1", "cluster2"])).unwrap();
        assert_eq!(ok(&r, "cluster1")["spec"], json!({"replicas": 3}));
        assert_eq!(ok(&r, "cluster2")["spec"], json!({"replicas": 5}));
        assert!(r.warnings.is_empty());
        let m = ok(&r, "cluster1");
        assert_eq!(m["apiVersion"], "app.example.com/v1");
        assert_eq!(m["kind"], "MyApp");
        assert_eq!(m["metadata"]["name"], "my-app-sample");
        assert_eq!(m["metadata"]["namespace"], "default");
        assert_eq!(m["metadata"]["labels"][MANAGED_BY_LABEL], MANAGED_BY_VALUE);
        assert_eq!(
            m["metadata"]["annotations"][SOURCE_ANNOTATION],
            "default/my-app-sample"
        );
    }

    #[test]
    fn hash_annotation_matches_and_differs_per_content() {
        let r = render(&app(SEED), &members(&["cluster1", "cluster2"])).unwrap();
        let one = r.clusters["cluster1"].rendered().unwrap();
        let two = r.clusters["cluster2"].rendered().unwrap();
        assert_eq!(
            one.to_value()["metadata"]["annotations"][HASH_ANNOTATION],
            one.hash.as_str()
        );
        assert_eq!(one.hash.len(), 64);
        assert_ne!(one.hash, two.hash);
    }

    #[test]
    fn rendering_is_deterministic() {
        let a = render(&app(SEED), &members(&["cluster1", "cluster2"])).unwrap();
        let b = render(&app(SEED), &members(&["cluster2", "cluster1"])).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn template_labels_and_annotations_are_merged() {
        let a = with_overrides(
            "  - clusterName: c2\n    clusterOverrides:\n    - {op: add, path: /metadata/labels/tier, value: gold}\n",
        );
        let r = render(&a, &members(&["c1", "c2"])).unwrap();
        assert_eq!(
            ok(&r, "c1")["metadata"]["labels"],
            json!({"team": "blue", MANAGED_BY_LABEL: MANAGED_BY_VALUE})
        );
        assert_eq!(ok(&r, "c2")["metadata"]["labels"]["tier"], "gold");
    }

    #[test]
    fn a_template_label_cannot_take_over_the_managed_by_label() {
        let a = with_overrides(
            "  - clusterName: c2\n    clusterOverrides:\n    - {op: add, path: /metadata/labels/app.kubernetes.io~1managed-by, value: helm}\n",
        );
        let r = render(&a, &members(&["c1", "c2"])).unwrap();
        assert_eq!(
            ok(&r, "c2")["metadata"]["labels"][MANAGED_BY_LABEL],
            MANAGED_BY_VALUE
        );
    }

    #[test]
    fn type_mismatch_is_reported_with_cluster_field_and_path() {
        let a = with_overrides(
            "  - clusterName: c2\n    clusterOverrides:\n    - {path: /spec/replicas, value: five}\n",
        );
        let r = render(&a, &members(&["c1", "c2"])).unwrap();
        assert!(is_ok(&r, "c1"), "the other cluster still renders");
        let RenderError::Invalid {
            path,
            reason,
            culprit,
        } = err(&r, "c2")
        else {
            panic!("{:?}", err(&r, "c2"))
        };
        assert_eq!(path, "/spec/replicas");
        assert!(
            reason.contains("\"five\" is not of type \"integer\""),
            "{reason}"
        );
        assert_eq!(
            culprit.as_deref(),
            Some("spec.overrides[0].clusterOverrides[0]")
        );
        assert!(
            err(&r, "c2")
                .to_string()
                .ends_with("(set by spec.overrides[0].clusterOverrides[0])")
        );
    }

    #[test]
    fn schema_limits_of_the_seed_are_enforced() {
        for (value, want) in [
            ("11", "greater than the maximum of 10"),
            ("0", "less than the minimum of 1"),
        ] {
            let a = with_overrides(&format!(
                "  - clusterName: c1\n    clusterOverrides:\n    - {{path: /spec/replicas, value: {value}}}\n"
            ));
            let r = render(&a, &members(&["c1", "c2"])).unwrap();
            assert!(
                err(&r, "c1").to_string().contains(want),
                "{}",
                err(&r, "c1")
            );
        }
        let a = with_overrides(
            "  - clusterName: c1\n    clusterOverrides:\n    - {path: /spec/image, value: nginx}\n",
        );
        let r = render(&a, &members(&["c1", "c2"])).unwrap();
        let e = err(&r, "c1").to_string();
        assert!(
            e.contains("/spec/image") && e.contains("does not match \"^.+:.+$\""),
            "{e}"
        );
    }

    #[test]
    fn override_errors_stay_with_their_cluster() {
        let a = with_overrides(
            "  - clusterName: c2\n    clusterOverrides:\n    - {op: remove, path: /spec/port}\n",
        );
        let r = render(&a, &members(&["c1", "c2"])).unwrap();
        assert!(is_ok(&r, "c1"));
        let RenderError::Override(e) = err(&r, "c2") else {
            panic!()
        };
        assert_eq!((e.op, e.path.as_str()), ("remove", "/spec/port"));
    }

    #[test]
    fn overrides_for_unplaced_clusters_are_ignored_with_a_warning() {
        let a = with_overrides(
            "  - clusterName: c9\n    clusterOverrides:\n    - {path: /spec/replicas, value: 1}\n",
        );
        let r = render(&a, &members(&["c1", "c2", "c9"])).unwrap();
        assert_eq!(
            r.clusters.keys().map(|c| &**c).collect::<Vec<_>>(),
            ["c1", "c2"]
        );
        assert_eq!(
            r.warnings,
            ["overrides for cluster c9 are ignored: it is not placed"]
        );
    }

    #[test]
    fn unknown_named_clusters_are_reported_and_the_rest_render() {
        let r = render(&app(SEED), &members(&["cluster1"])).unwrap();
        assert!(is_ok(&r, "cluster1"));
        assert_eq!(r.clusters["cluster2"], ClusterPlan::Unknown);
        assert_eq!(
            r.clusters["cluster2"].error().as_deref(),
            Some(UNKNOWN_CLUSTER)
        );
    }

    #[test]
    fn empty_template_renders_an_empty_spec() {
        let a = app(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: e}\nspec:\n  placement: {clusters: [{name: c1}]}\n",
        );
        let r = render(&a, &members(&["c1"])).unwrap();
        assert_eq!(ok(&r, "c1")["spec"], json!({}));
        assert_eq!(ok(&r, "c1")["metadata"]["namespace"], "default");
    }

    #[test]
    fn removing_the_whole_spec_renders_an_empty_spec() {
        let a = with_overrides(
            "  - clusterName: c1\n    clusterOverrides:\n    - {op: remove, path: /spec}\n",
        );
        let r = render(&a, &members(&["c1", "c2"])).unwrap();
        assert_eq!(ok(&r, "c1")["spec"], json!({}));
    }

    #[test]
    fn non_string_label_is_invalid() {
        let a = with_overrides(
            "  - clusterName: c1\n    clusterOverrides:\n    - {op: add, path: /metadata/labels/n, value: 5}\n",
        );
        let r = render(&a, &members(&["c1", "c2"])).unwrap();
        assert_eq!(
            err(&r, "c1").to_string(),
            "the rendered MyApp is invalid at /metadata/labels/n: must be a string (set by spec.overrides[0].clusterOverrides[0])"
        );
    }

    #[test]
    fn invalid_template_without_overrides_blames_no_override() {
        let mut a = app(SEED);
        a.spec.template.spec.replicas = Some(42);
        a.spec.overrides = vec![ClusterOverrides::named("cluster1", vec![])];
        let r = render(&a, &members(&["cluster1", "cluster2"])).unwrap();
        let RenderError::Invalid { culprit, .. } = err(&r, "cluster1") else {
            panic!()
        };
        assert_eq!(culprit, &None);
    }

    #[test]
    fn invalid_selector_fails_the_whole_app() {
        let a = app(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: s}\nspec:\n  placement:\n    clusterSelector: {matchExpressions: [{key: region, operator: In}]}\n",
        );
        let AppError::Placement(e) = render(&a, &members(&["c1"])).unwrap_err() else {
            panic!("a selector error")
        };
        assert_eq!(
            e.field,
            "spec.placement.clusterSelector.matchExpressions[0]"
        );
    }

    #[test]
    fn null_members_read_as_absent() {
        let a = with_overrides(
            "  - clusterName: c1\n    clusterOverrides:\n    - {op: add, path: /spec/strategy, value: {maxSurge: null, maxUnavailable: 2}}\n",
        );
        let r = render(&a, &members(&["c1", "c2"])).unwrap();
        assert_eq!(
            ok(&r, "c1")["spec"]["strategy"],
            json!({"maxUnavailable": 2})
        );
    }

    fn weighted(extra: &str) -> FederatedMyApp {
        app(&format!(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {{name: web, namespace: prod}}\n\
             spec:\n  placement:\n    clusters: [{{name: c1}}, {{name: c2}}, {{name: c3}}]\n    \
             replicaScheduling: {{mode: Weighted, totalReplicas: 12, preferences: [{{clusterNames: [c1], weight: 2}}, {{clusterNames: [c3], weight: 0}}]}}\n  \
             template:\n    spec: {{replicas: 3, image: 'nginx:1.27'}}\n{extra}"
        ))
    }

    #[test]
    fn a_division_writes_each_clusters_replicas_and_skips_clusters_with_none() {
        let r = render(&weighted(""), &members(&["c1", "c2", "c3"])).unwrap();
        assert_eq!(replicas(&r), [("c1", json!(8)), ("c2", json!(4))].into());
        assert!(!r.clusters.contains_key("c3"), "assigned 0: no MyApp");
        let schedule = r.schedule.as_ref().unwrap();
        assert_eq!(schedule.clusters["c3"].replicas, 0);
        assert_eq!(schedule.total(), 12);
    }

    /// [`weighted`] with `spec.autoscaling` from 3 to `max` in place of its total.
    fn autoscaled(max: i32, extra: &str) -> FederatedMyApp {
        let mut a = weighted(&format!(
            "  autoscaling: {{minReplicas: 3, maxReplicas: {max}}}\n{extra}"
        ));
        let scheduling = a.spec.placement.replica_scheduling.as_mut();
        scheduling.expect("weighted").total_replicas = None;
        a
    }

    #[test]
    fn autoscaling_renders_each_clusters_minimum_and_bounds() {
        let a = autoscaled(12, "");
        let r = render(&a, &members(&["c1", "c2", "c3"])).unwrap();
        assert_eq!(replicas(&r), [("c1", json!(2)), ("c2", json!(1))].into());
        let c1 = ok(&r, "c1");
        let annotations = &c1["metadata"]["annotations"];
        assert_eq!(annotations[flotilla_crds::bounds::MIN_ANNOTATION], "2");
        assert_eq!(annotations[flotilla_crds::bounds::MAX_ANNOTATION], "8");
        assert_eq!(annotations[flotilla_crds::bounds::SHARE_ANNOTATION], "8/12");
        let schedule = r.schedule.as_ref().unwrap();
        assert_eq!(
            schedule.clusters["c1"].replicas, 8,
            "status shows the maximum"
        );
        let mut status = FederatedMyAppStatus {
            clusters: vec![ClusterStatus {
                name: "c1".into(),
                ..ClusterStatus::default()
            }],
            ..FederatedMyAppStatus::default()
        };
        crate::schedule::annotate(&mut status, schedule);
        assert_eq!(
            (status.clusters[0].min_replicas, status.clusters[0].replicas),
            (Some(2), Some(8))
        );
    }

    #[test]
    fn bounds_alone_never_change_a_revision() {
        let with = |max: i32| {
            let a = autoscaled(max, "  rollout: {type: Progressive}\n");
            let r = render(&a, &members(&["c1", "c2", "c3"])).unwrap();
            let c1 = r.clusters["c1"].rendered().unwrap().hash.clone();
            c1[..crate::render::REVISION_LEN].to_owned()
        };
        assert_eq!(with(12), with(15));
    }

    #[test]
    fn an_override_of_replicas_under_a_division_is_that_clusters_error() {
        for op in [
            "{path: /spec/replicas, value: 5}",
            "{op: remove, path: /spec/replicas}",
            "{op: replace, path: /spec, value: {image: 'nginx:1'}}",
        ] {
            let a = weighted(&format!(
                "  overrides:\n  - clusterName: c2\n    clusterOverrides:\n    - {{op: add, path: /spec/port, value: 80}}\n    - {op}\n"
            ));
            let r = render(&a, &members(&["c1", "c2", "c3"])).unwrap();
            assert!(is_ok(&r, "c1"));
            assert_eq!(
                err(&r, "c2"),
                &RenderError::ReplicasOverridden {
                    assigned: 4,
                    culprit: "spec.overrides[0].clusterOverrides[1]".into()
                },
                "{op}"
            );
        }
        // Setting it to what the division says anyway is harmless.
        let a = weighted(
            "  overrides:\n  - clusterName: c2\n    clusterOverrides:\n    - {path: /spec/replicas, value: 4}\n",
        );
        assert!(is_ok(
            &render(&a, &members(&["c1", "c2", "c3"])).unwrap(),
            "c2"
        ));
    }

    #[test]
    fn duplicated_status_shows_what_each_cluster_runs_after_overrides() {
        let r = render(&app(SEED), &members(&["cluster1", "cluster2"])).unwrap();
        let schedule = r.schedule.as_ref().unwrap();
        assert!(!schedule.divided);
        let got: Vec<_> = schedule
            .clusters
            .values()
            .map(|a| (a.replicas, a.reason))
            .collect();
        assert_eq!(
            got,
            [
                (3, SchedulingReason::Duplicated),
                (5, SchedulingReason::Duplicated)
            ]
        );
    }

    #[test]
    fn an_infeasible_division_fails_the_whole_app() {
        let a = app(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: big}\nspec:\n  placement:\n    \
             clusters: [{name: c1}]\n    replicaScheduling: {mode: Weighted, totalReplicas: 11}\n",
        );
        let AppError::Schedule(e) = render(&a, &members(&["c1"])).unwrap_err() else {
            panic!("a schedule error")
        };
        assert_eq!(e.field, "spec.placement.replicaScheduling.totalReplicas");
    }

    fn in_namespace(namespace: &str) -> FederatedMyApp {
        let mut a = app(SEED);
        a.metadata.namespace = Some(namespace.into());
        a
    }

    /// An app in a forbidden namespace is planned nowhere: no cluster is sent a MyApp,
    /// and status names the namespace and the rule.
    #[test]
    fn an_app_in_a_forbidden_namespace_reaches_no_cluster() {
        let clusters = members(&["cluster1", "cluster2", "cluster3"]);
        for namespace in [
            "kube-system",
            "kube-public",
            "kube-node-lease",
            "flotilla-system",
        ] {
            let p = plan(
                &in_namespace(namespace),
                &clusters,
                &Admission::default(),
                &Grants::default(),
            );
            let e = p.placement_error.as_ref().expect("refused");
            assert_eq!(e.reason(), "NamespaceForbidden");
            assert!(
                e.to_string()
                    .starts_with(&format!("namespace {namespace} is forbidden"))
            );
            assert!(p.clusters.values().all(|c| c.rendered().is_none()), "{p:?}");
            assert_eq!(p.reported().count(), 0);
        }
    }

    /// A policy that newly forbids an app's namespace must not delete what its clusters
    /// run (refusing to place is never a reason to delete): every cluster keeps its copy,
    /// and nothing is pushed.
    #[test]
    fn a_newly_forbidden_namespace_keeps_what_members_run() {
        let clusters = members(&["cluster1", "cluster2"]);
        let key = crate::AppKey::new("default", "my-app-sample");
        let mut index = crate::index::compact::CompactIndex::default();
        let allowed = plan(
            &app(SEED),
            &clusters,
            &Admission::default(),
            &Grants::default(),
        );
        assert_eq!(index.set_app(&key, Some(1), allowed.desired()).len(), 2);
        let strict = Admission {
            namespaces: flotilla_crds::tenancy::NamespacePolicy::new(
                "flotilla-system",
                ["default"],
            ),
            ..Admission::default()
        };
        let refused = plan(&app(SEED), &clusters, &strict, &Grants::default());
        assert!(refused.placement_error.is_some());
        assert_eq!(refused.desired().len(), 2, "every cluster is kept");
        assert!(refused.desired().values().all(|d| *d == Desired::Keep));
        assert!(index.set_app(&key, Some(1), refused.desired()).is_empty());
    }

    /// Overrides cannot move a MyApp into another namespace: the namespace is the app's.
    #[test]
    fn an_override_cannot_change_the_namespace_or_name() {
        for path in ["/metadata/namespace", "/metadata/name", "/metadata"] {
            let a = with_overrides(&format!(
                "  - clusterName: c2\n    clusterOverrides:\n    - {{op: add, path: {path}, value: kube-system}}\n"
            ));
            let r = render(&a, &members(&["c1", "c2"])).unwrap();
            let RenderError::Override(e) = err(&r, "c2") else {
                panic!("{path}: {:?}", err(&r, "c2"))
            };
            assert!(e.reason.starts_with("path must be within"), "{path}: {e}");
            assert_eq!(ok(&r, "c1")["metadata"]["namespace"], "prod");
        }
    }

    /// Size limits refuse the app as a whole, naming the field and the limit.
    #[test]
    fn an_app_over_a_size_limit_is_planned_nowhere() {
        let mut a = app(SEED);
        a.spec.template.spec.config = [("big".to_owned(), "x".repeat(300 * 1024))].into();
        let p = plan(
            &a,
            &members(&["cluster1", "cluster2"]),
            &Admission::default(),
            &Grants::default(),
        );
        let e = p.placement_error.expect("refused");
        assert_eq!(e.reason(), "TooLarge");
        assert!(e.to_string().starts_with("spec.template is "), "{e}");
        assert!(p.clusters.values().all(|c| c.rendered().is_none()));
    }

    #[test]
    fn a_failed_over_cluster_is_left_as_it_is() {
        let mut a = weighted("");
        a.spec.placement.failover = Some(Default::default());
        let mut m = members(&["c1", "c2", "c3"]);
        m.get_mut("c1").unwrap().not_ready_for = Some(schedule::DEFAULT_GRACE);
        // c2 alone cannot hold 12: nothing moves, and the app says why.
        let e = render(&a, &m).unwrap_err();
        assert!(
            e.to_string().contains("1 cluster(s) take no new replicas"),
            "{e}"
        );
        a.spec
            .placement
            .replica_scheduling
            .as_mut()
            .unwrap()
            .total_replicas = Some(9);
        let r = render(&a, &m).unwrap();
        assert_eq!(r.clusters["c1"], ClusterPlan::Keep(KeepReason::FailedOver));
        assert_eq!(replicas(&r), [("c2", json!(9))].into());
        assert!(!r.clusters.contains_key("c3"));
    }

    /// A cluster NotReady within the grace period (or cordoned) whose share the status
    /// does not show yet (written late, through the budget) keeps what it runs: planned
    /// off, it would be sent a Delete, or have its MyApp collected, when its agent is back.
    #[test]
    fn a_frozen_cluster_the_status_shows_no_share_for_keeps_what_it_runs() {
        let mut a = weighted("");
        let scheduling = a.spec.placement.replica_scheduling.as_mut().unwrap();
        scheduling.total_replicas = Some(9);
        let mut m = members(&["c1", "c2", "c3"]);
        m.get_mut("c1").unwrap().not_ready_for = Some(std::time::Duration::from_secs(10));
        m.get_mut("c3").unwrap().unschedulable = true;
        let r = render(&a, &m).unwrap();
        assert_eq!(r.clusters["c1"], ClusterPlan::Keep(KeepReason::Unplanned));
        assert_eq!(r.clusters["c3"], ClusterPlan::Keep(KeepReason::Unplanned));
        assert_eq!(replicas(&r), [("c2", json!(9))].into());
    }

    #[test]
    fn bad_requests_under_capacity_name_the_field() {
        let a = app(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: c}\nspec:\n  placement:\n    \
             clusters: [{name: c1}]\n    replicaScheduling: {mode: Capacity}\n  template:\n    spec: {resources: {requests: {cpu: lots}}}\n",
        );
        let e = render(&a, &members(&["c1"])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "spec.template.spec.resources.requests: cpu: \"lots\" is not a quantity: expected a number"
        );
        // Other modes do not read requests (the member's apiserver judges them).
        let mut dup = a.clone();
        dup.spec.placement.replica_scheduling = None;
        assert!(render(&dup, &members(&["c1"])).is_ok());
    }

    // ---- the views: what the index is told, what status reports on ----

    #[test]
    fn failed_clusters_keep_their_copy_and_unknown_ones_get_nothing() {
        let a = app(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: a, namespace: n, generation: 3}\n\
                     spec:\n  placement: {clusters: [{name: c1}, {name: c2}, {name: ghost}]}\n  template: {spec: {replicas: 2}}\n  \
                     overrides:\n  - clusterName: c2\n    clusterOverrides: [{path: /spec/replicas, value: 99}]\n",
        );
        let members = members(&["c1", "c2"]);
        let p = plan(&a, &members, &Admission::default(), &Grants::default());
        let desired = p.desired();
        assert_eq!(p.generation, Some(3));
        assert!(matches!(desired["c1"], Desired::Apply(_)));
        assert_eq!(desired["c2"], Desired::Keep);
        assert!(!desired.contains_key("ghost"));
        assert!(
            matches!(p.clusters["ghost"].error(), Some(message) if message.contains("not a registered MemberCluster"))
        );
        assert!(
            matches!(p.clusters["c2"].error(), Some(message) if message.contains("maximum of 10"))
        );
    }

    #[test]
    fn clusters_that_render_the_same_bytes_share_one_copy() {
        let a = app(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: a, namespace: n}\n\
                     spec:\n  placement: {clusters: [{name: c1}, {name: c2}, {name: c3}]}\n  template: {spec: {replicas: 2}}\n  \
                     overrides:\n  - clusterName: c3\n    clusterOverrides: [{path: /spec/replicas, value: 3}]\n",
        );
        let p = plan(
            &a,
            &members(&["c1", "c2", "c3"]),
            &Admission::default(),
            &Grants::default(),
        );
        let rendered = |c: &str| match &p.desired()[c] {
            Desired::Apply(r) => r.clone(),
            other => panic!("{c}: {other:?}"),
        };
        assert!(Arc::ptr_eq(&rendered("c1"), &rendered("c2")));
        assert!(Arc::ptr_eq(
            &rendered("c1"),
            p.clusters["c2"].rendered().unwrap()
        ));
        assert_ne!(rendered("c1"), rendered("c3"), "c3's override is its own");
    }

    #[test]
    fn operations_that_differ_only_in_a_missing_value_render_apart() {
        // `value: null` (only code can write it: YAML's null reads as no value) clears
        // replicas and the MyApp asks for 1; no value at all is an error. In either
        // order, neither cluster gets the other's outcome.
        for (null, missing) in [("c1", "c2"), ("c2", "c1")] {
            let mut a = with_overrides(&format!(
                "  - clusterName: {null}\n    clusterOverrides: [{{path: /spec/replicas}}]\n\
                 \x20 - clusterName: {missing}\n    clusterOverrides: [{{path: /spec/replicas}}]\n"
            ));
            a.spec.overrides[0].cluster_overrides[0].value = Some(Value::Null);
            let r = render(&a, &members(&["c1", "c2"])).unwrap();
            assert_eq!(ok(&r, null)["spec"].get("replicas"), None);
            assert_eq!(r.schedule.as_ref().unwrap().clusters[null].replicas, 1);
            assert!(
                err(&r, missing)
                    .to_string()
                    .contains("replace needs a value"),
                "{}",
                err(&r, missing)
            );
        }
    }

    #[test]
    fn clusters_with_the_same_operations_share_one_render_and_keep_their_own_errors() {
        let a = with_overrides(
            "  - clusterName: c1\n    clusterOverrides: [{path: /spec/port, value: 80}, {path: /spec/replicas, value: 4}]\n\
             \x20 - clusterName: c2\n    clusterOverrides: [{path: /spec/port, value: 80}, {path: /spec/replicas, value: 4}]\n",
        );
        let r = render(&a, &members(&["c1", "c2"])).unwrap();
        // replace needs an existing port: both fail, each naming its own entry.
        for (cluster, outer) in [("c1", 0), ("c2", 1)] {
            let RenderError::Override(e) = err(&r, cluster) else {
                panic!("{:?}", err(&r, cluster))
            };
            assert_eq!(
                e.field,
                format!("spec.overrides[{outer}].clusterOverrides[0]")
            );
        }
        let a = with_overrides(
            "  - clusterName: c1\n    clusterOverrides: [{op: add, path: /spec/port, value: 80}]\n\
             \x20 - clusterName: c2\n    clusterOverrides: [{op: add, path: /spec/port, value: 80}]\n",
        );
        let r = render(&a, &members(&["c1", "c2", "c3"])).unwrap();
        assert!(Arc::ptr_eq(
            r.clusters["c1"].rendered().unwrap(),
            r.clusters["c2"].rendered().unwrap()
        ));
        assert_eq!(ok(&r, "c2")["spec"]["port"], 80);
    }

    #[test]
    fn an_invalid_placement_keeps_every_cluster_as_it_is() {
        let a = app(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: a}\n\
                     spec:\n  placement: {clusterSelector: {matchExpressions: [{key: k, operator: Bogus}]}}\n",
        );
        let p = plan(
            &a,
            &members(&["c1"]),
            &Admission::default(),
            &Grants::default(),
        );
        assert!(
            p.placement_error
                .as_ref()
                .unwrap()
                .to_string()
                .contains("unknown operator")
        );
        assert_eq!(p.desired()["c1"], Desired::Keep);
        assert_eq!(p.reported().count(), 0, "status speaks of no cluster");
    }

    fn labelled(clusters: &[(&str, &[(&str, &str)])]) -> Members {
        clusters
            .iter()
            .map(|(name, labels)| {
                let labels = labels.iter().map(|(k, v)| ((*k).into(), (*v).into()));
                ((*name).into(), Member::with_labels(labels.collect()))
            })
            .collect()
    }

    fn fleet(overrides: &str) -> (FederatedMyApp, Members) {
        let a = app(&format!(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {{name: web, namespace: prod}}\n\
             spec:\n  placement: {{clusterSelector: {{}}}}\n  template:\n    \
             spec: {{replicas: 3, image: 'nginx:1.27'}}\n  overrides:\n{overrides}"
        ));
        let m = labelled(&[
            ("eu1", &[("region", "eu"), ("floor", "2")]),
            ("eu2", &[("region", "eu"), ("floor", "2")]),
            ("us1", &[("region", "us"), ("floor", "4")]),
            ("bare", &[]),
        ]);
        (a, m)
    }

    #[test]
    fn selector_and_image_overrides_land_on_the_selected_clusters_only() {
        let (a, m) = fleet(
            "  - clusterSelector: {matchLabels: {region: eu}}\n    \
               image: {registry: registry.eu.example.com}\n    \
               clusterOverrides: [{path: /spec/replicas, value: 5}]\n\
             \x20 - clusterName: eu2\n    image: {tag: '1.28'}\n",
        );
        let r = render(&a, &m).unwrap();
        let image = |c: &str| ok(&r, c)["spec"]["image"].clone();
        assert_eq!(image("eu1"), "registry.eu.example.com/library/nginx:1.27");
        assert_eq!(image("eu2"), "registry.eu.example.com/library/nginx:1.28");
        assert_eq!(image("us1"), "nginx:1.27");
        assert_eq!(image("bare"), "nginx:1.27");
        let want = [("bare", 3), ("eu1", 5), ("eu2", 5), ("us1", 3)];
        assert_eq!(replicas(&r), want.map(|(c, n)| (c, json!(n))).into());
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        // Unselected clusters share the plain render.
        assert!(Arc::ptr_eq(
            r.clusters["us1"].rendered().unwrap(),
            r.clusters["bare"].rendered().unwrap()
        ));
    }

    #[test]
    fn a_missing_label_fails_that_cluster_alone_and_equal_labels_share_a_render() {
        let (a, m) = fleet(
            "  - clusterSelector: {}\n    clusterOverrides:\n    \
             - {path: /spec/replicas, valueFrom: {clusterLabel: floor, type: Integer}}\n    \
             - {op: add, path: /metadata/labels/region, valueFrom: {clusterLabel: region}}\n",
        );
        let r = render(&a, &m).unwrap();
        assert_eq!(ok(&r, "eu1")["spec"]["replicas"], 2);
        assert_eq!(ok(&r, "us1")["spec"]["replicas"], 4);
        assert_eq!(ok(&r, "us1")["metadata"]["labels"]["region"], "us");
        assert!(Arc::ptr_eq(
            r.clusters["eu1"].rendered().unwrap(),
            r.clusters["eu2"].rendered().unwrap()
        ));
        assert_eq!(
            r.clusters["bare"].error().unwrap(),
            "spec.overrides[0].clusterOverrides[0] (replace /spec/replicas): \
             valueFrom.clusterLabel: MemberCluster bare has no label floor"
        );
        assert_eq!(r.desired()["bare"], Desired::Keep, "it keeps what it runs");
        // A value from a label that breaks the schema names the operation.
        let (a, mut m) = fleet(
            "  - clusterSelector: {}\n    clusterOverrides: [{path: /spec/replicas, valueFrom: {clusterLabel: floor, type: Integer}}]\n",
        );
        m.get_mut("us1")
            .unwrap()
            .labels
            .insert("floor".into(), "40".into());
        m.remove("bare");
        let r = render(&a, &m).unwrap();
        assert!(is_ok(&r, "eu1"));
        let RenderError::Invalid { culprit, .. } = err(&r, "us1") else {
            panic!("{:?}", r.clusters["us1"])
        };
        assert_eq!(
            culprit.as_deref(),
            Some("spec.overrides[0].clusterOverrides[0]")
        );
    }

    #[test]
    fn an_unreadable_override_entry_keeps_every_placed_cluster_as_it_is() {
        let (a, m) = fleet("  - {clusterName: eu1, clusterSelector: {}}\n");
        let r = render(&a, &m).unwrap();
        for c in ["eu1", "eu2", "us1", "bare"] {
            assert_eq!(r.desired()[c], Desired::Keep, "{c}");
            assert!(
                r.clusters[c]
                    .error()
                    .unwrap()
                    .starts_with("spec.overrides[0]: sets both")
            );
        }
    }

    mod properties {
        use super::*;
        use flotilla_crds::federated::{ClusterOverride, OverrideOp, ValueFrom, ValueType};
        use proptest::prelude::*;

        const CLUSTERS: [&str; 3] = ["c1", "c2", "c3"];

        /// Pointers users write, and ones they get wrong: real fields, missing ones,
        /// escapes, array indices, `-`, empty tokens, paths outside the allowed roots.
        fn pointer() -> impl Strategy<Value = String> {
            let token = prop_oneof![
                Just("spec".to_owned()),
                Just("replicas".to_owned()),
                Just("image".to_owned()),
                Just("config".to_owned()),
                Just("metadata".to_owned()),
                Just("labels".to_owned()),
                Just("annotations".to_owned()),
                Just("a~1b".to_owned()),
                Just("~2".to_owned()),
                Just("0".to_owned()),
                Just("-".to_owned()),
                Just(String::new()),
                "[a-z~/]{0,6}",
            ];
            prop_oneof![
                prop::collection::vec(token, 0..5).prop_map(|t| format!("/{}", t.join("/"))),
                "\\PC{0,12}",
            ]
        }

        fn value() -> impl Strategy<Value = Option<Value>> {
            prop_oneof![
                Just(None),
                Just(Some(json!(null))),
                (-5i64..20).prop_map(|n| Some(json!(n))),
                "\\PC{0,8}".prop_map(|s| Some(json!(s))),
                Just(Some(json!({"k": "v"}))),
                Just(Some(json!([1, 2]))),
                Just(Some(json!(true))),
            ]
        }

        fn op() -> impl Strategy<Value = ClusterOverride> {
            let kind = prop_oneof![
                Just(OverrideOp::Add),
                Just(OverrideOp::Remove),
                Just(OverrideOp::Replace)
            ];
            (kind, pointer(), value()).prop_map(|(op, path, value)| ClusterOverride {
                op,
                path,
                value,
                value_from: None,
            })
        }

        fn overrides() -> impl Strategy<Value = Vec<ClusterOverrides>> {
            let cluster = prop_oneof![
                Just("c1".to_owned()),
                Just("c2".to_owned()),
                Just("ghost".to_owned())
            ];
            prop::collection::vec(
                (cluster, prop::collection::vec(op(), 0..4))
                    .prop_map(|(cluster, ops)| ClusterOverrides::named(cluster, ops)),
                0..4,
            )
        }

        fn base() -> FederatedMyApp {
            app(
                "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: p, namespace: n}\n\
                 spec:\n  placement: {clusters: [{name: c1}, {name: c2}, {name: c3}]}\n  \
                 template: {spec: {replicas: 2, image: 'nginx:1.27', config: {a: b}}}\n",
            )
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            /// Whatever the overrides: render never panics, never fails the whole app,
            /// an error is that cluster's alone, and a cluster no override names renders
            /// exactly as with no overrides at all.
            #[test]
            fn overrides_fail_only_their_own_cluster(list in overrides()) {
                let members = members(&CLUSTERS);
                let plain = render(&base(), &members).expect("the base renders");
                let mut with = base();
                with.spec.overrides = list.clone();
                let rendered = render(&with, &members).expect("overrides never fail the whole app");
                for cluster in CLUSTERS {
                    let named = list.iter().any(|o| o.cluster_name.as_deref() == Some(cluster));
                    let result = &rendered.clusters[cluster];
                    if !named {
                        prop_assert_eq!(result, &plain.clusters[cluster]);
                    }
                    if let Some(e) = result.error() {
                        prop_assert!(named, "{cluster} failed without an override: {e}");
                        prop_assert!(!e.is_empty());
                    }
                }
                // Overrides for a cluster that is not placed only warn.
                let ghost = list.iter().any(|o| o.cluster_name.as_deref() == Some("ghost"));
                prop_assert_eq!(ghost, rendered.warnings.iter().any(|w| w.contains("ghost")));
            }

            /// Equal inputs give equal renders, byte for byte.
            #[test]
            fn render_is_deterministic(list in overrides()) {
                let members = members(&CLUSTERS);
                let mut with = base();
                with.spec.overrides = list;
                let once = render(&with, &members).unwrap();
                let twice = render(&with, &members).unwrap();
                prop_assert_eq!(&once, &twice);
            }
        }

        // ---- grouped render against the render per cluster it replaced ----

        /// The planner as it was before classes: one render per cluster, the replicas a
        /// Duplicated cluster asks for read back from its JSON.
        fn plan_per_cluster(app: &FederatedMyApp, members: &Members) -> AppPlan {
            let Ok((decision, mut schedule)) =
                place_and_schedule(app, members, &Admission::default(), &Grants::default())
            else {
                return plan(app, members, &Admission::default(), &Grants::default());
            };
            let template = Template::of(app);
            let mut distinct: HashMap<String, Arc<RenderedMyApp>> = HashMap::new();
            let mut clusters = BTreeMap::new();
            for cluster in &decision.clusters {
                let Some(assigned) = schedule.clusters.get_mut(cluster) else {
                    continue;
                };
                match placing(assigned) {
                    Placing::Render => {}
                    Placing::Skip => continue,
                    Placing::Keep(reason) => {
                        clusters.insert(cluster.clone(), ClusterPlan::Keep(reason));
                        continue;
                    }
                }
                let labels = &members[cluster].labels;
                let ops = Targets::of(&app.spec.overrides).for_cluster(cluster, labels);
                let share = share_of(schedule.divided, &schedule.bounds, cluster, assigned);
                let rendered = ops
                    .map_err(RenderError::from)
                    .and_then(|ops| template.render(&ops, share));
                let planned = match rendered {
                    Ok(r) => {
                        let r = r.myapp;
                        if !schedule.divided {
                            let asked = r.to_value()["spec"]["replicas"].as_u64().unwrap_or(1);
                            assigned.replicas = asked as u32;
                        }
                        let shared = distinct
                            .entry(r.hash.clone())
                            .or_insert_with(|| Arc::new(r));
                        ClusterPlan::Apply(shared.clone())
                    }
                    Err(e) => ClusterPlan::Keep(KeepReason::RenderFailed(Box::new(e))),
                };
                clusters.insert(cluster.clone(), planned);
            }
            for cluster in decision.unknown {
                clusters.insert(cluster, ClusterPlan::Unknown);
            }
            AppPlan {
                generation: app.metadata.generation,
                placement_error: None,
                schedule: Some(schedule),
                clusters,
                warnings: unplaced_overrides(
                    &Targets::of(&app.spec.overrides),
                    members,
                    &decision.clusters,
                ),
                rollout: None,
            }
        }

        const SIX: [&str; 6] = ["c1", "c2", "c3", "c4", "c5", "c6"];

        /// Operations that matter to classes more often than random pointers hit them:
        /// replicas (as integers, as a float, null, without a value, removed), labels,
        /// a port.
        fn class_op() -> impl Strategy<Value = ClusterOverride> {
            let fixed = |op: OverrideOp, path: &str, value: Option<Value>| ClusterOverride {
                op,
                path: path.into(),
                value,
                value_from: None,
            };
            prop_oneof![
                op(),
                (1i64..12).prop_map(move |n| fixed(
                    OverrideOp::Replace,
                    "/spec/replicas",
                    Some(json!(n))
                )),
                Just(fixed(
                    OverrideOp::Replace,
                    "/spec/replicas",
                    Some(json!(3.0))
                )),
                Just(fixed(OverrideOp::Remove, "/spec/replicas", None)),
                Just(fixed(OverrideOp::Replace, "/spec/replicas", None)),
                Just(fixed(
                    OverrideOp::Replace,
                    "/spec/replicas",
                    Some(json!(null))
                )),
                Just(fixed(OverrideOp::Add, "/spec/port", Some(json!(80)))),
                Just(fixed(
                    OverrideOp::Add,
                    "/metadata/labels/tier",
                    Some(json!("gold"))
                )),
                Just(fixed(OverrideOp::Add, "/metadata/labels/tier", None)),
                Just(fixed(
                    OverrideOp::Add,
                    "/metadata/labels/tier",
                    Some(json!(null))
                )),
                Just(fixed(
                    OverrideOp::Replace,
                    "/spec/image",
                    Some(json!("nginx"))
                )),
                Just(ClusterOverride {
                    value_from: Some(ValueFrom {
                        cluster_label: "floor".into(),
                        type_: ValueType::Integer,
                    }),
                    ..fixed(OverrideOp::Replace, "/spec/replicas", None)
                }),
                Just(ClusterOverride {
                    value_from: Some(ValueFrom {
                        cluster_label: "region".into(),
                        type_: ValueType::String,
                    }),
                    ..fixed(OverrideOp::Add, "/metadata/labels/region", None)
                }),
            ]
        }

        /// Entries by label: a selector (by region, any region, every cluster, or
        /// an invalid one), maybe an image helper, and operations from the pool.
        fn selected(pool: &[Vec<ClusterOverride>], pick: (u8, usize, u8)) -> ClusterOverrides {
            let (selector, ops, image) = pick;
            let selector = match selector {
                0 => json!({"matchLabels": {"region": "eu"}}),
                1 => json!({"matchExpressions": [{"key": "region", "operator": "Exists"}]}),
                2 => json!({}),
                _ => json!({"matchExpressions": [{"key": "region", "operator": "In"}]}),
            };
            let image = match image {
                0 => None,
                1 => Some(json!({"registry": "registry.eu.example.com"})),
                2 => Some(json!({"tag": "1.28", "repository": "team/web"})),
                3 => Some(json!({"registryFrom": {"clusterLabel": "mirror"}})),
                _ => Some(json!({"registry": "no-dot"})),
            };
            serde_json::from_value(json!({
                "clusterSelector": selector, "image": image, "clusterOverrides": pool[ops],
            }))
            .expect("a valid entry")
        }

        /// Overrides drawn from a pool of two operation lists, so that several
        /// clusters often write the same operations (in entries of their own, sometimes
        /// split over two entries), plus some for a cluster that is not placed, and up
        /// to two entries by label ([`selected`]) before them.
        fn pooled_overrides() -> impl Strategy<Value = Vec<ClusterOverrides>> {
            let pool = prop::collection::vec(prop::collection::vec(class_op(), 0..4), 2);
            let choice =
                prop::collection::vec((prop::option::weighted(0.7, 0usize..2), any::<bool>()), 7);
            let by_label = prop::collection::vec(
                (prop_oneof![6 => 0u8..3, 1 => Just(3u8)], 0usize..2, 0u8..5),
                0..3,
            );
            (pool, choice, by_label).prop_map(|(pool, choice, by_label)| {
                let names = SIX.iter().copied().chain(["ghost"]);
                let mut all: Vec<ClusterOverrides> = by_label
                    .into_iter()
                    .map(|pick| selected(&pool, pick))
                    .collect();
                for (name, (pick, split)) in names.zip(choice) {
                    let Some(ops) = pick.map(|i| pool[i].clone()) else {
                        continue;
                    };
                    let at = if split { ops.len() / 2 } else { ops.len() };
                    for part in [&ops[..at], &ops[at..]] {
                        if !part.is_empty() || !split {
                            all.push(ClusterOverrides::named(name, part.to_vec()));
                        }
                    }
                }
                all
            })
        }

        /// `spec.placement.replicaScheduling` and `failover`: none, Duplicated, or a
        /// Weighted division with random weights and bounds.
        fn scheduling() -> impl Strategy<Value = (Option<Value>, Option<Value>)> {
            let pref = (0usize..6, 0u32..4, prop::option::of(0u32..4), prop::option::of(2u32..11))
                .prop_map(|(c, weight, min, max)| {
                    json!({"clusterNames": [SIX[c]], "weight": weight, "minReplicas": min, "maxReplicas": max})
                });
            let mode = prop_oneof![
                Just(None),
                Just(Some(json!({"mode": "Duplicated"}))),
                (0i32..30, prop::collection::vec(pref, 0..4)).prop_map(|(total, prefs)| {
                    Some(json!({"mode": "Weighted", "totalReplicas": total, "preferences": prefs}))
                }),
            ];
            let failover = prop::option::of(prop_oneof![
                Just(json!({})),
                (0i32..400).prop_map(|g| json!({"gracePeriodSeconds": g}))
            ]);
            (mode, failover)
        }

        /// A template's spec: replicas in and out of the schema's bounds or unset, an
        /// image valid or not, labels or none.
        fn template() -> impl Strategy<Value = Value> {
            let image = prop_oneof![Just("nginx:1.27"), Just("nginx"), Just("x:y")];
            (prop::option::of(-1i32..12), image, any::<bool>()).prop_map(|(replicas, image, labels)| {
                let metadata = if labels { json!({"labels": {"team": "blue"}}) } else { json!({}) };
                json!({"metadata": metadata, "spec": {"replicas": replicas, "image": image, "config": {"a": "b"}}})
            })
        }

        /// Members: each Ready, NotReady briefly, or NotReady past the default grace,
        /// sometimes cordoned, with a `region`, a `floor` and a `mirror` label or not
        /// (a floor that is no integer, a mirror that is no registry); and the previous
        /// division in status.
        fn members_and_status() -> impl Strategy<Value = (Members, Value)> {
            let ready = prop_oneof![6 => Just(0u8), 2 => Just(1), 2 => Just(2)];
            let region = prop_oneof![Just(None), Just(Some("eu")), Just(Some("us"))];
            let floor = prop_oneof![
                Just(None),
                Just(Some("1")),
                Just(Some("3")),
                Just(Some("x"))
            ];
            let mirror = prop_oneof![
                Just(None),
                Just(Some("m.eu.io:5000")),
                Just(Some("m.us.io")),
                Just(Some("bad"))
            ];
            let member = (
                (ready, prop::bool::weighted(0.15), 0i32..5, 0i32..5),
                (region, floor, mirror),
            );
            prop::collection::vec(member, 6).prop_map(|ms| {
                let mut members = Members::new();
                let mut previous = Vec::new();
                for (name, ((ready, cordoned, replicas, ready_replicas), labels)) in SIX.iter().zip(ms) {
                    let not_ready_for = [None, Some(10), Some(1000)][usize::from(ready)];
                    let (region, floor, mirror) = labels;
                    let labels = [("region", region), ("floor", floor), ("mirror", mirror)]
                        .into_iter()
                        .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned())))
                        .collect();
                    let member = placement::Member {
                        labels,
                        unschedulable: cordoned,
                        not_ready_for: not_ready_for.map(std::time::Duration::from_secs),
                        ..Default::default()
                    };
                    members.insert((*name).into(), member);
                    previous.push(json!({"name": name, "replicas": replicas, "readyReplicas": ready_replicas}));
                }
                (members, json!({"observedGeneration": 1, "clusters": previous}))
            })
        }

        fn grouped_case() -> impl Strategy<Value = (FederatedMyApp, Members)> {
            let placed = prop::collection::vec(any::<bool>(), 7);
            (placed, template(), scheduling(), pooled_overrides(), members_and_status(), any::<bool>())
                .prop_map(|(placed, template, (mode, failover), overrides, (members, status), with_status)| {
                    let names = SIX.iter().copied().chain(["ghost"]);
                    let clusters: Vec<Value> = names
                        .zip(placed)
                        .filter(|(_, on)| *on)
                        .map(|(n, _)| json!({"name": n}))
                        .collect();
                    let mut app = json!({
                        "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
                        "metadata": {"name": "g", "namespace": "n", "generation": 2},
                        "spec": {"placement": {"clusters": clusters}, "template": template, "overrides": overrides},
                    });
                    if let Some(mode) = mode {
                        app["spec"]["placement"]["replicaScheduling"] = mode;
                    }
                    if let Some(failover) = failover {
                        app["spec"]["placement"]["failover"] = failover;
                    }
                    if with_status {
                        app["status"] = status;
                    }
                    let app: FederatedMyApp = serde_json::from_value(app).expect("a valid FederatedMyApp");
                    (app, members)
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(4096))]

            /// Rendering once per class gives exactly what rendering per cluster gave:
            /// the same plan (bytes, hashes, replicas per cluster, errors with their
            /// culprit fields), and clusters with the same bytes share one copy.
            #[test]
            fn grouped_render_equals_render_per_cluster((app, members) in grouped_case()) {
                let grouped = plan(&app, &members, &Admission::default(), &Grants::default());
                let alone = plan_per_cluster(&app, &members);
                prop_assert_eq!(&grouped, &alone);
                let applied: Vec<&Arc<RenderedMyApp>> = grouped.clusters.values().filter_map(ClusterPlan::rendered).collect();
                for a in &applied {
                    for b in &applied {
                        prop_assert_eq!(a.hash == b.hash, Arc::ptr_eq(a, b));
                    }
                }
            }
        }
    }
}
