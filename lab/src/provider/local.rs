//! The local provider: each cluster is a `kwokctl --runtime binary` cluster, i.e. etcd,
//! kube-apiserver, kube-controller-manager, kube-scheduler and kwok-controller running as
//! local processes on 127.0.0.1, from binaries built once by `scripts/build-binaries.sh`.
//!
//! kwokctl's work dir is `<state dir>/kwok` (via `KWOK_WORKDIR`), so environments in
//! different state dirs do not see each other; every component gets a port the OS picked.
//! Teardown does not need kwokctl: it stops the recorded PIDs and removes the work dir.

use crate::env::{ClusterState, Env};
use crate::process::{self, ProcessRecord};
use crate::support::{free_port, workspace_root};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// kwokctl's work dir, inside the state dir.
const KWOK_DIR: &str = "kwok";
/// The Kubernetes version the binaries are built at (kwokctl is told, not left to guess).
const KUBE_VERSION: &str = "v1.34.4";

/// Builds the control-plane binaries if they are not cached yet and returns their
/// directory. Cached, this takes well under a second; cold, many minutes.
/// With `real_nodes`, also kubelet, kube-proxy and pause (built only then).
pub async fn binaries(real_nodes: bool) -> Result<PathBuf> {
    let script = workspace_root()
        .join("lab")
        .join("scripts")
        .join("build-binaries.sh");
    let out = tokio::process::Command::new("bash")
        .arg(&script)
        .env("FLOTILLA_K8S_VERSION", KUBE_VERSION.trim_start_matches('v'))
        .env("FLOTILLA_REAL_NODES", if real_nodes { "1" } else { "" })
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .await
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed ({}); its output is above",
            script.display(),
            out.status
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let dir = PathBuf::from(stdout.lines().last().unwrap_or_default().trim());
    if !dir.join("kwokctl").is_file() {
        bail!(
            "{} printed {:?}, which holds no kwokctl",
            script.display(),
            dir
        );
    }
    Ok(dir)
}

/// The ports of one cluster's components, picked here (see [`free_port`]) rather than by
/// kwokctl, which scans down from 32767 and so hands two environments created at the same
/// time the same ports.
fn free_ports() -> Result<[u16; 6]> {
    let mut ports = [0; 6];
    for p in &mut ports {
        *p = free_port()?;
    }
    Ok(ports)
}

/// What a cluster with a real node (`up --real-nodes`) needs from kwokctl: the apiserver
/// advertised at the environment's bridge (so the `kubernetes` Service sends Pods there,
/// where a forwarder to its loopback port listens: kwokctl's binary runtime assumes
/// loopback everywhere, and a node in its own network namespace cannot reach the host's
/// loopback), the bridge address in its certificate, the apiserver allowed into the
/// kubelet at its InternalIP with kwokctl's admin certificate (logs, exec), webhooks called at their Pods'
/// addresses (the host has no kube-proxy of its own), and the KWOK controller kept off
/// the real node.
pub struct RealNodeBinding {
    /// The host's address on the environment's bridge.
    pub address: String,
    /// kwokctl's PKI dir of the cluster (`<work dir>/clusters/<name>/pki`).
    pub pki: PathBuf,
}

/// The `kubernetes` Service's ClusterIP (the apiserver's default service range is
/// 10.0.0.0/24): Pods dial it, so the apiserver's certificate must name it.
pub const KUBERNETES_SERVICE_IP: &str = "10.0.0.1";

