//! What disturbs the whole environment, so it runs alone (its own test binary, one test):
//! restarting an agent and the hub, and sessions with stolen or revoked credentials.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result};
use flotilla_crds::{FederatedMyApp, MyApp};
use flotilla_e2e::federation::{Federation, HUB, agent_name};
use flotilla_e2e::support::sample;
use flotilla_e2e::{Env, wait_for};
use flotilla_proto::v1::federation_client::FederationClient;
use flotilla_proto::v1::{self as pb, agent_message, hub_message};
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

const TIMEOUT: Duration = Duration::from_secs(60);

fn apps(c: &Client) -> Api<MyApp> {
    Api::namespaced(c.clone(), "default")
}

/// (MyApp uid, generation, Deployment uid) per member: equal before and after means
/// nothing was deleted, re-created or re-applied with a change.
async fn fingerprint(env: &Env, name: &str) -> Result<BTreeMap<String, (String, i64, String)>> {
    let mut out = BTreeMap::new();
    for m in env.members() {
        let c = env.client(m).await?;
        let app = apps(&c).get(name).await?;
        let deploy = Api::<Deployment>::namespaced(c, "default")
            .get(&format!("{name}-deploy"))
            .await?;
        out.insert(
            m.to_owned(),
            (
                app.uid().unwrap(),
                app.metadata.generation.unwrap(),
                deploy.uid().unwrap(),
            ),
        );
    }
    Ok(out)
}

async fn hub_sent(f: &Federation, cluster: &str, kind: &str) -> Result<f64> {
    let text = f.metrics(HUB).await?;
    Ok(sample(
        &text,
        &format!("flotilla_hub_messages_sent_total{{cluster=\"{cluster}\",kind=\"{kind}\"}}"),
    ))
}

/// Waits until the hub has sent SyncComplete to `cluster` more than `before` times.
async fn resynced(f: &Federation, cluster: &str, before: f64) -> Result<()> {
    wait_for(TIMEOUT, &format!("{cluster} resynced"), || async {
        Ok((hub_sent(f, cluster, "sync_complete").await? > before).then_some(()))
    })
    .await
}

/// The one place this suite speaks the wire as an agent would: dial the hub over TLS,
/// send the bearer `token` on every call, open the session and say Hello as `cluster`.
/// `Ok(Err(status))` is the hub's refusal. (To move into `flotilla-proto` as the one
/// client-connect helper, shared with the agent.)
async fn open_session(
    f: &Federation,
    token: &str,
    cluster: &str,
) -> Result<
    Result<
        (
            tokio::sync::mpsc::Sender<pb::AgentMessage>,
            tonic::Streaming<pb::HubMessage>,
        ),
        tonic::Status,
    >,
> {
    let ca = std::fs::read(&f.hub_ca)?;
    let channel = Endpoint::from_shared(f.hub_grpc.clone())?
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(ca))
                .domain_name("localhost"),
        )?
        .connect()
        .await?;
    let bearer: tonic::metadata::MetadataValue<_> = format!("Bearer {token}").parse()?;
    let mut client =
        FederationClient::with_interceptor(channel, move |mut r: tonic::Request<()>| {
            r.metadata_mut().insert("authorization", bearer.clone());
            Ok(r)
        });
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let hello = pb::Hello {
        cluster: cluster.into(),
        agent_version: "e2e".into(),
        kubernetes_version: "".into(),
        managed: vec![],
    };
    tx.send(pb::AgentMessage {
        kind: Some(agent_message::Kind::Hello(hello)),
    })
    .await?;
    match client
        .session(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
    {
        Ok(r) => Ok(Ok((tx, r.into_inner()))),
        Err(status) => Ok(Err(status)),
    }
}

