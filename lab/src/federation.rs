//! Flotilla itself in the environment: `flotilla-hub run` against the host and one
//! `flotilla-agent run` per member, as local processes with real TLS (a CA made by
//! `flotilla-hub certs`) and one token per cluster (issued by `flotilla-hub join`).
//! Every launch is recorded in `federation.json`, so that tests can stop, kill and start
//! a component exactly as it was, or a variant of it (through a proxy, a twin).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use flotilla_crds::MemberCluster;
use flotilla_proto::client::{self, Dial, DialError};
use flotilla_proto::v1::{self as pb, hub_message};
use kube::Api;
use serde::{Deserialize, Serialize};

use crate::env::Env;
use crate::hubcli::HubCli;
use crate::process::{self, ProcessRecord};
use crate::support::{cargo_binaries, free_addr, http_get, stdout_of};

const STATE_FILE: &str = "federation.json";
pub const HUB: &str = "flotilla-hub";
/// How long the hub waits for heartbeats before a member is NotReady. Shorter than the
/// hub's default (40s) so that the fault suite sees it happen within seconds.
pub const HEARTBEAT_GRACE: Duration = Duration::from_secs(6);
/// The agents' heartbeat interval: a third of the grace, so one late beat is no outage.
pub const HEARTBEAT: Duration = Duration::from_secs(2);
/// Agents report capacity changes at most this often.
pub const CAPACITY_INTERVAL: Duration = Duration::from_secs(2);
/// The MemberCluster label members are joined with, for spread tests.
pub const REGION: &str = "topology.kubernetes.io/region";

/// Where deploy/hub installs the hub: its ServiceAccount, RBAC and Lease.
pub const HUB_NAMESPACE: &str = "flotilla-system";

/// cluster2 is alone in `us`; the others are in `eu`.
pub fn region_of(member: &str) -> &'static str {
    if member == "cluster2" { "us" } else { "eu" }
}

/// A FederatedMyApp `default/name` placed on `clusters`, its MyApps' spec `template` (for a
/// server-side apply).
pub fn federated_myapp(
    name: &str,
    clusters: &[impl AsRef<str>],
    template: serde_json::Value,
) -> serde_json::Value {
    let clusters: Vec<_> = clusters
        .iter()
        .map(|c| serde_json::json!({"name": c.as_ref()}))
        .collect();
    serde_json::json!({
        "apiVersion": "core.kubefed.io/v1beta1",
        "kind": "FederatedMyApp",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "placement": {"clusters": clusters},
            "template": {"spec": template},
        },
    })
}

/// How one component was started.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Launch {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub kubeconfig: PathBuf,
    /// `host:port` of its /healthz, /readyz and /metrics.
    pub http: String,
}

impl Launch {
    /// The value of `--NAME=VALUE` in its arguments.
    pub fn arg(&self, name: &str) -> Option<&str> {
        let prefix = format!("--{name}=");
        self.args.iter().find_map(|a| a.strip_prefix(&prefix))
    }

