//! Overrides: the changes to the template written for one cluster, in a fixed order.
//!
//! An entry of `spec.overrides` targets the cluster `clusterName` names or the clusters
//! `clusterSelector` selects. For one cluster the entries selecting it by label apply
//! first, in the order written, then those naming it, in the order written: where both
//! write the same path, the entry naming the cluster wins. Within an entry the image
//! helper ([`image`]) applies before the operations.
//!
//! Operations are RFC 6902 with JSON pointers relative to the template (`/spec/replicas`,
//! `/metadata/labels/tier`). `replace` and `remove` need an existing value (RFC 6902);
//! `add` needs an existing parent and appends to arrays with `-`. A value may be taken
//! from a label of the target cluster (`valueFrom.clusterLabel`): resolved per cluster
//! before anything is applied, so a cluster without the label fails alone. Errors name
//! the field of the FederatedMyApp that holds the change, the op and the path.

mod image;

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;

use flotilla_crds::federated::{
    ClusterOverride, ClusterOverrides, ImageOverride, OverrideOp, ValueType,
};
use json_patch::PatchOperation;
use jsonptr::Pointer;
use kube::core::{Selector, SelectorExt};
use serde_json::{Value, json};

use crate::placement::{ClusterName, Labels, parse_selector};

/// The parts of a template an override may change: the spec and the labels and
/// annotations that are merged onto the MyApp. Name and namespace are not the user's to
/// vary per cluster.
const WRITABLE: [&Pointer; 3] = [
    Pointer::from_static("/spec"),
    Pointer::from_static("/metadata/labels"),
    Pointer::from_static("/metadata/annotations"),
];

/// Where the image helper writes.
pub const IMAGE_PATH: &str = "/spec/image";

/// One change for one cluster, with the entry of `spec.overrides` that holds it.
#[derive(Debug, Clone)]
pub struct Located<'a> {
    pub outer: usize,
    pub change: Change<'a>,
}

#[derive(Debug, Clone)]
pub enum Change<'a> {
    /// `clusterOverrides[inner]`, its value resolved for the cluster (`None`: none
    /// written, which `remove` does not need).
    Op {
        inner: usize,
        op: &'a ClusterOverride,
        value: Option<Cow<'a, Value>>,
    },
    /// The entry's `image`, its registry resolved for the cluster.
    Image(Cow<'a, ImageOverride>),
}

impl<'a> Located<'a> {
    pub fn field(&self) -> String {
        match &self.change {
            Change::Op { inner, .. } => {
                format!("spec.overrides[{}].clusterOverrides[{inner}]", self.outer)
            }
            Change::Image(_) => format!("spec.overrides[{}].image", self.outer),
        }
    }

    /// The pointer it writes at.
    pub fn path(&self) -> &'a str {
        match &self.change {
            Change::Op { op, .. } => &op.path,
            Change::Image(_) => IMAGE_PATH,
        }
    }

    pub fn op_name(&self) -> &'static str {
        match &self.change {
            Change::Op { op, .. } => op_name(op.op),
            Change::Image(_) => "image",
        }
    }

    /// What the change does, whatever entry holds it: equal keys change a document
    /// alike.
    pub fn key(&self) -> (&'static str, &'a str, Option<String>) {
        let what = match &self.change {
            Change::Op { value, .. } => value.as_deref().map(Value::to_string),
            Change::Image(i) => Some(serde_json::to_string(i).expect("serializes")),
        };
        (self.op_name(), self.path(), what)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct OverrideError {
    pub field: String,
    /// `add`, `remove`, `replace`, `image`; empty for an entry that cannot be read.
    pub op: &'static str,
    pub path: String,
    pub reason: String,
}

impl fmt::Display for OverrideError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.op {
            "" => write!(f, "{}: {}", self.field, self.reason),
            op => write!(f, "{} ({op} {}): {}", self.field, self.path, self.reason),
        }
    }
}

pub fn op_name(op: OverrideOp) -> &'static str {
    match op {
        OverrideOp::Add => "add",
        OverrideOp::Remove => "remove",
        OverrideOp::Replace => "replace",
    }
}

