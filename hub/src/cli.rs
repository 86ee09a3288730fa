//! Command line: `render` (offline preview), `crds`, `certs`, `version`, `completion`;
//! `run` drives the hub; `rollout` pauses, resumes and aborts a progressive rollout; `join`,
//! `revoke`, `unjoin`, `cordon` and `uncordon` manage
//! member clusters.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand, ValueEnum};
use flotilla_crds::member::{MemberClusterSpec, MemberClusterStatus};
use flotilla_crds::{FederatedMyApp, MemberCluster};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use secrecy::ExposeSecret;
use serde::Deserialize;
use serde_json::Value;

use flotilla_common::kubeconfig::KubeArgs;
use flotilla_common::tenancy::TenancyArgs;
use flotilla_plan::placement::{Member, Members};
use flotilla_plan::plan::FAILED_OVER;
use flotilla_plan::{AppPlan, ClusterPlan, KeepReason};

#[derive(Parser, Debug)]
#[command(
    name = "flotilla-hub",
    version,
    about = "Flotilla hub: federates MyApps across member clusters"
)]
pub struct Cli {
    /// Log one JSON object per line instead of human-readable text.
    #[arg(long, global = true, env = "FLOTILLA_LOG_JSON")]
    pub log_json: bool,
    /// The host cluster (for `run`, `join`, `revoke`, `unjoin`).
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
    /// Run the hub against the host cluster (kubeconfig or in-cluster config).
    Run(crate::run::RunArgs),
    /// Register a member cluster and print its install (`kubectl apply -f` it in the
    /// member); `--rotate` issues a new credential for a registered one.
    Join(JoinArgs),
    /// Revoke a member cluster's credential: its agent is disconnected and refused.
    Revoke(RevokeArgs),
    /// Remove a member cluster: revoke its credential and delete its MemberCluster.
    Unjoin(UnjoinArgs),
    /// Write a CA and a serving certificate for the hub's gRPC endpoint.
    Certs(CertsArgs),
    /// Preview, offline, exactly the MyApp each cluster would get.
    Render(RenderArgs),
    /// Keep new replicas off a member cluster; what it runs stays.
    Cordon(CordonArgs),
    /// Let new replicas onto a cordoned member cluster again.
    Uncordon(CordonArgs),
    /// Every cluster of a FederatedMyApp, from the leading hub (its status on the host
    /// lists only the most urgent past 50 clusters).
    Status(crate::detail::StatusArgs),
    /// Where a FederatedMyApp's progressive rollout stands; pause, resume or abort it.
    Rollout(RolloutArgs),
    /// Print the CustomResourceDefinitions Flotilla installs.
    Crds {
        /// Print instead the cluster inventory API's CRDs (ClusterProfile,
        /// `multicluster.x-k8s.io`), for a host where no other cluster manager installed them.
        #[arg(long)]
        cluster_inventory: bool,
    },
    /// Print the version.
    Version,
    /// Print a shell completion script, e.g. `flotilla-hub completion bash > /etc/bash_completion.d/flotilla-hub`.
    Completion {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(clap::Args, Debug)]
pub struct RenderArgs {
    /// The FederatedMyApp YAML or JSON (`-` reads standard input).
    #[arg(short = 'f', long = "filename")]
    pub file: PathBuf,
    /// MemberCluster objects (a list, a `kind: List`, or a multi-document stream): their
    /// names, labels, `spec.unschedulable`, and `status` (the `Ready` condition and
    /// `capacity`) as the hub would see them. Without it, every cluster named in
    /// `placement.clusters` counts as registered, Ready, with no labels. A `status` on the
    /// FederatedMyApp is read as the previous division.
    #[arg(long)]
    pub clusters: Option<PathBuf>,
    /// The time readiness is judged at (RFC 3339), for a reproducible failover preview.
    /// Default: now.
    #[arg(long)]
    pub now: Option<Timestamp>,
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Yaml)]
    pub output: Output,
    /// As the hub's: the preview refuses what the hub would.
    #[command(flatten)]
    pub tenancy: TenancyArgs,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    Yaml,
    Json,
}

/// The outcome of `render`: what goes to stdout, what to stderr, and whether it failed.
pub struct RenderReport {
    pub stdout: String,
    pub stderr: Vec<String>,
    pub failed: bool,
}

pub fn render_command(args: &RenderArgs) -> anyhow::Result<RenderReport> {
    let app: FederatedMyApp = serde_yaml::from_str(&read(&args.file)?)
        .with_context(|| format!("{} is not a FederatedMyApp", args.file.display()))?;
    let now = args.now.unwrap_or_else(Timestamp::now);
    let members = match &args.clusters {
        Some(path) => parse_members(&read(path)?, now)
            .with_context(|| format!("reading {}", path.display()))?,
        None => named_members(&app),
    };
    let object = format!(
        "FederatedMyApp {}/{}",
        app.metadata.namespace.as_deref().unwrap_or("default"),
        app.metadata.name.as_deref().unwrap_or_default()
    );
    let admission = crate::run::admission(&args.tenancy);
    // Offline: no ClusterGrant is read, as for a namespace without one by default.
    let grants = flotilla_plan::grants::Grants::default();
    let planned = flotilla_plan::plan(&app, &members, &admission, &grants);
    if let Some(e) = planned.placement_error {
        return Err(anyhow::Error::new(e).context(object));
    }
    Ok(report(&object, &planned, args.output))
}

