//! `flotilla-bench footprint`: the agent's resident memory and idle CPU with N
//! MyApps (each reconciled into its Deployment and ConfigMap) on a real member, and the
//! hub's resident memory per 1,000 cluster-app pairs. The baseline is the same two
//! processes before the apps, in the same run. The apps are placed on every member, so
//! the time until all are reconciled everywhere is also the fan-out figure measured
//! beside Karmada (1,000 MyApps on two members). Run it on release builds
//! (`FLOTILLA_BIN_DIR`): a debug agent is several times larger.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use flotilla_crds::FederatedMyApp;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use serde_json::json;

use super::procstat::{self, Sample};
use super::{Report, cell, round};
use flotilla_lab::Env;
use flotilla_lab::federation::{Federation, HUB, agent_name};

/// Labels the bench's FederatedMyApps, to delete them together.
const LABEL: &str = "flotilla.io/bench=footprint";
const NAMESPACE: &str = "default";
/// After every app's pod exists, before idling is measured: the last status reports die
/// down.
const SETTLE: Duration = Duration::from_secs(15);
/// Between two looks at the Deployments' status (a list of every one on each member).
const ROLLOUT_POLL: Duration = Duration::from_secs(2);
/// The window idle CPU is averaged over.
const IDLE: Duration = Duration::from_secs(30);
const TIMEOUT: Duration = Duration::from_secs(900);

/// One process over an idle window: its memory at the end, its CPU share during it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Idle {
    pub rss_mib: f64,
    pub cpu_pct: f64,
}

impl Idle {
    fn between(start: Sample, end: Sample, window: Duration) -> Idle {
        Idle {
            rss_mib: end.rss_mib,
            cpu_pct: 100.0 * (end.cpu_s - start.cpu_s) / window.as_secs_f64(),
        }
    }
}

/// Both processes over the same idle window.
async fn idle(agent: u32, hub: u32) -> Result<(Idle, Idle)> {
    let (a0, h0) = (procstat::sample(Some(agent))?, procstat::sample(Some(hub))?);
    tokio::time::sleep(IDLE).await;
    let (a1, h1) = (procstat::sample(Some(agent))?, procstat::sample(Some(hub))?);
    Ok((Idle::between(a0, a1, IDLE), Idle::between(h0, h1, IDLE)))
}

fn fedapp(i: usize, members: &[String]) -> serde_json::Value {
    json!({"apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
           "metadata": {"name": name(i), "namespace": NAMESPACE, "labels": {"flotilla.io/bench": "footprint"}},
           "spec": {"placement": {"clusters": members.iter().map(|m| json!({"name": m})).collect::<Vec<_>>()},
                    "template": {"spec": {"replicas": 1, "image": "nginx:1.27", "config": {"index": i.to_string()}}}}})
}

fn name(i: usize) -> String {
    format!("footprint-{i:05}")
}

/// Whether a Deployment's controller has seen its latest spec and made every replica's
/// pod. Not that the pods run: the lab's KWOK nodes hold 110 pods each, so most of a
/// thousand stay Pending, which changes nothing once they exist.
fn rolled_out(d: &Deployment) -> bool {
    let wanted = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    d.status.as_ref().is_some_and(|s| {
        s.observed_generation.is_some()
            && s.observed_generation == d.metadata.generation
            && s.replicas == Some(wanted)
    })
}

/// The children the operator made, listed by its label; the bench's own among them by
/// [`ours`].
fn managed() -> ListParams {
    ListParams::default().labels("app.kubernetes.io/managed-by=flotilla-operator")
}

/// Whether a child is one of the bench's apps' (named after its MyApp).
fn ours(name: Option<&str>) -> bool {
    name.is_some_and(|n| n.starts_with("footprint-"))
}

