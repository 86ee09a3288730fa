//! Flotilla in real-node mode: the hub and the agents as Pods, installed as a user
//! installs them, from `deploy/` and from what `flotilla-hub join` prints.
//!
//! 1. Images: `flotilla-hub` and `flotilla-agent` built static (`--release --target
//!    x86_64-unknown-linux-musl`, as `deploy/Dockerfile` builds them; or taken from
//!    `$FLOTILLA_IMAGE_BIN_DIR`), stripped, laid out as the Dockerfile lays them out
//!    ([`super::oci`]) and imported into the nodes' containerd (the hub's into the host's
//!    node, the agent's into the members'). Tagged `e2e-<hash of the binary>`, so that a
//!    changed binary is a new image and a rollout.
//! 2. The hub: `kubectl apply -k` of an overlay written under the state dir over
//!    `deploy/overlays/hub-nodeport` (deploy/hub, gRPC on NodePort 30743), which changes
//!    only the image tag and puts the hub Pods on the real node (a toleration of
//!    `flotilla.io/real-node` and a nodeSelector on it: the only difference from a user's
//!    install, and the reason the taint keeps the MyApps' pods off that node). Its serving
//!    certificate comes from `flotilla-hub certs`, naming the host node's address, and goes
//!    into the Secret `flotilla-hub-tls` as docs/install.md says.
//! 3. Each member: `flotilla-hub join NAME --hub-address <host node>:30743 --agent-image
//!    ... -o NAME.yaml`, applied with the same toleration and nodeSelector (a kustomize
//!    overlay over that file), so the agent dials the hub through the host's Service.
//!
//! On kind (`up --provider kind --real-nodes`) the same install runs on each cluster's kind
//! node, which kind.rs labels and taints as a real node and also cordons: the images go in
//! with `kind load image-archive`, the hub address is the host's kind node on the `kind`
//! network, and the overlays add a toleration of the cordon (`node.kubernetes.io/
//! unschedulable`), so that the node stays out of the scheduling suite's capacity counts
//! and only the Pods that tolerate it land there. [`Nodes`] holds those differences.
//!
//! `up` then waits until both hub Pods are Ready, one of them leads (label
//! `flotilla.io/leader=true`), every agent is Ready and every MemberCluster is Ready. When
//! a Pod does not become Ready it fails with `kubectl describe pod` of the Pods concerned.

use super::{self as realnode, REAL_NODE_KEY};
use crate::env::Env;
use crate::federation::{HUB_NAMESPACE, REGION, flotilla_binaries, region_of, wait_member_ready};
use crate::hubcli::HubCli;
use crate::support::{cargo_binaries_with, stdout_of, workspace_root};
use anyhow::{Context, Result, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Static binaries for the images are taken from here when set.
pub const IMAGE_BIN_DIR_VAR: &str = "FLOTILLA_IMAGE_BIN_DIR";
/// The target the images' binaries are built for (no libc in the image).
pub const IMAGE_TARGET: &str = "x86_64-unknown-linux-musl";
/// deploy/components/hub-nodeport's port.
pub const HUB_NODE_PORT: u16 = 30743;
const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// The taint a cordoned node carries: kind's nodes are cordoned (see kind.rs).
const UNSCHEDULABLE_TAINT: &str = "node.kubernetes.io/unschedulable";

/// The nodes the Pods run on: what differs between real-node mode and kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nodes {
    /// Real-node mode's nodes (`realnode`), on the local provider.
    Real,
    /// Each kind cluster's node, tainted and cordoned by kind.rs.
    Kind,
}

impl Nodes {
    pub fn of(env: &Env) -> Nodes {
        match env.provider {
            crate::Provider::Local => Nodes::Real,
            crate::Provider::Kind => Nodes::Kind,
        }
    }

    /// The taints the Pods must tolerate (`NoSchedule`, operator `Exists`).
    pub fn taints(self) -> &'static [&'static str] {
        match self {
            Nodes::Real => &[REAL_NODE_KEY],
            Nodes::Kind => &[REAL_NODE_KEY, UNSCHEDULABLE_TAINT],
        }
    }
}

