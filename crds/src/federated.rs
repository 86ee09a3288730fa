//! `FederatedMyApp` (`core.kubefed.io/v1beta1`): one application, many clusters.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::myapp;

/// Annotation that keeps the member copies when the FederatedMyApp is deleted (KubeFed's).
pub const ORPHAN_ANNOTATION: &str = "kubefed.io/orphan";
/// The hub's finalizer: it holds a FederatedMyApp until every member has deleted (or
/// released) its MyApp. No MyApp is sent anywhere before it is on the object.
pub const HUB_FINALIZER: &str = "core.kubefed.io/flotilla-hub";

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
    printcolumn = r#"{"name":"Current","type":"integer","description":"Pods the members run across clusters, autoscalers' decisions included","jsonPath":".status.currentReplicas"}"#,
    printcolumn = r#"{"name":"Propagated","type":"string","jsonPath":".status.conditions[?(@.type==\"Propagated\")].status"}"#,
    printcolumn = r#"{"name":"Applied","type":"integer","priority":1,"description":"Placed clusters running the latest version","jsonPath":".status.appliedClusters"}"#,
    printcolumn = r#"{"name":"Pending","type":"integer","priority":1,"description":"Placed clusters whose agent has not applied the latest version yet","jsonPath":".status.pendingClusters"}"#,
    printcolumn = r#"{"name":"Disconnected","type":"integer","priority":1,"description":"Placed clusters whose MemberCluster is NotReady","jsonPath":".status.disconnectedClusters"}"#,
    printcolumn = r#"{"name":"Failed","type":"integer","priority":1,"description":"Clusters the MyApp could not be rendered for or applied to","jsonPath":".status.failedClusters"}"#,
    printcolumn = r#"{"name":"Rollout","type":"string","priority":1,"description":"Where a progressive rollout stands","jsonPath":".status.rollout.state"}"#,
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
    /// How a change of the template or the overrides reaches the placed clusters.
    /// Absent: all at once (type All).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<Rollout>,
    /// Federation-wide bounds for the autoscalers that scale the MyApp in each member
    /// (a HorizontalPodAutoscaler, or a KEDA ScaledObject, that targets the MyApp or its
    /// Deployment). Needs a divided mode (Weighted or Capacity): the maximum is divided
    /// as the replicas would be, the minimum within each cluster's maximum, and the agent
    /// writes each cluster's share into its autoscaler's bounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<Autoscaling>,
}

/// What the clusters' autoscalers may run together.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Autoscaling {
    /// The fewest replicas across clusters. Every cluster that runs the MyApp runs at
    /// least one, so the floor is at least the number of such clusters.
    #[schemars(range(min = 1))]
    pub min_replicas: i32,
    /// The most replicas across clusters, divided by `spec.placement.replicaScheduling`
    /// in place of `totalReplicas`.
    #[schemars(range(min = 1))]
    pub max_replicas: i32,
}

/// How a new revision (a change of what a cluster's MyApp runs, its replica count
/// aside) reaches the placed clusters, after Open Cluster Management's
/// `RolloutStrategy`. A cluster the rollout has not reached keeps what it runs; a change
/// of replicas alone (scheduling, capacity, failover) is never held for a cluster that
/// runs the current revision. A hub restart recomputes where the rollout stands from
/// what the agents report: a soak in progress starts again.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Rollout {
    /// All (default): every cluster at once. Progressive: waves of `maxConcurrency`
    /// clusters, in cluster-name order. ProgressivePerGroup: one wave per group, in the
    /// order written (split by `maxConcurrency` when set); clusters in no group last.
    #[serde(default, rename = "type")]
    pub type_: RolloutType,
    /// At most this many clusters per wave: a number, or a percentage of the placed
    /// clusters (rounded up). Below 1: 1; above them all: all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<IntOrString>,
    /// ProgressivePerGroup: the waves in order. A cluster in several groups goes with
    /// the first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<RolloutGroup>,
    /// How long every cluster of a wave must run the new revision Ready before the next
    /// wave starts (the soak). Default 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub min_success_seconds: Option<i32>,
    /// A cluster that runs the new revision but is not Ready this long after the hub
    /// first saw it there halts the rollout; a Degraded MyApp or a failed apply halts it
    /// at once. Default 600.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub progress_deadline_seconds: Option<i32>,
    /// True: no cluster is sent a revision it does not run yet (`flotilla-hub rollout
    /// pause|resume`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum RolloutType {
    #[default]
    All,
    Progressive,
    ProgressivePerGroup,
}

