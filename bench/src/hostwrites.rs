//! `flotilla-bench hostwrites`: what the hub writes to a real host apiserver, counted by
//! that apiserver itself (`apiserver_request_total`, request body bytes), never by
//! Flotilla.
//!
//! The real hub binary runs on the lab's host (as `up` launched it) and K simulated member
//! clusters speak the real protocol to it over TLS: each is a MemberCluster with a token
//! of its own and a load generator in this process that says Hello (with what it holds),
//! acknowledges every Apply and Delete with a StatusReport at once, reports every held
//! MyApp at the start of each session and heartbeats, like an agent. M FederatedMyApps are placed on all of them by label. Phases, each measured
//! from the host apiserver's counters:
//! - **converge**: from the apps' creation to every status showing every cluster applied;
//! - **idle**: nothing changes for a while; the baseline is the same window's writes by
//!   everything else (the host's own controllers), shown beside it;
//! - **flap within grace**: a tenth of the sessions end and come straight back;
//! - **flap past grace**: a tenth stay away past the heartbeat grace, then come back;
//! - **hub restart**: the hub SIGKILLed and started again, every session re-established.
//!
//! Then the largest FederatedMyApp status, in bytes, at K clusters.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use flotilla_crds::FederatedMyApp;
use flotilla_hub::auth::token_sha256;
use flotilla_lab::apiserver::Requests;
use flotilla_lab::federation::{self, Federation, HEARTBEAT, HEARTBEAT_GRACE, HUB};
use flotilla_lab::process::Signal;
use flotilla_lab::{Env, wait_for};
use flotilla_proto::v1::{self as pb, agent_message, hub_message};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::mpsc;

use super::{Report, cell};

#[derive(clap::Args, Debug, Clone)]
pub struct Size {
    /// Simulated member clusters
    #[arg(long, default_value_t = 200)]
    pub clusters: usize,
    /// FederatedMyApps, each placed on every simulated cluster
    #[arg(long, default_value_t = 200)]
    pub apps: usize,
    /// The idle window
    #[arg(long, default_value_t = 30)]
    pub idle_secs: u64,
}

const LABEL: &str = "flotilla-bench";
const LABEL_VALUE: &str = "hostwrites";
const NAMESPACE: &str = "default";
const CONVERGE: Duration = Duration::from_secs(900);

fn cluster_name(i: usize) -> String {
    format!("hw-member-{i:05}")
}

fn app_name(i: usize) -> String {
    format!("hw-app-{i:05}")
}

fn token(cluster: &str) -> String {
    format!("{cluster}.bench-secret")
}

/// What one simulated agent is told to do.
enum Cmd {
    /// End the session, stay away this long, come back.
    Flap(Duration),
}

/// One simulated agent: sessions until its command channel closes.
async fn sim_agent(f: Arc<Federation>, cluster: String, mut cmds: mpsc::Receiver<Cmd>) {
    let token = token(&cluster);
    let mut held: BTreeMap<(String, String), String> = BTreeMap::new();
    loop {
        let hello = pb::Hello {
            cluster: cluster.clone(),
            agent_version: "bench-simulated".into(),
            kubernetes_version: "v1.34.0 (simulated)".into(),
            managed: (held.iter())
                .map(|((namespace, name), hash)| pb::Managed {
                    key: Some(pb::ObjectKey {
                        namespace: namespace.clone(),
                        name: name.clone(),
                    }),
                    hash: hash.clone(),
                })
                .collect(),
            cluster_uid: format!("uid-{cluster}"),
            scope: Vec::new(),
            cluster_id: String::new(),
            // Simulated agents store no renewed token.
            renews_token: false,
        };
        let away = match f.open_session_with(&token, hello, 64).await {
            Ok((tx, inbound)) => match session(tx, inbound, &mut held, &mut cmds).await {
                Some(away) => away,
                None => return,
            },
            Err(_) => Duration::from_millis(500 + fastrand::u64(..1000)),
        };
        tokio::time::sleep(away).await;
    }
}

