//! Progressive rollout end to end on three members: a change reaches a first wave
//! (cluster1), and the rest only once cluster1 has run it Ready for the soak (sampled in
//! the members themselves); a revision that never gets Ready halts the rollout after the
//! first wave with a clear status and Event, the other clusters untouched; pause holds a
//! fix back, resume rolls it out; a hub restart mid-soak holds the second wave for a
//! whole soak from what the agents report; a cluster lost mid-rollout leaves its wave and
//! keeps what it ran until it is back. Each test ends with the convergence checker green
//! and no unwanted deletion.
//!
//! One test at a time: they time what the members run.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use flotilla_crds::{FederatedMyApp, HASH_ANNOTATION, MyApp};
use flotilla_e2e::converge;
use flotilla_e2e::deletions::DeletionLog;
use flotilla_lab::federation::Federation;
use flotilla_lab::{Env, await_object, wait_for};
use flotilla_plan::render::revision_of;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(90);
use flotilla_e2e::THREE_MEMBERS as MEMBERS;
/// How often the members are sampled.
const SAMPLE: Duration = Duration::from_millis(100);

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Ctx {
    env: Env,
    host: Client,
    members: BTreeMap<&'static str, Client>,
}

async fn ctx() -> Result<Ctx> {
    let (env, host, members) = flotilla_e2e::three_members("rollout").await?;
    Ok(Ctx { env, host, members })
}

/// What one member runs of an app: its content hash and whether it is Ready at its
/// current generation.
#[derive(Debug, Clone, PartialEq)]
struct Runs {
    hash: String,
    ready: bool,
}

impl Runs {
    fn revision(&self) -> Option<&str> {
        revision_of(&self.hash)
    }
}

/// cluster1 alone first, then the rest.
fn canary_first(soak: i32, deadline: i32) -> Value {
    json!({
        "type": "ProgressivePerGroup",
        "groups": [{"name": "canary", "clusters": [{"name": "cluster1"}]}],
        "minSuccessSeconds": soak,
        "progressDeadlineSeconds": deadline,
    })
}

/// Resources no node has (a thousand cores): the pods stay Pending, the MyApp never Ready.
fn never_scheduled() -> Value {
    json!({"requests": {"cpu": "1000"}})
}

fn nginx(tag: &str) -> Value {
    json!({"image": format!("nginx:{tag}"), "replicas": 1})
}

impl Ctx {
    fn fedapps(&self) -> Api<FederatedMyApp> {
        Api::namespaced(self.host.clone(), "default")
    }

    async fn apply(&self, name: &str, spec: Value, rollout: &Value) -> Result<()> {
        self.apply_with(name, spec, json!([]), rollout).await
    }

    async fn apply_with(
        &self,
        name: &str,
        spec: Value,
        overrides: Value,
        rollout: &Value,
    ) -> Result<()> {
        let placement = json!({"clusterSelector": {}});
        let spec = json!({"placement": placement, "template": {"spec": spec}, "overrides": overrides, "rollout": rollout});
        self.apply_spec(name, spec).await
    }

