//! Proves that the e2e environment is real: the apiservers are Kubernetes' own, the
//! project's CRDs are installed and Established, and Deployments get (fake) pods that
//! become Ready. (That they enforce the MyApp schema is `operator.rs`'s
//! `apiserver_rejects_invalid_myapps`.)
//!
//! Needs a running environment (`cargo run -p flotilla-e2e -- up`, or let
//! `cargo run -p flotilla-e2e -- test` do everything); without one every test fails and
//! says so.

use flotilla_lab::{Env, Provider, await_object};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

async fn env() -> Env {
    Env::load_ready()
        .await
        .unwrap_or_else(|e| panic!("the e2e environment is not up: {e:#}"))
}

async fn client(env: &Env, name: &str) -> Client {
    env.client(name)
        .await
        .unwrap_or_else(|e| panic!("no client for {name}: {e:#}"))
}

fn unique(prefix: &str) -> String {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    format!("{prefix}-{ms}")
}

#[tokio::test]
async fn environment_has_a_host_and_members() {
    let env = env().await;
    assert_eq!(env.clusters[0].name, env.host());
    assert!(
        !env.members().is_empty(),
        "no member clusters in {:?}",
        env.clusters
    );
    for c in &env.clusters {
        assert!(
            env.kubeconfig(&c.name).unwrap().is_file(),
            "kubeconfig of {} missing",
            c.name
        );
    }
}

#[tokio::test]
async fn crds_are_installed_on_host_and_members() {
    let env = env().await;
    for c in &env.clusters {
        let api: Api<CustomResourceDefinition> = Api::all(client(&env, &c.name).await);
        let listed: Vec<String> = api
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .iter()
            .map(|c| c.name_any())
            .collect();
        for want in flotilla_crds::crds() {
            let name = want.name_any();
            assert!(
                listed.contains(&name),
                "CRD {name} not listed on {}: {listed:?}",
                c.name
            );
            let crd = api.get(&name).await.unwrap();
            assert!(
                flotilla_lab::cluster::established(&crd),
                "CRD {name} not Established on {}",
                c.name
            );
        }
        // MyApp serves all three versions and stores v1, as installed.
        let myapp = api.get("myapps.app.example.com").await.unwrap();
        let served: Vec<(&str, bool)> = myapp
            .spec
            .versions
            .iter()
            .map(|v| (v.name.as_str(), v.storage))
            .collect();
        assert!(served.contains(&("v1", true)), "{served:?}");
        assert!(
            served.iter().any(|(v, _)| *v == "v1beta1")
                && served.iter().any(|(v, _)| *v == "v1alpha1"),
            "{served:?}"
        );
    }
}

#[tokio::test]
async fn a_deployment_on_a_member_becomes_available_with_fake_pods() {
    let env = env().await;
    let member = env.members()[0];
    let client = client(&env, member).await;
    let ns = unique("e2e-env");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap(),
        )
        .await
        .unwrap();

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "pause"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "pause"}},
            "template": {
                "metadata": {"labels": {"app": "pause"}},
                "spec": {"containers": [{"name": "pause", "image": "registry.k8s.io/pause:3.10"}]}
            }
        }
    }))
    .unwrap();
    deployments
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap();

    let available = |d: Option<&Deployment>| {
        let Some(status) = d.and_then(|d| d.status.as_ref()) else {
            return false;
        };
        let mut conditions = status.conditions.iter().flatten();
        let available = conditions.any(|c| c.type_ == "Available" && c.status == "True");
        available && status.ready_replicas == Some(2)
    };
    let available = await_object(
        &deployments,
        "pause",
        Duration::from_secs(90),
        "Deployment pause to be Available with 2 ready replicas",
        available,
    )
    .await;

    let pods: Vec<Pod> = Api::<Pod>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let placed: Vec<(String, String, String)> = pods
        .iter()
        .map(|p| {
            let node = p
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default();
            let phase = p
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            (p.name_any(), node, phase)
        })
        .collect();
    let _ = namespaces.delete(&ns, &DeleteParams::default()).await;
    available.unwrap_or_else(|e| panic!("{e:#}; pods: {placed:?}"));

    assert_eq!(placed.len(), 2, "{placed:?}");
    for (pod, node, phase) in &placed {
        assert_eq!(phase, "Running", "pod {pod}");
        if env.provider == Provider::Local {
            assert!(
                node.starts_with("kwok-node-"),
                "pod {pod} on {node}, not on a fake node"
            );
        }
    }
}
