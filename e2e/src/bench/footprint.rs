//! `flotilla-e2e bench footprint`: the agent's resident memory and idle CPU with N
//! MyApps (each reconciled into its Deployment and ConfigMap) on a real member, and the
//! hub's resident memory per 1,000 cluster-app pairs. The baseline is the same two
//! processes before the apps, in the same run. Run it on release builds
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
use crate::Env;
use crate::federation::{Federation, HUB, agent_name};

/// Labels the bench's FederatedMyApps, to delete them together.
const LABEL: &str = "flotilla.io/bench=footprint";
const NAMESPACE: &str = "default";
/// After the last Deployment appears, before idling is measured: status reports and
/// the Deployments' own rollouts die down.
const SETTLE: Duration = Duration::from_secs(15);
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

fn fedapp(i: usize, member: &str) -> serde_json::Value {
    json!({"apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
           "metadata": {"name": name(i), "namespace": NAMESPACE, "labels": {"flotilla.io/bench": "footprint"}},
           "spec": {"placement": {"clusters": [{"name": member}]},
                    "template": {"spec": {"replicas": 1, "image": "nginx:1.27", "config": {"index": i.to_string()}}}}})
}

fn name(i: usize) -> String {
    format!("footprint-{i:05}")
}

/// How many of the bench's apps have their Deployment and their ConfigMap on the member.
async fn reconciled(deployments: &Api<Deployment>, configs: &Api<ConfigMap>) -> Result<usize> {
    let managed = ListParams::default().labels("app.kubernetes.io/managed-by=flotilla-operator");
    let ours = |n: &str| n.starts_with("footprint-");
    let d = deployments.list_metadata(&managed).await?;
    let c = configs.list_metadata(&managed).await?;
    let count = |names: Vec<String>| names.iter().filter(|n| ours(n)).count();
    Ok(count(
        d.items
            .into_iter()
            .filter_map(|o| o.metadata.name)
            .collect(),
    )
    .min(count(
        c.items
            .into_iter()
            .filter_map(|o| o.metadata.name)
            .collect(),
    )))
}

pub async fn footprint(env: &Env, apps: usize) -> Result<Report> {
    anyhow::ensure!(apps > 0, "--apps must be positive");
    let member = env
        .members()
        .first()
        .copied()
        .context("no member cluster")?
        .to_owned();
    let federation = Federation::load(env)?;
    let agent = federation.process(env, &agent_name(&member))?.pid;
    let hub = federation.process(env, HUB)?.pid;
    let host = env.client(env.host()).await?;
    let target = env.client(&member).await?;
    let fedapps: Api<FederatedMyApp> = Api::namespaced(host, NAMESPACE);
    let deployments: Api<Deployment> = Api::namespaced(target.clone(), NAMESPACE);
    let configs: Api<ConfigMap> = Api::namespaced(target, NAMESPACE);

    eprintln!(
        "bench footprint: baseline, {}s idle with no app",
        IDLE.as_secs()
    );
    let (agent_before, hub_before) = idle(agent, hub).await?;

    eprintln!("bench footprint: applying {apps} FederatedMyApps placed on {member}");
    let start = Instant::now();
    futures::stream::iter(0..apps)
        .map(|i| {
            let fedapps = fedapps.clone();
            let member = member.clone();
            async move {
                fedapps
                    .patch(
                        &name(i),
                        &PatchParams::apply("flotilla-bench").force(),
                        &Patch::Apply(fedapp(i, &member)),
                    )
                    .await
                    .with_context(|| format!("applying FederatedMyApp {}", name(i)))
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<_>>()
        .await?;
    crate::wait_for(
        TIMEOUT,
        &format!("{apps} MyApps reconciled on {member}"),
        || async { Ok((reconciled(&deployments, &configs).await? >= apps).then_some(())) },
    )
    .await?;
    let propagated = start.elapsed();
    eprintln!(
        "bench footprint: {apps} apps reconciled in {:.1}s; settling {}s, then {}s idle",
        propagated.as_secs_f64(),
        SETTLE.as_secs(),
        IDLE.as_secs()
    );
    tokio::time::sleep(SETTLE).await;
    let (agent_after, hub_after) = idle(agent, hub).await?;

    eprintln!("bench footprint: deleting the apps");
    fedapps
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels(LABEL),
        )
        .await
        .context("deleting the bench's FederatedMyApps")?;
    crate::wait_for(
        TIMEOUT,
        &format!("the bench's apps gone from {member}"),
        || async { Ok((reconciled(&deployments, &configs).await? == 0).then_some(())) },
    )
    .await?;
    Ok(report(
        &member,
        apps,
        propagated,
        [agent_before, agent_after],
        [hub_before, hub_after],
    ))
}

/// The table and the JSON object of one run; `[before, after]` for each process.
pub fn report(
    member: &str,
    apps: usize,
    propagated: Duration,
    agent: [Idle; 2],
    hub: [Idle; 2],
) -> Report {
    let hub_per_1000 = (hub[1].rss_mib - hub[0].rss_mib) * 1000.0 / apps as f64;
    let row = |what: &str, i: Idle| vec![what.to_owned(), cell(i.rss_mib, 1), cell(i.cpu_pct, 2)];
    Report {
        preamble: vec![format!(
            "footprint on {member}: {apps} MyApps (1 replica, a ConfigMap and a Deployment each), \
                 reconciled {:.1}s after the first write; CPU averaged over {}s idle",
            propagated.as_secs_f64(),
            IDLE.as_secs()
        )],
        header: ["", "RSS MiB", "CPU %"].map(String::from).to_vec(),
        rows: vec![
            row("agent, no app (baseline)", agent[0]),
            row(&format!("agent, {apps} apps"), agent[1]),
            row("hub, no app (baseline)", hub[0]),
            row(&format!("hub, {apps} pairs"), hub[1]),
        ],
        notes: vec![
            format!("hub: {hub_per_1000:.1} MiB per 1,000 pairs over its baseline"),
            "targets: agent ≤ 32 MiB with 1,000 MyApps, idle CPU ~0".into(),
        ],
        json: json!({
            "scenario": "footprint",
            "apps": apps,
            "agent_rss_mib": round(agent[1].rss_mib, 1),
            "agent_idle_cpu_pct": round(agent[1].cpu_pct, 2),
            "agent_baseline_rss_mib": round(agent[0].rss_mib, 1),
            "hub_rss_mib_per_1000_pairs": round(hub_per_1000, 2),
            "propagated_s": round(propagated.as_secs_f64(), 1),
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
    fn the_report_carries_the_issue_s_fields() {
        let idle = |rss_mib, cpu_pct| Idle { rss_mib, cpu_pct };
        let r = report(
            "cluster1",
            500,
            Duration::from_secs(20),
            [idle(15.0, 0.1), idle(25.0, 0.2)],
            [idle(30.0, 0.0), idle(40.0, 0.1)],
        );
        assert_eq!(r.json["agent_rss_mib"], 25.0);
        assert_eq!(r.json["agent_idle_cpu_pct"], 0.2);
        assert_eq!(r.json["hub_rss_mib_per_1000_pairs"], 20.0);
        assert!(r.table().contains("agent, 500 apps"));
    }
}