/// Which entries of one app's overrides target which cluster, read once per plan.
pub struct Targets<'a> {
    all: &'a [ClusterOverrides],
    /// Entries by label, in the order written.
    selectors: Vec<(usize, Selector)>,
    by_name: HashMap<&'a str, Vec<usize>>,
    /// The first entry that cannot be read (both targets or neither, an invalid
    /// selector): it might target any cluster, so every cluster fails on it and keeps
    /// what it runs.
    invalid: Option<OverrideError>,
}

impl<'a> Targets<'a> {
    pub fn of(all: &'a [ClusterOverrides]) -> Self {
        let mut targets = Targets {
            all,
            selectors: Vec::new(),
            by_name: HashMap::new(),
            invalid: None,
        };
        for (outer, entry) in all.iter().enumerate() {
            let unreadable = |reason: String| OverrideError {
                field: format!("spec.overrides[{outer}]"),
                op: "",
                path: String::new(),
                reason,
            };
            match (&entry.cluster_name, &entry.cluster_selector) {
                (Some(name), None) => targets.by_name.entry(name).or_default().push(outer),
                (None, Some(selector)) => {
                    let field = format!("spec.overrides[{outer}].clusterSelector");
                    match parse_selector(selector, &field) {
                        Ok(s) => targets.selectors.push((outer, s)),
                        Err(e) => {
                            let e = OverrideError {
                                field: e.field,
                                op: "",
                                path: String::new(),
                                reason: e.reason,
                            };
                            targets.invalid.get_or_insert(e);
                        }
                    }
                }
                (Some(_), Some(_)) => {
                    let e = unreadable(
                        "sets both clusterName and clusterSelector; set exactly one".into(),
                    );
                    targets.invalid.get_or_insert(e);
                }
                (None, None) => {
                    let e = unreadable(
                        "sets neither clusterName nor clusterSelector; set exactly one".into(),
                    );
                    targets.invalid.get_or_insert(e);
                }
            }
        }
        targets
    }

    /// The entries that apply to `cluster`, in the order they apply.
    pub fn entries(&self, cluster: &str, labels: &Labels) -> Vec<usize> {
        let by_label = self.selectors.iter().filter(|(_, s)| s.matches(labels));
        let by_name = self.by_name.get(cluster).into_iter().flatten();
        by_label.map(|(i, _)| *i).chain(by_name.copied()).collect()
    }

    /// Every change for `cluster`, in the order they apply, values taken from its
    /// labels; the first that cannot be resolved is the cluster's error.
    pub fn for_cluster(
        &self,
        cluster: &str,
        labels: &Labels,
    ) -> Result<Vec<Located<'a>>, OverrideError> {
        if let Some(e) = &self.invalid {
            return Err(e.clone());
        }
        let mut changes = Vec::new();
        for outer in self.entries(cluster, labels) {
            let entry = &self.all[outer];
            if let Some(image) = &entry.image {
                let image =
                    resolve_image(image, cluster, labels).map_err(|reason| OverrideError {
                        field: format!("spec.overrides[{outer}].image"),
                        op: "image",
                        path: IMAGE_PATH.to_owned(),
                        reason,
                    })?;
                changes.push(Located {
                    outer,
                    change: Change::Image(image),
                });
            }
            for (inner, op) in entry.cluster_overrides.iter().enumerate() {
                let value = resolve(op, cluster, labels).map_err(|reason| OverrideError {
                    field: format!("spec.overrides[{outer}].clusterOverrides[{inner}]"),
                    op: op_name(op.op),
                    path: op.path.clone(),
                    reason,
                })?;
                changes.push(Located {
                    outer,
                    change: Change::Op { inner, op, value },
                });
            }
        }
        Ok(changes)
    }

    /// Entries that target none of `placed` (sorted; `labels` gives each one's): they
    /// change nothing, which the user is warned of.
    pub fn unused<'p>(
        &self,
        placed: &'p [ClusterName],
        labels: impl Fn(&str) -> &'p Labels,
    ) -> Vec<String> {
        let mut warnings = Vec::new();
        for entry in self.all {
            if let (Some(name), None) = (&entry.cluster_name, &entry.cluster_selector)
                && placed.binary_search_by(|c| (**c).cmp(name)).is_err()
            {
                warnings.push(format!(
                    "overrides for cluster {name} are ignored: it is not placed"
                ));
            }
        }
        for (outer, selector) in &self.selectors {
            if !placed.iter().any(|c| selector.matches(labels(c))) {
                warnings.push(format!(
                    "spec.overrides[{outer}].clusterSelector selects no placed cluster: its overrides are ignored"
                ));
            }
        }
        warnings
    }
}

