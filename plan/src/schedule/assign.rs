//! Assign: the replicas each cluster should run. Duplicated gives every chosen cluster
//! the template's replicas; a [`Strategy`] divides the total, as a short sequence of
//! steps over one [`Division`]: reserve what frozen clusters keep → each eligible
//! cluster's slot (the strategy's) → spread chooses → restrict the slots to the chosen →
//! apportion (or explain why it cannot) → smooth (the strategy's).

use std::collections::{BTreeMap, BTreeSet};

use flotilla_crds::federated::SchedulingReason;
use flotilla_crds::member::Resources;

use super::apportion::{self, Infeasible, Slot};
use super::classify::{Cluster, State};
use super::spread::{self, Candidate, Chosen};
use super::validate::Spread;
use super::{Assignment, MAX_PER_CLUSTER, RS, SPREAD, Schedule, ScheduleError, Strategy, err};

/// Mode Duplicated: every chosen cluster runs the template's replicas.
pub(super) fn duplicate(
    clusters: &[Cluster<'_>],
    template_replicas: Option<i32>,
    spread: &Spread,
) -> Result<Schedule, ScheduleError> {
    let replicas = template_replicas
        .unwrap_or(1)
        .clamp(1, MAX_PER_CLUSTER as i32) as u32;
    let candidates: Vec<Candidate> = clusters
        .iter()
        .filter(|c| c.state == State::Eligible || c.prev.replicas > 0)
        .map(|c| Candidate {
            name: c.name,
            fixed: c.state != State::Eligible,
            had: c.prev.replicas > 0,
            score: 0,
            group: c.group(spread),
        })
        .collect();
    let chosen = names(&candidates, &spread::select(&candidates, spread)?);
    let clusters = clusters
        .iter()
        .map(|c| {
            let assignment = match c.state {
                _ if chosen.contains(c.name.as_str()) => Assignment {
                    replicas,
                    reason: match c.state {
                        State::Frozen(reason) => reason,
                        _ => SchedulingReason::Duplicated,
                    },
                },
                State::Frozen(reason) => Assignment {
                    replicas: 0,
                    reason,
                },
                _ => Assignment {
                    replicas: 0,
                    reason: SchedulingReason::Spread,
                },
            };
            (c.name.clone(), assignment)
        })
        .collect();
    Ok(Schedule {
        divided: false,
        clusters,
        ..Schedule::default()
    })
}

fn names<'a>(candidates: &[Candidate<'a>], chosen: &Chosen) -> BTreeSet<&'a str> {
    chosen
        .order
        .iter()
        .map(|i| candidates[*i].name.as_str())
        .collect()
}

/// One divided app's state, step by step; [`super::transition`] reads it.
pub(super) struct Division<'c, 'a> {
    pub clusters: &'c [Cluster<'a>],
    pub strategy: Strategy,
    pub request: Resources,
    /// What frozen clusters keep, by name.
    pub frozen: BTreeMap<&'c str, u32>,
    /// The total less what frozen clusters keep: what the slots share.
    pub share: u32,
    /// One per cluster, in the clusters' order.
    pub slots: Vec<Slot>,
    /// The clusters spread could choose from.
    pub candidates: Vec<Candidate<'c>>,
    /// Those it chose.
    pub chosen: BTreeSet<&'c str>,
    /// The division of `share` over `slots`.
    pub target: Vec<u32>,
}

/// Weighted or Capacity.
pub(super) fn divide<'c, 'a>(
    clusters: &'c [Cluster<'a>],
    total: u32,
    strategy: Strategy,
    request: Resources,
    spread: &Spread,
) -> Result<Division<'c, 'a>, ScheduleError> {
    let (frozen, share) = reserve_frozen(clusters, total);
    let mut division = Division {
        clusters,
        strategy,
        request,
        frozen,
        share,
        slots: Vec::new(),
        candidates: Vec::new(),
        chosen: BTreeSet::new(),
        target: Vec::new(),
    };
    division.slots = division.eligible_slots();
    division.candidates = division.candidates(spread);
    let chosen = spread::select(&division.candidates, spread)?;
    division.restrict_to(&chosen)?;
    let target = division.apportion_or_explain(total)?;
    division.target = strategy.smooth(share, &division.slots, target);
    Ok(division)
}

