//! The kind provider, for users with Docker: one `kind create cluster` per cluster, same
//! state dir, same kubeconfig paths, so the suite cannot tell the providers apart.
//!
//! Each kind cluster has one real node (kubelet + containerd in a Docker container), and,
//! as in real-node mode, KWOK nodes beside it for the MyApps' pods: their images
//! (`nginx:1.27`, ...) cannot be pulled here, and the scheduling suite needs the fake
//! nodes' sizes. So `up`, once a cluster answers:
//! - labels the kind node `flotilla.io/real-node=true`, taints it
//!   `flotilla.io/real-node=true:NoSchedule` (real-node mode's taint) and cordons it, so
//!   that the MyApps' pods (no toleration) land on the KWOK nodes and the agents'
//!   capacity reports count the KWOK nodes alone, as on the local provider;
//! - gives kind's own workloads (kube-system, local-path-storage: CoreDNS, kube-proxy,
//!   the CNI, the storage provisioner) the toleration and a nodeSelector on that label,
//!   so that they stay on the kind node, and waits until they have rolled out;
//! - starts the cached `kwok` controller as a host process against the cluster's
//!   apiserver, managing only the nodes labelled `type=kwok` (recorded as `kwok-<cluster>`,
//!   stopped by `down` with the hub and agents); [`crate::cluster::prepare`] then adds the
//!   fake nodes, as for the local provider.
//!
//! `down` deletes the clusters, checks that none of their containers or volumes is left,
//! and removes kind's Docker network `kind` when no container uses it any more.

use crate::cluster::{FAKE_NODE_LABEL, FIELD_MANAGER};
use crate::env::{ClusterState, Env};
use crate::provider::realnode::REAL_NODE_KEY;
use crate::support::stdout_of;
use crate::wait::wait_for;
use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Node, PodSpec, Taint, Toleration};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

/// The namespaces of kind's own workloads, kept on the kind node.
const SYSTEM_NAMESPACES: [&str; 2] = ["kube-system", "local-path-storage"];
/// How long kind's workloads may take to roll out onto the tainted node.
const ROLLOUT_TIMEOUT: Duration = Duration::from_secs(180);
/// The taint a cordoned node carries (and a Deployment's pods must tolerate to land there).
const UNSCHEDULABLE_TAINT: &str = "node.kubernetes.io/unschedulable";

/// The kind binary (`$KIND`, else `kind` on PATH); `$FLOTILLA_KIND_IMAGE` picks a node image.
fn kind_bin() -> String {
    std::env::var("KIND").unwrap_or_else(|_| "kind".to_string())
}

/// kind cluster names are global to the Docker engine: qualify ours by the state dir, so
/// that two environments coexist.
pub fn kind_name(env: &Env, cluster: &str) -> String {
    format!(
        "flotilla-{:08x}-{cluster}",
        fnv1a(env.dir.to_string_lossy().as_bytes()) as u32
    )
}

/// FNV-1a: a hash that stays the same across Rust releases (unlike `DefaultHasher`).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// kind's cluster configuration: the API server listens on 127.0.0.1 at a port Docker picks.
fn kind_config() -> String {
    let config = serde_json::json!({
        "kind": "Cluster",
        "apiVersion": "kind.x-k8s.io/v1alpha4",
        "networking": {"apiServerAddress": "127.0.0.1", "apiServerPort": 0},
    });
    serde_yaml::to_string(&config).expect("a JSON value serializes as YAML")
}

/// `kind create cluster` arguments for cluster `cluster` of `env`; `image` pins a node image.
fn create_args(env: &Env, cluster: &ClusterState, config: &Path, image: &str) -> Vec<String> {
    let mut args: Vec<String> = ["create", "cluster", "--name"].map(String::from).to_vec();
    args.push(kind_name(env, &cluster.name));
    args.push("--kubeconfig".into());
    args.push(cluster.kubeconfig.to_string_lossy().into());
    args.push("--config".into());
    args.push(config.to_string_lossy().into());
    args.extend(["--wait".into(), "180s".into()]);
    if !image.is_empty() {
        args.extend(["--image".into(), image.to_string()]);
    }
    args
}

