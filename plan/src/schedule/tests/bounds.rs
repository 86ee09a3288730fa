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
fn bounds_move_at_once_without_make_before_break() {
    let mut c = autoscaled(WEIGHTED, 4, 16);
    let s = c.ok();
    c.settle(&s);
    c.set_ready("c3", 0);
    c.placement = placement(
        "replicaScheduling: {mode: Weighted, preferences: [{clusterNames: [c3], weight: 2}]}",
    );
    let moved = c.ok();
    assert_eq!(shares(&moved), [(4, Weight), (4, Weight), (8, Weight)]);
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