/// The name of the node the Pods of `cluster` run on.
pub fn node_name(env: &Env, cluster: &str) -> String {
    match Nodes::of(env) {
        Nodes::Real => realnode::NODE_NAME.to_string(),
        Nodes::Kind => {
            crate::provider::kind::node_name(&crate::provider::kind::kind_name(env, cluster))
        }
    }
}

/// Puts the image in OCI archive `archive` into the node of `cluster`: `ctr images import`
/// on a real node, `kind load image-archive` on kind.
pub async fn load(env: &Env, cluster: &str, archive: &Path) -> Result<()> {
    match Nodes::of(env) {
        Nodes::Real => {
            realnode::import(&realnode::nodes_dir(&env.dir).join(cluster), archive).await
        }
        Nodes::Kind => {
            let name = crate::provider::kind::kind_name(env, cluster);
            crate::provider::kind::load_image(&name, archive).await
        }
    }
}

/// The address the agents dial the hub at: the host's node, NodePort 30743.
fn hub_address(env: &Env, host: usize) -> Result<String> {
    let ip = match Nodes::of(env) {
        Nodes::Real => realnode::network(&env.dir)?.node_ip(host),
        Nodes::Kind => crate::provider::kind::node_address(&crate::provider::kind::kind_name(
            env,
            &env.clusters[host].name,
        ))?,
    };
    Ok(format!("{ip}:{HUB_NODE_PORT}"))
}

/// The images' references, as the manifests name them (`flotilla-hub:e2e-...`).
#[derive(Debug, Clone)]
pub struct Images {
    pub hub: String,
    pub agent: String,
}

fn install_dir(env: &Env) -> PathBuf {
    realnode::images_dir(&env.dir)
        .parent()
        .unwrap_or(&env.dir)
        .join("install")
}

/// The static binaries the images carry: `$FLOTILLA_IMAGE_BIN_DIR`'s, or built by cargo.
fn static_binaries() -> Result<BTreeMap<String, PathBuf>> {
    let wanted = [
        ("flotilla-hub", "flotilla-hub"),
        ("flotilla-agent", "flotilla-agent"),
    ];
    if let Some(dir) = std::env::var_os(IMAGE_BIN_DIR_VAR).filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        return Ok(wanted
            .iter()
            .map(|(_, b)| (b.to_string(), dir.join(b)))
            .collect());
    }
    eprintln!(
        "flotilla-e2e: building the images' static binaries (cargo build --release --target {IMAGE_TARGET})"
    );
    cargo_binaries_with(
        &wanted,
        &["--release", "--locked", "--target", IMAGE_TARGET],
    )
}

/// Builds both images (OCI archives under the state dir) and imports them into the nodes.
pub async fn images(env: &Env) -> Result<Images> {
    let bins = static_binaries()?;
    let dir = realnode::images_dir(&env.dir);
    std::fs::create_dir_all(&dir)?;
    let mut refs = BTreeMap::new();
    for component in ["hub", "agent"] {
        let name = format!("flotilla-{component}");
        let src = &bins[&name];
        // Stripped: the release profile keeps line tables (150 MB); the image needs none.
        let bin = dir.join(&name);
        std::fs::copy(src, &bin).with_context(|| format!("copying {}", src.display()))?;
        let strip = Command::new("strip").arg(&bin).status();
        if !strip.is_ok_and(|s| s.success()) {
            eprintln!(
                "flotilla-e2e: could not strip {} (kept as built)",
                bin.display()
            );
        }
        let hash = hex::encode(Sha256::digest(std::fs::read(&bin)?));
        let tag = format!("e2e-{}", &hash[..12]);
        let spec = super::oci::flotilla_image(component, &bin, &tag);
        let archive = dir.join(format!("{name}.tar"));
        super::oci::write_archive(&spec, &archive)?;
        for c in &env.clusters {
            let wanted = match component {
                "hub" => c.role == crate::Role::Host,
                _ => c.role == crate::Role::Member,
            };
            if wanted {
                load(env, &c.name, &archive)
                    .await
                    .with_context(|| format!("importing {name} into {}", c.name))?;
            }
        }
        refs.insert(component, format!("{name}:{tag}"));
    }
    Ok(Images {
        hub: refs["hub"].clone(),
        agent: refs["agent"].clone(),
    })
}

