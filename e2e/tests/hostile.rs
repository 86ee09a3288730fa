//! A hostile agent is contained (issue 20 item 2): a client holding the valid token of a
//! joined member (`hostile-e2e`, joined for the test: the lab's real agents keep running,
//! so the other clusters are real members throughout) tries each attack of the security
//! review over the real hub's TLS port. Each attempt is refused or clamped (a gRPC status,
//! or `flotilla_hub_agent_refused_total{reason}` and the hub's log line); the hub's RSS stays
//! bounded; the real members' MyApps and replica counts are unchanged; no MyApp is
//! deleted; everything converges at the end. A second test (the hub restarted with a
//! short `--claim-wait`) shows that a Hello claiming an app never placed on the cluster
//! delays its deletion only for that wait, and that reports on claimed keys are not kept.
//! Needs a running environment (`cargo run -p flotilla-e2e -- up`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use flotilla_crds::AppKey;
use flotilla_crds::federated::SchedulingReason;
use flotilla_crds::{FederatedMyApp, MemberCluster, MyApp};
use flotilla_e2e::converge;
use flotilla_e2e::deletions::DeletionLog;
use flotilla_lab::federation::{Federation, HUB, OpenSession};
use flotilla_lab::hubcli::HubCli;
use flotilla_lab::support::sample;
use flotilla_lab::{Env, wait_for};
use flotilla_proto::WireKey;
use flotilla_proto::client::{self, Dial, DialError, MAX_MESSAGE};
use flotilla_proto::v1::{self as pb, agent_message, hub_message};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

const HOSTILE: &str = "hostile-e2e";
/// Placed on both real members and on the hostile cluster, replicas divided by weight.
const SHARED: &str = "hostile-shared";
/// Placed on the real members only.
const BYSTANDER: &str = "hostile-bystander";
/// Each cluster's share of [`SHARED`] (the real members and the hostile one).
const SHARE: i32 = 2;
/// The cluster that claims an app it was never given (its own name: the tests run apart).
const CLAIMER: &str = "hostile-claimer-e2e";
/// Placed on the real members only, and claimed by [`CLAIMER`].
const CLAIMED: &str = "hostile-claimed";
/// The hub's `--claim-wait` in the claim test.
const CLAIM_WAIT: Duration = Duration::from_secs(8);
/// Keys the claimer's Hello claims besides [`CLAIMED`], each reported on.
const GHOSTS: usize = 20_000;
/// What reading their reports may add to the hub's RSS: kept, they would hold at least
/// 2 KiB each after the cut (about 40 MiB).
const GHOST_RSS_MAX: u64 = 24 << 20;
/// Both tests hold a hostile session; the claim test restarts the hub.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
/// The hub's cap on a reported node count (`convert::NODES_MAX`): `i32::MAX` reads as it.
const NODES_MAX: i32 = 1_000_000;
const TIMEOUT: Duration = Duration::from_secs(60);
/// What the attacks may add to the hub's RSS: decoding is bounded by the 4 MiB agent
/// message limit and one admission per cluster, so a leak or an unbounded buffer shows as
/// hundreds of MiB.
const RSS_GROWTH_MAX: u64 = 128 << 20;

fn refused(reason: &str) -> String {
    format!("flotilla_hub_agent_refused_total{{reason=\"{reason}\"}}")
}

async fn hub_metric(f: &Federation, series: &str) -> Result<f64> {
    Ok(sample(&f.metrics(HUB).await?, series))
}

fn report(key: &AppKey, f: impl FnOnce(&mut pb::StatusReport)) -> pb::AgentMessage {
    let mut r = pb::StatusReport {
        key: Some(key.to_wire()),
        ..Default::default()
    };
    f(&mut r);
    pb::AgentMessage {
        kind: Some(agent_message::Kind::Status(r)),
    }
}

fn message(kind: agent_message::Kind) -> pb::AgentMessage {
    pb::AgentMessage { kind: Some(kind) }
}

/// The hostile agent's session: it answers every Apply with a report forging readiness
/// (`ready_replicas = i32::MAX`), every Delete with "gone" (unless it stalls deletions),
/// and heartbeats, so that the hub keeps it Ready and placed.
struct Hostile {
    tx: mpsc::Sender<pb::AgentMessage>,
    tasks: Vec<JoinHandle<()>>,
    /// Keys the hub sent an Apply for, with the hash.
    applied: tokio::sync::watch::Receiver<BTreeMap<AppKey, String>>,
    /// Keys the hub sent a Delete for.
    deletes: tokio::sync::watch::Receiver<BTreeSet<AppKey>>,
}

