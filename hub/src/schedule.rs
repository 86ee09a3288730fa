//! Schedule: how many replicas each placed cluster runs. Pure and deterministic: the
//! same inputs give the same division, and the previous division (read back from the
//! FederatedMyApp's status) is an input, so that a change moves as few replicas as it
//! can.
//!
//! Stages, per FederatedMyApp:
//! 1. classify each placed cluster: eligible, frozen (cordoned or NotReady: keeps what
//!    it runs, gets nothing new), failed over (NotReady past the grace period: its share
//!    moves, its copy is left alone), or recovered (back from a failover under `Stay`);
//! 2. spread: choose the clusters that may run replicas and those that must run one;
//! 3. divide the total by largest remainder within each cluster's bounds, rounding
//!    towards the previous division, keeping it outright while capacity moves less than
//!    the hysteresis band;
//! 4. make before break: a cluster losing replicas keeps them until every cluster's new
//!    share is Ready.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use flotilla_crds::FederatedMyApp;
use flotilla_crds::federated::{
    ClusterPreference, FederatedMyAppStatus, Placement, RecoveryPolicy, SchedulingMode,
    SchedulingReason, SpreadConstraints,
};
use flotilla_crds::member::Resources;
use kube::core::{Selector, SelectorExt};

use crate::placement::{self, Member, Members};

/// The MyApp schema's bound on `spec.replicas`: a cluster runs 0 (no MyApp) or 1 to 10.
pub const MAX_PER_CLUSTER: u32 = 10;
/// Failover's default grace period.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(300);
/// How often a pending make-before-break is looked at again.
pub const SURPLUS_RECHECK: Duration = Duration::from_secs(5);
/// A replica without requests counts as requesting what the kube-scheduler assumes for
/// scoring (its non-zero defaults: 100m CPU, 200 MiB).
pub const DEFAULT_REQUEST: Resources = Resources {
    cpu_millis: 100,
    memory_bytes: 200 * 1024 * 1024,
};

/// What the previous division left on one cluster, from `status.clusters[]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Previous {
    pub replicas: u32,
    pub ready_replicas: u32,
    pub reason: Option<SchedulingReason>,
}

/// The previous division as the status shows it. An entry written before scheduling
/// existed (no `replicas`) counts as running what it reports ready and at least one, so
/// that an upgrade does not read a cordoned cluster as empty.
pub fn previous(status: Option<&FederatedMyAppStatus>) -> BTreeMap<String, Previous> {
    let clamp = |n: i32| u32::try_from(n).unwrap_or(0).min(MAX_PER_CLUSTER);
    status
        .map(|s| s.clusters.as_slice())
        .unwrap_or_default()
        .iter()
        .map(|c| {
            let prev = Previous {
                replicas: clamp(c.replicas.unwrap_or(c.ready_replicas.max(1))),
                ready_replicas: clamp(c.ready_replicas),
                reason: c.scheduling_reason,
            };
            (c.name.clone(), prev)
        })
        .collect()
}

/// Everything one app's division depends on.
#[derive(Debug, Clone)]
pub struct Inputs<'a> {
    pub placement: &'a Placement,
    /// The placed clusters, sorted (placement's decision).
    pub placed: &'a [String],
    pub members: &'a Members,
    /// `spec.template.spec.replicas`.
    pub template_replicas: Option<i32>,
    /// What one replica requests (Capacity only).
    pub request: Resources,
    pub previous: BTreeMap<String, Previous>,
    /// The spec changed since the previous division (generation ≠ observedGeneration).
    pub spec_changed: bool,
}

impl<'a> Inputs<'a> {
    pub fn for_app(
        app: &'a FederatedMyApp,
        placed: &'a [String],
        members: &'a Members,
    ) -> Result<Self, ScheduleError> {
        let status = app.status.as_ref();
        let mode = app
            .spec
            .placement
            .replica_scheduling
            .as_ref()
            .map(|r| r.mode);
        // Only Capacity reads the requests: other modes render what they always did.
        let request = match mode {
            Some(SchedulingMode::Capacity) => request_of(app)?,
            _ => DEFAULT_REQUEST,
        };
        Ok(Self {
            placement: &app.spec.placement,
            placed,
            members,
            template_replicas: app.spec.template.spec.replicas,
            request,
            previous: previous(status),
            spec_changed: status.and_then(|s| s.observed_generation) != app.metadata.generation,
        })
    }
}

/// One replica's requests, each missing resource at the kube-scheduler's default.
fn request_of(app: &FederatedMyApp) -> Result<Resources, ScheduleError> {
    let requests = app.spec.template.spec.workload.resources.as_ref();
    let Some(list) = requests.and_then(|r| r.requests.as_ref()) else {
        return Ok(DEFAULT_REQUEST);
    };
    let r = Resources::from_list(list).map_err(|e| ScheduleError {
        field: "spec.template.spec.resources.requests".into(),
        reason: e.to_string(),
    })?;
    Ok(Resources {
        cpu_millis: if r.cpu_millis > 0 {
            r.cpu_millis
        } else {
            DEFAULT_REQUEST.cpu_millis
        },
        memory_bytes: if r.memory_bytes > 0 {
            r.memory_bytes
        } else {
            DEFAULT_REQUEST.memory_bytes
        },
    })
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
    pub clusters: BTreeMap<String, Assignment>,
    /// When the same inputs may divide differently (a grace period ends, replacements
    /// may be Ready): reconcile again by then.
    pub recheck_after: Option<Duration>,
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

/// One preference, checked and with its matcher.
struct Pref<'p> {
    raw: &'p ClusterPreference,
    selector: Option<Selector>,
}

