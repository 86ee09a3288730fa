//! `MyApp` (`app.example.com`): the application one member cluster runs.
//!
//! `v1` is the storage version and carries the seed's schema (`replicas` 1–10, `image`
//! matching `^.+:.+$`). `v1beta1` and `v1alpha1` are older served versions; each differs
//! from `v1` by a renamed field so that conversion is real work, and every conversion
//! here is lossless in both directions.
//!
//! Every version serves the `/scale` subresource, so that a HorizontalPodAutoscaler or a
//! KEDA ScaledObject can target a MyApp: its replicas at the version's own path
//! (`spec.size` at v1alpha1), the pods it runs at `status.replicas`, and their selector
//! at `status.selector` (both written by the operator from the Deployment).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub const GROUP: &str = "app.example.com";

/// Rolling-update knobs of the Deployment the operator creates.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStrategy {
    /// Pods that may be unavailable during an update (number or percentage). Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<IntOrString>,
    /// Pods that may be created above `replicas` during an update. Default 25%.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_surge: Option<IntOrString>,
}

/// Observed state, written by the operator in the member cluster.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MyAppStatus {
    /// True only when the Deployment observed the latest spec and every replica is updated
    /// and available.
    #[serde(default)]
    pub ready: bool,
    #[serde(default)]
    pub ready_replicas: i32,
    /// Pods of the Deployment, of every version and state (its `status.replicas`): what
    /// the `/scale` subresource reports as the current replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// The Deployment's pod selector as a label query (`a=b,c=d`): what an autoscaler
    /// reads through `/scale` to find the pods it measures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Available`, `Progressing`, `Degraded`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// Fields shared unchanged by every version: kept in one place so that a new field
/// cannot be forgotten by one version's conversion.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Workload {
    /// Container image with a tag, e.g. `nginx:1.27`. Without an image the operator
    /// creates nothing and reports the condition `Degraded` with reason `ImageMissing`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^.+:.+$"))]
    pub image: Option<String>,
    /// Environment variables of the container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// Container port, exposed as `http`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<RolloutStrategy>,
}

pub mod v1 {
    use super::*;

    /// The desired state of one application in one cluster.
    #[derive(
        CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema,
    )]
    #[kube(
        group = "app.example.com",
        version = "v1",
        kind = "MyApp",
        doc = "MyApp is one application in one member cluster: the operator runs it as a Deployment and a ConfigMap (a rolling update on every change of either), and reports readiness in status. In a federation flotilla-agent applies it from a FederatedMyApp; it can also be applied by hand.",
        plural = "myapps",
        shortname = "ma",
        namespaced,
        status = "MyAppStatus",
        scale(
            spec_replicas_path = ".spec.replicas",
            status_replicas_path = ".status.replicas",
            label_selector_path = ".status.selector"
        ),
        printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".spec.replicas"}"#,
        printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
        printcolumn = r#"{"name":"Image","type":"string","jsonPath":".spec.image"}"#,
        printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
    )]
    #[serde(rename_all = "camelCase")]
    pub struct MyAppSpec {
        /// Number of pods, 1 to 10. Default 1.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schemars(range(min = 1, max = 10))]
        pub replicas: Option<i32>,
        #[serde(flatten)]
        pub workload: Workload,
        /// Files of the ConfigMap `<name>-config`; a change rolls the pods.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        pub config: BTreeMap<String, String>,
    }
}

pub mod v1beta1 {
    use super::*;

    /// `v1beta1`: the ConfigMap contents were called `configData`.
    #[derive(
        CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema,
    )]
    #[kube(
        group = "app.example.com",
        version = "v1beta1",
        kind = "MyApp",
        doc = "MyApp at v1beta1 (served, converted to the stored v1 by the agent's webhook): the ConfigMap contents were called configData.",
        plural = "myapps",
        shortname = "ma",
        namespaced,
        status = "MyAppStatus",
        scale(
            spec_replicas_path = ".spec.replicas",
            status_replicas_path = ".status.replicas",
            label_selector_path = ".status.selector"
        )
    )]
    #[serde(rename_all = "camelCase")]
    pub struct MyAppSpec {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schemars(range(min = 1, max = 10))]
        pub replicas: Option<i32>,
        #[serde(flatten)]
        pub workload: Workload,
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        pub config_data: BTreeMap<String, String>,
    }

    impl From<MyAppSpec> for v1::MyAppSpec {
        fn from(s: MyAppSpec) -> Self {
            Self {
                replicas: s.replicas,
                workload: s.workload,
                config: s.config_data,
            }
        }
    }
    impl From<v1::MyAppSpec> for MyAppSpec {
        fn from(s: v1::MyAppSpec) -> Self {
            Self {
                replicas: s.replicas,
                workload: s.workload,
                config_data: s.config,
            }
        }
    }
}

pub mod v1alpha1 {
    use super::*;

    /// `v1alpha1`: `replicas` was called `size`, the ConfigMap contents `configData`.
    #[derive(
        CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema,
    )]
    #[kube(
        group = "app.example.com",
        version = "v1alpha1",
        kind = "MyApp",
        doc = "MyApp at v1alpha1 (served, converted to the stored v1 by the agent's webhook): replicas was called size, the ConfigMap contents configData.",
        plural = "myapps",
        shortname = "ma",
        namespaced,
        status = "MyAppStatus",
        scale(
            spec_replicas_path = ".spec.size",
            status_replicas_path = ".status.replicas",
            label_selector_path = ".status.selector"
        )
    )]
    #[serde(rename_all = "camelCase")]
    pub struct MyAppSpec {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schemars(range(min = 1, max = 10))]
        pub size: Option<i32>,
        #[serde(flatten)]
        pub workload: Workload,
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        pub config_data: BTreeMap<String, String>,
    }

    impl From<MyAppSpec> for v1::MyAppSpec {
        fn from(s: MyAppSpec) -> Self {
            Self {
                replicas: s.size,
                workload: s.workload,
                config: s.config_data,
            }
        }
    }
    impl From<v1::MyAppSpec> for MyAppSpec {
        fn from(s: v1::MyAppSpec) -> Self {
            Self {
                size: s.replicas,
                workload: s.workload,
                config_data: s.config,
            }
        }
    }
}

pub use v1::{MyApp, MyAppSpec};