fn report(object: &str, planned: &AppPlan, output: Output) -> RenderReport {
    let mut stderr: Vec<String> = planned
        .warnings
        .iter()
        .map(|w| format!("warning: {object}: {w}"))
        .collect();
    let schedule = planned
        .schedule
        .as_ref()
        .expect("a plan without an error has a schedule");
    let plain = schedule
        .clusters
        .values()
        .all(|a| a.reason == flotilla_crds::federated::SchedulingReason::Duplicated);
    if schedule.divided || !plain {
        let each: Vec<String> = schedule
            .clusters
            .iter()
            .map(|(c, a)| format!("{c} {} ({:?})", a.replicas, a.reason))
            .collect();
        stderr.push(format!(
            "schedule: {object}: {} replicas: {}",
            schedule.total(),
            each.join(", ")
        ));
    }
    // A failed-over cluster is not an error of the app: its copy is left as it is.
    let mut failed = false;
    for (c, p) in &planned.clusters {
        if let Some(e) = p.error() {
            failed = true;
            stderr.push(format!("error: {object}, cluster {c}: {e}"));
        } else if *p == ClusterPlan::Keep(KeepReason::FailedOver) {
            stderr.push(format!("note: {object}, cluster {c}: {FAILED_OVER}"));
        }
    }
    let ok = planned
        .clusters
        .iter()
        .filter_map(|(c, p)| Some((c, p.rendered()?.to_value())));
    let stdout = match output {
        Output::Json => {
            let map: serde_json::Map<String, Value> = ok.map(|(c, v)| (c.to_string(), v)).collect();
            serde_json::to_string_pretty(&map).expect("JSON serializes") + "\n"
        }
        Output::Yaml => ok
            .map(|(c, v)| {
                format!(
                    "# cluster: {c}\n---\n{}",
                    serde_yaml::to_string(&v).expect("YAML serializes")
                )
            })
            .collect(),
    };
    RenderReport {
        stdout,
        stderr,
        failed,
    }
}

fn read(path: &Path) -> anyhow::Result<String> {
    if path == Path::new("-") {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading standard input")?;
        return Ok(s);
    }
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// Without a cluster list, the clusters the placement names are taken as registered.
fn named_members(app: &FederatedMyApp) -> Members {
    let named = app.spec.placement.clusters.iter().flatten();
    named
        .map(|c| (c.name.as_str().into(), Default::default()))
        .collect()
}

/// MemberClusters from YAML: a sequence, a `kind: List` with `items`, or documents.
/// Readiness is judged at `now`.
pub fn parse_members(yaml: &str, now: Timestamp) -> anyhow::Result<Members> {
    let mut members = Members::new();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let doc = Value::deserialize(doc)?;
        let items = match doc {
            Value::Null => continue,
            Value::Array(items) => items,
            Value::Object(mut map) if map.contains_key("items") => match map.remove("items") {
                Some(Value::Array(items)) => items,
                _ => bail!("`items` must be a list of MemberClusters"),
            },
            object => vec![object],
        };
        for (i, item) in items.into_iter().enumerate() {
            let kind = item
                .get("kind")
                .and_then(Value::as_str)
                .unwrap_or("MemberCluster");
            if kind != "MemberCluster" {
                bail!("item {i}: expected kind MemberCluster, found {kind}");
            }
            let meta: ObjectMeta =
                serde_json::from_value(item.get("metadata").cloned().unwrap_or_default())
                    .with_context(|| format!("item {i}: invalid metadata"))?;
            let name = meta
                .name
                .filter(|n| !n.is_empty())
                .with_context(|| format!("item {i}: metadata.name is missing"))?;
            let part = |key: &str| item.get(key).cloned().unwrap_or(Value::Null);
            let spec: Option<MemberClusterSpec> = serde_json::from_value(part("spec"))
                .with_context(|| format!("MemberCluster {name}: invalid spec"))?;
            let status: Option<MemberClusterStatus> = serde_json::from_value(part("status"))
                .with_context(|| format!("MemberCluster {name}: invalid status"))?;
            let mut mc = MemberCluster::new(&name, spec.unwrap_or_default());
            mc.metadata.labels = meta.labels;
            mc.status = status;
            members.insert(name.into(), Member::from_cluster(&mc, now));
        }
    }
    Ok(members)
}

/// Where `join` puts the credential: a file, always, unless `--stdout` says otherwise.
#[derive(clap::Args, Debug)]
#[command(group(
    clap::ArgGroup::new("destination")
        .required(true)
        .multiple(false)
        .args(["output", "token_file", "stdout"])
))]
pub struct JoinArgs {
    /// The member cluster's name (a DNS-1123 subdomain).
    pub name: String,
    /// Labels for placement selectors, `key=value` (repeatable). On `--rotate`, these are
    /// set and every other label is kept.
    #[arg(long = "label", short = 'l', value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Issue a new credential for a registered cluster (the agent holding the old one is
    /// disconnected); its labels are kept.
    #[arg(long)]
    pub rotate: bool,
    /// How long the token is valid. The hub renews it over the agent's session before it
    /// expires (see the hub's --token-lifetime); an agent that has not connected by then
    /// needs `join --rotate`.
    #[arg(long, default_value = "30d", value_parser = crate::run::parse_lifetime)]
    pub token_lifetime: Duration,
    /// Where the member's agent dials the hub, HOST:PORT. Default: the external address
    /// of the LoadBalancer Service flotilla-system/flotilla-hub.
    #[arg(long, value_name = "HOST:PORT")]
    pub hub_address: Option<String>,
    /// Name the agent verifies the hub's certificate against, when the certificate does
    /// not name the --hub-address host.
    #[arg(long)]
    pub hub_server_name: Option<String>,
    /// PEM of the CA of the hub's certificate. Default: `ca.crt` of the Secret
    /// flotilla-system/flotilla-hub-tls on the host.
    #[arg(long, value_name = "FILE")]
    pub hub_ca_file: Option<PathBuf>,
    /// The agent's image (default: deploy/base's).
    #[arg(long)]
    pub agent_image: Option<String>,
    /// Only these namespaces (repeat or comma-separate): the agent applies MyApps into
    /// them alone, watches them alone, and its rights on MyApps and their children are
    /// granted in them alone, a Role each. Default: every namespace not forbidden.
    #[arg(long = "allowed-namespace", value_delimiter = ',')]
    pub allowed_namespaces: Vec<String>,
    /// Write the member install here (mode 0600, it holds the credential). One of -o,
    /// --token-file and --stdout is required.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Issue the token only and write it here (mode 0600), no install: for installs kept
    /// elsewhere (deploy/overlays/member).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Print the member install, credential included, to standard output (e.g. piped
    /// straight into `kubectl apply -f -` for the member).
    #[arg(long)]
    pub stdout: bool,
}

