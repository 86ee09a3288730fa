//! Capacity: the room each cluster reports, and the hysteresis band.

use super::*;

#[test]
fn capacity_follows_the_room_and_never_exceeds_it() {
    let mut c = Case::new("replicaScheduling: {mode: Capacity, totalReplicas: 6}");
    c.request = Resources {
        cpu_millis: 500,
        memory_bytes: 1,
    };
    // Room for 8, 4 and 0 replicas.
    with_capacity(&mut c, [4000, 2000, 400]);
    assert_eq!(
        shares(&c.ok()),
        [(4, Capacity), (2, Capacity), (0, Capacity)]
    );
    // Room for 2, 1, 0: 3 replicas fit, 6 do not.
    with_capacity(&mut c, [1000, 500, 0]);
    let e = c.run().unwrap_err();
    assert!(e.reason.contains("take 0 to 3"), "{e}");
    // A cluster without a capacity report gets nothing.
    c.members.get_mut("c1").unwrap().capacity = None;
    c.placement = placement("replicaScheduling: {mode: Capacity, totalReplicas: 1}");
    assert_eq!(
        shares(&c.ok()),
        [(0, Capacity), (1, Capacity), (0, Capacity)]
    );
}

#[test]
fn capacity_counts_the_replicas_a_cluster_already_runs() {
    let mut c = Case::new("replicaScheduling: {mode: Capacity, totalReplicas: 6}");
    c.request = Resources {
        cpu_millis: 1000,
        memory_bytes: 1,
    };
    with_capacity(&mut c, [3000, 3000, 0]);
    let s = c.ok();
    assert_eq!(shares(&s), [(3, Capacity), (3, Capacity), (0, Capacity)]);
    c.settle(&s);
    // Our own pods filled the room: the division must not move.
    with_capacity(&mut c, [0, 0, 0]);
    assert_eq!(c.ok(), s);
}

#[test]
fn capacity_hysteresis_keeps_the_division_through_small_changes() {
    let mut c = Case::new("replicaScheduling: {mode: Capacity, totalReplicas: 10}");
    c.request = Resources {
        cpu_millis: 100,
        memory_bytes: 1,
    };
    with_capacity(&mut c, [1000, 1000, 1000]);
    let s = c.ok();
    assert_eq!(shares(&s), [(4, Capacity), (3, Capacity), (3, Capacity)]);
    c.settle(&s);
    // The running replicas use room; a little more frees up on c3 than c1.
    with_capacity(&mut c, [600, 700, 1000]);
    assert_eq!(c.ok(), s, "a small change moves nothing");
    // c3 grows a lot: replicas move there, the others hold theirs until they run. (Its
    // weight, 63 replicas' room, counts as 4 × the median, 40: 6 of 10, not 7.)
    with_capacity(&mut c, [600, 700, 6000]);
    let moved = c.ok();
    assert_eq!(shares(&moved), [(4, Surplus), (3, Surplus), (6, Capacity)]);
    c.set_ready("c3", 6);
    let moved = c.ok();
    assert_eq!(
        shares(&moved),
        [(2, Capacity), (2, Capacity), (6, Capacity)]
    );
}

/// A member that claims all the room there is (review H2: a lying agent) takes at most
/// `CAPACITY_TRUST` times the median cluster's part: the clusters that tell the truth
/// keep replicas, and their MyApps. (Unbounded, 5/5/0 went to 1/0/9.)
#[test]
fn a_cluster_claiming_endless_room_takes_a_bounded_part() {
    let mut c = Case::new("replicaScheduling: {mode: Capacity, totalReplicas: 10}");
    c.request = Resources {
        cpu_millis: 1000,
        memory_bytes: 1,
    };
    with_capacity(&mut c, [5000, 5000, 0]);
    let s = c.ok();
    assert_eq!(shares(&s), [(5, Capacity), (5, Capacity), (0, Capacity)]);
    c.settle(&s);
    // Our replicas filled c1 and c2; c3 says it has room for i64::MAX of them.
    with_capacity(&mut c, [0, 0, i64::MAX]);
    c.set_ready("c3", 10);
    let lied = c.ok();
    let got = shares(&lied);
    // Weights 5, 5 and (bounded) 4 × 5 = 20: c3 takes two thirds, the honest keep theirs.
    assert_eq!(got, [(2, Capacity), (2, Capacity), (6, Capacity)]);
}

/// The bound follows the lower median, so it never touches an honest fleet whose rooms
/// are within `CAPACITY_TRUST` of each other, nor a single cluster with room.
#[test]
fn the_room_bound_leaves_an_ordinary_fleet_alone() {
    let mut c = Case::new("replicaScheduling: {mode: Capacity, totalReplicas: 8}");
    c.request = Resources {
        cpu_millis: 1000,
        memory_bytes: 1,
    };
    // Room for 2, 1 and 8: 8 is within 4 × the median (2).
    with_capacity(&mut c, [2000, 1000, 8000]);
    assert_eq!(
        shares(&c.ok()),
        [(1, Capacity), (1, Capacity), (6, Capacity)]
    );
    // Only c3 has room: it takes all it can, however the others compare.
    with_capacity(&mut c, [0, 0, 8000]);
    assert_eq!(
        shares(&c.ok()),
        [(0, Capacity), (0, Capacity), (8, Capacity)]
    );
}
