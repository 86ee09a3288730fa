//! Render throughput: one FederatedMyApp × 100 clusters × 5 overrides each, against a
//! floor measured in the same run (serializing the template once per cluster, which any
//! render must at least do); and the same app dividing its replicas by weight.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use flotilla_crds::FederatedMyApp;
use flotilla_plan::admission::Admission;
use flotilla_plan::grants::Grants;
use flotilla_plan::placement::{Member, Members};
use flotilla_plan::{AppPlan, plan};
use serde_json::json;

const CLUSTERS: usize = 100;

fn fixture() -> (FederatedMyApp, Members) {
    let names: Vec<String> = (0..CLUSTERS).map(|i| format!("cluster{i:03}")).collect();
    let overrides: Vec<_> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            json!({"clusterName": name, "clusterOverrides": [
                {"path": "/spec/replicas", "value": 1 + i % 10},
                {"op": "add", "path": "/spec/port", "value": 8000 + i},
                {"op": "add", "path": "/spec/config/region", "value": format!("r{i}")},
                {"op": "add", "path": "/metadata/labels/shard", "value": format!("s{}", i % 7)},
                {"op": "replace", "path": "/spec/image", "value": format!("nginx:1.{i}")},
            ]})
        })
        .collect();
    let app = json!({
        "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
        "metadata": {"name": "bench", "namespace": "default"},
        "spec": {
            "placement": {"clusters": names.iter().map(|n| json!({"name": n})).collect::<Vec<_>>()},
            "template": {"metadata": {"labels": {"app": "bench"}},
                         "spec": {"replicas": 3, "image": "nginx:1.27", "config": {"a.conf": "x=1"}}},
            "overrides": overrides,
        }
    });
    let app: FederatedMyApp = serde_json::from_value(app).unwrap();
    // Every third cluster is labelled tier=gold, for the weighted variant's selector.
    let members = names
        .into_iter()
        .enumerate()
        .map(|(i, n)| {
            let tier = if i % 3 == 0 { "gold" } else { "silver" };
            (
                n.into(),
                Member::with_labels([("tier".into(), tier.into())].into()),
            )
        })
        .collect();
    (app, members)
}

/// Every placed cluster got its MyApp: no app error, no cluster error.
fn clean(planned: &AppPlan) -> bool {
    planned.placement_error.is_none() && planned.clusters.values().all(|p| p.rendered().is_some())
}

fn bench(c: &mut Criterion) {
    let (app, members) = fixture();
    assert!(
        clean(&plan(
            &app,
            &members,
            &Admission::default(),
            &Grants::default()
        )),
        "the fixture renders cleanly"
    );
    let mut group = c.benchmark_group("render_100_clusters_x_5_overrides");
    group.throughput(Throughput::Elements(CLUSTERS as u64));
    group.bench_function("floor_serialize_template_per_cluster", |b| {
        b.iter(|| {
            for _ in 0..CLUSTERS {
                black_box(serde_json::to_vec(black_box(&app.spec.template)).unwrap());
            }
        })
    });
    group.bench_function("render", |b| {
        b.iter(|| {
            black_box(plan(
                black_box(&app),
                &members,
                &Admission::default(),
                &Grants::default(),
            ))
        })
    });
    // The same app dividing 500 replicas by weight: the schedule's cost on top.
    let mut divided = app.clone();
    for o in &mut divided.spec.overrides {
        o.cluster_overrides.retain(|op| op.path != "/spec/replicas");
    }
    divided.spec.placement.replica_scheduling = Some(
        serde_json::from_value(json!({
            "mode": "Weighted", "totalReplicas": 500,
            "preferences": [{"clusterSelector": {"matchLabels": {"tier": "gold"}}, "weight": 3}],
        }))
        .unwrap(),
    );
    assert!(clean(&plan(
        &divided,
        &members,
        &Admission::default(),
        &Grants::default()
    )));
    group.bench_function("render_weighted", |b| {
        b.iter(|| {
            black_box(plan(
                black_box(&divided),
                &members,
                &Admission::default(),
                &Grants::default(),
            ))
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