/// One session: answers the hub and heartbeats until the hub ends it (`Some`: retry
/// soon), a flap is asked for (`Some`: that long) or the bench ends (`None`).
async fn session(
    tx: mpsc::Sender<pb::AgentMessage>,
    mut inbound: tonic::Streaming<pb::HubMessage>,
    held: &mut BTreeMap<(String, String), String>,
    cmds: &mut mpsc::Receiver<Cmd>,
) -> Option<Duration> {
    let retry = Duration::from_millis(500 + fastrand::u64(..1000));
    // Like an agent, every held MyApp's status once at the start of a session.
    for ((namespace, name), hash) in held.iter() {
        let key = pb::ObjectKey {
            namespace: namespace.clone(),
            name: name.clone(),
        };
        let kind = agent_message::Kind::Status(status_report(key, hash.clone(), true));
        if tx
            .send(pb::AgentMessage { kind: Some(kind) })
            .await
            .is_err()
        {
            return Some(retry);
        }
    }
    let mut beat = tokio::time::interval(HEARTBEAT);
    loop {
        let reply = tokio::select! {
            m = inbound.message() => match m {
                Ok(Some(m)) => answer(m, held),
                _ => return Some(retry),
            },
            _ = beat.tick() => Some(agent_message::Kind::Heartbeat(pb::Heartbeat {})),
            c = cmds.recv() => match c {
                Some(Cmd::Flap(away)) => return Some(away),
                None => return None,
            },
        };
        let Some(kind) = reply else { continue };
        if tx
            .send(pb::AgentMessage { kind: Some(kind) })
            .await
            .is_err()
        {
            return Some(retry);
        }
    }
}

/// What an agent that applies at once says to `m`.
fn answer(
    m: pb::HubMessage,
    held: &mut BTreeMap<(String, String), String>,
) -> Option<agent_message::Kind> {
    let (key, hash, exists) = match m.kind? {
        hub_message::Kind::Apply(a) => {
            let key = a.key?;
            held.insert((key.namespace.clone(), key.name.clone()), a.hash.clone());
            (key, a.hash, true)
        }
        hub_message::Kind::Delete(d) => {
            let key = d.key?;
            held.remove(&(key.namespace.clone(), key.name.clone()));
            (key, String::new(), false)
        }
        _ => return None,
    };
    Some(agent_message::Kind::Status(status_report(
        key, hash, exists,
    )))
}

/// The status of a MyApp applied at once and Ready (or gone).
fn status_report(key: pb::ObjectKey, hash: String, exists: bool) -> pb::StatusReport {
    pb::StatusReport {
        key: Some(key),
        hash,
        exists,
        ready: exists,
        ready_replicas: i32::from(exists),
        observed_generation: 1,
        generation: 1,
        ..Default::default()
    }
}

/// The simulated clusters' MemberClusters and the apps, applied on the host.
async fn create(host: &Client, size: &Size) -> Result<()> {
    let members: Api<flotilla_crds::MemberCluster> = Api::all(host.clone());
    let params = PatchParams::apply("flotilla-bench").force();
    for i in 0..size.clusters {
        let name = cluster_name(i);
        let mc = json!({
            "apiVersion": "core.kubefed.io/v1beta1", "kind": "MemberCluster",
            "metadata": {"name": name, "labels": {LABEL: LABEL_VALUE}},
            "spec": {"tokenSha256": token_sha256(&token(&name))},
        });
        members.patch(&name, &params, &Patch::Apply(&mc)).await?;
    }
    let apps: Api<FederatedMyApp> = Api::namespaced(host.clone(), NAMESPACE);
    for i in 0..size.apps {
        let name = app_name(i);
        let app = json!({
            "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "placement": {"clusterSelector": {"matchLabels": {LABEL: LABEL_VALUE}}},
                "template": {"spec": {"replicas": 1, "image": "nginx:1.27", "config": {"id": name}}},
            },
        });
        apps.patch(&name, &params, &Patch::Apply(&app)).await?;
    }
    Ok(())
}

/// The apps' statuses: how many show every cluster applied, and the largest in bytes.
async fn statuses(host: &Client, clusters: usize) -> Result<(usize, usize)> {
    let apps: Api<FederatedMyApp> = Api::namespaced(host.clone(), NAMESPACE);
    let list = apps.list(&ListParams::default()).await?;
    let ours = list
        .items
        .iter()
        .filter(|a| a.name_any().starts_with("hw-app-"));
    let (mut applied, mut largest) = (0, 0);
    for a in ours {
        let status = a.status.as_ref();
        if status.is_some_and(|s| s.applied_clusters as usize == clusters) {
            applied += 1;
        }
        largest = largest.max(serde_json::to_vec(&a.status)?.len());
    }
    Ok((applied, largest))
}

async fn ready_members(host: &Client) -> Result<usize> {
    let members: Api<flotilla_crds::MemberCluster> = Api::all(host.clone());
    let list = members
        .list(&ListParams::default().labels(&format!("{LABEL}={LABEL_VALUE}")))
        .await?;
    Ok(list
        .items
        .iter()
        .filter(|m| federation::member_ready(m))
        .count())
}

