//! The install manifests against real apiservers: every kustomization, the Helm chart
//! and the member install `flotilla-hub join` prints pass a server-side dry run, which
//! runs what the offline checks of `deploy/verify.sh` cannot: the apiserver's defaulting
//! and validation, CRD schemas and CEL rules, and RBAC's escalation check.
//!
//! It uses the tools `deploy/verify.sh` caches (helm, the Prometheus Operator CRDs for
//! the monitoring overlays): run that first, as `.ci/run` does.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use flotilla_e2e::run_against as run;
use flotilla_lab::Env;
use flotilla_lab::federation::Federation;
use flotilla_lab::support::{cached_tool, workspace_root};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;

/// Both tests write to the host (its MyApp CRD, `flotilla-system`): one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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
    let _one = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let host = env.kubeconfig(env.host())?.to_path_buf();
    namespace(&host)?;
    // The monitoring overlays need the Prometheus Operator's CRDs.
    let crds = cached_tool("prometheus-operator-crds-")?;
    for kind in ["servicemonitors", "prometheusrules"] {
        let file = crds.join(format!("monitoring.coreos.com_{kind}.yaml"));
        let text = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
        run(
            &kubectl(),
            &["apply", "--server-side", "-f", "-"],
            &host,
            Some(&text),
        )?;
        // Not `kubectl wait --for=condition=Established`: it fails at once on a CRD
        // whose status has no conditions yet (".status.conditions accessor error").
        let crds: Api<CustomResourceDefinition> = Api::all(env.client(env.host()).await?);
        flotilla_lab::await_object(
            &crds,
            &format!("{kind}.monitoring.coreos.com"),
            std::time::Duration::from_secs(60),
            &format!("CRD {kind}.monitoring.coreos.com Established"),
            |crd: Option<&CustomResourceDefinition>| {
                crd.is_some_and(flotilla_lab::cluster::established)
            },
        )
        .await?;
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
    let helm = cached_tool("helm-")?.join("helm");
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
            "--set",
            "hub.clusterInventory.installCRDs=true",
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
    f.hub_cli(&env)?.run(&[
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
    let removed = f.hub_cli(&env)?.run(&["unjoin", "dry-run-e2e"]);
    let _ = std::fs::remove_file(&file);
    let joined = joined?;
    removed?;
    report.push(format!("join output: {} objects", joined.len()));
    println!("server-side dry run passed: {}", report.join("; "));
    Ok(())
}

/// A cluster joins with what `flotilla-hub join` prints and nothing else: the stream is
/// applied for real (here to the host, which runs no agent of its own: a second agent on
/// a member's apiserver would see that member's MyApps), and the agent runs as a local
/// process (KWOK pods run no containers) with the Deployment's own arguments, the
/// Secret's token and CA, and a token of the ServiceAccount the stream created. A
/// FederatedMyApp placed on the new cluster reaches it; unjoin removes it again.
#[tokio::test]
async fn a_cluster_joins_with_the_join_output_alone() -> Result<()> {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::Api;

    const NAME: &str = "joined-e2e";
    let _one = ONE_AT_A_TIME.lock().await;
    let OnHost {
        env,
        f,
        host,
        host_client,
        dir,
    } = on_host(NAME).await?;
    let file = dir.join("install.yaml");
    let grpc = f.hub_grpc.trim_start_matches("https://").to_owned();
    f.hub_cli(&env)?.run(&[
        "join",
        NAME,
        "--hub-address",
        &grpc,
        "--hub-server-name",
        "localhost",
        "--hub-ca-file",
        &f.hub_ca.to_string_lossy(),
        "-o",
        &file.to_string_lossy(),
    ])?;
    let crds: Api<CustomResourceDefinition> = Api::all(host_client.clone());
    let conversion_before = crds.get("myapps.app.example.com").await?.spec.conversion;
    let result = async {
        run(
            &kubectl(),
            &[
                "apply",
                "--server-side",
                "--force-conflicts",
                "-f",
                &file.to_string_lossy(),
            ],
            &host,
            None,
        )?;

        // The agent as the Deployment runs it.
        let deployment: Deployment = Api::namespaced(host_client.clone(), "flotilla-system")
            .get("flotilla-agent")
            .await?;
        let container = &deployment.spec.unwrap().template.spec.unwrap().containers[0];
        let secret: Secret = Api::namespaced(host_client.clone(), "flotilla-system")
            .get("flotilla-hub-credentials")
            .await?;
        let data = secret.data.unwrap_or_default();
        let (token_file, ca_file) = (dir.join("token"), dir.join("ca.crt"));
        std::fs::write(
            &token_file,
            &data.get("token").context("the Secret has no token")?.0,
        )?;
        std::fs::write(
            &ca_file,
            &data.get("ca.crt").context("the Secret has no ca.crt")?.0,
        )?;
        let args = local_args(container.args.clone(), &token_file, &ca_file)?;
        // Its identity: a token of the ServiceAccount the stream created.
        let sa_kubeconfig = dir.join("kubeconfig.yaml");
        service_account_kubeconfig(&host, "flotilla-system/flotilla-agent", &sa_kubeconfig)?;
        // Its rights on Secrets: its credentials Secret read and patched (a renewed token is
        // stored there), no other Secret, and nothing else done to that one.
        for (verb, resource, want) in [
            ("get", "secrets/flotilla-hub-credentials", "yes"),
            ("patch", "secrets/flotilla-hub-credentials", "yes"),
            ("delete", "secrets/flotilla-hub-credentials", "no"),
            ("get", "secrets/flotilla-hub-tls", "no"),
            ("list", "secrets", "no"),
        ] {
            let out = Command::new(kubectl())
                .args(["auth", "can-i", verb, resource, "-n", "flotilla-system"])
                .env("KUBECONFIG", &sa_kubeconfig)
                .output()?;
            let got = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            anyhow::ensure!(
                got == want,
                "the agent's ServiceAccount: can-i {verb} {resource} says {got:?}, want {want:?}"
            );
        }
        let agent = spawn_agent(&env, &f, NAME, &args, &sa_kubeconfig, "flotilla-system")?;
        let outcome = place_and_delete(&host_client, NAME, "default", "joined-app").await;
        let stopped = agent.stop(std::time::Duration::from_secs(10));
        let _ = flotilla_lab::process::forget(&env.dir, &agent.name);
        outcome?;
        stopped
    }
    .await;
    let removed = f.hub_cli(&env)?.run(&["unjoin", NAME]);
    // The stream pointed the host's MyApp CRD at an agent Service that has no Pods here.
    let restored = restore_conversion(&crds, conversion_before).await;
    result?;
    removed?;
    restored?;
    Ok(())
}

/// The host's side of a test that runs an agent of its own there, as cluster `name`.
struct OnHost {
    env: Env,
    f: Federation,
    host: PathBuf,
    host_client: kube::Client,
    /// The test's files.
    dir: PathBuf,
}

async fn on_host(name: &str) -> Result<OnHost> {
    let env = Env::load_ready().await?;
    let f = Federation::load(&env)?;
    let host = env.kubeconfig(env.host())?.to_path_buf();
    let host_client = env.client(env.host()).await?;
    let dir = env.dir.join("federation").join(name);
    std::fs::create_dir_all(&dir)?;
    Ok(OnHost {
        env,
        f,
        host,
        host_client,
        dir,
    })
}

/// Puts the host's MyApp CRD's conversion back as it was before an agent under test
/// pointed it at its own Service (which has no Pods here).
async fn restore_conversion(
    crds: &Api<CustomResourceDefinition>,
    before: Option<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceConversion>,
) -> Result<()> {
    use kube::api::{Patch, PatchParams};
    let restore = match before.as_ref().map(|c| c.strategy.as_str()) {
        Some("Webhook") => serde_json::json!({"spec": {"conversion": before}}),
        _ => serde_json::json!({"spec": {"conversion": {"strategy": "None", "webhook": null}}}),
    };
    let patch = Patch::Merge(&restore);
    crds.patch("myapps.app.example.com", &PatchParams::default(), &patch)
        .await?;
    Ok(())
}

/// A Deployment's agent arguments for a local process: its files and listen addresses
/// replaced by local ones (the token file only where it reads one).
fn local_args(args: Option<Vec<String>>, token_file: &Path, ca_file: &Path) -> Result<Vec<String>> {
    let (http, webhook, scaler) = (
        flotilla_lab::support::free_addr()?,
        flotilla_lab::support::free_addr()?,
        flotilla_lab::support::free_addr()?,
    );
    let local = (args.unwrap_or_default().into_iter())
        .map(|a| match a.split_once('=') {
            Some(("--token-file", _)) => format!("--token-file={}", token_file.display()),
            Some(("--hub-ca-file", _)) => format!("--hub-ca-file={}", ca_file.display()),
            Some(("--http-addr", _)) => format!("--http-addr={http}"),
            Some(("--webhook-addr", _)) => format!("--webhook-addr={webhook}"),
            Some(("--scaler-addr", _)) => format!("--scaler-addr={scaler}"),
            _ => a,
        })
        .collect();
    Ok(local)
}

/// Writes to `file` a kubeconfig of `host`'s cluster that authenticates as the
/// ServiceAccount `account` (`namespace/name`), with a token of it.
fn service_account_kubeconfig(host: &Path, account: &str, file: &Path) -> Result<()> {
    let (namespace, name) = account.split_once('/').context("namespace/name")?;
    let token = run(
        &kubectl(),
        &["create", "token", name, "-n", namespace, "--duration=1h"],
        host,
        None,
    )?;
    let mut kubeconfig: serde_json::Value = serde_yaml::from_str(&std::fs::read_to_string(host)?)?;
    for user in kubeconfig["users"].as_array_mut().context("users")? {
        user["user"] = serde_json::json!({"token": token.trim()});
    }
    std::fs::write(file, serde_yaml::to_string(&kubeconfig)?)?;
    Ok(())
}

/// Runs the e2e's agent binary as `flotilla-agent` of `namespace` would, with `args`
/// and the identity in `kubeconfig`.
fn spawn_agent(
    env: &Env,
    f: &Federation,
    cluster: &str,
    args: &[String],
    kubeconfig: &Path,
    namespace: &str,
) -> Result<flotilla_lab::process::ProcessRecord> {
    let program = &f.components[&flotilla_lab::federation::agent_name("cluster1")].program;
    let mut cmd = std::process::Command::new(program);
    cmd.args(args)
        .env("KUBECONFIG", kubeconfig)
        .env("POD_NAMESPACE", namespace)
        .env("FLOTILLA_LEADER_ELECT", "true");
    env.spawn(&format!("agent-{cluster}"), &mut cmd)
}

/// Once `cluster` is Ready, places `namespace/name` on it alone, waits for its MyApp on
/// the host (where the agent under test writes), deletes it and waits until both are
/// gone.
async fn place_and_delete(
    host: &kube::Client,
    cluster: &str,
    namespace: &str,
    name: &str,
) -> Result<()> {
    use kube::api::{DeleteParams, Patch, PatchParams};
    const WAIT: std::time::Duration = std::time::Duration::from_secs(60);
    flotilla_lab::federation::wait_member_ready(host, cluster, true, WAIT).await?;
    let app = serde_json::json!({
        "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"placement": {"clusters": [{"name": cluster}]},
                 "template": {"spec": {"replicas": 2, "image": "nginx:1.27"}}},
    });
    let fedapps: Api<flotilla_crds::FederatedMyApp> = Api::namespaced(host.clone(), namespace);
    fedapps
        .patch(name, &PatchParams::apply("e2e"), &Patch::Apply(&app))
        .await?;
    let myapps: Api<flotilla_crds::MyApp> = Api::namespaced(host.clone(), namespace);
    let what = format!("{namespace}/{name} in cluster {cluster}");
    let applied = |a: Option<&flotilla_crds::MyApp>| a.is_some_and(|a| a.spec.replicas == Some(2));
    flotilla_lab::await_object(&myapps, name, WAIT, &what, applied).await?;
    let _ = fedapps.delete(name, &DeleteParams::default()).await;
    let what = format!("{namespace}/{name} deleted everywhere");
    flotilla_lab::wait_for(WAIT, &what, || async {
        Ok(
            (fedapps.get_opt(name).await?.is_none() && myapps.get_opt(name).await?.is_none())
                .then_some(()),
        )
    })
    .await?;
    Ok(())
}

/// A right as `kubectl auth can-i --list` shows it: resource, resource names, verbs.
type Right = (String, String, BTreeSet<String>);

/// Rights with the same resource and names as one, their verbs together (can-i merges
/// the rules of several roles so).
fn merged(rights: impl IntoIterator<Item = Right>) -> BTreeSet<Right> {
    let mut by: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    for (resource, names, verbs) in rights {
        by.entry((resource, names)).or_default().extend(verbs);
    }
    by.into_iter().map(|((r, n), v)| (r, n, v)).collect()
}

/// The rights docs/security.md's RBAC table under `heading` documents in the namespace
/// the table calls `namespace`: rows of scope `cluster`, of that namespace, and of scope
/// `MyApp namespaces` when `myapps` (an install that grants them there).
fn documented(heading: &str, namespace: &str, myapps: bool) -> Result<BTreeSet<Right>> {
    let docs = std::fs::read_to_string(workspace_root().join("docs/security.md"))?;
    let section = docs
        .split("\n### ")
        .find(|s| s.starts_with(heading))
        .with_context(|| format!("docs/security.md has no section {heading:?}"))?;
    let rows = section
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| Resource") && !l.starts_with("|---"))
        .map(|l| l.split('|').map(str::trim).collect::<Vec<_>>())
        .filter(|cells| {
            cells[4] == "cluster"
                || cells[4] == namespace
                || (myapps && cells[4] == "MyApp namespaces")
        })
        .map(|cells| {
            let verbs = cells[3].split_whitespace().map(str::to_owned).collect();
            (cells[1].to_owned(), cells[2].to_owned(), verbs)
        });
    Ok(merged(rows))
}

/// What ServiceAccount `account` (`namespace/name`) may do in `namespace`, as the
/// apiserver answers `kubectl auth can-i --list` (by impersonation), without what every
/// authenticated user may (the self-reviews, the discovery URLs).
fn granted(kubeconfig: &Path, account: &str, namespace: &str) -> Result<BTreeSet<Right>> {
    let who = format!(
        "--as=system:serviceaccount:{}",
        account.replacen('/', ":", 1)
    );
    let out = run(
        &kubectl(),
        &["auth", "can-i", "--list", &who, "-n", namespace],
        kubeconfig,
        None,
    )?;
    let list = |s: &str| -> String { s.trim_matches(['[', ']']).to_owned() };
    let rows = out.lines().skip(1).filter_map(|line| {
        let resource = line
            .split_whitespace()
            .next()
            .filter(|_| !line.starts_with(' '))?;
        if resource.starts_with("selfsubject") {
            return None;
        }
        // Resources, [non-resource URLs], [names], [verbs].
        let bracketed: Vec<&str> = line.match_indices('[').map(|(i, _)| &line[i..]).collect();
        let field = |i: usize| {
            bracketed
                .get(i)
                .map(|s| list(&s[..s.find(']').map_or(s.len(), |e| e + 1)]))
        };
        let names = field(1)?;
        let verbs = field(2)?.split_whitespace().map(str::to_owned).collect();
        Some((resource.to_owned(), names, verbs))
    });
    Ok(merged(rows))
}

/// The hub's and the agent's ServiceAccounts may do exactly what docs/security.md's RBAC
/// tables say, in their own namespace and in another one: a right added to a manifest
/// without its row (or a row without its right) fails here.
#[tokio::test]
async fn service_accounts_hold_exactly_the_documented_rights() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let host = env.kubeconfig(env.host())?.to_path_buf();
    let member = env.kubeconfig(env.members()[0])?.to_path_buf();
    // The member install's identity: its Namespace, ServiceAccount and roles.
    let built = run(
        &kubectl(),
        &["kustomize", "deploy/overlays/member"],
        &member,
        None,
    )?;
    apply_identity(&member, &built, &["Namespace"])?;

    for (heading, kubeconfig, account) in [
        ("The hub ", &host, "flotilla-system/flotilla-hub"),
        ("The agent ", &member, "flotilla-system/flotilla-agent"),
    ] {
        for namespace in ["flotilla-system", "default"] {
            holds_exactly(heading, kubeconfig, account, (namespace, namespace), true)?;
        }
    }
    Ok(())
}

