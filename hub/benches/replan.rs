//! Re-planning after one cluster's readiness flips: 1,000 apps each placed by name on 3
//! of 300 clusters, and 10 on every cluster. The planner that planned the fleet plans
//! only the apps a moved cluster can affect; the baseline, measured in the same run, is
//! what a flip cost before: planning every app (a fresh planner's first pass).
//!
//! And one app applied on a fleet of 10,000 clusters whose shape did not move: every
//! trigger compares the clusters with the shape every app was planned for. The
//! baseline adds what that cost before: building the shape to compare it.

use std::collections::{BTreeMap, BTreeSet};
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use flotilla_crds::{AppKey, FederatedMyApp};
use flotilla_plan::AppPlan;
use flotilla_plan::grants::Grants;
use flotilla_plan::index::Desired;
use flotilla_plan::placement::{ClusterName, Member, Members};
use flotilla_plan::planner::{Effects, Planner, Trigger, key_of, shape};
use flotilla_plan::rollout::Observed;
use serde_json::json;

const CLUSTERS: usize = 300;
const APPS: usize = 1_000;
const EVERYWHERE: usize = 10;
const FLEET: usize = 10_000;

/// Counts the apps planned; keeps nothing.
#[derive(Default)]
struct Count(usize);

impl Effects for Count {
    fn set_app(&mut self, _: &AppKey, _: Option<i64>, d: BTreeMap<ClusterName, Desired>) -> bool {
        black_box(d);
        true
    }
    fn delete_app(&mut self, _: &AppKey, _: bool, _: &[String]) -> Vec<String> {
        Vec::new()
    }
    fn drop_app(&mut self, _: &AppKey, _: bool, _: bool) {}
    fn planned_for(&mut self, _: BTreeSet<String>) {}
    fn publish(&mut self, _: &AppKey, plan: AppPlan, _: Option<Vec<String>>) {
        self.0 += 1;
        black_box(plan);
    }
    fn forget(&mut self, _: &AppKey) {}
    fn observed(&self, _: &AppKey) -> Observed {
        Observed::default()
    }
}

fn app(i: usize, placement: serde_json::Value) -> Arc<FederatedMyApp> {
    let app = json!({
        "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
        "metadata": {"name": format!("app{i:04}"), "namespace": "default", "generation": 1,
                     "finalizers": ["core.kubefed.io/flotilla-hub"]},
        "spec": {"placement": placement,
                 "template": {"spec": {"replicas": 2, "image": "nginx:1.27"}}},
    });
    Arc::new(serde_json::from_value(app).unwrap())
}

fn fixture() -> (Vec<Arc<FederatedMyApp>>, Members, Members) {
    let name = |c: usize| format!("cluster{:03}", c % CLUSTERS);
    let mut apps: Vec<_> = (0..APPS)
        .map(|i| {
            let named: Vec<_> = (0..3).map(|k| json!({"name": name(i + k * 97)})).collect();
            app(i, json!({"clusters": named}))
        })
        .collect();
    apps.extend((0..EVERYWHERE).map(|i| app(APPS + i, json!({"clusterSelector": {}}))));
    let members: Members = (0..CLUSTERS)
        .map(|c| (name(c).into(), Member::default()))
        .collect();
    let mut flipped = members.clone();
    flipped.get_mut(name(7).as_str()).unwrap().not_ready_for = Some(Duration::ZERO);
    (apps, members, flipped)
}

fn bench(c: &mut Criterion) {
    let (apps, members, flipped) = fixture();
    let grants = Grants::default();
    let now = Instant::now();
    let members_of = |flip: bool| if flip { &flipped } else { &members };

    let mut planner = Planner::default();
    let mut first = Count::default();
    planner.handle(
        Trigger::Members,
        &apps,
        (&members, &grants),
        now,
        &mut first,
    );
    let mut once = Count::default();
    planner.handle(Trigger::Members, &apps, (&flipped, &grants), now, &mut once);
    println!(
        "replan: {} apps planned at first, {} after cluster007 turned NotReady",
        first.0, once.0
    );

    let mut group = c.benchmark_group("replan_one_readiness_flip_1000_apps_300_clusters");
    group.bench_function("baseline_every_app", |b| {
        let mut flip = false;
        b.iter(|| {
            flip = !flip;
            let mut fx = Count::default();
            let fresh = (members_of(flip), &grants);
            Planner::default().handle(Trigger::Members, &apps, fresh, now, &mut fx);
            black_box(fx.0)
        })
    });
    group.bench_function("incremental", |b| {
        let mut flip = false;
        b.iter(|| {
            flip = !flip;
            let mut fx = Count::default();
            let now_members = (members_of(flip), &grants);
            planner.handle(Trigger::Members, &apps, now_members, now, &mut fx);
            black_box(fx.0)
        })
    });
    group.finish();

    let fleet: Members = (0..FLEET)
        .map(|c| {
            let mut member = Member::default();
            member
                .labels
                .insert("zone".into(), format!("zone-{}", c % 3));
            member
                .labels
                .insert("region".into(), format!("region-{}", c % 7));
            (format!("cluster{c:03}").into(), member)
        })
        .collect();
    let named = apps[..APPS].to_vec();
    let mut planner = Planner::default();
    planner.handle(
        Trigger::Members,
        &named,
        (&fleet, &grants),
        now,
        &mut Count::default(),
    );
    let applied = || Trigger::Applied(key_of(&apps[0]));
    let mut group = c.benchmark_group("one_app_applied_10000_clusters");
    group.bench_function("baseline_shape_built", |b| {
        b.iter(|| {
            black_box(shape(&fleet));
            let mut fx = Count::default();
            planner.handle(applied(), &named, (&fleet, &grants), now, &mut fx);
            black_box(fx.0)
        })
    });
    group.bench_function("shape_compared_in_place", |b| {
        b.iter(|| {
            let mut fx = Count::default();
            planner.handle(applied(), &named, (&fleet, &grants), now, &mut fx);
            black_box(fx.0)
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