impl Pref<'_> {
    fn matches(&self, name: &str, member: &Member) -> bool {
        let named = self.raw.cluster_names.iter().any(|n| n == name);
        let selected = self
            .selector
            .as_ref()
            .is_some_and(|s| s.matches(&member.labels));
        named || selected || (self.raw.cluster_names.is_empty() && self.selector.is_none())
    }
}

fn checked_prefs(prefs: &[ClusterPreference]) -> Result<Vec<Pref<'_>>, ScheduleError> {
    prefs
        .iter()
        .enumerate()
        .map(|(k, raw)| {
            let field = format!("{RS}.preferences[{k}]");
            let selector = raw
                .cluster_selector
                .as_ref()
                .map(|s| placement::parse_selector(s, &format!("{field}.clusterSelector")))
                .transpose()
                .map_err(|e| err(e.field, e.reason))?;
            for (name, v) in [
                ("weight", raw.weight),
                ("minReplicas", raw.min_replicas),
                ("maxReplicas", raw.max_replicas),
            ] {
                if v.is_some_and(|v| v < 0) {
                    return Err(err(format!("{field}.{name}"), "must not be negative"));
                }
            }
            let (min, max) = (raw.min_replicas.unwrap_or(0), raw.max_replicas);
            if min > MAX_PER_CLUSTER as i32 {
                return Err(err(
                    format!("{field}.minReplicas"),
                    format!("{min} is above the MyApp's limit of {MAX_PER_CLUSTER} per cluster"),
                ));
            }
            if let Some(max) = max.filter(|max| *max < min) {
                return Err(err(
                    format!("{field}.maxReplicas"),
                    format!("{max} is below minReplicas {min}"),
                ));
            }
            Ok(Pref { raw, selector })
        })
        .collect()
}

fn checked_spread(spread: Option<&SpreadConstraints>) -> Result<Spread, ScheduleError> {
    let Some(s) = spread else {
        return Ok(Spread::default());
    };
    let count = |name: &str, v: Option<i32>| match v {
        Some(n) if n < 0 => Err(err(format!("{SPREAD}.{name}"), "must not be negative")),
        v => Ok(v.map(|n| n as usize)),
    };
    let out = Spread {
        min_clusters: count("minClusters", s.min_clusters)?.unwrap_or(0),
        max_clusters: count("maxClusters", s.max_clusters)?,
        by_label: s.spread_by_label.clone().filter(|l| !l.is_empty()),
        min_groups: count("minGroups", s.min_groups)?.unwrap_or(0),
    };
    if out.max_clusters == Some(0) {
        return Err(err(format!("{SPREAD}.maxClusters"), "must be at least 1"));
    }
    if let Some(max) = out.max_clusters.filter(|max| *max < out.min_clusters) {
        return Err(err(
            format!("{SPREAD}.maxClusters"),
            format!("{max} is below minClusters {}", out.min_clusters),
        ));
    }
    if out.min_groups > 0 && out.by_label.is_none() {
        return Err(err(
            format!("{SPREAD}.spreadByLabel"),
            "minGroups needs a label to group by",
        ));
    }
    Ok(out)
}

#[derive(Debug, Default)]
struct Spread {
    min_clusters: usize,
    max_clusters: Option<usize>,
    by_label: Option<String>,
    min_groups: usize,
}

/// How a placed cluster takes part in this division.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Eligible,
    /// Keeps what it runs, gets nothing new.
    Frozen(SchedulingReason),
    FailedOver,
    Recovered,
}

pub fn schedule(inp: &Inputs<'_>) -> Result<Schedule, ScheduleError> {
    let rs = inp.placement.replica_scheduling.clone().unwrap_or_default();
    let prefs = checked_prefs(&rs.preferences)?;
    let spread = checked_spread(inp.placement.spread.as_ref())?;
    let divided = rs.mode != SchedulingMode::Duplicated;
    let failover = inp.placement.failover.as_ref().filter(|_| divided);
    let grace = failover
        .and_then(|f| f.grace_period_seconds)
        .map_or(DEFAULT_GRACE, |s| Duration::from_secs(s.max(0) as u64));
    let stay = failover.is_some_and(|f| f.on_recovery == RecoveryPolicy::Stay);
    if let Some(t) = rs.total_replicas.filter(|t| *t < 0) {
        return Err(err(
            format!("{RS}.totalReplicas"),
            format!("{t} is negative"),
        ));
    }

    let default_member = Member::default();
    let mut recheck: Option<Duration> = None;
    let mut earliest = |d: Duration| recheck = Some(recheck.map_or(d, |r| r.min(d)));
    let mut clusters = Vec::with_capacity(inp.placed.len());
    for name in inp.placed {
        let member = inp.members.get(name).unwrap_or(&default_member);
        let prev = inp.previous.get(name).cloned().unwrap_or_default();
        let was_failed = matches!(
            prev.reason,
            Some(SchedulingReason::FailedOver | SchedulingReason::Recovered)
        );
        let state = match member.not_ready_for {
            Some(down) if failover.is_some() && down >= grace => State::FailedOver,
            _ if was_failed && stay && !inp.spec_changed => State::Recovered,
            _ if member.unschedulable => State::Frozen(SchedulingReason::Cordoned),
            // Duplicated stays as it always was: a NotReady cluster is rendered for.
            Some(_) if !divided => State::Eligible,
            Some(down) => {
                if failover.is_some() {
                    earliest(grace - down);
                }
                State::Frozen(SchedulingReason::NotReady)
            }
            None => State::Eligible,
        };
        let pref = prefs
            .iter()
            .find(|p| p.matches(name, member))
            .map(|p| p.raw);
        clusters.push(Cluster {
            name,
            member,
            prev,
            state,
            weight: pref.and_then(|p| p.weight).unwrap_or(1) as u64,
            min: pref.and_then(|p| p.min_replicas).unwrap_or(0) as u32,
            max: pref
                .and_then(|p| p.max_replicas)
                .map_or(MAX_PER_CLUSTER, |m| (m as u32).min(MAX_PER_CLUSTER)),
        });
    }

    let mut out = if divided {
        let total = rs
            .total_replicas
            .or(inp.template_replicas)
            .unwrap_or(1)
            .max(0) as u32;
        divide_app(
            &clusters,
            total,
            rs.mode,
            inp.request,
            &spread,
            &mut earliest,
        )?
    } else {
        duplicate_app(&clusters, inp.template_replicas, &spread)?
    };
    out.recheck_after = recheck;
    Ok(out)
}

