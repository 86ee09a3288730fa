//! The kind provider, for users with Docker: one `kind create cluster` per cluster, same
//! state dir, same kubeconfig paths, so the suite cannot tell the providers apart.
//!
//! kind clusters have a real node (kubelet + containerd), so Deployments get real pods and
//! no KWOK controller is needed. The suite's Deployments run `registry.k8s.io/pause`,
//! which kind node images usually carry already (else the kubelet pulls it).
//!
//! Not run on our own machines (no Docker engine there): kept small and plain.

use crate::env::Env;
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

/// The API server listens on 127.0.0.1 at a port Docker picks.
const KIND_CONFIG: &str = "kind: Cluster\n\
                           apiVersion: kind.x-k8s.io/v1alpha4\n\
                           networking:\n  apiServerAddress: \"127.0.0.1\"\n  apiServerPort: 0\n";

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
    std::fs::write(&config, KIND_CONFIG)?;
    let config = config.to_string_lossy().into_owned();
    let existing = kind(&["get", "clusters"]).await?;
    for c in &env.clusters {
        let name = kind_name(env, &c.name);
        let kubeconfig = c.kubeconfig.to_string_lossy().into_owned();
        if existing.lines().any(|l| l.trim() == name) {
            // Idempotent: an existing cluster only gets its kubeconfig written again.
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
        let mut args = vec![
            "create",
            "cluster",
            "--name",
            &name,
            "--kubeconfig",
            &kubeconfig,
        ];
        args.extend(["--config", &config, "--wait", "180s"]);
        let image = std::env::var("FLOTILLA_KIND_IMAGE").unwrap_or_default();
        if !image.is_empty() {
            args.extend(["--image", &image]);
        }
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
        let v: serde_yaml::Value = serde_yaml::from_str(KIND_CONFIG).unwrap();
        assert_eq!(v["apiVersion"], "kind.x-k8s.io/v1alpha4");
        assert_eq!(v["networking"]["apiServerAddress"], "127.0.0.1");
        assert_eq!(v["networking"]["apiServerPort"], 0);
    }

    #[test]
    fn fnv1a_is_the_reference_function() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
