//! The fleet in SIG-Multicluster's cluster inventory API (KEP-4322,
//! `multicluster.x-k8s.io`): a `ClusterProfile` per MemberCluster, which Argo CD, Kueue's
//! MultiKueue, Headlamp and others read to learn which clusters exist and whether they
//! are healthy, and `PlacementDecision`s naming the clusters each FederatedMyApp is
//! placed on.
//!
//! These are Flotilla's own types for the fields it writes, serialized as the upstream
//! API (`sigs.k8s.io/cluster-inventory-api`) defines them. The CRDs built from them serve
//! `v1alpha1` (stored) and `v1alpha2`, as the upstream CRDs do since v0.2.0, for hosts
//! that have none; where another cluster manager installed the upstream CRDs already,
//! the hub writes into those.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;

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

/// The clusters a scheduler chose for one workload (`PlacementDecision`, v1alpha1): at
/// most [`DECISIONS_PER_SLICE`] a slice, the slices of one decision linked by
/// [`DECISION_KEY_LABEL`]. A data-only object: its fields are top-level, no spec.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PlacementDecision {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub decisions: Vec<ClusterDecision>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler_name: Option<String>,
}

/// One chosen cluster: a reference to its ClusterProfile, and why.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterDecision {
    pub cluster_profile_ref: ObjectReference,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Decisions in one PlacementDecision at most (the API's bound, after EndpointSlice).
pub const DECISIONS_PER_SLICE: usize = 100;
/// Label linking the slices of one decision.
pub const DECISION_KEY_LABEL: &str = "multicluster.x-k8s.io/decision-key";
/// Label giving a slice's position (from 0) when a decision spans several.
pub const DECISION_INDEX_LABEL: &str = "multicluster.x-k8s.io/decision-index";
/// Label linking a decision to the workload it places.
pub const PLACEMENT_KEY_LABEL: &str = "multicluster.x-k8s.io/placement-key";

impl kube::Resource for PlacementDecision {
    type DynamicType = ();
    type Scope = kube::core::NamespaceResourceScope;

    fn kind(_: &()) -> std::borrow::Cow<'_, str> {
        "PlacementDecision".into()
    }
    fn group(_: &()) -> std::borrow::Cow<'_, str> {
        GROUP.into()
    }
    fn version(_: &()) -> std::borrow::Cow<'_, str> {
        "v1alpha1".into()
    }
    fn plural(_: &()) -> std::borrow::Cow<'_, str> {
        "placementdecisions".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The PlacementDecision CRD: `v1alpha1` (stored) and `v1alpha2`, one schema.
pub fn placement_decision_crd() -> CustomResourceDefinition {
    let reference = json!({
        "type": "object",
        "description": "The chosen cluster's ClusterProfile.",
        "x-kubernetes-map-type": "atomic",
        "properties": {
            "apiVersion": {"type": "string"}, "kind": {"type": "string"},
            "namespace": {"type": "string"}, "name": {"type": "string"},
            "uid": {"type": "string"}, "resourceVersion": {"type": "string"},
            "fieldPath": {"type": "string"},
        },
    });
    let schema = json!({
        "type": "object",
        "description": "PlacementDecision publishes the set of clusters chosen by a scheduler at a point in time.",
        "required": ["decisions"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "decisions": {
                "type": "array", "minItems": 0, "maxItems": DECISIONS_PER_SLICE,
                "items": {
                    "type": "object", "required": ["clusterProfileRef"],
                    "properties": {
                        "clusterProfileRef": reference,
                        "reason": {"type": "string", "description": "Why this cluster was chosen."},
                    },
                },
            },
            "schedulerName": {"type": "string"},
        },
    });
    let version = |name: &str, storage: bool| {
        json!({
            "name": name, "served": true, "storage": storage,
            "schema": {"openAPIV3Schema": schema},
            "additionalPrinterColumns": [
                {"name": "Scheduler", "type": "string", "jsonPath": ".schedulerName"},
                {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
            ],
        })
    };
    serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("placementdecisions.{GROUP}")},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": "PlacementDecision", "listKind": "PlacementDecisionList",
                "plural": "placementdecisions", "singular": "placementdecision",
                "categories": ["multicluster"],
            },
            "scope": "Namespaced",
            "versions": [version("v1alpha1", true), version("v1alpha2", false)],
        },
    }))
    .expect("the PlacementDecision CRD is a CRD")
}
