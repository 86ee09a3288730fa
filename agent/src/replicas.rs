//! Replicas: one writer per field. The federation's replicas (the agent's on a MyApp, the
//! operator's on a Deployment) give way to an autoscaler's while one scales the object,
//! and come back when it goes.
//!
//! With server-side apply, a manager that leaves out a field it alone owns deletes it: a
//! MyApp would fall back to 1 replica until the autoscaler noticed. So before its first
//! apply without `replicas`, the live value is applied alone under a second manager
//! (`<manager>-replicas`), which keeps the field until the autoscaler writes its own and
//! so takes it over (the Kubernetes docs' "Transferring ownership"). Handing back is that
//! second manager applying the federation's value with force.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
use kube::api::{Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// Annotation the agent adds to each MyApp it applies: the replicas the federation
/// assigns this cluster. `spec.replicas` follows it unless an autoscaler scales the MyApp;
/// it is what the agent hands back when the autoscaler goes.
pub const ASSIGNED_ANNOTATION: &str = "flotilla.io/assigned-replicas";
/// A MyApp or Deployment without replicas runs one.
pub const DEFAULT: i32 = 1;

/// The second field manager of `manager`, holding `replicas` across a hand-over.
pub fn keeper(manager: &str) -> String {
    format!("{manager}-replicas")
}

/// Where an object's replicas live at an API version (`spec.size` at MyApp v1alpha1):
/// field managers record fields at the version they wrote.
pub type ReplicasPath = fn(api_version: &str) -> [&'static str; 2];

pub fn spec_replicas(_: &str) -> [&'static str; 2] {
    ["spec", "replicas"]
}

/// MyApp's replicas at each version.
pub fn myapp_replicas(api_version: &str) -> [&'static str; 2] {
    if api_version.ends_with("/v1alpha1") {
        ["spec", "size"]
    } else {
        ["spec", "replicas"]
    }
}

/// Whether a field manager other than `manager`'s own Apply owns the replicas.
pub fn owned_by_another(fields: &[ManagedFieldsEntry], manager: &str, path: ReplicasPath) -> bool {
    fields.iter().any(|entry| {
        let mine = entry.manager.as_deref() == Some(manager)
            && entry.operation.as_deref() == Some("Apply")
            && entry.subresource.as_deref().unwrap_or("").is_empty();
        let [parent, field] = path(entry.api_version.as_deref().unwrap_or(""));
        let owned = entry.fields_v1.as_ref().is_some_and(|f| {
            f.0.get(format!("f:{parent}"))
                .and_then(|p| p.get(format!("f:{field}")))
                .is_some()
        });
        !mine && owned
    })
}

/// Makes sure the live replicas of `live` survive `manager` leaving them out of its next
/// apply: unless another manager owns them already, its [`keeper`] applies them alone.
/// The live resource version is a precondition: a conflict means the object changed
/// since it was read, and the caller tries again.
pub async fn hand_over<K>(
    api: &Api<K>,
    live: &K,
    manager: &str,
    path: ReplicasPath,
) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    let value = serde_json::to_value(live).map_err(kube::Error::SerdeError)?;
    let [parent, field] = path(&K::api_version(&()));
    let Some(replicas) = value[parent][field].as_i64() else {
        return Ok(()); // nothing to keep
    };
    if owned_by_another(live.managed_fields(), manager, path) {
        return Ok(());
    }
    let keep = json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "metadata": {
            "name": live.name_any(),
            "namespace": live.namespace(),
            "resourceVersion": live.resource_version(),
        },
        (parent): {(field): replicas},
    });
    let params = PatchParams::apply(&keeper(manager));
    api.patch(&live.name_any(), &params, &Patch::Apply(&keep))
        .await
        .map(drop)
}

/// Gives the replicas back to the federation: the [`keeper`] of `manager` applies
/// `replicas` with force, taking them from the autoscaler that left them behind.
/// `resource_version` (of the object the decision was made on) is a precondition, so
/// that a value written since is looked at again first.
pub async fn hand_back<K>(
    api: &Api<K>,
    (namespace, name): (&str, &str),
    resource_version: Option<String>,
    replicas: i32,
    manager: &str,
) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    let back = json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": resource_version},
        "spec": {"replicas": replicas},
    });
    let params = PatchParams::apply(&keeper(manager)).force();
    api.patch(name, &params, &Patch::Apply(&back))
        .await
        .map(drop)
}

/// The federation's replicas of an applied MyApp manifest (1 when unset), written into
/// its [`ASSIGNED_ANNOTATION`].
pub fn record_assigned(manifest: &mut Value) -> i32 {
    let assigned = manifest["spec"]["replicas"]
        .as_i64()
        .and_then(|n| i32::try_from(n).ok())
        .unwrap_or(DEFAULT);
    manifest["metadata"]["annotations"][ASSIGNED_ANNOTATION] = json!(assigned.to_string());
    assigned
}

/// The federation's replicas of a MyApp the agent applied, from its annotation.
pub fn assigned(app: &impl ResourceExt) -> Option<i32> {
    app.annotations().get(ASSIGNED_ANNOTATION)?.parse().ok()
}

