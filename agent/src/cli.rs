//! Command line: `run` joins the hub; `operator` runs the MyApp operator alone against
//! the current kubeconfig (or the in-cluster config), for one cluster without a hub;
//! `webhook` serves the MyApp conversion webhook alone (what the OLM package owning the
//! MyApp CRD runs). All are wired in [`crate::run`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use k8s_openapi::jiff::SignedDuration;

use crate::operator::{Namespaces, OperatorConfig};
use crate::session::SessionConfig;
use crate::tenancy::Guard;
use crate::token::TokenStore;
use crate::webhook::WebhookConfig;
use crate::webhook::crd::Endpoint;
use flotilla_common::kubeconfig::KubeArgs;
use flotilla_common::leader;
use flotilla_common::telemetry;
use flotilla_common::tenancy::TenancyArgs;
use flotilla_crds::tenancy::NamespacePolicy;

#[derive(Parser, Debug)]
#[command(
    name = "flotilla-agent",
    version,
    about = "Flotilla agent: runs federated MyApps in one member cluster"
)]
pub struct Cli {
    /// Log one JSON object per line instead of human-readable text.
    #[arg(long, global = true)]
    pub log_json: bool,
    #[command(flatten)]
    pub kube: KubeArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "parsed once at start; boxing the flags would buy nothing"
)]
pub enum Command {
    /// Join the hub: apply the MyApps it sends, report their status, and run the
    /// operator and conversion webhook beside.
    Run(RunArgs),
    /// Run the MyApp operator (and its conversion webhook) without a hub.
    Operator(OperatorArgs),
    /// Serve only the MyApp conversion webhook (and /healthz, /readyz, /metrics): no
    /// operator, no hub, no leader election. The OLM package that owns the MyApp CRD
    /// runs this, beside operators scoped to some namespaces.
    Webhook(WebhookServeArgs),
    /// Print the version.
    Version,
    /// Print a shell completion script, e.g. `flotilla-agent completion bash`.
    Completion {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The hub's gRPC endpoint, e.g. https://hub.example.com:7443.
    #[arg(long, env = "FLOTILLA_HUB")]
    pub hub: String,
    /// This member cluster's name, as registered with `flotilla-hub join`.
    #[arg(long, env = "FLOTILLA_CLUSTER")]
    pub cluster: String,
    /// File holding the token `flotilla-hub join` issued; a token the hub renews is
    /// written back to it (atomically, mode 0600). Ignored with --token-secret.
    #[arg(
        long,
        env = "FLOTILLA_TOKEN_FILE",
        required_unless_present = "token_secret"
    )]
    pub token_file: Option<PathBuf>,
    /// Secret (in --flotilla-namespace) whose `token` key holds the token: read before
    /// every dial, and where a token the hub renews is stored (needs get and patch on
    /// that one Secret).
    #[arg(long, env = "FLOTILLA_TOKEN_SECRET")]
    pub token_secret: Option<String>,
    /// PEM of the CA that signed the hub's certificate.
    #[arg(long, env = "FLOTILLA_HUB_CA_FILE")]
    pub hub_ca_file: PathBuf,
    /// Verify the hub's certificate against this name instead of the URL's host.
    #[arg(long)]
    pub hub_server_name: Option<String>,
    /// Interval of heartbeats to the hub.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub heartbeat: Duration,
    /// Circuit breaker: the largest share (0–1) of its managed MyApps that orphan
    /// collection after a (re)connect may delete without a confirmation on the hub.
    #[arg(long, default_value_t = 0.5, value_parser = parse_share)]
    pub max_collect_share: f64,
    /// Report the cluster's capacity (nodes' allocatable minus pods' requests, for
    /// `replicaScheduling.mode: Capacity`) at most this often, when it changed. Needs
    /// list/watch on nodes and pods; 0s turns it off.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub capacity_interval: Duration,
    /// The hub's requests (apply, delete, release) carried out at once; each MyApp's
    /// requests still run one at a time, in order. Each costs the member's apiserver a
    /// GET and an apply: 8 at once held 1,000 new MyApps to 7/s on a busy member, 32 kept
    /// up with the host (BENCHMARKS.md, fan-out rerun).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..))]
    pub apply_concurrency: u16,
    #[command(flatten)]
    pub tenancy: TenancyArgs,
    /// Apply MyApps only into these namespaces (repeat or comma-separate), whatever the
    /// hub sends; the forbidden ones stay forbidden. Without it, every namespace that is
    /// not forbidden.
    #[arg(
        long = "allowed-namespace",
        value_delimiter = ',',
        env = "FLOTILLA_ALLOWED_NAMESPACES"
    )]
    pub allowed_namespaces: Vec<String>,
    #[command(flatten)]
    pub operator: OperatorArgs,
}

