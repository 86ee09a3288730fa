//! Replica scheduling end to end on three members (cluster1 and cluster3 in region `eu`,
//! cluster2 in `us`; fake nodes of 32, 16 and 8 cores): weights, capacity, spread,
//! cordon and failover, each checked in the members themselves, not only in status.
//!
//! One test at a time: cordon and failover change what every app may use.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use flotilla_crds::{FederatedMyApp, MemberCluster, MyApp};
use flotilla_e2e::deletions::DeletionLog;
use flotilla_e2e::{converge, faults};
use flotilla_lab::federation::{self, Federation, agent_name, wait_member_ready};
use flotilla_lab::{Env, await_object, wait_for};
use k8s_openapi::api::apps::v1::Deployment;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(60);
use flotilla_e2e::THREE_MEMBERS as MEMBERS;

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Ctx {
    env: Env,
    host: Client,
    members: BTreeMap<&'static str, Client>,
}

async fn ctx() -> Result<Ctx> {
    let (env, host, members) = flotilla_e2e::three_members("scheduling").await?;
    Ok(Ctx { env, host, members })
}

impl Ctx {
    fn fedapps(&self) -> Api<FederatedMyApp> {
        Api::namespaced(self.host.clone(), "default")
    }

    async fn apply(&self, name: &str, placement: Value, spec: Value) -> Result<()> {
        let app = json!({
            "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"placement": placement, "template": {"spec": spec}},
        });
        self.fedapps()
            .patch(
                name,
                &PatchParams::apply("e2e").force(),
                &Patch::Apply(&app),
            )
            .await
            .with_context(|| format!("applying FederatedMyApp default/{name}"))?;
        Ok(())
    }

    /// Replicas of MyApp `name` in each member (0: none there).
    async fn replicas_in_members(&self, name: &str) -> Result<BTreeMap<&'static str, i32>> {
        let mut out = BTreeMap::new();
        for (m, c) in &self.members {
            let app = Api::<MyApp>::namespaced(c.clone(), "default")
                .get_opt(name)
                .await?;
            out.insert(*m, app.map_or(0, |a| a.spec.replicas.unwrap_or(1)));
        }
        Ok(out)
    }

    /// Waits until the members run `want` replicas of `name` (in MEMBERS order) and
    /// the FederatedMyApp's status says the same.
    async fn wait_division(&self, name: &str, want: [i32; 3]) -> Result<FederatedMyApp> {
        let want_map: BTreeMap<&str, i32> = MEMBERS.into_iter().zip(want).collect();
        wait_for(TIMEOUT, &format!("{name} divided {want:?}"), || async {
            let have = self.replicas_in_members(name).await?;
            let app = self.fedapps().get(name).await?;
            let shown = shown_division(&app);
            let expected_shown: BTreeMap<String, i32> = want_map
                .iter()
                .filter(|(_, r)| **r > 0)
                .map(|(m, r)| ((*m).to_owned(), *r))
                .collect();
            Ok((have == want_map && shown == expected_shown).then_some(app))
        })
        .await
    }

    async fn delete(&self, name: &str) -> Result<()> {
        let api = self.fedapps();
        let _ = api.delete(name, &DeleteParams::default()).await;
        let gone = |a: Option<&FederatedMyApp>| a.is_none();
        await_object(&api, name, TIMEOUT, &format!("{name} deleted"), gone).await?;
        Ok(())
    }
}

/// Ready replicas of `name`'s Deployments across the members: the workload itself,
/// read even while a member's agent is down.
async fn ready_in_members(members: &BTreeMap<&'static str, Client>, name: &str) -> Result<i32> {
    let mut total = 0;
    for c in members.values() {
        let d = Api::<Deployment>::namespaced(c.clone(), "default")
            .get_opt(&format!("{name}-deploy"))
            .await?;
        total += d
            .and_then(|d| d.status)
            .and_then(|s| s.ready_replicas)
            .unwrap_or(0);
    }
    Ok(total)
}

/// status.clusters[].replicas of the clusters that run something.
fn shown_division(app: &FederatedMyApp) -> BTreeMap<String, i32> {
    let clusters = app.status.as_ref().map(|s| s.clusters.as_slice());
    clusters
        .unwrap_or_default()
        .iter()
        .filter_map(|c| Some((c.name.clone(), c.replicas.filter(|r| *r > 0)?)))
        .collect()
}

