//! Render: one cluster's MyApp from the app's template, the replicas the schedule gave
//! it and that cluster's overrides. Pure: no I/O, no clock, equal inputs give equal bytes.
//!
//! Template with the assigned replicas → that cluster's overrides → check against the
//! MyApp CRD's own `v1` schema (the member's apiserver enforces it again) → content hash
//! → JSON bytes, serialized once here so that pushing to an agent never re-serializes.
//! Which clusters get one, and with how many replicas, is the planner's (`crate::plan`).
//!
//! Under a divided mode the schedule owns `/spec/replicas`: an override that changes it
//! is that cluster's error (its copy is kept), since it would silently break the total.

use std::sync::LazyLock;

use bytes::Bytes;
use flotilla_crds::FederatedMyApp;
use flotilla_crds::bounds::{self, Bounds};
use jsonptr::{Pointer, Token};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use crate::overrides::{Located, OverrideError};

pub use flotilla_crds::{HASH_ANNOTATION, MANAGED_BY_LABEL, MANAGED_BY_VALUE, SOURCE_ANNOTATION};

/// What one cluster gets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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

/// One render: the MyApp, and the replicas it asks for (`spec.replicas`, 1 when unset),
/// read before serializing so that nobody parses the JSON back for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub myapp: RenderedMyApp,
    pub replicas: u32,
}

/// Why one cluster's MyApp cannot be rendered: that cluster's error alone.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    #[error("{0}")]
    Override(#[from] OverrideError),
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

/// What the schedule gives one cluster besides its overrides.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Share {
    /// Under a divided mode: `spec.replicas` (under autoscaling, the cluster's minimum:
    /// what it starts with until its autoscaler decides).
    pub replicas: Option<u32>,
    /// Under `spec.autoscaling`: its autoscaler's bounds, as annotations.
    pub bounds: Option<Bounds>,
}

/// One app's template, ready to render for any cluster.
pub struct Template<'a> {
    doc: Value,
    namespace: &'a str,
    name: &'a str,
    /// Under a progressive rollout the content hash starts with the revision
    /// ([`revisioned_hash`]).
    revisioned: bool,
}

impl<'a> Template<'a> {
    pub fn of(app: &'a FederatedMyApp) -> Self {
        Self {
            doc: template_doc(app),
            namespace: app.metadata.namespace.as_deref().unwrap_or("default"),
            name: app.metadata.name.as_deref().unwrap_or_default(),
            revisioned: crate::rollout::progressive(app),
        }
    }

    /// The MyApp for one cluster: its operations `ops` and its [`Share`].
    pub fn render(&self, ops: &[Located<'_>], share: Share) -> Result<Rendered, RenderError> {
        let who = (self.namespace, self.name);
        render_one(&self.doc, ops, who, share, self.revisioned)
    }
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
    (namespace, name): (&str, &str),
    share: Share,
    revisioned: bool,
) -> Result<Rendered, RenderError> {
    let replicas = share.replicas;
    let mut doc = base.clone();
    if let Some(n) = replicas {
        doc["spec"]["replicas"] = json!(n);
    }
    crate::overrides::apply(&mut doc, ops)?;
    if let Some(n) = replicas
        && doc.pointer(REPLICAS.as_str()) != Some(&json!(n))
    {
        return Err(RenderError::ReplicasOverridden {
            assigned: n,
            culprit: culprit(ops, REPLICAS).unwrap_or_else(|| "an override".into()),
        });
    }
    let invalid = |path: String, reason: String| RenderError::Invalid {
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
    for (key, value) in share.bounds.iter().flat_map(Bounds::annotations) {
        annotations.insert(key.into(), value.into());
    }
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
    let asked = myapp["spec"]["replicas"].as_u64().unwrap_or(1) as u32;
    let hash = match revisioned {
        true => revisioned_hash(&myapp),
        false => content_hash(&myapp),
    };
    myapp["metadata"]["annotations"][HASH_ANNOTATION] = Value::String(hash.clone());
    let json = serde_json::to_vec(&myapp).expect("a JSON value serializes");
    Ok(Rendered {
        myapp: RenderedMyApp {
            hash,
            json: Bytes::from(json),
        },
        replicas: asked,
    })
}

/// Width of the revision that prefixes a progressive app's content hash.
pub const REVISION_LEN: usize = 16;

/// A progressive app's content hash: `<revision>-<content>`, the revision being the
/// first [`REVISION_LEN`] hex digits of the hash of the MyApp without `spec.replicas`
/// (nor the autoscaling bounds) and the content the first 47 of the full hash, 64
/// characters in all (what the wire bounds a hash to). The agent reports the hash it
/// runs verbatim, so the hub reads from any report, after its own restart too, which
/// revision a member runs, with no change to the wire or the agent; a replica count or
/// bounds alone never change the revision.
pub fn revisioned_hash(myapp: &Value) -> String {
    let mut without = myapp.clone();
    if let Some(spec) = without.get_mut("spec").and_then(Value::as_object_mut) {
        spec.remove("replicas");
    }
    let annotations = without.pointer_mut("/metadata/annotations");
    if let Some(annotations) = annotations.and_then(Value::as_object_mut) {
        for key in bounds::ANNOTATIONS {
            annotations.remove(key);
        }
    }
    let revision = content_hash(&without);
    let content = content_hash(myapp);
    format!(
        "{}-{}",
        &revision[..REVISION_LEN],
        &content[..63 - REVISION_LEN]
    )
}

/// The revision a hash names: its prefix, when it is a progressive app's.
pub fn revision_of(hash: &str) -> Option<&str> {
    let (revision, content) = hash.split_once('-')?;
    let hex = |s: &str| s.bytes().all(|b| b.is_ascii_hexdigit());
    (revision.len() == REVISION_LEN && content.len() == 63 - REVISION_LEN && hex(revision))
        .then_some(revision)
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
            Pointer::parse(o.path()).is_ok_and(|op| path.starts_with(op) || op.starts_with(path))
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
}
