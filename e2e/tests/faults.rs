//! Fault injection on the real environment. Each test disturbs the hub, an agent, a
//! member's apiserver or the link between them, then proves two things: the environment
//! converges (every member runs exactly what the host's desired state renders to) and
//! nothing managed was deleted that the desired state did not ask for. Each prints
//! `fault <name>: converged pairs N, unwanted deletions N, converged in X.Xs`.
//!
//! The tests take the whole environment, so they run one at a time (a lock), and each
//! puts back what it changed (the hub and agents as `up` launched them) even when it fails.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use flotilla_crds::federated::HUB_FINALIZER;
use flotilla_crds::{FederatedMyApp, MemberCluster};
use flotilla_e2e::converge::{self, managed_myapps};
use flotilla_e2e::deletions::DeletionLog;
use flotilla_e2e::faults;
use flotilla_lab::federation::{self, Federation, HUB, agent_name, wait_member_ready};
use flotilla_lab::process::{ProcessRecord, Signal};
use flotilla_lab::support::{http_get, sample};
use flotilla_lab::{Env, await_object, process, wait_for};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(60);
/// Longer than an agent's longest reconnect delay (30 s, plus jitter).
const RECONNECT: Duration = Duration::from_secs(75);
/// Apps per test, placed on both members.
const APPS: usize = 10;
/// Updates in a burst, spread over the apps.
const BURST: usize = 100;

/// One fault at a time: they all take the whole environment.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Ctx {
    env: Env,
    f: Federation,
    host: Client,
    prefix: String,
}

impl Ctx {
    /// The environment with every component running, and this test's apps converged.
    async fn start(prefix: &str) -> Result<Ctx> {
        let env = Env::load_ready().await?;
        // Puts back any component an earlier test left stopped.
        let f = federation::up(&env).await?;
        let host = env.client(env.host()).await?;
        let ctx = Ctx {
            env,
            f,
            host,
            prefix: prefix.into(),
        };
        for i in 0..APPS {
            ctx.apply(i, 1).await?;
        }
        converge::wait_converged(&ctx.env, CONVERGE)
            .await
            .context("before the fault")?;
        Ok(ctx)
    }

    fn fedapps(&self) -> Api<FederatedMyApp> {
        Api::namespaced(self.host.clone(), "default")
    }

    fn name(&self, i: usize) -> String {
        format!("{}-{i}", self.prefix)
    }

    /// Server-side applies app `i` on both members with `replicas`.
    async fn apply(&self, i: usize, replicas: usize) -> Result<()> {
        let name = self.name(i);
        let app = json!({
            "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"placement": {"clusters": [{"name": "cluster1"}, {"name": "cluster2"}]},
                     "template": {"spec": {"replicas": replicas, "image": "nginx:1.27"}}},
        });
        self.fedapps()
            .patch(
                &name,
                &PatchParams::apply("e2e-faults").force(),
                &Patch::Apply(&app),
            )
            .await
            .with_context(|| format!("applying FederatedMyApp default/{name}"))?;
        Ok(())
    }

    /// `count` updates, round robin over the apps, each a new replicas value; calls
    /// `fault` once after `fault_at` of them.
    async fn burst<F, Fut>(&self, count: usize, fault_at: usize, fault: F) -> Result<()>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<()>>,
    {
        let mut fault = Some(fault);
        for n in 0..count {
            if n == fault_at
                && let Some(f) = fault.take()
            {
                f().await?;
            }
            self.apply(n % APPS, 2 + (n / APPS) % 8).await?;
        }
        Ok(())
    }

    /// Deletes this test's apps (after the checks: their deletions are wanted).
    async fn cleanup(&self) {
        let api = self.fedapps();
        for i in 0..APPS {
            let _ = api.delete(&self.name(i), &DeleteParams::default()).await;
        }
        let prefix = format!("{}-", self.prefix);
        let gone = wait_for(CONVERGE, "the test's FederatedMyApps deleted", || async {
            let left = api.list(&ListParams::default()).await?;
            Ok((!left.items.iter().any(|a| a.name_any().starts_with(&prefix))).then_some(()))
        })
        .await;
        if let Err(e) = gone {
            eprintln!("cleanup of {}: {e:#}", self.prefix);
        }
    }
}

/// The end of every fault: converged, nothing unwanted deleted, one summary line.
async fn verdict(ctx: &Ctx, fault: &str, log: &DeletionLog, since: Instant) -> Result<()> {
    let converged = converge::wait_converged(&ctx.env, CONVERGE).await;
    let unwanted = log.unwanted(&BTreeSet::new());
    let pairs = match &converged {
        Ok((r, _)) => r.converged.to_string(),
        Err(_) => "none (not converged)".into(),
    };
    println!(
        "fault {fault}: converged pairs {pairs}, unwanted deletions {}, converged in {:.1}s",
        unwanted.len(),
        since.elapsed().as_secs_f64()
    );
    let converged = converged.map(drop);
    let clean = log.assert_clean(&BTreeSet::new());
    match (converged, clean) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(a), Ok(())) | (Ok(()), Err(a)) => Err(a),
        (Err(a), Err(b)) => Err(a.context(format!("{b:#}"))),
    }
}

/// Runs `body`, then `restore` whatever happened, then `cleanup`; fails with the body's error.
async fn run<B, Fut>(prefix: &str, body: B) -> Result<()>
where
    B: FnOnce(Ctx) -> Fut,
    Fut: std::future::Future<Output = (Ctx, Result<()>)>,
{
    let _guard = ONE_AT_A_TIME.lock().await;
    let ctx = Ctx::start(prefix).await?;
    let (ctx, result) = body(ctx).await;
    // Put back every component as `up` launched it, then remove the test's apps.
    let restored = restore(&ctx).await;
    ctx.cleanup().await;
    result.and(restored)
}

/// Every agent and the hub as `up` launched them, and every member Ready.
async fn restore(ctx: &Ctx) -> Result<()> {
    federation::up(&ctx.env).await.map(drop)
}

fn hub_syncs(metrics: &str, cluster: &str) -> f64 {
    sample(
        metrics,
        &format!(
            "flotilla_hub_messages_sent_total{{cluster=\"{cluster}\",kind=\"sync_complete\"}}"
        ),
    )
}

