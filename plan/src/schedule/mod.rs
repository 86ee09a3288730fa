//! Schedule: how many replicas each placed cluster runs. Pure and deterministic: the
//! same inputs give the same division, and the previous division (read back from the
//! FederatedMyApp's status, where [`annotate`] wrote it) is an input, so that a change
//! moves as few replicas as it can.
//!
//! [`schedule`] runs these steps, one module each:
//! 1. [`validate`]: the preferences, the spread and the total, each error naming its
//!    field; the mode becomes a [`Strategy`] (or Duplicated);
//! 2. [`classify`]: each placed cluster is eligible, frozen (cordoned or NotReady: keeps
//!    what it runs, gets nothing new), failed over (NotReady past the grace period: its
//!    share moves, its copy is left alone), or recovered (back from a failover under
//!    `Stay`);
//! 3. [`spread`]: choose the clusters that may run replicas and those that must run one;
//! 4. [`assign`]: Duplicated gives every chosen cluster the template's replicas; a
//!    [`Strategy`] divides the total ([`apportion`]: largest remainder within each
//!    cluster's bounds, exact rationals, rounding towards the previous division);
//! 5. [`transition`]: which replicas moved because of a failover, and make before break.
//!
//! The disruption policy, Karmada's "Steady": a division changes what runs as little as
//! it can. Rounding leans towards the previous division ([`apportion::divide`]);
//! Capacity keeps the previous division outright while no share is off its new quota by
//! more than the hysteresis band ([`apportion::hysteresis`]); and make before break
//! ([`transition::make_before_break`]): a cluster losing replicas keeps them until every
//! cluster's new share is Ready, looked at again every [`SURPLUS_RECHECK`].

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_crds::FederatedMyApp;
use flotilla_crds::bounds::Bounds;
use flotilla_crds::federated::{
    Autoscaling, ClusterStatus, DivisionGroup, FederatedMyAppStatus, Placement, SchedulingMode,
    SchedulingReason, encode_names,
};
use flotilla_crds::member::Resources;

use crate::placement::{ClusterName, Members};

pub mod apportion;
mod assign;
pub mod bounds;
mod classify;
mod spread;
mod transition;
mod validate;

#[cfg(test)]
mod tests;

pub use apportion::{Infeasible, Slot, divide};

/// The MyApp schema's bound on `spec.replicas`: a cluster runs 0 (no MyApp) or 1 to 10.
pub const MAX_PER_CLUSTER: u32 = 10;
/// Failover's default grace period.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(300);
/// How often a pending make-before-break is looked at again.
pub const SURPLUS_RECHECK: Duration = Duration::from_secs(5);
/// A replica without requests counts as requesting what the kube-scheduler assumes for
/// scoring (its non-zero defaults: 100m CPU, 200 MiB).
pub use flotilla_crds::member::DEFAULT_REQUEST;

/// What the previous division left on one cluster, from `status.clusters[]` or
/// `status.division`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Previous {
    pub replicas: u32,
    pub ready_replicas: u32,
    pub reason: Option<SchedulingReason>,
}

/// The previous division as the status shows it: `status.division` when the status
/// lists only some clusters (`omittedClusters` > 0), else every `status.clusters[]`
/// entry. An entry written before scheduling existed (no `replicas`) counts as running
/// what it reports ready and at least one, so that an upgrade does not read a cordoned
/// cluster as empty. A division entry that does not decode is left out.
pub fn previous(status: Option<&FederatedMyAppStatus>) -> BTreeMap<String, Previous> {
    let Some(status) = status else {
        return BTreeMap::new();
    };
    if status.omitted_clusters > 0 {
        return from_division(&status.division);
    }
    status
        .clusters
        .iter()
        .map(|c| {
            let replicas = clamp(c.replicas.unwrap_or(c.ready_replicas.max(1)));
            let prev = Previous {
                replicas,
                ready_replicas: ready_within(c.ready_replicas, replicas),
                reason: c.scheduling_reason,
            };
            (c.name.clone(), prev)
        })
        .collect()
}

fn clamp(n: i32) -> u32 {
    u32::try_from(n).unwrap_or(0).min(MAX_PER_CLUSTER)
}