impl Hostile {
    async fn open(
        f: &Federation,
        (cluster, token): (&str, &str),
        managed: &[AppKey],
        confirms_deletes: bool,
    ) -> Result<Hostile> {
        let hello = pb::Hello {
            cluster: cluster.into(),
            agent_version: "hostile".into(),
            managed: managed
                .iter()
                .map(|k| pb::Managed {
                    key: Some(k.to_wire()),
                    hash: "claimed".into(),
                })
                .collect(),
            ..Default::default()
        };
        let (tx, mut inbound): OpenSession = f
            .open_session_with(token, hello, 256)
            .await
            .map_err(|e| anyhow::anyhow!("the hostile session: {e}"))?;
        let (seen, applied) = tokio::sync::watch::channel(BTreeMap::new());
        let (deleted, deletes) = tokio::sync::watch::channel(BTreeSet::new());
        let answers = tx.clone();
        let reader = tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                let reply = match m.kind {
                    Some(hub_message::Kind::Apply(a)) => {
                        let Some(key) = AppKey::from_wire(a.key) else {
                            continue;
                        };
                        seen.send_modify(|s| {
                            s.insert(key.clone(), a.hash.clone());
                        });
                        report(&key, |r| {
                            r.hash = a.hash;
                            r.exists = true;
                            r.ready = true;
                            r.ready_replicas = i32::MAX;
                            r.replicas = Some(i32::MAX);
                            r.observed_generation = i64::MAX;
                            r.generation = i64::MAX;
                        })
                    }
                    Some(hub_message::Kind::Delete(d)) => {
                        let Some(key) = AppKey::from_wire(d.key) else {
                            continue;
                        };
                        seen.send_modify(|s| {
                            s.remove(&key);
                        });
                        deleted.send_modify(|d| {
                            d.insert(key.clone());
                        });
                        if !confirms_deletes {
                            continue;
                        }
                        report(&key, |r| r.exists = false)
                    }
                    _ => continue,
                };
                if answers.send(reply).await.is_err() {
                    return;
                }
            }
        });
        let beats = tx.clone();
        let heartbeat = tokio::spawn(async move {
            loop {
                let beat = message(agent_message::Kind::Heartbeat(pb::Heartbeat {}));
                if beats.send(beat).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        });
        Ok(Hostile {
            tx,
            tasks: vec![reader, heartbeat],
            applied,
            deletes,
        })
    }

    async fn send(&self, m: pb::AgentMessage) -> Result<()> {
        self.tx
            .send(m)
            .await
            .context("the hub ended the hostile session")
    }

    fn close(self) {
        for t in self.tasks {
            t.abort();
        }
    }
}

/// Each real member's MyApps of this test: name → (uid, generation, spec.replicas).
async fn fingerprint(
    env: &Env,
) -> Result<BTreeMap<String, BTreeMap<String, (String, i64, Option<i32>)>>> {
    let mut out = BTreeMap::new();
    for m in env.members() {
        let apps = Api::<MyApp>::namespaced(env.client(m).await?, "default")
            .list(&Default::default())
            .await?;
        let ours = apps
            .items
            .into_iter()
            .filter(|a| a.name_any().starts_with("hostile-"))
            .map(|a| {
                let v = (
                    a.uid().unwrap_or_default(),
                    a.metadata.generation.unwrap_or_default(),
                    a.spec.replicas,
                );
                (a.name_any(), v)
            })
            .collect();
        out.insert(m.to_string(), ours);
    }
    Ok(out)
}

async fn apply_app(host: &Client, name: &str, spec: serde_json::Value) -> Result<()> {
    Api::<FederatedMyApp>::namespaced(host.clone(), "default")
        .patch(
            name,
            &PatchParams::apply("e2e-hostile").force(),
            &Patch::Apply(json!({
                "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
                "metadata": {"name": name, "namespace": "default"},
                "spec": spec})),
        )
        .await
        .with_context(|| format!("applying FederatedMyApp default/{name}"))?;
    Ok(())
}

/// CollectionBlocked Events on the hostile cluster's MemberCluster, repeats included.
async fn blocked_events(host: &Client) -> Result<i32> {
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::all(host.clone());
    let selector = format!("involvedObject.name={HOSTILE},reason=CollectionBlocked");
    let list = events
        .list(&kube::api::ListParams::default().fields(&selector))
        .await?;
    Ok(list.items.iter().map(|e| e.count.unwrap_or(1)).sum())
}

/// A session attempt with `hello` and the hub's answer: `Err(status)` when refused at
/// once or on its stream.
async fn attempt(f: &Federation, token: &str, hello: pb::Hello) -> Result<tonic::Status> {
    match f.open_session_with(token, hello, 1).await {
        Err(DialError::Refused(status)) => Ok(status),
        Err(e) => Err(e.into()),
        Ok((_tx, mut inbound)) => {
            match tokio::time::timeout(Duration::from_secs(30), inbound.message()).await {
                Ok(Err(status)) => Ok(status),
                Ok(Ok(m)) => bail!("a session the hub should refuse was served: {m:?}"),
                Err(_) => bail!("a session the hub should refuse got no answer in 30s"),
            }
        }
    }
}

/// What each test starts from, one test at a time: the lab, its federation, a host
/// client, the hub's CLI, and a cluster of the test's own joined, with its token.
struct Joined {
    _one: tokio::sync::MutexGuard<'static, ()>,
    env: Env,
    f: Federation,
    host: Client,
    cli: HubCli,
    token: String,
}

