//! The environment's recorded state: which provider made it, its clusters and their
//! kubeconfigs, and the control-plane processes it runs. Everything lives under one
//! directory (`$FLOTILLA_E2E_DIR`, default `<workspace>/target/e2e`), so environments in
//! different directories coexist.

use crate::process::{self, ProcessRecord};
use crate::support::workspace_root;
use anyhow::{Context, Result, bail};
use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The variable that names the state directory.
pub const DIR_VAR: &str = "FLOTILLA_E2E_DIR";
const STATE_FILE: &str = "env.json";

/// What made the clusters. The suite does not care; `down` does.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Provider {
    /// kwokctl --runtime binary: real control-plane processes on 127.0.0.1, fake (KWOK) nodes.
    Local,
    /// kind: one Docker container per cluster with a real node.
    Kind,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Host,
    Member,
}

/// One cluster of the environment.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ClusterState {
    pub name: String,
    pub role: Role,
    pub kubeconfig: PathBuf,
    /// Control-plane processes (local provider), recorded so that `down` can check them.
    #[serde(default)]
    pub components: Vec<ProcessRecord>,
}

/// A multi-cluster environment, as recorded in `<dir>/env.json`.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Env {
    #[serde(skip)]
    pub dir: PathBuf,
    pub provider: Provider,
    /// `up --real-nodes`: every cluster also has a real node (see `realnode`), and the hub
    /// and agents run as Pods there.
    #[serde(default)]
    pub real_nodes: bool,
    pub clusters: Vec<ClusterState>,
}

/// `$FLOTILLA_E2E_DIR`, or `<workspace>/target/e2e`. A relative path is taken from the
/// workspace root, so that the binary and `cargo test` (which runs in `e2e/`) agree.
pub fn default_dir() -> PathBuf {
    match std::env::var_os(DIR_VAR).filter(|v| !v.is_empty()) {
        Some(d) => workspace_root().join(d),
        None => workspace_root().join("target").join("e2e"),
    }
}

/// `--dir`, for the commands that work on an environment (`flotilla-e2e`, `flotilla-bench`).
#[derive(clap::Args, Debug)]
pub struct DirArg {
    /// State directory (relative paths are taken from the workspace root)
    /// [default: <workspace>/target/e2e]
    #[arg(long = "dir", global = true, env = DIR_VAR)]
    dir: Option<PathBuf>,
}

impl DirArg {
    /// The state directory it names, or [`default_dir`].
    pub fn resolve(&self) -> PathBuf {
        match &self.dir {
            Some(d) => workspace_root().join(d),
            None => default_dir(),
        }
    }
}

impl Env {
    pub(crate) fn new(
        dir: &Path,
        provider: Provider,
        real_nodes: bool,
        names: &[String],
    ) -> Result<Env> {
        std::fs::create_dir_all(dir.join("kubeconfigs"))
            .with_context(|| format!("creating {}", dir.display()))?;
        let dir = dir
            .canonicalize()
            .with_context(|| format!("resolving {}", dir.display()))?;
        let clusters = names
            .iter()
            .map(|name| ClusterState {
                name: name.clone(),
                role: if name == crate::HOST {
                    Role::Host
                } else {
                    Role::Member
                },
                kubeconfig: dir.join("kubeconfigs").join(format!("{name}.yaml")),
                components: Vec::new(),
            })
            .collect();
        Ok(Env {
            dir,
            provider,
            real_nodes,
            clusters,
        })
    }

    /// Loads the environment from [`default_dir`]; fails with a hint if there is none.
    pub fn load() -> Result<Env> {
        Self::load_from(&default_dir())
    }

    /// Loads the environment recorded in `dir`; fails with a hint if there is none.
    pub fn load_from(dir: &Path) -> Result<Env> {
        match Self::load_state(dir)? {
            Some(env) => Ok(env),
            None => bail!(
                "no Flotilla e2e environment in {} (no {STATE_FILE}): bring one up with \
                 `cargo run -p flotilla-e2e -- up`, or run everything with `cargo run -p flotilla-e2e -- test`",
                dir.display()
            ),
        }
    }

