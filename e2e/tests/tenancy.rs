//! Tenancy on the real apiservers (DESIGN.md rule 8): a FederatedMyApp in a system
//! namespace or in Flotilla's own is refused by the hub with a clear status and Event and
//! reaches no member; an agent refuses such a MyApp even when a hub sends it; a namespace
//! places only on the clusters its ClusterGrants grant, and a grant withdrawn keeps what
//! runs (in the default mode and with `--require-namespace-grant`). Each test ends with
//! the convergence checker green and the deletion log clean.
//! Needs a running environment (`cargo run -p flotilla-e2e -- up`).

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use flotilla_crds::{ClusterGrant, FederatedMyApp, MemberCluster, MyApp};
use flotilla_e2e::deletions::DeletionLog;
use flotilla_e2e::{agent_binary, converge};
use flotilla_lab::federation::{self, HUB};
use flotilla_lab::support::{free_addr, http_get, sample};
use flotilla_lab::{Env, await_object, wait_for};
use flotilla_proto::v1::federation_server::{Federation, FederationServer};
use flotilla_proto::v1::{self as pb, agent_message, hub_message};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

const TIMEOUT: Duration = Duration::from_secs(60);
/// The deletion log and the convergence checker watch the whole environment: one test
/// at a time, so that each sees only its own deletions.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn fedapps(host: &Client, namespace: &str) -> Api<FederatedMyApp> {
    Api::namespaced(host.clone(), namespace)
}

/// A FederatedMyApp placed on every registered cluster (`clusterSelector: {}`).
fn everywhere(namespace: &str, name: &str) -> Value {
    json!({
        "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"placement": {"clusterSelector": {}},
                 "template": {"spec": {"replicas": 1, "image": "nginx:1.27"}}},
    })
}

async fn apply(host: &Client, app: &Value) -> Result<()> {
    let (namespace, name) = (
        app["metadata"]["namespace"].as_str(),
        app["metadata"]["name"].as_str(),
    );
    let (namespace, name) = (namespace.context("namespace")?, name.context("name")?);
    fedapps(host, namespace)
        .patch(
            name,
            &PatchParams::apply("e2e-tenancy").force(),
            &Patch::Apply(app),
        )
        .await
        .with_context(|| format!("applying FederatedMyApp {namespace}/{name}"))?;
    Ok(())
}

fn condition<'a>(
    app: &'a FederatedMyApp,
    type_: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    app.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
}

async fn delete_and_wait(host: &Client, namespace: &str, name: &str) -> Result<()> {
    let api = fedapps(host, namespace);
    let _ = api.delete(name, &DeleteParams::default()).await;
    let gone = |a: Option<&FederatedMyApp>| a.is_none();
    let what = format!("FederatedMyApp {namespace}/{name} deleted");
    await_object(&api, name, TIMEOUT, &what, gone).await?;
    Ok(())
}