impl Joined {
    async fn start(cluster: &str) -> Result<Joined> {
        let one = ONE_AT_A_TIME.lock().await;
        let env = Env::load_ready().await?;
        let f = Federation::load(&env)?;
        let host = env.client(env.host()).await?;
        let cli = f.hub_cli(&env)?;
        let token_file = env.dir.join("federation").join(format!("{cluster}.token"));
        cli.join(cluster, &[], &token_file)?;
        let token = std::fs::read_to_string(&token_file)?.trim().to_owned();
        Ok(Joined {
            _one: one,
            env,
            f,
            host,
            cli,
            token,
        })
    }

    /// The lab's member clusters, by name.
    fn members(&self) -> Vec<String> {
        self.env.members().iter().map(|m| m.to_string()).collect()
    }
}

#[tokio::test]
async fn a_hostile_agent_is_contained() -> Result<()> {
    let t = Joined::start(HOSTILE).await?;
    let (env, f, host, cli, token) = (&t.env, &t.f, &t.host, &t.cli, &t.token);
    let members = t.members();
    ensure!(members.len() >= 2, "needs two members, has {members:?}");

    let outcome = attacks(env, f, host, token, &members).await;

    let fedapps: Api<FederatedMyApp> = Api::namespaced(host.clone(), "default");
    for app in [SHARED, BYSTANDER] {
        let _ = fedapps.delete(app, &DeleteParams::default()).await;
    }
    let removed = cli.run(&["unjoin", HOSTILE]).map(drop);
    outcome?;
    removed?;
    wait_for(TIMEOUT, "the test's FederatedMyApps gone", || async {
        let left = fedapps.list(&Default::default()).await?.items;
        Ok((!left.iter().any(|a| a.name_any().starts_with("hostile-"))).then_some(()))
    })
    .await?;
    converge::wait_converged(env, TIMEOUT).await?;
    Ok(())
}

