//! Which cluster this is, as Hello tells the hub: the UID of `kube-system`, and the
//! cluster ID the cluster states itself through SIG-Multicluster's About API (KEP-2149):
//! the `ClusterProperty` named `cluster.clusterset.k8s.io`, when its CRD is installed
//! and the object exists. The hub pins both and accepts a match on either (see
//! `hub::membership::foreign_cluster`).

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ApiResource, DynamicObject};
use kube::{Api, Client, ResourceExt};
use tracing::warn;

/// The well-known property that names a cluster within its clusterset.
pub const CLUSTER_ID_PROPERTY: &str = "cluster.clusterset.k8s.io";
/// The About API's group; `v1beta1` is served (and stored) by today's CRD, `v1alpha1`
/// by older ones and alongside.
const GROUP: &str = "about.k8s.io";
const VERSIONS: [&str; 2] = ["v1beta1", "v1alpha1"];
/// The longest cluster ID the hub accepts (it refuses a longer one rather than cut it).
pub const CLUSTER_ID_MAX: usize = 128;

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("reading ClusterProperty {CLUSTER_ID_PROPERTY} ({GROUP}/{version}): {source}")]
    Read {
        version: &'static str,
        source: kube::Error,
    },
    #[error("ClusterProperty {CLUSTER_ID_PROPERTY} ({GROUP}/{version}): {why}")]
    Invalid { version: &'static str, why: String },
}

/// What one read of the ClusterProperty says.
#[derive(Debug, PartialEq, Eq)]
pub enum Stated {
    /// The cluster states this ID.
    Id(String),
    /// No such object, or this version of the API is not served (no CRD): fall back.
    Absent,
    /// The agent may not read it: fall back, and say so.
    Forbidden,
}

/// The ID one read states. Any error but 404 and 403 is returned: it is retried, since
/// falling back on a passing error would switch the cluster's identity by surprise. An
/// object without a usable `spec.value` is an error too, for the same reason.
pub fn stated(
    version: &'static str,
    read: Result<DynamicObject, kube::Error>,
) -> Result<Stated, IdentityError> {
    let object = match read {
        Ok(o) => o,
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Stated::Absent),
        Err(kube::Error::Api(s)) if s.code == 403 => return Ok(Stated::Forbidden),
        Err(source) => return Err(IdentityError::Read { version, source }),
    };
    let invalid = |why: String| IdentityError::Invalid { version, why };
    match object.data.pointer("/spec/value") {
        Some(serde_json::Value::String(v)) if v.is_empty() => {
            Err(invalid("spec.value is empty".into()))
        }
        Some(serde_json::Value::String(v)) if v.len() > CLUSTER_ID_MAX => Err(invalid(format!(
            "spec.value is {} bytes; a cluster ID the hub accepts has at most {CLUSTER_ID_MAX}",
            v.len()
        ))),
        Some(serde_json::Value::String(v)) => Ok(Stated::Id(v.clone())),
        Some(other) => Err(invalid(format!("spec.value is not a string: {other}"))),
        None => Err(invalid("spec.value is missing".into())),
    }
}

/// The ID the cluster states, or `None` (no CRD, no object, or not allowed to read it).
pub async fn cluster_id(client: &Client) -> Result<Option<String>, IdentityError> {
    for version in VERSIONS {
        let resource = ApiResource {
            group: GROUP.into(),
            version: version.into(),
            api_version: format!("{GROUP}/{version}"),
            kind: "ClusterProperty".into(),
            plural: "clusterproperties".into(),
        };
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
        match stated(version, api.get(CLUSTER_ID_PROPERTY).await)? {
            Stated::Id(id) => return Ok(Some(id)),
            Stated::Absent => continue,
            Stated::Forbidden => {
                warn!(
                    "the agent may not get ClusterProperty {CLUSTER_ID_PROPERTY} ({GROUP}/{version}); \
                     the cluster is identified by its kube-system UID (grant get on that one object)"
                );
                return Ok(None);
            }
        }
    }
    Ok(None)
}

/// The UID of `kube-system`: the identity of this physical cluster; empty if it cannot
/// be read (the hub then refuses the agent once a UID is pinned, which names the cause).
pub async fn cluster_uid(client: &Client) -> String {
    Api::<Namespace>::all(client.clone())
        .get_opt("kube-system")
        .await
        .ok()
        .flatten()
        .and_then(|ns| ns.uid())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure("no", "")
                .with_code(code)
                .boxed(),
        )
    }

    fn property(spec: serde_json::Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "about.k8s.io/v1beta1", "kind": "ClusterProperty",
            "metadata": {"name": CLUSTER_ID_PROPERTY}, "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn a_stated_id_is_taken_and_absence_or_refusal_fall_back() {
        let id = stated("v1beta1", Ok(property(json!({"value": "eu-west-1"})))).unwrap();
        assert_eq!(id, Stated::Id("eu-west-1".into()));
        assert_eq!(
            stated("v1beta1", Err(api_error(404))).unwrap(),
            Stated::Absent
        );
        assert_eq!(
            stated("v1alpha1", Err(api_error(403))).unwrap(),
            Stated::Forbidden
        );
    }

    /// Anything else is retried, never taken for absence: that would switch identity.
    #[test]
    fn other_errors_and_unusable_values_are_errors_naming_the_object() {
        for code in [401, 409, 429, 500, 503] {
            let e = stated("v1beta1", Err(api_error(code))).unwrap_err();
            assert!(
                e.to_string()
                    .contains("ClusterProperty cluster.clusterset.k8s.io (about.k8s.io/v1beta1)"),
                "{e}"
            );
        }
        let unreachable = kube::Error::Service("connection refused".into());
        assert!(matches!(
            stated("v1beta1", Err(unreachable)),
            Err(IdentityError::Read { .. })
        ));
        for (spec, why) in [
            (json!({}), "spec.value is missing"),
            (json!({"value": ""}), "spec.value is empty"),
            (json!({"value": 7}), "spec.value is not a string: 7"),
            (json!({"value": "x".repeat(129)}), "spec.value is 129 bytes"),
        ] {
            let e = stated("v1alpha1", Ok(property(spec))).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
            assert!(e.to_string().contains("about.k8s.io/v1alpha1"), "{e}");
        }
        let longest = "x".repeat(CLUSTER_ID_MAX);
        assert_eq!(
            stated("v1beta1", Ok(property(json!({"value": longest.clone()})))).unwrap(),
            Stated::Id(longest)
        );
    }

    /// An apiserver that cannot be reached is an error, not "no property".
    #[tokio::test]
    async fn an_unreachable_apiserver_is_an_error() {
        let e = cluster_id(&crate::unreachable_client()).await.unwrap_err();
        assert!(
            matches!(
                e,
                IdentityError::Read {
                    version: "v1beta1",
                    ..
                }
            ),
            "{e}"
        );
    }
}
