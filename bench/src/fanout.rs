//! `flotilla-bench fanout` and `flotilla-bench resync`: one hub against K agents over real TLS on loopback.
//!
//! Three roles, two processes, so that the hub's figures are the hub's alone:
//! - the **hub** runs in a child process (`flotilla-bench serve hub`, this binary):
//!   K MemberClusters in a reflector store, M FederatedMyApps planned with the hub's
//!   own planning core (`flotilla_plan::plan`) into the `Dispatcher` and the
//!   `StatusBoard`, and the hub's `server::serve` (the tonic `FederationService`, TLS,
//!   keepalive, limits). It has no host apiserver: the index is built the way the planner
//!   builds it after the stores listed, and status is aggregated in memory but not
//!   written out;
//! - the **floor** runs in the same kind of child (`flotilla-bench serve floor`): a bare tonic
//!   service streaming, per cluster, the same number of Apply messages of the same size,
//!   then a SyncComplete listing the same keys, with no index, queue or authentication;
//! - the **agents** are load generators in this (the parent) process: each dials with
//!   the project's own client (TLS, bearer token), says Hello, acknowledges every Apply
//!   with a StatusReport at once (nothing is applied: there is no member apiserver), and
//!   after SyncComplete ends its half of the stream. The server ends the session only
//!   after it has read everything before that end, so an agent is done when every pair
//!   it received has been acknowledged to, and processed by, the server. With `--hold`
//!   the agents end their streams only once every one has synced, and the servers are
//!   read in between: every session open, as agents hold them in production.
//!
//! The hub's peak RSS (VmHWM) and CPU time (utime + stime) are read from
//! `/proc/<child pid>`; the 2 cores are still shared between the hub and the load
//! generators, which the table shows beside it.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use flotilla_crds::{FederatedMyApp, MemberCluster};
use flotilla_hub::auth::{MemberLookup, token_sha256};
use flotilla_hub::dispatch::Dispatcher;
use flotilla_hub::membership::{self, Membership};
use flotilla_hub::server::{FederationService, Host, Warning};
use flotilla_hub::status::{Planned, StatusBoard};
use flotilla_plan::admission::Admission;
use flotilla_plan::grants::Grants;
use flotilla_plan::index::Desired;
use flotilla_plan::plan;
use flotilla_plan::plan::plan_each;
use flotilla_plan::planner::{PLAN_CHUNK, key_of};
use flotilla_proto::client::{self, Dial, MAX_MESSAGE};
use flotilla_proto::v1::federation_server::{Federation, FederationServer};
use flotilla_proto::v1::{self as pb, agent_message, hub_message};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use prost::Message as _;
use secrecy::ExposeSecret;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

use super::procstat;
use super::{Report, cell, round};

const CERT_VAR: &str = "FLOTILLA_BENCH_CERT_PEM";
const KEY_VAR: &str = "FLOTILLA_BENCH_KEY_PEM";
/// A command the hub's child runs under, e.g. `heaptrack` to trace its allocations
/// during the fan-out (its peak RSS and CPU are then the wrapper's, not to be recorded).
const HUB_WRAPPER_VAR: &str = "FLOTILLA_BENCH_HUB_WRAPPER";
/// How long a server may take to plan everything before it listens (1M pairs included).
const SETUP_TIMEOUT: Duration = Duration::from_secs(1800);

/// K clusters, M apps, each placed on P of the clusters.
#[derive(clap::Args, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size {
    /// Member clusters K (one load-generating agent each)
    #[arg(long, default_value_t = 50)]
    pub clusters: usize,
    /// FederatedMyApps M
    #[arg(long, default_value_t = 1000)]
    pub apps: usize,
    /// Clusters P each app is placed on (an explicit list; one override each)
    #[arg(long = "per-app", default_value_t = 10)]
    pub per_app: usize,
}

impl Size {
    pub fn pairs(&self) -> usize {
        self.apps * self.per_app
    }

    /// The clusters app `app` is placed on: P consecutive ones, starting where the
    /// previous app's ended, so that every cluster gets the same share.
    pub fn placement(&self, app: usize) -> impl Iterator<Item = usize> + use<> {
        let (start, k) = (app * self.per_app, self.clusters);
        (0..self.per_app).map(move |j| (start + j) % k)
    }

    /// Each cluster's apps, in app order.
    pub fn apps_by_cluster(&self) -> Vec<Vec<u32>> {
        let mut by = vec![Vec::new(); self.clusters];
        for a in 0..self.apps {
            for c in self.placement(a) {
                by[c].push(a as u32);
            }
        }
        by
    }

    pub fn check(&self) -> Result<()> {
        ensure!(
            self.clusters > 0 && self.apps > 0 && self.per_app > 0,
            "--clusters, --apps and --per-app must be positive"
        );
        ensure!(
            self.per_app <= self.clusters,
            "--per-app ({}) cannot exceed --clusters ({})",
            self.per_app,
            self.clusters
        );
        Ok(())
    }