async fn kind(args: &[&str]) -> Result<String> {
    let out = tokio::process::Command::new(kind_bin())
        .args(args)
        .kill_on_drop(true)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .await
        .with_context(|| {
            format!(
                "running `{} {}` (is kind installed?)",
                kind_bin(),
                args.join(" ")
            )
        })?;
    if !out.status.success() {
        bail!(
            "`{} {}` failed ({})",
            kind_bin(),
            args.join(" "),
            out.status
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The names of the kind clusters that exist (`kind get clusters`).
async fn kind_clusters() -> Result<Vec<String>> {
    let out = kind(&["get", "clusters"]).await?;
    Ok(out.lines().map(|l| l.trim().to_string()).collect())
}

/// The name of the one node of kind cluster `kind_name` (kind's naming).
pub fn node_name(kind_name: &str) -> String {
    format!("{kind_name}-control-plane")
}

/// The address of kind cluster `kind_name`'s node on the `kind` network: what the other
/// clusters' nodes (and their Pods, masqueraded) reach its NodePorts at.
pub fn node_address(kind_name: &str) -> Result<String> {
    let node = node_name(kind_name);
    let format = format!("{{{{(index .NetworkSettings.Networks \"{NETWORK}\").IPAddress}}}}");
    let out = std::process::Command::new("docker")
        .args(["inspect", "-f", &format, &node])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running `docker inspect {node}` (is Docker installed?)"))?;
    let ip = stdout_of(format_args!("`docker inspect {node}`"), out)?;
    let ip = ip.trim();
    ensure!(
        ip.parse::<std::net::Ipv4Addr>().is_ok(),
        "kind node {node} has no IPv4 address on the {NETWORK} network: {ip:?}"
    );
    Ok(ip.to_string())
}

/// `kind load image-archive`: an OCI layout archive (as [`super::realnode::oci`] writes
/// them) into the containerd of kind cluster `kind_name`'s node, no registry.
pub async fn load_image(kind_name: &str, archive: &Path) -> Result<()> {
    let archive = archive.to_string_lossy();
    kind(&["load", "image-archive", &archive, "--name", kind_name])
        .await
        .with_context(|| format!("loading {archive} into kind cluster {kind_name}"))?;
    Ok(())
}

/// Creates kind cluster `kind_name` (unless it exists) with the environment's settings,
/// its kubeconfig written to `kubeconfig`: for a test that needs clusters of its own (the
/// Helm install). `down` deletes it with the environment's (it carries the prefix).
pub async fn create_extra(env: &Env, cluster: &str, kubeconfig: &Path) -> Result<String> {
    let name = kind_name(env, cluster);
    if kind_clusters().await?.contains(&name) {
        return Ok(name);
    }
    let config = env.dir.join(format!("kind-{cluster}.yaml"));
    std::fs::write(&config, kind_config())?;
    let state = ClusterState {
        name: cluster.to_string(),
        role: crate::Role::Member,
        kubeconfig: kubeconfig.to_path_buf(),
        components: Vec::new(),
    };
    let image = std::env::var("FLOTILLA_KIND_IMAGE").unwrap_or_default();
    let args = create_args(env, &state, &config, &image);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let created = kind(&args)
        .await
        .with_context(|| format!("creating kind cluster {name}"));
    remove(&config)?;
    created.map(|_| name)
}

/// Deletes kind cluster `kind_name` if it exists.
pub async fn delete_extra(kind_name: &str) -> Result<()> {
    if kind_clusters().await?.iter().any(|c| c == kind_name) {
        kind(&["delete", "cluster", "--name", kind_name]).await?;
    }
    Ok(())
}

/// The process name of the KWOK controller of `cluster`.
pub fn kwok_process(cluster: &str) -> String {
    format!("kwok-{cluster}")
}

pub async fn up(env: &mut Env) -> Result<()> {
    let config = env.dir.join("kind.yaml");
    std::fs::write(&config, kind_config())?;
    let existing = kind_clusters().await?;
    let image = std::env::var("FLOTILLA_KIND_IMAGE").unwrap_or_default();
    for c in &env.clusters {
        let name = kind_name(env, &c.name);
        if existing.contains(&name) {
            // Idempotent: an existing cluster only gets its kubeconfig written again.
            let kubeconfig = c.kubeconfig.to_string_lossy().into_owned();
            kind(&[
                "export",
                "kubeconfig",
                "--name",
                &name,
                "--kubeconfig",
                &kubeconfig,
            ])
            .await?;
            continue;
        }
        let args = create_args(env, c, &config, &image);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        kind(&args)
            .await
            .with_context(|| format!("creating kind cluster {name}"))?;
    }
    let bin = crate::provider::local::binaries(false).await?;
    for c in &env.clusters {
        let client = env.client(&c.name).await?;
        let node = node_name(&kind_name(env, &c.name));
        keep_to_the_kind_node(&client, &node)
            .await
            .with_context(|| format!("cluster {}: tainting kind node {node}", c.name))?;
        system_workloads_on_the_kind_node(&client)
            .await
            .with_context(|| {
                format!(
                    "cluster {}: moving kind's own workloads to kind node {node}",
                    c.name
                )
            })?;
        start_kwok(env, c, &bin.join("kwok"))
            .with_context(|| format!("cluster {}: starting its KWOK controller", c.name))?;
    }
    Ok(())
}

/// `up --provider kind --real-nodes`, once the clusters run: the hub and the agents as
/// Pods on the kind nodes, from deploy/ and `flotilla-hub join`, as real-node mode
/// installs them ([`crate::provider::realnode::pods`]). `start` is when `up` began.
pub async fn install_pods(env: &Env, start: std::time::Instant) -> Result<()> {
    let bin = crate::provider::local::binaries(false).await?;
    crate::provider::realnode::pods::up(env, &bin)
        .await
        .context("installing flotilla-hub and the agents as Pods on the kind nodes")?;
    eprintln!(
        "flotilla-e2e: environment up in {:.1}s, hub and agents as Pods on kind ({})",
        start.elapsed().as_secs_f64(),
        env.dir.display()
    );
    Ok(())
}

/// Labels, taints and cordons the kind node (server-side apply, so a second `up` changes
/// nothing): only what tolerates the taint and selects the label runs there.
async fn keep_to_the_kind_node(client: &Client, node: &str) -> Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    let patch = serde_json::json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {
            "name": node, "labels": {REAL_NODE_KEY: "true"},
        },
        "spec": {
            "unschedulable": true,
            "taints": [{"key": REAL_NODE_KEY, "value": "true", "effect": "NoSchedule"}],
        },
    });
    api.patch(
        node,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .with_context(|| format!("applying the label, taint and cordon to node {node}"))?;
    let got = api.get(node).await?;
    let taints: &[Taint] = got
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default();
    ensure!(
        taints
            .iter()
            .any(|t| t.key == REAL_NODE_KEY && t.effect == "NoSchedule"),
        "node {node} does not carry the taint {REAL_NODE_KEY} after the patch: {taints:?}"
    );
    Ok(())
}

/// Whether `tolerations` tolerate a `NoSchedule` taint with `key`.
fn tolerates(tolerations: &[Toleration], key: &str) -> bool {
    tolerations.iter().any(|t| {
        let effect_ok = t.effect.as_deref().is_none_or(|e| e == "NoSchedule");
        let key_ok = match t.key.as_deref() {
            None | Some("") => t.operator.as_deref() == Some("Exists"),
            Some(k) => k == key,
        };
        effect_ok && key_ok
    })
}

/// The pod template patch that keeps a workload of kind's on the kind node: its
/// tolerations plus the real-node taint's (and, for a Deployment, the cordon's), and a
/// nodeSelector on the real-node label. `None` if it has them already.
fn pin_patch(
    tolerations: &[Toleration],
    node_selector: Option<&BTreeMap<String, String>>,
    cordoned_too: bool,
) -> Option<serde_json::Value> {
    let mut all = tolerations.to_vec();
    let mut keys = vec![REAL_NODE_KEY];
    if cordoned_too {
        keys.push(UNSCHEDULABLE_TAINT);
    }
    for key in keys {
        if !tolerates(&all, key) {
            all.push(Toleration {
                key: Some(key.to_string()),
                operator: Some("Exists".to_string()),
                effect: Some("NoSchedule".to_string()),
                ..Default::default()
            });
        }
    }
    let selected =
        node_selector.is_some_and(|s| s.get(REAL_NODE_KEY).map(String::as_str) == Some("true"));
    if all.len() == tolerations.len() && selected {
        return None;
    }
    let mut selector = node_selector.cloned().unwrap_or_default();
    selector.insert(REAL_NODE_KEY.to_string(), "true".to_string());
    // A merge patch: the tolerations list is replaced whole (it holds the old ones too).
    Some(serde_json::json!({"spec": {"template": {"spec": {
        "tolerations": all, "nodeSelector": selector,
    }}}}))
}

/// Patches each workload in `api` whose Pod template lacks the kind node's tolerations
/// or nodeSelector (see [`pin_patch`]).
async fn pin_all<K>(
    api: &Api<K>,
    pod_spec: impl Fn(&K) -> Option<&PodSpec>,
    cordoned_too: bool,
) -> Result<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    K::DynamicType: Default,
{
    for w in api.list(&ListParams::default()).await? {
        let spec = pod_spec(&w);
        let tolerations = spec
            .and_then(|s| s.tolerations.as_deref())
            .unwrap_or_default();
        let selector = spec.and_then(|s| s.node_selector.as_ref());
        if let Some(patch) = pin_patch(tolerations, selector, cordoned_too) {
            let (kind, name) = (K::kind(&Default::default()).into_owned(), w.name_any());
            let ns = w.namespace().unwrap_or_default();
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .with_context(|| format!("patching {kind} {ns}/{name}"))?;
        }
    }
    Ok(())
}

/// Gives every Deployment and DaemonSet of kind's (kube-system, local-path-storage) the
/// toleration and nodeSelector of the kind node, then waits until each has rolled out.
async fn system_workloads_on_the_kind_node(client: &Client) -> Result<()> {
    for ns in SYSTEM_NAMESPACES {
        let deployments = Api::<Deployment>::namespaced(client.clone(), ns);
        pin_all(
            &deployments,
            |d| d.spec.as_ref()?.template.spec.as_ref(),
            true,
        )
        .await?;
        let daemonsets = Api::<DaemonSet>::namespaced(client.clone(), ns);
        pin_all(
            &daemonsets,
            |d| d.spec.as_ref()?.template.spec.as_ref(),
            false,
        )
        .await?;
    }
    for ns in SYSTEM_NAMESPACES {
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
        let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), ns);
        let what = format!("kind's Deployments and DaemonSets in {ns} rolled out on the kind node");
        wait_for(ROLLOUT_TIMEOUT, &what, || async {
            let mut pending = Vec::new();
            for d in deployments.list(&ListParams::default()).await? {
                if !deployment_rolled_out(&d) {
                    pending.push(format!("Deployment {}: {:?}", d.name_any(), d.status));
                }
            }
            for d in daemonsets.list(&ListParams::default()).await? {
                if !daemonset_rolled_out(&d) {
                    pending.push(format!("DaemonSet {}: {:?}", d.name_any(), d.status));
                }
            }
            Ok(pending.is_empty().then_some(()))
        })
        .await?;
    }
    Ok(())
}

