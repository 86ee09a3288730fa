//! `flotilla-e2e`: brings the lab's multi-cluster environment up and down, and runs the
//! tests. The benchmarks are `flotilla-bench`.

use anyhow::Result;
use clap::{Parser, Subcommand};
use flotilla_lab::{Env, Provider, env};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "flotilla-e2e",
    about = "Flotilla's multi-cluster e2e environment on real Kubernetes control planes"
)]
struct Cli {
    #[command(flatten)]
    dir: env::DirArg,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Bring up the host cluster and N member clusters (idempotent)
    Up {
        #[arg(long, default_value_t = 2)]
        members: usize,
        #[arg(long, value_enum, default_value_t = Provider::Local)]
        provider: Provider,
        /// Give every cluster one real node (kubelet, containerd, kube-proxy) beside the KWOK
        /// nodes, and run the hub and agents on them as Pods (needs root; see e2e/README.md).
        /// With `--provider kind`: the hub and agents as Pods on the kind nodes
        #[arg(long)]
        real_nodes: bool,
    },
    /// Stop everything the environment runs and remove its state
    Down,
    /// Show the clusters, their processes and their memory; exits 1 if not up and healthy
    Status,
    /// Print the path of cluster NAME's kubeconfig (host, cluster1, ...)
    Kubeconfig { name: String },
    /// Bring the environment up (if it is not) and apply the seed's FederatedMyApp on the host
    Demo,
    /// Unit tests + the e2e suite; brings the environment up (and down again) if it is not running
    Test {
        /// Three: the scheduling tests divide replicas over three members.
        #[arg(long, default_value_t = 3)]
        members: usize,
        #[arg(long, value_enum, default_value_t = Provider::Local)]
        provider: Provider,
        /// Bring the environment up with real nodes (hub and agents as Pods) and run the
        /// suites that hold there: propagation and realnodes (and, on kind, helm)
        #[arg(long)]
        real_nodes: bool,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command, cli.dir.resolve()).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("flotilla-e2e: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cmd: Cmd, dir: PathBuf) -> Result<bool> {
    match cmd {
        Cmd::Up {
            members,
            provider,
            real_nodes,
        } => {
            let env = flotilla_lab::up_with(&dir, members, provider, real_nodes).await?;
            for c in &env.clusters {
                println!("{}\t{}", c.name, c.kubeconfig.display());
            }
            Ok(true)
        }
        Cmd::Down => flotilla_lab::down(&dir).await.map(|()| true),
        Cmd::Status => flotilla_lab::status::status(&dir).await,
        Cmd::Kubeconfig { name } => {
            let env = Env::load_from(&dir)?;
            println!("{}", env.kubeconfig(&name)?.display());
            Ok(true)
        }
        Cmd::Demo => {
            let env = flotilla_lab::up(&dir, 2, Provider::Local).await?;
            flotilla_lab::demo::demo(&env).await.map(|()| true)
        }
        Cmd::Test {
            members,
            provider,
            real_nodes,
        } => flotilla_e2e::testcmd::run(&dir, members, provider, real_nodes).await,
    }
}