async fn attacks(
    env: &Env,
    f: &Federation,
    host: &Client,
    token: &str,
    members: &[String],
) -> Result<()> {
    let total = SHARE * (members.len() as i32 + 1);
    let mut placed: Vec<serde_json::Value> = members.iter().map(|m| json!({"name": m})).collect();
    apply_app(
        host,
        BYSTANDER,
        json!({"placement": {"clusters": placed.clone()},
               "template": {"spec": {"replicas": 2, "image": "nginx:1.27"}}}),
    )
    .await?;
    placed.push(json!({"name": HOSTILE}));
    apply_app(
        host,
        SHARED,
        json!({"placement": {"clusters": placed,
                             "replicaScheduling": {"mode": "Weighted", "totalReplicas": total}},
               "template": {"spec": {"replicas": 1, "image": "nginx:1.27"}}}),
    )
    .await?;
    let hostile = Hostile::open(f, (HOSTILE, token), &[], true).await?;
    let shared = AppKey::new("default", SHARED);
    let bystander = AppKey::new("default", BYSTANDER);
    let mut applied = hostile.applied.clone();
    tokio::time::timeout(TIMEOUT, applied.wait_for(|a| a.contains_key(&shared)))
        .await
        .context("the hostile cluster never got its share of the shared app")??;
    converge::wait_converged(env, TIMEOUT).await?;
    // The division settled: 2 each once the hostile share counts (until then the first
    // member keeps a surplus replica, make-before-break).
    let before = wait_for(TIMEOUT, "the shared app divided 2 each", || async {
        let now = fingerprint(env).await?;
        let settled = now
            .values()
            .all(|apps| apps.get(SHARED).is_some_and(|(_, _, r)| *r == Some(SHARE)));
        Ok(settled.then_some(now))
    })
    .await?;
    for m in members {
        let apps = &before[m];
        ensure!(
            apps.contains_key(SHARED) && apps.contains_key(BYSTANDER),
            "{m} runs {apps:?}, not both test apps"
        );
    }
    println!("the real members before the attacks: {before:?}");
    let log = DeletionLog::start(env).await?;
    let hub = f.process(env, HUB)?;
    let rss_before = hub.rss_bytes().context("the hub's RSS")?;
    let counted = |reason: &'static str| async move { hub_metric(f, &refused(reason)).await };
    let (long_before, range_before, large_before, second_before) = (
        counted("long_string").await?,
        counted("number_out_of_range").await?,
        counted("message_too_large").await?,
        counted("second_session").await?,
    );

    // 1. Many streams at once, each with a Hello of 3 MiB (under the limit, so each must be
    //    refused for being a second session, not for its size): one cluster, one session.
    let big_hello = || pb::Hello {
        cluster: HOSTILE.into(),
        agent_version: "hostile".into(),
        kubernetes_version: "k".repeat(3 << 20),
        ..Default::default()
    };
    let many = (0..64).map(|_| attempt(f, token, big_hello()));
    let answers = futures::future::join_all(many).await;
    let mut codes = BTreeMap::<String, usize>::new();
    for a in answers {
        *codes.entry(format!("{:?}", a?.code())).or_default() += 1;
    }
    println!("64 concurrent sessions with 3 MiB Hellos: {codes:?}");
    ensure!(
        codes.keys().all(|c| c == "AlreadyExists"),
        "a second session of a cluster with a live one must be refused ALREADY_EXISTS: {codes:?}"
    );

    // Many streams on one connection: those past the connection's stream limit are
    // refused by HTTP/2 (REFUSED_STREAM, UNAVAILABLE to the client), the rest as second
    // sessions.
    let one = client::connect(&Dial {
        hub: f.hub_grpc.clone(),
        ca_pem: std::fs::read(&f.hub_ca)?,
        server_name: Some("localhost".into()),
        token: token.into(),
        keepalive: Duration::from_secs(10),
        keepalive_timeout: Duration::from_secs(10),
    })
    .await?;
    let streams = (0..32).map(|_| {
        let mut c = one.clone();
        async move { client::open_session(&mut c, big_hello(), 1).await.err() }
    });
    let refused_streams = futures::future::join_all(streams).await;
    let mut stream_codes = BTreeMap::<String, usize>::new();
    for r in refused_streams {
        let code = match r {
            Some(DialError::Refused(s)) => {
                if s.code() == tonic::Code::Unavailable {
                    println!("a stream past the limit: {}", s.message());
                }
                format!("{:?}", s.code())
            }
            Some(e) => format!("dial error: {e}"),
            None => "served".into(),
        };
        *stream_codes.entry(code).or_default() += 1;
    }
    println!("32 concurrent streams on one connection: {stream_codes:?}");
    ensure!(
        stream_codes
            .keys()
            .all(|c| c == "AlreadyExists" || c == "Unavailable"),
        "streams on one connection: {stream_codes:?}"
    );

    // 2. A 16 MiB Hello: over the agent message limit, refused before it is buffered (or,
    //    the live session seen first, refused as a second session).
    let mut huge = big_hello();
    huge.kubernetes_version = "k".repeat(MAX_MESSAGE - 1024);
    let status = attempt(f, token, huge).await?;
    println!("a 16 MiB Hello: {:?} {}", status.code(), status.message());
    ensure!(
        matches!(
            status.code(),
            tonic::Code::ResourceExhausted | tonic::Code::AlreadyExists
        ),
        "a 16 MiB Hello: {status:?}"
    );

    // 3. Reports for keys not placed on it: the bystander, and an app in another namespace.
    let foreign = AppKey::new("kube-system", "not-placed-here");
    for key in [&bystander, &foreign] {
        hostile
            .send(report(key, |r| {
                r.exists = true;
                r.ready = true;
                r.ready_replicas = i32::MAX;
                r.apply_error = "forged".into();
            }))
            .await?;
    }

    // 4. Huge strings in every string field: each cut to its maximum.
    let mb = |c: char| c.to_string().repeat(1 << 20);
    let hash = hostile
        .applied
        .borrow()
        .get(&shared)
        .cloned()
        .unwrap_or_default();
    let long_fields: Vec<pb::AgentMessage> = vec![
        report(&shared, |r| {
            r.hash = mb('h');
            r.exists = true;
        }),
        report(&shared, |r| {
            r.hash = hash.clone();
            r.exists = true;
            r.apply_error = mb('e');
            r.autoscaler = mb('a');
            r.drift = mb('d');
        }),
        report(&shared, |r| {
            r.hash = hash.clone();
            r.exists = true;
            r.conditions = vec![pb::Condition {
                r#type: "Degraded".into(),
                status: "True".into(),
                reason: mb('r'),
                message: mb('m'),
            }];
        }),
        message(agent_message::Kind::TokenRenewed(pb::TokenRenewed {
            token_sha256: mb('t'),
            error: mb('x'),
        })),
    ];
    for m in long_fields {
        hostile.send(m).await?;
    }

    // 5. Forged capacity: negative, requested over allocatable, i64::MAX; and overflowing
    //    numbers in the other messages.
    let res = |cpu: i64, mem: i64| {
        Some(pb::Resources {
            cpu_millis: cpu,
            memory_bytes: mem,
        })
    };
    for capacity in [
        pb::Capacity {
            nodes: -1,
            allocatable: res(-5, i64::MIN),
            requested: res(i64::MIN, -1),
            largest_free: res(-1, -1),
        },
        pb::Capacity {
            nodes: 3,
            allocatable: res(1_000, 1 << 30),
            requested: res(i64::MAX, i64::MAX),
            largest_free: res(i64::MAX, 1 << 30),
        },
        pb::Capacity {
            nodes: i32::MAX,
            allocatable: res(i64::MAX, i64::MAX),
            requested: res(0, 0),
            largest_free: res(i64::MAX, i64::MAX),
        },
    ] {
        hostile
            .send(message(agent_message::Kind::Capacity(capacity)))
            .await?;
    }
    hostile
        .send(message(agent_message::Kind::CollectionBlocked(
            pb::CollectionBlocked {
                would_collect: u32::MAX,
                managed: u32::MAX,
            },
        )))
        .await?;
    // The extremes on its own share, readiness forged last: i32::MAX ready.
    for (replicas, generation) in [(i32::MIN, i64::MIN), (i32::MAX, i64::MAX)] {
        hostile
            .send(report(&shared, |r| {
                r.hash = hash.clone();
                r.exists = true;
                r.ready = true;
                r.ready_replicas = replicas;
                r.replicas = Some(replicas);
                r.observed_generation = generation;
                r.generation = generation;
            }))
            .await?;
    }

    // What the hub made of it.
    wait_for(TIMEOUT, "the hub to count the clamped numbers", || async {
        Ok((counted("number_out_of_range").await? > range_before).then_some(()))
    })
    .await?;
    let counts = (
        counted("long_string").await? - long_before,
        counted("number_out_of_range").await? - range_before,
        counted("message_too_large").await? - large_before,
        counted("second_session").await? - second_before,
    );
    println!(
        "refused or clamped: long_string +{}, number_out_of_range +{}, message_too_large +{}, second_session +{}",
        counts.0, counts.1, counts.2, counts.3
    );
    ensure!(counts.0 >= 1.0, "no long string was counted as cut");
    ensure!(counts.3 >= 64.0, "not every second session was counted");
    let log_text = std::fs::read_to_string(hub.log.as_ref().context("the hub's log")?)?;
    for line in [
        "agent input refused or clamped",
        "status for a MyApp not placed on this cluster",
    ] {
        ensure!(
            log_text
                .lines()
                .any(|l| l.contains(line) && l.contains(HOSTILE)),
            "the hub's log has no line `{line}` naming {HOSTILE}"
        );
    }

    // The capacity the planner reads is within bounds: no figure negative, none past the
    // hub's maxima (wrap-around or a panic in this debug build would show here).
    let mc = wait_for(TIMEOUT, "the hostile capacity written", || async {
        let mc = Api::<MemberCluster>::all(host.clone()).get(HOSTILE).await?;
        let cap = mc.status.as_ref().and_then(|s| s.capacity.clone());
        Ok(cap.filter(|c| c.nodes == NODES_MAX).map(|_| mc))
    })
    .await?;
    let cap = mc.status.and_then(|s| s.capacity).context("capacity")?;
    println!("the hostile cluster's capacity as the hub keeps it: {cap:?}");
    for (what, v) in [
        ("allocatable.cpuMillis", cap.allocatable.cpu_millis),
        ("allocatable.memoryBytes", cap.allocatable.memory_bytes),
        ("requested.cpuMillis", cap.requested.cpu_millis),
        ("largestFree.cpuMillis", cap.largest_free.cpu_millis),
    ] {
        ensure!(
            (0..i64::MAX).contains(&v),
            "capacity {what} = {v}: not clamped"
        );
    }

    // The shared app's status: the hostile cluster's forged readiness never counts more
    // than its share, and no string from it is longer than the hub's cut.
    let fedapps: Api<FederatedMyApp> = Api::namespaced(host.clone(), "default");
    let status = wait_for(
        TIMEOUT,
        "the shared app's status with the hostile report",
        || async {
            let app = fedapps.get(SHARED).await?;
            let status = app.status.clone().unwrap_or_default();
            Ok(status
                .clusters
                .iter()
                .any(|c| c.name == HOSTILE && c.ready_replicas != 0)
                .then_some(status))
        },
    )
    .await?;
    let size = serde_json::to_vec(&status)?.len();
    println!(
        "shared app status: readyReplicas {} of replicas {:?}; {} bytes",
        status.ready_replicas, status.replicas, size
    );
    ensure!(size < 16 << 10, "the shared app's status is {size} bytes");
    ensure!(
        status.replicas == Some(total) && status.ready_replicas <= total,
        "readyReplicas {} counts forged readiness past the {:?} replicas assigned",
        status.ready_replicas,
        status.replicas
    );
    let bystander_status = fedapps.get(BYSTANDER).await?.status.unwrap_or_default();
    ensure!(
        !bystander_status.clusters.iter().any(|c| c.name == HOSTILE),
        "the bystander's status lists the hostile cluster: {:?}",
        bystander_status.clusters
    );

    // A flood of CollectionBlocked (review M2): the condition shows the latest figures,
    // and the cluster gets at most one Event a minute, not one host write per message.
    let events_before = blocked_events(host).await?;
    let writes = "flotilla_hub_status_writes_total{kind=\"membercluster\",result=\"written\"}";
    let writes_before = hub_metric(f, writes).await?;
    for i in 0..1000u32 {
        hostile
            .send(message(agent_message::Kind::CollectionBlocked(
                pb::CollectionBlocked {
                    would_collect: i,
                    managed: 1000,
                },
            )))
            .await?;
    }
    wait_for(
        TIMEOUT,
        "the last held-back figure on the MemberCluster",
        || async {
            let mc = Api::<MemberCluster>::all(host.clone()).get(HOSTILE).await?;
            let blocked = (mc.status.unwrap_or_default().conditions.into_iter())
                .find(|c| c.type_ == "CollectionBlocked")
                .filter(|c| c.message.contains("999 of its 1000"));
            Ok(blocked.map(drop))
        },
    )
    .await?;
    let events = blocked_events(host).await? - events_before;
    let member_writes = hub_metric(f, writes).await? - writes_before;
    println!(
        "1,000 CollectionBlocked: {events} Event(s) published, {member_writes} MemberCluster status write(s)"
    );
    ensure!(
        events <= 1,
        "1,000 CollectionBlocked published {events} Events"
    );

    // The hub lives, bounded, and the real members run exactly what they ran.
    let rss_after = hub.rss_bytes().context("the hub's RSS after")?;
    println!(
        "hub RSS {} MiB -> {} MiB",
        rss_before >> 20,
        rss_after >> 20
    );
    ensure!(
        rss_after < rss_before + RSS_GROWTH_MAX,
        "the hub's RSS grew from {} MiB to {} MiB",
        rss_before >> 20,
        rss_after >> 20
    );
    let after = fingerprint(env).await?;
    ensure!(
        after == before,
        "the real members' MyApps changed: before {before:?}, after {after:?}"
    );
    log.assert_clean(&BTreeSet::new())?;
    hostile.close();
    Ok(())
}

