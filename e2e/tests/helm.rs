//! kind with the hub and agents as Pods only (`flotilla-e2e test --provider kind
//! --real-nodes`, which passes `--include-ignored`): `helm install` of `charts/flotilla`,
//! end to end. Two kind clusters of the test's own (the environment's host already runs
//! a hub, and two hubs on one host would fight over every FederatedMyApp): the hub from
//! the chart on one, an agent from the chart on the other, the images the environment
//! built loaded with `kind load image-archive` (no registry), the agent's credential from
//! `flotilla-hub join --token-file`; a FederatedMyApp on the chart's hub reaches the
//! member as a MyApp and a Deployment. `helm uninstall` of both, then the clusters are
//! deleted (`flotilla-e2e down` deletes them too, should the test be stopped halfway).
//!
//! It uses the helm that `deploy/verify.sh` caches: run that first, as `.ci/run` does.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use flotilla_crds::{FederatedMyApp, MyApp};
use flotilla_lab::federation::{federated_myapp, wait_member_ready};
use flotilla_lab::hubcli::HubCli;
use flotilla_lab::provider::realnode::pods::{HUB_NODE_PORT, hub_tls_secret};
use flotilla_lab::provider::{kind, realnode};
use flotilla_lab::support::{cached_tool, cargo_binaries, workspace_root};
use flotilla_lab::{Env, Provider, await_object, wait_for};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const NS: &str = "flotilla-system";
const TIMEOUT: Duration = Duration::from_secs(180);
const HOST: &str = "helm-host";
const MEMBER: &str = "helm-member";

/// The helm that `deploy/verify.sh` caches.
fn helm() -> Result<PathBuf> {
    Ok(cached_tool("helm-")?.join("helm"))
}