/// The tolerations and nodeSelector that put a Deployment's Pods on the real node.
fn real_node_patch(deployment: &str, nodes: Nodes) -> String {
    let tolerations: Vec<String> = nodes
        .taints()
        .iter()
        .map(|key| format!("{{key: {key}, operator: Exists, effect: NoSchedule}}"))
        .collect();
    format!(
        "- target: {{kind: Deployment, name: {deployment}}}\n\
        \x20 patch: |-\n\
        \x20   - op: add\n\
        \x20     path: /spec/template/spec/tolerations\n\
        \x20     value: [{tolerations}]\n\
        \x20   - op: add\n\
        \x20     path: /spec/template/spec/nodeSelector\n\
        \x20     value: {{{REAL_NODE_KEY}: \"true\"}}\n",
        tolerations = tolerations.join(", ")
    )
}

/// The e2e's overlay of the hub: `deploy/overlays/hub-nodeport`, its image tag, the real node.
fn hub_kustomization(base: &Path, image_tag: &str, nodes: Nodes) -> String {
    format!(
        "# Written by flotilla-e2e: deploy/overlays/hub-nodeport on the host's real node.\n\
         apiVersion: kustomize.config.k8s.io/v1beta1\n\
         kind: Kustomization\n\
         resources:\n\
         - {base}\n\
         images:\n\
         - name: flotilla-hub\n\
        \x20 newTag: {image_tag}\n\
         patches:\n\
         {patch}",
        base = base.display(),
        patch = real_node_patch("flotilla-hub", nodes),
    )
}

/// The e2e's overlay of a member's install (`join.yaml`, as `flotilla-hub join` wrote it).
fn member_kustomization(nodes: Nodes) -> String {
    format!(
        "# Written by flotilla-e2e: the install `flotilla-hub join` printed, on the real node.\n\
         apiVersion: kustomize.config.k8s.io/v1beta1\n\
         kind: Kustomization\n\
         resources:\n\
         - join.yaml\n\
         patches:\n\
         {}",
        real_node_patch("flotilla-agent", nodes)
    )
}

fn kubectl(bin: &Path, kubeconfig: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new(bin.join("kubectl"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .context("running kubectl")?;
    stdout_of(format_args!("kubectl {}", args.join(" ")), out)
}

/// `kubectl describe pod` of the Pods of `namespace` matching `selector`: what a failure shows.
pub fn describe_pods(bin: &Path, kubeconfig: &Path, namespace: &str, selector: &str) -> String {
    kubectl(
        bin,
        kubeconfig,
        &["-n", namespace, "describe", "pod", "-l", selector],
    )
    .unwrap_or_else(|e| format!("(kubectl describe failed: {e:#})"))
}

/// Waits until Deployment `name` has `replicas` ready Pods; on timeout, fails with
/// `kubectl describe pod` of its Pods.
async fn wait_deployment(
    env: &Env,
    bin: &Path,
    cluster: &str,
    name: &str,
    replicas: i32,
) -> Result<()> {
    let client = env.client(cluster).await?;
    let deployments: Api<Deployment> = Api::namespaced(client, HUB_NAMESPACE);
    let ready = |d: Option<&Deployment>| {
        let ready = d.and_then(|d| d.status.as_ref()?.ready_replicas);
        ready.unwrap_or(0) >= replicas
    };
    let what = format!("{replicas} ready Pod(s) of {HUB_NAMESPACE}/{name} in {cluster}");
    let waited = crate::await_object(&deployments, name, READY_TIMEOUT, &what, ready).await;
    if let Err(e) = waited {
        let describe = describe_pods(
            bin,
            env.kubeconfig(cluster)?,
            HUB_NAMESPACE,
            &format!("app.kubernetes.io/name={name}"),
        );
        bail!("{e:#}\n--- kubectl describe pod ---\n{describe}");
    }
    Ok(())
}

/// The Secret the hub serves with (docs/install.md names it).
pub const HUB_TLS_SECRET: &str = "flotilla-hub-tls";

/// The Secret [`HUB_TLS_SECRET`] in `namespace`, from the `ca.crt`, `tls.crt` and `tls.key`
/// that `flotilla-hub certs --out dir` wrote.
pub fn hub_tls_secret(dir: &Path, namespace: &str) -> Result<Secret> {
    let mut data = BTreeMap::new();
    for f in ["ca.crt", "tls.crt", "tls.key"] {
        data.insert(
            f.to_string(),
            k8s_openapi::ByteString(std::fs::read(dir.join(f))?),
        );
    }
    Ok(Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(HUB_TLS_SECRET.into()),
            namespace: Some(namespace.into()),
            ..Default::default()
        },
        data: Some(data),
        ..Default::default()
    })
}