/// Review H2: a Hello claiming `default/hostile-claimed`, an app this hub never placed on
/// the claimer, stalled the app's deletion until an admin unjoined the cluster. Now the
/// claimer is sent the Delete and waited for `--claim-wait` (here 8 s), then the deletion
/// goes on without it, with a Warning Event and a log line naming it; the real members'
/// copies are deleted as they should be, and nothing else.
#[tokio::test]
async fn a_claim_delays_a_deletion_only_for_the_claim_wait() -> Result<()> {
    let t = Joined::start(CLAIMER).await?;
    let (env, f, host, cli, token) = (&t.env, &t.f, &t.host, &t.cli, &t.token);
    let members = t.members();
    let wait = format!("{}s", CLAIM_WAIT.as_secs());
    f.stop(env, HUB)?;
    f.start_variant(env, HUB, HUB, |l| l.set_arg("claim-wait", Some(&wait)))?;
    f.wait_ready(HUB).await?;

    let outcome = claim(env, f, host, token, &members).await;

    let fedapps: Api<FederatedMyApp> = Api::namespaced(host.clone(), "default");
    let _ = fedapps.delete(CLAIMED, &DeleteParams::default()).await;
    let removed = cli.run(&["unjoin", CLAIMER]).map(drop);
    // The hub as `up` started it.
    let restored = async {
        f.stop(env, HUB)?;
        f.start(env, HUB)?;
        f.wait_ready(HUB).await
    }
    .await;
    outcome?;
    removed?;
    restored?;
    converge::wait_converged(env, TIMEOUT).await?;
    Ok(())
}

