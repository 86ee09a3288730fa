//! Command line: `operator` runs the MyApp operator alone against the current kubeconfig
//! (or the in-cluster config), for one cluster without a hub.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use k8s_openapi::jiff::SignedDuration;

use crate::http::{self, Readiness};
use crate::metrics::Metrics;
use crate::operator::{self, Namespaces, OperatorConfig};
use crate::{shutdown, telemetry};

#[derive(Parser, Debug)]
#[command(
    name = "flotilla-agent",
    version,
    about = "Flotilla agent: runs federated MyApps in one member cluster"
)]
pub struct Cli {
    /// Log one JSON object per line instead of human-readable text.
    #[arg(long, global = true, env = "FLOTILLA_LOG_JSON")]
    pub log_json: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the MyApp operator (and its conversion webhook) without a hub.
    Operator(OperatorArgs),
}

#[derive(Args, Debug)]
pub struct OperatorArgs {
    /// Reconcile every MyApp again after this long, e.g. `1h`, `30m`.
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    pub resync: Duration,
    /// Watch only these namespaces (repeat or comma-separate); all namespaces if absent.
    #[arg(long = "namespace", short = 'n', value_delimiter = ',')]
    pub namespaces: Vec<String>,
    /// Reconciles running at once (0: unbounded).
    #[arg(long, default_value_t = 16)]
    pub concurrency: u16,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,
    /// Names this instance in Events (the pod name in a cluster).
    #[arg(long, env = "POD_NAME")]
    pub instance: Option<String>,
}

impl OperatorArgs {
    pub fn operator_config(&self) -> OperatorConfig {
        OperatorConfig {
            namespaces: if self.namespaces.is_empty() {
                Namespaces::All
            } else {
                Namespaces::Only(self.namespaces.clone())
            },
            resync: self.resync,
            concurrency: self.concurrency,
            instance: self.instance.clone(),
        }
    }
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let d: SignedDuration = s
        .parse()
        .map_err(|e| format!("not a duration like 1h or 90s: {e}"))?;
    Duration::try_from(d).map_err(|_| "the duration must not be negative".to_string())
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    telemetry::init(cli.log_json);
    match cli.command {
        Command::Operator(args) => operator_command(args).await,
    }
}

async fn operator_command(args: OperatorArgs) -> anyhow::Result<()> {
    let shutdown = shutdown::on_signal().context("installing the SIGTERM handler")?;
    let client = kube::Client::try_default()
        .await
        .context("connecting to Kubernetes")?;
    let metrics = Arc::new(Metrics::default());
    let readiness = Readiness::default();
    let ready = readiness.gate("operator");
    let server = http::serve(
        args.http_addr,
        http::router(metrics.clone(), readiness),
        shutdown.clone(),
    );
    let operator = operator::run_operator(
        client,
        args.operator_config(),
        metrics,
        ready,
        shutdown.clone(),
    );
    let (served, ()) = tokio::join!(
        async {
            let served = server.await;
            // Without its endpoints the pod would be killed anyway: stop everything.
            shutdown.cancel();
            served
        },
        operator
    );
    served.with_context(|| format!("serving on {}", args.http_addr))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> OperatorArgs {
        let cli = Cli::try_parse_from([&["flotilla-agent", "operator"], args].concat()).unwrap();
        let Command::Operator(args) = cli.command;
        args
    }

    #[test]
    fn defaults_watch_everything_and_resync_hourly() {
        let config = parse(&[]).operator_config();
        assert_eq!(config.namespaces, Namespaces::All);
        assert_eq!(config.resync, Duration::from_secs(3600));
    }

    #[test]
    fn namespaces_and_resync_are_configurable() {
        let config = parse(&["-n", "a,b", "--namespace", "c", "--resync", "90s"]).operator_config();
        assert_eq!(
            config.namespaces,
            Namespaces::Only(vec!["a".into(), "b".into(), "c".into()])
        );
        assert_eq!(config.resync, Duration::from_secs(90));
        assert_eq!(
            parse(&["--resync", "1h30m"]).resync,
            Duration::from_secs(5400)
        );
    }

    #[test]
    fn bad_durations_are_refused() {
        for bad in ["soon", "-5m"] {
            assert!(
                Cli::try_parse_from(["flotilla-agent", "operator", "--resync", bad]).is_err(),
                "{bad}"
            );
        }
    }
}
