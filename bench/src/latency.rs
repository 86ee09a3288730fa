//! `flotilla-bench latency`: propagation latency, host write → the member's watch
//! sees the new MyApp, against a floor measured in the same run on the same clusters: a
//! FederatedMyApp write seen by a host watch plus a MyApp write seen by a member watch
//! (the two round trips any propagation needs, with the same kinds of object).
//!
//! Floor and Flotilla samples are interleaved, one of each per round, the order
//! alternating between rounds, so that both see the same load. The answer to "is
//! Flotilla's P99 within 10 ms of the floor's?" comes from a bootstrap interval of the
//! P99 difference: yes when all of it is at or below 10 ms, no when all of it is above,
//! and "too noisy to tell" when it straddles 10 ms.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use flotilla_crds::{FederatedMyApp, MyApp};
use futures::{Stream, StreamExt};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

use super::stats::{self, Verdict};
use super::{Report, cell, round};
use flotilla_lab::Env;

const PROBE: &str = "latency-probe";
/// Objects of the floor: a FederatedMyApp placed nowhere, a MyApp Flotilla does not manage.
const FLOOR: &str = "latency-floor";
const TIMEOUT: Duration = Duration::from_secs(30);

/// Waits on a watch stream until `done` holds for an object.
pub(super) async fn until<K, S>(stream: &mut S, done: impl Fn(&K) -> bool) -> Result<()>
where
    S: Stream<Item = Result<K, watcher::Error>> + Unpin,
{
    tokio::time::timeout(TIMEOUT, async {
        while let Some(obj) = stream.next().await {
            if done(&obj?) {
                return Ok(());
            }
        }
        bail!("the watch ended")
    })
    .await
    .context("no watch event within 30s")?
}

/// The objects named `name`, as a watch sees them.
pub(super) fn watch<K>(
    api: Api<K>,
    name: &str,
) -> impl Stream<Item = Result<K, watcher::Error>> + Unpin
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
    K::DynamicType: Default,
{
    Box::pin(
        watcher(
            api,
            watcher::Config::default().fields(&format!("metadata.name={name}")),
        )
        .applied_objects(),
    )
}

/// One server-side apply of `object` through `api`, timed until `stream` sees `seen`.
async fn round_trip<W, K>(
    api: &Api<W>,
    stream: &mut (impl Stream<Item = Result<K, watcher::Error>> + Unpin),
    name: &str,
    object: serde_json::Value,
    seen: impl Fn(&K) -> bool,
) -> Result<Duration>
where
    W: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    let start = Instant::now();
    api.patch(
        name,
        &PatchParams::apply("flotilla-latency").force(),
        &Patch::Apply(&object),
    )
    .await?;
    until(stream, seen).await?;
    Ok(start.elapsed())
}

/// The P99 difference a "within" verdict allows, ms.
pub const BOUND_MS: f64 = 10.0;
const BOOTSTRAP_ROUNDS: usize = 2000;
const CONFIDENCE: f64 = 0.95;

/// Samples in ms, and the figures drawn from them.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// P50, P90, P99.
    pub floor: [f64; 3],
    pub ours: [f64; 3],
    /// Bootstrap interval of ours P99 − floor P99.
    pub interval: stats::Interval,
    pub verdict: Verdict,
}

pub fn summarize(floor: &[f64], ours: &[f64]) -> Summary {
    let q = |v: &[f64]| {
        let s = stats::sorted(v);
        [0.5, 0.9, 0.99].map(|p| stats::percentile(&s, p))
    };
    let interval = stats::bootstrap_diff(ours, floor, 0.99, BOOTSTRAP_ROUNDS, CONFIDENCE, 0x5eed);
    Summary {
        floor: q(floor),
        ours: q(ours),
        interval,
        verdict: Verdict::of(interval, BOUND_MS),
    }
}