struct Cluster<'a> {
    name: &'a String,
    member: &'a Member,
    prev: Previous,
    state: State,
    weight: u64,
    min: u32,
    max: u32,
}

impl Cluster<'_> {
    fn group(&self, spread: &Spread) -> Option<&str> {
        spread
            .by_label
            .as_ref()
            .and_then(|l| self.member.labels.get(l))
            .map(String::as_str)
    }
}

/// Mode Duplicated: every chosen cluster runs the template's replicas.
fn duplicate_app(
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
    let chosen = select(&candidates, spread)?;
    let chosen: BTreeSet<&str> = chosen
        .order
        .iter()
        .map(|i| candidates[*i].name.as_str())
        .collect();
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
        recheck_after: None,
    })
}

/// Weighted or Capacity.
fn divide_app(
    clusters: &[Cluster<'_>],
    total: u32,
    mode: SchedulingMode,
    request: Resources,
    spread: &Spread,
    recheck: &mut impl FnMut(Duration),
) -> Result<Schedule, ScheduleError> {
    let by_weight = if mode == SchedulingMode::Capacity {
        SchedulingReason::Capacity
    } else {
        SchedulingReason::Weight
    };
    // Frozen clusters keep what they run, as far as the total goes (last names give way
    // first when the total shrank below them).
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
    let slot = |c: &Cluster<'_>| {
        // Capacity: the cluster could hold what it runs of this app plus its room.
        let cap = c.prev.replicas as u64
            + c.member
                .capacity
                .as_ref()
                .map_or(0, |cap| cap.room_for(&request).max(0) as u64);
        match mode {
            SchedulingMode::Capacity => Slot {
                weight: cap,
                min: c.min,
                max: (c.max as u64).min(cap) as u32,
                prev: c.prev.replicas,
            },
            _ => Slot {
                weight: c.weight,
                min: c.min,
                max: c.max,
                prev: c.prev.replicas,
            },
        }
    };
    let none = Slot {
        weight: 0,
        min: 0,
        max: 0,
        prev: 0,
    };
    let slots: Vec<Slot> = clusters
        .iter()
        .map(|c| match c.state {
            State::Eligible => slot(c),
            _ => none.clone(),
        })
        .collect();
    let candidates: Vec<Candidate> = clusters
        .iter()
        .zip(&slots)
        .filter(|(c, s)| frozen.get(c.name.as_str()).is_some_and(|n| *n > 0) || s.max > 0)
        .map(|(c, s)| Candidate {
            name: c.name,
            fixed: frozen.contains_key(c.name.as_str()),
            had: c.prev.replicas > 0,
            score: s.weight,
            group: c.group(spread),
        })
        .collect();
    let chosen = select(&candidates, spread)?;
    let mut slots = slots;
    let index: BTreeMap<&str, usize> = clusters
        .iter()
        .enumerate()
        .map(|(i, c)| (c.name.as_str(), i))
        .collect();
    let chosen_names: BTreeSet<&str> = chosen
        .order
        .iter()
        .map(|i| candidates[*i].name.as_str())
        .collect();
    for (i, c) in clusters.iter().enumerate() {
        if !chosen_names.contains(c.name.as_str()) && slots[i].min > 0 {
            return Err(err(
                format!("{SPREAD}.maxClusters"),
                format!(
                    "cluster {} needs minReplicas {} but is not among the clusters maxClusters allows",
                    c.name, slots[i].min
                ),
            ));
        }
        if !chosen_names.contains(c.name.as_str()) {
            slots[i].max = 0;
        }
    }
    for r in &chosen.required {
        let name = candidates[*r].name.as_str();
        if frozen.contains_key(name) {
            continue;
        }
        let s = &mut slots[index[name]];
        if s.max == 0 {
            return Err(err(
                SPREAD.to_string(),
                format!("cluster {name} must run a replica to meet the spread but can take none"),
            ));
        }
        s.min = s.min.max(1);
    }
    let share = left;
    let target = match divide(share, &slots) {
        Ok(t) => t,
        Err(e) => {
            let (runnable, down) = clusters.iter().fold((0, 0), |(r, d), c| match c.state {
                State::Eligible => (r + 1, d),
                _ => (r, d + 1),
            });
            let kept: u32 = frozen.values().sum();
            return Err(err(
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
            ));
        }
    };
    let target = if mode == SchedulingMode::Capacity {
        hysteresis(share, &slots, target)
    } else {
        target
    };
    // Which replicas are there only because a cluster failed over.
    let without_failover: Option<Vec<u32>> = clusters
        .iter()
        .any(|c| c.state == State::FailedOver)
        .then(|| {
            let slots: Vec<Slot> = slots
                .iter()
                .zip(clusters)
                .map(|(s, c)| match c.state {
                    State::FailedOver => slot(c),
                    _ => s.clone(),
                })
                .collect();
            divide(share, &slots).ok()
        })
        .flatten();

    let mut assignments: BTreeMap<String, Assignment> = BTreeMap::new();
    for (i, c) in clusters.iter().enumerate() {
        let a = match c.state {
            State::FailedOver => Assignment {
                replicas: c.prev.replicas,
                reason: SchedulingReason::FailedOver,
            },
            State::Recovered => Assignment {
                replicas: 0,
                reason: SchedulingReason::Recovered,
            },
            State::Frozen(reason) => Assignment {
                replicas: frozen[c.name.as_str()],
                reason,
            },
            State::Eligible => {
                let moved_in = without_failover.as_ref().is_some_and(|w| target[i] > w[i]);
                Assignment {
                    replicas: target[i],
                    reason: if slots[i].max == 0
                        && !chosen_names.contains(c.name.as_str())
                        && candidates.iter().any(|k| k.name == c.name)
                    {
                        SchedulingReason::Spread
                    } else if moved_in {
                        SchedulingReason::Failover
                    } else {
                        by_weight
                    },
                }
            }
        };
        assignments.insert(c.name.clone(), a);
    }
    // Make before break: while any cluster's new share is not Ready, the clusters losing
    // replicas keep them (failed-over clusters are left alone anyway).
    let pending = clusters.iter().any(|c| {
        let a = assignments[c.name.as_str()];
        c.state == State::Eligible && a.replicas > c.prev.ready_replicas
    });
    if pending {
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
                recheck(SURPLUS_RECHECK);
            }
        }
    }
    Ok(Schedule {
        divided: true,
        clusters: assignments,
        recheck_after: None,
    })
}

