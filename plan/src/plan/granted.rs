//! Placement within a namespace's ClusterGrants: a cluster not granted gets nothing new
//! and keeps what it runs; a grant withdrawn is never a Delete; the app's deletion still
//! deletes everywhere.

use std::collections::BTreeMap;

use flotilla_crds::{ClusterGrant, FederatedMyApp};
use serde_json::json;

use super::*;
use crate::index::Change;
use crate::index::compact::CompactIndex;
use crate::placement::Member;
use crate::status::{Inputs, compute};

fn app(placement: serde_json::Value, replicas: i64) -> FederatedMyApp {
    serde_json::from_value(json!({
        "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
        "metadata": {"name": "web", "namespace": "team", "generation": 1},
        "spec": {"placement": placement,
                 "template": {"spec": {"replicas": replicas, "image": "nginx:1.27"}}},
    }))
    .expect("a FederatedMyApp")
}

fn grant(spec: serde_json::Value) -> ClusterGrant {
    serde_json::from_value(json!({
        "apiVersion": "flotilla.io/v1alpha1", "kind": "ClusterGrant",
        "metadata": {"name": "g", "namespace": "team"}, "spec": spec,
    }))
    .expect("a ClusterGrant")
}

fn members() -> Members {
    ["c1", "c2", "c3"]
        .map(|c| {
            let labels = [("name".to_owned(), c.to_owned())].into();
            (c.into(), Member::with_labels(labels))
        })
        .into()
}

fn to_c1(required: bool) -> Grants {
    Grants::new(required, [&grant(json!({"clusters": ["c1"]}))])
}

fn planned(app: &FederatedMyApp, grants: &Grants) -> AppPlan {
    plan(app, &members(), &Admission::default(), grants)
}

fn not_granted(named: bool) -> ClusterPlan {
    ClusterPlan::Keep(KeepReason::NotGranted {
        namespace: "team".into(),
        named,
    })
}

#[test]
fn a_selector_places_only_on_granted_clusters_and_keeps_the_rest_unreported() {
    let p = planned(&app(json!({"clusterSelector": {}}), 2), &to_c1(false));
    assert!(p.placement_error.is_none(), "{p:?}");
    assert!(p.clusters["c1"].rendered().is_some());
    for c in ["c2", "c3"] {
        assert_eq!(p.clusters[c], not_granted(false), "{c}");
        assert_eq!(p.desired()[c], Desired::Keep, "{c} keeps what it runs");
    }
    let reported: Vec<&str> = p.reported().map(|(c, _)| &**c).collect();
    assert_eq!(
        reported,
        ["c1"],
        "a tenant is not told of clusters it may not use"
    );
}

#[test]
fn a_named_cluster_not_granted_is_reported_by_name_and_namespace() {
    let named = json!({"clusters": [{"name": "c2"}, {"name": "c1"}, {"name": "ghost"}]});
    let p = planned(&app(named, 1), &to_c1(false));
    assert!(p.clusters["c1"].rendered().is_some());
    assert_eq!(p.clusters["c2"], not_granted(true));
    assert_eq!(p.clusters["ghost"], ClusterPlan::Unknown);
    assert_eq!(p.clusters["c2"].error_reason(), "NotGranted");
    let message = p.clusters["c2"].error().expect("an error");
    assert!(
        message.starts_with("cluster is not granted to namespace team"),
        "{message}"
    );
    let status = compute(
        &Inputs {
            plan: &p,
            deleting_on: None,
            reports: None,
            reachable: &Default::default(),
        },
        None,
        &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()),
    );
    let c2 = status.clusters.iter().find(|c| c.name == "c2").expect("c2");
    assert_eq!(c2.message, message);
    assert_eq!(status.placed_clusters, 1);
    // Named only where it is not granted: nothing placed, and both conditions say why.
    let p = planned(
        &app(json!({"clusters": [{"name": "c2"}]}), 1),
        &to_c1(false),
    );
    let status = compute(
        &Inputs {
            plan: &p,
            deleting_on: None,
            reports: None,
            reachable: &Default::default(),
        },
        None,
        &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()),
    );
    for type_ in ["Propagated", "Ready", "Stalled"] {
        let c = status.conditions.iter().find(|c| c.type_ == type_);
        assert_eq!(c.map(|c| c.reason.as_str()), Some("NotGranted"), "{type_}");
    }
}