#[derive(clap::Args, Debug)]
pub struct RevokeArgs {
    pub name: String,
}

#[derive(clap::Args, Debug)]
pub struct UnjoinArgs {
    pub name: String,
    /// Also delete, in the member, every MyApp Flotilla manages there (their Deployments
    /// and ConfigMaps go with them). Needs --member-kubeconfig or --member-context.
    #[arg(long)]
    pub delete_workloads: bool,
    /// Kubeconfig of the member cluster, for --delete-workloads.
    #[arg(long, value_name = "FILE", requires = "delete_workloads")]
    pub member_kubeconfig: Option<PathBuf>,
    /// Context of the member cluster, for --delete-workloads.
    #[arg(long, value_name = "NAME", requires = "delete_workloads")]
    pub member_context: Option<String>,
}

#[derive(clap::Args, Debug)]
pub struct CordonArgs {
    /// The MemberCluster's name.
    pub name: String,
}

#[derive(clap::Args, Debug)]
pub struct RolloutArgs {
    #[arg(value_enum)]
    pub action: RolloutAction,
    /// The FederatedMyApp's name.
    pub name: String,
    #[arg(short = 'n', long, default_value = "default")]
    pub namespace: String,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RolloutAction {
    /// Print `status.rollout` and the Ready and Stalled conditions.
    Status,
    /// Set `spec.rollout.paused`: no cluster is sent a revision it does not run yet.
    Pause,
    /// Clear `spec.rollout.paused`: the waves go on where they stand.
    Resume,
    /// Put `spec.template` and `spec.overrides` back to the last revision a rollout
    /// completed (`status.rollout.lastComplete`): every cluster goes back to it at once.
    Abort,
}

#[derive(clap::Args, Debug)]
pub struct CertsArgs {
    /// Directory for ca.crt, ca.key, tls.crt and tls.key.
    #[arg(long)]
    pub out: PathBuf,
    /// Names and addresses agents dial the hub by (repeatable).
    #[arg(long = "san", default_values = ["localhost", "127.0.0.1"])]
    pub sans: Vec<String>,
    /// Keep the CA in the directory (ca.crt, ca.key) and issue only a new tls.crt and
    /// tls.key from it: agents, which trust ca.crt, need nothing new.
    #[arg(long)]
    pub renew: bool,
    /// How long the serving certificate is valid (the CA: ten years).
    #[arg(long, default_value = "365d", value_parser = humantime::parse_duration)]
    pub valid_for: std::time::Duration,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected key=value"))?;
    Ok((k.to_owned(), v.to_owned()))
}

const JOIN_MANAGER: &str = "flotilla-hub-join";
/// The hub's serving certificate; `join` reads its `ca.crt` when no --hub-ca-file is given.
const HUB_TLS_SECRET: &str = "flotilla-hub-tls";
const HUB_SERVICE: &str = "flotilla-hub";
const HUB_GRPC_PORT: u16 = 7443;

/// Registers the cluster (or, with `--rotate`, replaces its credential and keeps its
/// labels) and prints or writes the member install, or only the token with --token-file.
pub async fn join(kube: &KubeArgs, args: &JoinArgs) -> anyhow::Result<()> {
    use kube::api::{Api, Patch, PatchParams, PostParams};
    use std::collections::BTreeMap;
    if !crate::install::is_dns_subdomain(&args.name) {
        return Err(crate::install::InstallError::ClusterName(args.name.clone()).into());
    }
    let client = kube
        .client()
        .await
        .context("connecting to the host cluster")?;
    let token = crate::auth::issue(&args.name);
    // Everything that can fail locally is done before the host is changed.
    let install = match &args.token_file {
        Some(_) => None,
        None => {
            let install = crate::install::MemberInstall {
                cluster: args.name.clone(),
                hub_address: match &args.hub_address {
                    Some(a) => a.clone(),
                    None => hub_address_from_service(&client).await?,
                },
                hub_server_name: args.hub_server_name.clone(),
                hub_ca_pem: match &args.hub_ca_file {
                    Some(path) => std::fs::read_to_string(path)
                        .with_context(|| format!("reading --hub-ca-file {}", path.display()))?,
                    None => hub_ca_from_secret(&client).await?,
                },
                token: token.clone(),
                image: args.agent_image.clone(),
                allowed_namespaces: args.allowed_namespaces.clone(),
            };
            Some(crate::install::render(&install)?)
        }
    };

    let api: Api<flotilla_crds::MemberCluster> = Api::all(client);
    let labels: BTreeMap<_, _> = args.labels.iter().cloned().collect();
    let hash = crate::auth::token_sha256(token.expose_secret());
    let expires = crate::auth::expiry(Timestamp::now(), args.token_lifetime).to_string();
    let existing = api
        .get_opt(&args.name)
        .await
        .with_context(|| format!("reading MemberCluster {}", args.name))?;
    match existing {
        None => {
            let member: flotilla_crds::MemberCluster = serde_json::from_value(serde_json::json!({
                "apiVersion": "core.kubefed.io/v1beta1",
                "kind": "MemberCluster",
                "metadata": {"name": args.name, "labels": labels},
                "spec": {"tokenSha256": hash, "tokenExpiresAt": expires},
            }))?;
            let params = PostParams {
                field_manager: Some(JOIN_MANAGER.into()),
                ..Default::default()
            };
            api.create(&params, &member)
                .await
                .with_context(|| format!("registering MemberCluster {}", args.name))?;
        }
        Some(_) if !args.rotate => bail!(
            "MemberCluster {name} is already registered: `flotilla-hub join {name} --rotate` \
             issues a new credential (its labels are kept, the agent holding the old one is \
             disconnected); `kubectl label membercluster {name} KEY=VALUE` changes labels",
            name = args.name
        ),
        Some(_) => {
            // A merge patch: the labels given are set, every other label stays. A renewal
            // under way is dropped: only the new token is accepted.
            let mut patch = rotate_patch(&hash, &expires);
            if !labels.is_empty() {
                patch["metadata"] = serde_json::json!({"labels": labels});
            }
            let params = PatchParams {
                field_manager: Some(JOIN_MANAGER.into()),
                ..Default::default()
            };
            api.patch(&args.name, &params, &Patch::Merge(&patch))
                .await
                .with_context(|| {
                    format!("rotating the credential of MemberCluster {}", args.name)
                })?;
        }
    }
    let verb = if args.rotate {
        "credential rotated"
    } else {
        "registered"
    };
    match (&install, &args.output, &args.token_file) {
        (None, _, Some(path)) => {
            write_private(path, token.expose_secret())?;
            eprintln!(
                "MemberCluster {} {verb}; its agent token is in {}",
                args.name,
                path.display()
            );
        }
        (Some(yaml), Some(path), _) => {
            write_private(path, yaml)?;
            eprintln!(
                "MemberCluster {} {verb}; apply {} in that cluster: kubectl apply -f {}",
                args.name,
                path.display(),
                path.display()
            );
        }
        (Some(yaml), None, _) => print!("{yaml}"),
        (None, _, None) => unreachable!("without --token-file the install is rendered"),
    }
    Ok(())
}

/// What `join --rotate` writes into the MemberCluster's spec: the new token alone.
fn rotate_patch(hash: &str, expires: &str) -> Value {
    serde_json::json!({"spec": {
        "tokenSha256": hash,
        "tokenExpiresAt": expires,
        "nextTokenSha256": null,
        "nextTokenExpiresAt": null,
    }})
}

/// The external address of the hub's LoadBalancer Service.
async fn hub_address_from_service(client: &kube::Client) -> anyhow::Result<String> {
    use k8s_openapi::api::core::v1::Service;
    let api: kube::Api<Service> = kube::Api::namespaced(client.clone(), crate::install::NAMESPACE);
    let where_ = format!("Service {}/{HUB_SERVICE}", crate::install::NAMESPACE);
    let service = api
        .get_opt(HUB_SERVICE)
        .await
        .with_context(|| format!("reading {where_}"))?
        .with_context(|| format!("{where_} not found: pass --hub-address HOST:PORT"))?;
    let ingress = service
        .status
        .and_then(|s| s.load_balancer)
        .and_then(|lb| lb.ingress)
        .unwrap_or_default();
    let host = ingress
        .iter()
        .find_map(|i| i.hostname.clone().or_else(|| i.ip.clone()))
        .with_context(|| {
            format!("{where_} has no load balancer address: pass --hub-address HOST:PORT")
        })?;
    Ok(match host.parse::<std::net::Ipv6Addr>() {
        Ok(_) => format!("[{host}]:{HUB_GRPC_PORT}"),
        Err(_) => format!("{host}:{HUB_GRPC_PORT}"),
    })
}

/// `ca.crt` of the hub's TLS Secret on the host.
async fn hub_ca_from_secret(client: &kube::Client) -> anyhow::Result<String> {
    use k8s_openapi::api::core::v1::Secret;
    let api: kube::Api<Secret> = kube::Api::namespaced(client.clone(), crate::install::NAMESPACE);
    let where_ = format!("Secret {}/{HUB_TLS_SECRET}", crate::install::NAMESPACE);
    let secret = api
        .get_opt(HUB_TLS_SECRET)
        .await
        .with_context(|| format!("reading {where_}"))?
        .with_context(|| format!("{where_} not found: pass --hub-ca-file"))?;
    let ca = secret
        .data
        .and_then(|mut d| d.remove("ca.crt"))
        .with_context(|| format!("{where_} has no ca.crt: pass --hub-ca-file"))?;
    String::from_utf8(ca.0).with_context(|| format!("{where_}: ca.crt is not UTF-8 PEM"))
}

pub async fn revoke(kube: &KubeArgs, args: &RevokeArgs) -> anyhow::Result<()> {
    let client = kube
        .client()
        .await
        .context("connecting to the host cluster")?;
    revoke_member(&client, &args.name).await?;
    eprintln!(
        "MemberCluster {}: credential revoked; `flotilla-hub join {} --rotate` issues a new one",
        args.name, args.name
    );
    Ok(())
}

async fn revoke_member(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    use kube::api::{Api, Patch, PatchParams};
    let api: Api<flotilla_crds::MemberCluster> = Api::all(client.clone());
    // The next token of a renewal under way goes too (it is refused without a current
    // one, and nothing should be left to resurrect).
    let patch = serde_json::json!({"spec": {
        "tokenSha256": null,
        "tokenExpiresAt": null,
        "nextTokenSha256": null,
        "nextTokenExpiresAt": null,
    }});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("revoking MemberCluster {name}"))?;
    Ok(())
}

