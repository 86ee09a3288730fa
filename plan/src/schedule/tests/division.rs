//! Weighted and Duplicated divisions, and the fields validation names.

use super::*;

#[test]
fn no_scheduling_is_duplicated_as_before() {
    let mut c = Case::new("clusters: [{name: c1}, {name: c2}, {name: c3}]");
    c.template_replicas = Some(3);
    let s = c.ok();
    assert!(!s.divided);
    assert_eq!(shares(&s), [(3, Duplicated); 3]);
    assert_eq!(s.recheck_after, None);
    // A NotReady cluster is rendered for, as it always was.
    c.members.get_mut("c2").unwrap().not_ready_for = Some(Duration::from_secs(9999));
    assert_eq!(shares(&c.ok()), [(3, Duplicated); 3]);
}

#[test]
fn weighted_two_one_one() {
    let s = Case::new(WEIGHTED_2_1_1).ok();
    assert!(s.divided);
    assert_eq!(shares(&s), [(6, Weight), (3, Weight), (3, Weight)]);
    assert_eq!(s.total(), 12);
}

#[test]
fn weights_by_selector_first_match_wins() {
    let c = Case::new(
        "replicaScheduling: {mode: Weighted, totalReplicas: 8, preferences: [\
         {clusterNames: [c2], weight: 3}, {clusterSelector: {matchLabels: {region: eu}}, weight: 1}, {weight: 0}]}",
    );
    assert_eq!(shares(&c.ok()), [(2, Weight), (6, Weight), (0, Weight)]);
}

#[test]
fn total_defaults_to_the_template_replicas() {
    let mut c = Case::new("replicaScheduling: {mode: Weighted}");
    assert_eq!(c.ok().total(), 1);
    c.template_replicas = Some(7);
    assert_eq!(shares(&c.ok()), [(3, Weight), (2, Weight), (2, Weight)]);
}

#[test]
fn min_and_max_per_cluster() {
    let c = Case::new(
        "replicaScheduling: {mode: Weighted, totalReplicas: 12, preferences: [\
         {clusterNames: [c1], maxReplicas: 2}, {clusterNames: [c3], minReplicas: 6}]}",
    );
    assert_eq!(shares(&c.ok()), [(2, Weight), (4, Weight), (6, Weight)]);
}

#[test]
fn infeasible_totals_are_reported_naming_the_field() {
    let e = Case::new("replicaScheduling: {mode: Weighted, totalReplicas: 31}")
        .run()
        .unwrap_err();
    assert_eq!(e.field, "spec.placement.replicaScheduling.totalReplicas");
    assert_eq!(
        e.reason,
        "31 replicas cannot be divided: 3 schedulable cluster(s) take 0 to 30 between them"
    );
    let e = Case::new(
        "replicaScheduling: {mode: Weighted, totalReplicas: 2, preferences: [{minReplicas: 1}]}",
    )
    .run()
    .unwrap_err();
    assert!(e.reason.contains("take 3 to 30"), "{e}");
}

#[test]
fn invalid_fields_are_named() {
    for (yaml, field, reason) in [
        (
            "replicaScheduling: {mode: Weighted, totalReplicas: -1}",
            "spec.placement.replicaScheduling.totalReplicas",
            "-1 is negative",
        ),
        (
            "replicaScheduling: {mode: Weighted, preferences: [{}, {weight: -2}]}",
            "spec.placement.replicaScheduling.preferences[1].weight",
            "must not be negative",
        ),
        (
            "replicaScheduling: {mode: Weighted, preferences: [{minReplicas: 4, maxReplicas: 3}]}",
            "spec.placement.replicaScheduling.preferences[0].maxReplicas",
            "3 is below minReplicas 4",
        ),
        (
            "replicaScheduling: {mode: Weighted, preferences: [{minReplicas: 11}]}",
            "spec.placement.replicaScheduling.preferences[0].minReplicas",
            "11 is above the MyApp's limit of 10 per cluster",
        ),
        (
            "replicaScheduling: {mode: Weighted, preferences: [{clusterSelector: {matchExpressions: [{key: r, operator: In}]}}]}",
            "spec.placement.replicaScheduling.preferences[0].clusterSelector.matchExpressions[0]",
            "operator In needs at least one value",
        ),
        (
            "spread: {maxClusters: 0}",
            "spec.placement.spread.maxClusters",
            "must be at least 1",
        ),
        (
            "spread: {minClusters: 3, maxClusters: 2}",
            "spec.placement.spread.maxClusters",
            "2 is below minClusters 3",
        ),
        (
            "spread: {minGroups: 2}",
            "spec.placement.spread.spreadByLabel",
            "minGroups needs a label to group by",
        ),
        (
            "spread: {minClusters: -1}",
            "spec.placement.spread.minClusters",
            "must not be negative",
        ),
    ] {
        let e = Case::new(yaml).run().unwrap_err();
        assert_eq!(
            (e.field.as_str(), e.reason.as_str()),
            (field, reason),
            "{yaml}"
        );
    }
}
