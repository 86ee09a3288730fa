//! Faults to inject into a running environment: kill or stop the hub or an agent and start
//! it again, replace the hub gracefully, stop and start a member's kube-apiserver, route an
//! agent through a [`Proxy`] that can blackhole its link, start a second agent with
//! an existing agent's identity, and run a standby hub behind a [`LeaderService`].

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::proxy::Proxy;
use flotilla_lab::Env;
use flotilla_lab::federation::{Federation, HUB, HUB_NAMESPACE, Launch, agent_name};
use flotilla_lab::process::{self, ProcessRecord, Signal};
use flotilla_lab::support::free_addr;

/// SIGKILLs component `name` (the hub or `flotilla-agent-<cluster>`); returns once it is gone.
pub fn sigkill(env: &Env, f: &Federation, name: &str) -> Result<ProcessRecord> {
    let p = f.process(env, name)?;
    p.signal(Signal::KILL)?;
    if !p.wait_gone(Duration::from_secs(10)) {
        bail!("{name} (PID {}) still runs 10s after SIGKILL", p.pid);
    }
    Ok(p)
}

/// Starts a recorded component again and waits until it is ready.
pub async fn start(env: &Env, f: &Federation, name: &str) -> Result<ProcessRecord> {
    let p = f.start(env, name)?;
    f.wait_ready(name).await?;
    Ok(p)
}

/// A graceful replacement of the hub, as a rolling update does it: SIGTERM to the running
/// hub and, as soon as its gRPC port is free, a new hub on the same ports. The old process
/// is never SIGKILLed here; it is recorded as `flotilla-hub-old-<pid>` (so `down` still
/// stops it) and returned, for the caller to watch it end.
pub async fn replace_hub(env: &Env, f: &Federation) -> Result<(ProcessRecord, ProcessRecord)> {
    let old = f.process(env, HUB)?;
    old.signal(Signal::TERM)?;
    let old = process::rename(&env.dir, HUB, &format!("{HUB}-old-{}", old.pid))?;
    let grpc = f
        .hub_grpc
        .strip_prefix("https://")
        .context("the hub's URL is https://")?
        .to_string();
    // The old hub closes its listener first thing on SIGTERM; a new one can bind then.
    flotilla_lab::wait_for(
        Duration::from_secs(10),
        "the old hub to release its gRPC port",
        || async { Ok(std::net::TcpListener::bind(&grpc).ok().map(drop)) },
    )
    .await?;
    let new = f.start(env, HUB)?;
    f.wait_ready(HUB).await?;
    Ok((old, new))
}

/// A control-plane process as kwokctl started it: what it takes to start it again.
#[derive(Debug, Clone)]
pub struct Component {
    pub cluster: String,
    pub component: String,
    argv: Vec<String>,
    cwd: PathBuf,
    environ: Vec<(String, String)>,
    log: Option<PathBuf>,
}

/// Stops `component` (e.g. `kube-apiserver`) of `cluster` (SIGTERM, SIGKILL after 15s).
/// Local provider only.
pub fn stop_component(env: &Env, cluster: &str, component: &str) -> Result<Component> {
    let (record, stopped) = capture(env, cluster, component)?;
    record.stop(Duration::from_secs(15))?;
    Ok(stopped)
}

/// How `component` of `cluster` runs now. kube-controller-manager and kube-scheduler exit
/// when their apiserver is gone longer than their leader lease (as in a real cluster,
/// where the kubelet restarts them): capture them before, [`revive`] them after.
pub fn capture(env: &Env, cluster: &str, component: &str) -> Result<(ProcessRecord, Component)> {
    let name = format!("{cluster}/{component}");
    let record = env
        .cluster(cluster)?
        .components
        .iter()
        .find(|p| p.name == name && p.alive())
        .with_context(|| format!("{name} is not running"))?
        .clone();
    let proc = procfs::process::Process::new(i32::try_from(record.pid)?)
        .with_context(|| format!("reading /proc of {name} (PID {})", record.pid))?;
    let stopped = Component {
        cluster: cluster.into(),
        component: component.into(),
        argv: proc.cmdline()?,
        cwd: proc.cwd()?,
        environ: proc
            .environ()?
            .into_iter()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.to_string_lossy().into_owned(),
                )
            })
            .collect(),
        log: record.log.clone(),
    };
    Ok((record, stopped))
}

/// Starts again those of `components` that are not running.
pub fn revive(env: &mut Env, components: &[Component]) -> Result<Vec<String>> {
    let mut revived = Vec::new();
    for c in components {
        let name = format!("{}/{}", c.cluster, c.component);
        let running = env
            .cluster(&c.cluster)?
            .components
            .iter()
            .any(|p| p.name == name && p.alive());
        if !running {
            start_component(env, c)?;
            revived.push(name);
        }
    }
    Ok(revived)
}

/// Starts a component stopped by [`stop_component`] with the same command line,
/// directory and environment, and records the new PID where `down` looks for it.
pub fn start_component(env: &mut Env, stopped: &Component) -> Result<ProcessRecord> {
    let name = format!("{}/{}", stopped.cluster, stopped.component);
    let (program, args) = stopped
        .argv
        .split_first()
        .context("an empty command line")?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .current_dir(&stopped.cwd)
        .env_clear()
        .envs(stopped.environ.iter().map(|(k, v)| (k, v)));
    let log = stopped.log.clone().unwrap_or_else(|| {
        env.dir
            .join("logs")
            .join(format!("{}.log", stopped.component))
    });
    let record = process::spawn_detached(&name, &mut cmd, &log)?;
    std::fs::write(
        flotilla_lab::provider::local::pid_file(&env.dir, &stopped.cluster, &stopped.component),
        record.pid.to_string(),
    )?;
    let idx = env
        .clusters
        .iter()
        .position(|c| c.name == stopped.cluster)
        .context("the cluster left the environment")?;
    let components = &mut env.clusters[idx].components;
    components.retain(|p| p.name != name);
    components.push(record.clone());
    components.sort_by(|a, b| a.name.cmp(&b.name));
    env.save()?;
    Ok(record)
}

