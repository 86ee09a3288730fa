//! The cluster's ID from SIG-Multicluster's About API (KEP-2149) on the lab's real
//! apiservers: cluster2 is pinned by its `kube-system` UID; the About API CRD and the
//! ClusterProperty `cluster.clusterset.k8s.io` are installed in it and its agent
//! restarted; the MemberCluster then shows the stated ID beside the same UID, the
//! ClusterProfile publishes it, a Hello that matches either pin passes the pin check and
//! one that matches neither is refused, and nothing is deleted or re-applied anywhere.
//! Restarts an agent, so it runs alone (its own test binary, one test). Needs a running
//! environment (`cargo run -p flotilla-e2e -- up`).

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use flotilla_crds::inventory::ClusterProfile;
use flotilla_crds::{FederatedMyApp, MemberCluster};
use flotilla_e2e::deletions::DeletionLog;
use flotilla_lab::federation::{Federation, HUB, HUB_NAMESPACE, agent_name};
use flotilla_lab::support::sample;
use flotilla_lab::{Env, HOST, await_object, wait_for};
use flotilla_proto::client::DialError;
use flotilla_proto::v1 as pb;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(60);
const MEMBER: &str = "cluster2";
const PROPERTY: &str = "cluster.clusterset.k8s.io";
/// The About API's CRD, copied from kubernetes-sigs/about-api (source and licence in
/// its header).
const ABOUT_CRD: &str = include_str!("data/about.k8s.io_clusterproperties.yaml");

fn properties(member: &Client) -> Api<DynamicObject> {
    let resource = ApiResource {
        group: "about.k8s.io".into(),
        version: "v1beta1".into(),
        api_version: "about.k8s.io/v1beta1".into(),
        kind: "ClusterProperty".into(),
        plural: "clusterproperties".into(),
    };
    Api::all_with(member.clone(), &resource)
}

async fn hub_sent(f: &Federation, kind: &str) -> Result<f64> {
    let text = f.metrics(HUB).await?;
    Ok(sample(
        &text,
        &format!("flotilla_hub_messages_sent_total{{cluster=\"{MEMBER}\",kind=\"{kind}\"}}"),
    ))
}

/// The hub's answer to a Hello for cluster2 saying `uid` and `id`: `Ok` is a session
/// opened, `Err` the refusal.
async fn hello(
    f: &Federation,
    token: &str,
    uid: &str,
    id: &str,
) -> Result<Result<(), tonic::Status>> {
    let hello = pb::Hello {
        cluster: MEMBER.into(),
        agent_version: "e2e".into(),
        cluster_uid: uid.into(),
        cluster_id: id.into(),
        ..Default::default()
    };
    match f.open_session_with(token, hello, 4).await {
        Ok(_) => Ok(Ok(())),
        Err(DialError::Refused(status)) => Ok(Err(status)),
        Err(e) => Err(e.into()),
    }
}

