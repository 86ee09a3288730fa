//! `ClusterGrant` (`flotilla.io/v1alpha1`, namespaced): which member clusters the
//! FederatedMyApps of its namespace may be placed on, after OCM's
//! `ManagedClusterSetBinding`. A namespace may place on the union of its grants. Without
//! any grant a namespace places on every cluster, unless the hub runs with
//! `--require-namespace-grant`: then it places nowhere.
//!
//! Who may create a ClusterGrant in namespace N decides where N's workloads run: give
//! that right (RBAC on `clustergrants`) to the platform team, not to N's users.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The clusters one grant gives its namespace: those named, and those the selector
/// matches. Neither: none.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    doc = "ClusterGrant lets the FederatedMyApps of its namespace be placed on the member clusters it names or selects (a namespace places on the union of its grants). A namespace without any grant places on every cluster, or on none when flotilla-hub runs with --require-namespace-grant. A grant withdrawn keeps what runs.",
    group = "flotilla.io",
    version = "v1alpha1",
    kind = "ClusterGrant",
    plural = "clustergrants",
    shortname = "cgrant",
    category = "flotilla",
    namespaced,
    printcolumn = r#"{"name":"Clusters","type":"string","description":"Clusters granted by name","jsonPath":".spec.clusters"}"#,
    printcolumn = r#"{"name":"Selector","type":"string","description":"MemberCluster labels granted","jsonPath":".spec.clusterSelector"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterGrantSpec {
    /// MemberClusters granted by name. A name not (yet) registered grants nothing until
    /// a MemberCluster of that name is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clusters: Vec<String>,
    /// MemberClusters granted by their labels; `{}` grants every registered cluster. An
    /// invalid selector grants nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_selector: Option<LabelSelector>,
}