/// Restarts `cluster`'s agent with its link to the hub through a new [`Proxy`].
pub async fn agent_through_proxy(env: &Env, f: &Federation, cluster: &str) -> Result<Proxy> {
    let upstream = f
        .hub_grpc
        .strip_prefix("https://")
        .context("the hub's URL is https://")?;
    let proxy = Proxy::start(upstream).await?;
    agent_via(env, f, cluster, &proxy.addr.to_string()).await?;
    Ok(proxy)
}

/// Restarts `cluster`'s agent as the environment launched it (straight to the hub).
pub async fn agent_direct(env: &Env, f: &Federation, cluster: &str) -> Result<()> {
    f.restart(env, &agent_name(cluster)).await
}

/// Starts a second agent for `cluster` with the same credential, under the name
/// `flotilla-agent-<cluster>-twin`, on its own health and webhook ports (and without
/// re-publishing the conversion webhook, so that stopping it leaves the CRD working).
/// Returns once it serves `/healthz`: with the Lease held by the first agent it is a
/// standby, never ready. If it does not come up, it is stopped again.
pub async fn start_twin(
    env: &Env,
    f: &Federation,
    cluster: &str,
) -> Result<(ProcessRecord, Launch)> {
    let name = agent_name(cluster);
    let twin = format!("{name}-twin");
    let (http, webhook, scaler) = (free_addr()?, free_addr()?, free_addr()?);
    let (p, launch) = f.start_variant(env, &name, &twin, |l| {
        l.http = http.clone();
        l.set_arg("http-addr", Some(&http));
        l.set_arg("webhook-addr", Some(&webhook));
        l.set_arg("scaler-addr", Some(&scaler));
        l.set_arg("webhook-url", None);
    })?;
    if let Err(e) = flotilla_lab::federation::wait_http_ok(&twin, &launch.http, "/healthz").await {
        let _ = p.stop(Duration::from_secs(10));
        let _ = flotilla_lab::process::forget(&env.dir, &twin);
        return Err(e);
    }
    Ok((p, launch))
}

/// The second hub's name, as a process and in the Lease.
pub const STANDBY_HUB: &str = "flotilla-hub-b";

/// Starts a second hub beside the environment's, as deploy/hub's second replica runs:
/// the same ServiceAccount, TLS and flags, its own ports and Lease identity. Returns
/// once it serves `/healthz` (with the Lease held by the first hub, it stands by).
pub async fn start_standby_hub(env: &Env, f: &Federation) -> Result<(ProcessRecord, Launch)> {
    let (grpc, http) = (free_addr()?, free_addr()?);
    let (p, launch) = f.start_variant(env, HUB, STANDBY_HUB, |l| {
        l.http = http.clone();
        l.set_arg("grpc-addr", Some(&grpc));
        l.set_arg("http-addr", Some(&http));
        l.set_arg("leader-identity", Some(STANDBY_HUB));
    })?;
    if let Err(e) =
        flotilla_lab::federation::wait_http_ok(STANDBY_HUB, &launch.http, "/healthz").await
    {
        let _ = p.stop(Duration::from_secs(10));
        let _ = process::forget(&env.dir, STANDBY_HUB);
        return Err(e);
    }
    Ok((p, launch))
}

/// Who holds the hub's Lease now: the identity before the campaign number.
pub async fn hub_leader(host: &kube::Client) -> Result<Option<String>> {
    use k8s_openapi::api::coordination::v1::Lease;
    let leases: kube::Api<Lease> = kube::Api::namespaced(host.clone(), HUB_NAMESPACE);
    let holder = leases
        .get_opt(HUB)
        .await?
        .and_then(|l| l.spec?.holder_identity);
    Ok(holder.map(|h| h.split('/').next().unwrap_or_default().to_string()))
}

/// What the hub's Service does in a cluster (it selects the Pod labelled
/// `flotilla.io/leader=true`, which the leader sets): a [`Proxy`] whose new connections
/// go to the hub holding the Lease, looked up every 100 ms.
pub struct LeaderService {
    pub proxy: Proxy,
    follow: tokio::task::JoinHandle<()>,
}

impl LeaderService {
    /// `hubs`: each hub's Lease identity and gRPC `host:port`.
    pub async fn start(env: &Env, hubs: Vec<(String, String)>) -> Result<LeaderService> {
        let host = env.client(env.host()).await?;
        let first = hubs.first().context("at least one hub")?.1.clone();
        let proxy = Proxy::start(&first).await?;
        let upstream = proxy.upstream();
        let follow = tokio::spawn(async move {
            loop {
                if let Ok(Some(leader)) = hub_leader(&host).await
                    && let Some((_, addr)) = hubs.iter().find(|(id, _)| *id == leader)
                {
                    upstream.send_replace(addr.clone());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Ok(LeaderService { proxy, follow })
    }
}

impl Drop for LeaderService {
    fn drop(&mut self) {
        self.follow.abort();
    }
}

/// Restarts `cluster`'s agent dialing `hub` (`host:port`) instead of the hub.
pub async fn agent_via(env: &Env, f: &Federation, cluster: &str, hub: &str) -> Result<()> {
    let name = agent_name(cluster);
    f.stop(env, &name)?;
    let hub = format!("https://{hub}");
    f.start_variant(env, &name, &name, |l| l.set_arg("hub", Some(&hub)))?;
    f.wait_ready(&name).await
}
