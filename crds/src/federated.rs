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
    doc = "FederatedMyApp runs one MyApp on many member clusters: spec.placement chooses the clusters and divides the replicas among them, spec.template is the MyApp, spec.overrides change it per cluster. Status is written by flotilla-hub.",
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
    printcolumn = r#"{"name":"Replicas","type":"integer","description":"Replicas the scheduling assigns across clusters","jsonPath":".status.replicas"}"#,
    printcolumn = r#"{"name":"Ready-Replicas","type":"integer","description":"Ready replicas across clusters","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Propagated","type":"string","jsonPath":".status.conditions[?(@.type==\"Propagated\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct FederatedMyAppSpec {
    /// Which member clusters get the MyApp and how many replicas each runs.
    #[serde(default)]
    pub placement: Placement,
    /// The MyApp every placed cluster starts from.
    #[serde(default)]
    pub template: Template,
    /// Per-cluster changes to the template, applied in the order written.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<ClusterOverrides>,
}

/// Which member clusters get the MyApp. KubeFed's rule: `clusters`, when present (even
/// empty), wins over `clusterSelector`; an empty selector selects every cluster; with
/// neither the MyApp is placed nowhere. `replicaScheduling`, `spread` and `failover` then
/// decide how many replicas each placed cluster runs.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// Member clusters by name; when present (even empty) the selector is ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clusters: Option<Vec<ClusterRef>>,
    /// A standard label selector over MemberCluster labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_selector: Option<LabelSelector>,
    /// How replicas are divided among the placed clusters. Absent: Duplicated, every
    /// placed cluster runs the whole template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_scheduling: Option<ReplicaScheduling>,
    /// How widely the replicas must (or may) spread over the placed clusters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spread: Option<SpreadConstraints>,
    /// Opt-in: move the replicas of a cluster that stays NotReady to the other clusters.
    /// Only with mode Weighted or Capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failover: Option<Failover>,
}

/// How replicas are divided (Karmada's `replicaScheduling`, KubeFed's
/// ReplicaSchedulingPreference).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaScheduling {
    /// Duplicated (default): every placed cluster runs the template's replicas. Weighted:
    /// totalReplicas are divided by static weights. Capacity: totalReplicas are divided
    /// by each cluster's room for one more replica of this MyApp.
    #[serde(default)]
    pub mode: SchedulingMode,
    /// Replicas across all clusters (Weighted and Capacity). Default: the template's
    /// spec.replicas, or 1. Each cluster gets 0 (no MyApp) or 1 to 10 (the MyApp's schema);
    /// a total that cannot fit is reported in status, never truncated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub total_replicas: Option<i32>,
    /// Per-cluster weight and bounds. The first entry matching a cluster applies to it; a
    /// cluster no entry matches has weight 1 and no bounds beyond 0 to 10.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preferences: Vec<ClusterPreference>,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum SchedulingMode {
    #[default]
    Duplicated,
    Weighted,
    Capacity,
}

/// Weight and bounds for the clusters it matches: those named in `clusterNames` and those
/// `clusterSelector` selects; with neither, every cluster.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPreference {
    /// Clusters by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cluster_names: Vec<String>,
    /// Clusters by MemberCluster labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_selector: Option<LabelSelector>,
    /// Relative share under Weighted (default 1; 0 gives only minReplicas). Ignored
    /// under Capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub weight: Option<i32>,
    /// At least this many replicas on each matched cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 10))]
    pub min_replicas: Option<i32>,
    /// At most this many replicas on each matched cluster (10 at most, the MyApp's own
    /// limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 10))]
    pub max_replicas: Option<i32>,
}

/// Spread over clusters and over groups of clusters sharing a label value (Karmada's
/// `spreadConstraints`). Clusters already running the MyApp are kept in preference to
/// others, then higher weights (or capacity), then names in order.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SpreadConstraints {
    /// At least this many clusters run a replica; the first ones chosen get at least one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub min_clusters: Option<i32>,
    /// At most this many clusters run the MyApp.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_clusters: Option<i32>,
    /// A MemberCluster label whose values form the groups, e.g.
    /// `topology.kubernetes.io/region`. Clusters without it form no group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spread_by_label: Option<String>,
    /// At least this many groups run a replica (needs spreadByLabel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub min_groups: Option<i32>,
}

/// Failover (opt-in): once a placed cluster has been NotReady for `gracePeriodSeconds`,
/// its share is divided among the other clusters. Its own MyApp is left untouched while it
/// is unreachable. When it is Ready again, `onRecovery` decides; replicas are removed
/// anywhere only after the replicas replacing them are Ready.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Failover {
    /// How long a cluster may be NotReady before its replicas move. Default 300.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub grace_period_seconds: Option<i32>,
    /// Rebalance (default): the recovered cluster gets its share back and the others
    /// scale down once it is Ready. Stay: the replicas stay where they moved and the
    /// recovered cluster's MyApp is removed, until the FederatedMyApp's spec changes.
    #[serde(default)]
    pub on_recovery: RecoveryPolicy,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum RecoveryPolicy {
    #[default]
    Rebalance,
    Stay,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct ClusterRef {
    /// A MemberCluster's name.
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
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Clusters the MyApp is rendered for.
    #[serde(default)]
    pub placed_clusters: i32,
    /// Placed clusters whose MyApp is ready.
    #[serde(default)]
    pub ready_clusters: i32,
    /// Replicas assigned across clusters (the sum of `clusters[].replicas`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Ready replicas across clusters.
    #[serde(default)]
    pub ready_replicas: i32,
    /// One entry per placed cluster, and one per named cluster that is not registered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub clusters: Vec<ClusterStatus>,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStatus {
    pub name: String,
    #[serde(default)]
    pub ready: bool,
    /// Replicas this cluster is assigned (0: it gets no MyApp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Why it is assigned that many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduling_reason: Option<SchedulingReason>,
    #[serde(default)]
    pub ready_replicas: i32,
    /// Generation of the MyApp in the member cluster that the operator observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Why this cluster is not ready, in words a user can act on; empty when fine.
    #[serde(default)]
    pub message: String,
}

/// Why a cluster is assigned the replicas it is.
#[derive(
    Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema,
)]
pub enum SchedulingReason {
    /// Mode Duplicated: the whole template.
    Duplicated,
    /// Its share by static weight (and its bounds and the spread).
    Weight,
    /// Its share by room for more replicas.
    Capacity,
    /// It carries part of the share of a cluster that failed over.
    Failover,
    /// Cordoned (spec.unschedulable): it keeps what it runs and gets nothing new.
    Cordoned,
    /// NotReady within the failover grace period (or without failover): it keeps its
    /// share and gets nothing new.
    NotReady,
    /// NotReady past the failover grace period: its share moved, its MyApp is left as it
    /// is until it is Ready again.
    FailedOver,
    /// Not among the clusters spread.maxClusters allows.
    Spread,
    /// Back from a failover under onRecovery Stay: no replicas until the spec changes.
    Recovered,
    /// It keeps replicas it is losing until the replicas replacing them are Ready.
    Surplus,
}

/// `value` may be any JSON: schema it as such, kept by the apiserver unpruned.
fn any_value(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
}
