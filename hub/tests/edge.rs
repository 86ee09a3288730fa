//! The hub's gRPC edge against hostile or broken peers: the real `FederationService`
//! served by `server::serve` over TLS on 127.0.0.1, dialled by the agent's own client.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use flotilla_crds::MemberCluster;
use flotilla_hub::auth;
use flotilla_hub::auth::MemberLookup;
use flotilla_hub::dispatch::Dispatcher;
use flotilla_hub::edge::{Admissions, EdgeLimits, Refusal, RefusalMetrics};
use flotilla_hub::membership::Membership;
use flotilla_hub::server::{self, FederationService, Host, Warning};
use flotilla_hub::status::StatusBoard;
use flotilla_proto::client::{self, Dial, DialError, HubClient, MAX_AGENT_MESSAGE};
use flotilla_proto::v1::{self as pb, agent_message, hub_message};
use kube::runtime::reflector::{self, Store, store::Writer};
use kube::runtime::watcher;
use parking_lot::Mutex;
use secrecy::{ExposeSecret, SecretString};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Code;

const CLUSTERS: [&str; 3] = ["c1", "c2", "c3"];

/// Long enough for a loaded machine to finish what should finish, short enough to wait
/// for what must not happen.
const PATIENCE: Duration = Duration::from_secs(10);
const A_WHILE: Duration = Duration::from_secs(1);

struct Hub {
    addr: SocketAddr,
    ca_pem: String,
    tokens: Vec<(String, SecretString)>,
    members: Writer<MemberCluster>,
    host: Arc<FakeHost>,
    dispatcher: Arc<Dispatcher>,
    refusals: RefusalMetrics,
    shutdown: CancellationToken,
}

/// The host as the service sees it: the MemberClusters in a real reflector store, and
/// the Warning Events it would publish, kept in order.
struct FakeHost {
    members: Store<MemberCluster>,
    warnings: Mutex<Vec<(String, Warning)>>,
}

impl MemberLookup for FakeHost {
    fn member(&self, name: &str) -> Option<Arc<MemberCluster>> {
        self.members.member(name)
    }
}

#[tonic::async_trait]
impl Host for FakeHost {
    async fn warn(&self, cluster: &str, warning: Warning) {
        self.warnings.lock().push((cluster.to_owned(), warning));
    }
}

impl FakeHost {
    /// The reasons of the Events on `cluster`'s MemberCluster so far.
    fn reasons(&self, cluster: &str) -> Vec<&'static str> {
        (self.warnings.lock().iter())
            .filter(|(c, _)| c == cluster)
            .map(|(_, w)| w.reason)
            .collect()
    }
}

fn member(name: &str, token: Option<&SecretString>) -> MemberCluster {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "core.kubefed.io/v1beta1", "kind": "MemberCluster",
        "metadata": {"name": name},
        "spec": {"tokenSha256": token.map(|t| auth::token_sha256(t.expose_secret()))}
    }))
    .unwrap()
}

