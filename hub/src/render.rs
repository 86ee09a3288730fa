//! Render: one FederatedMyApp and the registered clusters in, exactly the MyApp each
//! placed cluster must run out. Pure: no I/O, no clock, equal inputs give equal bytes.
//!
//! Placement → schedule (replicas per cluster) → per cluster with replicas: template
//! with the assigned replicas → that cluster's overrides → check against the MyApp CRD's
//! own `v1` schema (the member's apiserver enforces it again) → content hash → JSON
//! bytes, serialized once here so that pushing to an agent never re-serializes.
//!
//! Under a divided mode the schedule owns `/spec/replicas`: an override that changes it
//! is that cluster's error (its copy is kept), since it would silently break the total.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use bytes::Bytes;
use flotilla_crds::FederatedMyApp;
use flotilla_crds::federated::SchedulingReason;
use jsonptr::{Pointer, Token};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use crate::overrides::{self, Located, OverrideError};
use crate::placement::{self, Members, SelectorError};
use crate::schedule::{self, Schedule, ScheduleError};

pub use flotilla_crds::{HASH_ANNOTATION, MANAGED_BY_LABEL, MANAGED_BY_VALUE, SOURCE_ANNOTATION};

/// What one cluster gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedMyApp {
    /// Hex SHA-256 of the canonical JSON of the MyApp (before the hash annotation).
    pub hash: String,
    /// The MyApp as JSON, hash annotation included: what the agent applies.
    pub json: Bytes,
}

impl RenderedMyApp {
    pub fn to_value(&self) -> Value {
        serde_json::from_slice(&self.json).expect("rendered JSON parses")
    }
}

/// Why one cluster gets nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster is named in spec.placement.clusters but is not a registered MemberCluster")]
    UnknownCluster,
    #[error("{0}")]
    Override(#[from] OverrideError),
    #[error(
        "NotReady past the failover grace period: its replicas moved to other clusters; its MyApp is left as it is until the cluster is Ready again"
    )]
    FailedOver,
    #[error(
        "{culprit} changes /spec/replicas, which spec.placement.replicaScheduling sets to {assigned} for this cluster; bound it with replicaScheduling.preferences[].minReplicas/maxReplicas instead"
    )]
    ReplicasOverridden { assigned: u32, culprit: String },
    #[error("the rendered MyApp is invalid at {path}: {reason}{}", culprit.as_ref().map(|f| format!(" (set by {f})")).unwrap_or_default())]
    Invalid {
        /// Pointer into the MyApp, e.g. `/spec/replicas`.
        path: String,
        reason: String,
        /// The override that last wrote at or above `path`, if any; else the template.
        culprit: Option<String>,
    },
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rendered {
    /// Every placed cluster and every unknown named one, sorted by name.
    pub clusters: BTreeMap<String, Result<RenderedMyApp, ClusterError>>,
    /// Things the user wrote that have no effect, e.g. overrides for unplaced clusters.
    pub warnings: Vec<String>,
    /// How many replicas each placed cluster runs and why (for status). Under Duplicated,
    /// what each rendered MyApp asks for after overrides.
    pub schedule: Schedule,
}

/// Why nothing of an app can be rendered: every cluster keeps what it has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Placement(#[from] SelectorError),
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
}

impl Rendered {
    pub fn errors(&self) -> impl Iterator<Item = (&str, &ClusterError)> {
        self.clusters
            .iter()
            .filter_map(|(c, r)| r.as_ref().err().map(|e| (c.as_str(), e)))
    }
}

/// Places, schedules and renders one FederatedMyApp. Fails as a whole only when the
/// placement or the division is invalid; each cluster's failure is that cluster's alone.
pub fn render(app: &FederatedMyApp, members: &Members) -> Result<Rendered, AppError> {
    let decision = placement::place(&app.spec.placement, members)?;
    let inputs = schedule::Inputs::for_app(app, &decision.clusters, members)?;
    let mut out = Rendered {
        schedule: schedule::schedule(&inputs)?,
        ..Rendered::default()
    };
    for o in &app.spec.overrides {
        if decision.clusters.binary_search(&o.cluster_name).is_err() {
            out.warnings.push(format!(
                "overrides for cluster {} are ignored: it is not placed",
                o.cluster_name
            ));
        }
    }
    let base = template_doc(app);
    let namespace = app.metadata.namespace.as_deref().unwrap_or("default");
    let name = app.metadata.name.as_deref().unwrap_or_default();
    for cluster in &decision.clusters {
        let Some(assigned) = out.schedule.clusters.get_mut(cluster) else {
            continue;
        };
        if assigned.reason == SchedulingReason::FailedOver {
            out.clusters
                .insert(cluster.clone(), Err(ClusterError::FailedOver));
            continue;
        }
        if assigned.replicas == 0 {
            continue;
        }
        let ops = overrides::for_cluster(&app.spec.overrides, cluster);
        let replicas = out.schedule.divided.then_some(assigned.replicas);
        let result = render_one(&base, &ops, namespace, name, replicas);
        if let (false, Ok(r)) = (out.schedule.divided, &result) {
            let asked = r.to_value()["spec"]["replicas"].as_u64().unwrap_or(1);
            assigned.replicas = asked as u32;
        }
        out.clusters.insert(cluster.clone(), result);
    }
    for cluster in decision.unknown {
        out.clusters
            .insert(cluster, Err(ClusterError::UnknownCluster));
    }
    Ok(out)
}