fn deployment_rolled_out(d: &Deployment) -> bool {
    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let generation = d.metadata.generation.unwrap_or(0);
    d.status.as_ref().is_some_and(|s| {
        s.observed_generation.unwrap_or(0) >= generation
            && s.updated_replicas.unwrap_or(0) == want
            && s.ready_replicas.unwrap_or(0) == want
            && s.replicas.unwrap_or(0) == want
    })
}

fn daemonset_rolled_out(d: &DaemonSet) -> bool {
    let generation = d.metadata.generation.unwrap_or(0);
    d.status.as_ref().is_some_and(|s| {
        s.observed_generation.unwrap_or(0) >= generation
            && s.desired_number_scheduled >= 1
            && s.updated_number_scheduled.unwrap_or(0) == s.desired_number_scheduled
            && s.number_ready == s.desired_number_scheduled
            && s.current_number_scheduled == s.desired_number_scheduled
    })
}

/// Starts the KWOK controller of `cluster` (unless it runs already): a host process
/// against the cluster's apiserver, managing the nodes labelled `type=kwok` only, as
/// kwokctl runs it for real-node mode.
fn start_kwok(env: &Env, cluster: &ClusterState, kwok: &Path) -> Result<()> {
    let name = kwok_process(&cluster.name);
    let running = crate::process::records(&env.dir)?
        .into_iter()
        .any(|r| r.name == name && r.alive());
    if running {
        return Ok(());
    }
    let mut cmd = std::process::Command::new(kwok);
    cmd.args(kwok_args(&cluster.kubeconfig));
    env.spawn(&name, &mut cmd)?;
    Ok(())
}