    fn args(&self) -> Vec<String> {
        vec![
            "--clusters".into(),
            self.clusters.to_string(),
            "--apps".into(),
            self.apps.to_string(),
            "--per-app".into(),
            self.per_app.to_string(),
        ]
    }

    fn describe(&self) -> String {
        format!(
            "{} clusters, {} apps on {} clusters each = {} pairs",
            self.clusters,
            self.apps,
            self.per_app,
            self.pairs()
        )
    }
}

pub fn cluster_name(i: usize) -> String {
    format!("member{i:04}")
}

fn cluster_index(name: &str) -> Option<usize> {
    name.strip_prefix("member")?.parse().ok()
}

fn app_name(a: usize) -> String {
    format!("app{a:06}")
}

fn token(cluster: &str) -> String {
    format!("{cluster}.bench-secret")
}

/// App `a`: placed by an explicit list, one override (replicas on its first cluster), and
/// a config entry of its own so that no two apps render the same bytes.
pub fn fed_app(a: usize, size: &Size) -> FederatedMyApp {
    let clusters: Vec<String> = size.placement(a).map(cluster_name).collect();
    serde_json::from_value(json!({
        "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
        "metadata": {"name": app_name(a), "namespace": "default", "generation": 1,
                     "finalizers": [flotilla_crds::federated::HUB_FINALIZER]},
        "spec": {
            "placement": {"clusters": clusters.iter().map(|c| json!({"name": c})).collect::<Vec<_>>()},
            "template": {"spec": {"replicas": 2, "image": "nginx:1.27", "config": {"a.conf": format!("id={a}")}}},
            "overrides": [{"clusterName": clusters[0], "clusterOverrides": [{"path": "/spec/replicas", "value": 3}]}]
        }
    }))
    .expect("the bench FederatedMyApp is valid")
}

fn member_cluster(name: &str) -> MemberCluster {
    serde_json::from_value(json!({
        "apiVersion": "core.kubefed.io/v1beta1", "kind": "MemberCluster",
        "metadata": {"name": name},
        "spec": {"tokenSha256": token_sha256(&token(name))}
    }))
    .expect("the bench MemberCluster is valid")
}

// ---------------------------------------------------------------------------------------
// The servers (child processes)

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The hub's FederationService over its planned index
    Hub,
    /// A bare tonic stream of the same messages
    Floor,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::Hub => "hub",
            Role::Floor => "floor",
        }
    }
}

/// `flotilla-bench serve <role>`: sets up, prints `ready <addr> <setup seconds>`, serves until
/// stdin closes.
pub async fn serve(role: Role, size: Size) -> Result<()> {
    size.check()?;
    // As `flotilla-hub run` does, for either role: each agent holds a file.
    flotilla_hub::edge::raise_open_files_limit(&Default::default())?;
    let cert = std::env::var(CERT_VAR).with_context(|| format!("{CERT_VAR} is not set"))?;
    let key = std::env::var(KEY_VAR).with_context(|| format!("{KEY_VAR} is not set"))?;
    let identity = Identity::from_pem(&cert, &key);
    let identity_pem = (cert, key);
    let addr: SocketAddr = flotilla_lab::support::free_addr()?.parse()?;
    let shutdown = CancellationToken::new();
    let start = Instant::now();
    // Held while serving: the hub closes its sessions when leadership ends.
    let (_leading, leading) = tokio::sync::watch::channel(true);
    let mut apps = Vec::new();
    let server = match role {
        Role::Hub => {
            let (service, planned) = hub_service(&size, leading)?;
            apps = planned;
            tokio::spawn(flotilla_hub::server::serve(
                addr,
                flotilla_hub::serving::ServingCert::from_pem(
                    identity_pem.0.as_bytes(),
                    identity_pem.1.as_bytes(),
                )?
                .server_config(),
                Default::default(),
                service,
                shutdown.clone(),
            ))
        }
        Role::Floor => {
            let bare = Bare::new(&size)?;
            // The hub's backlog, so that both accept a fleet dialling at once alike.
            let listener = flotilla_hub::edge::listen(addr)?;
            let router = Server::builder()
                .tls_config(ServerTlsConfig::new().identity(identity))?
                .add_service(
                    FederationServer::new(bare)
                        .max_decoding_message_size(MAX_MESSAGE)
                        .max_encoding_message_size(MAX_MESSAGE),
                );
            let stop = shutdown.clone();
            tokio::spawn(async move {
                router
                    .serve_with_incoming_shutdown(
                        TcpListenerStream::new(listener),
                        stop.cancelled_owned(),
                    )
                    .await
                    .context("serving the floor")
            })
        }
    };
    let setup = start.elapsed();
    flotilla_lab::wait_for(Duration::from_secs(10), "the server to listen", || async {
        Ok(tokio::net::TcpStream::connect(addr).await.ok().map(|_| ()))
    })
    .await?;
    println!("ready {addr} {}", setup.as_secs_f64());
    // Serve until the parent closes stdin (or dies).
    let mut sink = Vec::new();
    let _ = tokio::io::stdin().read_to_end(&mut sink).await;
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    drop(apps);
    Ok(())
}

