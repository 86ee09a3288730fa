//! Overrides: one cluster's RFC 6902 operations on the template, in the order written.
//!
//! Paths are JSON pointers relative to the template (`/spec/replicas`,
//! `/metadata/labels/tier`). `replace` and `remove` need an existing value (RFC 6902);
//! `add` needs an existing parent and appends to arrays with `-`. Errors name the field
//! of the FederatedMyApp that holds the operation, the op and the path.

use flotilla_crds::federated::{ClusterOverride, ClusterOverrides, OverrideOp};
use json_patch::PatchOperation;
use jsonptr::Pointer;
use serde_json::{Value, json};

/// The parts of a template an override may change: the spec and the labels and
/// annotations that are merged onto the MyApp. Name and namespace are not the user's to
/// vary per cluster.
const WRITABLE: [&Pointer; 3] = [
    Pointer::from_static("/spec"),
    Pointer::from_static("/metadata/labels"),
    Pointer::from_static("/metadata/annotations"),
];

/// One operation, with the field that holds it (`spec.overrides[0].clusterOverrides[1]`).
#[derive(Debug, Clone, Copy)]
pub struct Located<'a> {
    pub outer: usize,
    pub inner: usize,
    pub op: &'a ClusterOverride,
}

impl Located<'_> {
    pub fn field(&self) -> String {
        format!(
            "spec.overrides[{}].clusterOverrides[{}]",
            self.outer, self.inner
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} ({op} {path}): {reason}")]
pub struct OverrideError {
    pub field: String,
    pub op: &'static str,
    pub path: String,
    pub reason: String,
}

pub fn op_name(op: OverrideOp) -> &'static str {
    match op {
        OverrideOp::Add => "add",
        OverrideOp::Remove => "remove",
        OverrideOp::Replace => "replace",
    }
}

/// Every operation written for `cluster`, in order, across repeated entries for it.
pub fn for_cluster<'a>(all: &'a [ClusterOverrides], cluster: &str) -> Vec<Located<'a>> {
    all.iter()
        .enumerate()
        .filter(|(_, o)| o.cluster_name == cluster)
        .flat_map(|(outer, o)| {
            o.cluster_overrides
                .iter()
                .enumerate()
                .map(move |(inner, op)| Located { outer, inner, op })
        })
        .collect()
}

/// Applies the operations to `doc` one by one; stops at the first failure.
pub fn apply(doc: &mut Value, ops: &[Located<'_>]) -> Result<(), OverrideError> {
    for located in ops {
        apply_one(doc, located.op).map_err(|reason| OverrideError {
            field: located.field(),
            op: op_name(located.op.op),
            path: located.op.path.clone(),
            reason,
        })?;
    }
    Ok(())
}

fn apply_one(doc: &mut Value, o: &ClusterOverride) -> Result<(), String> {
    let path = parse(&o.path)?;
    if !WRITABLE.iter().any(|root| path.starts_with(root)) {
        let roots: Vec<&str> = WRITABLE.iter().map(|p| p.as_str()).collect();
        return Err(format!("path must be within {}", roots.join(", ")));
    }
    let value = match (o.op, &o.value) {
        (OverrideOp::Remove, _) => Value::Null,
        (_, Some(v)) => v.clone(),
        (op, None) => return Err(format!("{} needs a value", op_name(op))),
    };
    if matches!(o.op, OverrideOp::Replace | OverrideOp::Remove)
        && doc.pointer(path.as_str()).is_none()
    {
        return Err(format!(
            "nothing at this path in the template; {} needs an existing value (use add to create one)",
            op_name(o.op)
        ));
    }
    let operation: PatchOperation =
        serde_json::from_value(json!({"op": op_name(o.op), "path": path.as_str(), "value": value}))
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
        }
    }

    fn run(ops: &[ClusterOverride]) -> Result<Value, OverrideError> {
        let all = [ClusterOverrides {
            cluster_name: "c".into(),
            cluster_overrides: ops.to_vec(),
        }];
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
            ClusterOverrides {
                cluster_name: "c".into(),
                cluster_overrides: vec![op(Replace, "/spec/replicas", Some(json!(2)))],
            },
            ClusterOverrides {
                cluster_name: "other".into(),
                cluster_overrides: vec![op(Replace, "/spec/replicas", Some(json!(8)))],
            },
            ClusterOverrides {
                cluster_name: "c".into(),
                cluster_overrides: vec![op(Replace, "/spec/replicas", Some(json!(6)))],
            },
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
        let all = [ClusterOverrides {
            cluster_name: "c".into(),
            cluster_overrides: vec![op(Add, "/spec/env/9", Some(json!({})))],
        }];
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
}
