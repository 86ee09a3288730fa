//! Tenancy on the real apiservers (DESIGN.md rule 8): a FederatedMyApp in a system
//! namespace or in Flotilla's own is refused by the hub with a clear status and Event and
//! reaches no member; an agent refuses such a MyApp even when a hub sends it. Each test
//! ends with the convergence checker green and the deletion log clean.
//! Needs a running environment (`cargo run -p flotilla-e2e -- up`).

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use flotilla_crds::{FederatedMyApp, MyApp};
use flotilla_e2e::deletions::DeletionLog;
use flotilla_e2e::{agent_binary, converge};
use flotilla_lab::support::{free_addr, http_get, sample};
use flotilla_lab::{Env, await_object, wait_for};
use flotilla_proto::v1::federation_server::{Federation, FederationServer};
use flotilla_proto::v1::{self as pb, agent_message, hub_message};
use k8s_openapi::api::events::v1::Event;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
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
