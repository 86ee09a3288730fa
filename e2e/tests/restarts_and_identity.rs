//! What disturbs the whole environment, so it runs alone (its own test binary, one test):
//! restarting an agent and the hub, and sessions with stolen or revoked credentials.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result};
use flotilla_crds::{FederatedMyApp, MyApp};
use flotilla_lab::federation::{Federation, HUB, agent_name};
use flotilla_lab::support::sample;
use flotilla_lab::{Env, await_object, wait_for};
use flotilla_proto::v1::hub_message;
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(60);

fn apps(c: &Client) -> Api<MyApp> {
    Api::namespaced(c.clone(), "default")
}

/// (MyApp uid, generation, Deployment uid) per member: equal before and after means
/// nothing was deleted, re-created or re-applied with a change.
/// UIDs and generation of `name` (placed on cluster1 and cluster2) in both members.
async fn fingerprint(env: &Env, name: &str) -> Result<BTreeMap<String, (String, i64, String)>> {
    let mut out = BTreeMap::new();
    for m in ["cluster1", "cluster2"] {
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
    let ready = |a: Option<&FederatedMyApp>| {
        a.and_then(|a| a.status.as_ref())
            .is_some_and(|s| s.ready_clusters == 2)
    };
    await_object(&fedapps, "steady", TIMEOUT, "steady Ready", ready).await?;
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

    // cluster2's credential cannot claim cluster1; while cluster2's agent is connected,
    // a second session with its credential is refused rather than let in to flap.
    let token2 = std::fs::read_to_string(&f.tokens["cluster2"])?;
    let refused = f
        .session(token2.trim(), "cluster1")
        .await?
        .expect_err("claiming another cluster");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    // cluster2 is pinned to its kube-system UID: a Hello that leaves the UID out is
    // refused, naming the cluster.
    let no_uid = f
        .session(token2.trim(), "cluster2")
        .await?
        .expect_err("a Hello without the pinned UID");
    assert_eq!(no_uid.code(), tonic::Code::PermissionDenied, "{no_uid:?}");
    assert!(
        no_uid.message().contains("\"cluster2\"") && no_uid.message().contains("no cluster UID"),
        "{no_uid:?}"
    );
    let uid2 = Api::<flotilla_crds::MemberCluster>::all(host.clone())
        .get("cluster2")
        .await?
        .status
        .and_then(|s| s.cluster_uid)
        .context("cluster2's UID is pinned")?;
    let second = f
        .session_in(token2.trim(), "cluster2", &uid2)
        .await?
        .expect_err("a second live session of cluster2");
    assert_eq!(second.code(), tonic::Code::AlreadyExists, "{second:?}");

    // A revoked credential is refused.
    let dir = env.dir.join("federation");
    let token_file = dir.join("revoked-e2e.token");
    let cli = f.hub_cli(&env)?;
    cli.join("revoked-e2e", &[], &token_file)?;
    let token = std::fs::read_to_string(&token_file)?;
    let messages = wait_for(TIMEOUT, "the joined credential accepted", || async {
        Ok(f.session(token.trim(), "revoked-e2e").await?.ok())
    })
    .await?;
    // A credential sees only its own cluster's MyApps: nothing is placed on this one.
    let Some(hub_message::Kind::SyncComplete(complete)) = &messages.last().unwrap().kind else {
        panic!("{messages:?}")
    };
    assert!(complete.desired.is_empty(), "{:?}", complete.desired);
    assert!(messages.len() == 1, "{messages:?}");
    cli.revoke("revoked-e2e")?;
    let refused = wait_for(TIMEOUT, "the revoked credential refused", || async {
        let refused = f.session(token.trim(), "revoked-e2e").await?.err();
        Ok(refused.filter(|s| s.code() == tonic::Code::Unauthenticated))
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
