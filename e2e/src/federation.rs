//! Flotilla itself in the environment: `flotilla-hub run` against the host and one
//! `flotilla-agent run` per member, as local processes with real TLS (a CA made by
//! `flotilla-hub certs`) and one token per cluster (issued by `flotilla-hub join`).
//! Every launch is recorded so that tests can restart a component exactly as it was.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use flotilla_crds::MemberCluster;
use kube::Api;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::env::{Env, workspace_root};
use crate::process;

const STATE_FILE: &str = "federation.json";
pub const HUB: &str = "flotilla-hub";

/// How one component was started.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Launch {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub kubeconfig: PathBuf,
    /// `host:port` of its /healthz, /readyz and /metrics.
    pub http: String,
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

/// The directory holding `flotilla-hub` and `flotilla-agent`: `$FLOTILLA_BIN_DIR`, or
/// the workspace's debug build, built now.
fn binaries() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("FLOTILLA_BIN_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let root = workspace_root();
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "-q", "-p", "flotilla-hub", "-p", "flotilla-agent"])
        .current_dir(&root)
        .status()
        .context("running cargo build for flotilla-hub and flotilla-agent")?;
    if !status.success() {
        bail!("building flotilla-hub and flotilla-agent failed");
    }
    Ok(root.join("target/debug"))
}

/// `127.0.0.1:PORT` with a port free right now.
pub fn free_addr() -> Result<String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.to_string())
}

fn run_ok(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

impl Federation {
    pub fn load(env: &Env) -> Result<Federation> {
        let path = env.dir.join(STATE_FILE);
        let bytes = std::fs::read(&path)
            .with_context(|| format!("reading {} (is the environment up?)", path.display()))?;
        Ok(serde_json::from_slice(&bytes)?)
    }

    fn save(&self, env: &Env) -> Result<()> {
        Ok(std::fs::write(
            env.dir.join(STATE_FILE),
            serde_json::to_vec_pretty(self)?,
        )?)
    }

    /// Starts a recorded component (it must not be running).
    pub fn start(&self, env: &Env, name: &str) -> Result<()> {
        let launch = self
            .components
            .get(name)
            .with_context(|| format!("no component {name}"))?;
        let mut cmd = Command::new(&launch.program);
        cmd.args(&launch.args)
            .env("KUBECONFIG", &launch.kubeconfig)
            .env("RUST_LOG", "info");
        env.spawn(name, &mut cmd)?;
        Ok(())
    }

    /// Stops a component by its recorded PID.
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
        let http = &self.components[name].http;
        crate::wait_for(
            Duration::from_secs(60),
            &format!("{name} /readyz"),
            || async { Ok(matches!(http_get(http, "/readyz").await, Ok((200, _))).then_some(())) },
        )
        .await
    }

    /// A component's /metrics text.
    pub async fn metrics(&self, name: &str) -> Result<String> {
        let (code, body) = http_get(&self.components[name].http, "/metrics").await?;
        if code != 200 {
            bail!("{name} /metrics answered {code}");
        }
        Ok(body)
    }
}

/// Starts the hub and one agent per member unless they already run; returns when every
/// MemberCluster is Ready.
pub async fn up(env: &Env) -> Result<Federation> {
    if let Ok(existing) = Federation::load(env) {
        let running: Vec<String> = process::records(&env.dir)?
            .into_iter()
            .filter(|r| r.alive())
            .map(|r| r.name)
            .collect();
        if existing.components.keys().all(|c| running.contains(c)) {
            return Ok(existing);
        }
        for name in existing.components.keys() {
            existing.stop(env, name)?;
        }
    }
    let bin = binaries()?;
    let dir = env.dir.join("federation");
    let tls = dir.join("tls");
    run_ok(
        Command::new(bin.join("flotilla-hub"))
            .args(["certs", "--out"])
            .arg(&tls),
    )?;
    let host_kubeconfig = env.kubeconfig(env.host())?.to_path_buf();
    let grpc = free_addr()?;
    let mut components = BTreeMap::new();
    let hub_http = free_addr()?;
    components.insert(
        HUB.to_owned(),
        Launch {
            program: bin.join("flotilla-hub"),
            args: vec![
                "run".into(),
                format!("--grpc-addr={grpc}"),
                format!("--http-addr={hub_http}"),
                format!("--tls-cert={}", tls.join("tls.crt").display()),
                format!("--tls-key={}", tls.join("tls.key").display()),
                "--heartbeat-grace=15s".into(),
            ],
            kubeconfig: host_kubeconfig.clone(),
            http: hub_http,
        },
    );
    let mut tokens = BTreeMap::new();
    for member in env.members() {
        let token = dir.join(format!("{member}.token"));
        run_ok(
            Command::new(bin.join("flotilla-hub"))
                .args([
                    "join",
                    member,
                    "--label",
                    &format!("name={member}"),
                    "--token-file",
                ])
                .arg(&token)
                .env("KUBECONFIG", &host_kubeconfig),
        )?;
        let (http, webhook) = (free_addr()?, free_addr()?);
        components.insert(
            agent_name(member),
            Launch {
                program: bin.join("flotilla-agent"),
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
                    "--heartbeat=5s".into(),
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
    let members: Api<MemberCluster> = Api::all(env.client(env.host()).await?);
    for member in env.members() {
        crate::wait_for(
            Duration::from_secs(30),
            &format!("MemberCluster {member} Ready"),
            || async {
                let mc = members.get(member).await?;
                let ready = mc
                    .status
                    .iter()
                    .flat_map(|s| &s.conditions)
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                Ok(ready.then_some(()))
            },
        )
        .await?;
    }
    Ok(federation)
}

/// A plain HTTP/1.0 GET on loopback: (status code, body).
pub async fn http_get(addr: &str, path: &str) -> Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let code = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("malformed HTTP response")?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((code, body))
}

/// Reads a counter's value from Prometheus text, 0 when absent.
pub fn counter(metrics: &str, name_and_labels: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
        .unwrap_or(0.0)
}

pub fn state_path(dir: &Path) -> PathBuf {
    dir.join(STATE_FILE)
}