async fn claim(
    env: &Env,
    f: &Federation,
    host: &Client,
    token: &str,
    members: &[String],
) -> Result<()> {
    let placed: Vec<serde_json::Value> = members.iter().map(|m| json!({"name": m})).collect();
    apply_app(
        host,
        CLAIMED,
        json!({"placement": {"clusters": placed},
               "template": {"spec": {"replicas": 1, "image": "nginx:1.27"}}}),
    )
    .await?;
    converge::wait_converged(env, TIMEOUT).await?;
    let claimed = AppKey::new("default", CLAIMED);
    // Besides the real app, 20,000 keys no host app has (review H1: each one's reports
    // used to stay on the status board for good).
    let ghosts: Vec<AppKey> = (0..GHOSTS)
        .map(|i| AppKey::new("hostile-ghosts", format!("ghost-{i}")))
        .collect();
    let mut claims = ghosts.clone();
    claims.push(claimed.clone());
    let hostile = Hostile::open(f, (CLAIMER, token), &claims, false).await?;
    let hub = f.process(env, HUB)?;
    let rss_before = hub.rss_bytes().context("the hub's RSS")?;
    let cut_before = hub_metric(f, &refused("long_string")).await?;
    for key in &ghosts {
        hostile
            .send(report(key, |r| {
                r.exists = true;
                r.apply_error = "e".repeat(2048);
                r.conditions = vec![pb::Condition {
                    r#type: "Degraded".into(),
                    status: "True".into(),
                    reason: "Forged".into(),
                    message: "m".repeat(2048),
                }];
            }))
            .await?;
    }
    // Each report has strings to cut: the counter says when the hub has read them all.
    wait_for(TIMEOUT, "the hub to read every ghost report", || async {
        let cut = hub_metric(f, &refused("long_string")).await? - cut_before;
        Ok((cut >= GHOSTS as f64).then_some(()))
    })
    .await?;
    let rss_after = hub.rss_bytes().context("the hub's RSS after")?;
    println!(
        "{GHOSTS} reports on claimed keys with 4 KiB of strings each: hub RSS {} MiB -> {} MiB",
        rss_before >> 20,
        rss_after >> 20
    );
    ensure!(
        rss_after < rss_before + GHOST_RSS_MAX,
        "the hub kept the claimed keys' reports: RSS {} MiB -> {} MiB",
        rss_before >> 20,
        rss_after >> 20
    );
    let log = DeletionLog::start(env).await?;
    let fedapps: Api<FederatedMyApp> = Api::namespaced(host.clone(), "default");
    let started = std::time::Instant::now();
    fedapps.delete(CLAIMED, &DeleteParams::default()).await?;

    // The claimer is sent the Delete, and waited for.
    let mut deletes = hostile.deletes.clone();
    tokio::time::timeout(TIMEOUT, deletes.wait_for(|d| d.contains(&claimed)))
        .await
        .context("the claimer was never sent the Delete")??;
    let waiting = wait_for(TIMEOUT, "the deletion to wait on the claimer", || async {
        let Some(app) = fedapps.get_opt(CLAIMED).await? else {
            bail!("the app was deleted before it waited on the claimer");
        };
        let status = app.status.unwrap_or_default();
        let propagated = status.conditions.iter().find(|c| c.type_ == "Propagated");
        Ok(propagated
            .filter(|c| c.reason == "Deleting" && c.message.contains(CLAIMER))
            .map(|c| c.message.clone()))
    })
    .await?;
    println!("while the claim is waited for: {waiting}");

    // Then the deletion goes on without it.
    wait_for(TIMEOUT, "the claimed app gone from the host", || async {
        Ok(fedapps.get_opt(CLAIMED).await?.is_none().then_some(()))
    })
    .await?;
    let took = started.elapsed();
    println!(
        "deleted after {:.1}s (claim wait {wait:?})",
        took.as_secs_f64(),
        wait = CLAIM_WAIT
    );
    ensure!(
        took >= CLAIM_WAIT,
        "the deletion ended after {took:?}, before the claim wait of {CLAIM_WAIT:?}"
    );
    let event =
        flotilla_lab::wait_event(host, "default", CLAIMED, "ClaimUnconfirmed", TIMEOUT).await?;
    let note = event.message.unwrap_or_default();
    println!("Event ClaimUnconfirmed: {note}");
    ensure!(
        note.contains(CLAIMER),
        "the Event does not name {CLAIMER}: {note}"
    );
    let hub = f.process(env, HUB)?;
    let log_text = std::fs::read_to_string(hub.log.as_ref().context("the hub's log")?)?;
    ensure!(
        log_text
            .lines()
            .any(|l| l.contains("only claimed the MyApp") && l.contains(CLAIMER)),
        "the hub's log has no line naming {CLAIMER}"
    );
    // The real members' copies were deleted, as the host asked, and nothing else.
    let expected: BTreeSet<(String, String)> = members
        .iter()
        .map(|m| (m.clone(), format!("default/{CLAIMED}")))
        .collect();
    wait_for(TIMEOUT, "the members' copies deleted", || async {
        Ok((log.deletions().len() >= expected.len()).then_some(()))
    })
    .await?;
    log.assert_clean(&expected)?;
    hostile.close();
    Ok(())
}

