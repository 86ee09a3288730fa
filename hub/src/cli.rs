//! Command line: `render` (offline preview) and `crds`; `run`, `join`, `revoke`, `cordon`
//! and `uncordon` drive the hub.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand, ValueEnum};
use flotilla_crds::member::{MemberClusterSpec, MemberClusterStatus};
use flotilla_crds::{FederatedMyApp, MemberCluster};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use serde::Deserialize;
use serde_json::Value;

use crate::placement::{Member, Members};
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
    /// Keep new replicas off a member cluster; what it runs stays.
    Cordon(CordonArgs),
    /// Let new replicas onto a cordoned member cluster again.
    Uncordon(CordonArgs),
    /// Print the CustomResourceDefinitions Flotilla installs.
    Crds,
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
    let rendered = render::render(&app, &members).with_context(|| object.clone())?;
    Ok(report(&object, &rendered, args.output))
}

fn report(object: &str, rendered: &Rendered, output: Output) -> RenderReport {
    let mut stderr: Vec<String> = rendered
        .warnings
        .iter()
        .map(|w| format!("warning: {object}: {w}"))
        .collect();
    let schedule = &rendered.schedule;
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
    let failed_over = |e: &&render::ClusterError| matches!(e, render::ClusterError::FailedOver);
    stderr.extend(rendered.errors().map(|(c, e)| {
        let level = if failed_over(&e) { "note" } else { "error" };
        format!("{level}: {object}, cluster {c}: {e}")
    }));
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
        failed: rendered.errors().any(|(_, e)| !failed_over(&e)),
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
            members.insert(name, Member::from_cluster(&mc, now));
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
pub struct CordonArgs {
    /// The MemberCluster's name.
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
    use base64::Engine;
    use kube::api::{Api, Patch, PatchParams};
    let mut secret = [0u8; 32];
    rand::fill(&mut secret);
    let token = format!(
        "{}.{}",
        args.name,
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret)
    );
    let labels: std::collections::BTreeMap<_, _> = args.labels.iter().cloned().collect();
    let member = serde_json::json!({
        "apiVersion": "core.kubefed.io/v1beta1",
        "kind": "MemberCluster",
        "metadata": {"name": args.name, "labels": labels},
        "spec": {"tokenSha256": crate::server::token_sha256(&token)},
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

/// Sets `spec.unschedulable` with a merge patch, so that nothing else of the spec moves.
pub async fn cordon(args: &CordonArgs, unschedulable: bool) -> anyhow::Result<()> {
    use kube::api::{Api, Patch, PatchParams};
    let client = kube::Client::try_default()
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

/// `null` rather than `false` on uncordon: the field reads as absent, as it was before.
fn cordon_patch(unschedulable: bool) -> Value {
    let value = if unschedulable {
        Value::Bool(true)
    } else {
        Value::Null
    };
    serde_json::json!({"spec": {"unschedulable": value}})
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

#[cfg(test)]
mod tests {
    use super::*;

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
                unschedulable: false
            }
        );
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