/// One wave of a ProgressivePerGroup rollout: the clusters named, and those the
/// selector selects.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutGroup {
    /// For status and Events; default `group-N` (1-based).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clusters: Vec<ClusterRef>,
    /// A standard label selector over MemberCluster labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_selector: Option<LabelSelector>,
}

/// Where a progressive rollout stands.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStatus {
    /// The revision being rolled out, as the first 16 hex digits that prefix every
    /// rendered MyApp's content hash (`flotilla.io/content-hash`); one per distinct
    /// render, joined by commas, past one.
    pub revision: String,
    /// Progressing, Paused, Halted or Complete.
    pub state: String,
    /// The wave in progress (1-based); the last when complete.
    pub wave: i32,
    pub waves: i32,
    /// Placed clusters that run the current revision.
    pub updated_clusters: i32,
    /// Clusters held back until their wave.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub held_clusters: i32,
    /// Which wave, which cluster and why, when not Complete.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The last revision every placed cluster ran Ready: what `flotilla-hub rollout
    /// abort` puts back, and revisions no wave holds a cluster from (going back to them is
    /// immediate). Kept across rollouts; absent until one completes, or when the template
    /// and overrides are too large to keep a copy of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_complete: Option<CompletedRevision>,
}

/// A revision that every placed cluster ran Ready, and the spec that rendered it.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CompletedRevision {
    /// The FederatedMyApp's `metadata.generation` it completed at.
    pub generation: i64,
    /// Every distinct revision the placed clusters ran (one per class of clusters).
    pub revisions: Vec<String>,
    /// `spec.template` then; absent when the copy would be too large (64 KiB with the
    /// overrides).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<Template>,
    /// `spec.overrides` then.
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

/// Changes to the template for the clusters one entry targets: the cluster `clusterName`
/// names, or those `clusterSelector` selects (exactly one of the two). For each cluster
/// the entries selecting it by label apply first, in the order written, then the entries
/// naming it, in the order written: where two write the same path, the one naming the
/// cluster wins. Within an entry, `image` applies before `clusterOverrides`.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{"rule": "has(self.clusterName) != has(self.clusterSelector)", "message": "set exactly one of clusterName and clusterSelector"}]))]
pub struct ClusterOverrides {
    /// One MemberCluster by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_name: Option<String>,
    /// MemberClusters by label (a standard LabelSelector; empty selects every cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_selector: Option<LabelSelector>,
    /// Rewrites parts of `spec.image`; the parts not set are kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageOverride>,
    #[serde(default)]
    pub cluster_overrides: Vec<ClusterOverride>,
}

impl ClusterOverrides {
    /// An entry for the cluster `name`, with these operations.
    pub fn named(name: impl Into<String>, ops: Vec<ClusterOverride>) -> Self {
        Self {
            cluster_name: Some(name.into()),
            cluster_overrides: ops,
            ..Self::default()
        }
    }
}

/// The parts of the MyApp's image reference (`[registry/]repository[:tag][@digest]`)
/// to replace, after Karmada's ImageOverrider. `nginx:1.27` reads as registry
/// `docker.io`, repository `library/nginx`, tag `1.27`. A digest replaces the tag, a
/// tag replaces the digest; both set give `repository:tag@digest`.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{"rule": "!(has(self.registry) && has(self.registryFrom))", "message": "set registry or registryFrom, not both"}]))]
pub struct ImageOverride {
    /// A registry host with an optional port, e.g. `registry.eu.example.com:5000`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry: Option<String>,
    /// The registry, from a label of the target cluster (a regional mirror); not with
    /// `registry`. A cluster without the label cannot be rendered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry_from: Option<ClusterLabelRef>,
    /// The path within the registry, e.g. `team/web`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repository: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// e.g. `sha256:` and 64 hex digits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

/// One RFC 6902 operation on the template, with a JSON pointer relative to it
/// (`/spec/replicas`).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterOverride {
    #[serde(default)]
    pub op: OverrideOp,
    pub path: String,
    /// `add` and `replace` need this or `valueFrom` (not both: that cluster's render
    /// fails); ignored by `remove`. Schemaless, so no CEL rule can see it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub value: Option<serde_json::Value>,
    /// The value, taken from the target cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_from: Option<ValueFrom>,
}