/// The hub refuses a FederatedMyApp in `kube-system` and in `flotilla-system`: both
/// conditions say `NamespaceForbidden` naming the namespace and the rule, a Warning
/// Event says it too, and no member gets a MyApp, while the same app in `default`
/// reaches every member. Deleting the refused apps completes (their finalizer is
/// released) and deletes nothing on any member.
#[tokio::test]
async fn a_federatedmyapp_in_a_forbidden_namespace_reaches_no_member() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let host = env.client(env.host()).await?;
    let log = DeletionLog::start(&env).await?;
    let name = "tenancy-probe";
    let refused = [
        (
            "kube-system",
            "Kubernetes system namespaces are never placed into",
        ),
        (
            "flotilla-system",
            "Flotilla's own namespace holds its credentials and is never placed into",
        ),
    ];
    for (namespace, _) in refused {
        apply(&host, &everywhere(namespace, name)).await?;
    }
    apply(&host, &everywhere("default", name)).await?;

    for (namespace, rule) in refused {
        let message = format!("namespace {namespace} is forbidden: {rule}");
        let said = |a: Option<&FederatedMyApp>| {
            a.is_some_and(|a| {
                ["Propagated", "Ready"].iter().all(|t| {
                    condition(a, t).is_some_and(|c| {
                        c.status == "False"
                            && c.reason == "NamespaceForbidden"
                            && c.message == message
                    })
                })
            })
        };
        let what = format!("{namespace}/{name} refused with NamespaceForbidden");
        let app = await_object(&fedapps(&host, namespace), name, TIMEOUT, &what, said).await?;
        let status = app.context("no FederatedMyApp")?.status.unwrap_or_default();
        ensure!(
            status.clusters.is_empty() && status.placed_clusters == 0,
            "{status:?}"
        );

        let events: Api<Event> = Api::namespaced(host.clone(), namespace);
        wait_for(TIMEOUT, "a Warning Event NamespaceForbidden", || async {
            let list = events.list(&ListParams::default()).await?;
            Ok(list
                .items
                .iter()
                .any(|e| {
                    e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                        && e.reason.as_deref() == Some("NamespaceForbidden")
                        && e.type_.as_deref() == Some("Warning")
                        && e.note.as_deref() == Some(message.as_str())
                })
                .then_some(()))
        })
        .await?;
    }
    // The allowed twin reached every member, so the hub planned the refused ones too
    // (one planner, one pass); none of them reached any.
    for member in env.members() {
        let client = env.client(member).await?;
        let placed = |a: Option<&MyApp>| a.is_some();
        let what = format!("default/{name} on {member}");
        await_object(
            &Api::<MyApp>::namespaced(client.clone(), "default"),
            name,
            TIMEOUT,
            &what,
            placed,
        )
        .await?;
        for (namespace, _) in refused {
            let there = Api::<MyApp>::namespaced(client.clone(), namespace)
                .get_opt(name)
                .await?;
            ensure!(there.is_none(), "{namespace}/{name} reached {member}");
        }
    }
    converge::wait_converged(&env, TIMEOUT).await?;

    for namespace in ["kube-system", "flotilla-system", "default"] {
        delete_and_wait(&host, namespace, name).await?;
    }
    let expected: BTreeSet<(String, String)> = env
        .members()
        .iter()
        .map(|m| (m.to_string(), format!("default/{name}")))
        .collect();
    converge::wait_converged(&env, TIMEOUT).await?;
    log.assert_clean(&expected)
}

/// A hub that sends every agent `sends` after its Hello (never a SyncComplete, so the
/// agent collects nothing) and passes on the status reports it receives.
struct RogueHub {
    sends: Vec<pb::HubMessage>,
    reports: mpsc::UnboundedSender<pb::StatusReport>,
}

