//! Properties of the whole schedule over random clusters (regression seeds in
//! `proptest-regressions/schedule/tests/properties.txt`).

use super::*;
use proptest::prelude::*;
use proptest::strategy::Strategy;

/// Per cluster: weight, free CPU (millis), cordoned, NotReady for (seconds).
type ArbCluster = (u64, i64, bool, Option<u64>);

fn arb_case() -> impl Strategy<Value = (u32, Vec<ArbCluster>, u8)> {
    (
        0u32..40,
        prop::collection::vec(
            (
                0u64..5,
                0i64..4000,
                any::<bool>(),
                prop::option::of(0u64..400),
            ),
            1..6,
        ),
        0u8..2,
    )
}

fn build(total: u32, clusters: &[ArbCluster], mode: u8) -> Case {
    let mode = if mode == 0 { "Weighted" } else { "Capacity" };
    let prefs: Vec<String> = clusters
        .iter()
        .enumerate()
        .map(|(i, (w, ..))| format!("{{clusterNames: [k{i}], weight: {w}}}"))
        .collect();
    let mut c = Case::new(&format!(
        "replicaScheduling: {{mode: {mode}, totalReplicas: {total}, preferences: [{}]}}\nfailover: {{gracePeriodSeconds: 100}}",
        prefs.join(", ")
    ));
    c.request = Resources {
        cpu_millis: 500,
        memory_bytes: 1,
    };
    c.members = clusters
        .iter()
        .enumerate()
        .map(|(i, (_, cpu, cordoned, down))| {
            let mut m = Member {
                capacity: Some(capacity(*cpu)),
                unschedulable: *cordoned,
                ..Member::default()
            };
            m.not_ready_for = down.map(Duration::from_secs);
            (format!("k{i}").into(), m)
        })
        .collect();
    c
}

proptest! {
    #[test]
    fn schedule_is_deterministic_and_a_fixed_point((total, clusters, mode) in arb_case()) {
        let mut c = build(total, &clusters, mode);
        let first = c.run();
        prop_assert_eq!(&first, &c.run());
        if let Ok(s) = first {
            // Run again on its own result, everything Ready: nothing moves but
            // surplus being released.
            c.settle(&s);
            let again = c.ok();
            for (name, a) in &again.clusters {
                let before = s.clusters[name];
                if before.reason != Surplus {
                    prop_assert_eq!(a.replicas, before.replicas, "{} moved: {:?} -> {:?}", name, s, again);
                }
            }
            c.settle(&again);
            prop_assert_eq!(c.ok(), again);
        }
    }

    #[test]
    fn schedule_sums_to_the_total_and_respects_capacity((total, clusters, mode) in arb_case()) {
        let c = build(total, &clusters, mode);
        if let Ok(s) = c.run() {
            // Fresh (no previous division, nothing to hold): exactly the total.
            prop_assert_eq!(s.total(), total);
            for (i, (_, cpu, ..)) in clusters.iter().enumerate() {
                let a = s.clusters[format!("k{i}").as_str()];
                prop_assert!(a.replicas <= MAX_PER_CLUSTER);
                if mode == 1 {
                    prop_assert!(a.replicas as i64 <= cpu / 500, "{:?} exceeds room {}", a, cpu / 500);
                }
            }
        }
    }

    /// Under Capacity, a room claimed past `CAPACITY_TRUST` times the median counts as
    /// that much: whatever one cluster says beyond it (up to `i64::MAX`), the division is
    /// the same, so a lying member's pull on the others is bounded.
    #[test]
    fn a_claimed_room_past_the_bound_moves_nothing((total, clusters, _) in arb_case(), extra in 0i64..100) {
        // Every cluster eligible, one honest one at least with room for a replica.
        let mut clusters: Vec<ArbCluster> = clusters.into_iter().map(|(w, cpu, ..)| (w, cpu, false, None)).collect();
        prop_assume!(clusters.len() > 1 && clusters.iter().any(|c| c.1 >= 500));
        clusters.push((1, i64::MAX, false, None));
        let huge = build(total, &clusters, 1).run();
        // Honest rooms are under 8 replicas, so the bound is at most 4 × 8 = 32: a room
        // for 33 + `extra` is past it, and its maximum never binds (the liar's weight is
        // at most 4 × one honest cluster's, so it takes at most 4/5 of under 40).
        clusters.last_mut().unwrap().1 = (33 + extra) * 500;
        prop_assert_eq!(huge, build(total, &clusters, 1).run());
    }
}