/// A cluster spread may choose.
struct Candidate<'a> {
    name: &'a String,
    /// Frozen with replicas: always kept, first.
    fixed: bool,
    had: bool,
    score: u64,
    group: Option<&'a str>,
}

struct Chosen {
    /// Indexes into the candidates, in the order they were chosen.
    order: Vec<usize>,
    /// Those that must run at least one replica.
    required: Vec<usize>,
}

/// Spread: clusters already running the app first, then higher score, then name; one per
/// group first until `minGroups` groups are covered; at most `maxClusters`.
fn select(candidates: &[Candidate<'_>], spread: &Spread) -> Result<Chosen, ScheduleError> {
    let mut ranked: Vec<usize> = (0..candidates.len()).collect();
    ranked.sort_by(|a, b| {
        let (a, b) = (&candidates[*a], &candidates[*b]);
        (b.fixed, b.had, b.score)
            .cmp(&(a.fixed, a.had, a.score))
            .then_with(|| a.name.cmp(b.name))
    });
    let mut order: Vec<usize> = Vec::new();
    let mut groups: BTreeSet<&str> = BTreeSet::new();
    if spread.min_groups > 0 {
        for &i in &ranked {
            if groups.len() >= spread.min_groups {
                break;
            }
            if let Some(g) = candidates[i].group.filter(|g| !groups.contains(g)) {
                groups.insert(g);
                order.push(i);
            }
        }
        if groups.len() < spread.min_groups {
            return Err(err(
                format!("{SPREAD}.minGroups"),
                format!(
                    "{} groups needed, the schedulable clusters form {} by label {}",
                    spread.min_groups,
                    groups.len(),
                    spread.by_label.as_deref().unwrap_or_default()
                ),
            ));
        }
    }
    let representatives = order.clone();
    let fixed = candidates.iter().filter(|c| c.fixed).count();
    let limit = spread.max_clusters.map_or(usize::MAX, |m| m.max(fixed));
    if representatives.len() > limit {
        return Err(err(
            format!("{SPREAD}.maxClusters"),
            format!(
                "{} clusters cannot cover minGroups {}",
                limit, spread.min_groups
            ),
        ));
    }
    for &i in &ranked {
        if !order.contains(&i) && (order.len() < limit || candidates[i].fixed) {
            order.push(i);
        }
    }
    if order.len() < spread.min_clusters {
        return Err(err(
            format!("{SPREAD}.minClusters"),
            format!(
                "{} clusters needed, {} can take replicas",
                spread.min_clusters,
                order.len()
            ),
        ));
    }
    let mut required = representatives;
    for &i in &order {
        if required.len() >= spread.min_clusters {
            break;
        }
        if !required.contains(&i) {
            required.push(i);
        }
    }
    Ok(Chosen { order, required })
}

/// One cluster's input to [`divide`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub weight: u64,
    pub min: u32,
    pub max: u32,
    /// What it had: rounding leans towards it.
    pub prev: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Infeasible {
    pub min_sum: u64,
    pub max_sum: u64,
}

/// Divides `total` among `slots` in proportion to their weights within `[min, max]`:
/// each quota is clamped to its bounds and the rest shared in proportion (exact
/// rationals), then rounded by largest remainder so that every share is its quota
/// rounded down or up. Among those roundings it picks the one closest to `prev`, then
/// larger remainders, then earlier slots. A slot with weight 0 gets its minimum.
pub fn divide(total: u32, slots: &[Slot]) -> Result<Vec<u32>, Infeasible> {
    let hi: Vec<u32> = slots
        .iter()
        .map(|s| {
            if s.weight == 0 {
                s.min
            } else {
                s.max.max(s.min)
            }
        })
        .collect();
    let min_sum: u64 = slots.iter().map(|s| s.min as u64).sum();
    let max_sum: u64 = hi.iter().map(|h| *h as u64).sum();
    if (total as u64) < min_sum || (total as u64) > max_sum {
        return Err(Infeasible { min_sum, max_sum });
    }
    // Water-filling: fix the clusters whose proportional quota leaves their bounds, on
    // the side that is violated more, until the rest fit.
    let n = slots.len();
    let mut fixed: Vec<Option<u32>> = vec![None; n];
    let (rest, weights) = loop {
        let free: Vec<usize> = (0..n).filter(|i| fixed[*i].is_none()).collect();
        let rest = total as u128 - fixed.iter().flatten().map(|v| *v as u128).sum::<u128>();
        let weights: u128 = free.iter().map(|i| slots[*i].weight as u128).sum();
        if free.is_empty() || weights == 0 {
            break (rest, weights);
        }
        // Quota of i is rest * w_i / weights; compare numerators over `weights`.
        let num = |i: usize| rest * slots[i].weight as u128;
        let (mut excess, mut deficit) = (0u128, 0u128);
        for &i in &free {
            let (lo, up) = (slots[i].min as u128 * weights, hi[i] as u128 * weights);
            excess += num(i).saturating_sub(up);
            deficit += lo.saturating_sub(num(i));
        }
        if excess == 0 && deficit == 0 {
            break (rest, weights);
        }
        for &i in &free {
            if excess >= deficit && num(i) > hi[i] as u128 * weights {
                fixed[i] = Some(hi[i]);
            } else if excess < deficit && num(i) < slots[i].min as u128 * weights {
                fixed[i] = Some(slots[i].min);
            }
        }
    };
    let mut out: Vec<u32> = fixed.iter().map(|f| f.unwrap_or(0)).collect();
    let free: Vec<usize> = (0..n).filter(|i| fixed[*i].is_none()).collect();
    if weights == 0 {
        // Only zero weights are left: their minimum, which feasibility made the rest.
        for &i in &free {
            out[i] = slots[i].min;
        }
        return Ok(out);
    }
    let mut remainders = Vec::new();
    let mut handed = 0u128;
    for &i in &free {
        let num = rest * slots[i].weight as u128;
        out[i] = (num / weights) as u32;
        handed += num / weights;
        if !num.is_multiple_of(weights) {
            remainders.push((i, num % weights));
        }
    }
    let ups = (rest - handed) as usize;
    remainders.sort_by(|(a, ra), (b, rb)| {
        let toward = |i: usize| slots[i].prev > out[i];
        toward(*b).cmp(&toward(*a)).then(rb.cmp(ra)).then(a.cmp(b))
    });
    for (i, _) in remainders.into_iter().take(ups) {
        out[i] += 1;
    }
    Ok(out)
}

/// Capacity moves all the time (our own pods fill it): keep the previous division while
/// it is still valid and no share is off its new quota by more than the band.
fn hysteresis(total: u32, slots: &[Slot], target: Vec<u32>) -> Vec<u32> {
    let prev_sum: u64 = slots.iter().map(|s| s.prev as u64).sum();
    let valid = prev_sum == total as u64
        && slots
            .iter()
            .all(|s| s.prev >= s.min && s.prev <= s.max && (s.weight > 0 || s.prev == s.min));
    if !valid {
        return target;
    }
    let band = 1.0 + f64::from(total) / 10.0;
    let weights: f64 = slots.iter().map(|s| s.weight as f64).sum();
    let close = slots.iter().zip(&target).all(|(s, t)| {
        // Both the new rounding and the raw quota must be near what runs.
        let quota = if weights > 0.0 {
            f64::from(total) * s.weight as f64 / weights
        } else {
            0.0
        };
        (f64::from(s.prev) - f64::from(*t)).abs() <= band
            && (f64::from(s.prev) - quota).abs() <= band
    });
    if close {
        slots.iter().map(|s| s.prev).collect()
    } else {
        target
    }
}

/// Writes the division into the status the hub publishes: each cluster's assigned
/// replicas and reason, the desired total and the ready total.
pub fn annotate(status: &mut FederatedMyAppStatus, schedule: &Schedule) {
    for c in &mut status.clusters {
        if let Some(a) = schedule.clusters.get(&c.name) {
            c.replicas = Some(a.replicas as i32);
            c.scheduling_reason = Some(a.reason);
        }
    }
    status.replicas = Some(schedule.total() as i32);
    status.ready_replicas = status.clusters.iter().map(|c| c.ready_replicas).sum();
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_crds::member::ClusterCapacity;
    use proptest::prelude::*;

    use SchedulingReason::*;

    fn slot(weight: u64, min: u32, max: u32, prev: u32) -> Slot {
        Slot {
            weight,
            min,
            max,
            prev,
        }
    }

    fn weights(ws: &[u64]) -> Vec<Slot> {
        ws.iter().map(|w| slot(*w, 0, MAX_PER_CLUSTER, 0)).collect()
    }

    // ---- schedule: a FederatedMyApp's placement over registered clusters ----

    fn placement(yaml: &str) -> Placement {
        serde_yaml::from_str(yaml).expect("valid placement YAML")
    }

    fn member(labels: &[(&str, &str)]) -> Member {
        Member::with_labels(
            labels
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
        )
    }

    fn three() -> Members {
        [
            ("c1", member(&[("region", "eu")])),
            ("c2", member(&[("region", "eu")])),
            ("c3", member(&[("region", "us")])),
        ]
        .into_iter()
        .map(|(n, m)| (n.to_owned(), m))
        .collect()
    }

    struct Case {
        placement: Placement,
        members: Members,
        template_replicas: Option<i32>,
        request: Resources,
        previous: BTreeMap<String, Previous>,
        spec_changed: bool,
    }

    impl Case {
        fn new(yaml: &str) -> Self {
            Self {
                placement: placement(yaml),
                members: three(),
                template_replicas: None,
                request: DEFAULT_REQUEST,
                previous: BTreeMap::new(),
                spec_changed: false,
            }
        }

        fn run(&self) -> Result<Schedule, ScheduleError> {
            let placed: Vec<String> = self.members.keys().cloned().collect();
            schedule(&Inputs {
                placement: &self.placement,
                placed: &placed,
                members: &self.members,
                template_replicas: self.template_replicas,
                request: self.request,
                previous: self.previous.clone(),
                spec_changed: self.spec_changed,
            })
        }

        fn ok(&self) -> Schedule {
            self.run().expect("the division is feasible")
        }

        /// What the status says after this division, with every cluster's share Ready.
        fn settle(&mut self, s: &Schedule) {
            self.previous = s
                .clusters
                .iter()
                .map(|(c, a)| {
                    let prev = Previous {
                        replicas: a.replicas,
                        ready_replicas: a.replicas,
                        reason: Some(a.reason),
                    };
                    (c.clone(), prev)
                })
                .collect();
            self.spec_changed = false;
        }

        fn set_ready(&mut self, cluster: &str, ready: u32) {
            self.previous.get_mut(cluster).unwrap().ready_replicas = ready;
        }
    }

    fn shares(s: &Schedule) -> Vec<(u32, SchedulingReason)> {
        s.clusters
            .values()
            .map(|a| (a.replicas, a.reason))
            .collect()
    }

    const WEIGHTED_2_1_1: &str = "replicaScheduling: {mode: Weighted, totalReplicas: 12, preferences: [{clusterNames: [c1], weight: 2}]}";

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

    fn capacity(cpu_free_millis: i64) -> ClusterCapacity {
        ClusterCapacity {
            nodes: 1,
            allocatable: Resources {
                cpu_millis: cpu_free_millis,
                memory_bytes: 1 << 40,
            },
            requested: Resources::default(),
            largest_free: Resources {
                cpu_millis: cpu_free_millis,
                memory_bytes: 1 << 40,
            },
        }
    }

    fn with_capacity(c: &mut Case, cpu: [i64; 3]) {
        for (name, cpu) in ["c1", "c2", "c3"].iter().zip(cpu) {
            c.members.get_mut(*name).unwrap().capacity = Some(capacity(cpu));
        }
    }

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
        // c3 grows a lot: replicas move there, the others hold theirs until they run.
        with_capacity(&mut c, [600, 700, 6000]);
        let moved = c.ok();
        assert_eq!(shares(&moved), [(4, Surplus), (3, Surplus), (7, Capacity)]);
        c.set_ready("c3", 7);
        let moved = c.ok();
        assert_eq!(
            shares(&moved),
            [(2, Capacity), (1, Capacity), (7, Capacity)]
        );
    }

    #[test]
    fn spread_max_clusters_keeps_clusters_already_running() {
        let mut c = Case::new(
            "replicaScheduling: {mode: Weighted, totalReplicas: 6, preferences: [{clusterNames: [c3], weight: 5}]}\nspread: {maxClusters: 2}",
        );
        let s = c.ok();
        assert_eq!(shares(&s), [(1, Weight), (0, Spread), (5, Weight)]);
        // c2 becomes the heavier one: the running c1 still keeps its slot.
        c.settle(&s);
        c.placement = placement(
            "replicaScheduling: {mode: Weighted, totalReplicas: 6, preferences: [{clusterNames: [c3], weight: 5}, {clusterNames: [c2], weight: 2}]}\nspread: {maxClusters: 2}",
        );
        assert_eq!(shares(&c.ok()), [(1, Weight), (0, Spread), (5, Weight)]);
    }

    #[test]
    fn spread_over_groups_gives_each_group_a_replica() {
        // Weights put everything in eu; two regions are required.
        let c = Case::new(
            "replicaScheduling: {mode: Weighted, totalReplicas: 2, preferences: [{clusterNames: [c3], weight: 0}, {weight: 10}]}\n\
             spread: {spreadByLabel: region, minGroups: 2}",
        );
        let s = c.ok();
        assert_eq!(s.clusters["c3"].replicas, 1, "{s:?}");
        assert_eq!(s.total(), 2);
        let e = Case::new(
            "replicaScheduling: {mode: Weighted}\nspread: {spreadByLabel: region, minGroups: 3}",
        )
        .run()
        .unwrap_err();
        assert_eq!(e.field, "spec.placement.spread.minGroups");
        assert_eq!(
            e.reason,
            "3 groups needed, the schedulable clusters form 2 by label region"
        );
    }

    #[test]
    fn spread_min_clusters() {
        let s = Case::new(
            "replicaScheduling: {mode: Weighted, totalReplicas: 3, preferences: [{clusterNames: [c1], weight: 100}]}\nspread: {minClusters: 3}",
        )
        .ok();
        assert_eq!(shares(&s), [(1, Weight), (1, Weight), (1, Weight)]);
        let e = Case::new(
            "replicaScheduling: {mode: Weighted, totalReplicas: 2}\nspread: {minClusters: 3}",
        )
        .run()
        .unwrap_err();
        assert_eq!(e.field, "spec.placement.replicaScheduling.totalReplicas");
        let e = Case::new("spread: {minClusters: 4}").run().unwrap_err();
        assert_eq!(e.reason, "4 clusters needed, 3 can take replicas");
    }

    #[test]
    fn duplicated_spread_picks_clusters_in_name_order() {
        let mut c = Case::new("spread: {maxClusters: 2}");
        let s = c.ok();
        assert_eq!(shares(&s), [(1, Duplicated), (1, Duplicated), (0, Spread)]);
        // Once c3 runs it and c1 does not, c3 keeps it.
        c.previous = [("c2", 1), ("c3", 1)]
            .into_iter()
            .map(|(n, r)| {
                (
                    n.to_owned(),
                    Previous {
                        replicas: r,
                        ready_replicas: r,
                        reason: Some(Duplicated),
                    },
                )
            })
            .collect();
        assert_eq!(
            shares(&c.ok()),
            [(0, Spread), (1, Duplicated), (1, Duplicated)]
        );
    }

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

    impl Schedule {
        fn with_reason(mut self, cluster: &str, reason: SchedulingReason) -> Self {
            self.clusters.get_mut(cluster).unwrap().reason = reason;
            self
        }
    }

    const FAILOVER: &str = "replicaScheduling: {mode: Weighted, totalReplicas: 12, preferences: [{clusterNames: [c1], weight: 2}]}\nfailover: {gracePeriodSeconds: 60}";

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

    #[test]
    fn previous_reads_status_and_older_status_without_replicas() {
        let status: FederatedMyAppStatus = serde_yaml::from_str(
            "clusters:\n- {name: a, replicas: 4, readyReplicas: 2, schedulingReason: Weight}\n- {name: b, readyReplicas: 0}\n- {name: c, replicas: 40, readyReplicas: -3}\n",
        )
        .unwrap();
        let p = previous(Some(&status));
        assert_eq!(
            p["a"],
            Previous {
                replicas: 4,
                ready_replicas: 2,
                reason: Some(Weight)
            }
        );
        assert_eq!(
            p["b"],
            Previous {
                replicas: 1,
                ready_replicas: 0,
                reason: None
            }
        );
        assert_eq!(
            p["c"],
            Previous {
                replicas: 10,
                ready_replicas: 0,
                reason: None
            }
        );
        assert!(previous(None).is_empty());
    }

    #[test]
    fn annotate_fills_each_cluster_and_the_totals() {
        let s = Case::new(WEIGHTED_2_1_1).ok();
        let mut status: FederatedMyAppStatus = serde_yaml::from_str(
            "clusters:\n- {name: c1, readyReplicas: 6}\n- {name: c2, readyReplicas: 1}\n",
        )
        .unwrap();
        annotate(&mut status, &s);
        assert_eq!(status.replicas, Some(12));
        assert_eq!(status.ready_replicas, 7);
        assert_eq!(status.clusters[0].replicas, Some(6));
        assert_eq!(status.clusters[1].scheduling_reason, Some(Weight));
    }

    // ---- schedule: properties ----

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
                (format!("k{i}"), m)
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
                    let a = s.clusters[&format!("k{i}")];
                    prop_assert!(a.replicas <= MAX_PER_CLUSTER);
                    if mode == 1 {
                        prop_assert!(a.replicas as i64 <= cpu / 500, "{:?} exceeds room {}", a, cpu / 500);
                    }
                }
            }
        }
    }

    // ---- divide: ugly inputs first ----

    #[test]
    fn divide_nothing_among_nobody() {
        assert_eq!(divide(0, &[]), Ok(vec![]));
        assert_eq!(
            divide(1, &[]),
            Err(Infeasible {
                min_sum: 0,
                max_sum: 0
            })
        );
    }

    #[test]
    fn divide_zero_replicas() {
        assert_eq!(divide(0, &weights(&[1, 2, 3])), Ok(vec![0, 0, 0]));
    }

    #[test]
    fn divide_zero_weights_take_their_minimum_only() {
        let slots = [slot(0, 2, 10, 0), slot(0, 0, 10, 5)];
        assert_eq!(divide(2, &slots), Ok(vec![2, 0]));
        assert_eq!(
            divide(3, &slots),
            Err(Infeasible {
                min_sum: 2,
                max_sum: 2
            })
        );
    }

    #[test]
    fn divide_reports_totals_outside_the_bounds() {
        let slots = [slot(1, 3, 4, 0), slot(1, 3, 4, 0)];
        assert_eq!(
            divide(5, &slots),
            Err(Infeasible {
                min_sum: 6,
                max_sum: 8
            })
        );
        assert!(divide(9, &slots).is_err());
        assert!(divide(6, &slots).is_ok() && divide(8, &slots).is_ok());
        assert!(
            divide(31, &weights(&[1, 1, 1])).is_err(),
            "10 per cluster at most"
        );
    }

    #[test]
    fn divide_two_one_one() {
        assert_eq!(divide(12, &weights(&[2, 1, 1])), Ok(vec![6, 3, 3]));
        assert_eq!(divide(4, &weights(&[2, 1, 1])), Ok(vec![2, 1, 1]));
    }

    #[test]
    fn divide_ties_go_to_earlier_slots_then_towards_the_previous_division() {
        assert_eq!(divide(10, &weights(&[1, 1, 1])), Ok(vec![4, 3, 3]));
        let prev: Vec<Slot> = [3, 3, 4]
            .iter()
            .map(|p| slot(1, 0, MAX_PER_CLUSTER, *p))
            .collect();
        assert_eq!(divide(10, &prev), Ok(vec![3, 3, 4]));
    }

    #[test]
    fn divide_clamps_and_shares_the_rest() {
        let slots = [slot(1, 0, 2, 0), slot(1, 0, 10, 0), slot(1, 0, 10, 0)];
        assert_eq!(divide(12, &slots), Ok(vec![2, 5, 5]));
        let slots = [slot(1, 1, 10, 0), slot(1, 1, 10, 0), slot(10, 0, 10, 0)];
        assert_eq!(divide(3, &slots), Ok(vec![1, 1, 1]));
        // A large weight saturates at 10; the rest spreads over the others.
        let slots = weights(&[1000, 1, 1]);
        assert_eq!(divide(14, &slots), Ok(vec![10, 2, 2]));
    }

    // ---- divide: properties ----

    fn arb_slots(max_n: usize) -> impl Strategy<Value = Vec<Slot>> {
        prop::collection::vec(
            (0u64..20, 0u32..4, 0u32..=10, 0u32..=10).prop_map(|(w, lo, span, prev)| Slot {
                weight: w,
                min: lo,
                max: (lo + span).min(10),
                prev,
            }),
            0..max_n,
        )
    }

    /// Every division of `total` that rounds each quota `total * w / sum` down or up.
    fn roundings(total: u32, ws: &[u64]) -> Vec<Vec<u32>> {
        let sum: u64 = ws.iter().sum();
        let mut all = vec![vec![]];
        for w in ws {
            let q = total as u64 * w;
            let (lo, hi) = ((q / sum) as u32, q.div_ceil(sum) as u32);
            all = all
                .into_iter()
                .flat_map(|v: Vec<u32>| {
                    (lo..=hi).map(move |x| {
                        let mut v = v.clone();
                        v.push(x);
                        v
                    })
                })
                .collect();
        }
        all.retain(|v| v.iter().sum::<u32>() == total);
        all
    }

    proptest! {
        #[test]
        fn divide_sums_to_the_total_within_bounds_or_reports(total in 0u32..80, slots in arb_slots(8)) {
            match divide(total, &slots) {
                Ok(out) => {
                    prop_assert_eq!(out.iter().sum::<u32>(), total);
                    for (a, s) in out.iter().zip(&slots) {
                        prop_assert!(*a >= s.min, "{} below min {}", a, s.min);
                        prop_assert!(*a <= s.max.max(s.min), "{} above max {}", a, s.max);
                        if s.weight == 0 { prop_assert_eq!(*a, s.min); }
                    }
                }
                Err(e) => {
                    let lo: u64 = slots.iter().map(|s| s.min as u64).sum();
                    let hi: u64 = slots.iter().map(|s| if s.weight == 0 { s.min } else { s.max.max(s.min) } as u64).sum();
                    prop_assert_eq!(e, Infeasible { min_sum: lo, max_sum: hi });
                    prop_assert!((total as u64) < lo || (total as u64) > hi);
                }
            }
        }

        #[test]
        fn divide_is_proportional_within_one_replica(total in 0u32..80, slots in arb_slots(8)) {
            if let Ok(out) = divide(total, &slots) {
                // No replica could move from j to i and leave both closer to their
                // quota: a_j/w_j - a_i/w_i < 1/w_i + 1/w_j, wherever i may grow and j shrink.
                for (i, si) in slots.iter().enumerate() {
                    for (j, sj) in slots.iter().enumerate() {
                        if i == j || si.weight == 0 || sj.weight == 0 { continue; }
                        if out[i] >= si.max || out[j] <= sj.min { continue; }
                        let (ai, aj, wi, wj) = (out[i] as u64, out[j] as u64, si.weight, sj.weight);
                        prop_assert!(aj * wi < ai * wj + wi + wj, "{:?} {:?}", out, slots);
                    }
                }
            }
        }

        #[test]
        fn divide_without_bounds_is_each_quota_rounded(total in 0u32..=10, ws in prop::collection::vec(1u64..50, 3..6)) {
            let out = divide(total, &weights(&ws)).unwrap();
            let sum: u64 = ws.iter().sum();
            for (a, w) in out.iter().zip(&ws) {
                let quota = total as u64 * w; // over `sum`
                prop_assert!((*a as u64) * sum + sum > quota && quota + sum > (*a as u64) * sum,
                    "{} is not {}/{} rounded", a, quota, sum);
            }
        }

        #[test]
        fn divide_is_deterministic(total in 0u32..80, slots in arb_slots(8)) {
            prop_assert_eq!(divide(total, &slots), divide(total, &slots));
        }

        #[test]
        fn divide_rounds_to_the_division_closest_to_the_previous(
            total in 0u32..=10,
            ws in prop::collection::vec(1u64..20, 1..6),
            prev in prop::collection::vec(0u32..=10, 6),
        ) {
            // Totals up to 10 never clamp at 10 per cluster: every rounding is a candidate.
            let slots: Vec<Slot> = ws.iter().zip(&prev).map(|(w, p)| slot(*w, 0, MAX_PER_CLUSTER, *p)).collect();
            let out = divide(total, &slots).unwrap();
            let distance = |v: &[u32]| -> u32 { v.iter().zip(&prev).map(|(a, p)| a.abs_diff(*p)).sum() };
            let all = roundings(total, &ws);
            prop_assert!(all.contains(&out), "{:?} is not a rounding of the quotas", out);
            for cand in all {
                prop_assert!(distance(&cand) >= distance(&out), "{:?} is closer than {:?} to {:?}", cand, out, prev);
            }
        }

        #[test]
        fn a_cluster_leaving_moves_only_its_replicas(total in 0u32..40, ws in prop::collection::vec(1u64..20, 2..7), gone in 0usize..7) {
            let gone = gone % ws.len();
            let slots = weights(&ws);
            let Ok(before) = divide(total, &slots) else { return Ok(()); };
            let mut rest: Vec<Slot> = slots.iter().zip(&before).map(|(s, b)| slot(s.weight, 0, MAX_PER_CLUSTER, *b)).collect();
            rest.remove(gone);
            let mut kept = before.clone();
            kept.remove(gone);
            if let Ok(after) = divide(total, &rest) {
                for (a, b) in after.iter().zip(&kept) {
                    prop_assert!(a >= b, "a remaining cluster lost replicas: {:?} -> {:?}", kept, after);
                }
            }
        }

        #[test]
        fn a_cluster_joining_takes_replicas_only_for_itself(total in 0u32..40, ws in prop::collection::vec(1u64..20, 1..6), new in 1u64..20) {
            let slots = weights(&ws);
            let Ok(before) = divide(total, &slots) else { return Ok(()); };
            let mut more: Vec<Slot> = slots.iter().zip(&before).map(|(s, b)| slot(s.weight, 0, MAX_PER_CLUSTER, *b)).collect();
            more.push(slot(new, 0, MAX_PER_CLUSTER, 0));
            let after = divide(total, &more).unwrap();
            for (a, b) in after.iter().zip(&before) {
                prop_assert!(a <= b, "an existing cluster gained replicas: {:?} -> {:?}", before, after);
            }
        }
    }
}