fn kwok_args(kubeconfig: &Path) -> Vec<String> {
    vec![
        format!("--kubeconfig={}", kubeconfig.display()),
        "--manage-all-nodes=false".to_string(),
        format!(
            "--manage-nodes-with-label-selector={}={}",
            FAKE_NODE_LABEL.0, FAKE_NODE_LABEL.1
        ),
        "--node-lease-duration-seconds=40".to_string(),
    ]
}

pub async fn down(env: &Env) -> Result<()> {
    let existing = kind_clusters().await?;
    for c in &env.clusters {
        let name = kind_name(env, &c.name);
        // The node's volumes (kind's anonymous `/var`), to check that they went with it.
        let label = format!("label=io.x-k8s.kind.cluster={name}");
        let containers = docker(&["ps", "-aq", "-f", &label]).await?;
        let mut volumes = Vec::new();
        for id in containers.split_whitespace() {
            let names = docker(&[
                "inspect",
                "-f",
                "{{range .Mounts}}{{if .Name}}{{.Name}} {{end}}{{end}}",
                id,
            ])
            .await?;
            volumes.extend(names.split_whitespace().map(String::from));
        }
        if existing.contains(&name) {
            let kubeconfig = c.kubeconfig.to_string_lossy().into_owned();
            kind(&[
                "delete",
                "cluster",
                "--name",
                &name,
                "--kubeconfig",
                &kubeconfig,
            ])
            .await
            .with_context(|| format!("cluster {}: deleting kind cluster {name}", c.name))?;
        }
        let left = docker(&["ps", "-aq", "-f", &label]).await?;
        ensure!(
            left.trim().is_empty(),
            "cluster {}: containers of kind cluster {name} left after `kind delete cluster`: {}",
            c.name,
            left.split_whitespace().collect::<Vec<_>>().join(" ")
        );
        let all = docker(&["volume", "ls", "-q"]).await?;
        let kept: Vec<&String> = volumes
            .iter()
            .filter(|v| all.lines().any(|l| l.trim() == v.as_str()))
            .collect();
        ensure!(
            kept.is_empty(),
            "cluster {}: volumes of kind cluster {name} left after `kind delete cluster`: {kept:?}",
            c.name
        );
    }
    // Clusters a test made for itself (`create_extra`), left by a test that was stopped.
    let prefix = kind_name(env, "");
    for name in existing.iter().map(String::as_str) {
        let ours = env.clusters.iter().any(|c| kind_name(env, &c.name) == name);
        if name.starts_with(&prefix) && !ours {
            kind(&["delete", "cluster", "--name", name])
                .await
                .with_context(|| format!("deleting kind cluster {name}"))?;
        }
    }
    remove_network_if_unused().await?;
    remove(&env.dir.join("kind.yaml"))
}

