//! Hub fan-out over real gRPC with TLS on loopback: C agents connect with nothing
//! applied, and the hub pushes every (cluster, app) pair it rendered, then SyncComplete.
//! Prints pushes per second against a floor measured in the same run: a bare tonic
//! service streaming the same messages over the same TLS, with no index, queue or auth.
//!
//!   cargo bench -p flotilla-hub --bench fanout -- [CLUSTERS] [APPS]   (default 100 1000)

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_crds::{FederatedMyApp, MemberCluster};
use flotilla_hub::auth::token_sha256;
use flotilla_hub::dispatch::Dispatcher;
use flotilla_hub::index::{AppKey, Desired};
use flotilla_hub::membership::Membership;
use flotilla_hub::placement::Members;
use flotilla_hub::server::FederationService;
use flotilla_hub::status::StatusBoard;
use flotilla_proto::client::{self, Dial};
use flotilla_proto::v1::federation_server::{Federation, FederationServer};
use flotilla_proto::v1::{self as pb, hub_message};
use kube::runtime::reflector;
use kube::runtime::watcher;
use serde_json::json;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

fn tls() -> flotilla_common::tls::SelfSigned {
    flotilla_common::tls::self_signed("bench CA", "bench", &["localhost".into()]).unwrap()
}

async fn serve<S: Federation>(service: S, tls: &flotilla_common::tls::SelfSigned) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = Server::builder()
        .tls_config(
            ServerTlsConfig::new().identity(Identity::from_pem(&tls.cert_pem, &tls.key_pem)),
        )
        .unwrap()
        .add_service(FederationServer::new(service).max_decoding_message_size(16 << 20));
    tokio::spawn(server.serve_with_incoming(TcpListenerStream::new(listener)));
    addr
}

/// One agent: Hello, then counts Apply messages until SyncComplete.
async fn agent(addr: SocketAddr, ca: String, cluster: String, token: String) -> usize {
    let mut hub = client::connect(&Dial {
        hub: format!("https://{addr}"),
        ca_pem: ca.into_bytes(),
        server_name: Some("localhost".into()),
        token,
        keepalive: Duration::from_secs(20),
        keepalive_timeout: Duration::from_secs(20),
    })
    .await
    .unwrap();
    let hello = pb::Hello {
        cluster,
        ..Default::default()
    };
    let (tx, mut inbound) = client::open_session(&mut hub, hello, 4).await.unwrap();
    let mut applies = 0;
    while let Some(m) = inbound.message().await.unwrap() {
        match m.kind {
            Some(hub_message::Kind::Apply(_)) => applies += 1,
            Some(hub_message::Kind::SyncComplete(_)) => break,
            _ => {}
        }
    }
    drop(tx);
    applies
}

/// The floor: streams prebuilt messages, nothing else.
struct Bare {
    per_cluster: Arc<Vec<pb::HubMessage>>,
}