    async fn apply_spec(&self, name: &str, spec: Value) -> Result<()> {
        let app = json!({
            "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
            "metadata": {"name": name, "namespace": "default"},
            "spec": spec,
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

    /// What each member runs of `name` now.
    async fn runs(&self, name: &str) -> Result<BTreeMap<&'static str, Option<Runs>>> {
        let mut out = BTreeMap::new();
        for (m, c) in &self.members {
            let app = Api::<MyApp>::namespaced(c.clone(), "default")
                .get_opt(name)
                .await?;
            let runs = app.map(|a| {
                let status = a.status.clone().unwrap_or_default();
                let current = status.observed_generation >= a.metadata.generation;
                Runs {
                    hash: a
                        .annotations()
                        .get(HASH_ANNOTATION)
                        .cloned()
                        .unwrap_or_default(),
                    ready: current && status.ready,
                }
            });
            out.insert(*m, runs);
        }
        Ok(out)
    }

    /// Waits until the app's status, for its current generation, shows the rollout in
    /// `state` (and, with `ready`, the app Ready: a cluster that came back may still
    /// show disconnected a moment after the rollout completes); returns the app.
    async fn wait_rollout(&self, name: &str, state: &str, ready: bool) -> Result<FederatedMyApp> {
        let is = |a: Option<&FederatedMyApp>| {
            a.is_some_and(|a| {
                let status = a.status.as_ref();
                let current = status.and_then(|s| s.observed_generation) == a.metadata.generation;
                let rollout = status.and_then(|s| s.rollout.as_ref());
                let ready = !ready || condition(a, "Ready").0 == "True";
                current && ready && rollout.is_some_and(|r| r.state == state)
            })
        };
        let what = format!("{name}'s rollout {state}");
        let app = await_object(&self.fedapps(), name, TIMEOUT, &what, is).await?;
        app.context("the app is gone")
    }

    /// Waits until the rollout is complete, the app Ready, and every member runs `name`
    /// at one revision, Ready; returns that revision.
    async fn wait_complete(&self, name: &str) -> Result<String> {
        self.wait_rollout(name, "Complete", true).await?;
        wait_for(
            TIMEOUT,
            &format!("{name} Ready at one revision everywhere"),
            || async {
                let runs = self.runs(name).await?;
                let revisions: BTreeSet<Option<&str>> = runs
                    .values()
                    .map(|r| r.as_ref().filter(|r| r.ready).and_then(Runs::revision))
                    .collect();
                Ok(match revisions.into_iter().collect::<Vec<_>>()[..] {
                    [Some(r)] => Some(r.to_owned()),
                    _ => None,
                })
            },
        )
        .await
    }

    async fn delete(&self, name: &str) -> Result<()> {
        let api = self.fedapps();
        let _ = api.delete(name, &DeleteParams::default()).await;
        let gone = |a: Option<&FederatedMyApp>| a.is_none();
        await_object(&api, name, TIMEOUT, &format!("{name} deleted"), gone).await?;
        Ok(())
    }

    /// Fails unless the members converged on what the hub plans, gate included, and
    /// nothing was deleted.
    async fn clean(&self, log: &DeletionLog) -> Result<()> {
        converge::wait_converged(&self.env, TIMEOUT).await?;
        log.assert_clean(&BTreeSet::new())
    }
}

/// A condition's (status, reason, message).
fn condition(app: &FederatedMyApp, type_: &str) -> (String, String, String) {
    let conditions = app.status.as_ref().map_or(&[][..], |s| &s.conditions);
    conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
        .unwrap_or_default()
}

/// The second wave starts only once the first has run the new revision Ready for the
/// soak: sampled every 100 ms in the members.
#[tokio::test]
async fn a_change_reaches_the_second_wave_only_after_the_first_soaked() -> Result<()> {
    const SOAK: i32 = 10;
    let _one = ONE_AT_A_TIME.lock().await;
    let c = ctx().await?;
    let log = DeletionLog::start(&c.env).await?;
    let name = "ro-waves";
    let rollout = canary_first(SOAK, 120);
    c.apply(name, nginx("1.27"), &rollout).await?;
    let old = c.wait_complete(name).await?;

    c.apply(name, nginx("1.28"), &rollout).await?;
    let start = Instant::now();
    // When cluster1 was first seen running the new revision Ready; when each other
    // cluster was first seen running it at all.
    let mut canary_ready: Option<Instant> = None;
    let mut reached: BTreeMap<&str, Instant> = BTreeMap::new();
    let mut seen_progressing = false;
    let new = loop {
        ensure!(
            start.elapsed() < TIMEOUT,
            "not rolled out in {TIMEOUT:?}; reached {reached:?}"
        );
        let runs = c.runs(name).await?;
        let revision = |m: &str| {
            runs[m]
                .as_ref()
                .and_then(|r| r.revision().map(str::to_owned))
        };
        let now = Instant::now();
        let canary = runs["cluster1"].as_ref();
        if canary_ready.is_none()
            && canary.is_some_and(|r| r.ready && r.revision() != Some(old.as_str()))
        {
            canary_ready = Some(now);
        }
        for m in ["cluster2", "cluster3"] {
            match revision(m) {
                Some(r) if r == old => {}
                Some(_) => {
                    reached.entry(m).or_insert(now);
                }
                None => bail!("{m} runs no revision of {name}: {runs:?}"),
            }
        }
        if let Some(ready) = canary_ready
            && !seen_progressing
            && now < ready + Duration::from_secs(SOAK as u64 / 2)
        {
            // Mid-soak, status says where the rollout waits.
            let app = c.fedapps().get(name).await?;
            let r = app.status.as_ref().and_then(|s| s.rollout.clone());
            let r = r.context("no status.rollout")?;
            if r.state == "Progressing" && r.wave == 1 {
                ensure!((r.waves, r.held_clusters) == (2, 2), "{r:?}");
                ensure!(
                    condition(&app, "Ready").0 == "False",
                    "Ready while rolling out"
                );
                seen_progressing = true;
            }
        }
        if reached.len() == 2 {
            break revision("cluster1").context("cluster1 runs nothing")?;
        }
        tokio::time::sleep(SAMPLE).await;
    };
    let ready = canary_ready.context("cluster1 never seen Ready at the new revision")?;
    // The hub sees readiness no earlier than a sample does, give or take one sample.
    let soak = Duration::from_secs(SOAK as u64) - SAMPLE * 3;
    for (m, at) in &reached {
        ensure!(
            *at >= ready + soak,
            "{m} got the new revision {:?} after cluster1 was Ready: before the {SOAK}s soak",
            at.saturating_duration_since(ready)
        );
    }
    ensure!(
        seen_progressing,
        "status never showed wave 1 of 2 in progress"
    );
    ensure!(c.wait_complete(name).await? == new);
    c.clean(&log).await?;
    c.delete(name).await
}

/// A revision whose pods never get Ready halts after the first wave (cluster2 and
/// cluster3 keep the old one) with status and an Event naming cluster1; pause holds the
/// fix back from every cluster, resume rolls it out.
#[tokio::test]
async fn a_bad_revision_halts_after_the_first_wave_and_a_fix_resumes() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let c = ctx().await?;
    let log = DeletionLog::start(&c.env).await?;
    let name = "ro-halt";
    let rollout = canary_first(2, 15);
    c.apply(name, nginx("1.27"), &rollout).await?;
    let good = c.wait_complete(name).await?;
    let before = c.runs(name).await?;

    let bad = json!({"image": "nginx:1.27", "replicas": 1, "resources": never_scheduled()});
    c.apply(name, bad, &rollout).await?;
    let app = c.wait_rollout(name, "Halted", false).await?;
    let r = app
        .status
        .as_ref()
        .and_then(|s| s.rollout.clone())
        .context("no rollout")?;
    ensure!(r.wave == 1 && r.held_clusters == 2, "{r:?}");
    ensure!(
        r.message.contains("cluster1") && r.message.contains("progressDeadlineSeconds"),
        "{}",
        r.message
    );
    let (stalled, reason, _) = condition(&app, "Stalled");
    ensure!((stalled.as_str(), reason.as_str()) == ("True", "RolloutHalted"));
    ensure!(condition(&app, "Ready").0 == "False");
    let events: Api<Event> = Api::namespaced(c.host.clone(), "default");
    wait_for(TIMEOUT, "a Warning Event RolloutHalted", || async {
        let list = events.list(&ListParams::default()).await?;
        let halted = list.items.iter().any(|e| {
            let about = e.regarding.as_ref().and_then(|r| r.name.as_deref());
            about == Some(name) && e.reason.as_deref() == Some("RolloutHalted")
        });
        Ok(halted.then_some(()))
    })
    .await?;
    // The other clusters are untouched, and stay so.
    let runs = c.runs(name).await?;
    let canary = runs["cluster1"].clone().context("cluster1 runs nothing")?;
    ensure!(
        canary.revision() != Some(good.as_str()) && !canary.ready,
        "{canary:?}"
    );
    for _ in 0..20 {
        let runs = c.runs(name).await?;
        for m in ["cluster2", "cluster3"] {
            ensure!(
                runs[m] == before[m],
                "{m} changed under a halted rollout: {:?}",
                runs[m]
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // Paused, the fix goes nowhere, not even to the first wave.
    let hub = Federation::load(&c.env)?.hub_cli(&c.env)?;
    hub.run(&["rollout", "pause", name])?;
    c.apply(name, nginx("1.28"), &rollout).await?;
    let app = c.wait_rollout(name, "Paused", false).await?;
    ensure!(condition(&app, "Stalled").1 == "RolloutPaused");
    let summary = hub.run(&["rollout", "status", name])?;
    ensure!(
        summary.starts_with("rollout: Paused at wave 1 of 2"),
        "{summary}"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let runs = c.runs(name).await?;
    ensure!(
        runs["cluster1"].as_ref() == Some(&canary),
        "paused, yet cluster1 moved"
    );
    for m in ["cluster2", "cluster3"] {
        ensure!(runs[m] == before[m], "paused, yet {m} moved");
    }
    hub.run(&["rollout", "resume", name])?;
    let fixed = c.wait_complete(name).await?;
    ensure!(fixed != good && Some(fixed.as_str()) != canary.revision());
    c.clean(&log).await?;
    c.delete(name).await
}

/// A revision that halts in the second wave (cluster2's pods never get Ready), then
/// `rollout abort`: the template and overrides go back to the last complete revision,
/// and cluster1 and cluster2 return to it at once, though the soak in force would hold
/// cluster2 for five minutes behind cluster1 were it a new revision; cluster3 never
/// moves. Aborting again has nothing to do.
#[tokio::test]
async fn an_abort_puts_every_cluster_back_on_the_last_complete_revision_at_once() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let c = ctx().await?;
    let log = DeletionLog::start(&c.env).await?;
    let name = "ro-abort";
    let waves = |soak: i32| json!({"type": "Progressive", "maxConcurrency": 1, "minSuccessSeconds": soak, "progressDeadlineSeconds": 10});
    c.apply(name, nginx("1.27"), &waves(1)).await?;
    let good = c.wait_complete(name).await?;
    let before = c.runs(name).await?;
    // cluster2's new pods stay Pending.
    let starved = json!([{"clusterName": "cluster2", "clusterOverrides": [
        {"op": "add", "path": "/spec/resources", "value": never_scheduled()}]}]);
    c.apply_with(name, nginx("1.28"), starved.clone(), &waves(1))
        .await?;
    let app = c.wait_rollout(name, "Halted", false).await?;
    let r = (app.status.as_ref().and_then(|s| s.rollout.clone())).context("no rollout")?;
    ensure!(r.wave == 2 && r.message.contains("cluster2"), "{r:?}");
    let last = r.last_complete.context("no lastComplete")?;
    ensure!(last.revisions == [good.clone()], "{last:?} against {good}");
    // A five-minute soak from now on: a new revision would hold cluster2 behind cluster1.
    c.apply_with(name, nginx("1.28"), starved, &waves(300))
        .await?;

    let hub = Federation::load(&c.env)?.hub_cli(&c.env)?;
    let started = Instant::now();
    hub.run(&["rollout", "abort", name])?;
    c.wait_complete(name)
        .await
        .context("back on the last complete revision")?;
    let back = started.elapsed();
    ensure!(back < Duration::from_secs(120), "took {back:?}");
    let runs = c.runs(name).await?;
    ensure!(
        runs["cluster3"] == before["cluster3"],
        "cluster3 moved: {:?}",
        runs["cluster3"]
    );
    for m in ["cluster1", "cluster2"] {
        let revision = runs[m].as_ref().and_then(Runs::revision);
        ensure!(revision == Some(good.as_str()), "{m} runs {revision:?}");
    }
    let app = c.fedapps().get(name).await?;
    ensure!(
        app.spec.overrides.is_empty(),
        "the overrides are back to none"
    );
    let template = serde_json::to_value(&app.spec.template.spec)?;
    ensure!(template["image"] == "nginx:1.27", "{template}");
    let again = hub.run(&["rollout", "abort", name]);
    ensure!(
        again
            .as_ref()
            .is_err_and(|e| format!("{e:#}").contains("nothing to abort")),
        "{again:?}"
    );
    eprintln!("abort: every cluster back on {good} in {back:?}");
    c.clean(&log).await?;
    c.delete(name).await
}

/// Halted at wave 1 (cluster1's pods never get Ready) with a division of 6 replicas over
/// three clusters, the total is raised to 9 (a traffic spike): cluster2 and cluster3,
/// held but running the last complete revision, take 3 replicas each of that revision at
/// once (a change of the division is not held by a halted rollout), still held.
#[tokio::test]
async fn a_held_cluster_takes_its_new_share_of_a_division() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let c = ctx().await?;
    let log = DeletionLog::start(&c.env).await?;
    let name = "ro-share";
    let spec = |template: Value, total: i32| {
        json!({
            "placement": {"clusterSelector": {}, "replicaScheduling": {"mode": "Weighted", "totalReplicas": total}},
            "template": {"spec": template},
            "rollout": {"type": "Progressive", "maxConcurrency": 1, "minSuccessSeconds": 1, "progressDeadlineSeconds": 10},
        })
    };
    c.apply_spec(name, spec(nginx("1.27"), 6)).await?;
    let good = c.wait_complete(name).await?;
    let bad = json!({"image": "nginx:1.28", "resources": never_scheduled()});
    c.apply_spec(name, spec(bad.clone(), 6)).await?;
    c.wait_rollout(name, "Halted", false).await?;
    c.apply_spec(name, spec(bad, 9)).await?;
    let replicas = |m: &'static str| {
        let api = Api::<MyApp>::namespaced(c.members[m].clone(), "default");
        async move { anyhow::Ok(api.get(name).await?.spec.replicas) }
    };
    wait_for(TIMEOUT, "cluster2 and cluster3 run 3 replicas", || async {
        let three =
            replicas("cluster2").await? == Some(3) && replicas("cluster3").await? == Some(3);
        Ok(three.then_some(()))
    })
    .await?;
    let runs = c.runs(name).await?;
    for m in ["cluster2", "cluster3"] {
        let revision = runs[m].as_ref().and_then(Runs::revision);
        ensure!(
            revision == Some(good.as_str()),
            "{m} runs {revision:?}, not {good}"
        );
    }
    let app = c.fedapps().get(name).await?;
    let r = app.status.and_then(|s| s.rollout).context("no rollout")?;
    // cluster1's new share restarts its deadline: Progressing again, until it passes.
    ensure!(r.held_clusters == 2, "{r:?}");
    c.apply_spec(name, spec(nginx("1.27"), 9)).await?;
    c.wait_complete(name).await?;
    c.clean(&log).await?;
    c.delete(name).await
}

/// Samples the members until cluster2 and cluster3 both run another revision than
/// `old`; returns when each was first seen on it.
async fn reached(c: &Ctx, name: &str, old: &str) -> Result<BTreeMap<&'static str, Instant>> {
    let start = Instant::now();
    let mut reached = BTreeMap::new();
    while reached.len() < 2 {
        ensure!(
            start.elapsed() < TIMEOUT,
            "not rolled out in {TIMEOUT:?}: {reached:?}"
        );
        let runs = c.runs(name).await?;
        for m in ["cluster2", "cluster3"] {
            let revision = runs[m].as_ref().and_then(Runs::revision);
            if revision.is_some_and(|r| r != old) {
                reached.entry(m).or_insert_with(Instant::now);
            }
        }
        tokio::time::sleep(SAMPLE).await;
    }
    Ok(reached)
}

/// The hub restarts while the first wave soaks: the new hub knows only what agents
/// report, so it holds the second wave for a whole soak from the moment it hears them
/// (never less), and nothing is deleted. Restarted once the rollout is complete, it
/// reads it complete from the reports (not soaking again).
#[tokio::test]
async fn a_hub_restart_mid_soak_recomputes_the_rollout_from_reports() -> Result<()> {
    const SOAK: i32 = 12;
    let _one = ONE_AT_A_TIME.lock().await;
    let c = ctx().await?;
    let log = DeletionLog::start(&c.env).await?;
    let name = "ro-restart";
    let rollout = canary_first(SOAK, 120);
    c.apply(name, nginx("1.27"), &rollout).await?;
    let old = c.wait_complete(name).await?;
    c.apply(name, nginx("1.28"), &rollout).await?;
    wait_for(TIMEOUT, "cluster1 Ready at the new revision", || async {
        let runs = c.runs(name).await?;
        let canary = runs["cluster1"].as_ref();
        Ok(canary
            .is_some_and(|r| r.ready && r.revision() != Some(old.as_str()))
            .then_some(()))
    })
    .await?;
    let federation = Federation::load(&c.env)?;
    let restarted = Instant::now();
    federation
        .restart(&c.env, flotilla_lab::federation::HUB)
        .await?;
    let reached = reached(&c, name, &old).await?;
    for (m, at) in &reached {
        ensure!(
            *at >= restarted + Duration::from_secs(SOAK as u64),
            "{m} got the new revision {:?} after the hub restarted: within the soak",
            at.saturating_duration_since(restarted)
        );
    }
    c.wait_complete(name).await?;
    // Complete, the hub restarts again: once every agent is back and reported, it
    // relearns the rollout from the reports as complete, not as soaking again.
    federation
        .restart(&c.env, flotilla_lab::federation::HUB)
        .await?;
    for m in MEMBERS {
        flotilla_lab::federation::wait_member_ready(&c.host, m, true, TIMEOUT).await?;
    }
    for _ in 0..30 {
        let app = c.fedapps().get(name).await?;
        let rollout = app.status.and_then(|s| s.rollout);
        ensure!(
            rollout.as_ref().is_some_and(|r| r.state == "Complete"),
            "after the hub's restart a complete rollout reads {rollout:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    c.clean(&log).await?;
    c.delete(name).await
}

/// cluster3's agent stops mid-rollout: once its MemberCluster is NotReady it no longer
/// holds its wave, the rollout completes on the others, and cluster3 keeps what it ran
/// until it is back, then gets the revision.
#[tokio::test]
async fn a_cluster_lost_mid_rollout_does_not_stall_it() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let c = ctx().await?;
    let log = DeletionLog::start(&c.env).await?;
    let name = "ro-lost";
    let rollout = canary_first(2, 120);
    c.apply(name, nginx("1.27"), &rollout).await?;
    let old = c.wait_complete(name).await?;
    let federation = Federation::load(&c.env)?;
    let agent = flotilla_lab::federation::agent_name("cluster3");
    federation.stop(&c.env, &agent)?;
    let lost = async {
        let grace = Duration::from_secs(30);
        flotilla_lab::federation::wait_member_ready(&c.host, "cluster3", false, grace).await?;
        c.apply(name, nginx("1.28"), &rollout).await?;
        c.wait_rollout(name, "Complete", false).await?;
        let runs = c.runs(name).await?;
        let new = runs["cluster1"].as_ref().and_then(Runs::revision);
        ensure!(new.is_some() && new != Some(old.as_str()), "{runs:?}");
        ensure!(
            runs["cluster2"].as_ref().and_then(Runs::revision) == new,
            "{runs:?}"
        );
        let kept = runs["cluster3"].as_ref().and_then(Runs::revision);
        ensure!(
            kept == Some(old.as_str()),
            "cluster3 must keep {old}: {runs:?}"
        );
        Ok(())
    }
    .await;
    // Back as `up` launched it, whatever happened.
    federation.start(&c.env, &agent)?;
    federation.wait_ready(&agent).await?;
    lost?;
    let new = c.wait_complete(name).await?;
    ensure!(new != old);
    c.clean(&log).await?;
    c.delete(name).await
}