/// Applies what of `manifests` makes an install's identity: its ServiceAccounts, roles
/// and bindings, and the objects of the kinds `also`.
fn apply_identity(kubeconfig: &Path, manifests: &str, also: &[&str]) -> Result<()> {
    let mut kinds = vec![
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ClusterRole",
        "ClusterRoleBinding",
    ];
    kinds.extend(also);
    let identity = flotilla_e2e::of_kinds(manifests, &kinds)?;
    let apply = ["apply", "-f", "-"];
    run(&kubectl(), &apply, kubeconfig, Some(identity.as_bytes())).map(drop)
}

/// `account` holds exactly the rights the table under `heading` documents in namespace
/// `namespace.0` (which the table calls `namespace.1`); `myapps`: those of scope `MyApp
/// namespaces` too.
fn holds_exactly(
    heading: &str,
    kubeconfig: &Path,
    account: &str,
    (namespace, called): (&str, &str),
    myapps: bool,
) -> Result<()> {
    let want = documented(heading, called, myapps)?;
    let got = granted(kubeconfig, account, namespace)?;
    let missing: Vec<_> = want.difference(&got).collect();
    let undocumented: Vec<_> = got.difference(&want).collect();
    anyhow::ensure!(
        missing.is_empty() && undocumented.is_empty(),
        "{account} in {namespace}: documented but not granted {missing:?}; granted but not documented {undocumented:?}"
    );
    Ok(())
}

