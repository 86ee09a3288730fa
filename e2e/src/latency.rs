//! `flotilla-e2e latency`: propagation latency, host write → the member's watch sees the
//! new MyApp, against a floor measured in the same run on the same clusters: a
//! FederatedMyApp write seen by a host watch plus a MyApp write seen by a member watch
//! (the two round trips any propagation needs, with the same kinds of object).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use flotilla_crds::{FederatedMyApp, MyApp};
use futures::{Stream, StreamExt};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

use crate::Env;

const PROBE: &str = "latency-probe";
/// Objects of the floor: a FederatedMyApp placed nowhere, a MyApp Flotilla does not manage.
const FLOOR: &str = "latency-floor";
const TIMEOUT: Duration = Duration::from_secs(30);

/// Waits on a watch stream until `done` holds for an object.
async fn until<K, S>(stream: &mut S, done: impl Fn(&K) -> bool) -> Result<()>
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

fn watch<K>(api: Api<K>, name: &str) -> impl Stream<Item = Result<K, watcher::Error>> + Unpin
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

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

pub async fn latency(env: &Env, samples: usize) -> Result<()> {
    let member = env
        .members()
        .first()
        .copied()
        .context("no member cluster")?
        .to_owned();
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
        let f = round_trip(
            &fedapps,
            &mut host_floor,
            FLOOR,
            fedapp(FLOOR, &[], replicas),
            |a: &FederatedMyApp| a.spec.template.spec.replicas == Some(replicas),
        )
        .await?
            + round_trip(
                &myapps,
                &mut member_floor,
                FLOOR,
                myapp(replicas),
                has(replicas),
            )
            .await?;
        let p = round_trip(
            &fedapps,
            &mut member_probe,
            PROBE,
            fedapp(PROBE, &[&member], replicas),
            has(replicas),
        )
        .await?;
        if round > 0 {
            floor.push(f);
            flotilla.push(p);
        }
    }
    for name in [PROBE, FLOOR] {
        let _ = fedapps.delete(name, &DeleteParams::default()).await;
    }
    let _ = myapps.delete(FLOOR, &DeleteParams::default()).await;

    floor.sort();
    flotilla.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let row = |v: &[Duration]| [0.5, 0.9, 0.99].map(|p| ms(percentile(v, p)));
    println!("propagation latency, host → {member}, {samples} samples (a replicas change each)");
    println!("{:<40} {:>8} {:>8} {:>8}", "", "P50 ms", "P90 ms", "P99 ms");
    let (f, p) = (row(&floor), row(&flotilla));
    for (what, v) in [
        ("floor: host + member write→watch", f),
        ("flotilla: host write → member watch", p),
        ("flotilla − floor", [p[0] - f[0], p[1] - f[1], p[2] - f[2]]),
    ] {
        println!("{what:<40} {:>8.1} {:>8.1} {:>8.1}", v[0], v[1], v[2]);
    }
    Ok(())
}