impl RunArgs {
    /// The namespaces MyApps are never applied into, and those they may be.
    fn namespace_policy(&self) -> NamespacePolicy {
        let tenancy = &self.tenancy;
        NamespacePolicy::new(&tenancy.flotilla_namespace, &tenancy.forbidden_namespaces)
            .allowing_only(&self.allowed_namespaces)
    }

    fn session_config(&self) -> anyhow::Result<SessionConfig> {
        let read =
            |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
        let token = match (&self.token_secret, &self.token_file) {
            (Some(name), _) => TokenStore::Secret {
                namespace: self.tenancy.flotilla_namespace.clone(),
                name: name.clone(),
            },
            (None, Some(path)) => {
                // Read once here so that a missing file fails at start; the session reads
                // it again before every dial, to pick up a rotated token.
                String::from_utf8(read(path)?).context("the token file is not UTF-8")?;
                TokenStore::File(path.clone())
            }
            (None, None) => anyhow::bail!("--token-file or --token-secret is required"),
        };
        if !self.hub.starts_with("https://") {
            anyhow::bail!(
                "--hub {:?}: must start with https:// (the token is never sent in clear)",
                self.hub
            );
        }
        Ok(SessionConfig {
            hub: self.hub.clone(),
            cluster: self.cluster.clone(),
            token: std::sync::Arc::new(token),
            ca_pem: read(&self.hub_ca_file)?,
            server_name: self.hub_server_name.clone(),
            heartbeat: self.heartbeat,
            max_collect_share: self.max_collect_share,
            capacity_interval: Some(self.capacity_interval).filter(|i| !i.is_zero()),
            concurrency: self.apply_concurrency.into(),
            guard: Guard::new(self.namespace_policy()),
        })
    }
}

#[derive(Args, Debug)]
pub struct OperatorArgs {
    /// Reconcile every MyApp again after this long, e.g. `1h`, `30m`.
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    pub resync: Duration,
    /// Watch only these namespaces (repeat or comma-separate); all namespaces if absent
    /// or empty. Under OLM the environment variable carries the OperatorGroup's target
    /// namespaces (the pod's annotation `olm.targetNamespaces`, empty for AllNamespaces).
    #[arg(
        long = "namespace",
        short = 'n',
        value_delimiter = ',',
        env = "FLOTILLA_OPERATOR_NAMESPACES"
    )]
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
    /// Serve KEDA's external scaler here (the member install: 0.0.0.0:9090), so that a
    /// ScaledObject's `external` trigger scales a MyApp by a metric its pods export.
    /// Not served without it.
    #[arg(long)]
    pub scaler_addr: Option<SocketAddr>,
    #[command(flatten)]
    pub webhook: WebhookArgs,
    /// With `--leader-elect`, one agent per member cluster is active: the others serve
    /// the conversion webhook and wait for the Lease, touching nothing.
    #[command(flatten)]
    pub leader: leader::LeaderArgs,
}

/// `flotilla-agent webhook`: the conversion webhook and the HTTP endpoints, nothing else.
#[derive(Args, Debug)]
pub struct WebhookServeArgs {
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,
    #[command(flatten)]
    pub webhook: WebhookArgs,
}

/// The conversion webhook. Without `--webhook-url` or `--webhook-service` it serves but
/// leaves the CRD's conversion settings alone.
#[derive(Args, Debug)]
pub struct WebhookArgs {
    /// Address of the HTTPS conversion webhook.
    #[arg(long, default_value = "0.0.0.0:9443")]
    pub webhook_addr: SocketAddr,
    /// PEM certificate to serve (with --webhook-key), e.g. from a cert-manager Secret;
    /// without it the agent issues its own from the CA in --webhook-ca-secret.
    #[arg(long, requires = "webhook_key")]
    pub webhook_cert: Option<PathBuf>,
    #[arg(long, requires = "webhook_cert")]
    pub webhook_key: Option<PathBuf>,
    /// Secret (NAMESPACE/NAME) holding the webhook's CA, shared by the agent's replicas:
    /// created by the first, read by the others and at every restart, so the CRD's
    /// caBundle holds for all of them (needs create on Secrets and get on that one).
    /// Empty: a new CA at every start (one replica only).
    #[arg(long, default_value = "flotilla-system/flotilla-agent-webhook-ca", value_parser = parse_secret_ref)]
    pub webhook_ca_secret: SecretRef,
    /// Point the MyApp CRD at this https URL, e.g. https://127.0.0.1:9443/convert.
    #[arg(long, value_parser = Endpoint::parse_url, conflicts_with = "webhook_service")]
    pub webhook_url: Option<Endpoint>,
    /// Point the MyApp CRD at this Service: NAMESPACE/NAME[:PORT] (port 443 by default).
    #[arg(long, value_parser = Endpoint::parse_service)]
    pub webhook_service: Option<Endpoint>,
}