#[tonic::async_trait]
impl Federation for RogueHub {
    type SessionStream = ReceiverStream<Result<pb::HubMessage, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let mut inbound = request.into_inner();
        inbound.message().await?;
        let (tx, rx) = mpsc::channel(self.sends.len().max(1));
        for message in &self.sends {
            let _ = tx.send(Ok(message.clone())).await;
        }
        let reports = self.reports.clone();
        tokio::spawn(async move {
            // Holding `tx` keeps the stream open while the agent talks.
            let _open = tx;
            while let Ok(Some(message)) = inbound.message().await {
                if let Some(agent_message::Kind::Status(report)) = message.kind {
                    let _ = reports.send(report);
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

fn rogue_apply(namespace: &str, name: &str) -> pb::HubMessage {
    let manifest = json!({
        "apiVersion": "app.example.com/v1", "kind": "MyApp",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {flotilla_crds::MANAGED_BY_LABEL: flotilla_crds::MANAGED_BY_VALUE}},
        "spec": {"replicas": 1, "image": "nginx:1.27"},
    });
    pb::HubMessage {
        kind: Some(hub_message::Kind::Apply(pb::Apply {
            key: Some(pb::ObjectKey {
                namespace: namespace.into(),
                name: name.into(),
            }),
            hash: "rogue".into(),
            manifest: serde_json::to_vec(&manifest).expect("JSON").into(),
        })),
    }
}

/// A hub that sends MyApps into `kube-system`, `kube-public` and `flotilla-system`, and
/// into `default` to an agent that allows only a namespace of its own, gets each
/// refused: the agent reports the refusal for that MyApp, logs it, counts it by rule,
/// and the member holds none of them.
#[tokio::test]
async fn an_agent_refuses_forbidden_myapps_a_hub_sends() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let member = env
        .members()
        .first()
        .context("a member cluster")?
        .to_string();
    let client = env.client(&member).await?;
    let log = DeletionLog::start(&env).await?;
    let name = "tenancy-rogue";
    // The agent allows only a namespace of its own: `default` is refused too.
    let forbidden = [
        ("kube-system", "system"),
        ("kube-public", "system"),
        ("flotilla-system", "flotilla"),
        ("default", "not_allowed"),
    ];

    let tls = flotilla_common::tls::self_signed(
        "tenancy-e2e-ca",
        "tenancy-e2e-hub",
        &["localhost".into()],
    )?;
    let dir = env.dir.join("tenancy");
    std::fs::create_dir_all(&dir)?;
    let (ca, token) = (dir.join("ca.crt"), dir.join("token"));
    std::fs::write(&ca, &tls.ca_pem)?;
    std::fs::write(&token, "rogue.token")?;
    let (reports_tx, mut reports) = mpsc::unbounded_channel();
    let hub = RogueHub {
        sends: forbidden
            .iter()
            .map(|(ns, _)| rogue_apply(ns, name))
            .collect(),
        reports: reports_tx,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let identity = tonic::transport::Identity::from_pem(
        &tls.cert_pem,
        secrecy::ExposeSecret::expose_secret(&tls.key_pem),
    );
    let server = tonic::transport::Server::builder()
        .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))?
        .add_service(FederationServer::new(hub))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    let served = tokio::spawn(server);

    // A second agent on the member, dialling the rogue hub; its operator watches a
    // namespace of its own so that it never competes with the environment's.
    let (http, webhook) = (free_addr()?, free_addr()?);
    let mut cmd = Command::new(agent_binary());
    cmd.env("KUBECONFIG", env.kubeconfig(&member)?)
        .env_remove("FLOTILLA_LEADER_ELECT")
        .env_remove("POD_NAMESPACE")
        .args([
            "run",
            "--cluster",
            "rogue",
            "--hub-server-name",
            "localhost",
        ])
        .arg(format!("--hub=https://{addr}"))
        .arg(format!("--token-file={}", token.display()))
        .arg(format!("--hub-ca-file={}", ca.display()))
        .args(["--capacity-interval", "0s", "--heartbeat", "1s"])
        .args(["--namespace", "tenancy-e2e-operator"])
        .args(["--allowed-namespace", "tenancy-e2e-operator"])
        .arg(format!("--http-addr={http}"))
        .arg(format!("--webhook-addr={webhook}"));
    let agent = env.spawn("tenancy-rogue-agent", &mut cmd)?;
    let result = async {
        let mut refused = BTreeSet::new();
        let want: BTreeSet<String> = forbidden
            .iter()
            .map(|(ns, _)| format!("{ns}/{name}"))
            .collect();
        let outcome = tokio::time::timeout(TIMEOUT, async {
            while refused != want {
                let report = reports.recv().await.context("the rogue hub stopped")?;
                let key = report.key.clone().unwrap_or_default();
                let key = format!("{}/{}", key.namespace, key.name);
                if !want.contains(&key) {
                    continue;
                }
                let forbidden_ns = format!(
                    "namespace {} is forbidden",
                    key.split('/').next().unwrap_or_default()
                );
                ensure!(
                    !report.exists && report.apply_error.contains(&forbidden_ns),
                    "{key}: {report:?}"
                );
                refused.insert(key);
            }
            anyhow::Ok(())
        })
        .await;
        outcome.with_context(|| format!("refusals reported: {refused:?} of {want:?}"))??;
        let (code, metrics) = http_get(&http, "/metrics").await?;
        ensure!(code == 200, "/metrics answered {code}");
        for rule in ["system", "flotilla", "not_allowed"] {
            let count = sample(
                &metrics,
                &format!(r#"flotilla_agent_myapps_refused_total{{rule="{rule}"}}"#),
            );
            let sent = forbidden.iter().filter(|(_, r)| *r == rule).count() as f64;
            ensure!(
                count >= sent,
                "rule {rule}: {count} refusals counted, {sent} sent"
            );
        }
        let text = std::fs::read_to_string(agent.log.as_ref().context("the agent's log")?)?;
        ensure!(
            text.contains("refused") && text.contains("namespace kube-system is forbidden"),
            "the agent logged no refusal"
        );
        for (namespace, _) in forbidden {
            let there = Api::<MyApp>::namespaced(client.clone(), namespace)
                .get_opt(name)
                .await?;
            ensure!(
                there.is_none(),
                "{namespace}/{name} was applied on {member}"
            );
        }
        anyhow::Ok(())
    }
    .await;
    agent.stop(Duration::from_secs(5))?;
    flotilla_lab::process::forget(&env.dir, &agent.name)?;
    served.abort();
    result?;
    converge::wait_converged(&env, TIMEOUT).await?;
    let managed = converge::managed_myapps(&client).await?;
    let rogue: Vec<&String> = managed
        .keys()
        .filter(|k| k.ends_with(&format!("/{name}")))
        .collect();
    ensure!(
        rogue.is_empty(),
        "managed MyApps from the rogue hub: {rogue:?}"
    );
    log.assert_clean(&BTreeSet::new())
}

/// The namespace of the grant test: its own, so that its grants bind no other test's
/// apps (a grant in `default` would confine the seed sample).
const GRANTED_NS: &str = "tenancy-grants";

async fn create_namespace(client: &Client, name: &str) -> Result<()> {
    let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}});
    Api::<Namespace>::all(client.clone())
        .patch(name, &PatchParams::apply("e2e-tenancy"), &Patch::Apply(&ns))
        .await
        .with_context(|| format!("creating namespace {name}"))?;
    Ok(())
}