    /// Sets `--NAME=VALUE` (replacing it if present); `None` removes it.
    pub fn set_arg(&mut self, name: &str, value: Option<&str>) {
        let prefix = format!("--{name}=");
        self.args.retain(|a| !a.starts_with(&prefix));
        if let Some(v) = value {
            self.args.push(format!("{prefix}{v}"));
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Federation {
    /// `https://127.0.0.1:PORT`, what agents dial.
    pub hub_grpc: String,
    /// The CA that signed the hub's certificate.
    pub hub_ca: PathBuf,
    /// Token file per member cluster.
    pub tokens: BTreeMap<String, PathBuf>,
    /// `flotilla-hub` and `flotilla-agent-<cluster>`.
    pub components: BTreeMap<String, Launch>,
}

pub fn agent_name(cluster: &str) -> String {
    format!("flotilla-agent-{cluster}")
}

/// The paths of the workspace binaries `names` (each built from the package of its name):
/// in `$FLOTILLA_BIN_DIR`, or wherever cargo builds them (built now if stale).
pub fn flotilla_binaries(names: &[&str]) -> Result<BTreeMap<String, PathBuf>> {
    if let Some(dir) = std::env::var_os("FLOTILLA_BIN_DIR") {
        let dir = PathBuf::from(dir);
        return Ok(names.iter().map(|n| (n.to_string(), dir.join(n))).collect());
    }
    let wanted: Vec<(&str, &str)> = names.iter().map(|n| (*n, *n)).collect();
    cargo_binaries(&wanted)
}

/// `flotilla-hub` and `flotilla-agent`, as [`flotilla_binaries`] finds them.
fn binaries() -> Result<(PathBuf, PathBuf)> {
    let mut built = flotilla_binaries(&["flotilla-hub", "flotilla-agent"])?;
    let hub = built.remove("flotilla-hub").context("no flotilla-hub")?;
    let agent = built
        .remove("flotilla-agent")
        .context("no flotilla-agent")?;
    Ok((hub, agent))
}

/// A session as an agent holds it: what it sends, and what the hub sends it.
pub type OpenSession = (
    tokio::sync::mpsc::Sender<pb::AgentMessage>,
    tonic::Streaming<pb::HubMessage>,
);

impl Federation {
    pub fn load(env: &Env) -> Result<Federation> {
        let path = env.dir.join(STATE_FILE);
        let bytes = std::fs::read(&path)
            .with_context(|| format!("reading {} (is the environment up?)", path.display()))?;
        serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
    }

    fn save(&self, env: &Env) -> Result<()> {
        let path = env.dir.join(STATE_FILE);
        std::fs::write(&path, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// How component `name` was launched.
    pub fn launch(&self, name: &str) -> Result<&Launch> {
        self.components.get(name).with_context(|| {
            let known: Vec<&String> = self.components.keys().collect();
            format!("no component {name} in the federation (it has {known:?})")
        })
    }

    /// The hub's admin CLI against the host, as the host's administrator (the hub
    /// itself runs as its ServiceAccount, which may not join clusters).
    pub fn hub_cli(&self, env: &Env) -> Result<HubCli> {
        Ok(HubCli {
            program: self.launch(HUB)?.program.clone(),
            kubeconfig: env.kubeconfig(env.host())?.to_path_buf(),
        })
    }

    /// Starts a recorded component (it must not be running).
    pub fn start(&self, env: &Env, name: &str) -> Result<ProcessRecord> {
        spawn(env, name, self.launch(name)?)
    }

    /// Starts a variant of component `name` under the name `as_name` (its own log and
    /// PID record, stopped by `down`): `edit` changes the launch first.
    pub fn start_variant(
        &self,
        env: &Env,
        name: &str,
        as_name: &str,
        edit: impl FnOnce(&mut Launch),
    ) -> Result<(ProcessRecord, Launch)> {
        let mut launch = self.launch(name)?.clone();
        edit(&mut launch);
        Ok((spawn(env, as_name, &launch)?, launch))
    }

    /// The running process of component `name`, by its PID record.
    pub fn process(&self, env: &Env, name: &str) -> Result<ProcessRecord> {
        process::records(&env.dir)?
            .into_iter()
            .find(|r| r.name == name && r.alive())
            .with_context(|| format!("{name} is not running"))
    }

    /// Stops a component by its recorded PID (SIGTERM, SIGKILL after 10s).
    pub fn stop(&self, env: &Env, name: &str) -> Result<()> {
        for record in process::records(&env.dir)?
            .into_iter()
            .filter(|r| r.name == name)
        {
            record.stop(Duration::from_secs(10))?;
        }
        Ok(())
    }

    /// Stops and starts a component, then waits until it is ready again.
    pub async fn restart(&self, env: &Env, name: &str) -> Result<()> {
        self.stop(env, name)?;
        self.start(env, name)?;
        self.wait_ready(name).await
    }

    pub async fn wait_ready(&self, name: &str) -> Result<()> {
        wait_http_ready(name, &self.launch(name)?.http).await
    }

    /// Dials the hub and says Hello for `cluster` with `token`, as an agent does, with
    /// no cluster UID (refused for a cluster whose UID is pinned).
    pub async fn open_session(&self, token: &str, cluster: &str) -> Result<OpenSession, DialError> {
        self.open_session_in(token, cluster, "").await
    }

    /// As [`Self::open_session`], saying the agent runs in the cluster `cluster_uid`.
    pub async fn open_session_in(
        &self,
        token: &str,
        cluster: &str,
        cluster_uid: &str,
    ) -> Result<OpenSession, DialError> {
        let hello = pb::Hello {
            cluster: cluster.into(),
            agent_version: "e2e".into(),
            cluster_uid: cluster_uid.into(),
            ..Default::default()
        };
        self.open_session_with(token, hello, 4).await
    }

    /// Opens a session with the agent's own dial, saying `hello`; `buffer` messages may
    /// wait to be sent.
    pub async fn open_session_with(
        &self,
        token: &str,
        hello: pb::Hello,
        buffer: usize,
    ) -> Result<OpenSession, DialError> {
        let mut hub = client::connect(&Dial {
            hub: self.hub_grpc.clone(),
            ca_pem: std::fs::read(&self.hub_ca).unwrap_or_default(),
            server_name: Some("localhost".into()),
            token: token.into(),
            keepalive: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(10),
        })
        .await?;
        client::open_session(&mut hub, hello, buffer).await
    }

    /// Opens a session as an agent would (the agent's own dial) and reads until
    /// SyncComplete; `Err` inside: the hub refused it, with this status.
    pub async fn session(
        &self,
        token: &str,
        cluster: &str,
    ) -> Result<Result<Vec<pb::HubMessage>, tonic::Status>> {
        self.session_in(token, cluster, "").await
    }

    /// As [`Self::session`], saying the agent runs in the cluster `cluster_uid`.
    pub async fn session_in(
        &self,
        token: &str,
        cluster: &str,
        cluster_uid: &str,
    ) -> Result<Result<Vec<pb::HubMessage>, tonic::Status>> {
        let (_tx, mut inbound) = match self.open_session_in(token, cluster, cluster_uid).await {
            Ok(session) => session,
            Err(DialError::Refused(status)) => return Ok(Err(status)),
            Err(e) => return Err(e.into()),
        };
        let mut got = Vec::new();
        loop {
            match tokio::time::timeout(Duration::from_secs(20), inbound.message())
                .await
                .context("no SyncComplete")?
            {
                Ok(Some(m)) => {
                    let done = matches!(m.kind, Some(hub_message::Kind::SyncComplete(_)));
                    got.push(m);
                    if done {
                        return Ok(Ok(got));
                    }
                }
                Ok(None) => return Ok(Ok(got)),
                Err(status) => return Ok(Err(status)),
            }
        }
    }

    /// A component's /metrics text.
    pub async fn metrics(&self, name: &str) -> Result<String> {
        let (code, body) = http_get(&self.launch(name)?.http, "/metrics").await?;
        if code != 200 {
            bail!("{name} /metrics answered {code}");
        }
        Ok(body)
    }
}

fn spawn(env: &Env, name: &str, launch: &Launch) -> Result<ProcessRecord> {
    let mut cmd = Command::new(&launch.program);
    cmd.args(&launch.args)
        .env("KUBECONFIG", &launch.kubeconfig)
        .env("RUST_LOG", "info");
    env.spawn(name, &mut cmd)
}

/// Waits until `http` (a component's health address) answers /readyz with 200.
pub async fn wait_http_ready(name: &str, http: &str) -> Result<()> {
    wait_http_ok(name, http, "/readyz").await
}

/// Waits until `path` on `http` answers 200 (`/healthz`: the process serves).
pub async fn wait_http_ok(name: &str, http: &str, path: &str) -> Result<()> {
    crate::wait_for(
        Duration::from_secs(60),
        &format!("{name} {path}"),
        || async { Ok(matches!(http_get(http, path).await, Ok((200, _))).then_some(())) },
    )
    .await
}

/// Starts the hub and one agent per member unless they already run; returns when every
/// MemberCluster is Ready.
/// The hub's identity on the host as deploy/hub gives it: applies that kustomization's
/// Namespace, RBAC, admission policies (so that every suite runs the hub under them) and
/// FlowSchema (its Lease requests in `leader-election`), and writes
/// a kubeconfig (in `dir`) with a token of its ServiceAccount, so that the hub runs with
/// exactly those permissions.
fn hub_identity(host_kubeconfig: &Path, dir: &Path) -> Result<PathBuf> {
    let deploy = crate::support::workspace_root().join("deploy/hub");
    for file in [
        "namespace.yaml",
        "rbac.yaml",
        "admission.yaml",
        "flowschema.yaml",
    ] {
        let path = deploy.join(file);
        kubectl(host_kubeconfig, &["apply", "-f", &path.to_string_lossy()])?;
    }
    // A year: the environment may stay up long after the tests (`up`, `demo`).
    let token = kubectl(
        host_kubeconfig,
        &[
            "create",
            "token",
            HUB,
            "-n",
            HUB_NAMESPACE,
            "--duration=8760h",
        ],
    )?;
    let mut kubeconfig: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(host_kubeconfig)?)
            .with_context(|| format!("parsing {}", host_kubeconfig.display()))?;
    let users = kubeconfig
        .get_mut("users")
        .and_then(|u| u.as_sequence_mut())
        .with_context(|| format!("{} has no users", host_kubeconfig.display()))?;
    for user in users {
        user["user"] = serde_yaml::from_str(&format!("{{token: {}}}", token.trim()))?;
    }
    std::fs::create_dir_all(dir)?;
    let path = dir.join("hub.kubeconfig");
    std::fs::write(&path, serde_yaml::to_string(&kubeconfig)?)?;
    Ok(path)
}

/// `kubectl ARGS` against `kubeconfig`; its stdout, or an error with its stderr.
fn kubectl(kubeconfig: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("kubectl")
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .context("running kubectl (is it on PATH?)")?;
    stdout_of(format_args!("`kubectl {}`", args.join(" ")), out)
}

pub async fn up(env: &Env) -> Result<Federation> {
    if let Ok(existing) = Federation::load(env) {
        // Components a test left stopped start again as they were: the clusters are
        // joined already, and their credentials still hold.
        let running: Vec<String> = process::records(&env.dir)?
            .into_iter()
            .filter(|r| r.alive())
            .map(|r| r.name)
            .collect();
        let stopped: Vec<String> = (existing.components.keys())
            .filter(|c| !running.contains(c))
            .cloned()
            .collect();
        for name in &stopped {
            existing.start(env, name)?;
        }
        for name in &stopped {
            existing.wait_ready(name).await?;
        }
        return Ok(existing);
    }
    let (hub_bin, agent_bin) = binaries()?;
    let dir = env.dir.join("federation");
    let tls = dir.join("tls");
    let host_kubeconfig = env.kubeconfig(env.host())?.to_path_buf();
    let cli = HubCli {
        program: hub_bin.clone(),
        kubeconfig: host_kubeconfig.clone(),
    };
    cli.certs(&tls)?;
    let hub_kubeconfig = hub_identity(&host_kubeconfig, &dir)?;
    let grpc = free_addr()?;
    let mut components = BTreeMap::new();
    let hub_http = free_addr()?;
    components.insert(
        HUB.to_owned(),
        Launch {
            program: hub_bin,
            args: vec![
                "run".into(),
                format!("--grpc-addr={grpc}"),
                format!("--http-addr={hub_http}"),
                format!("--tls-cert={}", tls.join("tls.crt").display()),
                format!("--tls-key={}", tls.join("tls.key").display()),
                format!("--heartbeat-grace={}s", HEARTBEAT_GRACE.as_secs()),
                // Elected, as deploy/hub runs it; the name is the Pod name in a cluster.
                "--leader-elect".into(),
                format!("--leader-identity={HUB}"),
                format!("--lease-namespace={HUB_NAMESPACE}"),
            ],
            kubeconfig: hub_kubeconfig,
            http: hub_http,
        },
    );
    let mut tokens = BTreeMap::new();
    for member in env.members() {
        let token = dir.join(format!("{member}.token"));
        cli.join(
            member,
            &[("name", member), (REGION, region_of(member))],
            &token,
        )?;
        let (http, scaler) = (free_addr()?, free_addr()?);
        // Where the member's apiserver reaches it (for kind, not loopback).
        let webhook = crate::provider::host_addr_for_apiservers(env)?;
        components.insert(
            agent_name(member),
            Launch {
                program: agent_bin.clone(),
                args: vec![
                    "run".into(),
                    format!("--hub=https://{grpc}"),
                    format!("--cluster={member}"),
                    format!("--token-file={}", token.display()),
                    format!("--hub-ca-file={}", tls.join("ca.crt").display()),
                    "--hub-server-name=localhost".into(),
                    format!("--http-addr={http}"),
                    format!("--webhook-addr={webhook}"),
                    format!("--webhook-url=https://{webhook}/convert"),
                    format!("--scaler-addr={scaler}"),
                    // The webhook's CA, shared with a second agent of the member, beside the Lease.
                    "--webhook-ca-secret=default/flotilla-agent-webhook-ca".into(),
                    format!("--heartbeat={}s", HEARTBEAT.as_secs()),
                    format!("--capacity-interval={}s", CAPACITY_INTERVAL.as_secs()),
                    // One active agent per member, as the install runs it.
                    "--leader-elect".into(),
                    "--lease-namespace=default".into(),
                ],
                kubeconfig: env.kubeconfig(member)?.to_path_buf(),
                http,
            },
        );
        tokens.insert(member.to_owned(), token);
    }
    let federation = Federation {
        hub_grpc: format!("https://{grpc}"),
        hub_ca: tls.join("ca.crt"),
        tokens,
        components,
    };
    federation.save(env)?;
    for name in federation.components.keys() {
        federation.start(env, name)?;
    }
    for name in federation.components.keys() {
        federation.wait_ready(name).await?;
    }
    let client = env.client(env.host()).await?;
    for member in env.members() {
        wait_member_ready(&client, member, true, Duration::from_secs(30)).await?;
    }
    Ok(federation)
}

/// Whether MemberCluster `mc` has condition Ready=True.
pub fn member_ready(mc: &MemberCluster) -> bool {
    mc.status
        .iter()
        .flat_map(|s| &s.conditions)
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Waits until MemberCluster `member` on the host is Ready (`ready`) or not.
pub async fn wait_member_ready(
    host: &kube::Client,
    member: &str,
    ready: bool,
    timeout: Duration,
) -> Result<()> {
    let members: Api<MemberCluster> = Api::all(host.clone());
    let state = if ready { "Ready" } else { "NotReady" };
    crate::wait::await_object(
        &members,
        member,
        timeout,
        &format!("MemberCluster {member} {state}"),
        |mc: Option<&MemberCluster>| mc.is_some_and(|mc| member_ready(mc) == ready),
    )
    .await?;
    Ok(())
}

/// Removes the federation's launch records, certificates and tokens.
pub(crate) fn remove_state(dir: &Path) -> Result<()> {
    crate::env::remove_all(&[dir.join(STATE_FILE), dir.join("federation")])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_args_are_read_replaced_and_removed_by_name() {
        let mut l = Launch {
            program: "agent".into(),
            args: vec![
                "run".into(),
                "--hub=https://a:1".into(),
                "--hub-ca-file=/ca".into(),
            ],
            kubeconfig: "k".into(),
            http: "h".into(),
        };
        assert_eq!(l.arg("hub"), Some("https://a:1"));
        assert_eq!(l.arg("hu"), None, "a prefix of a name is another name");
        l.set_arg("hub", Some("https://b:2"));
        assert_eq!(l.arg("hub"), Some("https://b:2"));
        assert_eq!(
            l.arg("hub-ca-file"),
            Some("/ca"),
            "a longer name is untouched"
        );
        l.set_arg("hub-ca-file", None);
        assert_eq!(l.args, ["run", "--hub=https://b:2"]);
        l.set_arg("new", Some("x"));
        assert_eq!(l.arg("new"), Some("x"));
    }
}
