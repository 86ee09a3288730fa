//! The fleet in SIG-Multicluster's cluster inventory API (KEP-4322) on the real host
//! apiserver, written by the hub under deploy/hub's RBAC: a ClusterProfile per
//! MemberCluster that shows its health, identity, version and labels, follows it when
//! the member goes NotReady and back, is not rewritten while nothing changes, comes and
//! goes with the registration, and never takes over another cluster manager's profile;
//! and a PlacementDecision per FederatedMyApp that follows its placement.
//! Needs a running environment (`cargo run -p flotilla-e2e -- up`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use flotilla_crds::FederatedMyApp;
use flotilla_crds::MemberCluster;
use flotilla_crds::inventory::{
    CLUSTER_MANAGER_LABEL, CONTROL_PLANE_HEALTHY, ClusterManager, ClusterProfile,
    ClusterProfileSpec, JOINED, MEMBER_ID_LABEL,
};
use flotilla_crds::inventory::{PLACEMENT_KEY_LABEL, PlacementDecision};
use flotilla_e2e::converge;
use flotilla_e2e::deletions::DeletionLog;
use flotilla_lab::federation::{
    self, Federation, HUB_NAMESPACE, agent_name, region_of, wait_member_ready,
};
use flotilla_lab::{Env, HOST, await_object, wait_for};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(60);
/// The hub compares profiles with MemberClusters every 2 s.
const ROUNDS: Duration = Duration::from_secs(8);
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn profiles(host: &Client) -> Api<ClusterProfile> {
    Api::namespaced(host.clone(), HUB_NAMESPACE)
}

fn condition(p: &ClusterProfile, type_: &str) -> Option<(String, String)> {
    let conditions = &p.status.as_ref()?.conditions;
    let c = conditions.iter().find(|c| c.type_ == type_)?;
    Some((c.status.clone(), c.reason.clone()))
}

fn property<'a>(p: &'a ClusterProfile, name: &str) -> Option<&'a str> {
    let properties = &p.status.as_ref()?.properties;
    let found = properties.iter().find(|x| x.name == name)?;
    Some(found.value.as_str())
}

fn healthy(p: &ClusterProfile) -> Option<String> {
    condition(p, CONTROL_PLANE_HEALTHY).map(|(status, _)| status)
}

async fn versions(api: &Api<ClusterProfile>) -> Result<BTreeMap<String, String>> {
    let list = api.list(&Default::default()).await?;
    Ok(list
        .into_iter()
        .map(|p| (p.name_any(), p.resource_version().unwrap_or_default()))
        .collect())
}

#[tokio::test]
async fn every_member_has_a_profile_that_follows_its_health() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let host = env.client(HOST).await?;
    let api = profiles(&host);
    let members: Api<MemberCluster> = Api::all(host.clone());
    for member in env.members() {
        let mc = members.get(member).await?;
        let uid = mc
            .status
            .and_then(|s| s.cluster_uid)
            .context("clusterUID pinned")?;
        let version = env
            .client(member)
            .await?
            .apiserver_version()
            .await?
            .git_version;
        let what = format!("ClusterProfile {HUB_NAMESPACE}/{member} healthy, joined, {version}");
        let current = |p: Option<&ClusterProfile>| {
            p.is_some_and(|p| {
                let labels = p.labels();
                let status = p.status.as_ref();
                healthy(p).as_deref() == Some("True")
                    && condition(p, JOINED) == Some(("True".into(), "AgentJoined".into()))
                    && status.and_then(|s| s.version.kubernetes.as_deref()) == Some(&version)
                    && labels.get(CLUSTER_MANAGER_LABEL).map(String::as_str) == Some("flotilla")
                    && labels.get(MEMBER_ID_LABEL) == Some(&uid)
                    && labels.get(federation::REGION).map(String::as_str) == Some(region_of(member))
                    && property(p, "cluster.clusterset.k8s.io") == Some(&uid)
                    && property(p, "resources.flotilla.io/allocatable-cpu").is_some()
                    && p.spec.cluster_manager.name == "flotilla"
            })
        };
        await_object(&api, member, TIMEOUT, &what, current).await?;
    }

    // Nothing changes, nothing is written.
    let before = versions(&api).await?;
    tokio::time::sleep(ROUNDS).await;
    let after = versions(&api).await?;
    ensure!(
        before == after,
        "ClusterProfiles rewritten while nothing changed: {before:?} → {after:?}"
    );

    // The member goes NotReady and comes back; its MyApps are never touched.
    let log = DeletionLog::start(&env).await?;
    let f = Federation::load(&env)?;
    let agent = agent_name("cluster1");
    f.stop(&env, &agent)?;
    let result = async {
        let grace = federation::HEARTBEAT_GRACE + Duration::from_secs(15);
        wait_member_ready(&host, "cluster1", false, grace).await?;
        let unhealthy =
            |p: Option<&ClusterProfile>| p.is_some_and(|p| healthy(p).as_deref() == Some("False"));
        let what = "ClusterProfile cluster1 ControlPlaneHealthy False";
        await_object(&api, "cluster1", TIMEOUT, what, unhealthy).await?;
        let other = api.get("cluster2").await?;
        ensure!(
            healthy(&other).as_deref() == Some("True"),
            "cluster2's profile went unhealthy too"
        );
        Ok(())
    }
    .await;
    f.start(&env, &agent)?;
    result?;
    wait_member_ready(&host, "cluster1", true, TIMEOUT).await?;
    let back =
        |p: Option<&ClusterProfile>| p.is_some_and(|p| healthy(p).as_deref() == Some("True"));
    await_object(
        &api,
        "cluster1",
        TIMEOUT,
        "ClusterProfile cluster1 healthy again",
        back,
    )
    .await?;
    converge::wait_converged(&env, TIMEOUT).await?;
    log.assert_clean(&BTreeSet::new())
}

