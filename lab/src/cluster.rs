//! What every cluster gets once its apiserver answers, whichever provider made it:
//! the Flotilla CRDs and a few fake (KWOK) nodes.
//! Everything is server-side applied, so a second `up` changes nothing.

use crate::wait::{await_object, wait_for};
use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, Patch, PatchParams};
use kube::{Client, ResourceExt};
use std::collections::BTreeMap;
use std::time::Duration;

/// The field manager of everything `up` applies.
pub const FIELD_MANAGER: &str = "flotilla-e2e";
/// How many fake nodes each cluster gets.
pub const FAKE_NODES: usize = 3;

/// Allocatable CPU cores of each fake node of member `name`: cluster1 32, cluster2 16,
/// cluster3 8, ... (never under 2), so that `replicaScheduling.mode: Capacity` has sizes
/// to follow. The host's nodes keep KWOK's default (1000 cores).
pub fn node_cores(name: &str) -> Option<u32> {
    let n: u32 = name.strip_prefix("cluster")?.parse().ok()?;
    Some((64u32 >> n.min(5)).max(2))
}

/// Allocatable memory of each fake node of a member: ample, so that CPU decides.
pub const NODE_MEMORY: &str = "256Gi";
/// Label on the fake nodes (the value is the usual KWOK one).
pub const FAKE_NODE_LABEL: (&str, &str) = ("type", "kwok");

const READY_TIMEOUT: Duration = Duration::from_secs(120);

pub async fn prepare(client: &Client, name: &str) -> Result<()> {
    wait_for(
        READY_TIMEOUT,
        &format!("the apiserver of {name}"),
        || async { Ok(Some(client.apiserver_version().await?)) },
    )
    .await?;
    install_crds(client, flotilla_crds::crds()).await?;
    if name == crate::HOST {
        // The cluster inventory API, which the hub publishes ClusterProfiles into.
        install_crds(client, flotilla_crds::inventory_crds()).await?;
    }
    // Both providers: the kind provider runs a KWOK controller beside each kind cluster.
    fake_nodes(client, FAKE_NODES, node_cores(name)).await?;
    // Pods need the namespace's default ServiceAccount, which kube-controller-manager
    // creates: waiting for it means the controllers run and tests can create pods at once.
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
    let what = format!("the default ServiceAccount in {name}");
    let exists = |sa: Option<&ServiceAccount>| sa.is_some();
    await_object(&sas, "default", READY_TIMEOUT, &what, exists).await?;
    Ok(())
}

/// Applies CRDs (the project's: `flotilla_crds::crds()`, the same objects as
/// `crds/flotilla-crds.yaml`) and waits until the apiserver serves them.
pub async fn install_crds(client: &Client, crds: Vec<CustomResourceDefinition>) -> Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    for crd in crds {
        let name = crd.name_any();
        api.patch(&name, &pp, &Patch::Apply(&crd))
            .await
            .with_context(|| format!("applying CRD {name}"))?;
        await_object(
            &api,
            &name,
            READY_TIMEOUT,
            &format!("CRD {name} to be Established"),
            |crd: Option<&CustomResourceDefinition>| crd.is_some_and(established),
        )
        .await?;
    }
    Ok(())
}

/// Whether the CRD has condition Established=True.
pub fn established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        })
}

/// Whether the node has condition Ready=True.
pub fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Creates `count` Node objects that the KWOK controller (which kwokctl runs with
/// `--manage-all-nodes`) keeps Ready and whose bound pods it makes Running and Ready.
/// No taint: plain Deployments should land on them without tolerations. With `cores`,
/// each node's allocatable is set (KWOK keeps what a node's status already has).
pub async fn fake_nodes(client: &Client, count: usize, cores: Option<u32>) -> Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let names: Vec<String> = (0..count).map(|i| format!("kwok-node-{i}")).collect();
    for name in &names {
        let node = Node {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(BTreeMap::from([
                    (FAKE_NODE_LABEL.0.to_string(), FAKE_NODE_LABEL.1.to_string()),
                    ("kubernetes.io/hostname".to_string(), name.clone()),
                    ("kubernetes.io/os".to_string(), "linux".to_string()),
                    ("kubernetes.io/arch".to_string(), "amd64".to_string()),
                ])),
                annotations: Some(BTreeMap::from([(
                    "kwok.x-k8s.io/node".to_string(),
                    "fake".to_string(),
                )])),
                ..Default::default()
            },
            ..Default::default()
        };
        api.patch(name, &pp, &Patch::Apply(&node))
            .await
            .with_context(|| format!("applying node {name}"))?;
    }
    for name in &names {
        await_object(
            &api,
            name,
            READY_TIMEOUT,
            &format!("node {name} to be Ready"),
            |node: Option<&Node>| node.is_some_and(node_ready),
        )
        .await?;
    }
    // Sized once KWOK has initialized them (it keeps a status it finds, but its first
    // write could replace one made before it), and checked until the size holds.
    if let Some(cores) = cores {
        let size =
            serde_json::json!({"cpu": cores.to_string(), "memory": NODE_MEMORY, "pods": "110"});
        for name in &names {
            let status = serde_json::json!({
                "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                "status": {"allocatable": size, "capacity": size},
            });
            wait_for(
                READY_TIMEOUT,
                &format!("node {name} sized {cores} cores"),
                || async {
                    api.patch_status(name, &pp, &Patch::Apply(&status)).await?;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    let node = api.get(name).await?;
                    let cpu = node
                        .status
                        .and_then(|s| s.allocatable)
                        .and_then(|a| a.get("cpu").cloned());
                    Ok((cpu.map(|q| q.0) == Some(cores.to_string())).then_some(()))
                },
            )
            .await?;
        }
    }
    Ok(())
}