fn helm_run(helm: &Path, kubeconfig: &Path, args: &[&str]) -> Result<String> {
    let out = std::process::Command::new(helm)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .context("running helm")?;
    if !out.status.success() {
        bail!(
            "helm {} failed ({}): {}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Deletes the test's kind clusters when dropped, whatever happened before.
struct Clusters(Vec<String>);

impl Drop for Clusters {
    fn drop(&mut self) {
        let bin = std::env::var("KIND").unwrap_or_else(|_| "kind".to_string());
        for name in &self.0 {
            let _ = std::process::Command::new(&bin)
                .args(["delete", "cluster", "--name", name])
                .status();
        }
    }
}

async fn client_from(kubeconfig: &Path) -> Result<Client> {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await?;
    Ok(Client::try_from(config)?)
}

/// The image a Deployment of the environment runs, split as repository and tag.
async fn image_of(client: Client, name: &str) -> Result<(String, String)> {
    let d = Api::<Deployment>::namespaced(client, NS).get(name).await?;
    let image = d
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.containers.into_iter().next())
        .and_then(|c| c.image)
        .with_context(|| format!("Deployment {NS}/{name} has no image"))?;
    let (repo, tag) = image
        .rsplit_once(':')
        .with_context(|| format!("image {image} has no tag"))?;
    Ok((repo.to_string(), tag.to_string()))
}

async fn wait_ready(client: &Client, name: &str, replicas: i32) -> Result<()> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let what = format!("{replicas} ready Pod(s) of the chart's {NS}/{name}");
    let ready = |d: Option<&Deployment>| {
        d.and_then(|d| d.status.as_ref()?.ready_replicas)
            .unwrap_or(0)
            >= replicas
    };
    await_object(&api, name, TIMEOUT, &what, ready).await?;
    Ok(())
}

#[tokio::test]
#[ignore = "kind with Pods only: `flotilla-e2e test --provider kind --real-nodes`"]
async fn helm_installs_a_hub_and_an_agent_that_federate() -> Result<()> {
    let env = Env::load_ready().await?;
    ensure!(
        env.provider == Provider::Kind && env.real_nodes,
        "the Helm install runs on kind with the hub and agents as Pods \
         (`flotilla-e2e test --provider kind --real-nodes`): it loads their images"
    );
    let helm = helm()?;
    let chart = workspace_root().join("charts").join("flotilla");
    let dir = env.dir.join("helm");
    std::fs::create_dir_all(&dir)?;
    let (hub_repo, hub_tag) = image_of(env.client("host").await?, "flotilla-hub").await?;
    let (agent_repo, agent_tag) = image_of(env.client("cluster1").await?, "flotilla-agent").await?;
    let images = realnode::images_dir(&env.dir);

    let start = Instant::now();
    let mut clusters = Clusters(Vec::new());
    let mut kubeconfigs = Vec::new();
    for c in [HOST, MEMBER] {
        let kubeconfig = dir.join(format!("{c}.yaml"));
        let name = kind::create_extra(&env, c, &kubeconfig).await?;
        clusters.0.push(name.clone());
        let component = if c == HOST { "hub" } else { "agent" };
        kind::load_image(&name, &images.join(format!("flotilla-{component}.tar"))).await?;
        kubeconfigs.push(kubeconfig);
    }
    println!(
        "helm: two kind clusters made, images loaded, in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    let (host_kc, member_kc) = (&kubeconfigs[0], &kubeconfigs[1]);
    let host = client_from(host_kc).await?;
    let member = client_from(member_kc).await?;
    let hub_ip = kind::node_address(&clusters.0[0])?;
    let hub_address = format!("{hub_ip}:{HUB_NODE_PORT}");

    // The hub: its serving certificate first (the Secret the chart's hub mounts).
    let cli = HubCli {
        program: cargo_binaries(&[("flotilla-hub", "flotilla-hub")])?["flotilla-hub"].clone(),
        kubeconfig: host_kc.clone(),
    };
    let tls = dir.join("hub-tls");
    let _ = std::fs::remove_dir_all(&tls);
    let tls_out = tls.to_string_lossy().into_owned();
    cli.run(&["certs", "--out", &tls_out, "--san", &hub_ip])?;
    let namespaces: Api<Namespace> = Api::all(host.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}}))?;
    namespaces.create(&PostParams::default(), &ns).await?;
    Api::<Secret>::namespaced(host.clone(), NS)
        .create(&PostParams::default(), &hub_tls_secret(&tls, NS)?)
        .await?;
    let port = HUB_NODE_PORT.to_string();
    let hub_values = [
        ("hub.image.repository", hub_repo.as_str()),
        ("hub.image.tag", hub_tag.as_str()),
        ("hub.service.type", "NodePort"),
        ("hub.service.nodePort", port.as_str()),
    ];
    let mut args = vec!["install", "flotilla", chart.to_str().unwrap_or_default()];
    args.extend(["-n", NS]);
    let sets: Vec<String> = hub_values.iter().map(|(k, v)| format!("{k}={v}")).collect();
    for s in &sets {
        args.extend(["--set", s]);
    }
    let t = Instant::now();
    helm_run(&helm, host_kc, &args).context("helm install of the hub")?;
    wait_ready(&host, "flotilla-hub", 2).await?;
    println!(
        "helm: hub installed, 2 Pods Ready after {:.1}s",
        t.elapsed().as_secs_f64()
    );

    // The member: its credential from `join`, the agent from the chart.
    let token = dir.join("helm-member.token");
    let _ = std::fs::remove_file(&token);
    let token_out = token.to_string_lossy().into_owned();
    cli.run(&[
        "join",
        MEMBER,
        "--label",
        "region=eu",
        "--hub-address",
        &hub_address,
        "--token-file",
        &token_out,
    ])?;
    let values = json!({
        "hub": {"enabled": false},
        "agent": {
            "enabled": true,
            "cluster": MEMBER,
            "hub": {
                "address": hub_address,
                "token": std::fs::read_to_string(&token)?.trim(),
                "caCrt": std::fs::read_to_string(tls.join("ca.crt"))?,
            },
            "image": {"repository": agent_repo, "tag": agent_tag},
        },
    });
    let values_file = dir.join("member-values.yaml");
    std::fs::write(&values_file, serde_yaml::to_string(&values)?)?;
    let values_path = values_file.to_string_lossy().into_owned();
    let args = [
        "install",
        "flotilla",
        chart.to_str().unwrap_or_default(),
        "-n",
        NS,
        "--create-namespace",
        "-f",
        &values_path,
    ];
    let t = Instant::now();
    let installed = helm_run(&helm, member_kc, &args).context("helm install of the agent");
    std::fs::remove_file(&values_file)?;
    installed?;
    wait_ready(&member, "flotilla-agent", 1).await?;
    wait_member_ready(&host, MEMBER, true, TIMEOUT).await?;
    println!(
        "helm: agent installed, MemberCluster {MEMBER} Ready after {:.1}s",
        t.elapsed().as_secs_f64()
    );

    // A FederatedMyApp on the chart's hub reaches the member.
    let name = "helm-web";
    let fed: Api<FederatedMyApp> = Api::namespaced(host.clone(), "default");
    let app = federated_myapp(
        name,
        &[MEMBER],
        json!({"replicas": 2, "image": "nginx:1.27", "config": {"app.conf": "x=1"}}),
    );
    let t = Instant::now();
    fed.patch(
        name,
        &PatchParams::apply("helm-test").force(),
        &Patch::Apply(&app),
    )
    .await?;
    let myapps: Api<MyApp> = Api::namespaced(member.clone(), "default");
    let what = format!("MyApp {name} in {MEMBER}");
    let got = await_object(&myapps, name, TIMEOUT, &what, |a: Option<&MyApp>| {
        a.is_some()
    })
    .await?
    .context("no MyApp")?;
    assert_eq!(got.spec.replicas, Some(2), "the MyApp carries the template");
    // The agent's operator made its Deployment (its Pods wait for an image no registry
    // serves here; the object is what this test is after).
    let deployments: Api<Deployment> = Api::namespaced(member.clone(), "default");
    let owned = wait_for(TIMEOUT, "the MyApp's Deployment in the member", || async {
        let all = deployments.list(&ListParams::default()).await?;
        Ok(all.items.into_iter().find(|d| {
            d.owner_references()
                .iter()
                .any(|o| o.kind == "MyApp" && o.name == name)
        }))
    })
    .await?;
    println!(
        "helm: FederatedMyApp {name} reached {MEMBER} as MyApp and Deployment {} after {:.1}s",
        owned.name_any(),
        t.elapsed().as_secs_f64()
    );

    // Both releases uninstall.
    helm_run(&helm, member_kc, &["uninstall", "flotilla", "-n", NS])
        .context("helm uninstall of the agent")?;
    helm_run(&helm, host_kc, &["uninstall", "flotilla", "-n", NS])
        .context("helm uninstall of the hub")?;
    drop(clusters);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "helm: whole test {:.1}s, clusters deleted",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
