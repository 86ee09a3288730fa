//! Under `spec.autoscaling`: the maximum divided as replicas are, the minimum within it,
//! failover moving both, and no make before break.

use super::*;

fn autoscaled(yaml: &str, min: i32, max: i32) -> Case {
    let mut c = Case::new(yaml);
    c.autoscaling = Some(Autoscaling {
        min_replicas: min,
        max_replicas: max,
    });
    c
}

const WEIGHTED: &str =
    "replicaScheduling: {mode: Weighted, preferences: [{clusterNames: [c1], weight: 2}]}";

fn bounds(s: &Schedule) -> Vec<(u32, u32)> {
    s.bounds.values().map(|b| (b.min, b.max)).collect()
}

#[test]
fn the_bounds_follow_the_weights() {
    let s = autoscaled(WEIGHTED, 4, 16).ok();
    assert_eq!(shares(&s), [(8, Weight), (4, Weight), (4, Weight)]);
    assert_eq!(bounds(&s), [(2, 8), (1, 4), (1, 4)]);
    assert_eq!(s.bounds["c2"].share_of(160.0), 40.0);
}

#[test]
fn a_failed_over_cluster_s_bounds_move_with_its_share() {
    let yaml = format!("{WEIGHTED}\nfailover: {{gracePeriodSeconds: 60}}");
    let mut c = autoscaled(&yaml, 4, 16);
    let s = c.ok();
    c.settle(&s);
    c.members.get_mut("c1").unwrap().not_ready_for = Some(Duration::from_secs(60));
    let failed = c.ok();
    assert_eq!(
        shares(&failed),
        [(8, FailedOver), (8, Failover), (8, Failover)]
    );
    assert_eq!(bounds(&failed), [(2, 8), (2, 8)], "c2 and c3 only");
    assert!(!failed.bounds.contains_key("c1"), "its copy is left alone");
}

#[test]
fn a_cluster_losing_its_share_keeps_it_until_the_others_run_their_new_minimum() {
    let mut c = autoscaled(WEIGHTED, 8, 16);
    let s = c.ok();
    assert_eq!(bounds(&s), [(4, 8), (2, 4), (2, 4)]);
    c.settle(&s);
    // c3 drops out (weight 0): c1 and c2 share 16 at 2:1 (10 and 6, minimums 5 and 3).
    c.placement = placement(
        "replicaScheduling: {mode: Weighted, preferences: [{clusterNames: [c1], weight: 2}, {clusterNames: [c3], weight: 0}]}",
    );
    for (cluster, ready) in [("c1", 4), ("c2", 2), ("c3", 2)] {
        c.set_ready(cluster, ready);
    }
    let held = c.ok();
    assert_eq!(shares(&held), [(10, Weight), (6, Weight), (4, Surplus)]);
    assert_eq!(held.recheck_after, Some(SURPLUS_RECHECK));
    // c1 and c2 get their new bounds at once; c3 keeps its own, and its part of the
    // metric, until they run their new minimums.
    assert_eq!(bounds(&held), [(5, 10), (3, 6), (2, 4)]);
    assert_eq!((held.bounds["c3"].parts, held.bounds["c3"].whole), (4, 20));
    c.set_ready("c1", 5);
    c.set_ready("c2", 3);
    let moved = c.ok();
    assert_eq!(shares(&moved), [(10, Weight), (6, Weight), (0, Weight)]);
    assert_eq!(bounds(&moved), [(5, 10), (3, 6)]);
    assert_eq!(moved.recheck_after, None);
}

#[test]
fn errors_name_the_autoscaling_fields() {
    let e = autoscaled(WEIGHTED, 1, 31).run().unwrap_err();
    assert_eq!(e.field, "spec.autoscaling.maxReplicas", "{e}");
    let e = autoscaled("replicaScheduling: {mode: Duplicated}", 1, 3)
        .run()
        .unwrap_err();
    assert_eq!(e.field, "spec.autoscaling");
    let e = autoscaled(
        "replicaScheduling: {mode: Weighted, totalReplicas: 3}",
        1,
        3,
    )
    .run()
    .unwrap_err();
    assert_eq!(e.field, "spec.placement.replicaScheduling.totalReplicas");
}
