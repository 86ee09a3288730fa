//! The kind provider, for users with Docker: one `kind create cluster` per cluster, same
//! state dir, same kubeconfig paths, so the suite cannot tell the providers apart.
//!
//! kind clusters have a real node (kubelet + containerd), so Deployments get real pods and
//! no KWOK controller is needed. The suite's Deployments run `registry.k8s.io/pause`,
//! which kind node images usually carry already (else the kubelet pulls it).
//!
//! Not run on our own machines (no Docker engine there): kept small and plain.

use crate::env::{ClusterState, Env};
use anyhow::{Context, Result, bail};
use std::path::Path;
use std::process::Stdio;

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

pub async fn up(env: &mut Env) -> Result<()> {
    let config = env.dir.join("kind.yaml");
    std::fs::write(&config, kind_config())?;
    let existing = kind(&["get", "clusters"]).await?;
    let image = std::env::var("FLOTILLA_KIND_IMAGE").unwrap_or_default();
    for c in &env.clusters {
        let name = kind_name(env, &c.name);
        if existing.lines().any(|l| l.trim() == name) {
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
    Ok(())
}

pub async fn down(env: &Env) -> Result<()> {
    let existing = kind(&["get", "clusters"]).await?;
    for c in &env.clusters {
        let name = kind_name(env, &c.name);
        if existing.lines().any(|l| l.trim() == name) {
            let kubeconfig = c.kubeconfig.to_string_lossy().into_owned();
            kind(&[
                "delete",
                "cluster",
                "--name",
                &name,
                "--kubeconfig",
                &kubeconfig,
            ])
            .await?;
        }
    }
    remove(&env.dir.join("kind.yaml"))
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
    fn fnv1a_is_the_reference_function() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