/// A label of the target cluster's MemberCluster.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterLabelRef {
    /// e.g. `flotilla.io/registry`.
    pub cluster_label: String,
}

/// Where an operation's value comes from in the target cluster.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ValueFrom {
    /// A label of the cluster's MemberCluster, e.g. `topology.kubernetes.io/region`. A
    /// cluster without it cannot be rendered (it keeps what it runs; status says why).
    pub cluster_label: String,
    /// How the label's value is written: String (default) or Integer (decimal, e.g.
    /// a per-region replica floor).
    #[serde(default, rename = "type")]
    pub type_: ValueType,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ValueType {
    #[default]
    String,
    Integer,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum OverrideOp {
    Add,
    Remove,
    #[default]
    Replace,
}

/// Written by the hub only. Bounded whatever the number of clusters: up to 50 clusters
/// every one is listed in `clusters`; beyond, `clusters` lists the 20 most urgent, the
/// counts cover all of them, and `division` keeps every cluster's assignment.
/// `flotilla-hub status NAME` shows every cluster.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FederatedMyAppStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Propagated` and `Ready`; their messages name the most urgent clusters first and
    /// end with "… and N more" past 1 KiB.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Clusters the MyApp is rendered for.
    #[serde(default)]
    pub placed_clusters: i32,
    /// Placed clusters whose MyApp is ready.
    #[serde(default)]
    pub ready_clusters: i32,
    /// Placed clusters running the latest version (absent: 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub applied_clusters: i32,
    /// Placed clusters whose agent has not applied the latest version yet (absent: 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pending_clusters: i32,
    /// Placed clusters whose MemberCluster is NotReady: their agent has not heartbeated
    /// within the heartbeat grace; what they run keeps running (absent: 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub disconnected_clusters: i32,
    /// Clusters the MyApp could not be rendered for or applied to, or named in
    /// `placement.clusters` but not registered (absent: 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failed_clusters: i32,
    /// Clusters whose share moved elsewhere (failover); their copy is left as it is
    /// (absent: 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failed_over_clusters: i32,
    /// Replicas assigned across clusters (the sum of every cluster's `replicas`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Ready replicas across clusters.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Pods the members run across clusters, as their agents report them: differs from
    /// `replicas` where an autoscaler in the member owns the replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_replicas: Option<i32>,
    /// One entry per placed cluster, and one per named cluster that is not registered; past
    /// 50 of them, only the 20 most urgent (see `omittedClusters`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub clusters: Vec<ClusterStatus>,
    /// Clusters with an entry that `clusters` leaves out (absent: 0, every cluster is
    /// listed). Non-zero, `division` is the whole division.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub omitted_clusters: i32,
    /// Every cluster's assignment when `clusters` is not the whole list: the clusters
    /// sharing replicas, ready replicas and reason, grouped. The next plan reads it back
    /// (a division changes as little as it can; cordoned clusters keep what they run).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub division: Vec<DivisionGroup>,
    /// Where a progressive rollout (`spec.rollout`) stands; absent for type All.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutStatus>,
}

/// Up to this many clusters, `status.clusters` lists every one.
pub const FULL_LIST_MAX: usize = 50;
/// Past [`FULL_LIST_MAX`], `status.clusters` lists this many of the most urgent.
pub const URGENT_MAX: usize = 20;

fn is_zero(n: &i32) -> bool {
    *n == 0
}

/// Clusters that share one assignment. `clusters` holds their names, sorted and
/// front-coded to stay small at thousands of clusters: names separated by `,`, each one
/// after the first written as `N:rest`, the first N bytes of the name before it followed
/// by `rest` (`member0001,9:2,8:10` is member0001, member0002, member0010).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DivisionGroup {
    pub replicas: i32,
    #[serde(default)]
    pub ready_replicas: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<SchedulingReason>,
    pub clusters: String,
}

