//! Bounds: under `spec.autoscaling`, each cluster's share of the federation-wide minimum
//! and maximum, and of a federation-wide metric.
//!
//! The maximum is divided as replicas are: the schedule divides it in place of
//! `totalReplicas`, so every mode, preference, spread and failover rule applies, and a
//! failed-over cluster's maximum moves with its share. The minimum is divided here, in
//! proportion to each cluster's maximum and within it, and never below one: every
//! cluster that runs the MyApp runs at least one replica (the MyApp schema's floor, and
//! an HPA's). A cluster's share of a global metric is its part of the maximum.
//!
//! Bounds, not counts: the autoscaler in each member decides the replicas between them,
//! so make before break counts a new share as Ready at its new minimum; meanwhile a
//! cluster losing replicas keeps its old maximum ([`with_held`]).

use std::collections::BTreeMap;

use flotilla_crds::bounds::Bounds;
use flotilla_crds::federated::{Autoscaling, SchedulingReason};

use super::apportion::{self, Slot};
use super::{Assignment, RS, ScheduleError, Strategy, err};
use crate::placement::ClusterName;

const FIELD: &str = "spec.autoscaling";

/// `spec.autoscaling` checked against the scheduling fields.
pub(super) fn check(
    autoscaling: &Autoscaling,
    strategy: Option<Strategy>,
    total_replicas: Option<i32>,
) -> Result<(), ScheduleError> {
    let Autoscaling {
        min_replicas: min,
        max_replicas: max,
    } = *autoscaling;
    if min < 1 {
        return Err(err(
            format!("{FIELD}.minReplicas"),
            format!("{min} is below 1"),
        ));
    }
    if max < min {
        return Err(err(
            format!("{FIELD}.maxReplicas"),
            format!("{max} is below minReplicas {min}"),
        ));
    }
    if strategy.is_none() {
        return Err(err(
            FIELD,
            "needs spec.placement.replicaScheduling mode Weighted or Capacity, which divide the bounds (Duplicated divides nothing)",
        ));
    }
    if total_replicas.is_some() {
        return Err(err(
            format!("{RS}.totalReplicas"),
            "leave it out with spec.autoscaling: its maxReplicas is what is divided",
        ));
    }
    Ok(())
}

/// The field a division's error names under `spec.autoscaling`: its maximum is what
/// could not be divided.
pub(super) fn rename_total(mut e: ScheduleError) -> ScheduleError {
    if e.field == format!("{RS}.totalReplicas") {
        e.field = format!("{FIELD}.maxReplicas");
    }
    e
}

/// The clusters that run the MyApp, each with its maximum (its assignment), and the
/// sum of those maxima. Failed-over clusters are left out: their copy is left as it is.
fn running(assignments: &BTreeMap<ClusterName, Assignment>) -> (Vec<(&ClusterName, u32)>, u32) {
    let running: Vec<(&ClusterName, u32)> = assignments
        .iter()
        .filter(|(_, a)| a.replicas > 0 && a.reason != SchedulingReason::FailedOver)
        .map(|(name, a)| (name, a.replicas))
        .collect();
    let whole = running.iter().map(|(_, max)| max).sum();
    (running, whole)
}

/// Each cluster's bounds: its assignment (the divided maximum) as `max`, and `min`, the
/// federation's minimum divided in proportion to the maxima within them, at least one
/// each. Clusters that run nothing, and failed-over ones (whose copy is left as it is),
/// get none. `previous`: each cluster's last minimum, which rounding leans towards.
pub fn divide(
    min: u32,
    assignments: &BTreeMap<ClusterName, Assignment>,
    previous: &BTreeMap<String, u32>,
) -> BTreeMap<ClusterName, Bounds> {
    let (running, whole) = running(assignments);
    let slots: Vec<Slot> = running
        .iter()
        .map(|(name, max)| Slot {
            weight: u64::from(*max),
            min: 1,
            max: *max,
            prev: previous.get(&name[..]).copied().unwrap_or(0),
        })
        .collect();
    // At least one each, at most every maximum: always feasible.
    let floor = min.clamp(running.len() as u32, whole);
    let mins = apportion::divide(floor, &slots).expect("1 <= floor share <= max per slot");
    running
        .into_iter()
        .zip(mins)
        .map(|((name, max), min)| {
            let bounds = Bounds {
                min,
                max,
                parts: max,
                whole,
            };
            (name.clone(), bounds)
        })
        .collect()
}