#[test]
fn replicas_are_divided_among_granted_clusters_only() {
    let weighted = json!({"clusterSelector": {},
                          "replicaScheduling": {"mode": "Weighted", "totalReplicas": 6}});
    let two = Grants::new(
        false,
        [&grant(json!({"clusterSelector": {"matchExpressions": [
            {"key": "name", "operator": "In", "values": ["c1", "c2"]}]}}))],
    );
    let p = planned(&app(weighted, 1), &two);
    let schedule = p.schedule.as_ref().expect("a schedule");
    let replicas: BTreeMap<&str, u32> = (schedule.clusters.iter())
        .map(|(c, a)| (&**c, a.replicas))
        .collect();
    assert_eq!(replicas, [("c1", 3), ("c2", 3)].into());
    assert_eq!(p.clusters["c3"], not_granted(false));
}

/// Nothing granted at all (no grant in strict mode, grants that match no cluster): the
/// app as a whole is not planned, every registered cluster keeps what it runs, and the
/// app's conditions say why.
#[test]
fn nothing_granted_plans_nowhere_and_keeps_everything() {
    let app = app(json!({"clusterSelector": {}}), 1);
    let nobody = Grants::new(true, [&grant(json!({"clusters": ["ghost"]}))]);
    let strict = Grants::new(true, std::iter::empty());
    for (grants, message) in [
        (
            &strict,
            "namespace team has no ClusterGrant and this hub requires one (--require-namespace-grant): it may place on no cluster",
        ),
        (
            &nobody,
            "the ClusterGrants of namespace team (g) grant no registered cluster",
        ),
    ] {
        let p = planned(&app, grants);
        let e = p.placement_error.as_ref().expect("not planned");
        assert_eq!(
            (e.reason(), e.to_string().as_str()),
            ("NotGranted", message)
        );
        assert_eq!(p.desired().len(), 3);
        assert!(p.desired().values().all(|d| *d == Desired::Keep));
        let status = compute(
            &Inputs {
                plan: &p,
                deleting_on: None,
                reports: None,
                reachable: &Default::default(),
            },
            None,
            &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            ),
        );
        for type_ in ["Propagated", "Ready"] {
            let c = status.conditions.iter().find(|c| c.type_ == type_).unwrap();
            assert_eq!(
                (c.reason.as_str(), c.message.as_str()),
                ("NotGranted", message)
            );
        }
    }
    // The default mode: no grant, every cluster.
    let open = planned(&app, &Grants::default());
    assert_eq!(open.desired().len(), 3);
    assert!(
        open.desired()
            .values()
            .all(|d| matches!(d, Desired::Apply(_)))
    );
}

/// The rule of this module: withdrawing a grant (narrowing it, deleting the last one in
/// strict mode) pushes no Delete; deleting the app then deletes every copy.
#[test]
fn a_withdrawn_grant_pushes_no_delete_and_the_apps_deletion_deletes_everywhere() {
    let key = crate::AppKey::new("team", "web");
    let everywhere = app(json!({"clusterSelector": {}}), 1);
    for required in [false, true] {
        let mut index = CompactIndex::default();
        let all = Grants::new(required, [&grant(json!({"clusterSelector": {}}))]);
        let pushes = index.set_app(&key, Some(1), planned(&everywhere, &all).desired());
        assert_eq!(pushes.len(), 3, "applied on every cluster");
        let mut managed = std::collections::HashMap::new();
        managed.insert(key.clone(), "whatever".to_owned());
        for c in ["c1", "c2", "c3"] {
            index.connect(c, &managed, crate::index::Scope::All);
        }
        let narrowed = planned(&everywhere, &to_c1(required));
        let pushes = index.set_app(&key, Some(1), narrowed.desired());
        assert!(pushes.is_empty(), "narrowed: {pushes:?}");
        let gone = planned(&everywhere, &Grants::new(required, std::iter::empty()));
        let pushes = index.set_app(&key, Some(1), gone.desired());
        let deletes = (pushes.iter()).filter(|(_, _, c)| matches!(c, Change::Delete { .. }));
        assert_eq!(deletes.count(), 0, "withdrawn (required: {required})");
        for c in ["c1", "c2", "c3"] {
            assert!(
                index.desired_shared(c).iter().any(|k| **k == key),
                "{c} keeps it desired"
            );
        }
        let placed: Vec<String> = gone.desired().into_keys().map(|c| c.to_string()).collect();
        let pushes = index.delete_app(&key, false, &placed, std::time::Instant::now());
        let mut deleted: Vec<&str> = (pushes.iter())
            .filter(|(_, _, c)| *c == Change::Delete { orphan: false })
            .map(|(c, _, _)| c.as_str())
            .collect();
        deleted.sort_unstable();
        assert_eq!(deleted, ["c1", "c2", "c3"], "required: {required}");
    }
}