/// kwokctl's configuration for one cluster: the runtime, our binaries (so nothing is
/// downloaded), loopback, and ports.
fn kwokctl_config(bin: &Path, ports: [u16; 6], real: Option<&RealNodeBinding>) -> String {
    let b = bin.display();
    let [apiserver, etcd, etcd_peer, kwok, kcm, scheduler] = ports;
    let mut extra = String::new();
    if let Some(r) = real {
        let pki = r.pki.display();
        let address = &r.address;
        extra = format!(
            "\x20 kubeApiserverCertSANs: [\"{address}\", \"{KUBERNETES_SERVICE_IP}\"]\n\
             componentsPatches:\n\
             - name: kwok-controller\n\
             \x20 extraArgs:\n\
             \x20 - {{key: manage-all-nodes, value: \"false\", override: true}}\n\
             \x20 - {{key: manage-nodes-with-label-selector, value: {label}={value}}}\n\
             - name: kube-apiserver\n\
             \x20 extraArgs:\n\
             \x20 - {{key: advertise-address, value: \"{address}\"}}\n\
             \x20 - {{key: kubelet-client-certificate, value: {pki}/admin.crt}}\n\
             \x20 - {{key: kubelet-client-key, value: {pki}/admin.key}}\n\
             \x20 - {{key: enable-aggregator-routing, value: \"true\"}}\n\
             \x20 - {{key: kubelet-preferred-address-types, value: InternalIP}}\n",
            label = crate::cluster::FAKE_NODE_LABEL.0,
            value = crate::cluster::FAKE_NODE_LABEL.1,
        );
    }
    format!(
        "# Written by flotilla-e2e.\n\
         apiVersion: config.kwok.x-k8s.io/v1alpha1\n\
         kind: KwokctlConfiguration\n\
         options:\n\
        \x20 runtime: binary\n\
        \x20 kubeVersion: {KUBE_VERSION}\n\
        \x20 kubeBinaryPrefix: {b}\n\
        \x20 kubectlBinary: {b}/kubectl\n\
        \x20 etcdBinary: {b}/etcd\n\
        \x20 kwokControllerBinary: {b}/kwok\n\
        \x20 bindAddress: 127.0.0.1\n\
        \x20 kubeApiserverPort: {apiserver}\n\
        \x20 etcdPort: {etcd}\n\
        \x20 etcdPeerPort: {etcd_peer}\n\
        \x20 kwokControllerPort: {kwok}\n\
        \x20 kubeControllerManagerPort: {kcm}\n\
        \x20 kubeSchedulerPort: {scheduler}\n\
         {extra}"
    )
}

/// One cluster created at a time on the whole machine: between picking its ports and its
/// components binding them, no other environment picks.
async fn creation_lock() -> Result<std::fs::File> {
    let cache = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(c) => PathBuf::from(c),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache"),
    };
    let dir = cache.join("flotilla");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("kwokctl-create.lock");
    let file = std::fs::File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)?;
    tokio::task::spawn_blocking(move || file.lock().map(|()| file))
        .await?
        .with_context(|| format!("locking {}", path.display()))
}

pub async fn up(env: &mut Env) -> Result<()> {
    let bin = binaries(env.real_nodes).await?;
    let net = if env.real_nodes {
        let net = crate::provider::realnode::network(&env.dir)?;
        crate::provider::realnode::ensure_bridge(&net)?;
        Some(net)
    } else {
        None
    };
    let workdir = env.dir.join(KWOK_DIR);
    std::fs::create_dir_all(&workdir).with_context(|| format!("creating {}", workdir.display()))?;
    let logs = env.dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    for i in 0..env.clusters.len() {
        let c = &env.clusters[i];
        let log = logs.join(format!("kwokctl-{}.log", c.name));
        let kubeconfig = c.kubeconfig.to_string_lossy().into_owned();
        // kwokctl keeps the configuration of a cluster it made; this one only counts the first time.
        let config = workdir.join(format!("{}.kwokctl.yaml", c.name));
        let lock = creation_lock().await?;
        let real = net.as_ref().map(|n| RealNodeBinding {
            address: n.host_ip(),
            pki: workdir.join("clusters").join(&c.name).join("pki"),
        });
        std::fs::write(&config, kwokctl_config(&bin, free_ports()?, real.as_ref()))?;
        let config = config.to_string_lossy().into_owned();
        let args = [
            "--config",
            &config,
            "create",
            "cluster",
            "--name",
            &c.name,
            "--kubeconfig",
            &kubeconfig,
            "--wait",
            "2m",
        ];
        kwokctl(&bin, &workdir, &args, &log)
            .await
            .with_context(|| format!("creating cluster {}", c.name))?;
        drop(lock);
        let components = components(&workdir, &c.name)?;
        env.clusters[i].components = components;
        env.save()?;
    }
    Ok(())
}

