//! Drift: a managed MyApp whose spec someone else changed since the agent applied it
//! (a `kubectl edit` in the member, say). The content-hash annotation cannot tell: it
//! rides along with any edit. The field managers can: the agent writes every MyApp by
//! server-side apply under [`FIELD_MANAGER`], and the apiserver records who last set
//! each field. A spec field owned by any other manager's own write is drift, except the
//! replicas, which an autoscaler (through `/scale`) or a hand-made scale may own and
//! whose return is the hand-back's business ([`crate::handback`]).
//!
//! The agent reports drift to the hub (the report's `drift`, and an empty hash in
//! Hello), which sends its Apply again: the agent's forced apply takes the fields back.
//! A field the hub's MyApp does not set at all stays with whoever added it, and stays
//! reported.

use std::collections::BTreeSet;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

use crate::replicas::keeper;
use crate::sync::FIELD_MANAGER;

/// The longest drift note: a few field paths and managers, never a whole tree.
const NOTE_MAX: usize = 512;

/// The spec fields other managers own, in words (`spec.image by kubectl-edit`), sorted;
/// None when the agent owns every spec field but the replicas.
pub fn of(fields: &[ManagedFieldsEntry]) -> Option<String> {
    let mut found: BTreeSet<String> = BTreeSet::new();
    for entry in fields {
        let manager = entry.manager.as_deref().unwrap_or("an unnamed manager");
        let ours = manager == FIELD_MANAGER || manager == keeper(FIELD_MANAGER);
        let subresource = entry.subresource.as_deref().is_some_and(|s| !s.is_empty());
        if ours || subresource {
            continue;
        }
        let Some(spec) = (entry.fields_v1.as_ref())
            .and_then(|f| f.0.get("f:spec"))
            .and_then(|s| s.as_object())
        else {
            continue;
        };
        for field in spec.keys().filter_map(|k| k.strip_prefix("f:")) {
            if field != "replicas" && field != "size" {
                found.insert(format!("spec.{field} by {manager}"));
            }
        }
    }
    if found.is_empty() {
        return None;
    }
    let mut note = found.into_iter().collect::<Vec<_>>().join(", ");
    if note.len() > NOTE_MAX {
        let mut end = NOTE_MAX;
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
        note.push('…');
    }
    Some(note)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::FieldsV1;
    use serde_json::{Value, json};

    fn entry(
        manager: &str,
        operation: &str,
        subresource: &str,
        fields: Value,
    ) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            manager: Some(manager.into()),
            operation: Some(operation.into()),
            subresource: Some(subresource.into()).filter(|s: &String| !s.is_empty()),
            api_version: Some("app.example.com/v1".into()),
            fields_v1: Some(FieldsV1(fields)),
            ..Default::default()
        }
    }

    fn spec(fields: &[&str]) -> Value {
        let spec: serde_json::Map<String, Value> = fields
            .iter()
            .map(|f| (format!("f:{f}"), json!({})))
            .collect();
        json!({"f:metadata": {"f:labels": {}}, "f:spec": spec})
    }

    #[test]
    fn nothing_but_the_agents_own_writes_is_no_drift() {
        assert_eq!(of(&[]), None);
        let fields = [
            entry(
                FIELD_MANAGER,
                "Apply",
                "",
                spec(&["image", "replicas", "config"]),
            ),
            entry("flotilla-agent-replicas", "Apply", "", spec(&["replicas"])),
            entry(
                "flotilla-operator",
                "Update",
                "status",
                json!({"f:status": {}}),
            ),
            entry(
                "kube-controller-manager",
                "Update",
                "scale",
                spec(&["replicas"]),
            ),
        ];
        assert_eq!(of(&fields), None);
    }

    #[test]
    fn a_hand_edit_of_the_spec_is_drift_naming_field_and_manager() {
        let fields = [
            entry(FIELD_MANAGER, "Apply", "", spec(&["replicas"])),
            entry("kubectl-edit", "Update", "", spec(&["image"])),
            entry("kubectl-patch", "Update", "", spec(&["config", "image"])),
        ];
        assert_eq!(
            of(&fields).as_deref(),
            Some(
                "spec.config by kubectl-patch, spec.image by kubectl-edit, spec.image by kubectl-patch"
            )
        );
    }

    /// The replicas are the hand-back's (a `kubectl scale`, an autoscaler); metadata and
    /// status edits are not the spec.
    #[test]
    fn replicas_metadata_and_status_are_not_drift() {
        let fields = [
            entry("kubectl-scale", "Update", "", spec(&["replicas"])),
            entry(
                "old-client",
                "Update",
                "",
                json!({"f:spec": {"f:size": {}}}),
            ),
            entry(
                "kubectl-label",
                "Update",
                "",
                json!({"f:metadata": {"f:labels": {"f:x": {}}}}),
            ),
            entry(
                "someone",
                "Update",
                "",
                json!({"f:status": {"f:ready": {}}}),
            ),
        ];
        assert_eq!(of(&fields), None);
    }

    /// Ugly entries: no manager, no fields, a spec that is not an object, a huge list.
    #[test]
    fn ugly_entries_read_safely_and_the_note_is_bounded() {
        let nameless = ManagedFieldsEntry {
            fields_v1: Some(FieldsV1(spec(&["image"]))),
            ..Default::default()
        };
        assert_eq!(
            of(&[nameless]).as_deref(),
            Some("spec.image by an unnamed manager")
        );
        let odd = [
            ManagedFieldsEntry::default(),
            entry("x", "Update", "", json!({"f:spec": "not an object"})),
            entry("y", "Update", "", json!(null)),
        ];
        assert_eq!(of(&odd), None);
        let many: Vec<String> = (0..200).map(|i| format!("field{i}é")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let note = of(&[entry("kubectl-edit", "Update", "", spec(&many))]).unwrap();
        assert!(
            note.len() <= NOTE_MAX + '…'.len_utf8() && note.ends_with('…'),
            "{note}"
        );
    }
}
