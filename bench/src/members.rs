//! The MemberCluster watch under a fleet-wide event: every cluster turns NotReady, then
//! Ready again (a network partition healing, a hub's heartbeat grace passing for all),
//! with every cluster's agent connected. One event per cluster; the figure is the
//! watch's work per event against the floor, the same events only written to the store.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use flotilla_crds::MemberCluster;
use flotilla_crds::member::MemberClusterStatus;
use flotilla_hub::auth::Identity;
use flotilla_hub::dispatch::Dispatcher;
use flotilla_hub::membership::{MemberChanges, Membership, watch_members};
use flotilla_hub::status::StatusBoard;
use flotilla_plan::index::Scope;
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::runtime::{reflector, watcher};
use serde_json::json;

use super::{Report, cell, procstat, round};

fn member(name: &str, ready: bool) -> MemberCluster {
    let mut m = MemberCluster::new(name, Default::default());
    m.spec.token_sha256 = Some(format!("hash-{name}"));
    m.status = Some(MemberClusterStatus {
        conditions: vec![Condition {
            type_: "Ready".into(),
            status: if ready { "True" } else { "False" }.into(),
            reason: "Bench".into(),
            message: String::new(),
            last_transition_time: Time(k8s_openapi::jiff::Timestamp::now()),
            observed_generation: None,
        }],
        ..Default::default()
    });
    m
}

/// The list, then every cluster NotReady, then every cluster Ready: `3 × clusters` events.
fn events(clusters: usize) -> Vec<watcher::Event<MemberCluster>> {
    let names: Vec<String> = (0..clusters).map(|i| format!("cluster-{i:05}")).collect();
    let mut events = vec![watcher::Event::Init];
    events.extend(
        names
            .iter()
            .map(|n| watcher::Event::InitApply(member(n, true))),
    );
    events.push(watcher::Event::InitDone);
    for ready in [false, true] {
        events.extend(
            names
                .iter()
                .map(|n| watcher::Event::Apply(member(n, ready))),
        );
    }
    events
}

/// Seconds and CPU seconds of this process for `run`.
async fn timed(run: impl Future<Output = Result<()>>) -> Result<(f64, f64)> {
    let (cpu, at) = (procstat::sample(None)?.cpu_s, Instant::now());
    run.await?;
    Ok((
        at.elapsed().as_secs_f64(),
        procstat::sample(None)?.cpu_s - cpu,
    ))
}

pub async fn members(clusters: usize) -> Result<Report> {
    // The floor: the store alone.
    let (_, writer) = reflector::store::<MemberCluster>();
    let stream = futures::stream::iter(events(clusters).into_iter().map(Ok));
    let floor = timed(async {
        reflector(writer, stream).for_each(|_| async {}).await;
        Ok(())
    })
    .await?;

    // The watch, every cluster's agent connected.
    let dispatcher = Arc::new(Dispatcher::default());
    let mut sessions = Vec::with_capacity(clusters);
    for i in 0..clusters {
        let name = format!("cluster-{i:05}");
        let identity = Identity {
            token_hash: format!("hash-{name}"),
            cluster: name,
        };
        sessions.push(dispatcher.connect(&identity, &HashMap::new(), Scope::All)?);
    }
    let board = Arc::new(StatusBoard::default());
    let membership = Arc::new(Membership::new(Duration::from_secs(40)).with_status(board));
    let (members, writer) = reflector::store::<MemberCluster>();
    let stream = futures::stream::iter(events(clusters).into_iter().map(Ok));
    let (changed, _changes) = tokio::sync::watch::channel(MemberChanges::default());
    // Never called: no MemberCluster here asks for a collection to be confirmed.
    let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse()?))?;
    let watched = timed(async {
        let stream = reflector(writer, stream);
        let ended = watch_members(
            stream,
            members,
            dispatcher.clone(),
            membership,
            changed,
            client,
        );
        ensure!(ended.await.is_err(), "the watch ends with its stream");
        Ok(())
    })
    .await?;
    ensure!(
        sessions.iter().all(|s| !s.closed.is_cancelled()),
        "no session's credential changed: none may be closed"
    );

    let events = 3 * clusters;
    // Wall time, in this one process: CPU time is counted in ticks of 10 ms.
    let per_event = |(seconds, _): (f64, f64)| seconds * 1e6 / events as f64;
    let row = |case: &str, t: (f64, f64)| {
        vec![
            case.to_owned(),
            cell(t.0, 2),
            cell(t.1, 2),
            cell(per_event(t), 1),
            cell(per_event(t) / per_event(floor), 1),
        ]
    };
    Ok(Report {
        preamble: vec![
            format!(
                "members: {clusters} MemberClusters, each with its agent connected; {events} events (the list, all NotReady, all Ready)"
            ),
            "in this process: the reflector's store alone (floor), then the hub's MemberCluster watch over the same events".into(),
        ],
        header: ["case", "seconds", "CPU s", "µs/event", "× floor"]
            .map(String::from)
            .to_vec(),
        rows: vec![
            row("floor: the store alone", floor),
            row("hub: watch_members", watched),
        ],
        notes: vec![],
        json: json!({
            "clusters": clusters,
            "events": events,
            "floor_us_per_event": round(per_event(floor), 2),
            "watch_us_per_event": round(per_event(watched), 2),
        }),
    })
}
