//! The fleet in SIG-Multicluster's cluster inventory API (KEP-4322,
//! `multicluster.x-k8s.io`): a `ClusterProfile` per MemberCluster, which Argo CD, Kueue's
//! MultiKueue, Headlamp and others read to learn which clusters exist and whether they
//! are healthy.
//!
//! These are Flotilla's own types for the fields it writes, serialized as the upstream
//! API (`sigs.k8s.io/cluster-inventory-api`) defines them. The CRD built from them serves
//! `v1alpha1` (stored) and `v1alpha2`, as the upstream CRD does since v0.2.0, for hosts
//! that have none; where another cluster manager installed the upstream CRD already, the
//! hub writes into that one.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub const GROUP: &str = "multicluster.x-k8s.io";
/// Label naming the cluster manager of a ClusterProfile; the value equals
/// `spec.clusterManager.name`.
pub const CLUSTER_MANAGER_LABEL: &str = "x-k8s.io/cluster-manager";
/// Label correlating ClusterProfiles of one member cluster (v1alpha2); never empty.
pub const MEMBER_ID_LABEL: &str = "multicluster.x-k8s.io/inventory-member-id";
/// The name Flotilla gives itself as a cluster manager.
pub const CLUSTER_MANAGER: &str = "flotilla";
/// The condition KEP-4322 predefines for a cluster's health.
pub const CONTROL_PLANE_HEALTHY: &str = "ControlPlaneHealthy";
/// The condition KEP-4322 predefines for a cluster under a manager's management.
pub const JOINED: &str = "Joined";

/// Who owns a ClusterProfile; immutable once set.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct ClusterManager {
    /// The name of the cluster manager (a label value).
    pub name: String,
}

/// What a cluster manager observed of one member cluster.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterProfileStatus {
    /// `ControlPlaneHealthy`, `Joined`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "ClusterVersion::is_empty")]
    pub version: ClusterVersion,
    /// Name/value pairs: ClusterProperty names (KEP-2149) or the manager's own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub properties: Vec<Property>,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct ClusterVersion {
    /// The member's Kubernetes version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<String>,
}

impl ClusterVersion {
    fn is_empty(&self) -> bool {
        self.kubernetes.is_none()
    }
}

/// One property of a cluster and when it was last observed there.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Property {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    #[schemars(length(min = 1, max = 1024))]
    pub value: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_observed_time: Option<Time>,
}

/// The ClusterProfile type of one served version: both versions carry the same fields
/// Flotilla writes (v1alpha2 dropped `credentialProviders`, which Flotilla never sets).
macro_rules! cluster_profile {
    ($module:ident, $version:literal) => {
        pub mod $module {
            use super::*;

            /// A single cluster in a multi-cluster deployment, as its cluster manager sees it.
            #[derive(CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
            #[kube(
                doc = "ClusterProfile represents a single cluster in a multi-cluster deployment.",
                group = "multicluster.x-k8s.io",
                version = $version,
                kind = "ClusterProfile",
                plural = "clusterprofiles",
                namespaced,
                derive = "PartialEq",
                status = "ClusterProfileStatus",
                category = "multicluster",
                printcolumn = r#"{"name":"Manager","type":"string","jsonPath":".spec.clusterManager.name"}"#,
                printcolumn = r#"{"name":"Version","type":"string","jsonPath":".status.version.kubernetes"}"#,
                printcolumn = r#"{"name":"Healthy","type":"string","jsonPath":".status.conditions[?(@.type==\"ControlPlaneHealthy\")].status"}"#,
                printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
            )]
            #[serde(rename_all = "camelCase")]
            pub struct ClusterProfileSpec {
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub display_name: Option<String>,
                /// Which cluster manager owns this profile (immutable).
                #[schemars(extend("x-kubernetes-validations" = [{"rule": "self == oldSelf", "message": "ClusterManager is immutable"}]))]
                pub cluster_manager: ClusterManager,
            }
        }
    };
}

cluster_profile!(v1alpha1, "v1alpha1");
cluster_profile!(v1alpha2, "v1alpha2");

pub use v1alpha1::{ClusterProfile, ClusterProfileSpec};