async fn kwokctl(bin: &Path, workdir: &Path, args: &[&str], log: &Path) -> Result<()> {
    let file = std::fs::File::options()
        .create(true)
        .append(true)
        .open(log)?;
    // Our bin dir first on PATH: kwokctl runs `kubectl`, and must find ours.
    let path = match std::env::var_os("PATH") {
        Some(p) => std::env::join_paths(
            std::iter::once(bin.to_path_buf()).chain(std::env::split_paths(&p)),
        )?,
        None => bin.as_os_str().to_owned(),
    };
    let status = tokio::process::Command::new(bin.join("kwokctl"))
        .args(args)
        .env("KWOK_WORKDIR", workdir)
        .env("PATH", path)
        // If `up` is abandoned (Ctrl-C, SIGTERM in `test`), kwokctl must not go on starting things.
        .kill_on_drop(true)
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .status()
        .await
        .context("running kwokctl")?;
    if !status.success() {
        bail!(
            "kwokctl {} failed ({status}); last lines of {}:\n{}",
            args.join(" "),
            log.display(),
            tail(log, 15)
        );
    }
    Ok(())
}

fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The pid file kwokctl keeps for `component` of `cluster` in the environment in `dir`.
pub fn pid_file(dir: &Path, cluster: &str, component: &str) -> PathBuf {
    dir.join(KWOK_DIR)
        .join("clusters")
        .join(cluster)
        .join("pids")
        .join(format!("{component}.pid"))
}

