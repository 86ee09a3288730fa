//! The CSV's `customresourcedefinitions.owned`: one entry per served version of each CRD,
//! with a spec and a status descriptor per top-level field of that version's schema. The
//! texts come from the schema, so the console shows what `kubectl explain` shows.

use serde_json::{Map, Value, json};

/// UI hints (OLM's `x-descriptors`) for fields the console can render better than as
/// text, by field name; a field not listed gets none.
pub const X_DESCRIPTORS: [(&str, &str, &str); 8] = [
    (
        "spec",
        "replicas",
        "urn:alm:descriptor:com.tectonic.ui:podCount",
    ),
    (
        "spec",
        "size",
        "urn:alm:descriptor:com.tectonic.ui:podCount",
    ),
    ("spec", "image", "urn:alm:descriptor:com.tectonic.ui:text"),
    ("spec", "port", "urn:alm:descriptor:com.tectonic.ui:number"),
    (
        "spec",
        "resources",
        "urn:alm:descriptor:com.tectonic.ui:resourceRequirements",
    ),
    (
        "spec",
        "strategy",
        "urn:alm:descriptor:com.tectonic.ui:advanced",
    ),
    (
        "status",
        "conditions",
        "urn:alm:descriptor:io.kubernetes.conditions",
    ),
    (
        "status",
        "readyReplicas",
        "urn:alm:descriptor:com.tectonic.ui:podCount",
    ),
];

/// The owned entries for `crd`, newest served version first as the CRD lists them;
/// `resources` are the kinds the operator creates for each object.
pub fn owned(crd: &Value, resources: &[(&str, &str)]) -> Vec<Value> {
    let names = &crd["spec"]["names"];
    let kind = names["kind"].as_str().unwrap_or_default();
    let mut out = Vec::new();
    for version in crd["spec"]["versions"].as_array().into_iter().flatten() {
        if version["served"] != true {
            continue;
        }
        let schema = &version["schema"]["openAPIV3Schema"];
        let mut entry = Map::new();
        entry.insert("name".into(), crd["metadata"]["name"].clone());
        entry.insert("version".into(), version["name"].clone());
        entry.insert("kind".into(), json!(kind));
        entry.insert("displayName".into(), json!(kind));
        if let Some(text) = schema["description"].as_str() {
            entry.insert("description".into(), json!(text));
        }
        entry.insert(
            "resources".into(),
            resources
                .iter()
                .map(|(kind, version)| json!({"kind": kind, "name": "", "version": version}))
                .collect(),
        );
        for part in ["spec", "status"] {
            let descriptors = descriptors(part, &schema["properties"][part]);
            if !descriptors.is_empty() {
                entry.insert(format!("{part}Descriptors"), Value::Array(descriptors));
            }
        }
        out.push(Value::Object(entry));
    }
    out
}

fn descriptors(part: &str, schema: &Value) -> Vec<Value> {
    let Some(properties) = schema["properties"].as_object() else {
        return Vec::new();
    };
    properties
        .iter()
        .map(|(path, field)| {
            let mut d = Map::new();
            d.insert("path".into(), json!(path));
            d.insert("displayName".into(), json!(display_name(path)));
            if let Some(text) = field["description"].as_str() {
                d.insert("description".into(), json!(text));
            }
            let hints: Vec<&str> = X_DESCRIPTORS
                .iter()
                .filter(|(p, name, _)| *p == part && name == path)
                .map(|(_, _, urn)| *urn)
                .collect();
            if !hints.is_empty() {
                d.insert("x-descriptors".into(), json!(hints));
            }
            Value::Object(d)
        })
        .collect()
}

/// `readyReplicas` → `Ready Replicas`.
fn display_name(field: &str) -> String {
    let mut out = String::new();
    for (i, c) in field.chars().enumerate() {
        if i == 0 {
            out.extend(c.to_uppercase());
        } else {
            if c.is_uppercase() {
                out.push(' ');
            }
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names() {
        assert_eq!(display_name("readyReplicas"), "Ready Replicas");
        assert_eq!(display_name("observedGeneration"), "Observed Generation");
        assert_eq!(display_name("image"), "Image");
        assert_eq!(display_name(""), "");
    }

    #[test]
    fn one_entry_per_served_version_with_texts_from_the_schema() {
        let crd = json!({
            "metadata": {"name": "things.example.com"},
            "spec": {"names": {"kind": "Thing"}, "versions": [
                {"name": "v1", "served": true, "schema": {"openAPIV3Schema": {
                    "description": "A thing.",
                    "properties": {
                        "spec": {"properties": {"replicas": {"description": "How many."}, "x": {}}},
                        "status": {"properties": {"conditions": {}}}}}}},
                {"name": "v0", "served": false, "schema": {"openAPIV3Schema": {}}},
            ]}
        });
        let owned = owned(&crd, &[("Deployment", "v1")]);
        assert_eq!(owned.len(), 1, "unserved versions are not offered");
        let v1 = &owned[0];
        assert_eq!(v1["version"], "v1");
        assert_eq!(v1["description"], "A thing.");
        assert_eq!(
            v1["specDescriptors"],
            json!([
                {"path": "replicas", "displayName": "Replicas", "description": "How many.",
                 "x-descriptors": ["urn:alm:descriptor:com.tectonic.ui:podCount"]},
                {"path": "x", "displayName": "X"},
            ])
        );
        assert_eq!(
            v1["statusDescriptors"][0]["x-descriptors"],
            json!(["urn:alm:descriptor:io.kubernetes.conditions"])
        );
    }
}