/// Where a narrowed agent's install comes from.
#[derive(Clone, Copy, Debug)]
enum Narrowed {
    /// `helm template` with `agent.allowedNamespaces`, under a release namespace of its own.
    Chart,
    /// `flotilla-hub join --allowed-namespace`, into `flotilla-system`.
    Join,
}

/// Issue 20: the chart with `agent.allowedNamespaces` grants the agent its rights on
/// MyApps and their children in those namespaces alone (docs/security.md, RBAC), and the
/// agent runs on them: installed on the host (which runs no agent of its own), it holds
/// exactly the documented rights in a listed namespace, in another one and in its own;
/// run with its ServiceAccount's token and the Deployment's own arguments, it joins, a
/// FederatedMyApp placed on it reaches it and is deleted again, and its log holds no
/// request the apiserver refused.
#[tokio::test]
async fn an_agent_narrowed_by_the_chart_runs_on_the_rights_of_its_namespaces() -> Result<()> {
    narrowed_agent(Narrowed::Chart).await
}

/// As above, with the install `flotilla-hub join --allowed-namespace` prints.
#[tokio::test]
async fn an_agent_narrowed_by_join_runs_on_the_rights_of_its_namespaces() -> Result<()> {
    narrowed_agent(Narrowed::Join).await
}