/// Revokes the credential first (the agent is disconnected and can apply nothing more),
/// deletes the member's managed MyApps when asked, then the MemberCluster.
pub async fn unjoin(kube: &KubeArgs, args: &UnjoinArgs) -> anyhow::Result<()> {
    use kube::api::{Api, DeleteParams, ListParams};
    let name = &args.name;
    let member_kube = KubeArgs {
        kubeconfig: args.member_kubeconfig.clone(),
        context: args.member_context.clone(),
    };
    if args.delete_workloads && member_kube == KubeArgs::default() {
        bail!("--delete-workloads needs --member-kubeconfig or --member-context of cluster {name}");
    }
    let client = kube
        .client()
        .await
        .context("connecting to the host cluster")?;
    revoke_member(&client, name).await?;
    if args.delete_workloads {
        let member = member_kube
            .client()
            .await
            .with_context(|| format!("connecting to member cluster {name}"))?;
        let myapps: Api<flotilla_crds::MyApp> = Api::all(member.clone());
        let managed = format!(
            "{}={}",
            flotilla_crds::MANAGED_BY_LABEL,
            flotilla_crds::MANAGED_BY_VALUE
        );
        let list = myapps
            .list(&ListParams::default().labels(&managed))
            .await
            .with_context(|| format!("listing the MyApps Flotilla manages in cluster {name}"))?;
        for app in &list.items {
            let ns = app.metadata.namespace.as_deref().unwrap_or("default");
            let app_name = app.metadata.name.as_deref().unwrap_or_default();
            Api::<flotilla_crds::MyApp>::namespaced(member.clone(), ns)
                .delete(app_name, &DeleteParams::background())
                .await
                .with_context(|| format!("deleting MyApp {ns}/{app_name} in cluster {name}"))?;
        }
        eprintln!(
            "cluster {name}: deleted {} MyApps Flotilla managed",
            list.items.len()
        );
    }
    let api: Api<flotilla_crds::MemberCluster> = Api::all(client);
    api.delete(name, &DeleteParams::default())
        .await
        .with_context(|| format!("deleting MemberCluster {name}"))?;
    eprintln!(
        "MemberCluster {name} removed; its agent is disconnected. In cluster {name}, remove the \
         agent with: kubectl -n {ns} delete deployment/flotilla-agent secret/{secret}",
        ns = crate::install::NAMESPACE,
        secret = crate::install::SECRET
    );
    if !args.delete_workloads {
        eprintln!(
            "Its MyApps keep running there, no longer updated by Flotilla (--delete-workloads \
             removes them)."
        );
    }
    Ok(())
}