/// How many of the bench's apps' Deployments on the member are [`rolled_out`].
async fn rolled_out_count(deployments: &Api<Deployment>) -> Result<usize> {
    let list = deployments.list(&managed()).await?;
    let ours = |d: &&Deployment| ours(d.metadata.name.as_deref());
    Ok(list
        .items
        .iter()
        .filter(ours)
        .filter(|d| rolled_out(d))
        .count())
}

/// Until every member's controller-manager has made every app's pod: until then the
/// pods, the Deployments' status and the MyApps' status keep the agent busy, and a
/// window measured there is not idle (it read 1.4-2.9 % of a core). A failed list (an
/// apiserver busy with thousands of pods) is looked at again.
async fn until_rolled_out(deployments: &[&Api<Deployment>], apps: usize) -> Result<()> {
    let what = format!("the {apps} Deployments rolled out on every member");
    flotilla_lab::wait_for_every(ROLLOUT_POLL, TIMEOUT, &what, || async {
        let mut fewest = usize::MAX;
        for member in deployments {
            fewest = fewest.min(rolled_out_count(member).await?);
        }
        Ok((fewest >= apps).then_some(()))
    })
    .await
}

/// How many of the bench's apps have their Deployment and their ConfigMap on the member.
async fn reconciled(deployments: &Api<Deployment>, configs: &Api<ConfigMap>) -> Result<usize> {
    let d = deployments.list_metadata(&managed()).await?.items;
    let c = configs.list_metadata(&managed()).await?.items;
    let d = d
        .iter()
        .filter(|o| ours(o.metadata.name.as_deref()))
        .count();
    let c = c
        .iter()
        .filter(|o| ours(o.metadata.name.as_deref()))
        .count();
    Ok(d.min(c))
}