async fn apply_grant(host: &Client, name: &str, spec: Value) -> Result<()> {
    let grant = json!({
        "apiVersion": "flotilla.io/v1alpha1", "kind": "ClusterGrant",
        "metadata": {"name": name, "namespace": GRANTED_NS}, "spec": spec,
    });
    Api::<ClusterGrant>::namespaced(host.clone(), GRANTED_NS)
        .patch(
            name,
            &PatchParams::apply("e2e-tenancy").force(),
            &Patch::Apply(&grant),
        )
        .await
        .with_context(|| format!("applying ClusterGrant {GRANTED_NS}/{name}"))?;
    Ok(())
}

/// The MyApp `GRANTED_NS/name` on `member`: its content hash, or `None` when absent.
async fn myapp_hash(env: &Env, member: &str, name: &str) -> Result<Option<String>> {
    let client = env.client(member).await?;
    let found = Api::<MyApp>::namespaced(client, GRANTED_NS)
        .get_opt(name)
        .await?;
    Ok(found.map(|m| {
        let hash = m.annotations().get(flotilla_crds::HASH_ANNOTATION).cloned();
        hash.unwrap_or_default()
    }))
}

/// ClusterGrants confine a namespace (DESIGN.md rule 8): granted only the first member,
/// an app selecting every cluster lands there alone, and an app naming the second member
/// gets `NotGranted` for it (naming the cluster and the namespace) and nothing there.
/// Withdrawing the grant (the namespace's grants now match no cluster) keeps the MyApp
/// on the first member as it was, the app's conditions say why, and nothing is deleted;
/// deleting the namespace's last grant widens it to every cluster (the default mode),
/// and the hub logs a warning naming the namespace;
/// deleting the apps then deletes their MyApps everywhere. The deletion log holds only
/// those last deletions.
#[tokio::test]
async fn a_namespace_places_only_on_the_clusters_it_is_granted() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let host = env.client(env.host()).await?;
    let members = env.members();
    let [granted, other, ..] = members.as_slice() else {
        anyhow::bail!("the grant test needs two members: {members:?}");
    };
    let (granted, other) = (granted.to_string(), other.to_string());
    for cluster in std::iter::once(env.host()).chain(members.iter().copied()) {
        create_namespace(&env.client(cluster).await?, GRANTED_NS).await?;
    }
    let log = DeletionLog::start(&env).await?;
    let (spread, named) = ("grants-spread", "grants-named");
    apply_grant(&host, "first", json!({"clusters": [granted]})).await?;
    apply(&host, &everywhere(GRANTED_NS, spread)).await?;
    let mut naming = everywhere(GRANTED_NS, named);
    naming["spec"]["placement"] = json!({"clusters": [{"name": other}]});
    apply(&host, &naming).await?;

    // The spread app: on the granted member only.
    let api = fedapps(&host, GRANTED_NS);
    let ready_on_one = |a: Option<&FederatedMyApp>| {
        a.and_then(|a| a.status.as_ref())
            .is_some_and(|s| s.ready_clusters == 1 && s.placed_clusters == 1)
    };
    let what = format!("{GRANTED_NS}/{spread} Ready on {granted} alone");
    await_object(&api, spread, TIMEOUT, &what, ready_on_one).await?;
    let hash = myapp_hash(&env, &granted, spread).await?;
    let hash = hash.with_context(|| format!("{spread} on {granted}"))?;
    // The named app: NotGranted for the other member, naming it and the namespace.
    let message = format!("cluster is not granted to namespace {GRANTED_NS}");
    let said = |a: Option<&FederatedMyApp>| {
        a.is_some_and(|a| {
            let propagated = condition(a, "Propagated");
            let status = a.status.as_ref();
            let entry = status.and_then(|s| s.clusters.iter().find(|c| c.name == other));
            propagated.is_some_and(|c| c.reason == "NotGranted" && c.message.contains(&other))
                && entry.is_some_and(|e| e.message.starts_with(&message))
        })
    };
    let what = format!("{GRANTED_NS}/{named} NotGranted for {other}");
    await_object(&api, named, TIMEOUT, &what, said).await?;
    converge::wait_converged(&env, TIMEOUT).await?;
    for app in [spread, named] {
        let there = myapp_hash(&env, &other, app).await?;
        ensure!(there.is_none(), "{app} reached {other}, not granted");
    }

    // Withdrawn: the grant now names only a cluster nobody registered.
    apply_grant(&host, "first", json!({"clusters": ["not-registered"]})).await?;
    let withdrawn = |a: Option<&FederatedMyApp>| {
        a.is_some_and(|a| {
            condition(a, "Propagated").is_some_and(|c| {
                c.reason == "NotGranted" && c.message.contains("grant no registered cluster")
            })
        })
    };
    let what = format!("{GRANTED_NS}/{spread} NotGranted as a whole");
    await_object(&api, spread, TIMEOUT, &what, withdrawn).await?;
    converge::wait_converged(&env, TIMEOUT).await?;
    // Kept as it was: nothing deleted, nothing rewritten, nothing new elsewhere.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let kept = myapp_hash(&env, &granted, spread).await?;
    ensure!(
        kept.as_ref() == Some(&hash),
        "{spread} on {granted}: {kept:?}, was {hash}"
    );
    ensure!(myapp_hash(&env, &other, spread).await?.is_none());
    log.assert_clean(&BTreeSet::new())?;

    // The last grant deleted: the default mode places the namespace everywhere again,
    // and the hub says so, naming the namespace.
    let f = federation::Federation::load(&env)?;
    let hub_log = f.process(&env, HUB)?.log.context("the hub has no log")?;
    let logged = std::fs::read_to_string(&hub_log)?.len();
    Api::<ClusterGrant>::namespaced(host.clone(), GRANTED_NS)
        .delete("first", &DeleteParams::default())
        .await?;
    wait_for(
        TIMEOUT,
        "the hub's warning that the namespace widened",
        || async {
            let text = std::fs::read_to_string(&hub_log)?;
            let new = text.get(logged..).unwrap_or_default();
            Ok(new
                .lines()
                .any(|l| l.contains("namespace has no ClusterGrant left") && l.contains(GRANTED_NS))
                .then_some(()))
        },
    )
    .await?;
    for member in &members {
        let client = env.client(member).await?;
        let api = Api::<MyApp>::namespaced(client, GRANTED_NS);
        let what = format!("{GRANTED_NS}/{spread} on {member} once no grant is left");
        await_object(&api, spread, TIMEOUT, &what, |a: Option<&MyApp>| {
            a.is_some()
        })
        .await?;
    }
    converge::wait_converged(&env, TIMEOUT).await?;

    for app in [spread, named] {
        delete_and_wait(&host, GRANTED_NS, app).await?;
    }
    converge::wait_converged(&env, TIMEOUT).await?;
    let mut expected: BTreeSet<(String, String)> = members
        .iter()
        .map(|m| (m.to_string(), format!("{GRANTED_NS}/{spread}")))
        .collect();
    expected.insert((other.clone(), format!("{GRANTED_NS}/{named}")));
    log.assert_clean(&expected)
}

