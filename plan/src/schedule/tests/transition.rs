//! Cordon, NotReady and failover, recovery, and make before break.

use super::*;

#[test]
fn cordon_keeps_what_runs_and_sends_nothing_new() {
    let mut c = Case::new(WEIGHTED_2_1_1);
    let s = c.ok();
    c.settle(&s);
    c.members.get_mut("c1").unwrap().unschedulable = true;
    assert_eq!(c.ok(), s.clone().with_reason("c1", Cordoned));
    // Scaling up: the new replicas go elsewhere.
    c.placement = placement(
        "replicaScheduling: {mode: Weighted, totalReplicas: 16, preferences: [{clusterNames: [c1], weight: 2}]}",
    );
    assert_eq!(shares(&c.ok()), [(6, Cordoned), (5, Weight), (5, Weight)]);
    // A cordoned cluster that runs nothing gets nothing, in either mode.
    c.previous.clear();
    assert_eq!(shares(&c.ok()), [(0, Cordoned), (8, Weight), (8, Weight)]);
    c.placement = placement("clusters: [{name: c1}, {name: c2}, {name: c3}]");
    assert_eq!(
        shares(&c.ok()),
        [(0, Cordoned), (1, Duplicated), (1, Duplicated)]
    );
}

#[test]
fn not_ready_within_grace_changes_nothing_and_says_when_to_look_again() {
    let mut c = Case::new(FAILOVER);
    let s = c.ok();
    c.settle(&s);
    c.members.get_mut("c1").unwrap().not_ready_for = Some(Duration::from_secs(45));
    let now = c.ok();
    assert_eq!(shares(&now), [(6, NotReady), (3, Weight), (3, Weight)]);
    assert_eq!(now.recheck_after, Some(Duration::from_secs(15)));
    // Without failover, a NotReady cluster keeps its share for good.
    c.placement = placement(WEIGHTED_2_1_1);
    c.members.get_mut("c1").unwrap().not_ready_for = Some(Duration::from_secs(4500));
    let s = c.ok();
    assert_eq!(shares(&s), [(6, NotReady), (3, Weight), (3, Weight)]);
    assert_eq!(s.recheck_after, None);
}

#[test]
fn failover_moves_the_share_and_leaves_the_copy_alone() {
    let mut c = Case::new(FAILOVER);
    let s = c.ok();
    c.settle(&s);
    c.members.get_mut("c1").unwrap().not_ready_for = Some(Duration::from_secs(60));
    let failed = c.ok();
    assert_eq!(
        shares(&failed),
        [(6, FailedOver), (6, Failover), (6, Failover)]
    );
    assert_eq!(
        failed.total(),
        12,
        "the failed cluster's copy is not counted"
    );
    // Stable while it stays down, once the replacements run.
    c.settle(&failed);
    assert_eq!(c.ok(), failed);
}

#[test]
fn rebalance_scales_the_others_down_only_once_the_returned_cluster_is_ready() {
    let mut c = Case::new(FAILOVER);
    let s = c.ok();
    c.settle(&s);
    c.members.get_mut("c1").unwrap().not_ready_for = Some(Duration::from_secs(600));
    let failed = c.ok();
    c.settle(&failed);
    c.set_ready("c1", 0);
    c.members.get_mut("c1").unwrap().not_ready_for = None;
    let back = c.ok();
    assert_eq!(shares(&back), [(6, Weight), (6, Surplus), (6, Surplus)]);
    assert_eq!(back.recheck_after, Some(SURPLUS_RECHECK));
    c.settle(&back);
    c.set_ready("c1", 5);
    assert_eq!(shares(&c.ok()), [(6, Weight), (6, Surplus), (6, Surplus)]);
    c.set_ready("c1", 6);
    assert_eq!(c.ok(), s);
}

#[test]
fn stay_keeps_the_replicas_where_they_moved_until_the_spec_changes() {
    let mut c = Case::new(&format!("{FAILOVER}\n").replace(
        "gracePeriodSeconds: 60}",
        "gracePeriodSeconds: 60, onRecovery: Stay}",
    ));
    let s = c.ok();
    c.settle(&s);
    c.members.get_mut("c1").unwrap().not_ready_for = Some(Duration::from_secs(600));
    let failed = c.ok();
    c.settle(&failed);
    c.set_ready("c2", 4);
    c.members.get_mut("c1").unwrap().not_ready_for = None;
    // c2's moved replicas are not all Ready: c1 keeps what it runs meanwhile.
    assert_eq!(shares(&c.ok()), [(6, Recovered), (6, Weight), (6, Weight)]);
    c.set_ready("c2", 6);
    let stayed = c.ok();
    assert_eq!(shares(&stayed), [(0, Recovered), (6, Weight), (6, Weight)]);
    c.settle(&stayed);
    assert_eq!(c.ok(), stayed, "it stays");
    c.spec_changed = true;
    let after_edit = c.ok();
    assert_eq!(after_edit.clusters["c1"].replicas, 6);
    assert_eq!(after_edit.clusters["c2"].reason, Surplus);
}

#[test]
fn make_before_break_when_weights_change() {
    let mut c = Case::new(WEIGHTED_2_1_1);
    let s = c.ok();
    c.settle(&s);
    c.placement = placement(
        "replicaScheduling: {mode: Weighted, totalReplicas: 12, preferences: [{clusterNames: [c3], weight: 2}]}",
    );
    assert_eq!(shares(&c.ok()), [(6, Surplus), (3, Weight), (6, Weight)]);
    c.set_ready("c3", 6);
    assert_eq!(shares(&c.ok()), [(3, Weight), (3, Weight), (6, Weight)]);
    // Scaling down has nothing to wait for.
    c.placement = placement(
        "replicaScheduling: {mode: Weighted, totalReplicas: 4, preferences: [{clusterNames: [c1], weight: 2}]}",
    );
    assert_eq!(shares(&c.ok()), [(2, Weight), (1, Weight), (1, Weight)]);
}