async fn narrowed_agent(source: Narrowed) -> Result<()> {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::Namespace;
    use kube::api::{DeleteParams, Patch, PatchParams};

    const TEAM: &str = "narrowed-team";
    const RELEASE_NS: &str = "narrowed-agent";
    let (name, own_namespace, created) = match source {
        Narrowed::Chart => ("narrowed-chart", RELEASE_NS, &[RELEASE_NS, TEAM][..]),
        Narrowed::Join => ("narrowed-join", "flotilla-system", &[TEAM][..]),
    };
    let _one = ONE_AT_A_TIME.lock().await;
    let OnHost {
        env,
        f,
        host,
        host_client,
        dir,
    } = on_host(name).await?;
    let namespaces: Api<Namespace> = Api::all(host_client.clone());
    for ns in created {
        // An earlier run's namespace may still be terminating.
        let what = format!("namespace {ns} not terminating");
        flotilla_lab::wait_for(std::time::Duration::from_secs(120), &what, || async {
            let found = namespaces.get_opt(ns).await?;
            Ok(found
                .is_none_or(|n| n.metadata.deletion_timestamp.is_none())
                .then_some(()))
        })
        .await?;
        let object =
            serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
        namespaces
            .patch(ns, &PatchParams::apply("e2e"), &Patch::Apply(&object))
            .await?;
    }
    let crds: Api<CustomResourceDefinition> = Api::all(host_client.clone());
    let conversion_before = crds.get("myapps.app.example.com").await?.spec.conversion;
    let (token, install) = (dir.join("token"), dir.join("install.yaml"));
    let grpc = f.hub_grpc.trim_start_matches("https://").to_owned();
    let ca = f.hub_ca.to_string_lossy().into_owned();
    let joined = match source {
        Narrowed::Chart => ["join", name, "--token-file", &token.to_string_lossy()]
            .map(String::from)
            .to_vec(),
        Narrowed::Join => [
            "join",
            name,
            "--allowed-namespace",
            TEAM,
            "--hub-address",
            &grpc,
            "--hub-server-name",
            "localhost",
            "--hub-ca-file",
            &ca,
            "-o",
            &install.to_string_lossy(),
        ]
        .map(String::from)
        .to_vec(),
    };
    f.hub_cli(&env)?
        .run(&joined.iter().map(String::as_str).collect::<Vec<_>>())?;
    let result = async {
        let manifests = match source {
            Narrowed::Chart => run(
                &cached_tool("helm-")?.join("helm"),
                &[
                    "template",
                    "narrowed",
                    "charts/flotilla",
                    "--namespace",
                    RELEASE_NS,
                    "--set",
                    "hub.enabled=false",
                    "--set",
                    "agent.enabled=true",
                    "--set",
                    &format!("agent.cluster={name}"),
                    "--set",
                    &format!("agent.hub.address={grpc}"),
                    "--set",
                    "agent.hub.serverName=localhost",
                    "--set-file",
                    &format!("agent.hub.token={}", token.display()),
                    "--set-file",
                    &format!("agent.hub.caCrt={ca}"),
                    "--set",
                    &format!("agent.allowedNamespaces={{{TEAM}}}"),
                ],
                &host,
                None,
            )?,
            Narrowed::Join => std::fs::read_to_string(&install)?,
        };
        apply_identity(&host, &manifests, &["Namespace", "Secret"])?;

        let account = format!("{own_namespace}/flotilla-agent");
        let heading = "The agent ";
        holds_exactly(heading, &host, &account, (TEAM, TEAM), true)?;
        holds_exactly(heading, &host, &account, ("default", "default"), false)?;
        let own = (own_namespace, "flotilla-system");
        holds_exactly(heading, &host, &account, own, false)?;

        let deployment: Deployment =
            serde_yaml::from_str(&flotilla_e2e::of_kinds(&manifests, &["Deployment"])?)?;
        let container = &deployment
            .spec
            .context("spec")?
            .template
            .spec
            .context("pod")?
            .containers[0];
        let ca_file = dir.join("ca.crt");
        std::fs::copy(&f.hub_ca, &ca_file)?;
        let args = local_args(container.args.clone(), &token, &ca_file)?;
        anyhow::ensure!(
            args.contains(&format!("--allowed-namespace={TEAM}"))
                && args.contains(&format!("--namespace={TEAM}")),
            "the {source:?} agent does not watch {TEAM} alone: {args:?}"
        );
        let sa_kubeconfig = dir.join("kubeconfig.yaml");
        service_account_kubeconfig(&host, &account, &sa_kubeconfig)?;
        let agent = spawn_agent(&env, &f, name, &args, &sa_kubeconfig, own_namespace)?;
        let outcome = place_and_delete(&host_client, name, TEAM, "narrowed-app").await;
        let stopped = agent.stop(std::time::Duration::from_secs(10));
        let _ = flotilla_lab::process::forget(&env.dir, &agent.name);
        outcome?;
        stopped?;
        let log = std::fs::read_to_string(agent.log.as_ref().context("the agent's log")?)?;
        let refused: Vec<&str> = (log.lines())
            .filter(|l| l.contains("forbidden: User") || l.contains("cannot list resource"))
            .take(3)
            .collect();
        anyhow::ensure!(
            refused.is_empty(),
            "the apiserver refused the agent: {refused:#?}"
        );
        anyhow::Ok(())
    }
    .await;
    let removed = f.hub_cli(&env)?.run(&["unjoin", name]);
    let restored = restore_conversion(&crds, conversion_before).await;
    for ns in created {
        let _ = namespaces.delete(ns, &DeleteParams::default()).await;
    }
    if let Narrowed::Chart = source {
        let cluster_wide = "clusterrole,clusterrolebinding";
        let delete = [
            "delete",
            cluster_wide,
            "narrowed-flotilla-agent",
            "--ignore-not-found",
        ];
        let _ = run(&kubectl(), &delete, &host, None);
    }
    result?;
    removed?;
    restored?;
    Ok(())
}