/// A hub restarted with `--require-namespace-grant` (DESIGN.md rules 1, 2 and 8): a
/// namespace without a grant places nowhere (`NotGranted` on the app as a whole, nothing
/// on any member), a grant to the first member places it there alone, and deleting that
/// last grant keeps the MyApp where it runs. Switching the hub to strict mode deletes
/// nothing anywhere (every other app keeps what it runs). The hub is restarted in the
/// default mode in any case; the app is deleted then, from wherever it runs.
#[tokio::test]
async fn a_hub_that_requires_grants_places_an_ungranted_namespace_nowhere() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let host = env.client(env.host()).await?;
    let f = federation::Federation::load(&env)?;
    let members = env.members();
    let first = members.first().context("a member")?.to_string();
    let namespace = "tenancy-strict";
    for cluster in std::iter::once(env.host()).chain(members.iter().copied()) {
        create_namespace(&env.client(cluster).await?, namespace).await?;
    }
    let log = DeletionLog::start(&env).await?;
    let name = "strict-spread";
    let grants = Api::<ClusterGrant>::namespaced(host.clone(), namespace);
    let strict = async {
        f.stop(&env, HUB)?;
        f.start_variant(&env, HUB, HUB, |l| {
            l.args.push("--require-namespace-grant".into())
        })?;
        f.wait_ready(HUB).await?;
        apply(&host, &everywhere(namespace, name)).await?;
        let api = fedapps(&host, namespace);
        let refused = |a: Option<&FederatedMyApp>| {
            a.is_some_and(|a| {
                ["Propagated", "Ready"].iter().all(|t| {
                    condition(a, t).is_some_and(|c| {
                        c.reason == "NotGranted"
                            && c.message
                                .contains("has no ClusterGrant and this hub requires one")
                    })
                })
            })
        };
        let what = format!("{namespace}/{name} NotGranted without a grant");
        await_object(&api, name, TIMEOUT, &what, refused).await?;
        for member in &members {
            let client = env.client(member).await?;
            let there = Api::<MyApp>::namespaced(client, namespace)
                .get_opt(name)
                .await?;
            ensure!(there.is_none(), "{name} reached {member} without a grant");
        }
        let grant = json!({
            "apiVersion": "flotilla.io/v1alpha1", "kind": "ClusterGrant",
            "metadata": {"name": "first", "namespace": namespace},
            "spec": {"clusters": [first]},
        });
        grants
            .patch(
                "first",
                &PatchParams::apply("e2e-tenancy"),
                &Patch::Apply(&grant),
            )
            .await?;
        let placed = |a: Option<&FederatedMyApp>| {
            a.and_then(|a| a.status.as_ref())
                .is_some_and(|s| s.ready_clusters == 1 && s.placed_clusters == 1)
        };
        let what = format!("{namespace}/{name} Ready on {first} alone");
        await_object(&api, name, TIMEOUT, &what, placed).await?;
        let client = env.client(&first).await?;
        let hash = |m: Option<MyApp>| {
            m.and_then(|m| m.annotations().get(flotilla_crds::HASH_ANNOTATION).cloned())
        };
        let myapps = Api::<MyApp>::namespaced(client, namespace);
        let before = hash(myapps.get_opt(name).await?).context("no MyApp on the first member")?;
        // The last grant deleted: strict mode places the namespace nowhere, and keeps it.
        grants.delete("first", &DeleteParams::default()).await?;
        let what = format!("{namespace}/{name} NotGranted once its grant is gone");
        await_object(&api, name, TIMEOUT, &what, refused).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after = hash(myapps.get_opt(name).await?);
        ensure!(
            after.as_ref() == Some(&before),
            "{name} on {first}: {after:?}, was {before}"
        );
        for member in members.iter().skip(1) {
            let client = env.client(member).await?;
            let there = Api::<MyApp>::namespaced(client, namespace)
                .get_opt(name)
                .await?;
            ensure!(there.is_none(), "{name} reached {member}, never granted");
        }
        log.assert_clean(&BTreeSet::new())
    }
    .await;
    let restored = async {
        f.stop(&env, HUB)?;
        f.start(&env, HUB)?;
        f.wait_ready(HUB).await
    }
    .await;
    strict?;
    restored?;
    for member in &members {
        federation::wait_member_ready(&host, member, true, Duration::from_secs(90)).await?;
    }
    converge::wait_converged(&env, TIMEOUT).await?;
    // Back in the default mode the namespace, which has no grant left, places
    // everywhere: the app's deletion may take it from every member.
    delete_and_wait(&host, namespace, name).await?;
    converge::wait_converged(&env, TIMEOUT).await?;
    let deleted = members
        .iter()
        .map(|m| (m.to_string(), format!("{namespace}/{name}")));
    log.assert_clean(&deleted.collect())
}