/// Sets `spec.unschedulable` with a merge patch, so that nothing else of the spec moves.
pub async fn cordon(kube: &KubeArgs, args: &CordonArgs, unschedulable: bool) -> anyhow::Result<()> {
    use kube::api::{Api, Patch, PatchParams};
    let client = kube
        .client()
        .await
        .context("connecting to the host cluster")?;
    let api: Api<MemberCluster> = Api::all(client);
    api.patch(
        &args.name,
        &PatchParams::default(),
        &Patch::Merge(&cordon_patch(unschedulable)),
    )
    .await
    .with_context(|| format!("setting spec.unschedulable of MemberCluster {}", args.name))?;
    let what = if unschedulable {
        "cordoned: no new replicas go there, what it runs stays"
    } else {
        "uncordoned: it takes new replicas again"
    };
    eprintln!("MemberCluster {} {what}", args.name);
    Ok(())
}

/// `flotilla-hub rollout status|pause|resume|abort NAME`: reads `status.rollout`, sets
/// `spec.rollout.paused` with a merge patch (nothing else of the spec moves), or puts the
/// last complete revision's template and overrides back ([`abort_patch`]). An app that
/// rolls out all at once is refused: there is no rollout to act on.
pub async fn rollout(kube: &KubeArgs, args: &RolloutArgs) -> anyhow::Result<()> {
    use kube::api::{Api, Patch, PatchParams};
    let client = kube
        .client()
        .await
        .context("connecting to the host cluster")?;
    let api: Api<FederatedMyApp> = Api::namespaced(client, &args.namespace);
    let who = format!("FederatedMyApp {}/{}", args.namespace, args.name);
    let app = api
        .get(&args.name)
        .await
        .with_context(|| format!("reading {who}"))?;
    if args.action == RolloutAction::Status {
        print!("{}", rollout_summary(&app));
        return Ok(());
    }
    anyhow::ensure!(
        flotilla_plan::rollout::progressive(&app),
        "{who} rolls out to every cluster at once (spec.rollout.type is All or absent): there is no rollout to {}",
        format!("{:?}", args.action).to_lowercase()
    );
    if args.action == RolloutAction::Abort {
        let (patch, generation) = abort_patch(&app, &who)?;
        api.patch(
            &args.name,
            &PatchParams::default(),
            &Patch::Json::<()>(patch),
        )
        .await
        .with_context(|| format!("setting spec.template and spec.overrides of {who} back"))?;
        eprintln!(
            "{who} aborted: spec.template and spec.overrides are back to generation {generation}, the last complete revision; every cluster goes back to it at once"
        );
        return Ok(());
    }
    let paused = args.action == RolloutAction::Pause;
    api.patch(
        &args.name,
        &PatchParams::default(),
        &Patch::Merge(&paused_patch(paused)),
    )
    .await
    .with_context(|| format!("setting spec.rollout.paused of {who}"))?;
    let what = match paused {
        true => "paused: no cluster is sent a revision it does not run yet",
        false => "resumed: the waves go on where they stand",
    };
    eprintln!("{who} {what}");
    Ok(())
}

