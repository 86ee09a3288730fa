//! Spread: maxClusters, minClusters, minGroups.

use super::*;

#[test]
fn spread_max_clusters_keeps_clusters_already_running() {
    let mut c = Case::new(
        "replicaScheduling: {mode: Weighted, totalReplicas: 6, preferences: [{clusterNames: [c3], weight: 5}]}\nspread: {maxClusters: 2}",
    );
    let s = c.ok();
    assert_eq!(shares(&s), [(1, Weight), (0, Spread), (5, Weight)]);
    // c2 becomes the heavier one: the running c1 still keeps its slot.
    c.settle(&s);
    c.placement = placement(
        "replicaScheduling: {mode: Weighted, totalReplicas: 6, preferences: [{clusterNames: [c3], weight: 5}, {clusterNames: [c2], weight: 2}]}\nspread: {maxClusters: 2}",
    );
    assert_eq!(shares(&c.ok()), [(1, Weight), (0, Spread), (5, Weight)]);
}

#[test]
fn spread_over_groups_gives_each_group_a_replica() {
    // Weights put everything in eu; two regions are required.
    let c = Case::new(
        "replicaScheduling: {mode: Weighted, totalReplicas: 2, preferences: [{clusterNames: [c3], weight: 0}, {weight: 10}]}\n\
         spread: {spreadByLabel: region, minGroups: 2}",
    );
    let s = c.ok();
    assert_eq!(s.clusters["c3"].replicas, 1, "{s:?}");
    assert_eq!(s.total(), 2);
    let e = Case::new(
        "replicaScheduling: {mode: Weighted}\nspread: {spreadByLabel: region, minGroups: 3}",
    )
    .run()
    .unwrap_err();
    assert_eq!(e.field, "spec.placement.spread.minGroups");
    assert_eq!(
        e.reason,
        "3 groups needed, the schedulable clusters form 2 by label region"
    );
}

#[test]
fn spread_min_clusters() {
    let s = Case::new(
        "replicaScheduling: {mode: Weighted, totalReplicas: 3, preferences: [{clusterNames: [c1], weight: 100}]}\nspread: {minClusters: 3}",
    )
    .ok();
    assert_eq!(shares(&s), [(1, Weight), (1, Weight), (1, Weight)]);
    let e = Case::new(
        "replicaScheduling: {mode: Weighted, totalReplicas: 2}\nspread: {minClusters: 3}",
    )
    .run()
    .unwrap_err();
    assert_eq!(e.field, "spec.placement.replicaScheduling.totalReplicas");
    let e = Case::new("spread: {minClusters: 4}").run().unwrap_err();
    assert_eq!(e.reason, "4 clusters needed, 3 can take replicas");
}

#[test]
fn duplicated_spread_picks_clusters_in_name_order() {
    let mut c = Case::new("spread: {maxClusters: 2}");
    let s = c.ok();
    assert_eq!(shares(&s), [(1, Duplicated), (1, Duplicated), (0, Spread)]);
    // Once c3 runs it and c1 does not, c3 keeps it.
    c.previous = [("c2", 1), ("c3", 1)]
        .into_iter()
        .map(|(n, r)| {
            (
                n.to_owned(),
                Previous {
                    replicas: r,
                    ready_replicas: r,
                    reason: Some(Duplicated),
                },
            )
        })
        .collect();
    assert_eq!(
        shares(&c.ok()),
        [(0, Spread), (1, Duplicated), (1, Duplicated)]
    );
}
