//! `flotilla-bench join`: agent start → its MemberCluster Ready on the host, with the
//! cluster NotReady before each start (the agent stopped for longer than the heartbeat
//! grace). The floor, in the same run: a new client's first write to the host seen by
//! a host watch (a new TLS connection and one watch round trip, which any join needs).

use std::time::{Duration, Instant};

use anyhow::Result;
use flotilla_crds::MemberCluster;
use futures::Stream;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::watcher;
use serde_json::json;

use super::latency::{until, watch};
use super::{Report, cell, round};
use flotilla_lab::Env;
use flotilla_lab::federation::{
    Federation, HEARTBEAT_GRACE, agent_name, member_ready, wait_member_ready,
};

const FLOOR: &str = "join-floor";

/// A new client's first write to the host, until a watch sees it.
async fn floor(
    env: &Env,
    seen: &mut (impl Stream<Item = Result<ConfigMap, watcher::Error>> + Unpin),
    round: usize,
) -> Result<Duration> {
    let start = Instant::now();
    let fresh = env.client(env.host()).await?;
    let value = round.to_string();
    Api::<ConfigMap>::namespaced(fresh, "default")
        .patch(
            FLOOR,
            &PatchParams::apply("flotilla-bench").force(),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": FLOOR}, "data": {"round": value}})),
        )
        .await?;
    until(seen, |c: &ConfigMap| {
        c.data.as_ref().and_then(|d| d.get("round")) == Some(&value)
    })
    .await?;
    Ok(start.elapsed())
}

pub async fn join(env: &Env, samples: usize) -> Result<Report> {
    anyhow::ensure!(samples > 0, "--samples must be positive");
    let member = super::first_member(env)?;
    let federation = Federation::load(env)?;
    let agent = agent_name(&member);
    let host = env.client(env.host()).await?;
    let members: Api<MemberCluster> = Api::all(host.clone());
    let configs: Api<ConfigMap> = Api::namespaced(host.clone(), "default");
    let mut floor_seen = watch(configs.clone(), FLOOR);
    let (mut floors, mut joins) = (Vec::new(), Vec::new());
    for round in 0..samples {
        floors.push(floor(env, &mut floor_seen, round).await?.as_secs_f64());
        federation.stop(env, &agent)?;
        eprintln!(
            "bench join {}/{samples}: {agent} stopped; waiting for {member} NotReady",
            round + 1
        );
        wait_member_ready(&host, &member, false, HEARTBEAT_GRACE * 5).await?;
        let mut ready = watch(members.clone(), &member);
        let start = Instant::now();
        federation.start(env, &agent)?;
        until(&mut ready, member_ready).await?;
        joins.push(start.elapsed().as_secs_f64());
        federation.wait_ready(&agent).await?;
    }
    let _ = configs.delete(FLOOR, &DeleteParams::default()).await;
    Ok(report(&member, &floors, &joins))
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::MIN, f64::max)
}

pub fn report(member: &str, floor: &[f64], joins: &[f64]) -> Report {
    let row = |what: &str, v: &[f64]| vec![what.to_owned(), cell(median(v), 3), cell(max(v), 3)];
    Report {
        preamble: vec![format!(
            "join of {member}: agent start → MemberCluster Ready (NotReady before), {} samples",
            joins.len()
        )],
        header: ["", "median s", "max s"].map(String::from).to_vec(),
        rows: vec![
            row("floor: new client's first host write → watch", floor),
            row("flotilla: agent start → Ready", joins),
        ],
        notes: vec!["target: join ≤ 1 s".into()],
        json: json!({
            "scenario": "join",
            "samples": joins.len(),
            "join_s": round(median(joins), 3),
            "join_max_s": round(max(joins), 3),
            "floor_s": round(median(floor), 3),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_gives_the_median_join() {
        let r = report("cluster1", &[0.01, 0.02, 0.03], &[0.5, 0.9, 0.7]);
        assert_eq!(r.json["join_s"], 0.7);
        assert_eq!(r.json["join_max_s"], 0.9);
        assert!(r.table().contains("agent start → Ready"));
    }
}