/// One phase's host writes.
struct Phase {
    name: &'static str,
    seconds: f64,
    writes: Requests,
}

impl Phase {
    fn row(&self) -> Vec<String> {
        let by = self.writes.writes_by_resource();
        let leases = by.get("leases").copied().unwrap_or(0);
        let total: u64 = by.values().sum();
        let flotilla = ["federatedmyapps", "memberclusters"]
            .iter()
            .map(|r| self.writes.bytes(r).0)
            .sum::<u64>();
        vec![
            self.name.into(),
            cell(self.seconds, 1),
            (total - leases).to_string(),
            cell((total - leases) as f64 / self.seconds.max(0.001), 2),
            self.writes.writes("federatedmyapps", "status").to_string(),
            self.writes.writes("memberclusters", "status").to_string(),
            self.writes.writes("events", "").to_string(),
            leases.to_string(),
            cell(flotilla as f64 / 1024.0, 1),
        ]
    }
}

/// Runs `during` and counts the host's writes over it (and `settle` after it).
async fn measure<F: Future<Output = Result<()>>>(
    host: &Client,
    name: &'static str,
    settle: Duration,
    during: F,
) -> Result<Phase> {
    eprintln!("bench hostwrites: {name}");
    let (start, before) = (Instant::now(), Requests::read(host).await?);
    during.await?;
    tokio::time::sleep(settle).await;
    let writes = Requests::read(host).await?.since(&before);
    let phase = Phase {
        name,
        seconds: start.elapsed().as_secs_f64(),
        writes,
    };
    // A long run that fails late still leaves the figures of the phases it finished.
    eprintln!("bench hostwrites: {name} done: {}", phase.row().join(" | "));
    Ok(phase)
}

async fn flap(agents: &[mpsc::Sender<Cmd>], away: Duration) -> Result<()> {
    for a in agents.iter().step_by(10) {
        a.send(Cmd::Flap(away))
            .await
            .context("a simulated agent ended")?;
    }
    Ok(())
}

async fn all_ready(host: &Client, clusters: usize, what: &str) -> Result<()> {
    wait_for(CONVERGE, what, || async {
        Ok((ready_members(host).await? == clusters).then_some(()))
    })
    .await
}

pub async fn hostwrites(env: &Env, size: Size) -> Result<Report> {
    ensure!(size.clusters >= 10, "--clusters must be at least 10");
    let f = Arc::new(federation::up(env).await?);
    let host = env.client(env.host()).await?;
    let agents: Vec<mpsc::Sender<Cmd>> = (0..size.clusters)
        .map(|i| {
            let (tx, rx) = mpsc::channel(1);
            tokio::spawn(sim_agent(f.clone(), cluster_name(i), rx));
            tx
        })
        .collect();
    let outcome = phases(env, &f, &host, &size, &agents).await;
    if let Err(e) = cleanup(&host, &size).await {
        // The figures are taken; a slow cleanup (a million pairs to delete) must not
        // lose them.
        eprintln!(
            "bench hostwrites: cleanup incomplete, hw-app-* FederatedMyApps may be left: {e:#}"
        );
    }
    drop(agents);
    let (phases, largest) = outcome?;
    Ok(report(&size, &phases, largest))
}

async fn phases(
    env: &Env,
    f: &Federation,
    host: &Client,
    size: &Size,
    agents: &[mpsc::Sender<Cmd>],
) -> Result<(Vec<Phase>, usize)> {
    let settle = HEARTBEAT_GRACE + Duration::from_secs(4);
    let converge = measure(host, "converge", Duration::ZERO, async {
        create(host, size).await?;
        all_ready(host, size.clusters, "every simulated cluster Ready").await?;
        wait_for(CONVERGE, "every app applied on every cluster", || async {
            let (applied, _) = statuses(host, size.clusters).await?;
            Ok((applied == size.apps).then_some(()))
        })
        .await
    })
    .await?;
    tokio::time::sleep(settle).await;
    let idle = measure(host, "idle", Duration::from_secs(size.idle_secs), async {
        Ok(())
    })
    .await?;
    let within = measure(
        host,
        "flap within grace (1/10)",
        settle,
        flap(agents, Duration::ZERO),
    )
    .await?;
    let past = measure(host, "flap past grace (1/10)", settle, async {
        flap(agents, HEARTBEAT_GRACE + Duration::from_secs(4)).await?;
        tokio::time::sleep(HEARTBEAT_GRACE + Duration::from_secs(6)).await;
        all_ready(host, size.clusters, "the flapped clusters Ready again").await
    })
    .await?;
    let restart = measure(host, "hub SIGKILL + start", settle, async {
        let hub = f.process(env, HUB)?;
        hub.signal(Signal::KILL)?;
        ensure!(
            hub.wait_gone(Duration::from_secs(10)),
            "the hub outlived SIGKILL"
        );
        f.start(env, HUB)?;
        f.wait_ready(HUB).await?;
        tokio::time::sleep(Duration::from_secs(5)).await;
        all_ready(host, size.clusters, "every cluster back with the new hub").await
    })
    .await?;
    let (_, largest) = statuses(host, size.clusters).await?;
    eprintln!("bench hostwrites: largest FederatedMyApp status {largest} B");
    Ok((vec![converge, idle, within, past, restart], largest))
}