#[tokio::test]
async fn a_profile_comes_and_goes_with_the_registration_and_others_are_left_alone() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let host = env.client(HOST).await?;
    let api = profiles(&host);
    let members: Api<MemberCluster> = Api::all(host.clone());
    let (probe, foreign) = ("inventory-probe", "inventory-foreign");
    // No agent ever dials for these: registrations only.
    let register = |name: &str, team: &str| {
        json!({
            "apiVersion": "core.kubefed.io/v1beta1", "kind": "MemberCluster",
            "metadata": {"name": name, "labels": {"team": team}},
            "spec": {"tokenSha256": "0".repeat(64)},
        })
    };
    let pp = PatchParams::apply("e2e-inventory").force();
    // Another cluster manager's profile of the same name as a registration.
    let theirs = ClusterProfile::new(
        foreign,
        ClusterProfileSpec {
            display_name: None,
            cluster_manager: ClusterManager {
                name: "open-cluster-management".into(),
            },
        },
    );
    api.create(&PostParams::default(), &theirs)
        .await
        .context("creating the foreign profile")?;
    let result = async {
        for name in [probe, foreign] {
            members
                .patch(name, &pp, &Patch::Apply(register(name, "a")))
                .await?;
        }
        let registered = |uid: Option<String>| {
            move |p: Option<&ClusterProfile>| {
                p.is_some_and(|p| {
                    condition(p, JOINED) == Some(("False".into(), "AwaitingAgent".into()))
                        // Unknown until the hub writes the MemberCluster NotReady.
                        && healthy(p).as_deref() != Some("True")
                        && p.labels().get("team").map(String::as_str) == Some("a")
                        && !p.labels().contains_key(MEMBER_ID_LABEL)
                        && p.owner_references().iter().any(|o| Some(&o.uid) == uid.as_ref())
                })
            }
        };
        let what = "ClusterProfile inventory-probe, awaiting its agent";
        let uid = members.get(probe).await?.uid();
        await_object(&api, probe, TIMEOUT, what, registered(uid)).await?;
        // Unjoined and joined again at once: the profile goes (the garbage collector may
        // be first) and comes back, though this hub's cache may never have shown it gone.
        members.delete(probe, &DeleteParams::default()).await?;
        let gone = |p: Option<&ClusterProfile>| p.is_none();
        await_object(&api, probe, TIMEOUT, "the probe's profile gone", gone).await?;
        members
            .patch(probe, &pp, &Patch::Apply(register(probe, "a")))
            .await?;
        let uid = members.get(probe).await?.uid();
        await_object(
            &api,
            probe,
            TIMEOUT,
            "the probe's profile back",
            registered(uid),
        )
        .await?;
        members
            .patch(probe, &pp, &Patch::Apply(register(probe, "b")))
            .await?;
        let relabelled = |p: Option<&ClusterProfile>| {
            p.is_some_and(|p| p.labels().get("team").map(String::as_str) == Some("b"))
        };
        await_object(
            &api,
            probe,
            TIMEOUT,
            "the probe's profile relabelled",
            relabelled,
        )
        .await?;

        // Several rounds on, the other manager's profile is as it was.
        tokio::time::sleep(ROUNDS).await;
        let left = api.get(foreign).await?;
        ensure!(
            left.spec.cluster_manager.name == "open-cluster-management"
                && !left.labels().contains_key(CLUSTER_MANAGER_LABEL)
                && left.status.is_none(),
            "the hub took over another cluster manager's ClusterProfile: {left:?}"
        );

        members.delete(probe, &DeleteParams::default()).await?;
        await_object(
            &api,
            probe,
            TIMEOUT,
            "the probe's profile gone",
            |p: Option<&ClusterProfile>| p.is_none(),
        )
        .await?;
        Ok(())
    }
    .await;
    for name in [probe, foreign] {
        let _ = members.delete(name, &DeleteParams::default()).await;
    }
    let _ = api.delete(foreign, &DeleteParams::default()).await;
    result?;
    let kept = api.get_opt(foreign).await?;
    ensure!(kept.is_none(), "cleanup left {foreign}");
    Ok(())
}

