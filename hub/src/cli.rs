//! Command line: `render` (offline preview) and `crds`; `run` and `join` drive the hub.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand, ValueEnum};
use flotilla_crds::FederatedMyApp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use serde_json::Value;

use crate::placement::Members;
use crate::render::{self, Rendered};

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
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the hub against the host cluster (kubeconfig or in-cluster config).
    Run(crate::run::RunArgs),
    /// Register a member cluster (or rotate its credential) and issue its agent's token.
    Join(JoinArgs),
    /// Revoke a member cluster's credential: its agent is disconnected and refused.
    Revoke(RevokeArgs),
    /// Write a CA and a serving certificate for the hub's gRPC endpoint.
    Certs(CertsArgs),
    /// Preview, offline, exactly the MyApp each cluster would get.
    Render(RenderArgs),
    /// Print the CustomResourceDefinitions Flotilla installs.
    Crds,
}

#[derive(clap::Args, Debug)]
pub struct RenderArgs {
    /// The FederatedMyApp YAML or JSON (`-` reads standard input).
    #[arg(short = 'f', long = "filename")]
    pub file: PathBuf,
    /// MemberCluster objects (a list, a `kind: List`, or a multi-document stream); only
    /// names and labels matter. Without it, every cluster named in `placement.clusters`
    /// counts as registered with no labels.
    #[arg(long)]
    pub clusters: Option<PathBuf>,
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Yaml)]
    pub output: Output,
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
    let members = match &args.clusters {
        Some(path) => {
            parse_members(&read(path)?).with_context(|| format!("reading {}", path.display()))?
        }
        None => named_members(&app),
    };
    let object = format!(
        "FederatedMyApp {}/{}",
        app.metadata.namespace.as_deref().unwrap_or("default"),
        app.metadata.name.as_deref().unwrap_or_default()
    );
    let rendered = render::render(&app, &members).with_context(|| object.clone())?;
    Ok(report(&object, &rendered, args.output))
}

fn report(object: &str, rendered: &Rendered, output: Output) -> RenderReport {
    let mut stderr: Vec<String> = rendered
        .warnings
        .iter()
        .map(|w| format!("warning: {object}: {w}"))
        .collect();
    stderr.extend(
        rendered
            .errors()
            .map(|(c, e)| format!("error: {object}, cluster {c}: {e}")),
    );
    let ok = rendered
        .clusters
        .iter()
        .filter_map(|(c, r)| Some((c, r.as_ref().ok()?.to_value())));
    let stdout = match output {
        Output::Json => {
            let map: serde_json::Map<String, Value> = ok.map(|(c, v)| (c.clone(), v)).collect();
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
        failed: rendered.errors().next().is_some(),
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
        .map(|c| (c.name.clone(), Default::default()))
        .collect()
}

/// MemberClusters from YAML: a sequence, a `kind: List` with `items`, or documents.
pub fn parse_members(yaml: &str) -> anyhow::Result<Members> {
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
            members.insert(name, meta.labels.unwrap_or_default());
        }
    }
    Ok(members)
}

#[derive(clap::Args, Debug)]
pub struct JoinArgs {
    /// The member cluster's name (a DNS-1123 subdomain).
    pub name: String,
    /// Labels for placement selectors, `key=value` (repeatable).
    #[arg(long = "label", short = 'l', value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Write the agent's token here (mode 0600) instead of standard output.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct RevokeArgs {
    pub name: String,
}

#[derive(clap::Args, Debug)]
pub struct CertsArgs {
    /// Directory for ca.crt, tls.crt and tls.key.
    #[arg(long)]
    pub out: PathBuf,
    /// Names and addresses agents dial the hub by (repeatable).
    #[arg(long = "san", default_values = ["localhost", "127.0.0.1"])]
    pub sans: Vec<String>,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected key=value"))?;
    Ok((k.to_owned(), v.to_owned()))
}

const JOIN_MANAGER: &str = "flotilla-hub-join";

/// Creates or updates the MemberCluster with a fresh token; only its hash is stored.
pub async fn join(args: &JoinArgs) -> anyhow::Result<()> {
    use kube::api::{Api, Patch, PatchParams};
    let token = crate::auth::issue(&args.name);
    let labels: std::collections::BTreeMap<_, _> = args.labels.iter().cloned().collect();
    let member = serde_json::json!({
        "apiVersion": "core.kubefed.io/v1beta1",
        "kind": "MemberCluster",
        "metadata": {"name": args.name, "labels": labels},
        "spec": {"tokenSha256": crate::auth::token_sha256(&token)},
    });
    let client = kube::Client::try_default()
        .await
        .context("connecting to the host cluster")?;
    let api: Api<flotilla_crds::MemberCluster> = Api::all(client);
    api.patch(
        &args.name,
        &PatchParams::apply(JOIN_MANAGER).force(),
        &Patch::Apply(&member),
    )
    .await
    .with_context(|| format!("registering MemberCluster {}", args.name))?;
    match &args.token_file {
        Some(path) => {
            write_private(path, &token)?;
            eprintln!(
                "MemberCluster {} registered; its agent token is in {}",
                args.name,
                path.display()
            );
        }
        None => println!("{token}"),
    }
    Ok(())
}

pub async fn revoke(args: &RevokeArgs) -> anyhow::Result<()> {
    use kube::api::{Api, Patch, PatchParams};
    let client = kube::Client::try_default()
        .await
        .context("connecting to the host cluster")?;
    let api: Api<flotilla_crds::MemberCluster> = Api::all(client);
    let patch = serde_json::json!({"spec": {"tokenSha256": null}});
    api.patch(&args.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("revoking MemberCluster {}", args.name))?;
    eprintln!(
        "MemberCluster {}: credential revoked; `flotilla-hub join {}` issues a new one",
        args.name, args.name
    );
    Ok(())
}

pub fn certs(args: &CertsArgs) -> anyhow::Result<()> {
    let tls = flotilla_common::tls::self_signed("flotilla-hub CA", "flotilla-hub", &args.sans)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    std::fs::write(args.out.join("ca.crt"), &tls.ca_pem)?;
    std::fs::write(args.out.join("tls.crt"), &tls.cert_pem)?;
    write_private(&args.out.join("tls.key"), &tls.key_pem)?;
    eprintln!(
        "wrote ca.crt, tls.crt and tls.key to {}",
        args.out.display()
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