#[tokio::test]
async fn agent_sigkilled_mid_burst() -> Result<()> {
    run("fault-agent-kill", |ctx| async move {
        let r = async {
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            let agent = agent_name("cluster1");
            ctx.burst(BURST, BURST / 3, || async {
                faults::sigkill(&ctx.env, &ctx.f, &agent).map(drop)
            })
            .await?;
            faults::start(&ctx.env, &ctx.f, &agent).await?;
            verdict(&ctx, "agent-sigkill-mid-burst", &log, start).await
        }
        .await;
        (ctx, r)
    })
    .await
}

#[tokio::test]
async fn hub_sigkilled_mid_burst() -> Result<()> {
    run("fault-hub-kill", |ctx| async move {
        let r = async {
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            ctx.burst(BURST, BURST / 3, || async {
                faults::sigkill(&ctx.env, &ctx.f, HUB).map(drop)
            })
            .await?;
            faults::start(&ctx.env, &ctx.f, HUB).await?;
            verdict(&ctx, "hub-sigkill-mid-burst", &log, start).await
        }
        .await;
        (ctx, r)
    })
    .await
}

#[tokio::test]
async fn graceful_hub_restart_moves_every_agent_to_the_new_process() -> Result<()> {
    run("fault-hub-term", |ctx| async move {
        let r = async {
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            let (old, _new) = faults::replace_hub(&ctx.env, &ctx.f).await?;
            // Counters start at zero in the new process: a SyncComplete sent to a member
            // means that member's agent has a session with it.
            let members = ctx.env.members();
            let moved = wait_for(
                Duration::from_secs(10),
                "every agent in session with the new hub",
                || async {
                    let m = ctx.f.metrics(HUB).await?;
                    Ok(members
                        .iter()
                        .all(|c| hub_syncs(&m, c) >= 1.0)
                        .then_some(()))
                },
            )
            .await;
            let old_gone = old.wait_gone(Duration::from_secs(10));
            // Propagation through the new hub.
            ctx.burst(APPS, usize::MAX, || async { Ok(()) }).await?;
            let verdict = verdict(&ctx, "graceful-hub-restart", &log, start).await;
            // Only now may the old process be stopped for good (cleanup, not the test).
            if !old_gone {
                let _ = old.stop(Duration::from_secs(5));
            }
            process::forget(&ctx.env.dir, &old.name)?;
            moved.context("after SIGTERM to the old hub and a new hub at once")?;
            ensure!(
                old_gone,
                "the old hub (PID {}) still ran 10s after SIGTERM",
                old.pid
            );
            verdict
        }
        .await;
        (ctx, r)
    })
    .await
}

#[tokio::test]
async fn a_member_apiserver_stopped_for_30s_recovers() -> Result<()> {
    run("fault-apiserver", |ctx| async move {
        let mut env = ctx.env.clone();
        let r = async {
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            let clients: Vec<faults::Component> = ["kube-controller-manager", "kube-scheduler"]
                .into_iter()
                .map(|c| faults::capture(&env, "cluster2", c).map(|(_, c)| c))
                .collect::<Result<_>>()?;
            let stopped = faults::stop_component(&env, "cluster2", "kube-apiserver")?;
            // The desired state moves on while cluster2 cannot apply anything.
            let changed = ctx.burst(BURST / 5, usize::MAX, || async { Ok(()) }).await;
            tokio::time::sleep(Duration::from_secs(30).saturating_sub(start.elapsed())).await;
            faults::start_component(&mut env, &stopped)?;
            // Those that lost their leader lease exited; a kubelet would start them again.
            let revived = faults::revive(&mut env, &clients)?;
            eprintln!("started again after the outage: {revived:?}");
            changed?;
            let verdict = verdict(&ctx, "member-apiserver-down-30s", &log, start).await;
            faults::revive(&mut env, &clients)?;
            verdict
        }
        .await;
        (ctx, r)
    })
    .await
}

#[tokio::test]
async fn an_agent_cut_off_past_the_heartbeat_grace_keeps_its_apps() -> Result<()> {
    run("fault-blackhole", |ctx| async move {
        let r = async {
            let proxy = faults::agent_through_proxy(&ctx.env, &ctx.f, "cluster1").await?;
            wait_member_ready(&ctx.host, "cluster1", true, Duration::from_secs(30)).await?;
            converge::wait_converged(&ctx.env, CONVERGE).await?;
            let c1 = ctx.env.client("cluster1").await?;
            // What the hub writes of them: readiness aside, which the member's own
            // operator keeps moving while its agent is cut off.
            let written = |mut apps: std::collections::BTreeMap<_, converge::Have>| {
                apps.values_mut().for_each(|h| h.ready = false);
                apps
            };
            let before = written(managed_myapps(&c1).await?);
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            proxy.blackhole();
            wait_member_ready(
                &ctx.host,
                "cluster1",
                false,
                federation::HEARTBEAT_GRACE + Duration::from_secs(15),
            )
            .await?;
            // cluster1 keeps exactly what it ran; cluster2 still gets updates.
            ensure!(
                written(managed_myapps(&c1).await?) == before,
                "cluster1's MyApps changed while it was cut off"
            );
            ctx.apply(0, 9).await?;
            let c2 = Api::<flotilla_crds::MyApp>::namespaced(
                ctx.env.client("cluster2").await?,
                "default",
            );
            let name = ctx.name(0);
            let updated =
                |a: Option<&flotilla_crds::MyApp>| a.is_some_and(|a| a.spec.replicas == Some(9));
            let what = "cluster2 to get the update";
            await_object(&c2, &name, Duration::from_secs(30), what, updated).await?;
            wait_member_ready(&ctx.host, "cluster2", true, Duration::from_secs(1)).await?;
            proxy.heal();
            wait_member_ready(&ctx.host, "cluster1", true, Duration::from_secs(60)).await?;
            verdict(&ctx, "agent-blackholed-past-grace", &log, start).await
        }
        .await;
        // `up` would see the proxied agent running and keep it: put it back by hand.
        let direct = faults::agent_direct(&ctx.env, &ctx.f, "cluster1").await;
        (ctx, r.and(direct))
    })
    .await
}