/// Whether someone other than the federation set the replicas of a MyApp the agent
/// applied: they differ from what the agent last assigned it (its annotation; without
/// one, from what it is about to assign). Only then may an autoscaler the cache does not
/// show yet be scaling it: a change the federation makes alone needs no fresh look.
pub fn set_by_someone_else(app: &flotilla_crds::MyApp, about_to_assign: i32) -> bool {
    let runs = app.spec.replicas.unwrap_or(DEFAULT);
    runs != assigned(app).unwrap_or(about_to_assign)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::FieldsV1;

    fn entry(manager: &str, operation: &str, version: &str, fields: Value) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            manager: Some(manager.into()),
            operation: Some(operation.into()),
            api_version: Some(version.into()),
            fields_v1: Some(FieldsV1(fields)),
            ..Default::default()
        }
    }

    /// The agent's own Apply does not count; an HPA's write through `/scale` (an Update
    /// of the subresource), the keeper, or a write at v1alpha1 (`spec.size`) does.
    #[test]
    fn another_owner_is_any_entry_but_the_managers_own_apply() {
        let replicas = json!({"f:spec": {"f:replicas": {}, "f:image": {}}});
        let mine = entry(
            "flotilla-agent",
            "Apply",
            "app.example.com/v1",
            replicas.clone(),
        );
        assert!(!owned_by_another(
            std::slice::from_ref(&mine),
            "flotilla-agent",
            myapp_replicas
        ));

        let mut scaled = entry(
            "kube-controller-manager",
            "Update",
            "app.example.com/v1",
            json!({"f:spec": {"f:replicas": {}}}),
        );
        scaled.subresource = Some("scale".into());
        assert!(owned_by_another(
            &[mine.clone(), scaled],
            "flotilla-agent",
            myapp_replicas
        ));

        let kept = entry(
            "flotilla-agent-replicas",
            "Apply",
            "app.example.com/v1",
            json!({"f:spec": {"f:replicas": {}}}),
        );
        assert!(owned_by_another(
            &[mine.clone(), kept],
            "flotilla-agent",
            myapp_replicas
        ));

        let old = entry(
            "kubectl",
            "Update",
            "app.example.com/v1alpha1",
            json!({"f:spec": {"f:size": {}}}),
        );
        assert!(owned_by_another(
            &[mine.clone(), old],
            "flotilla-agent",
            myapp_replicas
        ));

        let image = entry(
            "kubectl",
            "Update",
            "app.example.com/v1",
            json!({"f:spec": {"f:image": {}}}),
        );
        assert!(!owned_by_another(
            &[mine, image],
            "flotilla-agent",
            myapp_replicas
        ));
    }

    #[test]
    fn the_assigned_replicas_ride_on_the_manifest() {
        let mut manifest =
            json!({"metadata": {"name": "a", "annotations": {"x": "y"}}, "spec": {"replicas": 3}});
        assert_eq!(record_assigned(&mut manifest), 3);
        assert_eq!(
            manifest["metadata"]["annotations"][ASSIGNED_ANNOTATION],
            "3"
        );
        assert_eq!(manifest["metadata"]["annotations"]["x"], "y");
        let mut unset = json!({"metadata": {"name": "a"}, "spec": {}});
        assert_eq!(record_assigned(&mut unset), DEFAULT);
        let app: flotilla_crds::MyApp = serde_json::from_value(json!({
            "apiVersion": "app.example.com/v1", "kind": "MyApp", "metadata": manifest["metadata"], "spec": {}
        }))
        .unwrap();
        assert_eq!(assigned(&app), Some(3));
    }

    fn myapp(replicas: Option<i32>, assigned: Option<&str>) -> flotilla_crds::MyApp {
        let annotations = assigned.map_or(json!({}), |a| json!({ASSIGNED_ANNOTATION: a}));
        serde_json::from_value(json!({
            "apiVersion": "app.example.com/v1", "kind": "MyApp",
            "metadata": {"name": "a", "namespace": "n", "annotations": annotations},
            "spec": {"replicas": replicas}
        }))
        .unwrap()
    }

    /// A replicas change the federation makes alone (the MyApp still runs what it was
    /// last assigned) needs no fresh look; replicas someone else set, or a MyApp without
    /// the annotation whose replicas differ from the new assignment, do.
    #[test]
    fn replicas_set_by_someone_else_are_told_from_the_federation_s_own() {
        assert!(!set_by_someone_else(&myapp(Some(3), Some("3")), 5));
        assert!(!set_by_someone_else(&myapp(None, Some("1")), 4));
        assert!(set_by_someone_else(&myapp(Some(7), Some("3")), 3));
        assert!(set_by_someone_else(&myapp(Some(7), Some("3")), 5));
        assert!(set_by_someone_else(&myapp(Some(2), None), 5));
        assert!(!set_by_someone_else(&myapp(Some(5), None), 5));
        let unreadable = myapp(Some(3), Some("not a number"));
        assert!(set_by_someone_else(&unreadable, 5));
    }
}