/// Issue 20: an agent started with `--allowed-namespace` lists and watches only those
/// namespaces, and its Hello says so. A MyApp placed earlier in another namespace is then
/// unknown to it, not gone: deleting its FederatedMyApp waits (the finalizer stays, and
/// the Propagated condition names the scope), and the member's copy keeps running. Once
/// the agent covers the namespace again, the deletion completes and deletes that copy,
/// and nothing else.
#[tokio::test]
async fn an_agent_narrowed_to_some_namespaces_confirms_no_deletion_outside_them() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let f = federation::Federation::load(&env)?;
    let host = env.client(env.host()).await?;
    let log = DeletionLog::start(&env).await?;
    let member = env.members()[0].to_owned();
    let agent = federation::agent_name(&member);
    const SCOPE: &str = "scope-e2e";
    let (scope, name) = (SCOPE, "scope-probe");
    let members: Api<MemberCluster> = Api::all(host.clone());
    let member_client = env.client(&member).await?;
    create_namespace(&member_client, scope).await?;
    let app = json!({
        "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"placement": {"clusters": [{"name": member}]},
                 "template": {"spec": {"replicas": 1, "image": "nginx:1.27"}}},
    });
    apply(&host, &app).await?;
    let on_member: Api<MyApp> = Api::namespaced(member_client.clone(), "default");
    let what = format!("default/{name} on {member}");
    await_object(&on_member, name, TIMEOUT, &what, |a: Option<&MyApp>| {
        a.is_some()
    })
    .await?;

    let narrowed = async {
        f.stop(&env, &agent)?;
        f.start_variant(&env, &agent, &agent, |l| {
            l.set_arg("allowed-namespace", Some(scope))
        })?;
        f.wait_ready(&agent).await?;
        // The narrowed agent's Hello did not list default/{name}; the hub sent its Apply
        // again, and the agent refused it: proof that the new session is up.
        let refused = |a: Option<&FederatedMyApp>| {
            a.and_then(|a| serde_json::to_string(&a.status).ok())
                .is_some_and(|s| s.contains("not listed in --allowed-namespace"))
        };
        let what = format!("default/{name}: {member}'s agent refuses it");
        await_object(&fedapps(&host, "default"), name, TIMEOUT, &what, refused).await?;
        let watches = |namespaces: &'static [&'static str]| {
            move |m: Option<&MemberCluster>| {
                m.and_then(|m| m.status.as_ref())
                    .is_some_and(|s| s.agent_namespaces == namespaces)
            }
        };
        let what = format!("MemberCluster {member} shows the namespaces its agent watches");
        await_object(&members, &member, TIMEOUT, &what, watches(&[SCOPE])).await?;

        fedapps(&host, "default")
            .delete(name, &DeleteParams::default())
            .await?;
        let reason = format!("{member} (its agent watches only namespaces {scope}, not default)");
        let waiting = |a: Option<&FederatedMyApp>| {
            a.and_then(|a| condition(a, "Propagated"))
                .is_some_and(|c| c.reason == "Deleting" && c.message.contains(&reason))
        };
        let what = format!("default/{name}: the deletion waits for {member}, naming the scope");
        await_object(&fedapps(&host, "default"), name, TIMEOUT, &what, waiting).await?;
        // Longer than a deletion takes when the agent can see it (a second or two).
        tokio::time::sleep(Duration::from_secs(5)).await;
        let still = fedapps(&host, "default").get_opt(name).await?;
        ensure!(
            still.is_some(),
            "the finalizer went while {member}'s copy was unknown"
        );
        ensure!(
            on_member.get_opt(name).await?.is_some(),
            "default/{name} left {member} while its agent could not see it"
        );
        anyhow::Ok(())
    }
    .await;
    // The agent as `up` started it.
    let restored = async {
        f.stop(&env, &agent)?;
        f.start(&env, &agent)?;
        f.wait_ready(&agent).await
    }
    .await;
    narrowed?;
    restored?;
    let what = format!("MemberCluster {member} shows its agent watching every namespace");
    let all = |m: Option<&MemberCluster>| {
        m.and_then(|m| m.status.as_ref())
            .is_some_and(|s| s.agent_namespaces.is_empty())
    };
    await_object(&members, &member, TIMEOUT, &what, all).await?;
    delete_and_wait(&host, "default", name).await?;
    let what = format!("default/{name} gone from {member}");
    await_object(&on_member, name, TIMEOUT, &what, |a: Option<&MyApp>| {
        a.is_none()
    })
    .await?;
    let _ = Api::<Namespace>::all(member_client)
        .delete(scope, &DeleteParams::default())
        .await;
    converge::wait_converged(&env, TIMEOUT).await?;
    log.assert_clean(&BTreeSet::from([(member, format!("default/{name}"))]))
}