/// A cluster's ready replicas as make-before-break reads them: at most what it was
/// assigned. Its agent reports the count; one that says more (a lying member, or an
/// autoscaler's extra pods) must not end the wait of the clusters that keep replicas
/// for it (review H2): its new share counts as Ready only once the status shows it
/// assigned and ready.
fn ready_within(ready: i32, replicas: u32) -> u32 {
    clamp(ready).min(replicas)
}

fn from_division(groups: &[DivisionGroup]) -> BTreeMap<String, Previous> {
    let mut out = BTreeMap::new();
    for g in groups {
        let replicas = clamp(g.replicas);
        let prev = Previous {
            replicas,
            ready_replicas: ready_within(g.ready_replicas, replicas),
            reason: g.reason,
        };
        // A hand-edited entry that does not decode loses that group only.
        for name in g.cluster_names().unwrap_or_default() {
            out.insert(name, prev.clone());
        }
    }
    out
}

/// The whole division as [`previous`] reads it back, from the status entries of every
/// scheduled cluster (the ones [`annotate`] gave `replicas`), grouped by assignment.
/// Entries that read as nothing (no replicas, none ready, no failover mark) are left out:
/// [`previous`] gives the same for a cluster it does not find.
pub fn division(clusters: &[ClusterStatus]) -> Vec<DivisionGroup> {
    type Assigned = (i32, i32, Option<SchedulingReason>);
    let mut groups: BTreeMap<Assigned, Vec<&str>> = BTreeMap::new();
    for c in clusters {
        let Some(replicas) = c.replicas else { continue };
        let marked = matches!(
            c.scheduling_reason,
            Some(SchedulingReason::FailedOver | SchedulingReason::Recovered)
        );
        if replicas <= 0 && c.ready_replicas <= 0 && !marked {
            continue;
        }
        let key = (replicas, c.ready_replicas, c.scheduling_reason);
        groups.entry(key).or_default().push(&c.name);
    }
    groups
        .into_iter()
        .map(|((replicas, ready_replicas, reason), mut names)| {
            names.sort_unstable();
            DivisionGroup {
                replicas,
                ready_replicas,
                reason,
                clusters: encode_names(names),
            }
        })
        .collect()
}

/// Everything one app's division depends on.
#[derive(Debug, Clone)]
pub struct Inputs<'a> {
    pub placement: &'a Placement,
    /// The placed clusters, sorted (placement's decision).
    pub placed: &'a [ClusterName],
    pub members: &'a Members,
    /// `spec.template.spec.replicas`.
    pub template_replicas: Option<i32>,
    /// What one replica requests (Capacity only).
    pub request: Resources,
    pub previous: BTreeMap<String, Previous>,
    /// The spec changed since the previous division (generation ≠ observedGeneration).
    pub spec_changed: bool,
    /// `spec.autoscaling`: the maximum is divided, the minimum follows ([`bounds`]).
    pub autoscaling: Option<Autoscaling>,
    /// Each cluster's last minimum under autoscaling (`status.clusters[].minReplicas`).
    pub previous_min: BTreeMap<String, u32>,
}

impl<'a> Inputs<'a> {
    pub fn for_app(
        app: &'a FederatedMyApp,
        placed: &'a [ClusterName],
        members: &'a Members,
    ) -> Result<Self, ScheduleError> {
        let status = app.status.as_ref();
        let scheduling = app.spec.placement.replica_scheduling.as_ref();
        let request = match scheduling.and_then(|r| Strategy::of(r.mode)) {
            Some(strategy) => strategy.request(app)?,
            None => DEFAULT_REQUEST,
        };
        Ok(Self {
            placement: &app.spec.placement,
            placed,
            members,
            template_replicas: app.spec.template.spec.replicas,
            request,
            previous: previous(status),
            spec_changed: status.and_then(|s| s.observed_generation) != app.metadata.generation,
            autoscaling: app.spec.autoscaling,
            previous_min: status.map_or_else(BTreeMap::new, |s| {
                let min = |c: &ClusterStatus| Some((c.name.clone(), clamp(c.min_replicas?)));
                s.clusters.iter().filter_map(min).collect()
            }),
        })
    }
}