#[tokio::test]
async fn a_member_cluster_deleted_and_recreated_with_its_token_deletes_nothing() -> Result<()> {
    run("fault-recreate", |ctx| async move {
        let r = async {
            let members: Api<MemberCluster> = Api::all(ctx.host.clone());
            let mc = members.get("cluster1").await?;
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            members.delete("cluster1", &DeleteParams::default()).await?;
            let gone = |mc: Option<&MemberCluster>| mc.is_none();
            let what = "MemberCluster cluster1 gone";
            await_object(&members, "cluster1", Duration::from_secs(30), what, gone).await?;
            // Re-created as GitOps would: same labels, same token hash.
            let again: MemberCluster = serde_json::from_value(json!({
                "apiVersion": "core.kubefed.io/v1beta1", "kind": "MemberCluster",
                "metadata": {"name": "cluster1", "labels": mc.labels()},
                "spec": mc.spec,
            }))?;
            members.create(&PostParams::default(), &again).await?;
            // The agent connects right after the re-creation (its session was dropped, or
            // it restarted): its SyncComplete must reflect the apps placed on cluster1.
            let agent = agent_name("cluster1");
            faults::sigkill(&ctx.env, &ctx.f, &agent)?;
            faults::start(&ctx.env, &ctx.f, &agent).await?;
            wait_member_ready(&ctx.host, "cluster1", true, Duration::from_secs(60)).await?;
            verdict(&ctx, "membercluster-recreated-same-token", &log, start).await
        }
        .await;
        (ctx, r)
    })
    .await
}

#[tokio::test]
async fn a_second_agent_with_the_same_identity_changes_nothing() -> Result<()> {
    run("fault-twin", |ctx| async move {
        let r = async {
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            let (twin, launch) = faults::start_twin(&ctx.env, &ctx.f, "cluster1").await?;
            // Both run while the desired state changes.
            let burst = ctx.burst(BURST / 5, usize::MAX, || async { Ok(()) }).await;
            tokio::time::sleep(Duration::from_secs(5)).await;
            let verdict = verdict(&ctx, "second-agent-same-identity", &log, start).await;
            // The first agent holds the Lease: the twin waited as a standby throughout.
            let standby = match http_get(&launch.http, "/readyz").await {
                Ok((200, _)) => Err(anyhow::anyhow!(
                    "the twin agent is ready: two agents act for cluster1"
                )),
                _ => Ok(()),
            };
            let twin_ran = twin.alive();
            twin.stop(Duration::from_secs(10))?;
            process::forget(&ctx.env.dir, &twin.name)?;
            burst?;
            standby?;
            if !twin_ran {
                // Not a failure by itself (a refused twin may exit), but say so.
                eprintln!("the twin agent exited by itself; its log: {:?}", twin.log);
            }
            verdict?;
            // The original agent still serves cluster1.
            wait_member_ready(&ctx.host, "cluster1", true, Duration::from_secs(30)).await?;
            ctx.apply(1, 7).await?;
            converge::wait_converged(&ctx.env, CONVERGE)
                .await
                .map(drop)
                .context("after the twin stopped")
        }
        .await;
        (ctx, r)
    })
    .await
}