    /// Loads the environment and checks that every apiserver answers: what a test calls first.
    pub async fn load_ready() -> Result<Env> {
        let env = Self::load()?;
        for c in &env.clusters {
            let client = env.client(&c.name).await?;
            let version =
                tokio::time::timeout(Duration::from_secs(10), client.apiserver_version()).await;
            match version {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => bail!(
                    "cluster {} of the e2e environment in {} does not answer ({e}); \
                     is it up? `cargo run -p flotilla-e2e -- status`",
                    c.name,
                    env.dir.display()
                ),
                Err(_) => bail!(
                    "cluster {} of the e2e environment in {} did not answer within 10s; \
                     is it up? `cargo run -p flotilla-e2e -- status`",
                    c.name,
                    env.dir.display()
                ),
            }
        }
        Ok(env)
    }

    /// The state in `dir`, if an environment was (at least partly) brought up there.
    pub fn load_state(dir: &Path) -> Result<Option<Env>> {
        let path = dir.join(STATE_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let mut env: Env =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        env.dir = dir.to_path_buf();
        Ok(Some(env))
    }

    /// Records the state in `<dir>/env.json` (written aside, then renamed).
    pub fn save(&self) -> Result<()> {
        let path = self.dir.join(STATE_FILE);
        let tmp = self.dir.join(format!("{STATE_FILE}.tmp"));
        std::fs::write(&tmp, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))
    }

    /// The name of the host cluster.
    pub fn host(&self) -> &str {
        crate::HOST
    }

    /// The names of the member clusters, in order.
    pub fn members(&self) -> Vec<&str> {
        self.clusters
            .iter()
            .filter(|c| c.role == Role::Member)
            .map(|c| c.name.as_str())
            .collect()
    }

    pub fn cluster(&self, name: &str) -> Result<&ClusterState> {
        self.clusters
            .iter()
            .find(|c| c.name == name)
            .with_context(|| {
                let names: Vec<&str> = self.clusters.iter().map(|c| c.name.as_str()).collect();
                format!("no cluster {name:?} in the e2e environment (it has {names:?})")
            })
    }

    /// The kubeconfig file of cluster `name`.
    pub fn kubeconfig(&self, name: &str) -> Result<&Path> {
        Ok(&self.cluster(name)?.kubeconfig)
    }

    /// A client for cluster `name`, from its kubeconfig.
    pub async fn client(&self, name: &str) -> Result<Client> {
        let path = self.kubeconfig(name)?;
        let kubeconfig = Kubeconfig::read_from(path)
            .with_context(|| format!("reading kubeconfig {}", path.display()))?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", path.display()))?;
        Client::try_from(config).with_context(|| format!("building a client for cluster {name}"))
    }

    /// Starts `cmd` as a process of this environment: output to `<dir>/logs/<name>.log`,
    /// PID recorded under `<dir>/procs/`, stopped by `down`.
    pub fn spawn(&self, name: &str, cmd: &mut Command) -> Result<ProcessRecord> {
        process::spawn(&self.dir, name, cmd)
    }
}

/// Removes the state and kubeconfigs `up` wrote; logs stay for post-mortems.
pub(crate) fn remove_state(dir: &Path) -> Result<()> {
    remove_all(&[dir.join(STATE_FILE), dir.join("kubeconfigs")])
}

/// Removes files and directories; those already gone are fine.
pub(crate) fn remove_all(paths: &[PathBuf]) -> Result<()> {
    for p in paths {
        let r = if p.is_dir() {
            std::fs::remove_dir_all(p)
        } else {
            std::fs::remove_file(p)
        };
        match r {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", p.display())),
        }
    }
    Ok(())
}