/// Deletes the apps while the simulated agents still answer (their finalizers wait for
/// every cluster's confirmation), then the MemberClusters.
async fn cleanup(host: &Client, size: &Size) -> Result<()> {
    let apps: Api<FederatedMyApp> = Api::namespaced(host.clone(), NAMESPACE);
    for i in 0..size.apps {
        let _ = apps.delete(&app_name(i), &DeleteParams::default()).await;
    }
    wait_for(CONVERGE, "the bench's FederatedMyApps deleted", || async {
        let left = apps.list(&ListParams::default()).await?;
        Ok((!left
            .items
            .iter()
            .any(|a| a.name_any().starts_with("hw-app-")))
        .then_some(()))
    })
    .await?;
    let members: Api<flotilla_crds::MemberCluster> = Api::all(host.clone());
    let selector = ListParams::default().labels(&format!("{LABEL}={LABEL_VALUE}"));
    members
        .delete_collection(&DeleteParams::default(), &selector)
        .await?;
    Ok(())
}

fn report(size: &Size, phases: &[Phase], largest: usize) -> Report {
    let idle = phases.iter().find(|p| p.name == "idle");
    let idle_rate = idle.map_or(0.0, |p| {
        let by = p.writes.writes_by_resource();
        let total: u64 = by.values().sum::<u64>() - by.get("leases").copied().unwrap_or(0);
        total as f64 / p.seconds
    });
    let flapped = size.clusters.div_ceil(10);
    let per_flap = |name: &str| {
        phases.iter().find(|p| p.name == name).map_or(0.0, |p| {
            let w = p.writes.writes("federatedmyapps", "status")
                + p.writes.writes("memberclusters", "status");
            w as f64 / flapped as f64
        })
    };
    let (within, past) = (
        per_flap("flap within grace (1/10)"),
        per_flap("flap past grace (1/10)"),
    );
    Report {
        preamble: vec![
            format!(
                "hostwrites: the real hub on a real host apiserver, {} simulated clusters speaking the real protocol over TLS, {} apps on every one ({} pairs); writes counted by the host apiserver",
                size.clusters,
                size.apps,
                size.clusters * size.apps
            ),
            format!(
                "heartbeat every {}s, grace {}s; {flapped} clusters flap in each flap phase",
                HEARTBEAT.as_secs(),
                HEARTBEAT_GRACE.as_secs()
            ),
        ],
        header: [
            "phase",
            "s",
            "writes",
            "writes/s",
            "fma status",
            "mc status",
            "events",
            "lease writes",
            "flotilla KiB",
        ]
        .map(String::from)
        .to_vec(),
        rows: phases.iter().map(Phase::row).collect(),
        notes: vec![
            format!(
                "idle host writes/s (Leases aside, everything on the host): {idle_rate:.2} (target <= 1)"
            ),
            format!(
                "status writes per flapped cluster: within grace {within:.2}, past grace {past:.2}"
            ),
            format!(
                "largest FederatedMyApp status: {largest} bytes at {} clusters (target <= 16 KiB at 1,000)",
                size.clusters
            ),
        ],
        json: json!({
            "clusters": size.clusters,
            "apps": size.apps,
            "idle_writes_per_s": idle_rate,
            "status_writes_per_flap_within_grace": within,
            "status_writes_per_flap_past_grace": past,
            "largest_status_bytes": largest,
            "phases": phases.iter().map(|p| json!({"phase": p.name, "seconds": p.seconds, "writes": p.writes.writes_by_resource()})).collect::<Vec<_>>(),
        }),
    }
}
