//! Flotilla's end-to-end suite: the tests in `tests/` run against an environment of the
//! lab (`flotilla_lab`: real control planes, the hub and the agents), and use what this
//! crate adds for them:
//!
//! - [`converge`]: what every member must run (computed with the hub's own planning)
//!   against what it runs,
//! - [`deletions`]: every deletion of a managed MyApp during a test,
//! - [`faults`]: kill, replace, stop and start components; an agent behind a [`proxy`]
//!   (a link that can be cut),
//! - [`testcmd`]: `flotilla-e2e test`, the unit tests and this suite in one command,
//! - [`agent_binary`]: the agent for tests that run one of their own; [`hub_cli`]: the
//!   hub's admin CLI in either mode,
//! - [`three_members`]: the clients of a suite that needs three members.

pub mod converge;
pub mod deletions;
pub mod faults;
pub mod proxy;
pub mod testcmd;

/// The `flotilla-agent` binary, built once per test run so that a test never runs a
/// stale one.
pub fn agent_binary() -> &'static std::path::Path {
    static BIN: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    built_once(&BIN, "flotilla-agent")
}

/// The `flotilla-hub` binary, built once per test run: its admin CLI works in either
/// mode of the lab (in real-node mode the running hub is a Pod, and `Federation` has no
/// launch record of it).
pub fn hub_binary() -> &'static std::path::Path {
    static BIN: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    built_once(&BIN, "flotilla-hub")
}

/// The executable of the workspace binary `name` (of the package of that name), built
/// the first time it is asked for.
fn built_once(
    bin: &'static std::sync::OnceLock<std::path::PathBuf>,
    name: &str,
) -> &'static std::path::Path {
    bin.get_or_init(|| {
        flotilla_lab::support::cargo_binaries(&[(name, name)])
            .unwrap_or_else(|e| panic!("building {name}: {e:#}"))
            .remove(name)
            .unwrap_or_else(|| panic!("cargo names the {name} executable"))
    })
}

/// The documents of a multi-document YAML (what `kubectl kustomize` prints) whose `kind`
/// is one of `kinds`, as YAML again: the identity and policy objects of an install
/// without its workloads, to apply where nothing runs them.
pub fn of_kinds(yaml: &str, kinds: &[&str]) -> anyhow::Result<String> {
    use serde::Deserialize;
    let mut picked = String::new();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let object = serde_json::Value::deserialize(doc)?;
        if kinds.contains(&object["kind"].as_str().unwrap_or_default()) {
            picked.push_str("---\n");
            picked.push_str(&serde_yaml::to_string(&object)?);
        }
    }
    Ok(picked)
}

/// Runs `program args` from the workspace root against `kubeconfig`, feeding `stdin`:
/// its stdout, or an error with the command line and its stderr.
pub fn run_against(
    program: &std::path::Path,
    args: &[&str],
    kubeconfig: &std::path::Path,
    stdin: Option<&[u8]>,
) -> anyhow::Result<String> {
    use anyhow::Context as _;
    use std::process::{Command, Stdio};
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env("KUBECONFIG", kubeconfig)
        .current_dir(flotilla_lab::support::workspace_root())
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
        child.stdin.take().expect("piped").write_all(input)?;
    }
    let out = child.wait_with_output()?;
    anyhow::ensure!(
        out.status.success(),
        "`{} {}` failed: {}",
        program.display(),
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The hub's admin CLI against the host, as the host's administrator.
pub fn hub_cli(env: &flotilla_lab::Env) -> anyhow::Result<flotilla_lab::hubcli::HubCli> {
    Ok(flotilla_lab::hubcli::HubCli {
        program: hub_binary().to_path_buf(),
        kubeconfig: env.kubeconfig(env.host())?.to_path_buf(),
    })
}

/// The members of the suites that need three (scheduling, rollout).
pub const THREE_MEMBERS: [&str; 3] = ["cluster1", "cluster2", "cluster3"];

/// The environment, the host's client and each of [`THREE_MEMBERS`]' for `suite`; an
/// error that says how to bring three up when the environment has fewer.
pub async fn three_members(
    suite: &str,
) -> anyhow::Result<(
    flotilla_lab::Env,
    kube::Client,
    std::collections::BTreeMap<&'static str, kube::Client>,
)> {
    let env = flotilla_lab::Env::load_ready().await?;
    anyhow::ensure!(
        THREE_MEMBERS.iter().all(|m| env.members().contains(m)),
        "the {suite} tests need three members: run `flotilla-e2e test` (3 by default) or `up --members 3`; this environment has {:?}",
        env.members()
    );
    let host = env.client(env.host()).await?;
    let mut members = std::collections::BTreeMap::new();
    for m in THREE_MEMBERS {
        members.insert(m, env.client(m).await?);
    }
    Ok((env, host, members))
}