/// The template as the document overrides address, with empty label and annotation
/// maps present so that `add /metadata/labels/x` works on a template without metadata.
fn template_doc(app: &FederatedMyApp) -> Value {
    let mut doc = serde_json::to_value(&app.spec.template).expect("typed template serializes");
    let metadata = doc
        .as_object_mut()
        .expect("template is an object")
        .entry("metadata");
    let metadata = metadata.or_insert_with(|| json!({}));
    for key in ["labels", "annotations"] {
        metadata
            .as_object_mut()
            .expect("metadata is an object")
            .entry(key)
            .or_insert_with(|| json!({}));
    }
    doc
}

const REPLICAS: &Pointer = Pointer::from_static("/spec/replicas");

fn render_one(
    base: &Value,
    ops: &[Located<'_>],
    namespace: &str,
    name: &str,
    replicas: Option<u32>,
) -> Result<RenderedMyApp, ClusterError> {
    let mut doc = base.clone();
    if let Some(n) = replicas {
        doc["spec"]["replicas"] = json!(n);
    }
    overrides::apply(&mut doc, ops)?;
    if let Some(n) = replicas
        && doc.pointer(REPLICAS.as_str()) != Some(&json!(n))
    {
        return Err(ClusterError::ReplicasOverridden {
            assigned: n,
            culprit: culprit(ops, REPLICAS).unwrap_or_else(|| "an override".into()),
        });
    }
    let invalid = |path: String, reason: String| ClusterError::Invalid {
        culprit: Pointer::parse(&path).ok().and_then(|p| culprit(ops, p)),
        path,
        reason,
    };
    let mut labels = string_map(&doc, "labels").map_err(|(p, r)| invalid(p, r))?;
    let mut annotations = string_map(&doc, "annotations").map_err(|(p, r)| invalid(p, r))?;
    labels.insert(MANAGED_BY_LABEL.into(), MANAGED_BY_VALUE.into());
    annotations.insert(
        SOURCE_ANNOTATION.into(),
        format!("{namespace}/{name}").into(),
    );
    let mut spec = match doc.get_mut("spec") {
        None | Some(Value::Null) => json!({}),
        Some(spec) => spec.take(),
    };
    strip_nulls(&mut spec);
    let mut myapp = json!({
        "apiVersion": "app.example.com/v1",
        "kind": "MyApp",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations},
        "spec": spec,
    });
    if let Some(e) = MYAPP_SCHEMA.iter_errors(&myapp).next() {
        return Err(invalid(e.instance_path().to_string(), e.to_string()));
    }
    let hash = content_hash(&myapp);
    myapp["metadata"]["annotations"][HASH_ANNOTATION] = Value::String(hash.clone());
    let json = serde_json::to_vec(&myapp).expect("a JSON value serializes");
    Ok(RenderedMyApp {
        hash,
        json: Bytes::from(json),
    })
}

/// Labels and annotations must stay maps of strings whatever the overrides did.
fn string_map(doc: &Value, key: &str) -> Result<Map<String, Value>, (String, String)> {
    let path = jsonptr::PointerBuf::from_tokens(["metadata", key]);
    let map = match doc.pointer(path.as_str()) {
        None | Some(Value::Null) => return Ok(Map::new()),
        Some(Value::Object(map)) => map,
        Some(_) => return Err((path.to_string(), "must be a map of strings".into())),
    };
    if let Some((k, _)) = map.iter().find(|(_, v)| !v.is_string()) {
        let path = path.with_trailing_token(Token::new(k.as_str()));
        return Err((path.to_string(), "must be a string".into()));
    }
    Ok(map.clone())
}