/// The processes kwokctl started for cluster `name`, from its pid files. A PID is only
/// taken if the process runs one of that cluster's binaries, so a stale pid file never
/// points us at an unrelated process.
fn components(workdir: &Path, name: &str) -> Result<Vec<ProcessRecord>> {
    let cluster = workdir.join("clusters").join(name);
    let pids = cluster.join("pids");
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(&pids) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e).with_context(|| format!("listing {}", pids.display())),
    };
    for entry in entries {
        let path = entry?.path();
        let Some(component) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        let Ok(pid) = std::fs::read_to_string(&path)
            .unwrap_or_default()
            .trim()
            .parse::<u32>()
        else {
            continue;
        };
        let program = i32::try_from(pid)
            .ok()
            .and_then(|pid| procfs::process::Process::new(pid).ok()?.cmdline().ok())
            .and_then(|args| args.into_iter().next());
        if !program.is_some_and(|p| Path::new(&p).starts_with(&cluster)) {
            continue;
        }
        let log = cluster.join("logs").join(format!("{component}.log"));
        let record = ProcessRecord::observe(&format!("{name}/{component}"), pid, Some(log));
        if record.alive() {
            out.push(record);
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Stops every control-plane process of the environment by PID, checks that no process
/// mentioning the work dir is left, and removes the work dir.
pub fn down(dir: &Path, state: Option<&Env>) -> Result<()> {
    let workdir = dir.join(KWOK_DIR);
    let mut procs: Vec<ProcessRecord> = state
        .map(|e| {
            e.clusters
                .iter()
                .flat_map(|c: &ClusterState| c.components.clone())
                .collect()
        })
        .unwrap_or_default();
    // Also what the pid files say, for a half-finished `up` that recorded nothing yet.
    if let Ok(entries) = std::fs::read_dir(workdir.join("clusters")) {
        for entry in entries.flatten() {
            if let Some(name) = entry.file_name().to_str() {
                procs.extend(components(&workdir, name)?);
            }
        }
    }
    procs.sort_by_key(|p| p.pid);
    procs.dedup_by_key(|p| p.pid);
    // Clients first, then the apiservers, then etcd: an apiserver whose etcd is gone spends
    // its shutdown retrying etcd instead of exiting.
    let tier = |p: &ProcessRecord| match p.name.rsplit('/').next() {
        Some("etcd") => 2,
        Some("kube-apiserver") => 1,
        _ => 0,
    };
    for t in 0..=2 {
        let group: Vec<ProcessRecord> = procs.iter().filter(|p| tier(p) == t).cloned().collect();
        process::stop_many(&group, Duration::from_secs(15))?;
    }
    let left = process::mentioning(&workdir);
    if !left.is_empty() {
        // Not recorded, yet running from our work dir: ours all the same. Stop them, say so.
        let names: Vec<String> = left
            .iter()
            .map(|p| format!("{} (PID {})", p.name, p.pid))
            .collect();
        eprintln!(
            "flotilla-e2e: stopping unrecorded processes from {}: {}",
            workdir.display(),
            names.join(", ")
        );
        process::stop_many(&left, Duration::from_secs(5))?;
    }
    match std::fs::remove_dir_all(&workdir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing {}", workdir.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_points_kwokctl_at_our_binaries_on_loopback() {
        let yaml = kwokctl_config(Path::new("/cache/bin"), [1, 2, 3, 4, 5, 6], None);
        let v: serde_yaml::Value = serde_yaml::from_str(&yaml).unwrap();
        let o = &v["options"];
        assert_eq!(v["kind"], "KwokctlConfiguration");
        assert_eq!(o["runtime"], "binary");
        assert_eq!(o["kubeBinaryPrefix"], "/cache/bin");
        assert_eq!(o["etcdBinary"], "/cache/bin/etcd");
        assert_eq!(o["kwokControllerBinary"], "/cache/bin/kwok");
        assert_eq!(o["bindAddress"], "127.0.0.1");
        assert_eq!(o["kubeApiserverPort"], 1);
        assert_eq!(o["kubeSchedulerPort"], 6);
        assert!(v.get("componentsPatches").is_none());
    }

    #[test]
    fn real_node_config_advertises_the_bridge_and_keeps_kwok_off_the_real_node() {
        let real = RealNodeBinding {
            address: "10.213.7.1".into(),
            pki: PathBuf::from("/e2e/kwok/clusters/host/pki"),
        };
        let yaml = kwokctl_config(Path::new("/cache/bin"), [1, 2, 3, 4, 5, 6], Some(&real));
        let v: serde_yaml::Value = serde_yaml::from_str(&yaml).unwrap();
        assert_eq!(v["options"]["bindAddress"], "127.0.0.1");
        assert_eq!(v["options"]["kubeApiserverCertSANs"][0], "10.213.7.1");
        assert_eq!(v["options"]["kubeApiserverCertSANs"][1], "10.0.0.1");
        let patches = v["componentsPatches"].as_sequence().unwrap();
        let kwok = &patches[0];
        assert_eq!(kwok["name"], "kwok-controller");
        assert_eq!(kwok["extraArgs"][0]["key"], "manage-all-nodes");
        assert_eq!(kwok["extraArgs"][0]["value"], "false");
        assert_eq!(kwok["extraArgs"][0]["override"], true);
        assert_eq!(kwok["extraArgs"][1]["value"], "type=kwok");
        assert_eq!(patches[1]["extraArgs"][0]["key"], "advertise-address");
        assert_eq!(patches[1]["extraArgs"][0]["value"], "10.213.7.1");
        assert_eq!(
            patches[1]["extraArgs"][1]["value"],
            "/e2e/kwok/clusters/host/pki/admin.crt"
        );
    }

    #[test]
    fn free_ports_differ() {
        let mut ports = free_ports().unwrap().to_vec();
        ports.sort();
        ports.dedup();
        assert_eq!(ports.len(), 6);
    }
}