impl DivisionGroup {
    /// The group's cluster names, decoded; an entry that does not decode is an error
    /// naming it.
    pub fn cluster_names(&self) -> Result<Vec<String>, String> {
        decode_names(&self.clusters)
    }
}

/// `names` (sorted) front-coded as [`DivisionGroup::clusters`] holds them.
pub fn encode_names<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    let mut out = String::new();
    let mut previous = "";
    for name in names {
        if !out.is_empty() {
            out.push(',');
        }
        let shared = previous
            .bytes()
            .zip(name.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        // Cut on a character boundary (names are ASCII, but never split one).
        let shared = (0..=shared)
            .rev()
            .find(|n| name.is_char_boundary(*n))
            .unwrap_or(0);
        if shared > 1 {
            out.push_str(&format!("{shared}:{}", &name[shared..]));
        } else {
            out.push_str(name);
        }
        previous = name;
    }
    out
}

/// The names [`encode_names`] wrote.
pub fn decode_names(encoded: &str) -> Result<Vec<String>, String> {
    let mut names: Vec<String> = Vec::new();
    for entry in encoded.split(',').filter(|e| !e.is_empty()) {
        let name = match entry.split_once(':') {
            None => entry.to_owned(),
            Some((shared, rest)) => {
                let previous = names.last().map_or("", String::as_str);
                let prefix = shared
                    .parse::<usize>()
                    .ok()
                    .and_then(|n| previous.get(..n))
                    .ok_or_else(|| {
                        format!("division entry {entry:?} does not follow {previous:?}")
                    })?;
                format!("{prefix}{rest}")
            }
        };
        names.push(name);
    }
    Ok(names)
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStatus {
    pub name: String,
    #[serde(default)]
    pub ready: bool,
    /// Replicas this cluster is assigned (0: it gets no MyApp). Under `spec.autoscaling`:
    /// the most its autoscaler may run (`maxReplicas`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Under `spec.autoscaling`: the fewest replicas its autoscaler may run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_replicas: Option<i32>,
    /// Why it is assigned that many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduling_reason: Option<SchedulingReason>,
    #[serde(default)]
    pub ready_replicas: i32,
    /// Pods the member's MyApp runs (its `status.replicas`), whoever decided how many:
    /// differs from `replicas` while an autoscaler in the member owns them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_replicas: Option<i32>,
    /// The autoscaler in the member that owns this cluster's replicas (a
    /// HorizontalPodAutoscaler on the MyApp or its Deployment; a KEDA ScaledObject through
    /// the one it creates). Flotilla leaves those replicas alone while it exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaler: Option<String>,
    /// Generation of the MyApp in the member cluster that the operator observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Why this cluster is not ready, in words a user can act on (cut at 256 bytes;
    /// `flotilla-hub status NAME` shows it whole); empty when fine.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_front_code_and_decode_back() {
        let names = [
            "member0001",
            "member0002",
            "member0010",
            "other",
            "o",
            "paris-1",
        ];
        let encoded = encode_names(names);
        assert_eq!(encoded, "member0001,9:2,8:10,other,o,paris-1");
        assert_eq!(decode_names(&encoded).unwrap(), names);
        assert_eq!(decode_names("").unwrap(), Vec::<String>::new());
        assert_eq!(encode_names([]), "");
        // 1,000 names of the bench's shape: under 6 bytes each.
        let many: Vec<String> = (0..1000).map(|i| format!("member{i:04}")).collect();
        let encoded = encode_names(many.iter().map(String::as_str));
        assert!(encoded.len() < 6 * 1000, "{} bytes", encoded.len());
        assert_eq!(decode_names(&encoded).unwrap(), many);
    }

    #[test]
    fn a_broken_division_names_the_entry() {
        let e = decode_names("ab,5:x").unwrap_err();
        assert!(e.contains("\"5:x\" does not follow \"ab\""), "{e}");
        assert!(decode_names("ab,x:y").is_err());
        assert!(decode_names("9:x").is_err(), "nothing before it");
    }
}