pub async fn latency(env: &Env, samples: usize, svg: Option<&Path>) -> Result<Report> {
    anyhow::ensure!(samples > 0, "--samples must be positive");
    let member = super::first_member(env)?;
    let host = env.client(env.host()).await?;
    let target = env.client(&member).await?;
    let fedapps: Api<FederatedMyApp> = Api::namespaced(host.clone(), "default");
    let myapps: Api<MyApp> = Api::namespaced(target.clone(), "default");
    let mut host_floor = watch(fedapps.clone(), FLOOR);
    let mut member_floor = watch(myapps.clone(), FLOOR);
    let mut member_probe = watch(myapps.clone(), PROBE);

    let fedapp = |name: &str, clusters: &[&str], replicas: i32| {
        json!({"apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp", "metadata": {"name": name, "namespace": "default"},
               "spec": {"placement": {"clusters": clusters.iter().map(|c| json!({"name": c})).collect::<Vec<_>>()},
                        "template": {"spec": {"replicas": replicas, "image": "nginx:1.27"}}}})
    };
    let myapp = |replicas: i32| {
        json!({"apiVersion": "app.example.com/v1", "kind": "MyApp", "metadata": {"name": FLOOR, "namespace": "default"},
               "spec": {"replicas": replicas}})
    };
    let has = |replicas: i32| move |a: &MyApp| a.spec.replicas == Some(replicas);
    let (mut floor, mut flotilla) = (Vec::new(), Vec::new());
    // One warm-up round, not counted: connections, caches, the first placement.
    for round in 0..=samples {
        let replicas = 1 + (round % 9) as i32;
        let floor_sample = async {
            let host = round_trip(
                &fedapps,
                &mut host_floor,
                FLOOR,
                fedapp(FLOOR, &[], replicas),
                |a: &FederatedMyApp| a.spec.template.spec.replicas == Some(replicas),
            )
            .await?;
            let on_member = round_trip(
                &myapps,
                &mut member_floor,
                FLOOR,
                myapp(replicas),
                has(replicas),
            )
            .await?;
            anyhow::Ok(host + on_member)
        };
        let flotilla_sample = round_trip(
            &fedapps,
            &mut member_probe,
            PROBE,
            fedapp(PROBE, &[&member], replicas),
            has(replicas),
        );
        // The order alternates, so that neither side always runs first.
        let (f, p) = if round % 2 == 0 {
            let f = floor_sample.await?;
            (f, flotilla_sample.await?)
        } else {
            let p = flotilla_sample.await?;
            (floor_sample.await?, p)
        };
        if round > 0 {
            floor.push(f.as_secs_f64() * 1000.0);
            flotilla.push(p.as_secs_f64() * 1000.0);
        }
    }
    for name in [PROBE, FLOOR] {
        let _ = fedapps.delete(name, &DeleteParams::default()).await;
    }
    let _ = myapps.delete(FLOOR, &DeleteParams::default()).await;

    if let Some(path) = svg {
        let title = format!("propagation latency, host → {member}: CDF of {samples} samples each");
        let chart = crate::chart::cdf_svg(
            &title,
            "ms",
            &[
                ("flotilla: host write → member watch", &flotilla),
                ("floor: host + member write→watch", &floor),
            ],
        )?;
        std::fs::write(path, chart).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("bench latency: the CDF chart is in {}", path.display());
    }
    let hub_binary = flotilla_lab::federation::Federation::load(env)
        .and_then(|f| Ok(f.launch(flotilla_lab::federation::HUB)?.program.clone()))
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "unknown".into());
    Ok(report(&member, samples, &hub_binary, &floor, &flotilla))
}

/// The table and the JSON object of one run.
pub fn report(
    member: &str,
    samples: usize,
    hub_binary: &str,
    floor: &[f64],
    ours: &[f64],
) -> Report {
    let s = summarize(floor, ours);
    let row = |what: &str, v: [f64; 3]| {
        let mut r = vec![what.to_owned()];
        r.extend(v.iter().map(|x| cell(*x, 1)));
        r
    };
    let diff = [0, 1, 2].map(|i| s.ours[i] - s.floor[i]);
    Report {
        preamble: vec![
            format!(
                "propagation latency, host → {member}, {samples} samples of each, interleaved (a replicas change each)"
            ),
            format!("hub and agents: {hub_binary}"),
        ],
        header: ["", "P50 ms", "P90 ms", "P99 ms"]
            .map(String::from)
            .to_vec(),
        rows: vec![
            row("floor: host + member write→watch", s.floor),
            row("flotilla: host write → member watch", s.ours),
            row("flotilla − floor", diff),
        ],
        notes: vec![format!(
            "P99 difference {:+.1} ms, {:.0}% bootstrap interval [{:+.1}, {:+.1}] ms ({BOOTSTRAP_ROUNDS} resamples): {}",
            diff[2],
            CONFIDENCE * 100.0,
            s.interval.low,
            s.interval.high,
            s.verdict.describe(BOUND_MS)
        )],
        json: json!({
            "scenario": "latency",
            "samples": samples,
            "ours_p50_ms": round(s.ours[0], 2),
            "ours_p90_ms": round(s.ours[1], 2),
            "ours_p99_ms": round(s.ours[2], 2),
            "floor_p50_ms": round(s.floor[0], 2),
            "floor_p90_ms": round(s.floor[1], 2),
            "floor_p99_ms": round(s.floor[2], 2),
            "minus_floor_p99_ms": round(diff[2], 2),
            "minus_floor_p99_ci_ms": [round(s.interval.low, 2), round(s.interval.high, 2)],
            "verdict": s.verdict.describe(BOUND_MS),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clear_shift_is_not_within_and_equal_samples_are_within() {
        let floor: Vec<f64> = (0..300).map(|i| 40.0 + f64::from(i % 50)).collect();
        let slower: Vec<f64> = floor.iter().map(|x| x + 50.0).collect();
        assert_eq!(summarize(&floor, &slower).verdict, Verdict::NotWithin);
        assert_eq!(summarize(&floor, &floor).verdict, Verdict::Within);
    }

    #[test]
    fn a_wide_tail_is_too_noisy_to_tell() {
        // Both mostly 40 ms, with rare tails of very different lengths.
        let floor: Vec<f64> = (0..100)
            .map(|i| if i % 40 == 0 { 120.0 } else { 40.0 })
            .collect();
        let ours: Vec<f64> = (0..100)
            .map(|i| if i % 40 == 1 { 60.0 } else { 40.0 })
            .collect();
        assert_eq!(summarize(&floor, &ours).verdict, Verdict::TooNoisy);
    }

    #[test]
    fn the_report_carries_the_issue_s_fields() {
        let r = report(
            "cluster1",
            3,
            "target/release/flotilla-hub",
            &[10.0, 20.0, 30.0],
            &[11.0, 21.0, 31.0],
        );
        for field in [
            "ours_p50_ms",
            "ours_p99_ms",
            "floor_p50_ms",
            "floor_p99_ms",
            "minus_floor_p99_ms",
        ] {
            assert!(r.json.get(field).is_some(), "{field}");
        }
        assert_eq!(r.json["ours_p50_ms"], 21.0);
        assert!(r.table().contains("flotilla − floor"));
    }
}