/// The hub's metrics must be readable for the graceful-restart check to mean anything.
#[tokio::test]
async fn the_hub_counts_sync_completes_per_member() -> Result<()> {
    let _guard = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let f = federation::up(&env).await?;
    // An agent that lost its hub in an earlier test may still be in its reconnect
    // backoff: wait for its session rather than race it.
    let deadline = Instant::now() + RECONNECT;
    loop {
        let m = f.metrics(HUB).await?;
        let missing: Vec<&str> = (env.members().into_iter())
            .filter(|c| hub_syncs(&m, c) < 1.0)
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the hub reports no SyncComplete sent to {missing:?}:\n{m}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A host that lost its FederatedMyApps (a bad restore, a wrong kubeconfig) must not wipe
/// a member: MyApps the member runs as Flotilla's but the hub no longer wants, more than
/// half of what the agent manages, are held back until a user confirms; then they go.
#[tokio::test]
async fn a_mass_collection_waits_for_a_confirmation() -> Result<()> {
    run("fault-breaker", |ctx| async move {
        let r = async {
            let c2 = ctx.env.client("cluster2").await?;
            let myapps: Api<flotilla_crds::MyApp> = Api::namespaced(c2.clone(), "default");
            let managed = managed_myapps(&c2).await?.len();
            // Left behind as Flotilla's: more than the apps it should keep.
            let leftovers: Vec<String> = (0..managed + 2)
                .map(|i| format!("fault-breaker-leftover-{i}"))
                .collect();
            for name in &leftovers {
                let app = json!({
                    "apiVersion": "app.example.com/v1", "kind": "MyApp",
                    "metadata": {"name": name, "namespace": "default",
                                 "labels": {flotilla_crds::MANAGED_BY_LABEL: flotilla_crds::MANAGED_BY_VALUE}},
                    "spec": {"replicas": 1, "image": "nginx:1.27"},
                });
                myapps
                    .patch(name, &PatchParams::apply("e2e-leftover"), &Patch::Apply(&app))
                    .await
                    .with_context(|| format!("creating leftover MyApp {name} in cluster2"))?;
            }
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            // The agent's next session lists them; the hub wants none of them.
            let agent = agent_name("cluster2");
            faults::sigkill(&ctx.env, &ctx.f, &agent)?;
            faults::start(&ctx.env, &ctx.f, &agent).await?;
            let members: Api<MemberCluster> = Api::all(ctx.host.clone());
            let count = leftovers.len();
            let blocked_of = |mc: &MemberCluster| {
                let conditions = &mc.status.as_ref()?.conditions;
                conditions
                    .iter()
                    .find(|c| c.type_ == "CollectionBlocked" && c.status == "True")
                    .cloned()
            };
            let is_blocked = |mc: Option<&MemberCluster>| mc.and_then(blocked_of).is_some();
            let what = "cluster2 CollectionBlocked";
            let mc = await_object(&members, "cluster2", CONVERGE, what, is_blocked).await?;
            let blocked = mc.as_ref().and_then(blocked_of).context("no MemberCluster")?;
            ensure!(
                blocked.message.contains(&format!("deleting {count} of"))
                    && blocked.message.contains("flotilla.io/confirm-collection"),
                "the condition does not say what to confirm: {}",
                blocked.message
            );
            flotilla_lab::wait_event(&ctx.host, "default", "cluster2", "CollectionBlocked", CONVERGE)
                .await?;
            // Held back: nothing deleted while unconfirmed.
            tokio::time::sleep(Duration::from_secs(5)).await;
            for name in &leftovers {
                ensure!(
                    myapps.get_opt(name).await?.is_some(),
                    "{name} was collected without a confirmation"
                );
            }
            ensure!(
                log.unwanted(&BTreeSet::new()).is_empty(),
                "deleted while held back: {:?}",
                log.deletions()
            );
            // Another count confirms nothing: removed unused, the leftovers stay.
            let wrong = json!({"metadata": {"annotations": {"flotilla.io/confirm-collection": (count + 1).to_string()}}});
            members
                .patch("cluster2", &PatchParams::default(), &Patch::Merge(&wrong))
                .await?;
            let removed = |mc: Option<&MemberCluster>| {
                mc.is_some_and(|mc| !mc.annotations().contains_key("flotilla.io/confirm-collection"))
            };
            await_object(&members, "cluster2", CONVERGE, "a wrong count removed", removed).await?;
            tokio::time::sleep(Duration::from_secs(2)).await;
            for name in &leftovers {
                ensure!(myapps.get_opt(name).await?.is_some(), "{name} collected on a wrong count");
            }
            // Confirmed: the hub passes it on and the leftovers go, and only they.
            let confirm = json!({"metadata": {"annotations": {"flotilla.io/confirm-collection": count.to_string()}}});
            members
                .patch("cluster2", &PatchParams::default(), &Patch::Merge(&confirm))
                .await?;
            wait_for(CONVERGE, "the leftovers collected", || async {
                for name in &leftovers {
                    if myapps.get_opt(name).await?.is_some() {
                        return Ok(None);
                    }
                }
                Ok(Some(()))
            })
            .await?;
            let consumed = |mc: Option<&MemberCluster>| {
                mc.is_some_and(|mc| {
                    let cleared = !mc.annotations().contains_key("flotilla.io/confirm-collection");
                    cleared && blocked_of(mc).is_none()
                })
            };
            let what = "the confirmation consumed";
            await_object(&members, "cluster2", CONVERGE, what, consumed).await?;
            let expected: BTreeSet<(String, String)> = leftovers
                .iter()
                .map(|n| ("cluster2".to_owned(), format!("default/{n}")))
                .collect();
            let converged = converge::wait_converged(&ctx.env, CONVERGE).await;
            let unwanted = log.unwanted(&expected);
            println!(
                "fault mass-collection-held-back: converged pairs {}, unwanted deletions {}, converged in {:.1}s",
                converged.as_ref().map_or("none (not converged)".into(), |(r, _)| r.converged.to_string()),
                unwanted.len(),
                start.elapsed().as_secs_f64()
            );
            converged?;
            log.assert_clean(&expected)
        }
        .await;
        (ctx, r)
    })
    .await
}

/// Marks the test's first half of apps `kubefed.io/orphan`; returns their names.
async fn orphaned_half(ctx: &Ctx) -> Result<Vec<String>> {
    let released: Vec<String> = (0..APPS / 2).map(|i| ctx.name(i)).collect();
    let orphan = json!({"metadata": {"annotations": {"kubefed.io/orphan": "true"}}});
    for name in &released {
        ctx.fedapps()
            .patch(name, &PatchParams::default(), &Patch::Merge(&orphan))
            .await?;
    }
    Ok(released)
}

/// Waits until the FederatedMyApps `names` are gone from the host.
async fn fedapps_gone(ctx: &Ctx, names: &[String]) -> Result<()> {
    let api = ctx.fedapps();
    wait_for(CONVERGE, "the released FederatedMyApps gone", || async {
        for name in names {
            if api.get_opt(name).await?.is_some() {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .await
}

/// The released MyApps `names` that are not as a release leaves them in both members
/// (there, no longer managed), in words; then removes them all by hand (released
/// copies are no longer Flotilla's).
async fn check_released_and_remove(ctx: &Ctx, names: &[String]) -> Result<Vec<String>> {
    let mut unreleased = Vec::new();
    for member in ["cluster1", "cluster2"] {
        let myapps: Api<flotilla_crds::MyApp> =
            Api::namespaced(ctx.env.client(member).await?, "default");
        for name in names {
            match myapps.get_opt(name).await? {
                None => unreleased.push(format!("{member}: {name} deleted")),
                Some(a) if a.labels().contains_key(flotilla_crds::MANAGED_BY_LABEL) => {
                    unreleased.push(format!("{member}: {name} still managed"))
                }
                Some(_) => {}
            }
        }
    }
    for member in ["cluster1", "cluster2"] {
        let myapps: Api<flotilla_crds::MyApp> =
            Api::namespaced(ctx.env.client(member).await?, "default");
        for name in names {
            let _ = myapps.delete(name, &DeleteParams::default()).await;
        }
    }
    Ok(unreleased)
}

/// Releasing with `kubefed.io/orphan` while the hub is SIGKILLed mid-way: every released
/// MyApp stays in both members (no longer managed), nothing is deleted, the
/// FederatedMyApps go once the new hub has heard every release.
#[tokio::test]
async fn hub_sigkilled_while_an_orphaning_delete_is_in_flight() -> Result<()> {
    run("fault-orphan-kill", |ctx| async move {
        let r = async {
            let released = orphaned_half(&ctx).await?;
            let api = ctx.fedapps();
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            for (i, name) in released.iter().enumerate() {
                api.delete(name, &DeleteParams::default()).await?;
                if i == released.len() / 2 {
                    faults::sigkill(&ctx.env, &ctx.f, HUB)?;
                }
            }
            faults::start(&ctx.env, &ctx.f, HUB).await?;
            fedapps_gone(&ctx, &released).await?;
            let verdict = verdict(&ctx, "hub-sigkill-during-orphaning-delete", &log, start).await;
            let unreleased = check_released_and_remove(&ctx, &released).await?;
            ensure!(unreleased.is_empty(), "not released: {unreleased:?}");
            verdict
        }
        .await;
        (ctx, r)
    })
    .await
}

/// Waits until every one of the test's apps carries the hub's finalizer.
async fn every_app_held(ctx: &Ctx) -> Result<()> {
    let api = ctx.fedapps();
    let prefix = format!("{}-", ctx.prefix);
    let held = |a: &FederatedMyApp| a.finalizers().iter().any(|f| f == HUB_FINALIZER);
    let what = "the hub's finalizer back on every app";
    wait_for(CONVERGE, what, || async {
        let apps = api.list(&ListParams::default()).await?;
        let mut mine = apps
            .items
            .iter()
            .filter(|a| a.name_any().starts_with(&prefix));
        Ok(mine.all(held).then_some(()))
    })
    .await
}

/// The hub's finalizer stripped by hand from live apps while the hub is down, and one of
/// them changed meanwhile: the restarted hub holds every copy (an app it does not hold
/// is sent nowhere and taken from nowhere), puts its finalizer back, then rolls the
/// change out. Nothing is deleted.
#[tokio::test]
async fn finalizers_stripped_while_the_hub_is_down_delete_nothing() -> Result<()> {
    run("fault-unheld", |ctx| async move {
        let r = async {
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            faults::sigkill(&ctx.env, &ctx.f, HUB)?;
            let strip = json!({"metadata": {"finalizers": null}});
            for i in 0..APPS {
                let name = ctx.name(i);
                ctx.fedapps()
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&strip))
                    .await
                    .with_context(|| format!("stripping the finalizers of default/{name}"))?;
            }
            ctx.apply(0, 3).await?;
            faults::start(&ctx.env, &ctx.f, HUB).await?;
            every_app_held(&ctx).await?;
            let fault = "finalizers-stripped-while-the-hub-is-down";
            verdict(&ctx, fault, &log, start).await
        }
        .await;
        (ctx, r)
    })
    .await
}

/// Releasing with `kubefed.io/orphan` around a graceful hub restart: some FederatedMyApps
/// deleted just before SIGTERM reaches the old hub, the rest while every agent moves to
/// the new one. Every released MyApp stays in both members, no longer managed, and
/// nothing is deleted. (Once, a suite that deleted an orphaned app right after a hub
/// restart found it still managed on a member after its FederatedMyApp was gone.)
#[tokio::test]
async fn an_orphaning_delete_across_a_graceful_hub_restart_releases_everywhere() -> Result<()> {
    run("fault-orphan-term", |ctx| async move {
        let r = async {
            let released = orphaned_half(&ctx).await?;
            let api = ctx.fedapps();
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            let (before, after) = released.split_at(released.len() / 2);
            for name in before {
                api.delete(name, &DeleteParams::default()).await?;
            }
            let (old, _new) = faults::replace_hub(&ctx.env, &ctx.f).await?;
            for name in after {
                api.delete(name, &DeleteParams::default()).await?;
            }
            let gone = fedapps_gone(&ctx, &released).await;
            if !old.wait_gone(Duration::from_secs(10)) {
                let _ = old.stop(Duration::from_secs(5));
            }
            process::forget(&ctx.env.dir, &old.name)?;
            gone?;
            let verdict = verdict(
                &ctx,
                "orphaning-delete-across-graceful-restart",
                &log,
                start,
            )
            .await;
            let unreleased = check_released_and_remove(&ctx, &released).await?;
            ensure!(unreleased.is_empty(), "not released: {unreleased:?}");
            verdict
        }
        .await;
        (ctx, r)
    })
    .await
}

/// An app taken off a cluster while that cluster's agent is away, and the hub restarted
/// before the agent returns: the new hub never knew the app was there, so no explicit
/// Delete is owed; the agent's next session lists it, the hub's desired set leaves it out,
/// and the collection after SyncComplete removes it (one of the session's apps, within the
/// breaker's share). It is not left behind, and nothing else goes.
#[tokio::test]
async fn an_app_taken_off_an_absent_cluster_across_a_hub_restart_is_collected() -> Result<()> {
    run("fault-shrink-restart", |ctx| async move {
        let r = async {
            let agent = agent_name("cluster2");
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            ctx.f.stop(&ctx.env, &agent)?;
            let name = ctx.name(0);
            let only_cluster1 = json!({
                "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"placement": {"clusters": [{"name": "cluster1"}]},
                         "template": {"spec": {"replicas": 1, "image": "nginx:1.27"}}},
            });
            ctx.fedapps()
                .patch(
                    &name,
                    &PatchParams::apply("e2e-faults").force(),
                    &Patch::Apply(&only_cluster1),
                )
                .await?;
            // The hub sees the new generation (and queues the Delete for cluster2) ...
            wait_for(CONVERGE, "the hub observing the new placement", || async {
                let app = ctx.fedapps().get(&name).await?;
                let observed = app.status.as_ref().and_then(|s| s.observed_generation);
                Ok((observed.is_some() && observed == app.metadata.generation).then_some(()))
            })
            .await?;
            // ... and forgets it: a new hub has nothing queued for cluster2.
            faults::sigkill(&ctx.env, &ctx.f, HUB)?;
            faults::start(&ctx.env, &ctx.f, HUB).await?;
            faults::start(&ctx.env, &ctx.f, &agent).await?;
            let c2: Api<flotilla_crds::MyApp> =
                Api::namespaced(ctx.env.client("cluster2").await?, "default");
            wait_for(CONVERGE, "the app collected from cluster2", || async {
                Ok(c2.get_opt(&name).await?.is_none().then_some(()))
            })
            .await?;
            converge::wait_converged(&ctx.env, CONVERGE).await?;
            let expected = BTreeSet::from([("cluster2".to_string(), format!("default/{name}"))]);
            println!(
                "fault hub-restart-after-shrink: collected in {:.1}s, unwanted deletions {}",
                start.elapsed().as_secs_f64(),
                log.unwanted(&expected).len()
            );
            log.assert_clean(&expected)
        }
        .await;
        (ctx, r)
    })
    .await
}

/// `join --rotate` for a running member: the agent holding the old token is cut off,
/// reads the new one from its token file and reconnects on its own; labels, placement
/// and workloads stay as they were.
#[tokio::test]
async fn a_rotated_token_changes_nothing_but_the_credential() -> Result<()> {
    run("fault-rotate", |ctx| async move {
        let r = async {
            let members: Api<MemberCluster> = Api::all(ctx.host.clone());
            let labels_before = members.get("cluster1").await?.labels().clone();
            let syncs = hub_syncs(&ctx.f.metrics(HUB).await?, "cluster1");
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            let token = &ctx.f.tokens["cluster1"];
            ctx.f.hub_cli(&ctx.env)?.run(&[
                "join",
                "cluster1",
                "--rotate",
                "--token-file",
                &token.to_string_lossy(),
            ])?;
            wait_for(
                CONVERGE,
                "cluster1's agent back with the new token",
                || async {
                    let now = hub_syncs(&ctx.f.metrics(HUB).await?, "cluster1");
                    Ok((now > syncs).then_some(()))
                },
            )
            .await?;
            let labels_after = members.get("cluster1").await?.labels().clone();
            ensure!(
                labels_after == labels_before,
                "rotation changed labels: {labels_before:?} -> {labels_after:?}"
            );
            ctx.apply(0, 6).await?;
            verdict(&ctx, "token-rotated", &log, start).await
        }
        .await;
        (ctx, r)
    })
    .await
}

/// Two hubs, elected, behind what stands in for their Service (new connections go to the
/// Lease holder): the leader is SIGKILLed, every app changes during the failover, the
/// standby leads within the lease duration and a retry period (15 s + 2 s, and 1 s for
/// the calls), the agents follow it, everything converges and nothing is deleted.
#[tokio::test]
async fn the_standby_hub_takes_over_when_the_leader_is_sigkilled() -> Result<()> {
    run("fault-hub-failover", |ctx| async move {
        let members: Vec<String> = ctx.env.members().iter().map(|m| m.to_string()).collect();
        let mut standby = None;
        let r = async {
            let (hub_b, launch) = faults::start_standby_hub(&ctx.env, &ctx.f).await?;
            standby = Some(hub_b);
            let grpc = |l: &federation::Launch| {
                l.arg("grpc-addr").map(str::to_owned).context("--grpc-addr")
            };
            let service = faults::LeaderService::start(
                &ctx.env,
                vec![
                    (HUB.into(), grpc(ctx.f.launch(HUB)?)?),
                    (faults::STANDBY_HUB.into(), grpc(&launch)?),
                ],
            )
            .await?;
            ensure!(
                faults::hub_leader(&ctx.host).await?.as_deref() == Some(HUB),
                "the environment's hub should lead before the fault"
            );
            for m in &members {
                faults::agent_via(&ctx.env, &ctx.f, m, &service.proxy.addr.to_string()).await?;
            }
            converge::wait_converged(&ctx.env, CONVERGE).await?;

            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            faults::sigkill(&ctx.env, &ctx.f, HUB)?;
            for i in 0..APPS {
                ctx.apply(i, 4).await?;
            }
            wait_for(
                Duration::from_secs(30),
                "the standby hub to lead",
                || async {
                    let leader = faults::hub_leader(&ctx.host).await?;
                    Ok((leader.as_deref() == Some(faults::STANDBY_HUB)).then_some(()))
                },
            )
            .await?;
            let took = start.elapsed();
            println!(
                "fault hub-failover: the standby leads {:.1}s after the SIGKILL",
                took.as_secs_f64()
            );
            ensure!(
                took < Duration::from_secs(18),
                "the standby took {took:?} to lead (the bound is 18 s)"
            );
            // The agents reach the new leader: it completed a sync with each.
            wait_for(
                CONVERGE,
                "every agent synced with the new leader",
                || async {
                    let metrics = http_get(&launch.http, "/metrics").await?.1;
                    Ok(members
                        .iter()
                        .all(|m| hub_syncs(&metrics, m) >= 1.0)
                        .then_some(()))
                },
            )
            .await?;
            verdict(&ctx, "hub-failover", &log, start).await
        }
        .await;
        // Back to one hub: the standby hands its Lease back as it stops, the
        // environment's hub starts and the agents dial it again.
        let back = async {
            if let Some(p) = standby {
                p.stop(Duration::from_secs(15))?;
                process::forget(&ctx.env.dir, faults::STANDBY_HUB)?;
            }
            if !ctx.f.process(&ctx.env, HUB).is_ok_and(|p| p.alive()) {
                faults::start(&ctx.env, &ctx.f, HUB).await?;
            }
            for m in &members {
                faults::agent_direct(&ctx.env, &ctx.f, m).await?;
            }
            anyhow::Ok(())
        }
        .await;
        (ctx, r.and(back))
    })
    .await
}

/// The stop of kube-controller-manager and kube-scheduler a member's apiserver outage
/// causes (they exit when their own lease runs out): captured before, revived after.
fn member_clients(env: &Env, member: &str) -> Result<Vec<faults::Component>> {
    ["kube-controller-manager", "kube-scheduler"]
        .into_iter()
        .map(|c| faults::capture(env, member, c).map(|(_, c)| c))
        .collect()
}

/// An agent whose apiserver stops for 20 s, past its renew deadline (10 s) and its Lease
/// duration (15 s), stops leading and stops acting (not ready); once the apiserver is
/// back the same process wins the Lease again and acts again: `/readyz` 200, a new FederatedMyApp's MyApp lands there, the
/// environment converges and nothing was deleted. (An agent stayed a standby for good,
/// "waiting for: operator", before.)
#[tokio::test]
async fn an_agent_whose_apiserver_was_down_past_its_lease_works_again() -> Result<()> {
    run("fault-agent-lease", |ctx| async move {
        let mut env = ctx.env.clone();
        let member = "cluster1";
        let name = agent_name(member);
        let fresh = ctx.name(APPS);
        let clients = member_clients(&env, member);
        let r = async {
            let clients = clients.as_ref().map_err(|e| anyhow::anyhow!("{e:#}"))?;
            let agent = ctx.f.process(&env, &name)?;
            let http = ctx.f.launch(&name)?.http.clone();
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            let stopped = faults::stop_component(&env, member, "kube-apiserver")?;
            let stood_down = wait_for(
                Duration::from_secs(30),
                "cluster1's agent to stop acting (/readyz not 200)",
                || async {
                    Ok(
                        matches!(http_get(&http, "/readyz").await, Ok((c, _)) if c != 200)
                            .then_some(()),
                    )
                },
            )
            .await;
            tokio::time::sleep(Duration::from_secs(20).saturating_sub(start.elapsed())).await;
            faults::start_component(&mut env, &stopped)?;
            eprintln!(
                "started again after the outage: {:?}",
                faults::revive(&mut env, clients)?
            );
            let back = federation::wait_http_ready(&name, &http).await;
            ensure!(
                agent.alive(),
                "the agent (PID {}) exited instead of acting again; its log: {:?}",
                agent.pid,
                agent.log
            );
            stood_down?;
            back.context("the agent after its apiserver came back")?;
            println!(
                "fault agent-lease-lost-and-regained: ready again {:.1}s after the outage began",
                start.elapsed().as_secs_f64()
            );
            // It acts: a new app lands on its cluster.
            ctx.apply(APPS, 3).await?;
            let myapps: Api<flotilla_crds::MyApp> =
                Api::namespaced(ctx.env.client(member).await?, "default");
            wait_for(CONVERGE, "the new app's MyApp in cluster1", || async {
                Ok(myapps.get_opt(&fresh).await?.map(drop))
            })
            .await?;
            verdict(&ctx, "agent-lease-lost-and-regained", &log, start).await
        }
        .await;
        let _ = ctx.fedapps().delete(&fresh, &DeleteParams::default()).await;
        // Those that lost their leader lease may exit late: started again, as a kubelet would.
        let revived = match &clients {
            Ok(clients) => faults::revive(&mut env, clients).map(drop),
            Err(_) => Ok(()),
        };
        (ctx, r.and(revived))
    })
    .await
}

/// SIGTERM to `p`; fails if it still runs after 10 s (what the Pod's
/// terminationGracePeriodSeconds of 15 s leaves, with margin).
fn sigterm_ends(p: &ProcessRecord, state: &str) -> Result<()> {
    let at = Instant::now();
    p.signal(Signal::TERM)?;
    let gone = p.wait_gone(Duration::from_secs(10));
    println!(
        "fault agent-sigterm: {state}: {} after {:.1}s",
        if gone { "ended" } else { "still running" },
        at.elapsed().as_secs_f64()
    );
    ensure!(
        gone,
        "{} ({state}) still ran 10s after SIGTERM; its log: {:?}",
        p.name,
        p.log
    );
    Ok(())
}

/// SIGTERM ends an agent within 10 s whatever it is doing: leading and in session; a
/// standby without the Lease; its apiserver down (for 1 s: still leading, its renewals
/// failing; for 12 s: past the renew deadline of 10 s, no longer leading, its Lease
/// never released). Nothing is deleted, and everything converges after.
#[tokio::test]
async fn sigterm_ends_an_agent_within_10s_in_every_state() -> Result<()> {
    run("fault-agent-sigterm", |ctx| async move {
        let mut env = ctx.env.clone();
        let member = "cluster1";
        let name = agent_name(member);
        let r = async {
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            wait_member_ready(&ctx.host, member, true, Duration::from_secs(30)).await?;
            sigterm_ends(&ctx.f.process(&env, &name)?, "leading, in session")?;
            faults::start(&env, &ctx.f, &name).await?;

            let (twin, _) = faults::start_twin(&env, &ctx.f, member).await?;
            let standby = sigterm_ends(&twin, "standby without the Lease");
            process::forget(&env.dir, &twin.name)?;
            standby?;

            for down in [Duration::from_secs(1), Duration::from_secs(12)] {
                let clients = member_clients(&env, member)?;
                let stopped = faults::stop_component(&env, member, "kube-apiserver")?;
                tokio::time::sleep(down).await;
                let state = format!("its apiserver down for {}s", down.as_secs());
                let ended = sigterm_ends(&ctx.f.process(&env, &name)?, &state);
                faults::start_component(&mut env, &stopped)?;
                faults::revive(&mut env, &clients)?;
                ended?;
                faults::start(&env, &ctx.f, &name).await?;
            }
            verdict(&ctx, "agent-sigterm-in-every-state", &log, start).await
        }
        .await;
        (ctx, r)
    })
    .await
}

/// Issue 19, item 4 (the stale member snapshot): a new FederatedMyApp whose finalizer
/// PATCH the host is slow to answer (an admission webhook holds it, as a busy apiserver
/// would) while a cluster joins its placement. A planner that read the registered
/// clusters before that PATCH and planned with them after it sent the joining cluster a
/// Delete after the Apply of a newer plan, and left the app off it for good.
#[tokio::test]
async fn a_cluster_that_joins_while_a_new_app_is_finalized_keeps_it() -> Result<()> {
    run("fault-join-race", |ctx| async move {
        let name = ctx.name(APPS);
        let joiner = "cluster3";
        let members: Api<MemberCluster> = Api::all(ctx.host.clone());
        let r = async {
            ensure!(
                ctx.env.members().contains(&joiner),
                "this test needs {joiner}: up --members 3"
            );
            let hold = HeldUpdates::start(&ctx.host, &name, HOLD).await?;
            set_race_label(&members, "cluster1", Some(&name)).await?;
            let log = DeletionLog::start(&ctx.env).await?;
            let start = Instant::now();
            let deletes = hub_deletes(&ctx.f.metrics(HUB).await?, joiner);
            let app = json!({
                "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
                "metadata": {"name": name, "namespace": "default", "labels": {HOLD_LABEL: name}},
                "spec": {"placement": {"clusterSelector": {"matchLabels": {RACE_LABEL: name}}},
                         "template": {"spec": {"replicas": 1, "image": "nginx:1.27"}}},
            });
            ctx.fedapps()
                .create(&PostParams::default(), &serde_json::from_value(app)?)
                .await?;
            // The hub's finalizer PATCH is held: the cluster joins meanwhile.
            hold.wait(
                |s| s.held >= 1,
                "the hub's finalizer PATCH to reach the webhook",
            )
            .await?;
            set_race_label(&members, joiner, Some(&name)).await?;
            hold.wait(|s| s.released >= 1, "the held PATCH answered")
                .await?;
            let myapps: Api<flotilla_crds::MyApp> =
                Api::namespaced(ctx.env.client(joiner).await?, "default");
            wait_for(CONVERGE, &format!("{name} on {joiner}"), || async {
                Ok(myapps.get_opt(&name).await?)
            })
            .await?;
            // Still there once the hub has acted on everything the race left it.
            tokio::time::sleep(Duration::from_secs(5)).await;
            ensure!(
                myapps.get_opt(&name).await?.is_some(),
                "{name} left {joiner} after the held PATCH was answered"
            );
            let sent = hub_deletes(&ctx.f.metrics(HUB).await?, joiner) - deletes;
            ensure!(sent == 0.0, "the hub sent {joiner} {sent} Delete(s)");
            verdict(&ctx, "cluster-joins-during-finalizer-patch", &log, start).await
        }
        .await;
        let _ = HeldUpdates::remove(&ctx.host).await;
        for cluster in ["cluster1", joiner] {
            let _ = set_race_label(&members, cluster, None).await;
        }
        let _ = ctx.fedapps().delete(&name, &DeleteParams::default()).await;
        (ctx, r)
    })
    .await
}

/// How long the webhook holds each UPDATE of the race's app.
const HOLD: Duration = Duration::from_secs(3);
/// The FederatedMyApps whose UPDATEs the webhook holds (value: the app's name).
const HOLD_LABEL: &str = "flotilla-e2e/hold-updates";
/// The MemberCluster label the race's app selects (value: the app's name).
const RACE_LABEL: &str = "flotilla-e2e/join-race";
const WEBHOOK: &str = "flotilla-e2e-hold-updates";

fn hub_deletes(metrics: &str, cluster: &str) -> f64 {
    sample(
        metrics,
        &format!("flotilla_hub_messages_sent_total{{cluster=\"{cluster}\",kind=\"delete\"}}"),
    )
}

async fn set_race_label(
    members: &Api<MemberCluster>,
    cluster: &str,
    value: Option<&str>,
) -> Result<()> {
    let patch = json!({"metadata": {"labels": {RACE_LABEL: value}}});
    members
        .patch(cluster, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("labelling MemberCluster {cluster}"))?;
    Ok(())
}

/// What the webhook has seen: dry-run probes, held UPDATEs, and those it answered.
#[derive(Debug, Clone, Copy, Default)]
struct Held {
    probes: usize,
    held: usize,
    released: usize,
}

/// A validating admission webhook served by this test over TLS on loopback: it holds every
/// UPDATE of the FederatedMyApp it was started for (labelled `HOLD_LABEL`) for `hold`,
/// and of its status for twice that, then allows it.
struct HeldUpdates {
    seen: tokio::sync::watch::Receiver<Held>,
    stop: tokio_util::sync::CancellationToken,
}

impl HeldUpdates {
    async fn start(host: &Client, app: &str, hold: Duration) -> Result<HeldUpdates> {
        use axum::routing::post;
        use k8s_openapi::ByteString;
        use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;

        let tls = flotilla_common::tls::self_signed(
            "flotilla-e2e-webhook-ca",
            "flotilla-e2e-webhook",
            &["127.0.0.1".into()],
        )?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (tx, seen) = tokio::sync::watch::channel(Held::default());
        let tx = std::sync::Arc::new(tx);
        let app_name = app.to_owned();
        let router = axum::Router::new().route(
            "/hold",
            post(move |axum::Json(review): axum::Json<serde_json::Value>| {
                let (tx, app_name) = (tx.clone(), app_name.clone());
                async move {
                    let request = &review["request"];
                    let ours = request["operation"] == "UPDATE" && request["name"] == app_name;
                    if request["dryRun"] == true {
                        tx.send_modify(|s| s.probes += 1);
                    } else if ours && request["subResource"] == "status" {
                        // Status lands after the finalizer, so that the finalizer PATCH's
                        // resourceVersion still holds when it is let through.
                        tokio::time::sleep(hold * 2).await;
                    } else if ours {
                        tx.send_modify(|s| s.held += 1);
                        tokio::time::sleep(hold).await;
                        tx.send_modify(|s| s.released += 1);
                    }
                    axum::Json(json!({
                        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                        "response": {"uid": request["uid"], "allowed": true},
                    }))
                }
            }),
        );
        let stop = tokio_util::sync::CancellationToken::new();
        let server = tonic::transport::Server::builder()
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(
                tonic::transport::Identity::from_pem(
                    &tls.cert_pem,
                    secrecy::ExposeSecret::expose_secret(&tls.key_pem),
                ),
            ))?
            .accept_http1(true)
            .add_routes(tonic::service::Routes::from(router))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                stop.clone().cancelled_owned(),
            );
        tokio::spawn(server);
        let held = HeldUpdates { seen, stop };
        let config = json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": WEBHOOK},
            "webhooks": [{
                "name": "hold-updates.flotilla-e2e.io",
                "clientConfig": {"url": format!("https://{addr}/hold")},
                "rules": [{"apiGroups": ["core.kubefed.io"], "apiVersions": ["v1beta1"],
                           "resources": ["federatedmyapps", "federatedmyapps/status"],
                           "operations": ["CREATE", "UPDATE"]}],
                "objectSelector": {"matchLabels": {HOLD_LABEL: app}},
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 10,
                "failurePolicy": "Ignore",
            }],
        });
        let mut config: ValidatingWebhookConfiguration = serde_json::from_value(config)?;
        for webhook in config.webhooks.iter_mut().flatten() {
            webhook.client_config.ca_bundle = Some(ByteString(tls.ca_pem.clone().into_bytes()));
        }
        let api: Api<ValidatingWebhookConfiguration> = Api::all(host.clone());
        let _ = api.delete(WEBHOOK, &DeleteParams::default()).await;
        api.create(&PostParams::default(), &config)
            .await
            .context("registering the webhook")?;
        // The apiserver picks the configuration up a moment later: dry-run creates show
        // when it calls the webhook.
        let fedapps: Api<FederatedMyApp> = Api::namespaced(host.clone(), "default");
        let probe: FederatedMyApp = serde_json::from_value(json!({
            "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
            "metadata": {"name": format!("{app}-probe"), "namespace": "default",
                         "labels": {HOLD_LABEL: app}},
            "spec": {},
        }))?;
        let dry_run = PostParams {
            dry_run: true,
            ..Default::default()
        };
        wait_for(CONVERGE, "the webhook called by the host", || async {
            fedapps.create(&dry_run, &probe).await?;
            Ok((held.seen.borrow().probes > 0).then_some(()))
        })
        .await?;
        Ok(held)
    }

    async fn wait(&self, until: impl Fn(&Held) -> bool, what: &str) -> Result<()> {
        let mut seen = self.seen.clone();
        tokio::time::timeout(CONVERGE, seen.wait_for(until))
            .await
            .with_context(|| format!("waiting for {what}"))??;
        Ok(())
    }

    async fn remove(host: &Client) -> Result<()> {
        use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
        let api: Api<ValidatingWebhookConfiguration> = Api::all(host.clone());
        api.delete(WEBHOOK, &DeleteParams::default()).await?;
        Ok(())
    }
}

impl Drop for HeldUpdates {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