fn weighted(total: i32) -> Value {
    json!({
        "clusterSelector": {},
        "replicaScheduling": {
            "mode": "Weighted", "totalReplicas": total,
            "preferences": [{"clusterNames": ["cluster1"], "weight": 2}],
        },
    })
}

fn nginx() -> Value {
    json!({"image": "nginx:1.27", "replicas": 1})
}

#[tokio::test]
async fn weighted_2_1_1_lands_as_6_3_3_and_reports_it() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let c = ctx().await?;
    c.apply("sched-weighted", weighted(12), nginx()).await?;
    c.wait_division("sched-weighted", [6, 3, 3]).await?;
    let all_ready = |a: Option<&FederatedMyApp>| {
        let status = a.and_then(|a| a.status.as_ref());
        status.is_some_and(|s| s.replicas == Some(12) && s.ready_replicas == 12)
    };
    let what = "12 ready replicas in status";
    let app = await_object(&c.fedapps(), "sched-weighted", TIMEOUT, what, all_ready).await?;
    let status = app.and_then(|a| a.status).context("no status")?;
    for cluster in &status.clusters {
        ensure!(
            cluster.scheduling_reason == Some(flotilla_crds::federated::SchedulingReason::Weight),
            "{}: reason {:?}",
            cluster.name,
            cluster.scheduling_reason
        );
    }
    c.delete("sched-weighted").await
}

#[tokio::test]
async fn capacity_follows_the_clusters_sizes() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let c = ctx().await?;
    // Every agent reported its nodes: 3 nodes of 32, 16 and 8 cores.
    let members: Api<MemberCluster> = Api::all(c.host.clone());
    for (m, cores) in [("cluster1", 32), ("cluster2", 16), ("cluster3", 8)] {
        let reported = |mc: Option<&MemberCluster>| {
            mc.and_then(|mc| mc.status.as_ref())
                .is_some_and(|s| s.capacity.is_some())
        };
        let what = format!("{m}'s capacity in status");
        let mc = await_object(&members, m, TIMEOUT, &what, reported).await?;
        let capacity = mc
            .and_then(|mc| mc.status?.capacity)
            .context("no capacity")?;
        ensure!(capacity.nodes == 3, "{m}: {capacity:?}");
        ensure!(
            capacity.allocatable.cpu_millis == 3 * cores * 1000,
            "{m}: allocatable {:?}",
            capacity.allocatable
        );
    }
    // Four cores a replica: room for about 24, 12 and 6 replicas.
    let spec =
        json!({"image": "nginx:1.27", "replicas": 1, "resources": {"requests": {"cpu": "4"}}});
    let placement = json!({"clusterSelector": {}, "replicaScheduling": {"mode": "Capacity", "totalReplicas": 12}});
    c.apply("sched-capacity", placement, spec).await?;
    let division = wait_for(TIMEOUT, "sched-capacity divided", || async {
        let have = c.replicas_in_members("sched-capacity").await?;
        Ok((have.values().sum::<i32>() == 12).then_some(have))
    })
    .await?;
    let (one, two, three) = (
        division["cluster1"],
        division["cluster2"],
        division["cluster3"],
    );
    ensure!(
        one > two && two > three && three > 0,
        "the division {division:?} does not follow sizes 32:16:8"
    );
    c.delete("sched-capacity").await
}

#[tokio::test]
async fn spread_over_two_regions_and_cordon_keep_their_promises() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let c = ctx().await?;
    // At most two clusters, in at least two regions: cluster2 (us) and one of eu, which
    // by weight (2) is cluster1.
    let mut placement = weighted(6);
    placement["spread"] = json!({
        "maxClusters": 2, "minGroups": 2, "spreadByLabel": federation::REGION,
    });
    c.apply("sched-spread", placement, nginx()).await?;
    c.wait_division("sched-spread", [4, 2, 0]).await?;
    c.delete("sched-spread").await?;

    // Cordon cluster1: a new app gets nothing there; uncordon: it gets its share.
    let hub = Federation::load(&c.env)?.hub_cli(&c.env)?;
    hub.run(&["cordon", "cluster1"])?;
    let cordoned = async {
        let is_cordoned = |mc: Option<&MemberCluster>| mc.is_some_and(|mc| mc.spec.unschedulable);
        let (members, what) = (Api::all(c.host.clone()), "cluster1 cordoned in the hub");
        await_object(&members, "cluster1", TIMEOUT, what, is_cordoned).await?;
        c.apply("sched-cordon", weighted(4), nginx()).await?;
        c.wait_division("sched-cordon", [0, 2, 2]).await?;
        anyhow::Ok(())
    }
    .await;
    hub.run(&["uncordon", "cluster1"])?;
    cordoned?;
    // Uncordoned, the weights apply again: 2:1:1 of 4.
    c.wait_division("sched-cordon", [2, 1, 1]).await?;
    c.delete("sched-cordon").await
}

