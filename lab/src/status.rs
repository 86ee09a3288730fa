//! `flotilla-e2e status`: what runs, whether each apiserver answers, and how much memory
//! the environment's processes hold.

use crate::env::Env;
use crate::process::{self, ProcessRecord};
use anyhow::Result;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams};
use std::path::Path;
use std::time::Duration;

/// Prints the environment in `dir`; returns whether it is up and healthy.
pub async fn status(dir: &Path) -> Result<bool> {
    let Some(env) = Env::load_state(dir)? else {
        println!("no environment in {}", dir.display());
        return Ok(false);
    };
    println!(
        "environment {} (provider {:?})",
        env.dir.display(),
        env.provider
    );
    let mut healthy = true;
    let mut total_rss = 0;
    for c in &env.clusters {
        let answer = match probe(&env, &c.name).await {
            Ok((version, nodes)) => format!("up, Kubernetes {version}, {nodes} nodes"),
            Err(e) => {
                healthy = false;
                format!("DOWN: {e:#}")
            }
        };
        println!(
            "  {:<10} {}\n  {:<10} kubeconfig {}",
            c.name,
            answer,
            "",
            c.kubeconfig.display()
        );
        for p in &c.components {
            total_rss += print_process(p, &mut healthy);
        }
    }
    if env.real_nodes {
        for node in crate::provider::realnode::nodes(&env.dir) {
            println!("  real node of {}", node.cluster);
            for p in node.all() {
                let p = ProcessRecord {
                    name: format!("{}/{}", node.cluster, p.name),
                    ..p
                };
                total_rss += print_process(&p, &mut healthy);
            }
        }
    }
    let others = process::records(&env.dir)?;
    if !others.is_empty() {
        println!("  processes");
        for p in &others {
            total_rss += print_process(p, &mut healthy);
        }
    }
    if total_rss > 0 {
        println!("  total RSS  {} MiB", total_rss / (1024 * 1024));
    }
    Ok(healthy)
}

fn print_process(p: &ProcessRecord, healthy: &mut bool) -> u64 {
    match p.rss_bytes() {
        Some(rss) => {
            println!(
                "    {:<34} PID {:<8} RSS {:>5} MiB",
                p.name,
                p.pid,
                rss / (1024 * 1024)
            );
            rss
        }
        None => {
            *healthy = false;
            println!("    {:<34} PID {:<8} NOT RUNNING", p.name, p.pid);
            0
        }
    }
}

async fn probe(env: &Env, name: &str) -> Result<(String, usize)> {
    let client = env.client(name).await?;
    let work = async {
        let version = client.apiserver_version().await?.git_version;
        let nodes = Api::<Node>::all(client.clone())
            .list_metadata(&ListParams::default())
            .await?
            .items
            .len();
        anyhow::Ok((version, nodes))
    };
    tokio::time::timeout(Duration::from_secs(5), work)
        .await
        .unwrap_or_else(|_| anyhow::bail!("no answer within 5s"))
}

/// Quietly: is there an environment in `dir` whose apiservers all answer and whose
/// recorded processes all run?
pub async fn is_up(dir: &Path) -> bool {
    let Ok(Some(env)) = Env::load_state(dir) else {
        return false;
    };
    for c in &env.clusters {
        if probe(&env, &c.name).await.is_err() || c.components.iter().any(|p| !p.alive()) {
            return false;
        }
    }
    true
}