/// Review M2: an agent that reconnects in a loop, saying another version each time,
/// made one MemberCluster write per reconnect (100 reconnects in 7 s made 96). Now a
/// burst is written, the rest waits for the cluster's write budget, and the latest
/// version is written once it refills.
#[tokio::test]
async fn a_reconnect_loop_makes_a_bounded_number_of_host_writes() -> Result<()> {
    const LOOPER: &str = "hostile-looper-e2e";
    let t = Joined::start(LOOPER).await?;
    let outcome = reconnect_loop(&t.f, &t.host, &t.token, LOOPER).await;
    let removed = t.cli.run(&["unjoin", LOOPER]).map(drop);
    outcome.and(removed)
}

async fn reconnect_loop(f: &Federation, host: &Client, token: &str, looper: &str) -> Result<()> {
    let writes = "flotilla_hub_status_writes_total{kind=\"membercluster\",result=\"written\"}";
    let before = hub_metric(f, writes).await?;
    let started = std::time::Instant::now();
    let (mut last, mut served) = (None, 0);
    for i in 0..100 {
        let version = format!("loop-{i}");
        let hello = pb::Hello {
            cluster: looper.into(),
            agent_version: version.clone(),
            kubernetes_version: "v1.34.4".into(),
            ..Default::default()
        };
        match f.open_session_with(token, hello, 1).await {
            Ok((tx, mut inbound)) => {
                // The hub answers once it has taken the Hello in.
                let answer = tokio::time::timeout(TIMEOUT, inbound.message()).await;
                ensure!(matches!(answer, Ok(Ok(Some(_)))), "session {i}: {answer:?}");
                (last, served) = (Some(version), served + 1);
                drop(tx);
            }
            // The previous session is not closed on the hub's side yet.
            Err(DialError::Refused(s)) if s.code() == tonic::Code::AlreadyExists => {}
            Err(e) => return Err(e.into()),
        }
    }
    let elapsed = started.elapsed();
    let written = hub_metric(f, writes).await? - before;
    println!(
        "100 reconnects with another version each ({served} served) in {elapsed:.1?}: {written} MemberCluster status write(s)"
    );
    let last = last.context("no session was served")?;
    // The burst (5), one more per 10 s, and a little for the other clusters' writes.
    let bound = 5.0 + elapsed.as_secs_f64() / 10.0 + 3.0;
    ensure!(
        written <= bound,
        "{written} MemberCluster writes for 100 reconnects (bound {bound:.0})"
    );
    wait_for(TIMEOUT, "the last version on the MemberCluster", || async {
        let mc = Api::<MemberCluster>::all(host.clone()).get(looper).await?;
        let shown = mc.status.and_then(|s| s.agent_version);
        Ok((shown.as_deref() == Some(last.as_str())).then_some(()))
    })
    .await
}