/// The JSON patch that puts `app`'s template and overrides back to its last complete
/// revision, guarded by the `resourceVersion` read (a concurrent edit makes it fail,
/// not vanish), and the generation it goes back to. Refused when there is none, when
/// status kept no copy of it, or when the app already runs it.
fn abort_patch(app: &FederatedMyApp, who: &str) -> anyhow::Result<(json_patch::Patch, i64)> {
    let rollout = app.status.as_ref().and_then(|s| s.rollout.as_ref());
    let last = rollout.and_then(|r| r.last_complete.as_ref()).with_context(|| {
        format!("{who} has no complete rollout to go back to (status.rollout.lastComplete is absent)")
    })?;
    let template = last.template.as_ref().with_context(|| {
        format!(
            "{who}: status.rollout.lastComplete (generation {}) keeps no copy of the spec (over {} bytes): set spec.template back by hand",
            last.generation,
            flotilla_plan::rollout::COPY_MAX
        )
    })?;
    anyhow::ensure!(
        (template, &last.overrides) != (&app.spec.template, &app.spec.overrides),
        "{who} already has the template and overrides of its last complete rollout (generation {}): nothing to abort",
        last.generation
    );
    let version = app.metadata.resource_version.clone().unwrap_or_default();
    let mut ops = vec![
        serde_json::json!({"op": "test", "path": "/metadata/resourceVersion", "value": version}),
        serde_json::json!({"op": "add", "path": "/spec/template", "value": template}),
    ];
    match (last.overrides.is_empty(), app.spec.overrides.is_empty()) {
        (false, _) => ops.push(
            serde_json::json!({"op": "add", "path": "/spec/overrides", "value": last.overrides}),
        ),
        (true, false) => ops.push(serde_json::json!({"op": "remove", "path": "/spec/overrides"})),
        (true, true) => {}
    }
    Ok((
        crate::writes::json_patch(Value::Array(ops)),
        last.generation,
    ))
}

/// `null` rather than `false` on resume: the field reads as absent.
fn paused_patch(paused: bool) -> Value {
    let value = if paused {
        Value::Bool(true)
    } else {
        Value::Null
    };
    serde_json::json!({"spec": {"rollout": {"paused": value}}})
}

/// What `rollout status` prints.
fn rollout_summary(app: &FederatedMyApp) -> String {
    let status = app.status.as_ref();
    let Some(r) = status.and_then(|s| s.rollout.as_ref()) else {
        return match flotilla_plan::rollout::progressive(app) {
            true => "rollout: not planned yet (no status.rollout)\n".to_owned(),
            false => "rollout: All (every cluster at once)\n".to_owned(),
        };
    };
    let mut out = format!(
        "rollout: {} at wave {} of {}\nrevision: {}\nupdated clusters: {}, held: {}\n",
        r.state, r.wave, r.waves, r.revision, r.updated_clusters, r.held_clusters
    );
    if !r.message.is_empty() {
        out.push_str(&format!("message: {}\n", r.message));
    }
    let conditions = status.map_or(&[][..], |s| s.conditions.as_slice());
    for c in conditions
        .iter()
        .filter(|c| c.type_ == "Ready" || c.type_ == "Stalled")
    {
        out.push_str(&format!("{}: {} ({})\n", c.type_, c.status, c.reason));
    }
    out
}

/// `null` rather than `false` on uncordon: the field reads as absent, as it was before.
fn cordon_patch(unschedulable: bool) -> Value {
    let value = if unschedulable {
        Value::Bool(true)
    } else {
        Value::Null
    };
    serde_json::json!({"spec": {"unschedulable": value}})
}

/// `flotilla-hub certs`: a CA (kept: ca.key) and the hub's serving certificate; with
/// `--renew`, a new serving certificate from the CA already in the directory.
pub fn certs(args: &CertsArgs) -> anyhow::Result<()> {
    use flotilla_common::tls::Ca;
    let dir = &args.out;
    let ca = if args.renew {
        let read = |f: &str| {
            std::fs::read_to_string(dir.join(f))
                .with_context(|| format!("--renew keeps the CA in {}: reading {f}", dir.display()))
        };
        let ca = Ca {
            cert_pem: read("ca.crt")?,
            key_pem: read("ca.key")?.into(),
        };
        anyhow::ensure!(
            ca.key_matches(),
            "{}: ca.key is not the key of ca.crt (or does not parse)",
            dir.display()
        );
        ca
    } else {
        Ca::generate("flotilla-hub CA")?
    };
    let tls = ca.issue_valid_for("flotilla-hub", &args.sans, args.valid_for)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut wrote = vec!["tls.crt", "tls.key"];
    if !args.renew {
        std::fs::write(dir.join("ca.crt"), &ca.cert_pem)?;
        write_private(&dir.join("ca.key"), ca.key_pem.expose_secret())?;
        wrote.extend(["ca.crt", "ca.key"]);
    }
    // The key before the certificate: a hub reloading in between finds a pair that does
    // not match, and keeps serving the old one until both are new.
    write_private(&dir.join("tls.key"), tls.key_pem.expose_secret())?;
    std::fs::write(dir.join("tls.crt"), &tls.cert_pem)?;
    eprintln!(
        "wrote {} to {} (the serving certificate valid for {} days); keep ca.key out of the cluster",
        wrote.join(", "),
        dir.display(),
        args.valid_for.as_secs() / 86_400
    );
    Ok(())
}