/// The operation's value for `cluster`: as written, or from its label.
fn resolve<'a>(
    op: &'a ClusterOverride,
    cluster: &str,
    labels: &Labels,
) -> Result<Option<Cow<'a, Value>>, String> {
    let Some(from) = &op.value_from else {
        return Ok(op.value.as_ref().map(Cow::Borrowed));
    };
    if op.value.is_some() {
        return Err("sets value and valueFrom; set one".into());
    }
    if op.op == OverrideOp::Remove {
        return Ok(None);
    }
    let key = &from.cluster_label;
    let Some(label) = labels.get(key) else {
        return Err(format!(
            "valueFrom.clusterLabel: MemberCluster {cluster} has no label {key}"
        ));
    };
    let value = match from.type_ {
        ValueType::String => Value::String(label.clone()),
        ValueType::Integer => label.parse::<i64>().map(Value::from).map_err(|_| {
            format!(
                "valueFrom.clusterLabel: label {key} of MemberCluster {cluster} is {label:?}, not an integer"
            )
        })?,
    };
    Ok(Some(Cow::Owned(value)))
}

/// The image helper for `cluster`: its registry as written, or from its label.
fn resolve_image<'a>(
    image: &'a ImageOverride,
    cluster: &str,
    labels: &Labels,
) -> Result<Cow<'a, ImageOverride>, String> {
    let Some(from) = &image.registry_from else {
        return Ok(Cow::Borrowed(image));
    };
    if image.registry.is_some() {
        return Err("sets registry and registryFrom; set one".into());
    }
    let key = &from.cluster_label;
    let registry = labels.get(key).ok_or_else(|| {
        format!("registryFrom.clusterLabel: MemberCluster {cluster} has no label {key}")
    })?;
    Ok(Cow::Owned(ImageOverride {
        registry: Some(registry.clone()),
        registry_from: None,
        ..image.clone()
    }))
}

