//! The install manifests against real apiservers: every kustomization, the Helm chart
//! and the member install `flotilla-hub join` prints pass a server-side dry run, which
//! runs what the offline checks of `deploy/verify.sh` cannot: the apiserver's defaulting
//! and validation, CRD schemas and CEL rules, and RBAC's escalation check.
//!
//! It uses the tools `deploy/verify.sh` caches (helm, the Prometheus Operator CRDs for
//! the monitoring overlays): run that first, as `.ci/run` does.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use flotilla_e2e::Env;
use flotilla_e2e::federation::Federation;
use flotilla_e2e::support::workspace_root;

fn tools() -> PathBuf {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache/flotilla/tools")
}

/// The newest cached directory whose name starts with `prefix`.
fn cached(prefix: &str) -> Result<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(tools())
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    found.sort();
    found.pop().with_context(|| {
        format!(
            "no {prefix}* in {}: run `bash deploy/verify.sh` first (it builds the tools this test uses)",
            tools().display()
        )
    })
}

/// Runs `program args`, feeding `stdin`; fails with its stderr.
fn run(program: &Path, args: &[&str], kubeconfig: &Path, stdin: Option<&[u8]>) -> Result<String> {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env("KUBECONFIG", kubeconfig)
        .current_dir(workspace_root())
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("running {cmd:?}"))?;
    if let Some(input) = stdin {
        use std::io::Write;
        child.stdin.take().unwrap().write_all(input)?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "`{} {}` failed: {}",
            program.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn kubectl() -> PathBuf {
    PathBuf::from("kubectl")
}

/// `kubectl apply --dry-run=server` of `manifests`; the names of what would be applied.
fn dry_run(kubeconfig: &Path, what: &str, manifests: &[u8]) -> Result<Vec<String>> {
    let out = run(
        &kubectl(),
        &["apply", "--dry-run=server", "-o", "name", "-f", "-"],
        kubeconfig,
        Some(manifests),
    )
    .with_context(|| format!("server-side dry run of {what}"))?;
    Ok(out.lines().map(str::to_owned).collect())
}

/// The namespace everything installs into, for real: a dry run does not create it.
fn namespace(kubeconfig: &Path) -> Result<()> {
    let ns = b"apiVersion: v1\nkind: Namespace\nmetadata: {name: flotilla-system}\n";
    run(&kubectl(), &["apply", "-f", "-"], kubeconfig, Some(ns)).map(drop)
}

#[tokio::test]
async fn manifests_pass_a_server_side_dry_run() -> Result<()> {
    let env = Env::load_ready().await?;
    let host = env.kubeconfig(env.host())?.to_path_buf();
    namespace(&host)?;
    // The monitoring overlays need the Prometheus Operator's CRDs.
    let crds = cached("prometheus-operator-crds-")?;
    for kind in ["servicemonitors", "prometheusrules"] {
        let file = crds.join(format!("monitoring.coreos.com_{kind}.yaml"));
        let text = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
        run(
            &kubectl(),
            &["apply", "--server-side", "-f", "-"],
            &host,
            Some(&text),
        )?;
        run(
            &kubectl(),
            &[
                "wait",
                "--for=condition=Established",
                &format!("crd/{kind}.monitoring.coreos.com"),
            ],
            &host,
            None,
        )?;
    }

    let mut report = Vec::new();
    for kustomization in [
        "deploy/base",
        "deploy/hub",
        "deploy/overlays/hub-nodeport",
        "deploy/overlays/hub-production",
        "deploy/overlays/member",
        "deploy/overlays/production",
    ] {
        let built = run(&kubectl(), &["kustomize", kustomization], &host, None)?;
        let applied = dry_run(&host, kustomization, built.as_bytes())?;
        report.push(format!("{kustomization}: {} objects", applied.len()));
    }

    // The chart, hub and agent, with its Prometheus Operator objects.
    let helm = cached("helm-")?.join("helm");
    let chart = run(
        &helm,
        &[
            "template",
            "flotilla",
            "charts/flotilla",
            "--namespace",
            "flotilla-system",
            "--set",
            "agent.enabled=true",
            "--set",
            "agent.mode=operator",
            "--set",
            "monitoring.enabled=true",
        ],
        &host,
        None,
    )?;
    let applied = dry_run(&host, "the Helm chart", chart.as_bytes())?;
    report.push(format!("charts/flotilla: {} objects", applied.len()));

    // What `join` prints. Dry-run on the host, as on a fresh member: the e2e members'
    // MyApp CRDs already point their conversion at the local agents by URL, which the
    // printed CRD's Service reference would conflict with (in a real member the agent
    // points it at that same Service).
    let f = Federation::load(&env)?;
    let file = env.dir.join("federation").join("dry-run-join.yaml");
    f.hub_cli()?.run(&[
        "join",
        "dry-run-e2e",
        "--hub-address",
        "hub.example.com:7443",
        "--hub-ca-file",
        &f.hub_ca.to_string_lossy(),
        "-o",
        &file.to_string_lossy(),
    ])?;
    let install = std::fs::read(&file)?;
    let joined = dry_run(&host, "the join output", &install);
    let removed = f.hub_cli()?.run(&["unjoin", "dry-run-e2e"]);
    let _ = std::fs::remove_file(&file);
    let joined = joined?;
    removed?;
    report.push(format!("join output: {} objects", joined.len()));
    println!("server-side dry run passed: {}", report.join("; "));
    Ok(())
}