/// Issue 20 item 2: a member that claims all the room there is takes a bounded part of a
/// Capacity app (its room counts for 4 × the median cluster's at most), and the honest
/// members keep their MyApps. Unbounded, 6 replicas over two honest members and the liar
/// went 0/0/6: the honest copies were removed once the liar said its own were Ready.
#[tokio::test]
async fn a_member_claiming_endless_room_takes_a_bounded_part() -> Result<()> {
    const ROOMY: &str = "hostile-roomy-e2e";
    let t = Joined::start(ROOMY).await?;
    let (env, f, host, cli, token) = (&t.env, &t.f, &t.host, &t.cli, &t.token);
    let members: Vec<String> = t.members().into_iter().take(2).collect();
    ensure!(members.len() == 2, "needs two members, has {members:?}");
    let outcome = roomy(env, f, host, (ROOMY, token), &members).await;
    let fedapps: Api<FederatedMyApp> = Api::namespaced(host.clone(), "default");
    let _ = fedapps.delete(ROOMY_APP, &DeleteParams::default()).await;
    let removed = cli.run(&["unjoin", ROOMY]).map(drop);
    outcome?;
    removed?;
    wait_for(TIMEOUT, "the capacity app gone", || async {
        Ok(fedapps.get_opt(ROOMY_APP).await?.is_none().then_some(()))
    })
    .await?;
    converge::wait_converged(env, TIMEOUT).await?;
    Ok(())
}

const ROOMY_APP: &str = "hostile-capacity";

async fn roomy(
    env: &Env,
    f: &Federation,
    host: &Client,
    (roomy, token): (&str, &str),
    members: &[String],
) -> Result<()> {
    let hostile = Hostile::open(f, (roomy, token), &[], true).await?;
    let endless = Some(pb::Resources {
        cpu_millis: i64::MAX,
        memory_bytes: i64::MAX,
    });
    hostile
        .send(message(agent_message::Kind::Capacity(pb::Capacity {
            nodes: 1,
            allocatable: endless,
            requested: Some(pb::Resources::default()),
            largest_free: endless,
        })))
        .await?;
    wait_for(TIMEOUT, "the claimed room on the MemberCluster", || async {
        let mc = Api::<MemberCluster>::all(host.clone()).get(roomy).await?;
        Ok(mc.status.and_then(|s| s.capacity).map(drop))
    })
    .await?;
    let mut placed: Vec<serde_json::Value> = members.iter().map(|m| json!({"name": m})).collect();
    placed.push(json!({"name": roomy}));
    apply_app(
        host,
        ROOMY_APP,
        json!({"placement": {"clusters": placed,
                             "replicaScheduling": {"mode": "Capacity", "totalReplicas": 6}},
               "template": {"spec": {"replicas": 1, "image": "nginx:1.27"}}}),
    )
    .await?;
    // Settled: every cluster has its share, none holds a surplus (the liar's copy is
    // "Ready", so make-before-break has let go of whatever it was going to).
    let fedapps: Api<FederatedMyApp> = Api::namespaced(host.clone(), "default");
    let last = std::sync::Mutex::new(BTreeMap::new());
    let shares = wait_for(TIMEOUT, "the capacity app divided and settled", || async {
        let status = fedapps.get(ROOMY_APP).await?.status.unwrap_or_default();
        let shares: BTreeMap<String, (i32, Option<SchedulingReason>)> = (status.clusters.iter())
            .map(|c| {
                (
                    c.name.clone(),
                    (c.replicas.unwrap_or(0), c.scheduling_reason),
                )
            })
            .collect();
        let settled = shares.len() == 3
            && shares
                .values()
                .all(|(_, r)| *r == Some(SchedulingReason::Capacity))
            && shares.values().map(|(n, _)| n).sum::<i32>() == 6;
        *last.lock().unwrap() = shares.clone();
        Ok(settled.then_some(shares))
    })
    .await
    .with_context(|| format!("the division last shown: {:?}", last.lock().unwrap()))?;
    println!("a Capacity app of 6 with one member claiming endless room: {shares:?}");
    hostile.close();
    ensure!(
        shares[roomy].0 <= 4,
        "the liar took {} of 6: {shares:?}",
        shares[roomy].0
    );
    let running = fingerprint(env).await?;
    for m in members {
        ensure!(shares[m].0 >= 1, "{m} lost its share: {shares:?}");
        ensure!(
            running[m].contains_key(ROOMY_APP),
            "{m} no longer runs {ROOMY_APP}: {:?}",
            running[m]
        );
    }
    Ok(())
}
