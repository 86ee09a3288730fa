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
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
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