/// kind's Docker network, which `kind delete cluster` keeps for the next cluster.
const NETWORK: &str = "kind";

/// The IPv4 gateway of the `kind` network: the host's address as the nodes (and so the
/// apiservers, static Pods on the host network of their node) reach it.
pub fn gateway() -> Result<String> {
    let out = std::process::Command::new("docker")
        .args([
            "network",
            "inspect",
            NETWORK,
            "-f",
            "{{range .IPAM.Config}}{{.Gateway}} {{end}}",
        ])
        .stdin(Stdio::null())
        .output()
        .context("running `docker network inspect kind` (is Docker installed?)")?;
    if !out.status.success() {
        bail!(
            "`docker network inspect {NETWORK}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .split_whitespace()
        .find(|a| a.parse::<std::net::Ipv4Addr>().is_ok())
        .map(String::from)
        .with_context(|| format!("Docker network {NETWORK} has no IPv4 gateway: {stdout:?}"))
}

/// Removes the `kind` network (its bridge and iptables rules) when no container is
/// attached to it any more: clusters of other environments keep it.
async fn remove_network_if_unused() -> Result<()> {
    let filter = format!("name=^{NETWORK}$");
    if docker(&["network", "ls", "-q", "-f", &filter])
        .await?
        .trim()
        .is_empty()
    {
        return Ok(());
    }
    let users = docker(&["ps", "-aq", "-f", &format!("network={NETWORK}")]).await?;
    if !users.trim().is_empty() {
        eprintln!(
            "flotilla-e2e: Docker network {NETWORK} kept: containers {} use it",
            users.split_whitespace().collect::<Vec<_>>().join(" ")
        );
        return Ok(());
    }
    docker(&["network", "rm", NETWORK])
        .await
        .with_context(|| format!("removing Docker network {NETWORK}"))?;
    Ok(())
}

async fn docker(args: &[&str]) -> Result<String> {
    let out = tokio::process::Command::new("docker")
        .args(args)
        .kill_on_drop(true)
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("running `docker {}` (is Docker installed?)", args.join(" ")))?;
    stdout_of(format_args!("`docker {}`", args.join(" ")), out)
}

fn remove(p: &Path) -> Result<()> {
    match std::fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", p.display()))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_config_listens_on_loopback_at_a_random_port() {
        let v: serde_yaml::Value = serde_yaml::from_str(&kind_config()).unwrap();
        assert_eq!(v["kind"], "Cluster");
        assert_eq!(v["apiVersion"], "kind.x-k8s.io/v1alpha4");
        assert_eq!(v["networking"]["apiServerAddress"], "127.0.0.1");
        assert_eq!(v["networking"]["apiServerPort"], 0);
    }

    fn env_in(dir: &str) -> Env {
        Env {
            real_nodes: false,
            dir: dir.into(),
            provider: crate::Provider::Kind,
            clusters: vec![ClusterState {
                name: "cluster1".into(),
                role: crate::Role::Member,
                kubeconfig: format!("{dir}/kubeconfigs/cluster1.yaml").into(),
                components: vec![],
            }],
        }
    }

    #[test]
    fn create_args_name_the_cluster_by_state_dir_and_write_its_kubeconfig() {
        let env = env_in("/state/a");
        let c = &env.clusters[0];
        let args = create_args(&env, c, Path::new("/state/a/kind.yaml"), "");
        let name = kind_name(&env, "cluster1");
        assert_eq!(
            args,
            [
                "create",
                "cluster",
                "--name",
                &name,
                "--kubeconfig",
                "/state/a/kubeconfigs/cluster1.yaml",
                "--config",
                "/state/a/kind.yaml",
                "--wait",
                "180s"
            ]
        );
        assert!(
            name.starts_with("flotilla-") && name.ends_with("-cluster1"),
            "{name}"
        );
        // Another state dir, another Docker-global name: two environments coexist.
        assert_ne!(kind_name(&env_in("/state/b"), "cluster1"), name);
        let pinned = create_args(&env, c, Path::new("/k.yaml"), "kindest/node:v1.34.0");
        assert_eq!(
            pinned[pinned.len() - 2..],
            ["--image", "kindest/node:v1.34.0"]
        );
    }

    #[test]
    fn kind_workloads_get_the_toleration_and_selector_once() {
        let control_plane = Toleration {
            key: Some("node-role.kubernetes.io/control-plane".into()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Default::default()
        };
        let patch = pin_patch(std::slice::from_ref(&control_plane), None, true).unwrap();
        let spec = &patch["spec"]["template"]["spec"];
        let tolerations: Vec<Toleration> =
            serde_json::from_value(spec["tolerations"].clone()).unwrap();
        assert_eq!(tolerations[0], control_plane, "the old ones are kept");
        assert!(tolerates(&tolerations, REAL_NODE_KEY));
        assert!(tolerates(&tolerations, UNSCHEDULABLE_TAINT));
        assert_eq!(spec["nodeSelector"][REAL_NODE_KEY], "true");
        let selector = BTreeMap::from([(REAL_NODE_KEY.to_string(), "true".to_string())]);
        assert_eq!(pin_patch(&tolerations, Some(&selector), true), None);
        // A DaemonSet that tolerates every taint only needs the selector.
        let all = Toleration {
            operator: Some("Exists".into()),
            ..Default::default()
        };
        let patch = pin_patch(std::slice::from_ref(&all), None, false).unwrap();
        assert_eq!(
            patch["spec"]["template"]["spec"]["tolerations"],
            serde_json::json!([all])
        );
        assert!(!tolerates(&[control_plane], REAL_NODE_KEY));
    }

    #[test]
    fn kwok_manages_the_fake_nodes_only() {
        let args = kwok_args(Path::new("/state/kubeconfigs/cluster1.yaml"));
        assert!(args.contains(&"--manage-all-nodes=false".to_string()));
        assert!(args.contains(&"--manage-nodes-with-label-selector=type=kwok".to_string()));
        assert!(args.contains(&"--kubeconfig=/state/kubeconfigs/cluster1.yaml".to_string()));
    }

    #[test]
    fn fnv1a_is_the_reference_function() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
