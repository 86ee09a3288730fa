//! The lab: Flotilla's multi-cluster environment on real Kubernetes control planes, for
//! the end-to-end suite (`flotilla-e2e`) and the benchmarks (`flotilla-bench`).
//!
//! A host cluster and N member clusters run real Kubernetes control planes: the `local`
//! provider starts kube-apiserver, etcd, kube-controller-manager, kube-scheduler and a
//! KWOK controller as local processes through `kwokctl --runtime binary`; the `kind`
//! provider uses `kind create cluster`. Either way the result is an [`Env`]: a state
//! directory with one kubeconfig per cluster, which the tests load with [`Env::load`].
//!
//! Modules, in the order `up` goes through them:
//! - [`provider`]: make the clusters ([`provider::local`], [`provider::kind`]) and, in
//!   real-node mode, a real node per cluster with Flotilla as Pods ([`provider::realnode`]),
//! - [`cluster`]: what every cluster gets once its apiserver answers (CRDs, fake nodes),
//! - [`env`]: the recorded state, kubeconfigs and clients,
//! - [`process`]: processes recorded by PID, signalled and stopped by PID,
//! - [`hubcli`]: the hub's admin commands (`certs`, `join`, `revoke`),
//! - [`federation`]: the hub and agents, launched and recorded so they can be restarted,
//! - [`support`]: workspace root, built binaries, free ports, HTTP GET, metrics samples,
//! - [`wait`]: the poll helper,
//! - [`apiserver`]: what an apiserver itself counts (requests, bytes) and who holds a Lease.
//!
//! Then what the commands print: [`status`] (`flotilla-e2e status`) and [`demo`].

pub mod apiserver;
pub mod cluster;
pub mod demo;
pub mod env;
pub mod federation;
pub mod hubcli;
pub mod process;
pub mod provider;
pub mod status;
pub mod support;
pub mod wait;

pub use env::{Env, Provider, Role};
pub use process::ProcessRecord;
pub use wait::{await_object, wait_event, wait_for, wait_for_every};

use anyhow::{Context, Result, bail};
use std::path::Path;
use std::time::Instant;

/// Name of the host cluster.
pub const HOST: &str = "host";

/// The cluster names of an environment with `members` member clusters.
pub fn cluster_names(members: usize) -> Vec<String> {
    std::iter::once(HOST.to_string())
        .chain((1..=members).map(|i| format!("cluster{i}")))
        .collect()
}

/// Brings the environment in `dir` up (idempotent: clusters already running are kept).
pub async fn up(dir: &Path, members: usize, provider: Provider) -> Result<Env> {
    up_with(dir, members, provider, false).await
}

/// [`up`], with the hub and the agents as Pods if `real_nodes`: on the local provider, on
/// one real node per cluster ([`provider::realnode`]); on kind, on each cluster's kind node.
pub async fn up_with(
    dir: &Path,
    members: usize,
    provider: Provider,
    real_nodes: bool,
) -> Result<Env> {
    let start = Instant::now();
    let names = cluster_names(members);
    if let Some(existing) = Env::load_state(dir)? {
        if existing.provider != provider {
            bail!(
                "an environment made by the {:?} provider exists in {}; run `flotilla-e2e down` first",
                existing.provider,
                dir.display()
            );
        }
        let have: Vec<&str> = existing.clusters.iter().map(|c| c.name.as_str()).collect();
        if have != names.iter().map(String::as_str).collect::<Vec<_>>() {
            bail!(
                "the environment in {} has clusters {have:?}, not {names:?}; run `flotilla-e2e down` first",
                dir.display()
            );
        }
        if existing.real_nodes != real_nodes {
            bail!(
                "the environment in {} was brought up {} real nodes; run `flotilla-e2e down` first",
                dir.display(),
                if existing.real_nodes {
                    "with"
                } else {
                    "without"
                }
            );
        }
    }
    // Record the intent first, so that `down` can clean up after a half-finished `up`.
    let mut env = Env::new(dir, provider, real_nodes, &names)?;
    env.save()?;
    match provider {
        Provider::Local => provider::local::up(&mut env).await?,
        Provider::Kind => provider::kind::up(&mut env).await?,
    }
    for c in &env.clusters {
        let client = env.client(&c.name).await?;
        cluster::prepare(&client, &c.name)
            .await
            .with_context(|| format!("preparing cluster {}", c.name))?;
    }
    env.save()?;
    if real_nodes {
        match provider {
            Provider::Local => provider::realnode::install(&env, start).await?,
            Provider::Kind => provider::kind::install_pods(&env, start).await?,
        }
        return Ok(env);
    }
    // Flotilla itself: the hub on the host, one agent per member (stopped by `down`).
    federation::up(&env)
        .await
        .context("starting flotilla-hub and the agents")?;
    eprintln!(
        "flotilla-e2e: environment up in {:.1}s ({})",
        start.elapsed().as_secs_f64(),
        dir.display()
    );
    Ok(env)
}

/// Tears the environment in `dir` down: processes spawned through [`Env::spawn`] first, then
/// the clusters; checks by PID that nothing it started is left running.
pub async fn down(dir: &Path) -> Result<()> {
    let start = Instant::now();
    // The canonical path: it is what the processes' command lines mention.
    let dir = &dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    process::stop_all(dir).context("stopping managed processes")?;
    // Real nodes (if any) before their control planes: the kubelets' last calls find them.
    provider::realnode::down(dir).context("stopping the real nodes")?;
    let state = Env::load_state(dir)?;
    let provider = state
        .as_ref()
        .map(|s| s.provider)
        .unwrap_or(Provider::Local);
    match (provider, state) {
        (Provider::Kind, Some(env)) => provider::kind::down(&env).await?,
        // The local provider also sweeps its kwok work dir, so a half-made env goes too.
        (_, state) => provider::local::down(dir, state.as_ref())?,
    }
    federation::remove_state(dir)?;
    env::remove_state(dir)?;
    eprintln!(
        "flotilla-e2e: environment down in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