impl WebhookArgs {
    pub fn webhook_config(&self) -> WebhookConfig {
        WebhookConfig {
            addr: self.webhook_addr,
            cert_files: self.webhook_cert.clone().zip(self.webhook_key.clone()),
            ca_secret: self.webhook_ca_secret.0.clone(),
            endpoint: self
                .webhook_url
                .clone()
                .or_else(|| self.webhook_service.clone()),
        }
    }
}

impl OperatorArgs {
    pub fn operator_config(&self) -> OperatorConfig {
        OperatorConfig {
            namespaces: {
                // An empty value (OLM's AllNamespaces) names no namespace.
                let named: Vec<String> = self
                    .namespaces
                    .iter()
                    .filter(|n| !n.is_empty())
                    .cloned()
                    .collect();
                if named.is_empty() {
                    Namespaces::All
                } else {
                    Namespaces::Only(named)
                }
            },
            resync: self.resync,
            concurrency: self.concurrency,
            instance: self.instance.clone(),
        }
    }
}

/// `NAMESPACE/NAME` of a Secret, or none (empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretRef(pub Option<(String, String)>);

fn parse_secret_ref(s: &str) -> Result<SecretRef, String> {
    if s.is_empty() {
        return Ok(SecretRef(None));
    }
    match s.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok(SecretRef(Some((ns.into(), name.into()))))
        }
        _ => Err("expected NAMESPACE/NAME, or empty".into()),
    }
}

fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(share) if (0.0..=1.0).contains(&share) => Ok(share),
        _ => Err(format!("{s:?}: expected a share between 0 and 1, e.g. 0.5")),
    }
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let d: SignedDuration = s
        .parse()
        .map_err(|e| format!("not a duration like 1h or 90s: {e}"))?;
    Duration::try_from(d).map_err(|_| "the duration must not be negative".to_string())
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Version => {
            println!("flotilla-agent {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Command::Completion { shell } => {
            use clap::CommandFactory;
            let mut command = Cli::command();
            clap_complete::generate(
                shell,
                &mut command,
                "flotilla-agent",
                &mut std::io::stdout(),
            );
            Ok(())
        }
        Command::Operator(args) => {
            telemetry::init(cli.log_json);
            crate::run::serve(&cli.kube, args, None).await
        }
        Command::Webhook(args) => {
            telemetry::init(cli.log_json);
            crate::run::serve_webhook(&cli.kube, args).await
        }
        Command::Run(args) => {
            telemetry::init(cli.log_json);
            let session = args.session_config()?;
            crate::run::serve(&cli.kube, args.operator, Some(session)).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> OperatorArgs {
        let cli = Cli::try_parse_from([&["flotilla-agent", "operator"], args].concat()).unwrap();
        let Command::Operator(args) = cli.command else {
            panic!("parsed as the operator command")
        };
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

    /// OLM's `olm.targetNamespaces` reaches `--namespace` through the environment: a
    /// list for Own/Single/MultiNamespace, empty for AllNamespaces. clap hands an
    /// environment value to the same parser as one on the command line (split at
    /// commas), so the command line stands in for it here (tests may not set the
    /// process environment).
    #[test]
    fn olms_target_namespaces_reach_the_operator() {
        use clap::CommandFactory;
        let command = Cli::command();
        let operator = command.find_subcommand("operator").unwrap();
        let arg = operator
            .get_arguments()
            .find(|a| a.get_id() == "namespaces")
            .unwrap();
        assert_eq!(
            arg.get_env(),
            Some(std::ffi::OsStr::new("FLOTILLA_OPERATOR_NAMESPACES"))
        );
        assert_eq!(
            parse(&["--namespace=team-a,team-b"])
                .operator_config()
                .namespaces,
            Namespaces::Only(vec!["team-a".into(), "team-b".into()])
        );
        assert_eq!(
            parse(&["--namespace=team-a"]).operator_config().namespaces,
            Namespaces::Only(vec!["team-a".into()])
        );
        assert_eq!(
            parse(&["--namespace="]).operator_config().namespaces,
            Namespaces::All,
            "AllNamespaces' empty annotation watches everything"
        );
    }

    /// `webhook` serves the mounted certificate and nothing else: no CRD to patch.
    #[test]
    fn the_webhook_command_serves_a_certificate_alone() {
        let cli = Cli::try_parse_from([
            "flotilla-agent",
            "webhook",
            "--webhook-cert=/certs/tls.crt",
            "--webhook-key=/certs/tls.key",
            "--http-addr=127.0.0.1:18080",
        ])
        .unwrap();
        let Command::Webhook(args) = cli.command else {
            panic!("parsed as the webhook command")
        };
        let config = args.webhook.webhook_config();
        assert_eq!(
            config.cert_files,
            Some(("/certs/tls.crt".into(), "/certs/tls.key".into()))
        );
        assert!(config.endpoint.is_none());
        assert_eq!(args.http_addr, "127.0.0.1:18080".parse().unwrap());
        // The operator's flags are not the webhook's.
        assert!(Cli::try_parse_from(["flotilla-agent", "webhook", "--namespace=a"]).is_err());
    }

    #[test]
    fn webhook_endpoint_is_a_url_or_a_service() {
        let url = parse(&["--webhook-url", "https://127.0.0.1:9443/convert"])
            .webhook
            .webhook_config();
        assert_eq!(
            url.endpoint,
            Some(Endpoint::Url("https://127.0.0.1:9443/convert".into()))
        );
        let svc = parse(&["--webhook-service", "flotilla-system/flotilla-agent"])
            .webhook
            .webhook_config();
        assert!(matches!(svc.endpoint, Some(Endpoint::Service { .. })));
        assert_eq!(parse(&[]).webhook.webhook_config().endpoint, None);
        let both = [
            "--webhook-url",
            "https://h/convert",
            "--webhook-service",
            "a/b",
        ];
        assert!(
            Cli::try_parse_from([&["flotilla-agent", "operator"][..], &both].concat()).is_err()
        );
        assert!(
            Cli::try_parse_from(["flotilla-agent", "operator", "--webhook-cert", "c.pem"]).is_err()
        );
    }

    #[test]
    fn the_webhook_ca_is_shared_through_a_secret_unless_told_otherwise() {
        let ca = |args: &[&str]| parse(args).webhook.webhook_config().ca_secret;
        assert_eq!(
            ca(&[]),
            Some(("flotilla-system".into(), "flotilla-agent-webhook-ca".into()))
        );
        assert_eq!(
            ca(&["--webhook-ca-secret", "ns/ca"]),
            Some(("ns".into(), "ca".into()))
        );
        assert_eq!(ca(&["--webhook-ca-secret="]), None);
        for bad in ["ca", "/ca", "ns/", "ns/a/b"] {
            let args = ["flotilla-agent", "operator", "--webhook-ca-secret", bad];
            assert!(Cli::try_parse_from(args).is_err(), "{bad}");
        }
    }

    /// The tenancy flags reach the agent's namespace policy: the forbidden namespaces,
    /// its own, and its allow-list.
    #[test]
    fn the_tenancy_flags_reach_the_namespace_policy() {
        let cli = Cli::try_parse_from([
            "flotilla-agent",
            "run",
            "--hub=https://h:1",
            "--cluster=c",
            "--token-file=t",
            "--hub-ca-file=ca",
            "--forbidden-namespace=vault",
            "--flotilla-namespace=ops",
            "--allowed-namespace=shop,team",
            "--allowed-namespace=vault",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("parsed as run")
        };
        let rule = |ns: &str| args.namespace_policy().check(ns).err().map(|f| f.rule);
        use flotilla_crds::tenancy::Rule;
        assert_eq!(rule("shop"), None);
        assert_eq!(rule("team"), None);
        assert_eq!(rule("vault"), Some(Rule::Configured));
        assert_eq!(rule("ops"), Some(Rule::Flotilla));
        assert_eq!(rule("kube-system"), Some(Rule::System));
        assert_eq!(rule("default"), Some(Rule::NotAllowed));
    }

    #[test]
    fn kubeconfig_and_context_are_global() {
        let cli = Cli::try_parse_from([
            "flotilla-agent",
            "operator",
            "--kubeconfig",
            "/k",
            "--context",
            "paris",
        ])
        .unwrap();
        assert_eq!(cli.kube.kubeconfig, Some(PathBuf::from("/k")));
        assert_eq!(cli.kube.context.as_deref(), Some("paris"));
        let cli = Cli::try_parse_from(["flotilla-agent", "--context", "c", "version"]).unwrap();
        assert!(matches!(cli.command, Command::Version));
        assert_eq!(cli.kube.context.as_deref(), Some("c"));
    }

    #[test]
    fn completion_takes_a_known_shell() {
        for shell in ["bash", "zsh", "fish"] {
            assert!(Cli::try_parse_from(["flotilla-agent", "completion", shell]).is_ok());
        }
        assert!(Cli::try_parse_from(["flotilla-agent", "completion", "cmd.exe"]).is_err());
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
