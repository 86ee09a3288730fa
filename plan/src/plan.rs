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

use flotilla_crds::FederatedMyApp;
use flotilla_crds::federated::SchedulingReason;

use crate::index::Desired;
use crate::overrides;
use crate::placement::{self, Decision, Members, SelectorError};
use crate::render::{RenderError, RenderedMyApp, Template};
use crate::schedule::{self, Schedule, ScheduleError};

/// What status says of a cluster named in `spec.placement.clusters` that is not
/// registered.
pub const UNKNOWN_CLUSTER: &str =
    "cluster is named in spec.placement.clusters but is not a registered MemberCluster";
/// What status says of a cluster that failed over.
pub const FAILED_OVER: &str = "NotReady past the failover grace period: its replicas moved to other clusters; its MyApp is left as it is until the cluster is Ready again";

/// What the planner decided for one cluster.
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

/// Why a cluster keeps what it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeepReason {
    /// Its MyApp cannot be rendered (an override, the schema): this cluster's error.
    RenderFailed(Box<RenderError>),
    /// NotReady past the failover grace period: its share runs elsewhere, its copy is
    /// left as it was. Not an error, and not counted as placed.
    FailedOver,
    /// The app as a whole cannot be planned ([`AppPlan::placement_error`]): where it
    /// runs now is unknown, so every registered cluster keeps what it has.
    Unplanned,
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
    /// `RenderFailed`, an Event repeats it): a failed render or an unknown cluster.
    pub fn error(&self) -> Option<String> {
        match self {
            ClusterPlan::Keep(KeepReason::RenderFailed(e)) => Some(e.to_string()),
            ClusterPlan::Unknown => Some(UNKNOWN_CLUSTER.to_owned()),
            ClusterPlan::Apply(_) | ClusterPlan::Keep(_) => None,
        }
    }

    /// What the index holds for the cluster; `None`: nothing (an unknown cluster).
    pub fn desired(&self) -> Option<Desired> {
        match self {
            ClusterPlan::Apply(r) => Some(Desired::Apply(r.clone())),
            ClusterPlan::Keep(_) => Some(Desired::Keep),
            ClusterPlan::Unknown => None,
        }
    }
}

/// Why nothing of an app can be planned: every cluster keeps what it has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Placement(#[from] SelectorError),
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
}

/// What the hub decided for one app at one generation.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
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
    pub clusters: BTreeMap<String, ClusterPlan>,
    /// Things the user wrote that have no effect, e.g. overrides for unplaced clusters.
    pub warnings: Vec<String>,
}

impl AppPlan {
    /// The index's view: what each cluster should have.
    pub fn desired(&self) -> BTreeMap<String, Desired> {
        self.clusters
            .iter()
            .filter_map(|(c, p)| Some((c.clone(), p.desired()?)))
            .collect()
    }

    /// The clusters status reports on: all but those kept because the app as a whole
    /// could not be planned (the app's error says why).
    pub fn reported(&self) -> impl Iterator<Item = (&String, &ClusterPlan)> {
        self.clusters
            .iter()
            .filter(|(_, p)| **p != ClusterPlan::Keep(KeepReason::Unplanned))
    }
}

