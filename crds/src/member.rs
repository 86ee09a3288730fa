//! `MemberCluster` (`core.kubefed.io/v1beta1`, cluster-scoped): a registered member.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A member cluster, created by `flotilla-hub join`. Its labels feed
/// `placement.clusterSelector`.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "core.kubefed.io",
    version = "v1beta1",
    kind = "MemberCluster",
    plural = "memberclusters",
    shortname = "mc",
    category = "flotilla",
    status = "MemberClusterStatus",
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Kubernetes","type":"string","jsonPath":".status.kubernetesVersion"}"#,
    printcolumn = r#"{"name":"Agent","type":"string","jsonPath":".status.agentVersion"}"#,
    printcolumn = r#"{"name":"Heartbeat","type":"date","jsonPath":".status.lastHeartbeatTime"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MemberClusterSpec {
    /// SHA-256 (hex) of the agent's bearer token. Only the hash is stored; clearing it
    /// revokes the agent, `flotilla-hub join` issues a new token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_sha256: Option<String>,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemberClusterStatus {
    /// `Ready`: an agent is connected and heartbeating.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes_version: Option<String>,
    /// UID of the member's `kube-system` namespace, pinned by the first agent that
    /// connects: the credential is bound to that physical cluster, and an agent running
    /// anywhere else is refused. Clear it (with `kubectl edit --subresource=status`) to
    /// move the registration to a rebuilt cluster.
    #[serde(
        default,
        rename = "clusterUID",
        skip_serializing_if = "Option::is_none"
    )]
    pub cluster_uid: Option<String>,
}