/// The bounds once make before break has held some clusters' replicas: the `target`
/// minimum of every cluster that has one (a held cluster keeps its old maximum above
/// it), the last minimum of a held cluster that is losing its share, and the shares
/// of the metric over every maximum given out, held ones included (they still drain
/// their part of a global queue). With nothing held, `target` as it is.
pub fn with_held(
    target: BTreeMap<ClusterName, Bounds>,
    assignments: &BTreeMap<ClusterName, Assignment>,
    previous: &BTreeMap<String, u32>,
) -> BTreeMap<ClusterName, Bounds> {
    let (running, whole) = running(assignments);
    running
        .into_iter()
        .map(|(name, max)| {
            let min = target
                .get(name)
                .map(|b| b.min)
                .or_else(|| previous.get(&**name).copied())
                .unwrap_or(1)
                .clamp(1, max);
            let bounds = Bounds {
                min,
                max,
                parts: max,
                whole,
            };
            (name.clone(), bounds)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{prop_assert, prop_assert_eq, proptest};

    fn assigned(maxima: &[u32]) -> BTreeMap<ClusterName, Assignment> {
        maxima
            .iter()
            .enumerate()
            .map(|(i, max)| {
                let a = Assignment {
                    replicas: *max,
                    reason: SchedulingReason::Weight,
                };
                (format!("c{i}").into(), a)
            })
            .collect()
    }

    fn mins(bounds: &BTreeMap<ClusterName, Bounds>) -> Vec<u32> {
        bounds.values().map(|b| b.min).collect()
    }

    #[test]
    fn the_minimum_follows_the_maxima() {
        let b = divide(8, &assigned(&[8, 4, 4]), &BTreeMap::new());
        assert_eq!(mins(&b), [4, 2, 2]);
        assert_eq!(b["c0"].max, 8);
        assert_eq!((b["c1"].parts, b["c1"].whole), (4, 16));
    }

    #[test]
    fn every_running_cluster_runs_one_at_least() {
        let b = divide(1, &assigned(&[6, 3, 1]), &BTreeMap::new());
        assert_eq!(mins(&b), [1, 1, 1], "the floor is raised to one each");
        let b = divide(40, &assigned(&[6, 3, 1]), &BTreeMap::new());
        assert_eq!(mins(&b), [6, 3, 1], "the floor never passes the maxima");
    }

    #[test]
    fn clusters_that_run_nothing_or_failed_over_get_no_bounds() {
        let mut a = assigned(&[6, 0, 3]);
        a.insert(
            "gone".into(),
            Assignment {
                replicas: 4,
                reason: SchedulingReason::FailedOver,
            },
        );
        let b = divide(3, &a, &BTreeMap::new());
        assert_eq!(b.keys().map(|c| &**c).collect::<Vec<_>>(), ["c0", "c2"]);
        assert_eq!(
            b["c0"].whole, 9,
            "the failed-over copy is no part of the share"
        );
        assert!(divide(3, &BTreeMap::new(), &BTreeMap::new()).is_empty());
    }

    #[test]
    fn rounding_leans_towards_the_previous_minimum() {
        // 3 over equal maxima: one of them gets the odd replica, the one that had it.
        let previous = BTreeMap::from([("c2".to_owned(), 2)]);
        let b = divide(4, &assigned(&[5, 5, 5]), &previous);
        assert_eq!(mins(&b), [1, 1, 2]);
    }

    #[test]
    fn check_names_the_field() {
        let a = |min, max| Autoscaling {
            min_replicas: min,
            max_replicas: max,
        };
        let w = Some(Strategy::Weighted);
        assert_eq!(
            check(&a(0, 3), w, None).unwrap_err().field,
            "spec.autoscaling.minReplicas"
        );
        assert_eq!(
            check(&a(4, 3), w, None).unwrap_err().field,
            "spec.autoscaling.maxReplicas"
        );
        assert_eq!(
            check(&a(1, 3), None, None).unwrap_err().field,
            "spec.autoscaling"
        );
        assert_eq!(
            check(&a(1, 3), w, Some(3)).unwrap_err().field,
            "spec.placement.replicaScheduling.totalReplicas"
        );
        assert_eq!(check(&a(3, 3), Some(Strategy::Capacity), None), Ok(()));
    }

    fn arb_maxima() -> impl proptest::strategy::Strategy<Value = Vec<u32>> {
        proptest::collection::vec(0u32..=10, 0..8)
    }

    proptest! {
        #[test]
        fn mins_sum_to_the_floor_within_each_maximum(maxima in arb_maxima(), min in 0u32..90) {
            let b = divide(min, &assigned(&maxima), &BTreeMap::new());
            let running = maxima.iter().filter(|m| **m > 0).count() as u32;
            let whole: u32 = maxima.iter().sum();
            prop_assert_eq!(b.len() as u32, running);
            prop_assert_eq!(b.values().map(|b| b.max).sum::<u32>(), whole, "maxima sum to the divided maximum");
            if running > 0 {
                prop_assert_eq!(b.values().map(|b| b.min).sum::<u32>(), min.clamp(running, whole));
            }
            for bounds in b.values() {
                prop_assert!(1 <= bounds.min && bounds.min <= bounds.max, "{bounds:?}");
                prop_assert_eq!((bounds.parts, bounds.whole), (bounds.max, whole));
            }
        }

        #[test]
        fn a_minimum_one_higher_moves_each_cluster_by_one_at_most(maxima in arb_maxima(), min in 1u32..60) {
            let a = assigned(&maxima);
            let before = divide(min, &a, &BTreeMap::new());
            let previous = before.iter().map(|(c, b)| (c.to_string(), b.min)).collect();
            prop_assert_eq!(&divide(min, &a, &previous), &before, "a fixed point");
            prop_assert_eq!(&with_held(before.clone(), &a, &previous), &before, "nothing held");
            let after = divide(min + 1, &a, &previous);
            for (c, b) in &after {
                prop_assert!(b.min.abs_diff(before[c].min) <= 1, "{c}: {} then {}", before[c].min, b.min);
                prop_assert!(b.min >= before[c].min, "{c} lost replicas when the floor rose");
            }
        }
    }
}