/// Under Capacity, how many times the median cluster's room one cluster's room counts for
/// at most (see [`Strategy::bound_weights`]).
pub const CAPACITY_TRUST: u64 = 4;

/// How a divided mode weighs the clusters: what differs between Weighted and Capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// By the preferences' weights.
    Weighted,
    /// By the room each cluster's agent reports for one more replica.
    Capacity,
}

impl Strategy {
    /// The strategy of a mode; `None` for Duplicated, which divides nothing.
    pub fn of(mode: SchedulingMode) -> Option<Self> {
        match mode {
            SchedulingMode::Duplicated => None,
            SchedulingMode::Weighted => Some(Strategy::Weighted),
            SchedulingMode::Capacity => Some(Strategy::Capacity),
        }
    }

    /// What one replica requests. Only Capacity reads the requests: other modes render
    /// what they always did (the member's apiserver judges the requests).
    fn request(self, app: &FederatedMyApp) -> Result<Resources, ScheduleError> {
        match self {
            Strategy::Weighted => Ok(DEFAULT_REQUEST),
            Strategy::Capacity => validate::request_of(app),
        }
    }

    /// The reason an eligible cluster's share carries.
    fn reason(self) -> SchedulingReason {
        match self {
            Strategy::Weighted => SchedulingReason::Weight,
            Strategy::Capacity => SchedulingReason::Capacity,
        }
    }

    /// One eligible cluster's input to the apportionment.
    fn slot(self, c: &classify::Cluster<'_>, request: Resources) -> Slot {
        match self {
            Strategy::Weighted => Slot {
                weight: c.weight,
                min: c.min,
                max: c.max,
                prev: c.prev.replicas,
            },
            Strategy::Capacity => {
                // The cluster could hold what it runs of this app plus its room.
                let room = c.member.capacity.as_ref();
                let cap = c.prev.replicas as u64
                    + room.map_or(0, |cap| cap.room_for(&request).max(0) as u64);
                Slot {
                    weight: cap,
                    min: c.min,
                    max: (c.max as u64).min(cap) as u32,
                    prev: c.prev.replicas,
                }
            }
        }
    }

    /// Capacity: no cluster's room counts for more than [`CAPACITY_TRUST`] times the
    /// median cluster's. Rooms are what agents say; one member that overstates its own
    /// (a lie, or a bug) then takes at most that many parts of a Capacity app, and the
    /// clusters that tell the truth keep theirs. Only the weight is bounded: a cluster
    /// still takes up to its whole room when the others are full.
    fn bound_weights(self, slots: &mut [Slot]) {
        if self != Strategy::Capacity {
            return;
        }
        let mut weights: Vec<u64> = slots.iter().map(|s| s.weight).filter(|w| *w > 0).collect();
        if weights.len() < 2 {
            return;
        }
        weights.sort_unstable();
        // The lower median: a minority of clusters, however large their figures, cannot
        // move it past what an honest one reports.
        let ceiling = weights[(weights.len() - 1) / 2].saturating_mul(CAPACITY_TRUST);
        for s in slots {
            s.weight = s.weight.min(ceiling);
        }
    }