pub async fn footprint(env: &Env, apps: usize) -> Result<Report> {
    anyhow::ensure!(apps > 0, "--apps must be positive");
    let members: Vec<String> = env.members().iter().map(|m| m.to_string()).collect();
    let member = members.first().context("no member cluster")?.clone();
    let federation = Federation::load(env)?;
    let agent = federation.process(env, &agent_name(&member))?.pid;
    let hub = federation.process(env, HUB)?.pid;
    let host = env.client(env.host()).await?;
    let fedapps: Api<FederatedMyApp> = Api::namespaced(host, NAMESPACE);
    let mut children = Vec::new();
    for m in &members {
        let client = env.client(m).await?;
        children.push((
            Api::<Deployment>::namespaced(client.clone(), NAMESPACE),
            Api::<ConfigMap>::namespaced(client, NAMESPACE),
        ));
    }
    // The fewest of the bench's apps reconciled on any member.
    let everywhere = || async {
        let mut fewest = usize::MAX;
        for (deployments, configs) in &children {
            fewest = fewest.min(reconciled(deployments, configs).await?);
        }
        anyhow::Ok(fewest)
    };

    eprintln!(
        "bench footprint: baseline, {}s idle with no app",
        IDLE.as_secs()
    );
    let (agent_before, hub_before) = idle(agent, hub).await?;

    eprintln!("bench footprint: applying {apps} FederatedMyApps placed on {members:?}");
    let start = Instant::now();
    futures::stream::iter(0..apps)
        .map(|i| {
            let (fedapps, members) = (fedapps.clone(), &members);
            async move {
                fedapps
                    .patch(
                        &name(i),
                        &PatchParams::apply("flotilla-bench").force(),
                        &Patch::Apply(fedapp(i, members)),
                    )
                    .await
                    .with_context(|| format!("applying FederatedMyApp {}", name(i)))
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<_>>()
        .await?;
    let written = start.elapsed();
    flotilla_lab::wait_for(
        TIMEOUT,
        &format!("{apps} MyApps reconciled on every member"),
        || async { Ok((everywhere().await? >= apps).then_some(())) },
    )
    .await?;
    let propagated = start.elapsed();
    eprintln!(
        "bench footprint: {apps} apps written in {:.1}s, reconciled everywhere in {:.1}s; waiting for every pod",
        written.as_secs_f64(),
        propagated.as_secs_f64(),
    );
    let deployments: Vec<&Api<Deployment>> = children.iter().map(|(d, _)| d).collect();
    until_rolled_out(&deployments, apps).await?;
    let rolled = start.elapsed();
    eprintln!(
        "bench footprint: every pod made {:.1}s after the first apply; settling {}s, then {}s idle",
        rolled.as_secs_f64(),
        SETTLE.as_secs(),
        IDLE.as_secs()
    );
    tokio::time::sleep(SETTLE).await;
    let (agent_after, hub_after) = idle(agent, hub).await?;

    eprintln!("bench footprint: deleting the apps");
    let deleting = Instant::now();
    // The figures are taken: a failed clean-up (an apiserver busy with 2,000 Deployments
    // closed the connection once) is said, and costs them nothing.
    let deleted = async {
        // Tried again: after the idle minute the first request may go out on a pooled
        // connection the apiserver is closing ("connection closed before message
        // completed", seen twice); deleting what is already deleting is harmless.
        let all = ListParams::default().labels(LABEL);
        let mut tries = 1;
        while let Err(e) = fedapps.delete_collection(&DeleteParams::default(), &all).await {
            if tries == 3 {
                return Err(e).context("deleting the bench's FederatedMyApps");
            }
            eprintln!("bench footprint: deleting the apps: {e}; trying again");
            tries += 1;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        flotilla_lab::wait_for(TIMEOUT, "the bench's apps gone from every member", || async {
            let mut left = 0;
            for (deployments, configs) in &children {
                left += reconciled(deployments, configs).await?;
            }
            Ok((left == 0).then_some(()))
        })
        .await?;
        anyhow::Ok(deleting.elapsed())
    }
    .await
    .inspect_err(|e| {
        eprintln!("bench footprint: cleaning up failed (delete them with `kubectl delete federatedmyapps -l {LABEL}`): {e:#}");
    })
    .ok();
    Ok(report(
        &Run {
            member,
            members: members.len(),
            apps,
            written,
            propagated,
            rolled,
            deleted,
        },
        [agent_before, agent_after],
        [hub_before, hub_after],
    ))
}

/// What one run did, and how long it took.
pub struct Run {
    /// The member whose agent is measured.
    pub member: String,
    pub members: usize,
    pub apps: usize,
    /// Until every FederatedMyApp was written to the host.
    pub written: Duration,
    /// Until every member had every app's Deployment and ConfigMap.
    pub propagated: Duration,
    /// Until every member's controller-manager had made every app's pod.
    pub rolled: Duration,
    /// From the deletion until no member has any; `None` if the clean-up failed.
    pub deleted: Option<Duration>,
}

/// The table and the JSON object of one run; `[before, after]` for each process.
pub fn report(run: &Run, agent: [Idle; 2], hub: [Idle; 2]) -> Report {
    let (apps, member) = (run.apps, &run.member);
    let pairs = apps * run.members;
    let hub_per_1000 = (hub[1].rss_mib - hub[0].rss_mib) * 1000.0 / pairs as f64;
    let row = |what: &str, i: Idle| vec![what.to_owned(), cell(i.rss_mib, 1), cell(i.cpu_pct, 2)];
    Report {
        preamble: vec![
            format!(
                "{apps} MyApps (1 replica, a ConfigMap and a Deployment each) on {} members: written {:.1}s, \
                 reconciled on every member {:.1}s, every pod made {:.1}s, {}",
                run.members,
                run.written.as_secs_f64(),
                run.propagated.as_secs_f64(),
                run.rolled.as_secs_f64(),
                match run.deleted {
                    Some(d) => format!("all gone {:.1}s after their deletion", d.as_secs_f64()),
                    None => "not all deleted (the clean-up failed)".to_owned(),
                }
            ),
            format!(
                "footprint of {member}'s agent and the hub; CPU averaged over {}s idle, {}s after every pod was made",
                IDLE.as_secs(),
                SETTLE.as_secs()
            ),
        ],
        header: ["", "RSS MiB", "CPU %"].map(String::from).to_vec(),
        rows: vec![
            row("agent, no app (baseline)", agent[0]),
            row(&format!("agent, {apps} apps"), agent[1]),
            row("hub, no app (baseline)", hub[0]),
            row(&format!("hub, {pairs} pairs"), hub[1]),
        ],
        notes: vec![
            format!("hub: {hub_per_1000:.1} MiB per 1,000 pairs over its baseline"),
            "targets: agent ≤ 32 MiB with 1,000 MyApps, idle CPU ~0".into(),
        ],
        json: json!({
            "scenario": "footprint",
            "apps": apps,
            "members": run.members,
            "agent_rss_mib": round(agent[1].rss_mib, 1),
            "agent_idle_cpu_pct": round(agent[1].cpu_pct, 2),
            "agent_baseline_rss_mib": round(agent[0].rss_mib, 1),
            "hub_rss_mib_per_1000_pairs": round(hub_per_1000, 2),
            "written_s": round(run.written.as_secs_f64(), 1),
            "propagated_s": round(run.propagated.as_secs_f64(), 1),
            "rolled_out_s": round(run.rolled.as_secs_f64(), 1),
            "deleted_s": run.deleted.map(|d| round(d.as_secs_f64(), 1)),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_cpu_is_the_share_of_the_window() {
        let start = Sample {
            peak_rss_mib: 10.0,
            rss_mib: 9.0,
            cpu_s: 1.0,
        };
        let end = Sample {
            peak_rss_mib: 12.0,
            rss_mib: 11.0,
            cpu_s: 1.3,
        };
        let i = Idle::between(start, end, Duration::from_secs(30));
        assert_eq!(i.rss_mib, 11.0);
        assert!((i.cpu_pct - 1.0).abs() < 1e-9);
    }

    #[test]
    fn a_deployment_is_rolled_out_once_its_controller_made_every_pod() {
        let d = |generation: i64, status: serde_json::Value| -> Deployment {
            serde_json::from_value(json!({
                "metadata": {"name": "footprint-00000", "generation": generation},
                "spec": {"replicas": 1, "selector": {}, "template": {}},
                "status": status,
            }))
            .unwrap()
        };
        assert!(rolled_out(&d(
            2,
            json!({"observedGeneration": 2, "replicas": 1})
        )));
        assert!(
            !rolled_out(&d(2, json!({"observedGeneration": 1, "replicas": 1}))),
            "the controller has not seen the latest spec"
        );
        assert!(
            !rolled_out(&d(1, json!({"observedGeneration": 1}))),
            "no pod made yet"
        );
        assert!(!rolled_out(&d(1, json!({}))), "no status yet");
    }

    #[test]
    fn the_report_carries_the_issue_s_fields() {
        let idle = |rss_mib, cpu_pct| Idle { rss_mib, cpu_pct };
        let run = Run {
            member: "cluster1".into(),
            members: 2,
            apps: 500,
            written: Duration::from_secs(2),
            propagated: Duration::from_secs(20),
            rolled: Duration::from_secs(40),
            deleted: Some(Duration::from_secs(10)),
        };
        let r = report(
            &run,
            [idle(15.0, 0.1), idle(25.0, 0.2)],
            [idle(30.0, 0.0), idle(40.0, 0.1)],
        );
        assert_eq!(r.json["agent_rss_mib"], 25.0);
        assert_eq!(r.json["agent_idle_cpu_pct"], 0.2);
        assert_eq!(
            r.json["hub_rss_mib_per_1000_pairs"], 10.0,
            "10 MiB over 1,000 pairs"
        );
        assert_eq!(r.json["propagated_s"], 20.0);
        assert_eq!(r.json["rolled_out_s"], 40.0);
        assert!(r.table().contains("agent, 500 apps"));
    }
}