/// Places, schedules and renders one FederatedMyApp. The app fails as a whole only when
/// the placement or the division is invalid; each cluster's failure is that cluster's
/// alone.
pub fn plan(app: &FederatedMyApp, members: &Members) -> AppPlan {
    let generation = app.metadata.generation;
    match place_and_schedule(app, members) {
        Ok((decision, schedule)) => placed(app, decision, schedule, generation),
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
) -> Result<(Decision, Schedule), AppError> {
    let decision = placement::place(&app.spec.placement, members)?;
    let inputs = schedule::Inputs::for_app(app, &decision.clusters, members)?;
    let schedule = schedule::schedule(&inputs)?;
    Ok((decision, schedule))
}

/// Renders each placed cluster that runs replicas. Clusters that render the same bytes
/// share one copy (and hash): one per distinct content, not one per cluster.
fn placed(
    app: &FederatedMyApp,
    decision: Decision,
    mut schedule: Schedule,
    generation: Option<i64>,
) -> AppPlan {
    let warnings = unplaced_overrides(app, &decision.clusters);
    let template = Template::of(app);
    let mut distinct: HashMap<String, Arc<RenderedMyApp>> = HashMap::new();
    let mut clusters = BTreeMap::new();
    for cluster in &decision.clusters {
        let Some(assigned) = schedule.clusters.get_mut(cluster) else {
            continue;
        };
        if assigned.reason == SchedulingReason::FailedOver {
            clusters.insert(cluster.clone(), ClusterPlan::Keep(KeepReason::FailedOver));
            continue;
        }
        if assigned.replicas == 0 {
            continue;
        }
        let ops = overrides::for_cluster(&app.spec.overrides, cluster);
        let replicas = schedule.divided.then_some(assigned.replicas);
        let planned = match template.render(&ops, replicas) {
            Ok(r) => {
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
        generation,
        placement_error: None,
        schedule: Some(schedule),
        clusters,
        warnings,
    }
}

fn unplaced_overrides(app: &FederatedMyApp, placed: &[String]) -> Vec<String> {
    app.spec
        .overrides
        .iter()
        .filter(|o| placed.binary_search(&o.cluster_name).is_err())
        .map(|o| {
            format!(
                "overrides for cluster {} are ignored: it is not placed",
                o.cluster_name
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_crds::federated::ClusterOverrides;
    use serde_json::{Value, json};

    use crate::render::{HASH_ANNOTATION, MANAGED_BY_LABEL, MANAGED_BY_VALUE, SOURCE_ANNOTATION};

    const SEED: &str = include_str!("../../examples/federatedmyapp.yaml");

    fn app(yaml: &str) -> FederatedMyApp {
        serde_yaml::from_str(yaml).expect("valid FederatedMyApp YAML")
    }

    fn members(names: &[&str]) -> Members {
        names
            .iter()
            .map(|n| ((*n).to_owned(), Default::default()))
            .collect()
    }

    /// The plan, or the app's error when it has one.
    fn render(app: &FederatedMyApp, members: &Members) -> Result<AppPlan, AppError> {
        let planned = plan(app, members);
        match planned.placement_error {
            Some(e) => Err(e),
            None => Ok(planned),
        }
    }

    fn replicas(r: &AppPlan) -> BTreeMap<&str, Value> {
        r.clusters
            .iter()
            .filter_map(|(c, m)| {
                Some((
                    c.as_str(),
                    m.rendered()?.to_value()["spec"]["replicas"].clone(),
                ))
            })
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
        assert_eq!(r.clusters.keys().collect::<Vec<_>>(), ["c1", "c2"]);
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
        a.spec.overrides = vec![ClusterOverrides::default()];
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
        let p = plan(&a, &members);
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
        let p = plan(&a, &members(&["c1", "c2", "c3"]));
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
    fn an_invalid_placement_keeps_every_cluster_as_it_is() {
        let a = app(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: a}\n\
                     spec:\n  placement: {clusterSelector: {matchExpressions: [{key: k, operator: Bogus}]}}\n",
        );
        let p = plan(&a, &members(&["c1"]));
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

    mod properties {
        use super::*;
        use flotilla_crds::federated::{ClusterOverride, OverrideOp};
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
            })
        }

        fn overrides() -> impl Strategy<Value = Vec<ClusterOverrides>> {
            let cluster = prop_oneof![
                Just("c1".to_owned()),
                Just("c2".to_owned()),
                Just("ghost".to_owned())
            ];
            prop::collection::vec(
                (cluster, prop::collection::vec(op(), 0..4)).prop_map(|(cluster_name, ops)| {
                    ClusterOverrides {
                        cluster_name,
                        cluster_overrides: ops,
                    }
                }),
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
                    let named = list.iter().any(|o| o.cluster_name == cluster);
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
                let ghost = list.iter().any(|o| o.cluster_name == "ghost");
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
    }
}