/// The clusters an app's PlacementDecision names, slice by slice; `None` before it has one.
async fn decided(api: &Api<PlacementDecision>, app: &str) -> Result<Option<Vec<String>>> {
    let selector = format!("{PLACEMENT_KEY_LABEL}={app}");
    let slices = api.list(&ListParams::default().labels(&selector)).await?;
    if slices.items.is_empty() {
        return Ok(None);
    }
    let refs = slices.items.iter().flat_map(|s| &s.decisions);
    let names = refs.map(|d| d.cluster_profile_ref.name.clone().unwrap_or_default());
    Ok(Some(names.collect()))
}

#[tokio::test]
async fn a_placement_decision_follows_the_placement() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let host = env.client(HOST).await?;
    let apps: Api<FederatedMyApp> = Api::namespaced(host.clone(), "default");
    let decisions: Api<PlacementDecision> = Api::namespaced(host.clone(), "default");
    let name = "inventory-placed";
    let placed_on = |clusters: &[&str]| {
        let clusters: Vec<_> = clusters.iter().map(|c| json!({"name": c})).collect();
        json!({
            "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"placement": {"clusters": clusters},
                     "template": {"spec": {"replicas": 1, "image": "nginx:1.27"}}},
        })
    };
    let pp = PatchParams::apply("e2e-inventory").force();
    let expect = |want: Vec<&'static str>| {
        let decisions = decisions.clone();
        let what = format!("the PlacementDecision of {name} to name {want:?}");
        async move {
            wait_for(TIMEOUT, &what, || async {
                let names = decided(&decisions, name).await?;
                Ok(names.filter(|n| *n == want).map(|_| ()))
            })
            .await
        }
    };
    let result = async {
        apps.patch(name, &pp, &Patch::Apply(placed_on(&["cluster1"])))
            .await?;
        expect(vec!["cluster1"]).await?;
        let log = DeletionLog::start(&env).await?;
        apps.patch(
            name,
            &pp,
            &Patch::Apply(placed_on(&["cluster1", "cluster2"])),
        )
        .await?;
        expect(vec!["cluster1", "cluster2"]).await?;
        let slice = decisions
            .list(&ListParams::default().labels(&format!("{PLACEMENT_KEY_LABEL}={name}")))
            .await?;
        let slice = slice.items.first().context("a slice")?;
        ensure!(
            slice.scheduler_name.as_deref() == Some("flotilla"),
            "scheduler: {slice:?}"
        );
        let profile = &slice.decisions[0].cluster_profile_ref;
        ensure!(
            profile.kind.as_deref() == Some("ClusterProfile")
                && profile.namespace.as_deref() == Some(HUB_NAMESPACE),
            "the decision does not name the cluster's ClusterProfile: {profile:?}"
        );
        converge::wait_converged(&env, TIMEOUT).await?;
        log.assert_clean(&BTreeSet::new())
    }
    .await;
    let _ = apps.delete(name, &DeleteParams::default()).await;
    result?;
    // The owner reference takes the decision with the app.
    wait_for(
        TIMEOUT,
        "the PlacementDecision gone with its app",
        || async { Ok(decided(&decisions, name).await?.is_none().then_some(())) },
    )
    .await
}