/// Failover: cluster3's agent dies; past the grace period its share moves to the others
/// while its own copy is left untouched; when it comes back it gets its share again, and
/// the surplus goes only once its replicas are Ready. The ready replicas across the
/// members never dip below the total minus cluster3's share.
#[tokio::test]
async fn failover_moves_a_lost_clusters_share_without_a_dip() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let c = ctx().await?;
    let f = federation::up(&c.env).await?;
    let name = "sched-failover";
    let mut placement = weighted(12);
    placement["failover"] = json!({"gracePeriodSeconds": 5, "onRecovery": "Rebalance"});
    c.apply(name, placement, nginx()).await?;
    c.wait_division(name, [6, 3, 3]).await?;
    wait_for(TIMEOUT, "12 replicas ready in the members", || async {
        Ok((ready_in_members(&c.members, name).await? == 12).then_some(()))
    })
    .await?;
    let c3 = Api::<MyApp>::namespaced(c.members["cluster3"].clone(), "default");
    let before = c3.get(name).await?;
    let log = DeletionLog::start(&c.env).await?;

    // Sample the ready replicas in the members throughout.
    let lowest = Arc::new(AtomicI32::new(i32::MAX));
    let sampler = {
        let (lowest, members) = (lowest.clone(), c.members.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(n) = ready_in_members(&members, name).await {
                    lowest.fetch_min(n, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };

    let agent = agent_name("cluster3");
    let started = Instant::now();
    let outcome = async {
        faults::sigkill(&c.env, &f, &agent)?;
        wait_member_ready(
            &c.host,
            "cluster3",
            false,
            federation::HEARTBEAT_GRACE + Duration::from_secs(15),
        )
        .await?;
        // 12 over cluster1 and cluster2 at 2:1; cluster3's copy stays as it was.
        let moved = wait_for(TIMEOUT, "cluster3's share moved", || async {
            let have = c.replicas_in_members(name).await?;
            Ok((have["cluster1"] == 8 && have["cluster2"] == 4).then_some(have))
        })
        .await?;
        let kept = c3.get(name).await?;
        ensure!(
            kept.metadata.generation == before.metadata.generation && moved["cluster3"] == 3,
            "cluster3's MyApp was touched while it was unreachable: {moved:?}"
        );
        // Status follows the pushes (its writes are coalesced).
        let failed_over = |a: Option<&FederatedMyApp>| {
            let reason = a.and_then(|a| a.status.as_ref()).and_then(|s| {
                let c3 = s.clusters.iter().find(|c| c.name == "cluster3")?;
                c3.scheduling_reason
            });
            reason == Some(flotilla_crds::federated::SchedulingReason::FailedOver)
        };
        let what = "cluster3 FailedOver in status";
        await_object(&c.fedapps(), name, TIMEOUT, what, failed_over).await?;
        // Back: Rebalance gives cluster3 its share again, and 6/3/3 once it is Ready.
        faults::start(&c.env, &f, &agent).await?;
        wait_member_ready(&c.host, "cluster3", true, TIMEOUT).await?;
        c.wait_division(name, [6, 3, 3]).await?;
        wait_for(TIMEOUT, "12 replicas ready again", || async {
            Ok((ready_in_members(&c.members, name).await? == 12).then_some(()))
        })
        .await?;
        anyhow::Ok(())
    }
    .await;
    sampler.abort();
    // Whatever happened, the agent runs again for the other tests.
    let restored = federation::up(&c.env).await;
    outcome?;
    restored?;
    let lowest = lowest.load(Ordering::Relaxed);
    println!(
        "failover: lowest ready replicas {lowest} of 12 (bound 9), round trip {:.1}s",
        started.elapsed().as_secs_f64()
    );
    ensure!(
        lowest >= 9,
        "ready replicas dipped to {lowest}, below 12 - cluster3's 3"
    );
    converge::wait_converged(&c.env, TIMEOUT).await?;
    log.assert_clean(&BTreeSet::new())?;
    c.delete(name).await
}
