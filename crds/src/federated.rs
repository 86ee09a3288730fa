//! `FederatedMyApp` (`core.kubefed.io/v1beta1`): one application, many clusters.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::myapp;

/// Annotation that keeps the member copies when the FederatedMyApp is deleted (KubeFed's).
pub const ORPHAN_ANNOTATION: &str = "kubefed.io/orphan";

/// A user's request to run one MyApp on a set of member clusters.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "core.kubefed.io",
    version = "v1beta1",
    kind = "FederatedMyApp",
    plural = "federatedmyapps",
    shortname = "fma",
    category = "flotilla",
    namespaced,
    status = "FederatedMyAppStatus",
    printcolumn = r#"{"name":"Ready","type":"integer","description":"Clusters whose MyApp is ready","jsonPath":".status.readyClusters"}"#,
    printcolumn = r#"{"name":"Placed","type":"integer","description":"Clusters the MyApp is placed on","jsonPath":".status.placedClusters"}"#,
    printcolumn = r#"{"name":"Propagated","type":"string","jsonPath":".status.conditions[?(@.type==\"Propagated\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct FederatedMyAppSpec {
    #[serde(default)]
    pub placement: Placement,
    #[serde(default)]
    pub template: Template,
    /// Per-cluster changes to the template, applied in the order written.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<ClusterOverrides>,
}

/// Which member clusters get the MyApp. KubeFed's rule: `clusters`, when present (even
/// empty), wins over `clusterSelector`; an empty selector selects every cluster; with
/// neither the MyApp is placed nowhere.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clusters: Option<Vec<ClusterRef>>,
    /// A standard label selector over MemberCluster labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_selector: Option<LabelSelector>,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct ClusterRef {
    pub name: String,
}

/// The MyApp every placed cluster starts from.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct Template {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateMetadata>,
    #[serde(default)]
    pub spec: myapp::v1::MyAppSpec,
}

/// Labels and annotations merged onto each rendered MyApp.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct TemplateMetadata {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterOverrides {
    pub cluster_name: String,
    #[serde(default)]
    pub cluster_overrides: Vec<ClusterOverride>,
}

/// One RFC 6902 operation on the template, with a JSON pointer relative to it
/// (`/spec/replicas`).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct ClusterOverride {
    #[serde(default)]
    pub op: OverrideOp,
    pub path: String,
    /// Required by `add` and `replace`; ignored by `remove`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub value: Option<serde_json::Value>,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum OverrideOp {
    Add,
    Remove,
    #[default]
    Replace,
}

/// Written by the hub only.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FederatedMyAppStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Propagated` and `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub placed_clusters: i32,
    #[serde(default)]
    pub ready_clusters: i32,
    /// One entry per placed cluster, and one per named cluster that is not registered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clusters: Vec<ClusterStatus>,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStatus {
    pub name: String,
    #[serde(default)]
    pub ready: bool,
    #[serde(default)]
    pub ready_replicas: i32,
    /// Generation of the MyApp in the member cluster that the operator observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Why this cluster is not ready, in words a user can act on; empty when fine.
    #[serde(default)]
    pub message: String,
}

/// `value` may be any JSON: schema it as such, kept by the apiserver unpruned.
fn any_value(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
}