/// A session as `cluster` with `token`: every message up to SyncComplete, or the refusal.
async fn session(
    f: &Federation,
    token: &str,
    cluster: &str,
) -> Result<Result<Vec<pb::HubMessage>, tonic::Status>> {
    let (_tx, mut inbound) = match open_session(f, token, cluster).await? {
        Ok(open) => open,
        Err(status) => return Ok(Err(status)),
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

#[tokio::test]
async fn restarts_resend_nothing_and_credentials_bind_one_cluster() -> Result<()> {
    let env = Env::load_ready().await?;
    let f = Federation::load(&env)?;
    let host = env.client("host").await?;
    let fedapps: Api<FederatedMyApp> = Api::namespaced(host.clone(), "default");
    let make = |name: &str, clusters: &[&str]| {
        json!({"apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
               "metadata": {"name": name, "namespace": "default"},
               "spec": {"placement": {"clusters": clusters.iter().map(|c| json!({"name": c})).collect::<Vec<_>>()},
                        "template": {"spec": {"replicas": 2, "image": "nginx:1.27"}}}})
    };
    fedapps
        .patch(
            "steady",
            &PatchParams::apply("e2e"),
            &Patch::Apply(make("steady", &["cluster1", "cluster2"])),
        )
        .await?;
    fedapps
        .patch(
            "only-on-1",
            &PatchParams::apply("e2e"),
            &Patch::Apply(make("only-on-1", &["cluster1"])),
        )
        .await?;
    wait_for(TIMEOUT, "steady Ready", || async {
        let s = fedapps.get("steady").await?.status.unwrap_or_default();
        Ok((s.ready_clusters == 2).then_some(()))
    })
    .await?;
    let before = fingerprint(&env, "steady").await?;

    // Agent restart: it says Hello with the hashes it applied; the hub sends no Apply.
    let applies = hub_sent(&f, "cluster1", "apply").await?;
    let syncs = hub_sent(&f, "cluster1", "sync_complete").await?;
    f.restart(&env, &agent_name("cluster1")).await?;
    resynced(&f, "cluster1", syncs).await?;
    assert_eq!(
        hub_sent(&f, "cluster1", "apply").await?,
        applies,
        "the hub re-sent unchanged MyApps"
    );
    assert_eq!(
        fingerprint(&env, "steady").await?,
        before,
        "the agent restart changed a member"
    );

    // Hub restart: a fresh hub (counters from zero) renders everything, then sends
    // nothing the agents already run.
    f.restart(&env, HUB).await?;
    for m in env.members() {
        resynced(&f, m, 0.0).await?;
        assert_eq!(
            hub_sent(&f, m, "apply").await?,
            0.0,
            "the restarted hub re-sent to {m}"
        );
    }
    assert_eq!(
        fingerprint(&env, "steady").await?,
        before,
        "the hub restart changed a member"
    );

    // cluster2's credential cannot claim cluster1, and sees only cluster2's MyApps.
    let token2 = std::fs::read_to_string(&f.tokens["cluster2"])?;
    let refused = session(&f, token2.trim(), "cluster1")
        .await?
        .expect_err("claiming another cluster");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    let messages = session(&f, token2.trim(), "cluster2")
        .await?
        .expect("cluster2's own session");
    let Some(hub_message::Kind::SyncComplete(complete)) = &messages.last().unwrap().kind else {
        panic!("{messages:?}")
    };
    let names: Vec<&str> = complete.desired.iter().map(|k| k.name.as_str()).collect();
    assert!(
        names.contains(&"steady") && !names.contains(&"only-on-1"),
        "{names:?}"
    );
    for m in &messages {
        if let Some(hub_message::Kind::Apply(a)) = &m.kind {
            assert_ne!(a.key.as_ref().unwrap().name, "only-on-1");
        }
    }

    // A revoked credential is refused.
    let dir = env.dir.join("federation");
    let token_file = dir.join("revoked-e2e.token");
    let cli = f.hub_cli()?;
    cli.join("revoked-e2e", &[], &token_file)?;
    let token = std::fs::read_to_string(&token_file)?;
    wait_for(TIMEOUT, "the joined credential accepted", || async {
        Ok(session(&f, token.trim(), "revoked-e2e").await?.ok())
    })
    .await?;
    cli.revoke("revoked-e2e")?;
    let refused = wait_for(TIMEOUT, "the revoked credential refused", || async {
        Ok(session(&f, token.trim(), "revoked-e2e").await?.err())
    })
    .await?;
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    assert!(
        refused.message().contains("unknown or revoked"),
        "{refused:?}"
    );
    Api::<flotilla_crds::MemberCluster>::all(host.clone())
        .delete("revoked-e2e", &DeleteParams::default())
        .await?;

    for name in ["steady", "only-on-1"] {
        fedapps.delete(name, &DeleteParams::default()).await?;
    }
    wait_for(TIMEOUT, "test apps deleted", || async {
        Ok((fedapps.get_opt("steady").await?.is_none()
            && fedapps.get_opt("only-on-1").await?.is_none())
        .then_some(()))
    })
    .await
}