fn write_private(path: &Path, contents: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.write_all(contents.as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod join_tests {
    use super::*;
    use clap::Parser;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from([&["flotilla-hub"], args].concat())
    }

    #[test]
    fn join_takes_labels_address_output_and_the_host_context() {
        let cli = parse(&[
            "join",
            "paris",
            "-l",
            "region=eu",
            "--label",
            "tier=a=b",
            "--hub-address",
            "hub.example.com:7443",
            "-o",
            "paris.yaml",
            "--context",
            "host",
        ])
        .unwrap();
        let Command::Join(args) = cli.command else {
            panic!("parsed as join")
        };
        assert_eq!(
            args.labels,
            [
                ("region".into(), "eu".into()),
                ("tier".into(), "a=b".into())
            ]
        );
        assert_eq!(args.hub_address.as_deref(), Some("hub.example.com:7443"));
        assert_eq!(args.output, Some(PathBuf::from("paris.yaml")));
        assert!(!args.rotate);
        assert_eq!(cli.kube.context.as_deref(), Some("host"));
    }

    #[test]
    fn join_prints_the_install_only_when_asked() {
        let Command::Join(args) = parse(&["join", "paris", "--stdout"]).unwrap().command else {
            panic!("parsed as join")
        };
        assert!(args.stdout);
        assert_eq!((args.output, args.token_file), (None, None));
    }

    #[test]
    fn join_refuses_what_cannot_work() {
        for bad in [
            &["join", "paris", "--label", "region"][..],
            &["join", "paris", "-o", "a.yaml", "--token-file", "t"][..],
            // The credential goes to a file unless printing it is asked for.
            &["join", "paris"][..],
            &["join", "paris", "-o", "a.yaml", "--stdout"][..],
            &["join", "paris", "--token-file", "t", "--stdout"][..],
            &["join"][..],
            &["unjoin", "paris", "--member-context", "paris"][..],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        let cli = parse(&[
            "unjoin",
            "paris",
            "--delete-workloads",
            "--member-context",
            "paris",
        ])
        .unwrap();
        let Command::Unjoin(args) = cli.command else {
            panic!("parsed as unjoin")
        };
        assert!(args.delete_workloads);
    }

    #[test]
    fn version_and_completion_parse() {
        assert!(matches!(
            parse(&["version"]).unwrap().command,
            Command::Version
        ));
        assert!(parse(&["completion", "zsh"]).is_ok());
        assert!(parse(&["completion", "tcsh"]).is_err());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pause sets only `spec.rollout.paused`; resume leaves it as if never set; status
    /// prints where the rollout stands.
    #[test]
    fn rollout_pauses_resumes_and_summarises() {
        use clap::Parser;
        let parse = |args: &[&str]| Cli::try_parse_from(args);
        let cli = parse(&["flotilla-hub", "rollout", "pause", "web", "-n", "prod"]).unwrap();
        let Command::Rollout(args) = cli.command else {
            panic!("not rollout")
        };
        assert_eq!(
            (args.action, args.name.as_str()),
            (RolloutAction::Pause, "web")
        );
        assert!(parse(&["flotilla-hub", "rollout", "undo", "web"]).is_err());
        let mut app: FederatedMyApp = serde_yaml::from_str(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: web}\n\
             spec: {rollout: {type: Progressive, maxConcurrency: 1}}\n",
        )
        .unwrap();
        let mut spec = serde_json::to_value(&app.spec).unwrap();
        json_patch::merge(&mut spec, &paused_patch(true)["spec"]);
        assert_eq!(spec["rollout"]["paused"], Value::Bool(true));
        assert_eq!(spec["rollout"]["maxConcurrency"], 1);
        json_patch::merge(&mut spec, &paused_patch(false)["spec"]);
        let resumed: flotilla_crds::FederatedMyAppSpec = serde_json::from_value(spec).unwrap();
        assert_eq!(resumed, app.spec);
        assert!(rollout_summary(&app).contains("not planned yet"));
        app.status = Some(flotilla_crds::FederatedMyAppStatus {
            rollout: Some(flotilla_crds::federated::RolloutStatus {
                revision: "0123456789abcdef".into(),
                state: "Halted".into(),
                wave: 1,
                waves: 2,
                updated_clusters: 1,
                held_clusters: 2,
                message: "halted at wave 1 of 2: cluster c1".into(),
                last_complete: None,
            }),
            ..Default::default()
        });
        let summary = rollout_summary(&app);
        assert!(
            summary.starts_with("rollout: Halted at wave 1 of 2\n"),
            "{summary}"
        );
        assert!(summary.contains("message: halted at wave 1 of 2: cluster c1"));
    }

    /// Abort puts the template and overrides of the last complete revision back, guarded
    /// by the version read; refused with nothing to go back to, no copy, or nothing to do.
    #[test]
    fn abort_puts_the_last_complete_spec_back() {
        let app = |image: &str, overrides: &str| -> FederatedMyApp {
            serde_yaml::from_str(&format!(
                "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {{name: web, resourceVersion: '42'}}\n\
                 spec: {{rollout: {{type: Progressive}}, template: {{spec: {{image: '{image}', replicas: 2}}}}, overrides: {overrides}}}\n"
            ))
            .unwrap()
        };
        let c2 = "[{clusterName: c2, clusterOverrides: [{path: /spec/replicas, value: 3}]}]";
        let good = app("nginx:1", c2);
        let mut bad = app("nginx:bad", "[]");
        let last = flotilla_crds::federated::CompletedRevision {
            generation: 4,
            revisions: vec!["0123456789abcdef".into()],
            template: Some(good.spec.template.clone()),
            overrides: good.spec.overrides.clone(),
        };
        let who = "FederatedMyApp default/web";
        let err = abort_patch(&bad, who).unwrap_err().to_string();
        assert!(err.contains("no complete rollout to go back to"), "{err}");
        let with = |app: &mut FederatedMyApp,
                    last: &flotilla_crds::federated::CompletedRevision| {
            let rollout = flotilla_crds::federated::RolloutStatus {
                last_complete: Some(last.clone()),
                ..Default::default()
            };
            app.status = Some(flotilla_crds::FederatedMyAppStatus {
                rollout: Some(rollout),
                ..Default::default()
            });
        };
        with(&mut bad, &last);
        let (patch, generation) = abort_patch(&bad, who).unwrap();
        assert_eq!(generation, 4);
        let mut object = serde_json::to_value(&bad).unwrap();
        json_patch::patch(&mut object, &patch).unwrap();
        let aborted: FederatedMyApp = serde_json::from_value(object.clone()).unwrap();
        assert_eq!(
            (aborted.spec.template, aborted.spec.overrides),
            (good.spec.template.clone(), good.spec.overrides.clone())
        );
        assert_eq!(aborted.spec.rollout, bad.spec.rollout, "nothing else moves");
        // Someone changed the app since it was read: the patch fails.
        object["metadata"]["resourceVersion"] = "43".into();
        assert!(json_patch::patch(&mut object, &patch).is_err());
        // Back to no overrides: removed.
        let mut with_overrides = app("nginx:bad", c2);
        with(
            &mut with_overrides,
            &flotilla_crds::federated::CompletedRevision {
                overrides: vec![],
                ..last.clone()
            },
        );
        let (patch, _) = abort_patch(&with_overrides, who).unwrap();
        let mut object = serde_json::to_value(&with_overrides).unwrap();
        json_patch::patch(&mut object, &patch).unwrap();
        assert!(object["spec"].get("overrides").is_none());
        // Nothing to do, and no copy kept.
        let mut same = good.clone();
        with(&mut same, &last);
        assert!(
            abort_patch(&same, who)
                .unwrap_err()
                .to_string()
                .contains("nothing to abort")
        );
        with(
            &mut bad,
            &flotilla_crds::federated::CompletedRevision {
                template: None,
                ..last
            },
        );
        assert!(
            abort_patch(&bad, who)
                .unwrap_err()
                .to_string()
                .contains("keeps no copy")
        );
    }

    /// `certs` keeps the CA's key (owner-only); `--renew` issues a new serving pair from
    /// the same CA and leaves the CA as it was; without a CA, or with another CA's key,
    /// it is refused.
    #[test]
    fn certs_keep_the_ca_and_renew_from_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("flotilla-certs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let args = |renew: bool| CertsArgs {
            out: dir.clone(),
            sans: vec!["localhost".into()],
            renew,
            valid_for: std::time::Duration::from_secs(86_400),
        };
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
        let err = certs(&args(true)).unwrap_err();
        assert!(format!("{err:#}").contains("reading ca.crt"), "{err:#}");
        certs(&args(false)).unwrap();
        for key in ["ca.key", "tls.key"] {
            let mode = std::fs::metadata(dir.join(key))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{key}");
        }
        let (ca, ca_key, leaf) = (read("ca.crt"), read("ca.key"), read("tls.crt"));
        certs(&args(true)).unwrap();
        assert_eq!(
            (read("ca.crt"), read("ca.key")),
            (ca.clone(), ca_key),
            "the CA kept"
        );
        assert_ne!(read("tls.crt"), leaf, "a new serving certificate");
        // The new pair is one (the key is the certificate's) and loads as the hub does.
        crate::serving::ServingCert::load(dir.join("tls.crt"), dir.join("tls.key")).unwrap();
        let other = flotilla_common::tls::Ca::generate("other").unwrap();
        std::fs::write(dir.join("ca.key"), other.key_pem.expose_secret()).unwrap();
        let err = certs(&args(true)).unwrap_err();
        assert!(
            format!("{err:#}").contains("not the key of ca.crt"),
            "{err:#}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cordon_patches_only_unschedulable() {
        assert_eq!(
            cordon_patch(true),
            serde_json::json!({"spec": {"unschedulable": true}})
        );
        assert_eq!(
            cordon_patch(false),
            serde_json::json!({"spec": {"unschedulable": null}})
        );
        // Merged onto a spec, uncordon leaves it as if never cordoned.
        let mut spec = serde_json::json!({"spec": {"tokenSha256": "ab", "unschedulable": true}});
        json_patch::merge(&mut spec, &cordon_patch(false));
        let spec: MemberClusterSpec = serde_json::from_value(spec["spec"].clone()).unwrap();
        assert_eq!(
            spec,
            MemberClusterSpec {
                token_sha256: Some("ab".into()),
                unschedulable: false,
                ..Default::default()
            }
        );
    }

    #[test]
    fn rotation_leaves_only_the_new_token() {
        let mut member = serde_json::json!({"spec": {
            "tokenSha256": "old", "tokenExpiresAt": "2026-01-01T00:00:00Z",
            "nextTokenSha256": "next", "nextTokenExpiresAt": "2026-02-01T00:00:00Z",
            "unschedulable": true,
        }});
        json_patch::merge(&mut member, &rotate_patch("new", "2027-01-01T00:00:00Z"));
        let spec: MemberClusterSpec = serde_json::from_value(member["spec"].clone()).unwrap();
        assert_eq!(spec.token_sha256.as_deref(), Some("new"));
        assert_eq!(
            spec.token_expires_at.map(|t| t.0.to_string()).as_deref(),
            Some("2027-01-01T00:00:00Z")
        );
        assert_eq!(
            (spec.next_token_sha256, spec.next_token_expires_at),
            (None, None)
        );
        assert!(spec.unschedulable, "nothing else changes");
    }

    #[test]
    fn members_carry_cordon_readiness_and_capacity() {
        let now: Timestamp = "2025-01-01T01:00:00Z".parse().unwrap();
        let yaml = "- metadata: {name: a, labels: {region: eu}}\n  spec: {unschedulable: true}\n\
                    - metadata: {name: b}\n  status:\n    conditions: [{type: Ready, status: 'False', reason: AgentSilent, message: '', lastTransitionTime: '2025-01-01T00:00:00Z'}]\n    \
                    capacity: {nodes: 1, allocatable: {cpuMillis: 1000, memoryBytes: 1}, requested: {cpuMillis: 0, memoryBytes: 0}, largestFree: {cpuMillis: 1000, memoryBytes: 1}}\n";
        let m = parse_members(yaml, now).unwrap();
        assert!(m["a"].unschedulable);
        assert_eq!(m["a"].labels["region"], "eu");
        assert_eq!(m["a"].not_ready_for, None);
        assert_eq!(
            m["b"].not_ready_for,
            Some(std::time::Duration::from_secs(3600))
        );
        assert_eq!(m["b"].capacity.as_ref().unwrap().nodes, 1);
    }

    #[test]
    fn a_bad_member_spec_names_the_cluster() {
        let e = parse_members(
            "- metadata: {name: a}\n  spec: {unschedulable: maybe}\n",
            Timestamp::UNIX_EPOCH,
        )
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("MemberCluster a: invalid spec"),
            "{e:#}"
        );
    }
}