/// Frozen clusters keep what they run, as far as the total goes (last names give way
/// first when the total shrank below them). Returns what each keeps and what is left.
fn reserve_frozen<'c>(clusters: &'c [Cluster<'_>], total: u32) -> (BTreeMap<&'c str, u32>, u32) {
    let mut frozen: BTreeMap<&str, u32> = BTreeMap::new();
    let mut left = total;
    for c in clusters
        .iter()
        .filter(|c| matches!(c.state, State::Frozen(_)))
    {
        let keep = c.prev.replicas.min(c.max).min(left);
        left -= keep;
        frozen.insert(c.name, keep);
    }
    (frozen, left)
}

impl<'c> Division<'c, '_> {
    /// The strategy's slot for each eligible cluster; nothing for the others.
    fn eligible_slots(&self) -> Vec<Slot> {
        let mut slots: Vec<Slot> = self
            .clusters
            .iter()
            .map(|c| match c.state {
                State::Eligible => self.strategy.slot(c, self.request),
                _ => Slot::NONE,
            })
            .collect();
        self.strategy.bound_weights(&mut slots);
        slots
    }

    /// The clusters that keep replicas or may take some, scored by their slot's weight.
    fn candidates(&self, spread: &Spread) -> Vec<Candidate<'c>> {
        self.clusters
            .iter()
            .zip(&self.slots)
            .filter(|(c, s)| self.frozen.get(c.name.as_str()).is_some_and(|n| *n > 0) || s.max > 0)
            .map(|(c, s)| Candidate {
                name: c.name,
                fixed: self.frozen.contains_key(c.name.as_str()),
                had: c.prev.replicas > 0,
                score: s.weight,
                group: c.group(spread),
            })
            .collect()
    }

    /// Clusters spread left out take nothing (an error if they must take some); those it
    /// requires take at least one (an error if they can take none).
    fn restrict_to(&mut self, chosen: &Chosen) -> Result<(), ScheduleError> {
        self.chosen = names(&self.candidates, chosen);
        for (c, slot) in self.clusters.iter().zip(&mut self.slots) {
            if self.chosen.contains(c.name.as_str()) {
                continue;
            }
            if slot.min > 0 {
                return Err(err(
                    format!("{SPREAD}.maxClusters"),
                    format!(
                        "cluster {} needs minReplicas {} but is not among the clusters maxClusters allows",
                        c.name, slot.min
                    ),
                ));
            }
            slot.max = 0;
        }
        for r in &chosen.required {
            let name = self.candidates[*r].name.as_str();
            if self.frozen.contains_key(name) {
                continue;
            }
            let i = self.clusters.iter().position(|c| **c.name == *name);
            let s = &mut self.slots[i.expect("a candidate is a cluster")];
            if s.max == 0 {
                return Err(err(
                    SPREAD.to_string(),
                    format!(
                        "cluster {name} must run a replica to meet the spread but can take none"
                    ),
                ));
            }
            s.min = s.min.max(1);
        }
        Ok(())
    }

    fn apportion_or_explain(&self, total: u32) -> Result<Vec<u32>, ScheduleError> {
        apportion::divide(self.share, &self.slots).map_err(|e| self.infeasible(total, e))
    }

    /// Why `total` cannot be divided, in the user's terms.
    fn infeasible(&self, total: u32, e: Infeasible) -> ScheduleError {
        let runnable = self
            .clusters
            .iter()
            .filter(|c| c.state == State::Eligible)
            .count();
        let down = self.clusters.len() - runnable;
        let kept: u32 = self.frozen.values().sum();
        err(
            format!("{RS}.totalReplicas"),
            format!(
                "{total} replicas cannot be divided: {runnable} schedulable cluster(s) take {} to {} between them{}{}",
                e.min_sum,
                e.max_sum,
                if kept > 0 {
                    format!(", {kept} stay on cordoned or NotReady clusters")
                } else {
                    String::new()
                },
                if down > 0 {
                    format!(" ({down} cluster(s) take no new replicas)")
                } else {
                    String::new()
                },
            ),
        )
    }
}