/// Installs the hub on the host and an agent on every member, as Pods on the real nodes,
/// and waits until all of them are Ready and every member is Ready on the host.
pub async fn up(env: &Env, bin: &Path) -> Result<()> {
    let images = images(env).await?;
    let dir = install_dir(env);
    let host = env
        .clusters
        .iter()
        .enumerate()
        .find(|(_, c)| c.role == crate::Role::Host)
        .context("no host cluster")?;
    let host_kubeconfig = env.kubeconfig(&host.1.name)?;
    let nodes = Nodes::of(env);
    let hub_address = hub_address(env, host.0)?;

    // The hub.
    let hub_dir = dir.join("hub");
    std::fs::create_dir_all(&hub_dir)?;
    let tag = images
        .hub
        .rsplit_once(':')
        .map_or("latest", |(_, t)| t)
        .to_string();
    let base = workspace_root()
        .join("deploy")
        .join("overlays")
        .join("hub-nodeport");
    // kustomize takes bases by relative path only ("new root cannot be absolute").
    let relative = pathdiff::diff_paths(&base, hub_dir.canonicalize()?)
        .with_context(|| format!("{} relative to {}", base.display(), hub_dir.display()))?;
    std::fs::write(
        hub_dir.join("kustomization.yaml"),
        hub_kustomization(&relative, &tag, nodes),
    )?;
    let cli_bin = flotilla_binaries(&["flotilla-hub"])?;
    let cli = HubCli {
        program: cli_bin["flotilla-hub"].clone(),
        kubeconfig: host_kubeconfig.to_path_buf(),
    };
    let tls = dir.join("hub-tls");
    if !tls.join("tls.key").exists() {
        let (ip, _) = hub_address.split_once(':').unwrap_or_default();
        let out = tls.to_string_lossy().into_owned();
        cli.run(&[
            "certs",
            "--out",
            &out,
            "--san",
            ip,
            "--san",
            "flotilla-hub.flotilla-system.svc",
            "--san",
            "localhost",
            "--san",
            "127.0.0.1",
        ])?;
    }
    kubectl(
        bin,
        host_kubeconfig,
        &["apply", "-k", &hub_dir.to_string_lossy()],
    )
    .context("installing the hub (kubectl apply -k)")?;
    let secret = hub_tls_secret(&tls, HUB_NAMESPACE)?;
    let host_client = env.client(&host.1.name).await?;
    Api::<Secret>::namespaced(host_client.clone(), HUB_NAMESPACE)
        .patch(
            HUB_TLS_SECRET,
            &PatchParams::apply(crate::cluster::FIELD_MANAGER).force(),
            &Patch::Apply(&secret),
        )
        .await
        .with_context(|| format!("creating the Secret {HUB_TLS_SECRET}"))?;
    wait_deployment(env, bin, &host.1.name, "flotilla-hub", 2).await?;
    let pods: Api<Pod> = Api::namespaced(host_client.clone(), HUB_NAMESPACE);
    crate::wait_for(READY_TIMEOUT, "a leading hub Pod", || async {
        let leaders = pods
            .list(&ListParams::default().labels("flotilla.io/leader=true"))
            .await?;
        Ok((!leaders.items.is_empty()).then_some(()))
    })
    .await?;

    // The agents.
    let members: Api<flotilla_crds::MemberCluster> = Api::all(host_client.clone());
    for c in env
        .clusters
        .iter()
        .filter(|c| c.role == crate::Role::Member)
    {
        let member_dir = dir.join(&c.name);
        std::fs::create_dir_all(&member_dir)?;
        let join = member_dir.join("join.yaml");
        let region = format!("{REGION}={}", region_of(&c.name));
        let join_path = join.to_string_lossy().into_owned();
        let mut args = vec![
            "join",
            &c.name,
            "--label",
            &region,
            "--hub-address",
            &hub_address,
            "--agent-image",
            &images.agent,
            "-o",
            &join_path,
        ];
        if members.get_opt(&c.name).await?.is_some() {
            args.push("--rotate");
        }
        if join.exists() {
            std::fs::remove_file(&join)?;
        }
        cli.run(&args)?;
        std::fs::write(
            member_dir.join("kustomization.yaml"),
            member_kustomization(nodes),
        )?;
        kubectl(
            bin,
            env.kubeconfig(&c.name)?,
            &["apply", "-k", &member_dir.to_string_lossy()],
        )
        .with_context(|| format!("installing the agent of {}", c.name))?;
    }
    for c in env
        .clusters
        .iter()
        .filter(|c| c.role == crate::Role::Member)
    {
        wait_deployment(env, bin, &c.name, "flotilla-agent", 1).await?;
        wait_member_ready(&host_client, &c.name, true, READY_TIMEOUT).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlays_put_the_pods_on_the_real_node_and_nothing_else() {
        let k: serde_yaml::Value = serde_yaml::from_str(&hub_kustomization(
            Path::new("/repo/deploy/overlays/hub-nodeport"),
            "e2e-abc",
            Nodes::Real,
        ))
        .unwrap();
        assert_eq!(k["resources"][0], "/repo/deploy/overlays/hub-nodeport");
        assert_eq!(k["images"][0]["newTag"], "e2e-abc");
        let patch: serde_yaml::Value =
            serde_yaml::from_str(k["patches"][0]["patch"].as_str().unwrap()).unwrap();
        assert_eq!(patch[0]["value"][0]["key"], REAL_NODE_KEY);
        assert_eq!(patch[1]["value"][REAL_NODE_KEY], "true");
        // The base as kustomize takes it: relative to the overlay's directory.
        let relative = |from: &str, to: &str| pathdiff::diff_paths(to, from).unwrap();
        assert_eq!(
            relative("/e2e/nodes/install/hub", "/repo/deploy/x"),
            Path::new("../../../../repo/deploy/x")
        );
        assert_eq!(
            relative("/repo/target/e2e/i", "/repo/deploy/x"),
            Path::new("../../../deploy/x")
        );
        assert_eq!(patch[0]["value"].as_sequence().unwrap().len(), 1);
        let m: serde_yaml::Value =
            serde_yaml::from_str(&member_kustomization(Nodes::Real)).unwrap();
        assert_eq!(m["resources"][0], "join.yaml");
        assert_eq!(m["patches"][0]["target"]["name"], "flotilla-agent");
    }

    #[test]
    fn on_kind_the_pods_also_tolerate_the_cordon() {
        for k in [
            hub_kustomization(Path::new("../hub-nodeport"), "e2e-abc", Nodes::Kind),
            member_kustomization(Nodes::Kind),
        ] {
            let k: serde_yaml::Value = serde_yaml::from_str(&k).unwrap();
            let patch: serde_yaml::Value =
                serde_yaml::from_str(k["patches"][0]["patch"].as_str().unwrap()).unwrap();
            let keys: Vec<&str> = patch[0]["value"]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|t| {
                    assert_eq!(t["operator"], "Exists");
                    assert_eq!(t["effect"], "NoSchedule");
                    t["key"].as_str().unwrap()
                })
                .collect();
            assert_eq!(keys, [REAL_NODE_KEY, UNSCHEDULABLE_TAINT]);
            assert_eq!(patch[1]["value"][REAL_NODE_KEY], "true");
        }
    }
}