#[tokio::test]
async fn a_stated_cluster_id_is_pinned_beside_the_uid_and_nothing_moves() -> Result<()> {
    let env = Env::load_ready().await?;
    let f = Federation::load(&env)?;
    let host = env.client(HOST).await?;
    let member = env.client(MEMBER).await?;
    let members: Api<MemberCluster> = Api::all(host.clone());
    let fedapps: Api<FederatedMyApp> = Api::namespaced(host.clone(), "default");
    let log = DeletionLog::start(&env).await?;
    let app = json!({"apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
        "metadata": {"name": "about-id", "namespace": "default"},
        "spec": {"placement": {"clusters": [{"name": "cluster1"}, {"name": MEMBER}]},
                 "template": {"spec": {"replicas": 1, "image": "nginx:1.27"}}}});
    fedapps
        .patch("about-id", &PatchParams::apply("e2e"), &Patch::Apply(app))
        .await?;
    await_object(
        &fedapps,
        "about-id",
        TIMEOUT,
        "about-id Ready",
        |a: Option<&FederatedMyApp>| {
            a.and_then(|a| a.status.as_ref())
                .is_some_and(|s| s.ready_clusters == 2)
        },
    )
    .await?;
    let status = members.get(MEMBER).await?.status.unwrap_or_default();
    ensure!(
        status.cluster_id.is_none(),
        "cluster2 starts with an ID pinned (a failed run's?): {status:?}"
    );
    let uid = status.cluster_uid.context("cluster2's UID is pinned")?;
    let id = format!("e2e-{}", uid.get(..8).unwrap_or(&uid));
    let before = flotilla_e2e::converge::managed_myapps(&member).await?;

    // The About API in cluster2, as a cluster-set admin would install it.
    let crd: CustomResourceDefinition = serde_yaml::from_str(
        ABOUT_CRD
            .split("\n---\n")
            .nth(1)
            .context("the CRD document")?,
    )?;
    let crds: Api<CustomResourceDefinition> = Api::all(member.clone());
    crds.patch(
        &crd.name_any(),
        &PatchParams::apply("e2e").force(),
        &Patch::Apply(&crd),
    )
    .await?;
    await_object(
        &crds,
        &crd.name_any(),
        TIMEOUT,
        "the About API established",
        |c: Option<&CustomResourceDefinition>| {
            c.and_then(|c| c.status.as_ref())
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                })
        },
    )
    .await?;
    let property = json!({"apiVersion": "about.k8s.io/v1beta1", "kind": "ClusterProperty",
        "metadata": {"name": PROPERTY}, "spec": {"value": id}});
    wait_for(TIMEOUT, "the ClusterProperty created", || async {
        // The new resource may take a moment to be served after Established.
        Ok(properties(&member)
            .patch(
                PROPERTY,
                &PatchParams::apply("e2e"),
                &Patch::Apply(&property),
            )
            .await
            .ok())
    })
    .await?;

    let result = async {
        let applies = hub_sent(&f, "apply").await?;
        f.restart(&env, &agent_name(MEMBER)).await?;
        let shown = await_object(
            &members,
            MEMBER,
            TIMEOUT,
            "cluster2 shows its stated ID",
            |m: Option<&MemberCluster>| {
                m.and_then(|m| m.status.as_ref())
                    .is_some_and(|s| s.cluster_id.as_deref() == Some(id.as_str()))
            },
        )
        .await?;
        let shown = shown.and_then(|m| m.status).unwrap_or_default();
        ensure!(
            shown.cluster_uid.as_deref() == Some(uid.as_str()),
            "the UID pin moved: {shown:?}"
        );
        let profiles: Api<ClusterProfile> = Api::namespaced(host.clone(), HUB_NAMESPACE);
        await_object(
            &profiles,
            MEMBER,
            TIMEOUT,
            "the profile shows the stated ID",
            |p: Option<&ClusterProfile>| {
                p.and_then(|p| p.status.as_ref()).is_some_and(|s| {
                    s.properties
                        .iter()
                        .any(|x| x.name == PROPERTY && x.value == id)
                })
            },
        )
        .await?;

        // The pin rules against the live hub. While cluster2's agent holds its session, a
        // Hello that passes the pin check is refused only as a second session.
        let token = std::fs::read_to_string(&f.tokens[MEMBER])?;
        let token = token.trim();
        for (sent_uid, sent_id, why) in [
            (
                "not-cluster2",
                id.as_str(),
                "the ID alone (a rebuilt cluster)",
            ),
            (uid.as_str(), "", "the UID alone (an older agent)"),
            (uid.as_str(), id.as_str(), "both"),
        ] {
            let refused = hello(&f, token, sent_uid, sent_id).await?.err();
            let refused = refused.with_context(|| format!("{why}: a second session opened"))?;
            ensure!(
                refused.code() == tonic::Code::AlreadyExists,
                "{why}: {refused:?}"
            );
        }
        for (sent_uid, sent_id) in [("not-cluster2", "not-the-id"), ("", ""), ("", "not-the-id")] {
            let refused = hello(&f, token, sent_uid, sent_id)
                .await?
                .err()
                .context("a Hello that matches neither pin was let in")?;
            ensure!(
                refused.code() == tonic::Code::PermissionDenied
                    && refused.message().contains(&format!("{PROPERTY} is {id:?}")),
                "{sent_uid:?}/{sent_id:?}: {refused:?}"
            );
        }

        ensure!(
            hub_sent(&f, "apply").await? == applies,
            "the reconnect under a new ID re-sent MyApps"
        );
        let after = flotilla_e2e::converge::managed_myapps(&member).await?;
        ensure!(
            before == after,
            "cluster2's MyApps changed: {before:?} -> {after:?}"
        );
        log.assert_clean(&BTreeSet::new())
    }
    .await;

    // Clean up: the property goes, the agent says Hello without it (still matching the
    // UID pin), and the ID pin is cleared as an admin would, so that other suites see
    // the UID again.
    properties(&member)
        .delete(PROPERTY, &DeleteParams::default())
        .await?;
    crds.delete(&crd.name_any(), &DeleteParams::default())
        .await?;
    f.restart(&env, &agent_name(MEMBER)).await?;
    members
        .patch_status(
            MEMBER,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"clusterID": null}})),
        )
        .await?;
    fedapps.delete("about-id", &DeleteParams::default()).await?;
    wait_for(TIMEOUT, "about-id deleted", || async {
        Ok(fedapps.get_opt("about-id").await?.is_none().then_some(()))
    })
    .await?;
    result?;
    // The cleared ID stays cleared (the agent no longer states one).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let status = members.get(MEMBER).await?.status.unwrap_or_default();
    ensure!(status.cluster_id.is_none(), "{status:?}");
    ensure!(
        status.cluster_uid.as_deref() == Some(uid.as_str()),
        "{status:?}"
    );
    Ok(())
}