/// The hub's service over an index planned the way the planner plans it.
fn hub_service(
    size: &Size,
    leading: tokio::sync::watch::Receiver<bool>,
) -> Result<(FederationService, Vec<Arc<FederatedMyApp>>)> {
    let (store, mut writer) = reflector::store::<MemberCluster>();
    writer.apply_watcher_event(&watcher::Event::Init);
    for i in 0..size.clusters {
        writer.apply_watcher_event(&watcher::Event::InitApply(member_cluster(&cluster_name(i))));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    let members = membership::registered(&store);
    let dispatcher = Arc::new(Dispatcher::default());
    let status = Arc::new(StatusBoard::default());
    // Kept while serving, as the hub's FederatedMyApp store keeps them.
    let apps: Vec<Arc<FederatedMyApp>> =
        (0..size.apps).map(|a| Arc::new(fed_app(a, size))).collect();
    let mut pairs = 0;
    // As the hub's planner plans many apps: a chunk's plans on every core, then each
    // plan into the index and the board in turn.
    for chunk in apps.chunks(PLAN_CHUNK) {
        let plans = plan_each(chunk, &members, &Admission::default(), &Grants::default());
        for (app, plan) in chunk.iter().zip(plans) {
            let key = key_of(app);
            let desired = plan.desired();
            pairs += desired
                .values()
                .filter(|d| matches!(d, Desired::Apply(_)))
                .count();
            dispatcher.set_app(&key, app.metadata.generation, desired);
            status.set_plan(
                &key,
                Planned {
                    plan,
                    deleting_on: None,
                },
            );
        }
    }
    ensure!(
        pairs == size.pairs(),
        "planned {pairs} pairs, expected {}",
        size.pairs()
    );
    dispatcher.planned_for(members.into_keys().map(|c| c.to_string()).collect());
    let service = FederationService {
        dispatcher: dispatcher.clone(),
        status,
        membership: Arc::new(Membership::new(Duration::from_secs(60))),
        // Its renewal loop is not run: tokens are not renewed here.
        renewer: Arc::new(flotilla_hub::renew::Renewer::new(
            kube::Api::all(kube::Client::try_from(kube::Config::new(
                "http://127.0.0.1:1".parse()?,
            ))?),
            store.clone(),
            dispatcher.clone(),
            Duration::from_secs(3600),
            Default::default(),
        )),
        host: Arc::new(NoEvents(store)),
        leading,
        admissions: Default::default(),
        refusals: Default::default(),
    };
    Ok((service, apps))
}

/// The MemberClusters, and no Events: the service's (an expired token, a held-back
/// collection) never happen here.
struct NoEvents(Store<MemberCluster>);

impl MemberLookup for NoEvents {
    fn member(&self, name: &str) -> Option<Arc<MemberCluster>> {
        self.0.member(name)
    }
}

#[tonic::async_trait]
impl Host for NoEvents {
    async fn warn(&self, cluster: &str, warning: Warning) {
        unreachable!("{cluster}: {warning:?}")
    }
}

/// The floor: streams prebuilt messages, reads the acknowledgements, nothing else.
struct Bare {
    apps_by_cluster: Arc<Vec<Vec<u32>>>,
    hash: String,
    manifest: Bytes,
    live: Arc<AtomicUsize>,
}

impl Bare {
    fn new(size: &Size) -> Result<Bare> {
        // One app's rendered bytes, the same size as every app's.
        let members = (0..size.clusters)
            .map(|i| (cluster_name(i).into(), Default::default()))
            .collect();
        let desired = plan(
            &fed_app(0, size),
            &members,
            &Admission::default(),
            &Grants::default(),
        )
        .desired();
        let Some(Desired::Apply(one)) = desired.into_values().last() else {
            bail!("the sample app did not render");
        };
        Ok(Bare {
            apps_by_cluster: Arc::new(size.apps_by_cluster()),
            hash: one.hash.clone(),
            manifest: one.json.clone(),
            live: Arc::default(),
        })
    }
}

fn object_key(a: usize) -> pb::ObjectKey {
    pb::ObjectKey {
        namespace: "default".into(),
        name: app_name(a),
    }
}

#[tonic::async_trait]
impl Federation for Bare {
    type SessionStream = ReceiverStream<Result<pb::HubMessage, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let mut inbound = request.into_inner();
        let cluster = match inbound.message().await? {
            Some(pb::AgentMessage {
                kind: Some(agent_message::Kind::Hello(h)),
            }) => h.cluster,
            _ => return Err(Status::invalid_argument("Hello first")),
        };
        let apps = cluster_index(&cluster)
            .and_then(|i| self.apps_by_cluster.get(i))
            .ok_or_else(|| Status::not_found(cluster))?
            .clone();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let (hash, manifest, live) = (self.hash.clone(), self.manifest.clone(), self.live.clone());
        live.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            for &a in &apps {
                let apply = pb::Apply {
                    key: Some(object_key(a as usize)),
                    hash: hash.clone(),
                    manifest: manifest.clone(),
                };
                let m = pb::HubMessage {
                    kind: Some(hub_message::Kind::Apply(apply)),
                };
                if tx.send(Ok(m)).await.is_err() {
                    break;
                }
            }
            let sync = pb::SyncComplete {
                desired: apps.iter().map(|&a| object_key(a as usize)).collect(),
                confirmed_collection: 0,
            };
            let _ = tx
                .send(Ok(pb::HubMessage {
                    kind: Some(hub_message::Kind::SyncComplete(sync)),
                }))
                .await;
            // Read the acknowledgements until the agent ends its stream, then end ours.
            while let Ok(Some(_)) = inbound.message().await {}
            live.fetch_sub(1, Ordering::SeqCst);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A server child process.
struct Child {
    child: tokio::process::Child,
    stdin: Option<tokio::process::ChildStdin>,
    pid: u32,
    addr: SocketAddr,
    setup_s: f64,
}

impl Child {
    async fn start(
        role: Role,
        size: &Size,
        tls: &flotilla_common::tls::SelfSigned,
    ) -> Result<Child> {
        let exe = std::env::current_exe().context("locating this binary")?;
        let wrapper = (role == Role::Hub)
            .then(|| std::env::var(HUB_WRAPPER_VAR).ok())
            .flatten()
            .filter(|w| !w.is_empty());
        let wrapped = wrapper.is_some();
        let mut command = match wrapper {
            Some(wrapper) => {
                let mut command = tokio::process::Command::new(wrapper);
                command.arg(exe);
                command
            }
            None => tokio::process::Command::new(exe),
        };
        let mut child = command
            .args(["serve", role.as_str()])
            .args(size.args())
            .env(CERT_VAR, &tls.cert_pem)
            .env(KEY_VAR, tls.key_pem.expose_secret())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("starting the bench server")?;
        let pid = child.id().context("the bench server has no pid")?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().context("no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(SETUP_TIMEOUT, async {
            loop {
                let line = lines.next_line().await?;
                match line {
                    // What a wrapper prints of its own goes to stderr.
                    Some(line) if wrapped && !line.starts_with("ready ") => eprintln!("{line}"),
                    line => return Ok::<_, std::io::Error>(line),
                }
            }
        })
        .await
        .context("the bench server did not get ready")??
        .with_context(|| format!("the {} server exited before it was ready", role.as_str()))?;
        let mut words = line.split_whitespace();
        let (Some("ready"), Some(addr), Some(setup)) = (words.next(), words.next(), words.next())
        else {
            bail!("unexpected line from the bench server: {line:?}");
        };
        Ok(Child {
            child,
            stdin,
            pid,
            addr: addr.parse()?,
            setup_s: setup.parse()?,
        })
    }

    /// Closes its stdin and waits for it to exit (kills it after 30 s).
    async fn stop(mut self) -> Result<()> {
        drop(self.stdin.take());
        match tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await {
            Ok(status) => {
                status?;
            }
            Err(_) => {
                self.child.kill().await?;
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// The agents (load generators, in this process)

/// What one agent saw in one session.
#[derive(Debug, Default, Clone)]
pub struct AgentRun {
    pub applies: u64,
    pub deletes: u64,
    /// Encoded size of the Apply and Delete messages received.
    pub apply_bytes: u64,
    /// Encoded size of the SyncComplete received.
    pub sync_bytes: u64,
    /// From the start of the phase to this agent's SyncComplete.
    pub to_sync: Duration,
    /// What it holds afterwards (only when asked to keep it).
    pub held: Vec<pb::Managed>,
    /// Sessions that failed to open and were opened again.
    pub retries: u64,
}

async fn dial(addr: SocketAddr, ca: &str, cluster: &str) -> Result<client::HubClient> {
    let dial = Dial {
        hub: format!("https://{addr}"),
        ca_pem: ca.as_bytes().to_vec(),
        server_name: Some("localhost".into()),
        token: token(cluster).into(),
        keepalive: Duration::from_secs(30),
        keepalive_timeout: Duration::from_secs(30),
    };
    let mut attempt = 0;
    loop {
        match client::connect(&dial).await {
            Ok(c) => return Ok(c),
            Err(e) if attempt >= 5 => return Err(e).context(format!("{cluster}: dialling")),
            Err(_) => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
            }
        }
    }
}

/// With `--hold`: the agents keep their sessions open once synced, as agents in production
/// do, until every one has synced and the server has been read in that state.
#[derive(Clone)]
struct Hold {
    synced: tokio::sync::mpsc::UnboundedSender<()>,
    release: CancellationToken,
}

/// One load-generating agent: Hello with `managed`, an immediate StatusReport for every
/// Apply, and after SyncComplete (and the release, if it `hold`s) the end of its stream;
/// done when the server has read it all and ended the session.
async fn agent(
    addr: SocketAddr,
    ca: Arc<String>,
    cluster: String,
    managed: Vec<pb::Managed>,
    keep: bool,
    hold: Option<Hold>,
    start: Instant,
) -> Result<AgentRun> {
    let hello = pb::Hello {
        cluster: cluster.clone(),
        agent_version: "bench-load-generator".into(),
        kubernetes_version: "none (load generator)".into(),
        managed,
        cluster_uid: String::new(),
        cluster_id: String::new(),
        // Simulated agents store no renewed token.
        renews_token: false,
        // Every namespace.
        scope: Vec::new(),
    };
    // Like an agent, retry a session the hub refused or dropped while opening it (seen
    // under heavy load: the connection broke before the response headers).
    let mut retries = 0;
    let (tx, mut inbound) = loop {
        let opened = async {
            let mut hub = dial(addr, &ca, &cluster).await?;
            client::open_session(&mut hub, hello.clone(), 64)
                .await
                .with_context(|| format!("{cluster}: opening the session"))
        };
        match opened.await {
            Ok(session) => break session,
            Err(e) if retries >= 5 => return Err(e),
            Err(e) => {
                retries += 1;
                eprintln!("bench: {e:#}; retrying ({retries})");
                tokio::time::sleep(Duration::from_millis(500 * retries)).await;
            }
        }
    };
    let mut run = AgentRun {
        retries,
        ..AgentRun::default()
    };
    loop {
        let m = inbound
            .message()
            .await
            .with_context(|| format!("{cluster}: reading the session"))?
            .with_context(|| format!("{cluster}: the session ended before SyncComplete"))?;
        let len = m.encoded_len() as u64;
        match m.kind {
            Some(hub_message::Kind::Apply(a)) => {
                run.applies += 1;
                run.apply_bytes += len;
                let ack = pb::StatusReport {
                    key: a.key.clone(),
                    hash: a.hash.clone(),
                    exists: true,
                    ready: true,
                    ready_replicas: 2,
                    observed_generation: 1,
                    generation: 1,
                    ..Default::default()
                };
                if keep {
                    run.held.push(pb::Managed {
                        key: a.key,
                        hash: a.hash,
                    });
                }
                tx.send(pb::AgentMessage {
                    kind: Some(agent_message::Kind::Status(ack)),
                })
                .await
                .with_context(|| format!("{cluster}: the session closed"))?;
            }
            Some(hub_message::Kind::Delete(_)) => {
                run.deletes += 1;
                run.apply_bytes += len;
            }
            Some(hub_message::Kind::SyncComplete(_)) => {
                run.sync_bytes += len;
                run.to_sync = start.elapsed();
                break;
            }
            // Never sent: its Hello says it stores no renewed token.
            Some(hub_message::Kind::RenewToken(_)) | None => {}
        }
    }
    if let Some(hold) = hold {
        let _ = hold.synced.send(());
        // Whatever the server sends meanwhile is read (it sends nothing to a synced agent).
        tokio::select! {
            _ = hold.release.cancelled() => {}
            m = inbound.message() => match m {
                Ok(Some(m)) => bail!("{cluster}: the server sent {m:?} to a synced agent"),
                Ok(None) => bail!("{cluster}: the server ended a synced agent's session"),
                // E.g. the server's keepalive gave up on a load generator too busy to answer.
                Err(e) => bail!("{cluster}: a synced agent's session broke: {e}"),
            },
        }
    }
    // End our half; the server reads up to the end, in order, then ends the session.
    drop(tx);
    while let Ok(Some(_)) = inbound.message().await {}
    Ok(run)
}

/// The server while every agent held its synced session (`--hold`).
#[derive(Debug, Clone, Copy)]
struct Held {
    /// Its resident set then.
    rss_mib: f64,
    /// Its open file descriptors then.
    open_files: usize,
}

/// Every agent at once; returns when every one is done. With `hold` (the server's pid),
/// the server is read once every agent has synced, and only then are they released.
async fn run_agents(
    addr: SocketAddr,
    ca: &str,
    size: &Size,
    mut managed: Vec<Vec<pb::Managed>>,
    keep: bool,
    hold: Option<u32>,
) -> Result<(Duration, Vec<AgentRun>, Option<Held>)> {
    let ca = Arc::new(ca.to_owned());
    managed.resize(size.clusters, Vec::new());
    let (synced, mut synced_rx) = tokio::sync::mpsc::unbounded_channel();
    let release = CancellationToken::new();
    let hold_with = hold.map(|_| Hold {
        synced,
        release: release.clone(),
    });
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, m) in managed.into_iter().enumerate() {
        let agent = agent(
            addr,
            ca.clone(),
            cluster_name(i),
            m,
            keep,
            hold_with.clone(),
            start,
        );
        tasks.spawn(async move { agent.await.map(|run| (i, run)) });
    }
    drop(hold_with);
    let mut held = None;
    if let Some(pid) = hold {
        for _ in 0..size.clusters {
            tokio::select! {
                Some(()) = synced_rx.recv() => {}
                Some(ended) = tasks.join_next() => {
                    let (i, _) = ended??;
                    bail!("{} ended its session before every agent had synced", cluster_name(i));
                }
            }
        }
        let sample = procstat::sample(Some(pid))?;
        held = Some(Held {
            rss_mib: sample.rss_mib,
            open_files: procstat::open_files(pid)?,
        });
        release.cancel();
    }
    let mut runs = Vec::with_capacity(size.clusters);
    while let Some(ended) = tasks.join_next().await {
        runs.push(ended??);
    }
    runs.sort_unstable_by_key(|(i, _)| *i);
    let runs = runs.into_iter().map(|(_, run)| run).collect();
    Ok((start.elapsed(), runs, held))
}

/// One phase against one server: its time, and the server's and the load generators'
/// resources over it.
#[derive(Debug, Clone)]
struct Phase {
    seconds: f64,
    /// The latest SyncComplete.
    to_sync_s: f64,
    applies: u64,
    apply_bytes: u64,
    sync_bytes: u64,
    server_cpu_s: f64,
    server_peak_rss_mib: f64,
    loadgen_cpu_s: f64,
    retries: u64,
    runs: Vec<AgentRun>,
    /// Its RSS after its set-up, before any agent dialled.
    setup_rss_mib: f64,
    held: Option<Held>,
}

impl Phase {
    /// What each held stream cost the server beyond its set-up, KiB.
    fn kib_per_stream(&self, streams: usize) -> Option<f64> {
        let held = self.held?;
        Some((held.rss_mib - self.setup_rss_mib) * 1024.0 / streams as f64)
    }

    /// The server as every agent held its synced session, in words (`--hold` only).
    fn held_note(&self, what: &str, streams: usize) -> Option<String> {
        let (held, per) = (self.held?, self.kib_per_stream(streams)?);
        Some(format!(
            "{what} with every agent synced and holding its session: RSS {:.0} MiB ({per:.1} KiB a stream beyond its {:.0} MiB before the agents), {} open files",
            held.rss_mib, self.setup_rss_mib, held.open_files
        ))
    }

    /// The same, for `--json` (null without `--hold`).
    fn held_json(&self, streams: usize) -> Value {
        let (Some(held), Some(per)) = (self.held, self.kib_per_stream(streams)) else {
            return Value::Null;
        };
        json!({"rss_mib": round(held.rss_mib, 1), "kib_per_stream": round(per, 2), "open_files": held.open_files})
    }
}

async fn phase(
    server: &Child,
    ca: &str,
    size: &Size,
    managed: Vec<Vec<pb::Managed>>,
    keep: bool,
    hold: bool,
) -> Result<Phase> {
    let (s0, l0) = (procstat::sample(Some(server.pid))?, procstat::sample(None)?);
    let hold = hold.then_some(server.pid);
    let (elapsed, runs, held) = run_agents(server.addr, ca, size, managed, keep, hold).await?;
    let (s1, l1) = (procstat::sample(Some(server.pid))?, procstat::sample(None)?);
    Ok(Phase {
        seconds: elapsed.as_secs_f64(),
        to_sync_s: runs
            .iter()
            .map(|r| r.to_sync.as_secs_f64())
            .fold(0.0, f64::max),
        applies: runs.iter().map(|r| r.applies).sum(),
        apply_bytes: runs.iter().map(|r| r.apply_bytes).sum(),
        sync_bytes: runs.iter().map(|r| r.sync_bytes).sum(),
        server_cpu_s: s1.cpu_s - s0.cpu_s,
        server_peak_rss_mib: s1.peak_rss_mib,
        loadgen_cpu_s: l1.cpu_s - l0.cpu_s,
        retries: runs.iter().map(|r| r.retries).sum(),
        runs,
        setup_rss_mib: s0.rss_mib,
        held,
    })
}

fn tls() -> Result<flotilla_common::tls::SelfSigned> {
    Ok(flotilla_common::tls::self_signed(
        "flotilla bench CA",
        "flotilla-bench",
        &["localhost".into()],
    )?)
}

const HOW: &str = "TLS gRPC on loopback; hub and floor each in their own process; the agents are load generators in this process that acknowledge every Apply with a StatusReport (no member apiserver)";

/// `bench fanout`.
pub async fn fanout(size: Size, hold: bool) -> Result<Report> {
    Ok(measure(size, hold).await?.report())
}

/// One size's fan-out: the floor's, then the hub's.
pub struct Measured {
    size: Size,
    floor: Phase,
    hub: Phase,
    hub_setup_s: f64,
    /// The hub's process right after its set-up.
    setup: procstat::Sample,
}

/// `bench fanout --sweep-apps A,B,… --svg PATH`: one fan-out per number of apps (the
/// clusters and the clusters per app as given), each table as it ends, then the figures
/// per pair against the number of pairs, hub beside floor, as a table and a chart.
pub async fn sweep(
    size: Size,
    apps: &[usize],
    svg: Option<&std::path::Path>,
    hold: bool,
) -> Result<Report> {
    ensure!(!apps.is_empty(), "--sweep-apps names no size");
    // Each run with its report's JSON, made once for the table printed as it ends.
    let mut runs = Vec::with_capacity(apps.len());
    for &apps in apps {
        let run = measure(Size { apps, ..size }, hold).await?;
        let report = run.report();
        eprint!("{}", report.table());
        runs.push((run, report.json));
    }
    runs.sort_by_key(|(r, _)| r.size.pairs());
    let per_pair = |p: &Phase, pairs: f64| crate::chart::PerPair {
        pushes_per_s: pairs / p.seconds.max(1e-9),
        cpu_us: p.server_cpu_s * 1e6 / pairs,
        peak_rss_kib: p.server_peak_rss_mib * 1024.0 / pairs,
    };
    let points: Vec<crate::chart::SweepPoint> = (runs.iter())
        .map(|(r, _)| {
            let pairs = r.size.pairs() as f64;
            crate::chart::SweepPoint {
                pairs,
                hub: per_pair(&r.hub, pairs),
                floor: per_pair(&r.floor, pairs),
            }
        })
        .collect();
    if let Some(path) = svg {
        let title = format!(
            "fan-out, {} clusters, {} clusters per app: hub and floor per pair",
            size.clusters, size.per_app
        );
        let chart = crate::chart::sweep_svg(&title, &points)?;
        std::fs::write(path, chart).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("bench fanout: the chart is in {}", path.display());
    }
    let rows = points.iter().flat_map(|p| {
        [("floor", &p.floor), ("hub", &p.hub)].map(|(case, f)| {
            vec![
                format!("{}", p.pairs),
                case.to_owned(),
                cell(f.pushes_per_s, 0),
                cell(f.cpu_us, 2),
                cell(f.peak_rss_kib, 3),
            ]
        })
    });
    Ok(Report {
        preamble: vec![
            format!(
                "fan-out sweep: {} clusters, {} clusters per app, apps {apps:?}",
                size.clusters, size.per_app
            ),
            HOW.to_owned(),
        ],
        header: [
            "pairs",
            "case",
            "pushes/s",
            "server CPU µs/pair",
            "server peak RSS KiB/pair",
        ]
        .map(String::from)
        .to_vec(),
        rows: rows.collect(),
        notes: vec![],
        json: json!({
            "scenario": "fanout-sweep",
            "runs": runs.into_iter().map(|(_, json)| json).collect::<Vec<_>>(),
        }),
    })
}

async fn measure(size: Size, hold: bool) -> Result<Measured> {
    size.check()?;
    let tls = tls()?;

    eprintln!("bench fanout: {}: floor", size.describe());
    let floor_server = Child::start(Role::Floor, &size, &tls).await?;
    let floor = phase(&floor_server, &tls.ca_pem, &size, Vec::new(), false, hold).await;
    floor_server.stop().await?;
    let floor = floor?;
    ensure!(
        floor.applies as usize == size.pairs(),
        "the floor delivered {} Applies, expected {}",
        floor.applies,
        size.pairs()
    );

    eprintln!(
        "bench fanout: {}: hub (planning every pair first)",
        size.describe()
    );
    let hub_server = Child::start(Role::Hub, &size, &tls).await?;
    let setup = procstat::sample(Some(hub_server.pid))?;
    let hub_setup_s = hub_server.setup_s;
    let hub = phase(&hub_server, &tls.ca_pem, &size, Vec::new(), false, hold).await;
    hub_server.stop().await?;
    let hub = hub?;
    ensure!(
        hub.applies as usize == size.pairs(),
        "the hub delivered {} Applies, expected {} (every pair exactly once)",
        hub.applies,
        size.pairs()
    );
    Ok(Measured {
        size,
        floor,
        hub,
        hub_setup_s,
        setup,
    })
}

impl Measured {
    fn report(&self) -> Report {
        let Measured {
            size,
            ref floor,
            ref hub,
            hub_setup_s,
            setup,
        } = *self;
        let pairs = size.pairs() as f64;
        let rate = |s: f64| pairs / s;
        let row = |what: &str, p: &Phase| {
            vec![
                what.to_owned(),
                cell(p.seconds, 2),
                cell(rate(p.seconds), 0),
                cell(p.seconds / floor.seconds, 2),
                cell(p.server_peak_rss_mib, 0),
                cell(p.server_cpu_s, 2),
                cell(p.loadgen_cpu_s, 2),
            ]
        };
        Report {
        preamble: vec![
            format!("fan-out: {}", size.describe()),
            HOW.to_owned(),
            "seconds: all agents dial → every pair pushed and its acknowledgement read by the server".to_owned(),
        ],
        header: [
            "case",
            "seconds",
            "pushes/s",
            "× floor",
            "server peak RSS MiB",
            "server CPU s",
            "load gen CPU s",
        ]
        .map(String::from)
        .to_vec(),
        rows: vec![
            row("floor: bare tonic stream, same messages", floor),
            row("hub: auth, index diff, queues, reports", hub),
        ],
        notes: vec![
            format!(
                "hub set-up before the agents (flotilla_plan::plan: placement, overrides, render, hash; index; status board): {:.2} s ({:.0} pairs/s), {:.2} CPU s, RSS {:.0} MiB after it",
                hub_setup_s,
                pairs / hub_setup_s.max(1e-9),
                setup.cpu_s,
                setup.rss_mib
            ),
            format!(
                "hub from cold (set-up + fan-out): {:.2} s, {:.2} CPU s in total",
                hub_setup_s + hub.seconds,
                setup.cpu_s + hub.server_cpu_s
            ),
            format!(
                "sessions opened again after a refusal or a broken connection: floor {}, hub {}",
                floor.retries, hub.retries
            ),
        ]
        .into_iter()
        .chain(hub.held_note("hub", size.clusters))
        .chain(floor.held_note("floor", size.clusters))
        .collect(),
        json: json!({
            "scenario": "fanout",
            "clusters": size.clusters,
            "apps": size.apps,
            "per_app": size.per_app,
            "pairs": size.pairs(),
            "seconds": round(hub.seconds, 3),
            "pushes_per_s": round(rate(hub.seconds), 0),
            "hub_peak_rss_mib": round(hub.server_peak_rss_mib, 1),
            "hub_cpu_s": round(hub.server_cpu_s, 2),
            "hub_setup_s": round(hub_setup_s, 3),
            "hub_setup_cpu_s": round(setup.cpu_s, 2),
            "hub_rss_after_setup_mib": round(setup.rss_mib, 1),
            "floor_seconds": round(floor.seconds, 3),
            "floor_pushes_per_s": round(rate(floor.seconds), 0),
            "floor_peak_rss_mib": round(floor.server_peak_rss_mib, 1),
            "floor_cpu_s": round(floor.server_cpu_s, 2),
            "session_retries": hub.retries,
            "hub_held": hub.held_json(size.clusters),
            "floor_held": floor.held_json(size.clusters),
        }),
    }
    }
}

/// `bench resync`: the agents sync once with nothing applied (the baseline), the hub
/// process is stopped and a new one plans everything again, and the agents reconnect
/// saying in Hello that they hold every MyApp at its current hash. Target: no Apply.
/// With `hold`, each hub is read as every agent holds its synced session: after the
/// restart a session has read a Hello listing every MyApp of its cluster.
pub async fn resync(size: Size, hold: bool) -> Result<Report> {
    size.check()?;
    let tls = tls()?;
    eprintln!(
        "bench resync: {}: first sync, agents holding nothing",
        size.describe()
    );
    let first = Child::start(Role::Hub, &size, &tls).await?;
    let cold = phase(&first, &tls.ca_pem, &size, Vec::new(), true, hold).await;
    first.stop().await?;
    let mut cold = cold?;
    let held: Vec<Vec<pb::Managed>> = cold
        .runs
        .iter_mut()
        .map(|r| std::mem::take(&mut r.held))
        .collect();
    eprintln!("bench resync: hub restarted; agents reconnect holding everything");
    let second = Child::start(Role::Hub, &size, &tls).await?;
    let warm = phase(&second, &tls.ca_pem, &size, held, false, hold).await;
    second.stop().await?;
    let warm = warm?;

    let row = |what: &str, p: &Phase| {
        vec![
            what.to_owned(),
            p.applies.to_string(),
            p.apply_bytes.to_string(),
            p.sync_bytes.to_string(),
            cell(p.to_sync_s, 2),
            cell(p.server_cpu_s, 2),
        ]
    };
    Ok(Report {
        preamble: vec![
            format!("resync after a hub restart: {}", size.describe()),
            HOW.to_owned(),
            "bytes: protobuf-encoded messages from the hub; seconds: all agents dial → the last SyncComplete".to_owned(),
        ],
        header: [
            "case",
            "Apply messages",
            "Apply bytes",
            "SyncComplete bytes",
            "seconds",
            "hub CPU s",
        ]
        .map(String::from)
        .to_vec(),
        rows: vec![
            row("baseline: first sync, agents hold nothing", &cold),
            row("resync: new hub, agents hold everything", &warm),
        ],
        notes: vec![
            format!(
                "target: 0 Apply messages on an unchanged resync ({})",
                if warm.applies == 0 { "met" } else { "missed" }
            ),
            format!(
                "sessions opened again after a refusal or a broken connection: baseline {}, resync {}",
                cold.retries, warm.retries
            ),
        ]
        .into_iter()
        .chain(cold.held_note("hub, baseline", size.clusters))
        .chain(warm.held_note("hub after the restart", size.clusters))
        .collect(),
        json: json!({
            "scenario": "resync",
            "clusters": size.clusters,
            "apps": size.apps,
            "per_app": size.per_app,
            "pairs": size.pairs(),
            "apply_messages": warm.applies,
            "bytes": warm.apply_bytes + warm.sync_bytes,
            "apply_bytes": warm.apply_bytes,
            "seconds": round(warm.to_sync_s, 3),
            "hub_cpu_s": round(warm.server_cpu_s, 2),
            "baseline_apply_messages": cold.applies,
            "baseline_bytes": cold.apply_bytes + cold.sync_bytes,
            "baseline_seconds": round(cold.to_sync_s, 3),
            "hub_held": warm.held_json(size.clusters),
            "baseline_hub_held": cold.held_json(size.clusters),
        }),
    })
}