#[tonic::async_trait]
impl Federation for Bare {
    type SessionStream = ReceiverStream<Result<pb::HubMessage, Status>>;
    async fn session(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let mut inbound = request.into_inner();
        let _hello = inbound.message().await?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let messages = self.per_cluster.clone();
        tokio::spawn(async move {
            for m in messages.iter() {
                if tx.send(Ok(m.clone())).await.is_err() {
                    return;
                }
            }
            let _ = inbound.message().await;
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

async fn run_agents(
    addr: SocketAddr,
    tls: &flotilla_common::tls::SelfSigned,
    tokens: &BTreeMap<String, String>,
) -> (usize, Duration) {
    let start = Instant::now();
    let agents: Vec<_> = tokens
        .iter()
        .map(|(c, t)| tokio::spawn(agent(addr, tls.ca_pem.clone(), c.clone(), t.clone())))
        .collect();
    let mut total = 0;
    for a in agents {
        total += a.await.unwrap();
    }
    (total, start.elapsed())
}

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (clusters, apps) = (
        args.first().copied().unwrap_or(100),
        args.get(1).copied().unwrap_or(1000),
    );
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async move {
        let tls = tls();
        let names: Vec<String> = (0..clusters).map(|i| format!("cluster{i:04}")).collect();
        let members: Members = names.iter().map(|n| (n.clone(), Default::default())).collect();
        let (store, mut writer) = reflector::store::<MemberCluster>();
        let mut tokens = BTreeMap::new();
        for name in &names {
            let token = format!("{name}.bench-secret");
            let mc: MemberCluster = serde_json::from_value(json!({
                "apiVersion": "core.kubefed.io/v1beta1", "kind": "MemberCluster",
                "metadata": {"name": name}, "spec": {"tokenSha256": token_sha256(&token)}})).unwrap();
            writer.apply_watcher_event(&watcher::Event::Apply(mc));
            tokens.insert(name.clone(), token);
        }

        let rss_before = rss_mib();
        let dispatcher = Arc::new(Dispatcher::default());
        let start = Instant::now();
        for a in 0..apps {
            let app: FederatedMyApp = serde_json::from_value(json!({
                "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
                "metadata": {"name": format!("app{a:05}"), "namespace": "default"},
                "spec": {"placement": {"clusterSelector": {}},
                         "template": {"spec": {"replicas": 2, "image": "nginx:1.27", "config": {"a.conf": format!("id={a}")}}},
                         "overrides": [{"clusterName": names[a % clusters], "clusterOverrides": [{"path": "/spec/replicas", "value": 3}]}]}})).unwrap();
            let rendered = flotilla_hub::render::render(&app, &members).unwrap();
            let plan = rendered.clusters.into_iter().map(|(c, r)| (c, Desired::Apply(Arc::new(r.unwrap())))).collect();
            dispatcher.set_app(&AppKey::new("default", format!("app{a:05}")), None, plan);
        }
        let render_time = start.elapsed();
        let pairs = clusters * apps;
        let rss_index = rss_mib() - rss_before;

        dispatcher.planned_for(names.iter().cloned().collect());
        // Held for the whole run: the server closes its sessions when leadership ends.
        let (_leading, leading) = tokio::sync::watch::channel(true);
        let service = FederationService {
            dispatcher: dispatcher.clone(),
            status: Arc::new(StatusBoard::default()),
            membership: Arc::new(Membership::new(Duration::from_secs(60))),
            members: store,
            leading,
            // No host here: its only Event (a held-back collection) never happens.
            recorder: kube::runtime::events::Recorder::new(
                kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap()))
                    .unwrap(),
                "flotilla-hub-bench".into(),
            ),
        };
        let hub_addr = serve(service, &tls).await;
        let (delivered, hub_time) = run_agents(hub_addr, &tls, &tokens).await;
        assert_eq!(delivered, pairs, "every pair is delivered exactly once");

        // The floor carries the same bytes: one app's rendered JSON per message.
        let sample = flotilla_hub::render::render(
            &serde_json::from_value(json!({"apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
                "metadata": {"name": "app00000", "namespace": "default"},
                "spec": {"placement": {"clusters": [{"name": names[0]}]},
                         "template": {"spec": {"replicas": 2, "image": "nginx:1.27", "config": {"a.conf": "id=0"}}}}})).unwrap(),
            &members,
        )
        .unwrap();
        let one = sample.clusters.into_values().next().unwrap().unwrap();
        let mut per_cluster: Vec<pb::HubMessage> = (0..apps)
            .map(|a| pb::HubMessage { kind: Some(hub_message::Kind::Apply(pb::Apply {
                key: Some(pb::ObjectKey { namespace: "default".into(), name: format!("app{a:05}") }),
                hash: one.hash.clone(), manifest: one.json.clone() })) })
            .collect();
        per_cluster.push(pb::HubMessage { kind: Some(hub_message::Kind::SyncComplete(pb::SyncComplete::default())) });
        let bare_addr = serve(Bare { per_cluster: Arc::new(per_cluster) }, &tls).await;
        let (floor_delivered, floor_time) = run_agents(bare_addr, &tls, &tokens).await;
        assert_eq!(floor_delivered, pairs);

        let rate = |d: Duration| pairs as f64 / d.as_secs_f64();
        println!("fan-out: {clusters} clusters x {apps} apps = {pairs} pairs, TLS gRPC on loopback, agents in-process");
        println!("render + index of all pairs: {:.2}s ({:.0} pairs/s); index memory ~{rss_index:.0} MiB", render_time.as_secs_f64(), rate(render_time));
        println!("floor (bare tonic stream): {:.2}s, {:.0} pushes/s", floor_time.as_secs_f64(), rate(floor_time));
        println!("hub (auth, index diff, queues): {:.2}s, {:.0} pushes/s", hub_time.as_secs_f64(), rate(hub_time));
        println!("ratio hub/floor: {:.2}x; process RSS {:.0} MiB", hub_time.as_secs_f64() / floor_time.as_secs_f64(), rss_mib());
    });
}