impl Hub {
    /// A leading hub with CLUSTERS registered; planned for them when `planned`.
    async fn start(limits: EdgeLimits, planned: bool) -> Hub {
        let certs =
            flotilla_common::tls::self_signed("edge-ca", "hub", &["localhost".into()]).unwrap();
        let tls = flotilla_hub::serving::ServingCert::from_pem(
            certs.cert_pem.as_bytes(),
            certs.key_pem.expose_secret().as_bytes(),
        )
        .unwrap()
        .server_config();
        let (store, mut members) = reflector::store::<MemberCluster>();
        let tokens: Vec<(String, SecretString)> = CLUSTERS
            .iter()
            .map(|c| (c.to_string(), auth::issue(c)))
            .collect();
        members.apply_watcher_event(&watcher::Event::Init);
        for (c, t) in &tokens {
            members.apply_watcher_event(&watcher::Event::InitApply(member(c, Some(t))));
        }
        members.apply_watcher_event(&watcher::Event::InitDone);
        let host = Arc::new(FakeHost {
            members: store.clone(),
            warnings: Mutex::default(),
        });
        let dispatcher = Arc::new(Dispatcher::default());
        if planned {
            dispatcher.planned_for(CLUSTERS.iter().map(|c| c.to_string()).collect());
        }
        let refusals = RefusalMetrics::default();
        let (leading_tx, leading) = tokio::sync::watch::channel(true);
        let service = FederationService {
            dispatcher: dispatcher.clone(),
            status: Arc::new(StatusBoard::default()),
            membership: Arc::new(Membership::new(Duration::from_secs(60))),
            // Its renewal loop is not run: tokens are not renewed here.
            renewer: Arc::new(flotilla_hub::renew::Renewer::new(
                kube::Api::all(
                    kube::Client::try_from(kube::Config::new(
                        "http://127.0.0.1:1".parse().unwrap(),
                    ))
                    .unwrap(),
                ),
                store.clone(),
                dispatcher.clone(),
                Duration::from_secs(3600),
                Default::default(),
            )),
            host: host.clone(),
            leading,
            admissions: Arc::new(Admissions::default()),
            refusals: refusals.clone(),
        };
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let shutdown = CancellationToken::new();
        tokio::spawn({
            let shutdown = shutdown.clone();
            async move {
                let _leading = leading_tx;
                server::serve(addr, tls, limits, service, shutdown).await
            }
        });
        tokio::time::timeout(PATIENCE, async {
            while TcpStream::connect(addr).await.is_err() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the hub listens");
        Hub {
            addr,
            ca_pem: certs.ca_pem,
            tokens,
            members,
            host,
            dispatcher,
            refusals,
            shutdown,
        }
    }

    fn token(&self, cluster: &str) -> &SecretString {
        &self.tokens.iter().find(|(c, _)| c == cluster).unwrap().1
    }

    fn dial(&self, cluster: &str) -> Dial {
        Dial {
            hub: format!("https://{}", self.addr),
            ca_pem: self.ca_pem.clone().into_bytes(),
            server_name: Some("localhost".into()),
            token: self.token(cluster).clone(),
            keepalive: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(10),
        }
    }

    async fn connect(&self, cluster: &str) -> HubClient {
        tokio::time::timeout(PATIENCE, client::connect(&self.dial(cluster)))
            .await
            .expect("the TLS handshake finishes")
            .expect("the hub accepts the connection")
    }

    fn revoke(&mut self, cluster: &str) {
        self.members
            .apply_watcher_event(&watcher::Event::Apply(member(cluster, None)));
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

fn hello(cluster: &str) -> pb::Hello {
    pb::Hello {
        cluster: cluster.into(),
        agent_version: "0.0.0-test".into(),
        ..Default::default()
    }
}

type Session = (
    mpsc::Sender<pb::AgentMessage>,
    tonic::Streaming<pb::HubMessage>,
);

/// A session of `cluster` that the hub admitted: its first message is SyncComplete.
async fn session(client: &mut HubClient, cluster: &str) -> Session {
    let (tx, mut inbound) =
        tokio::time::timeout(PATIENCE, client::open_session(client, hello(cluster), 4))
            .await
            .expect("the hub answers")
            .expect("the hub admits the session");
    let first = tokio::time::timeout(PATIENCE, inbound.message())
        .await
        .expect("SyncComplete arrives")
        .expect("the stream is healthy")
        .expect("the stream is open");
    assert!(matches!(
        first.kind,
        Some(hub_message::Kind::SyncComplete(_))
    ));
    (tx, inbound)
}

/// How the hub ends `inbound`.
async fn ending(inbound: &mut tonic::Streaming<pb::HubMessage>) -> Code {
    tokio::time::timeout(PATIENCE, async {
        loop {
            match inbound.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => break Code::Ok,
                Err(status) => break status.code(),
            }
        }
    })
    .await
    .expect("the hub ends the session")
}

fn refused(result: Result<Session, DialError>) -> Code {
    match result {
        Err(DialError::Refused(status)) => status.code(),
        Err(e) => panic!("not refused by the hub: {e}"),
        Ok(_) => panic!("admitted"),
    }
}

#[tokio::test]
async fn a_peer_that_never_handshakes_is_dropped_and_frees_its_connection() {
    let hub = Hub::start(
        EdgeLimits {
            tls_handshake_timeout: Duration::from_millis(300),
            max_agent_connections: 1,
            ..Default::default()
        },
        true,
    )
    .await;
    let mut silent = TcpStream::connect(hub.addr).await.unwrap();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(PATIENCE, silent.read(&mut buf))
        .await
        .expect("the hub closes a connection that sends no ClientHello");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    assert_eq!(hub.refusals.get(Refusal::TlsHandshakeTimeout), 1);
    // Not TLS at all: refused at once, counted (besides `Hub::start`'s probe, which
    // connected and left).
    let failed = || hub.refusals.get(Refusal::TlsHandshakeFailed);
    let before = failed();
    let mut plain = TcpStream::connect(hub.addr).await.unwrap();
    plain.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let read = tokio::time::timeout(PATIENCE, plain.read(&mut buf)).await;
    assert!(
        read.is_ok(),
        "the hub keeps a connection that spoke plain HTTP"
    );
    drop(plain);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while failed() == before && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(failed(), before + 1);
    // The only connection slot is free again: an agent gets in.
    let mut client = hub.connect("c1").await;
    session(&mut client, "c1").await;
}

#[tokio::test]
async fn connections_beyond_the_bound_wait_until_one_ends() {
    let hub = Hub::start(
        EdgeLimits {
            max_agent_connections: 1,
            ..Default::default()
        },
        true,
    )
    .await;
    let mut first = hub.connect("c1").await;
    let held = session(&mut first, "c1").await;
    let second = tokio::time::timeout(A_WHILE, client::connect(&hub.dial("c2"))).await;
    assert!(second.is_err(), "a connection past the bound was served");
    drop((held, first));
    let mut second = hub.connect("c2").await;
    session(&mut second, "c2").await;
}

#[tokio::test]
async fn streams_beyond_the_bound_wait_on_their_connection() {
    let hub = Hub::start(
        EdgeLimits {
            max_streams_per_connection: 1,
            ..Default::default()
        },
        true,
    )
    .await;
    let mut client = hub.connect("c1").await;
    let _held = session(&mut client, "c1").await;
    // Past the bound the stream never reaches the hub (which would refuse it within
    // milliseconds, c1 having a session): the client holds it until a stream ends.
    let mut again = client.clone();
    let second =
        tokio::time::timeout(A_WHILE, client::open_session(&mut again, hello("c1"), 4)).await;
    assert!(second.is_err(), "a stream past the bound was served");
    assert_eq!(hub.refusals.get(Refusal::SecondSession), 0);
}

#[tokio::test]
async fn a_second_session_of_a_cluster_being_admitted_is_refused_before_its_hello() {
    // Not planned: the first session is admitted and waits for the plan.
    let hub = Hub::start(EdgeLimits::default(), false).await;
    let mut client = hub.connect("c1").await;
    let first = tokio::spawn(async move {
        client::open_session(&mut client, hello("c1"), 4)
            .await
            .map(drop)
    });
    tokio::time::sleep(A_WHILE).await;
    // A second agent that has not sent Hello yet: refused without waiting for it.
    let mut other = hub.connect("c1").await;
    let (_tx, rx) = mpsc::channel::<pb::AgentMessage>(1);
    let status = tokio::time::timeout(A_WHILE, other.session(ReceiverStream::new(rx)))
        .await
        .expect("refused before any Hello is read")
        .expect_err("a second session is refused");
    assert_eq!(status.code(), Code::AlreadyExists, "{status:?}");
    assert_eq!(hub.refusals.get(Refusal::SecondSession), 1);
    // The first was the one admitted.
    hub.dispatcher.planned_for(
        CLUSTERS
            .iter()
            .map(|c| c.to_string())
            .collect::<BTreeSet<_>>(),
    );
    tokio::time::timeout(PATIENCE, first)
        .await
        .expect("the hub answers")
        .unwrap()
        .expect("the first session is admitted");
}

/// Once the first is live, the next is refused after its Hello: the identity checks
/// (cluster name, pinned UID) still name what is wrong with it.
#[tokio::test]
async fn a_second_session_of_a_live_cluster_is_refused_after_its_hello() {
    let hub = Hub::start(EdgeLimits::default(), true).await;
    let mut client = hub.connect("c1").await;
    let _held = session(&mut client, "c1").await;
    let mut other = hub.connect("c1").await;
    let result = client::open_session(&mut other, hello("c2"), 4).await;
    assert_eq!(refused(result), Code::PermissionDenied);
    let result = client::open_session(&mut other, hello("c1"), 4).await;
    assert_eq!(refused(result), Code::AlreadyExists);
    assert_eq!(hub.refusals.get(Refusal::SecondSession), 1);
}

#[tokio::test]
async fn an_oversized_message_ends_only_that_session() {
    let hub = Hub::start(EdgeLimits::default(), true).await;
    let mut c1 = hub.connect("c1").await;
    let (tx1, mut inbound1) = session(&mut c1, "c1").await;
    let mut c2 = hub.connect("c2").await;
    let (tx2, mut inbound2) = session(&mut c2, "c2").await;

    // A report just over the limit (the largest Hello an agent may need fits under it).
    let huge = pb::AgentMessage {
        kind: Some(agent_message::Kind::Status(pb::StatusReport {
            apply_error: "x".repeat(MAX_AGENT_MESSAGE),
            ..Default::default()
        })),
    };
    tx1.send(huge).await.unwrap();
    assert_eq!(ending(&mut inbound1).await, Code::ResourceExhausted);
    assert_eq!(hub.refusals.get(Refusal::MessageTooLarge), 1);

    // c2's session lives on, and c1 may come back.
    tx2.send(pb::AgentMessage {
        kind: Some(agent_message::Kind::Heartbeat(pb::Heartbeat {})),
    })
    .await
    .unwrap();
    assert!(
        tokio::time::timeout(A_WHILE, inbound2.message())
            .await
            .is_err(),
        "c2's session ended"
    );
    let mut c1 = hub.connect("c1").await;
    session(&mut c1, "c1").await;

    // A Hello over the limit is refused the same way.
    let mut c3 = hub.connect("c3").await;
    let mut big = hello("c3");
    big.agent_version = "v".repeat(MAX_AGENT_MESSAGE);
    let result = client::open_session(&mut c3, big, 4).await;
    assert_eq!(refused(result), Code::ResourceExhausted);
    assert_eq!(hub.refusals.get(Refusal::MessageTooLarge), 2);
}

#[tokio::test]
async fn a_credential_revoked_while_its_session_waits_is_refused() {
    // Not planned yet: an admitted session waits for the plan (up to 10 s).
    let mut hub = Hub::start(EdgeLimits::default(), false).await;
    let mut client = hub.connect("c1").await;
    let opening = tokio::spawn(async move {
        client::open_session(&mut client, hello("c1"), 4)
            .await
            .map(|_| ())
    });
    // Authenticated by now (this test passes, wrongly, only if it were not yet).
    tokio::time::sleep(A_WHILE).await;
    hub.revoke("c1");
    hub.dispatcher.planned_for(
        CLUSTERS
            .iter()
            .map(|c| c.to_string())
            .collect::<BTreeSet<_>>(),
    );
    let result = tokio::time::timeout(PATIENCE, opening)
        .await
        .expect("the hub answers")
        .unwrap();
    match result {
        Err(DialError::Refused(status)) => {
            assert_eq!(status.code(), Code::Unauthenticated, "{status:?}")
        }
        other => panic!("a revoked credential was admitted: {other:?}"),
    }
    assert!(hub.dispatcher.sessions().is_empty());
    assert_eq!(hub.refusals.get(Refusal::RevokedWhileAdmitted), 1);
}

#[tokio::test]
async fn cut_and_refused_input_is_counted() {
    let hub = Hub::start(EdgeLimits::default(), true).await;
    let mut c1 = hub.connect("c1").await;
    let (tx, _inbound) = session(&mut c1, "c1").await;
    tx.send(pb::AgentMessage {
        kind: Some(agent_message::Kind::Status(pb::StatusReport {
            key: Some(pb::ObjectKey {
                namespace: "default".into(),
                name: "web".into(),
            }),
            apply_error: "é".repeat(4096),
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    tokio::time::timeout(PATIENCE, async {
        while hub.refusals.get(Refusal::LongString) == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the cut report is counted");

    // A Hello naming a cluster UID longer than any real one: refused, not cut.
    let mut c2 = hub.connect("c2").await;
    let mut odd = hello("c2");
    odd.cluster_uid = "u".repeat(4096);
    let result = client::open_session(&mut c2, odd, 4).await;
    assert_eq!(refused(result), Code::InvalidArgument);
    assert_eq!(hub.refusals.get(Refusal::LongString), 2);
    // So is a stated cluster ID (the About API's ClusterProperty) past that length.
    let mut c2 = hub.connect("c2").await;
    let mut odd = hello("c2");
    odd.cluster_id = "i".repeat(129);
    let result = client::open_session(&mut c2, odd, 4).await;
    assert_eq!(refused(result), Code::InvalidArgument);
    assert_eq!(hub.refusals.get(Refusal::LongString), 3);
}

/// The hub says on the MemberCluster why an agent cannot connect (its token expired),
/// and, once a minute at most, that its agent holds back a collection: the operator sees
/// both in `kubectl describe membercluster`.
#[tokio::test]
async fn an_expired_token_and_a_held_back_collection_are_told_on_the_membercluster() {
    let mut hub = Hub::start(EdgeLimits::default(), true).await;
    let expired = {
        let mut m = member("c1", Some(hub.token("c1")));
        let past =
            k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(1);
        m.spec.token_expires_at = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(past));
        m
    };
    hub.members
        .apply_watcher_event(&watcher::Event::Apply(expired));
    let mut c1 = hub.connect("c1").await;
    let result = client::open_session(&mut c1, hello("c1"), 4).await;
    assert_eq!(refused(result), Code::Unauthenticated);
    assert_eq!(hub.host.reasons("c1"), ["TokenExpired"]);
    assert_eq!(hub.refusals.get(Refusal::TokenExpired), 1);
    let note = hub.host.warnings.lock()[0].1.note.clone();
    assert!(note.contains("c1") && note.contains("expired"), "{note}");

    let mut c2 = hub.connect("c2").await;
    let (tx, _inbound) = session(&mut c2, "c2").await;
    for would_collect in [3, 4] {
        tx.send(pb::AgentMessage {
            kind: Some(agent_message::Kind::CollectionBlocked(
                pb::CollectionBlocked {
                    would_collect,
                    managed: 5,
                },
            )),
        })
        .await
        .unwrap();
    }
    tokio::time::timeout(PATIENCE, async {
        while hub.host.reasons("c2").is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the held-back collection is told");
    tokio::time::sleep(A_WHILE).await;
    assert_eq!(
        hub.host.reasons("c2"),
        ["CollectionBlocked"],
        "once a minute at most"
    );
    let note = hub.host.warnings.lock()[1].1.note.clone();
    assert!(
        note.contains("deleting 3 of its 5") && note.contains("kubectl annotate membercluster c2"),
        "{note}"
    );
}