/// The last override that wrote at, above or below `path`: the one to blame.
fn culprit(ops: &[Located<'_>], path: &Pointer) -> Option<String> {
    ops.iter()
        .rev()
        .find(|o| {
            Pointer::parse(&o.op.path).is_ok_and(|op| path.starts_with(op) || op.starts_with(path))
        })
        .map(Located::field)
}

/// The MyApp CRD's `v1` schema, compiled once.
static MYAPP_SCHEMA: LazyLock<jsonschema::Validator> = LazyLock::new(|| {
    jsonschema::validator_for(&flotilla_crds::myapp_v1_schema())
        .expect("the MyApp CRD schema compiles")
});

/// Drops `null` members: every optional MyApp field reads `null` as absent, and without
/// them the schema check need not know OpenAPI's `nullable`.
fn strip_nulls(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.retain(|_, v| !v.is_null());
            map.values_mut().for_each(strip_nulls);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

/// SHA-256 over a canonical encoding: object keys sorted, so the hash does not depend
/// on key order.
pub fn content_hash(value: &Value) -> String {
    let mut hasher = Sha256::new();
    feed(&mut hasher, value);
    hex::encode(hasher.finalize())
}

fn feed(h: &mut Sha256, value: &Value) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            h.update(b"{");
            for k in keys {
                feed(h, &Value::String(k.clone()));
                h.update(b":");
                feed(h, &map[k]);
                h.update(b",");
            }
            h.update(b"}");
        }
        Value::Array(items) => {
            h.update(b"[");
            for item in items {
                feed(h, item);
                h.update(b",");
            }
            h.update(b"]");
        }
        scalar => h.update(scalar.to_string().as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_crds::federated::ClusterOverrides;

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

    fn replicas(r: &Rendered) -> BTreeMap<&str, Value> {
        r.clusters
            .iter()
            .filter_map(|(c, m)| {
                Some((
                    c.as_str(),
                    m.as_ref().ok()?.to_value()["spec"]["replicas"].clone(),
                ))
            })
            .collect()
    }

    fn ok(r: &Rendered, cluster: &str) -> Value {
        r.clusters[cluster]
            .as_ref()
            .expect("cluster renders")
            .to_value()
    }

    fn err<'a>(r: &'a Rendered, cluster: &str) -> &'a ClusterError {
        r.clusters[cluster].as_ref().expect_err("cluster fails")
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
        let one = r.clusters["cluster1"].as_ref().unwrap();
        let two = r.clusters["cluster2"].as_ref().unwrap();
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
    fn content_hash_ignores_key_order_but_not_values() {
        let a: Value = serde_json::from_str(r#"{"a":1,"b":{"x":[1,2],"y":"s"}}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"b":{"y":"s","x":[1,2]},"a":1}"#).unwrap();
        let c: Value = serde_json::from_str(r#"{"b":{"y":"s","x":[2,1]},"a":1}"#).unwrap();
        assert_eq!(content_hash(&a), content_hash(&b));
        assert_ne!(content_hash(&a), content_hash(&c));
        // Distinct structures must not collide through the encoding.
        assert_ne!(
            content_hash(&json!(["a,b"])),
            content_hash(&json!(["a", "b"]))
        );
        assert_ne!(
            content_hash(&json!({"a": "1"})),
            content_hash(&json!({"a": 1}))
        );
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
        assert!(r.clusters["c1"].is_ok(), "the other cluster still renders");
        let ClusterError::Invalid {
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
        assert!(r.clusters["c1"].is_ok());
        let ClusterError::Override(e) = err(&r, "c2") else {
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
        assert!(r.clusters["cluster1"].is_ok());
        assert_eq!(err(&r, "cluster2"), &ClusterError::UnknownCluster);
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
        let ClusterError::Invalid { culprit, .. } = err(&r, "cluster1") else {
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
        assert_eq!(r.schedule.clusters["c3"].replicas, 0);
        assert_eq!(r.schedule.total(), 12);
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
            assert!(r.clusters["c1"].is_ok());
            assert_eq!(
                err(&r, "c2"),
                &ClusterError::ReplicasOverridden {
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
        assert!(render(&a, &members(&["c1", "c2", "c3"])).unwrap().clusters["c2"].is_ok());
    }

    #[test]
    fn duplicated_status_shows_what_each_cluster_runs_after_overrides() {
        let r = render(&app(SEED), &members(&["cluster1", "cluster2"])).unwrap();
        assert!(!r.schedule.divided);
        let got: Vec<_> = r
            .schedule
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
        assert_eq!(err(&r, "c1"), &ClusterError::FailedOver);
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
                    if let Err(e) = result {
                        prop_assert!(named, "{cluster} failed without an override: {e}");
                        let culprit = e.to_string();
                        prop_assert!(!culprit.is_empty());
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