/// Applies the changes to `doc` one by one; stops at the first failure.
pub fn apply(doc: &mut Value, changes: &[Located<'_>]) -> Result<(), OverrideError> {
    for located in changes {
        let done = match &located.change {
            Change::Op { op, value, .. } => apply_one(doc, op.op, &op.path, value.as_deref()),
            Change::Image(with) => apply_image(doc, with),
        };
        done.map_err(|reason| OverrideError {
            field: located.field(),
            op: located.op_name(),
            path: located.path().to_owned(),
            reason,
        })?;
    }
    Ok(())
}

fn apply_image(doc: &mut Value, with: &ImageOverride) -> Result<(), String> {
    let Some(Value::String(current)) = doc.pointer_mut(IMAGE_PATH) else {
        return Err(
            "spec.image is not set (or not a string): the image helper rewrites an existing image"
                .into(),
        );
    };
    *current = image::rewrite(current, with)?;
    Ok(())
}

fn apply_one(
    doc: &mut Value,
    op: OverrideOp,
    path: &str,
    value: Option<&Value>,
) -> Result<(), String> {
    let path = parse(path)?;
    if !WRITABLE.iter().any(|root| path.starts_with(root)) {
        let roots: Vec<&str> = WRITABLE.iter().map(|p| p.as_str()).collect();
        return Err(format!("path must be within {}", roots.join(", ")));
    }
    let value = match (op, value) {
        (OverrideOp::Remove, _) => Value::Null,
        (_, Some(v)) => v.clone(),
        (op, None) => return Err(format!("{} needs a value", op_name(op))),
    };
    if matches!(op, OverrideOp::Replace | OverrideOp::Remove)
        && doc.pointer(path.as_str()).is_none()
    {
        return Err(format!(
            "nothing at this path in the template; {} needs an existing value (use add to create one)",
            op_name(op)
        ));
    }
    let operation: PatchOperation =
        serde_json::from_value(json!({"op": op_name(op), "path": path.as_str(), "value": value}))
            .map_err(|e| format!("invalid JSON pointer: {e}"))?;
    json_patch::patch(doc, &[operation]).map_err(|e| match e.kind {
        json_patch::PatchErrorKind::InvalidPointer => {
            "the parent does not exist, or the array index is out of range".to_owned()
        }
        kind => kind.to_string(),
    })
}

/// An RFC 6901 pointer below the root (the root itself is not a path to change).
fn parse(path: &str) -> Result<&Pointer, String> {
    match Pointer::parse(path) {
        Ok(p) if !p.is_root() => Ok(p),
        Err(e) if e.is_invalid_encoding() => {
            Err("invalid JSON pointer: '~' must be followed by 0 or 1".into())
        }
        _ => Err("path must be a JSON pointer starting with '/', e.g. /spec/replicas".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc() -> Value {
        json!({
            "metadata": {"labels": {"app": "web"}, "annotations": {}},
            "spec": {"replicas": 3, "image": "nginx:1.27", "env": [{"name": "A", "value": "1"}],
                     "config": {"a/b": "slash", "m~n": "tilde"}}
        })
    }

    fn op(op: OverrideOp, path: &str, value: Option<Value>) -> ClusterOverride {
        ClusterOverride {
            op,
            path: path.into(),
            value,
            value_from: None,
        }
    }

    fn for_cluster<'a>(all: &'a [ClusterOverrides], cluster: &str) -> Vec<Located<'a>> {
        Targets::of(all)
            .for_cluster(cluster, &Labels::new())
            .expect("the targets read")
    }

    fn run(ops: &[ClusterOverride]) -> Result<Value, OverrideError> {
        let all = [ClusterOverrides::named("c", ops.to_vec())];
        let mut d = doc();
        apply(&mut d, &for_cluster(&all, "c")).map(|()| d)
    }

    fn err(ops: &[ClusterOverride]) -> OverrideError {
        run(ops).expect_err("the override must fail")
    }

    use OverrideOp::{Add, Remove, Replace};

    #[test]
    fn replace_existing_value() {
        let d = run(&[op(Replace, "/spec/replicas", Some(json!(5)))]).unwrap();
        assert_eq!(d["spec"]["replicas"], 5);
    }

    #[test]
    fn replace_is_the_default_op() {
        let o: ClusterOverride =
            serde_json::from_value(json!({"path": "/spec/replicas", "value": 5})).unwrap();
        assert_eq!(o.op, Replace);
    }

    #[test]
    fn add_new_field_and_label() {
        let d = run(&[
            op(Add, "/spec/port", Some(json!(8080))),
            op(Add, "/metadata/labels/tier", Some(json!("gold"))),
        ])
        .unwrap();
        assert_eq!(d["spec"]["port"], 8080);
        assert_eq!(d["metadata"]["labels"]["tier"], "gold");
    }

    #[test]
    fn add_replaces_an_existing_member_as_rfc6902_says() {
        let d = run(&[op(Add, "/spec/replicas", Some(json!(7)))]).unwrap();
        assert_eq!(d["spec"]["replicas"], 7);
    }

    #[test]
    fn add_to_array_end_with_dash_and_at_index() {
        let d = run(&[
            op(Add, "/spec/env/-", Some(json!({"name": "B"}))),
            op(Add, "/spec/env/0", Some(json!({"name": "Z"}))),
        ])
        .unwrap();
        let names: Vec<_> = d["spec"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].clone())
            .collect();
        assert_eq!(names, [json!("Z"), json!("A"), json!("B")]);
    }

    #[test]
    fn add_past_array_end_fails() {
        let e = err(&[op(Add, "/spec/env/5", Some(json!({"name": "B"})))]);
        assert!(e.reason.contains("out of range"), "{e}");
    }

    #[test]
    fn add_under_missing_parent_fails() {
        let e = err(&[op(Add, "/spec/nope/deeper", Some(json!(1)))]);
        assert!(e.reason.contains("parent does not exist"), "{e}");
    }

    #[test]
    fn remove_existing_and_array_element() {
        let d = run(&[
            op(Remove, "/spec/image", None),
            op(Remove, "/spec/env/0", None),
        ])
        .unwrap();
        assert!(d["spec"].get("image").is_none());
        assert_eq!(d["spec"]["env"], json!([]));
    }

    #[test]
    fn remove_or_replace_missing_path_fails() {
        for o in [Remove, Replace] {
            let e = err(&[op(o, "/spec/replicaz", Some(json!(1)))]);
            assert_eq!(e.path, "/spec/replicaz");
            assert!(e.reason.contains("nothing at this path"), "{e}");
        }
    }

    #[test]
    fn escaped_pointers_reach_keys_with_slash_and_tilde() {
        let d = run(&[
            op(Replace, "/spec/config/a~1b", Some(json!("new slash"))),
            op(Replace, "/spec/config/m~0n", Some(json!("new tilde"))),
        ])
        .unwrap();
        assert_eq!(
            d["spec"]["config"],
            json!({"a/b": "new slash", "m~n": "new tilde"})
        );
    }

    #[test]
    fn invalid_escape_is_rejected() {
        let e = err(&[op(Replace, "/spec/config/a~2b", Some(json!("x")))]);
        assert!(e.reason.contains("'~' must be followed by 0 or 1"), "{e}");
    }

    #[test]
    fn pointer_must_start_with_slash() {
        for path in ["spec/replicas", "", "#/spec/replicas"] {
            let e = err(&[op(Replace, path, Some(json!(1)))]);
            assert!(e.reason.contains("starting with '/'"), "{path}: {e}");
        }
    }

    #[test]
    fn only_spec_labels_and_annotations_are_writable() {
        for path in [
            "/metadata/name",
            "/metadata",
            "/kind",
            "/specs/replicas",
            "/",
        ] {
            let e = err(&[op(Add, path, Some(json!("x")))]);
            assert!(e.reason.contains("must be within"), "{path}: {e}");
        }
    }

    #[test]
    fn add_and_replace_need_a_value() {
        for o in [Add, Replace] {
            let e = err(&[op(o, "/spec/replicas", None)]);
            assert!(e.reason.ends_with("needs a value"), "{e}");
        }
    }

    #[test]
    fn operations_apply_in_order() {
        let d = run(&[
            op(Replace, "/spec/replicas", Some(json!(4))),
            op(Remove, "/spec/replicas", None),
            op(Add, "/spec/replicas", Some(json!(9))),
        ])
        .unwrap();
        assert_eq!(d["spec"]["replicas"], 9);
    }

    #[test]
    fn error_names_the_field_op_and_path() {
        let e = err(&[
            op(Replace, "/spec/replicas", Some(json!(4))),
            op(Remove, "/spec/gone", None),
        ]);
        assert_eq!(e.field, "spec.overrides[0].clusterOverrides[1]");
        assert_eq!(
            e.to_string(),
            "spec.overrides[0].clusterOverrides[1] (remove /spec/gone): nothing at this path in the \
             template; remove needs an existing value (use add to create one)"
        );
    }

    #[test]
    fn repeated_entries_for_a_cluster_are_concatenated_in_order() {
        let all = [
            ClusterOverrides::named("c", vec![op(Replace, "/spec/replicas", Some(json!(2)))]),
            ClusterOverrides::named("other", vec![op(Replace, "/spec/replicas", Some(json!(8)))]),
            ClusterOverrides::named("c", vec![op(Replace, "/spec/replicas", Some(json!(6)))]),
        ];
        let ops = for_cluster(&all, "c");
        assert_eq!(
            ops.iter().map(Located::field).collect::<Vec<_>>(),
            [
                "spec.overrides[0].clusterOverrides[0]",
                "spec.overrides[2].clusterOverrides[0]"
            ]
        );
        let mut d = doc();
        apply(&mut d, &ops).unwrap();
        assert_eq!(d["spec"]["replicas"], 6);
    }

    #[test]
    fn a_failed_operation_leaves_no_partial_change_of_its_own() {
        let mut d = doc();
        let all = [ClusterOverrides::named(
            "c",
            vec![op(Add, "/spec/env/9", Some(json!({})))],
        )];
        assert!(apply(&mut d, &for_cluster(&all, "c")).is_err());
        assert_eq!(d, doc());
    }

    #[test]
    fn writable_roots_are_matched_segment_wise() {
        for path in [
            "/spec",
            "/spec/replicas",
            "/metadata/labels",
            "/metadata/labels/a~1b",
        ] {
            assert!(run(&[op(Add, path, Some(json!("x")))]).is_ok(), "{path}");
        }
        for path in ["/specs", "/metadata/labelsx", "/metadata/name", "/spe"] {
            let e = err(&[op(Add, path, Some(json!("x")))]);
            assert!(e.reason.contains("must be within"), "{path}: {e}");
        }
    }

    #[test]
    fn trailing_tilde_is_an_invalid_escape() {
        let e = err(&[op(Replace, "/spec/config/m~", Some(json!("x")))]);
        assert!(e.reason.contains("'~' must be followed by 0 or 1"), "{e}");
    }

    // ---- targets by label, the image helper, values from labels ----

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect()
    }

    fn entries(yaml: &str) -> Vec<ClusterOverrides> {
        serde_yaml::from_str(yaml).expect("valid overrides YAML")
    }

    fn fields(changes: &[Located<'_>]) -> Vec<String> {
        changes.iter().map(Located::field).collect()
    }

    const EU: [(&str, &str); 1] = [("region", "eu")];

    #[test]
    fn an_entry_with_both_targets_or_neither_fails_every_cluster_naming_it() {
        for (yaml, said) in [
            (
                "- {clusterName: c, clusterSelector: {}}",
                "sets both clusterName and clusterSelector",
            ),
            (
                "- {clusterOverrides: [{path: /spec/replicas, value: 2}]}",
                "sets neither",
            ),
        ] {
            let all = entries(&format!("- {{clusterName: other}}\n{yaml}"));
            let targets = Targets::of(&all);
            for cluster in ["c", "other", "elsewhere"] {
                let e = targets.for_cluster(cluster, &labels(&EU)).unwrap_err();
                assert_eq!(e.field, "spec.overrides[1]");
                assert!(e.to_string().starts_with("spec.overrides[1]: "), "{e}");
                assert!(e.reason.contains(said), "{e}");
            }
        }
    }

    #[test]
    fn an_invalid_selector_fails_every_cluster_naming_the_requirement() {
        let all = entries(
            "- clusterSelector: {matchExpressions: [{key: region, operator: In}]}\n  clusterOverrides: []",
        );
        let e = Targets::of(&all)
            .for_cluster("c", &Labels::new())
            .unwrap_err();
        assert_eq!(
            e.field,
            "spec.overrides[0].clusterSelector.matchExpressions[0]"
        );
    }

    #[test]
    fn an_empty_selector_selects_every_cluster_and_one_matching_nothing_none() {
        let all = entries(
            "- clusterSelector: {}\n  clusterOverrides: [{path: /spec/replicas, value: 4}]\n\
             - clusterSelector: {matchLabels: {region: mars}}\n  clusterOverrides: [{path: /spec/replicas, value: 9}]",
        );
        let targets = Targets::of(&all);
        for l in [Labels::new(), labels(&EU)] {
            let changes = targets.for_cluster("any", &l).unwrap();
            assert_eq!(fields(&changes), ["spec.overrides[0].clusterOverrides[0]"]);
        }
        let eu = labels(&EU);
        let unused = targets.unused(&["c".into()], |_| &eu);
        assert_eq!(
            unused,
            [
                "spec.overrides[1].clusterSelector selects no placed cluster: its overrides are ignored"
            ]
        );
    }

    #[test]
    fn selected_entries_apply_first_in_order_then_named_ones_so_the_name_wins() {
        // Written name first, then two selectors: the order of application is the
        // selectors in list order, then the name, whatever the order written.
        let all = entries(
            "- clusterName: c\n  clusterOverrides: [{path: /spec/replicas, value: 7}]\n\
             - clusterSelector: {matchLabels: {region: eu}}\n  clusterOverrides: [{path: /spec/replicas, value: 3}]\n\
             - clusterSelector: {matchExpressions: [{key: region, operator: Exists}]}\n  clusterOverrides: [{path: /spec/replicas, value: 2}]\n\
             - clusterName: d\n  clusterOverrides: [{path: /spec/replicas, value: 8}]",
        );
        let targets = Targets::of(&all);
        let changes = targets.for_cluster("c", &labels(&EU)).unwrap();
        assert_eq!(
            fields(&changes),
            [
                "spec.overrides[1].clusterOverrides[0]",
                "spec.overrides[2].clusterOverrides[0]",
                "spec.overrides[0].clusterOverrides[0]"
            ]
        );
        let mut d = doc();
        apply(&mut d, &changes).unwrap();
        assert_eq!(d["spec"]["replicas"], 7, "the entry naming c wins");
        // Without the name, the last matching selector wins; without labels, nothing.
        let mut d = doc();
        apply(&mut d, &targets.for_cluster("e", &labels(&EU)).unwrap()).unwrap();
        assert_eq!(d["spec"]["replicas"], 2);
        assert!(targets.for_cluster("e", &Labels::new()).unwrap().is_empty());
        let eu = labels(&EU);
        let unused = targets.unused(&["c".into()], |_| &eu);
        assert_eq!(
            unused,
            ["overrides for cluster d are ignored: it is not placed"]
        );
    }

    #[test]
    fn values_come_from_the_clusters_labels_or_name_what_is_missing() {
        let all = entries(
            "- clusterSelector: {}\n  clusterOverrides:\n  \
             - {op: add, path: /metadata/labels/region, valueFrom: {clusterLabel: topology.kubernetes.io/region}}\n  \
             - {path: /spec/replicas, valueFrom: {clusterLabel: floor, type: Integer}}",
        );
        let targets = Targets::of(&all);
        let region = "topology.kubernetes.io/region";
        let run = |l: Labels| -> Result<Value, OverrideError> {
            let changes = targets.for_cluster("c1", &l)?;
            let mut d = doc();
            apply(&mut d, &changes).map(|()| d)
        };
        let d = run(labels(&[(region, "europe-west1"), ("floor", "4")])).unwrap();
        assert_eq!(d["metadata"]["labels"]["region"], "europe-west1");
        assert_eq!(d["spec"]["replicas"], 4);
        // Unicode passes through as written (the render CLI reads labels from files).
        let d = run(labels(&[(region, "région-ünï"), ("floor", "-2")])).unwrap();
        assert_eq!(d["metadata"]["labels"]["region"], "région-ünï");
        assert_eq!(d["spec"]["replicas"], -2);

        let e = run(labels(&[("floor", "4")])).unwrap_err();
        assert_eq!(e.field, "spec.overrides[0].clusterOverrides[0]");
        assert_eq!(
            e.to_string(),
            "spec.overrides[0].clusterOverrides[0] (add /metadata/labels/region): \
             valueFrom.clusterLabel: MemberCluster c1 has no label topology.kubernetes.io/region"
        );
        for floor in ["four", "", "4.0", "99999999999999999999"] {
            let e = run(labels(&[(region, "eu"), ("floor", floor)])).unwrap_err();
            assert_eq!(e.field, "spec.overrides[0].clusterOverrides[1]");
            assert!(
                e.reason.contains(&format!(
                    "label floor of MemberCluster c1 is {floor:?}, not an integer"
                )),
                "{e}"
            );
        }
    }

    #[test]
    fn value_and_value_from_together_are_refused_and_remove_needs_no_label() {
        let all = entries(
            "- clusterName: c\n  clusterOverrides:\n  \
             - {op: remove, path: /spec/image, valueFrom: {clusterLabel: nope}}\n  \
             - {path: /spec/replicas, value: 2, valueFrom: {clusterLabel: nope}}",
        );
        let e = Targets::of(&all)
            .for_cluster("c", &Labels::new())
            .unwrap_err();
        assert_eq!(e.field, "spec.overrides[0].clusterOverrides[1]");
        assert!(e.reason.contains("sets value and valueFrom"), "{e}");
        let all = entries(
            "- clusterName: c\n  clusterOverrides: [{op: remove, path: /spec/image, valueFrom: {clusterLabel: nope}}]",
        );
        let mut d = doc();
        apply(&mut d, &for_cluster(&all, "c")).unwrap();
        assert!(d["spec"].get("image").is_none());
    }

    #[test]
    fn the_image_helper_applies_before_its_entrys_operations_and_names_itself() {
        let all = entries(
            "- clusterSelector: {}\n  image: {registry: registry.eu.example.com, tag: '1.28'}\n\
             - clusterName: c\n  image: {tag: '1.29'}\n  clusterOverrides: [{path: /spec/image, value: 'web:2'}]",
        );
        let changes = for_cluster(&all, "c");
        assert_eq!(
            fields(&changes),
            [
                "spec.overrides[0].image",
                "spec.overrides[1].image",
                "spec.overrides[1].clusterOverrides[0]"
            ]
        );
        let mut d = doc();
        apply(&mut d, &changes[..2]).unwrap();
        assert_eq!(
            d["spec"]["image"],
            "registry.eu.example.com/library/nginx:1.29"
        );
        apply(&mut d, &changes[2..]).unwrap();
        assert_eq!(
            d["spec"]["image"], "web:2",
            "the operation after the helper wins"
        );

        let mut d = doc();
        d["spec"].as_object_mut().unwrap().remove("image");
        let e = apply(&mut d, &changes).unwrap_err();
        assert_eq!(e.field, "spec.overrides[0].image");
        assert!(
            e.to_string()
                .starts_with("spec.overrides[0].image (image /spec/image): spec.image is not set"),
            "{e}"
        );
        let mut d = doc();
        d["spec"]["image"] = json!("Not A Ref:1");
        let e = apply(&mut d, &changes).unwrap_err();
        assert!(
            e.reason
                .contains("\"Not A Ref:1\" is not an image reference"),
            "{e}"
        );
    }

    #[test]
    fn a_regional_registry_comes_from_the_clusters_label() {
        let all = entries(
            "- clusterSelector: {}\n  image: {registryFrom: {clusterLabel: flotilla.io/registry}, tag: '1.28'}",
        );
        let targets = Targets::of(&all);
        let run = |l: Labels| -> Result<Value, OverrideError> {
            let changes = targets.for_cluster("c1", &l)?;
            let mut d = doc();
            apply(&mut d, &changes).map(|()| d)
        };
        let d = run(labels(&[(
            "flotilla.io/registry",
            "mirror.eu.example.com:5000",
        )]))
        .unwrap();
        assert_eq!(
            d["spec"]["image"],
            "mirror.eu.example.com:5000/library/nginx:1.28"
        );
        let e = run(Labels::new()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "spec.overrides[0].image (image /spec/image): registryFrom.clusterLabel: \
             MemberCluster c1 has no label flotilla.io/registry"
        );
        // A label that is no registry host is named as the registry it would be.
        let e = run(labels(&[("flotilla.io/registry", "eu")])).unwrap_err();
        assert!(
            e.reason
                .starts_with("image.registry \"eu\" is not a valid registry"),
            "{e}"
        );

        let all = entries(
            "- clusterName: c1\n  image: {registry: a.io, registryFrom: {clusterLabel: r}}",
        );
        let e = Targets::of(&all)
            .for_cluster("c1", &Labels::new())
            .unwrap_err();
        assert_eq!(e.field, "spec.overrides[0].image");
        assert!(e.reason.contains("sets registry and registryFrom"), "{e}");
    }
}