    /// Capacity moves all the time (our own pods fill it): it keeps the previous
    /// division within the hysteresis band. Weights move only when the user edits them.
    fn smooth(self, total: u32, slots: &[Slot], target: Vec<u32>) -> Vec<u32> {
        match self {
            Strategy::Weighted => target,
            Strategy::Capacity => apportion::hysteresis(total, slots, target),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assignment {
    /// 0: the cluster gets no MyApp. FailedOver: what it was left running with; its MyApp
    /// is not touched.
    pub replicas: u32,
    pub reason: SchedulingReason,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schedule {
    /// Weighted or Capacity: `replicas` is written into each cluster's MyApp.
    pub divided: bool,
    /// Every placed cluster.
    pub clusters: BTreeMap<ClusterName, Assignment>,
    /// When the same inputs may divide differently (a grace period ends, replacements
    /// may be Ready): reconcile again by then.
    pub recheck_after: Option<Duration>,
    /// Under `spec.autoscaling`: each running cluster's bounds; its assignment is its
    /// maximum.
    pub bounds: BTreeMap<ClusterName, Bounds>,
}

impl Schedule {
    /// Replicas assigned across clusters; a failed-over cluster's are not counted (they
    /// are only left where they were).
    pub fn total(&self) -> u32 {
        self.clusters
            .values()
            .filter(|a| a.reason != SchedulingReason::FailedOver)
            .map(|a| a.replicas)
            .sum()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct ScheduleError {
    /// The field to change, e.g. `spec.placement.replicaScheduling.totalReplicas`.
    pub field: String,
    pub reason: String,
}

fn err(field: impl Into<String>, reason: impl Into<String>) -> ScheduleError {
    ScheduleError {
        field: field.into(),
        reason: reason.into(),
    }
}

const RS: &str = "spec.placement.replicaScheduling";
const SPREAD: &str = "spec.placement.spread";

/// The earliest time a step asked to be looked at again.
#[derive(Debug, Default)]
struct Recheck(Option<Duration>);

impl Recheck {
    fn within(&mut self, after: Duration) {
        self.0 = Some(self.0.map_or(after, |r| r.min(after)));
    }
}

/// Divides one app's replicas: validate → classify → spread → assign → transition.
pub fn schedule(inp: &Inputs<'_>) -> Result<Schedule, ScheduleError> {
    let rules = validate::rules(inp.placement)?;
    if let Some(a) = &inp.autoscaling {
        bounds::check(a, rules.strategy, rules.total_replicas)?;
    }
    let mut recheck = Recheck::default();
    let clusters = classify::classify(inp, &rules, &mut recheck);
    let mut out = match rules.strategy {
        None => assign::duplicate(&clusters, inp.template_replicas, &rules.spread)?,
        Some(strategy) => match inp.autoscaling {
            None => {
                let total = rules.total(inp.template_replicas);
                let division =
                    assign::divide(&clusters, total, strategy, inp.request, &rules.spread)?;
                let mut out = transition::transition(&division);
                let needs = |_: &str, a: &Assignment| a.replicas;
                transition::make_before_break(&clusters, &mut out.clusters, &mut recheck, needs);
                out
            }
            Some(a) => {
                let total = a.max_replicas.max(0) as u32;
                let division =
                    assign::divide(&clusters, total, strategy, inp.request, &rules.spread)
                        .map_err(bounds::rename_total)?;
                let mut out = transition::transition(&division);
                let min = a.min_replicas.max(0) as u32;
                let target = bounds::divide(min, &out.clusters, &inp.previous_min);
                // A new share counts as Ready at its new minimum: the autoscalers decide
                // the rest.
                let needs = |c: &str, _: &Assignment| target.get(c).map_or(0, |b| b.min);
                transition::make_before_break(&clusters, &mut out.clusters, &mut recheck, needs);
                out.bounds = bounds::with_held(target, &out.clusters, &inp.previous_min);
                out
            }
        },
    };
    out.recheck_after = recheck.0;
    Ok(out)
}

/// Writes the division into the status the hub publishes: each cluster's assigned
/// replicas and reason, the desired total and the ready total.
pub fn annotate(status: &mut FederatedMyAppStatus, schedule: &Schedule) {
    for c in &mut status.clusters {
        // A member is ready with at most what it runs: its share, or with an autoscaler
        // in the member, the MyApp's own limit. A lying agent's count must not inflate
        // the total (review H2).
        let mut most = MAX_PER_CLUSTER;
        c.min_replicas = schedule.bounds.get(c.name.as_str()).map(|b| b.min as i32);
        if let Some(a) = schedule.clusters.get(c.name.as_str()) {
            c.replicas = Some(a.replicas as i32);
            c.scheduling_reason = Some(a.reason);
            if c.autoscaler.is_none() {
                most = a.replicas;
            }
        }
        c.ready_replicas = ready_within(c.ready_replicas, most) as i32;
    }
    status.replicas = Some(schedule.total() as i32);
    // Saturating: the counts are agents' reports, summed over up to 10,000 clusters.
    status.ready_replicas = status
        .clusters
        .iter()
        .fold(0i32, |sum, c| sum.saturating_add(c.ready_replicas));
}
