//! Transition: from the division to what each cluster is told, and the disruption
//! policy's last step. A share that grew because a cluster failed over says so
//! (`Failover`); a failed-over cluster keeps its copy as it is (`FailedOver`); and make
//! before break: while any cluster's new share is not Ready, the clusters losing
//! replicas keep them (`Surplus`, or `Recovered` for a recovered cluster draining).

use std::collections::BTreeMap;

use flotilla_crds::federated::SchedulingReason;

use super::apportion::{self, Slot};
use super::assign::Division;
use super::classify::{Cluster, State};
use super::{Assignment, Recheck, SURPLUS_RECHECK, Schedule};
use crate::placement::ClusterName;

/// What each cluster is told before make before break ([`make_before_break`], which the
/// caller runs with what a new share needs to count as Ready).
pub(super) fn transition(division: &Division<'_, '_>) -> Schedule {
    let without_failover = attribute_failover(division);
    let assignments = division
        .clusters
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let assignment = assign(division, i, c, without_failover.as_deref());
            (c.name.clone(), assignment)
        })
        .collect();
    Schedule {
        divided: true,
        clusters: assignments,
        ..Schedule::default()
    }
}

/// The division as it would be had no cluster failed over (their slots as if they were
/// eligible), to tell which replicas are there only because one did; `None` when none
/// did, or when that division is infeasible.
fn attribute_failover(division: &Division<'_, '_>) -> Option<Vec<u32>> {
    let clusters = division.clusters;
    if !clusters.iter().any(|c| c.state == State::FailedOver) {
        return None;
    }
    let mut slots: Vec<Slot> = division
        .slots
        .iter()
        .zip(clusters)
        .map(|(s, c)| match c.state {
            State::FailedOver => division.strategy.slot(c, division.request),
            _ => s.clone(),
        })
        .collect();
    division.strategy.bound_weights(&mut slots);
    apportion::divide(division.share, &slots).ok()
}

/// What cluster `i` is told, before make before break.
fn assign(
    division: &Division<'_, '_>,
    i: usize,
    c: &Cluster<'_>,
    without_failover: Option<&[u32]>,
) -> Assignment {
    let target = division.target[i];
    match c.state {
        State::FailedOver => Assignment {
            replicas: c.prev.replicas,
            reason: SchedulingReason::FailedOver,
        },
        State::Recovered => Assignment {
            replicas: 0,
            reason: SchedulingReason::Recovered,
        },
        State::Frozen(reason) => Assignment {
            replicas: division.frozen[c.name.as_str()],
            reason,
        },
        State::Eligible => {
            let left_out = division.slots[i].max == 0
                && !division.chosen.contains(c.name.as_str())
                && division.candidates.iter().any(|k| k.name == c.name);
            let moved_in = without_failover.is_some_and(|w| target > w[i]);
            Assignment {
                replicas: target,
                reason: if left_out {
                    SchedulingReason::Spread
                } else if moved_in {
                    SchedulingReason::Failover
                } else {
                    division.strategy.reason()
                },
            }
        }
    }
}

/// Make before break: while any eligible cluster has fewer Ready replicas than its new
/// share `needs` (its assignment; under autoscaling, its new minimum), the clusters
/// losing replicas keep them (failed-over clusters are left alone anyway), and the plan
/// asks to be looked at again.
pub(super) fn make_before_break(
    clusters: &[Cluster<'_>],
    assignments: &mut BTreeMap<ClusterName, Assignment>,
    recheck: &mut Recheck,
    needs: impl Fn(&str, &Assignment) -> u32,
) {
    let pending = clusters.iter().any(|c| {
        let a = &assignments[c.name.as_str()];
        c.state == State::Eligible && needs(c.name.as_str(), a) > c.prev.ready_replicas
    });
    if !pending {
        return;
    }
    for c in clusters.iter().filter(|c| c.state != State::FailedOver) {
        let a = assignments
            .get_mut(c.name.as_str())
            .expect("every cluster is assigned");
        if a.replicas < c.prev.replicas {
            *a = Assignment {
                replicas: c.prev.replicas,
                // A recovered cluster stays marked as such while it drains.
                reason: match c.state {
                    State::Recovered => SchedulingReason::Recovered,
                    _ => SchedulingReason::Surplus,
                },
            };
            recheck.within(SURPLUS_RECHECK);
        }
    }
}
