//! Status: a plan and agents' reports, folded into `FederatedMyApp.status`. Pure: the
//! hub's status board holds the inputs and writes the result.
//!
//! Per cluster the plan says what it should run and its agent's report says what it
//! runs; `Propagated` names the most urgent reason a cluster is behind, `Ready` counts
//! the placed clusters whose MyApp is Ready. The division (replicas per cluster and why)
//! is written in too ([`crate::schedule::annotate`]): the next plan reads it back as the
//! previous division.
//!
//! Bounded whatever the number of clusters ([`compute`]): counts by state, messages cut
//! at [`CLUSTER_MESSAGE_MAX`] and [`CONDITION_MESSAGE_MAX`] ("… and N more"), every
//! cluster listed up to [`FULL_LIST_MAX`], past that the [`URGENT_MAX`] most urgent and
//! the whole division in compact form. [`detail`] is the same fold with nothing left out.

use std::collections::{BTreeMap, HashSet};

use arcstr::ArcStr;
use flotilla_crds::condition;
use flotilla_crds::federated::{
    ClusterStatus, FULL_LIST_MAX, FederatedMyAppStatus, RolloutStatus, URGENT_MAX,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::index::Held;
use crate::plan::{AppError, AppPlan, ClusterPlan, FAILED_OVER, KeepReason};
use crate::rollout;
use crate::schedule;

/// A cluster's message in a bounded status is cut to this many bytes.
pub const CLUSTER_MESSAGE_MAX: usize = 256;
/// A condition's message in a bounded status is cut to this many bytes.
pub const CONDITION_MESSAGE_MAX: usize = 1024;

/// What an agent last said about one MyApp: the wire's `StatusReport`, as the hub
/// reads it. A hub holds one per (app, cluster), a million on a big fleet, so a healthy
/// report is small: the hash is shared ([`ArcStr`], one pointer) and the words are boxed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Report {
    /// The content hash of the MyApp the status belongs to.
    pub hash: ArcStr,
    pub exists: bool,
    pub ready: bool,
    pub ready_replicas: i32,
    pub observed_generation: i64,
    pub generation: i64,
    /// The pods the member's MyApp runs, whoever decided how many (absent from older
    /// agents).
    pub replicas: Option<i32>,
    /// What it says in words, absent when it says nothing ([`Report::with_words`]).
    pub words: Option<Box<Words>>,
}

const _: () = assert!(size_of::<Report>() <= 48);

/// One app's reports by cluster; the hub shares one name per cluster among them.
pub type Reports = BTreeMap<ArcStr, Report>;

/// What a report says in words: rare on a healthy fleet.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Words {
    /// The MyApp's `Degraded` condition, when True: reason and message.
    pub degraded: Option<(String, String)>,
    /// Why the agent could not apply (or remove) it; it retries by itself.
    pub apply_error: Option<String>,
    /// The autoscaler in the member that owns the replicas, in words.
    pub autoscaler: Option<String>,
    /// Spec fields someone else changed in the member since the agent applied it, in
    /// words.
    pub drift: Option<String>,
}

impl Report {
    /// The report with these words; none at all are stored as `None`, so that equal
    /// reports compare equal.
    pub fn with_words(self, words: Words) -> Report {
        let words = Some(Box::new(words)).filter(|w| **w != Words::default());
        Report { words, ..self }
    }

    fn said(&self) -> Option<&Words> {
        self.words.as_deref()
    }

    pub fn degraded(&self) -> Option<&(String, String)> {
        self.said()?.degraded.as_ref()
    }

    pub fn apply_error(&self) -> Option<&str> {
        self.said()?.apply_error.as_deref()
    }

    pub fn autoscaler(&self) -> Option<&str> {
        self.said()?.autoscaler.as_deref()
    }

    pub fn drift(&self) -> Option<&str> {
        self.said()?.drift.as_deref()
    }

    pub fn held(&self) -> Held {
        match (self.apply_error(), self.exists) {
            (Some(_), _) => Held::Failed,
            (None, true) if self.drift().is_some() => Held::Drifted,
            (None, true) => Held::Present,
            (None, false) => Held::Absent,
        }
    }

    fn not_ready_reason(&self) -> String {
        if self.observed_generation < self.generation {
            return "the operator has not observed the latest spec yet".into();
        }
        match self.degraded() {
            Some((reason, message)) => format!("{reason}: {message}"),
            None => format!("{} replica(s) ready", self.ready_replicas),
        }
    }
}

/// What status says of a cluster a progressive rollout holds back.
pub const HELD: &str = "held until its wave of the rollout (status.rollout): it keeps what it runs";

/// Why a cluster's MyApp is not propagated, most urgent first: errors a user must fix
/// before states that pass by themselves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    RenderFailed,
    /// Named in `spec.placement.clusters`, not granted to the app's namespace.
    NotGranted,
    ApplyFailed,
    AgentDisconnected,
    Pending,
    /// A progressive rollout has not reached it yet.
    Held,
    /// Its MyApp was changed in the member: the hub sent its Apply again.
    Drifted,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::RenderFailed => "RenderFailed",
            Reason::NotGranted => "NotGranted",
            Reason::ApplyFailed => "ApplyFailed",
            Reason::AgentDisconnected => "AgentDisconnected",
            Reason::Pending => "Pending",
            Reason::Held => "RolloutHeld",
            Reason::Drifted => "Drifted",
        }
    }
}

/// How urgent a cluster's entry is, most urgent first: the order a bounded status lists
/// clusters in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Urgency {
    Behind(Reason),
    NotReady,
    FailedOver,
    Fine,
}

/// Everything the status of one app is computed from.
pub struct Inputs<'a> {
    pub plan: &'a AppPlan,
    /// The app is being deleted and these clusters have not confirmed it.
    pub deleting_on: Option<&'a [String]>,
    pub reports: Option<&'a Reports>,
    /// Clusters whose MemberCluster is Ready (its agent heartbeated within the grace). A
    /// session that ends does not change it: a reconnect within the grace changes no
    /// status.
    pub reachable: &'a HashSet<String>,
}

/// How much of the fold a status keeps.
#[derive(Clone, Copy)]
struct Limits {
    cluster_message: usize,
    condition_message: usize,
    /// Past [`FULL_LIST_MAX`] entries, list the most urgent and the division.
    bounded_list: bool,
}

const BOUNDED: Limits = Limits {
    cluster_message: CLUSTER_MESSAGE_MAX,
    condition_message: CONDITION_MESSAGE_MAX,
    bounded_list: true,
};

const WHOLE: Limits = Limits {
    cluster_message: usize::MAX,
    condition_message: usize::MAX,
    bounded_list: false,
};

/// The clusters' entries and what they add up to.
#[derive(Default)]
struct Tally {
    clusters: Vec<(ClusterStatus, Urgency)>,
    placed: i32,
    ready: i32,
    applied: i32,
    failed_over: i32,
    /// (cluster, reason, message) for each cluster not propagated.
    not_propagated: Vec<(String, Reason, String)>,
    /// `cluster: why` for each placed cluster whose MyApp is not Ready.
    not_ready: Vec<String>,
}

impl Tally {
    fn count(&self, reason: Reason) -> i32 {
        self.not_propagated
            .iter()
            .filter(|(_, r, _)| *r == reason)
            .count() as i32
    }
}

/// The status as a pure function of the inputs, bounded (see the module's header);
/// `previous` keeps condition transition times stable while a condition's status does
/// not change.
pub fn compute(
    inputs: &Inputs<'_>,
    previous: Option<&FederatedMyAppStatus>,
    now: &Time,
) -> FederatedMyAppStatus {
    fold(inputs, previous, now, BOUNDED)
}

/// The same fold with every cluster listed and every message whole (what
/// `flotilla-hub status NAME` shows).
pub fn detail(
    inputs: &Inputs<'_>,
    previous: Option<&FederatedMyAppStatus>,
    now: &Time,
) -> FederatedMyAppStatus {
    fold(inputs, previous, now, WHOLE)
}

fn fold(
    inputs: &Inputs<'_>,
    previous: Option<&FederatedMyAppStatus>,
    now: &Time,
    limits: Limits,
) -> FederatedMyAppStatus {
    let plan = inputs.plan;
    let tally = tally(inputs, limits.cluster_message);
    let cond = |type_: &str, ok: bool, reason: &str, message: String| {
        condition::new(type_, ok, reason, message, plan.generation, now)
    };
    let propagated = propagated(inputs, &tally, limits.condition_message, cond);
    let ready = match &plan.placement_error {
        // Not planned at all: "the placement selects no cluster" would blame the wrong field.
        Some(e @ (AppError::Refused(_) | AppError::NotGranted(_))) => cond(
            "Ready",
            false,
            e.reason(),
            cut(e.to_string(), limits.condition_message),
        ),
        _ => ready(&tally, limits.condition_message, cond),
    };
    let (unplannable, deleting) = (plan.placement_error.is_some(), inputs.deleting_on.is_some());
    let rollout = plan.rollout.as_ref();
    let [reconciling, stalled] = progress(
        &tally,
        (unplannable, deleting, rollout),
        &propagated,
        &ready,
        cond,
    );
    let before: &[Condition] = previous.map_or(&[], |p| &p.conditions);
    let failed = tally.count(Reason::RenderFailed) + tally.count(Reason::ApplyFailed);
    let mut status = FederatedMyAppStatus {
        observed_generation: plan.generation,
        conditions: [propagated, ready, reconciling, stalled]
            .into_iter()
            .map(|c| condition::settle(c, before))
            .collect(),
        placed_clusters: tally.placed,
        ready_clusters: tally.ready,
        applied_clusters: tally.applied,
        pending_clusters: tally.count(Reason::Pending),
        disconnected_clusters: tally.count(Reason::AgentDisconnected),
        failed_clusters: failed,
        failed_over_clusters: tally.failed_over,
        current_replicas: current_replicas(&tally),
        clusters: tally.clusters.iter().map(|(c, _)| c.clone()).collect(),
        rollout: rollout::with_newest_completion(
            plan.rollout.as_ref(),
            previous.and_then(|p| p.rollout.as_ref()),
        ),
        ..Default::default()
    };
    if let Some(schedule) = &plan.schedule {
        schedule::annotate(&mut status, schedule);
    }
    if limits.bounded_list && status.clusters.len() > FULL_LIST_MAX {
        let urgency: Vec<Urgency> = tally.clusters.iter().map(|(_, u)| *u).collect();
        list_most_urgent(&mut status, &urgency);
    }
    status
}

/// The pods the members run across clusters, by their agents' reports; absent while no
/// agent reports them (older agents). Saturating: summed over up to 10,000 clusters.
fn current_replicas(tally: &Tally) -> Option<i32> {
    tally
        .clusters
        .iter()
        .filter_map(|(c, _)| c.current_replicas)
        .reduce(i32::saturating_add)
}

/// Keeps the [`URGENT_MAX`] most urgent entries that are not fine (by urgency, then
/// name) and the whole division beside them.
fn list_most_urgent(status: &mut FederatedMyAppStatus, urgency: &[Urgency]) {
    status.division = schedule::division(&status.clusters);
    let all = std::mem::take(&mut status.clusters);
    let total = all.len();
    let mut ranked: Vec<(Urgency, ClusterStatus)> = urgency
        .iter()
        .copied()
        .zip(all)
        .filter(|(u, _)| *u != Urgency::Fine)
        .collect();
    ranked.sort_by(|(ua, a), (ub, b)| ua.cmp(ub).then_with(|| a.name.cmp(&b.name)));
    ranked.truncate(URGENT_MAX);
    status.omitted_clusters = (total - ranked.len()) as i32;
    status.clusters = ranked.into_iter().map(|(_, c)| c).collect();
}

/// Where one cluster stands.
enum Standing {
    /// Not propagated, and why.
    Behind(Reason, String),
    /// Propagated, its MyApp not Ready, and why.
    NotReady(String),
    FailedOver,
    Ready,
}

fn tally(inputs: &Inputs<'_>, message_max: usize) -> Tally {
    let mut tally = Tally::default();
    for (name, planned) in inputs.plan.reported() {
        let report = inputs.reports.and_then(|r| r.get(&**name));
        let mut entry = ClusterStatus {
            name: name.to_string(),
            ..Default::default()
        };
        if let Some(r) = report.filter(|r| r.exists) {
            entry.ready_replicas = r.ready_replicas;
            entry.current_replicas = r.replicas;
            entry.autoscaler = r.autoscaler().map(|a| cut(a.to_owned(), message_max));
            entry.observed_generation = Some(r.observed_generation);
        }
        let standing = match planned {
            ClusterPlan::Keep(KeepReason::FailedOver) => Standing::FailedOver,
            ClusterPlan::Keep(KeepReason::Held { .. }) => {
                tally.placed += 1;
                Standing::Behind(Reason::Held, HELD.to_owned())
            }
            ClusterPlan::Apply(rendered) => {
                tally.placed += 1;
                let reachable = inputs.reachable.contains(&**name);
                standing(&rendered.hash, reachable, report)
            }
            ClusterPlan::Keep(KeepReason::NotGranted { .. }) => {
                Standing::Behind(Reason::NotGranted, planned.error().unwrap_or_default())
            }
            failed => Standing::Behind(Reason::RenderFailed, failed.error().unwrap_or_default()),
        };
        let urgency = match standing {
            Standing::Behind(reason, message) => {
                entry.message = cut(message, message_max);
                let listed = (name.to_string(), reason, entry.message.clone());
                tally.not_propagated.push(listed);
                Urgency::Behind(reason)
            }
            Standing::NotReady(why) => {
                tally.applied += 1;
                entry.message = cut(why, message_max);
                tally.not_ready.push(format!("{name}: {}", entry.message));
                Urgency::NotReady
            }
            Standing::FailedOver => {
                tally.failed_over += 1;
                entry.message = FAILED_OVER.to_owned();
                Urgency::FailedOver
            }
            Standing::Ready => {
                (tally.applied, tally.ready) = (tally.applied + 1, tally.ready + 1);
                entry.ready = true;
                Urgency::Fine
            }
        };
        tally.clusters.push((entry, urgency));
    }
    tally
}

/// A cluster that should run the MyApp with `hash`, as its agent's report shows it.
fn standing(hash: &str, reachable: bool, report: Option<&Report>) -> Standing {
    if !reachable {
        return Standing::Behind(
            Reason::AgentDisconnected,
            "the cluster's agent has not heartbeated within the grace period (MemberCluster NotReady); its last applied MyApp keeps running".to_owned(),
        );
    }
    let pending = || {
        Standing::Behind(
            Reason::Pending,
            "waiting for the agent to apply the latest version".to_owned(),
        )
    };
    let Some(r) = report else {
        return pending();
    };
    if let Some(error) = r.apply_error() {
        return Standing::Behind(
            Reason::ApplyFailed,
            format!("applying the MyApp failed (the agent retries): {error}"),
        );
    }
    if r.exists
        && let Some(drift) = r.drift()
    {
        return Standing::Behind(
            Reason::Drifted,
            format!("its MyApp was changed in the member ({drift}); the hub applied it again"),
        );
    }
    if !r.exists || *r.hash != *hash {
        return pending();
    }
    if r.ready && r.observed_generation >= r.generation {
        Standing::Ready
    } else {
        Standing::NotReady(r.not_ready_reason())
    }
}

fn propagated(
    inputs: &Inputs<'_>,
    tally: &Tally,
    max: usize,
    cond: impl Fn(&str, bool, &str, String) -> Condition,
) -> Condition {
    match (&inputs.plan.placement_error, inputs.deleting_on) {
        (_, Some(waiting)) => {
            let names = if waiting.is_empty() {
                "no cluster".to_owned()
            } else {
                join_capped(waiting.to_vec(), ", ", max)
            };
            let message = format!("waiting for {names} to confirm deletion");
            cond("Propagated", false, "Deleting", message)
        }
        (Some(e), _) => cond("Propagated", false, e.reason(), cut(e.to_string(), max)),
        (None, None) => {
            let mut behind: Vec<&(String, Reason, String)> = tally.not_propagated.iter().collect();
            behind.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
            match behind.first() {
                None => cond(
                    "Propagated",
                    true,
                    "Propagated",
                    format!("applied on {} cluster(s)", tally.placed),
                ),
                Some((_, reason, _)) => {
                    let each = behind.iter().map(|(c, _, m)| format!("{c}: {m}"));
                    let message = join_capped(each.collect(), "; ", max);
                    cond("Propagated", false, reason.as_str(), message)
                }
            }
        }
    }
}

fn ready(
    tally: &Tally,
    max: usize,
    cond: impl Fn(&str, bool, &str, String) -> Condition,
) -> Condition {
    let (placed, ready_count) = (tally.placed, tally.ready);
    let unrendered = tally.count(Reason::RenderFailed);
    if unrendered > 0 {
        // Those clusters keep their previous version: the app is not Ready everywhere.
        let head = format!(
            "{unrendered} cluster(s) keep their previous version: the template could not be rendered for them"
        );
        let mut each = vec![head];
        each.extend(tally.not_ready.iter().cloned());
        cond(
            "Ready",
            false,
            Reason::RenderFailed.as_str(),
            join_capped(each, "; ", max),
        )
    } else if placed == 0 && tally.count(Reason::NotGranted) > 0 {
        let why = "the placement names no cluster granted to the app's namespace";
        cond("Ready", false, Reason::NotGranted.as_str(), why.into())
    } else if placed == 0 {
        cond(
            "Ready",
            false,
            "NoClusters",
            "the placement selects no registered cluster".into(),
        )
    } else if ready_count == placed {
        cond(
            "Ready",
            true,
            "Ready",
            format!("ready on all {placed} cluster(s)"),
        )
    } else {
        let head = format!("{ready_count} of {placed} cluster(s) ready");
        let mut each = vec![head];
        each.extend(tally.not_ready.iter().cloned());
        let message = join_capped(each, "; ", max);
        cond("Ready", false, "NotReady", message)
    }
}

/// kstatus's abnormal-true pair, so that `kubectl wait` and Flux tell a finished
/// rollout without a health script of their own (Argo CD has none for this kind: it
/// reads them through `deploy/argocd/argocd-cm-health.yaml`). `Stalled`: nothing changes
/// until the spec or the fleet does (an invalid placement, a template that cannot be
/// rendered for a cluster, no cluster selected, a rollout halted or paused).
/// `Reconciling`: otherwise, until every
/// placed cluster runs the current version Ready. Short messages: `Propagated` and
/// `Ready` name the clusters, and the status stays within its bound.
fn progress(
    tally: &Tally,
    (unplannable, deleting, rollout): (bool, bool, Option<&RolloutStatus>),
    propagated: &Condition,
    ready: &Condition,
    cond: impl Fn(&str, bool, &str, String) -> Condition,
) -> [Condition; 2] {
    let unrendered = tally.count(Reason::RenderFailed);
    let stalled = if deleting {
        // A deletion goes on whatever the spec says.
        None
    } else if unplannable {
        let why = "the app cannot be planned (Propagated says why)";
        Some((propagated.reason.as_str(), why.to_owned()))
    } else if unrendered > 0 {
        let why = format!(
            "the template cannot be rendered for {unrendered} cluster(s) (Propagated names them)"
        );
        Some((Reason::RenderFailed.as_str(), why))
    } else if tally.placed == 0 && tally.count(Reason::NotGranted) > 0 {
        let why = "the placement names no cluster granted to the app's namespace";
        Some((Reason::NotGranted.as_str(), why.to_owned()))
    } else if tally.placed == 0 {
        let why = "the placement selects no registered cluster";
        Some(("NoClusters", why.to_owned()))
    } else if let Some(r) = rollout.filter(|r| r.state == "Halted" || r.state == "Paused") {
        let reason = match r.state.as_str() {
            "Halted" => "RolloutHalted",
            _ => "RolloutPaused",
        };
        Some((reason, r.message.clone()))
    } else {
        None
    };
    if let Some((reason, message)) = stalled {
        return [
            cond("Reconciling", false, "Stalled", "see Stalled".to_owned()),
            cond("Stalled", true, reason, message),
        ];
    }
    let not_stalled = cond("Stalled", false, "NotStalled", String::new());
    if ready.status == "True" && propagated.status == "True" {
        let done = format!(
            "the current version is Ready on all {} cluster(s)",
            tally.placed
        );
        return [cond("Reconciling", false, "Ready", done), not_stalled];
    }
    let reason = if propagated.status == "True" {
        ready.reason.as_str()
    } else {
        propagated.reason.as_str()
    };
    let counts = [
        (tally.count(Reason::Pending), "pending"),
        (tally.count(Reason::ApplyFailed), "retrying a failed apply"),
        (tally.count(Reason::AgentDisconnected), "disconnected"),
    ];
    let mut message = format!("{} of {} cluster(s) ready", tally.ready, tally.placed);
    for (n, what) in counts.into_iter().filter(|(n, _)| *n > 0) {
        message.push_str(&format!(", {n} {what}"));
    }
    [cond("Reconciling", true, reason, message), not_stalled]
}

/// `items` joined with `sep` within `max` bytes: the first items that fit, then
/// "… and N more" (the first item is always there, cut if it must be).
fn join_capped(items: Vec<String>, sep: &str, max: usize) -> String {
    let total = items.len();
    let tail = |n: usize| format!("{sep}… and {n} more");
    let mut out = String::new();
    for (i, item) in items.into_iter().enumerate() {
        let after = total - i - 1;
        let reserve = if after > 0 { tail(after).len() } else { 0 };
        if i > 0 {
            if out.len() + sep.len() + item.len() + reserve > max {
                out.push_str(&tail(after + 1));
                break;
            }
            out.push_str(sep);
        }
        let room = max.saturating_sub(out.len() + reserve);
        out.push_str(&cut(item, room));
    }
    out
}

/// `s` cut to at most `max` bytes on a character boundary, ending in "…" when cut.
pub(crate) fn cut(mut s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s.push('…');
    s
}

#[cfg(test)]
mod bounded;

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::admission::Refusal;
    use crate::placement::SelectorError;
    use flotilla_crds::tenancy::{Forbidden, Rule};

    use bytes::Bytes;
    use k8s_openapi::jiff::Timestamp;

    use crate::overrides::OverrideError;
    use crate::render::{RenderError, RenderedMyApp};

    fn now() -> Time {
        Time(Timestamp::from_second(1_700_000_000).unwrap())
    }

    fn rendered(h: &str) -> ClusterPlan {
        ClusterPlan::Apply(Arc::new(RenderedMyApp {
            hash: h.into(),
            json: Bytes::new(),
        }))
    }

    fn failed(field: &str, path: &str, reason: &str) -> ClusterPlan {
        ClusterPlan::Keep(KeepReason::RenderFailed(Box::new(RenderError::Override(
            OverrideError {
                field: field.into(),
                op: "replace",
                path: path.into(),
                reason: reason.into(),
            },
        ))))
    }

    fn report(hash: &str, ready: bool, replicas: i32) -> Report {
        Report {
            hash: hash.into(),
            exists: true,
            ready,
            ready_replicas: replicas,
            observed_generation: 1,
            generation: 1,
            ..Default::default()
        }
    }

    fn plan(entries: &[(&str, ClusterPlan)]) -> AppPlan {
        AppPlan {
            generation: Some(4),
            clusters: entries
                .iter()
                .map(|(c, o)| ((*c).into(), o.clone()))
                .collect(),
            ..Default::default()
        }
    }

    fn run(plan: &AppPlan, reports: &[(&str, Report)], reachable: &[&str]) -> FederatedMyAppStatus {
        let reports: Reports = reports
            .iter()
            .map(|(c, r)| ((*c).into(), r.clone()))
            .collect();
        let reachable = reachable.iter().map(|c| c.to_string()).collect();
        compute(
            &Inputs {
                plan,
                deleting_on: None,
                reports: Some(&reports),
                reachable: &reachable,
            },
            None,
            &now(),
        )
    }

    fn cond<'a>(s: &'a FederatedMyAppStatus, t: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn all_ready() {
        let p = plan(&[("c1", rendered("h1")), ("c2", rendered("h2"))]);
        let s = run(
            &p,
            &[("c1", report("h1", true, 3)), ("c2", report("h2", true, 5))],
            &["c1", "c2"],
        );
        assert_eq!((s.placed_clusters, s.ready_clusters), (2, 2));
        assert_eq!(s.observed_generation, Some(4));
        assert_eq!(cond(&s, "Propagated").status, "True");
        assert_eq!(cond(&s, "Ready").status, "True");
        assert_eq!(
            s.clusters[1],
            ClusterStatus {
                name: "c2".into(),
                ready: true,
                ready_replicas: 5,
                observed_generation: Some(1),
                message: String::new(),
                ..Default::default()
            }
        );
    }

    /// What the members run, autoscalers' decisions included, is shown beside the
    /// assignment: per cluster with the autoscaler that decided it, and summed over the
    /// clusters that report it (older agents do not).
    #[test]
    fn the_members_current_replicas_and_their_autoscalers_are_shown() {
        let p = plan(&[
            ("c1", rendered("h1")),
            ("c2", rendered("h2")),
            ("c3", rendered("h3")),
        ]);
        let scaled = Report {
            replicas: Some(4),
            ..report("h1", true, 4)
        }
        .with_words(Words {
            autoscaler: Some("HorizontalPodAutoscaler web scales the MyApp".into()),
            ..Words::default()
        });
        let plain = Report {
            replicas: Some(2),
            ..report("h2", true, 2)
        };
        let old_agent = report("h3", true, 2);
        let s = run(
            &p,
            &[("c1", scaled), ("c2", plain), ("c3", old_agent)],
            &["c1", "c2", "c3"],
        );
        let shown: Vec<_> = s
            .clusters
            .iter()
            .map(|c| (c.current_replicas, c.autoscaler.as_deref()))
            .collect();
        assert_eq!(
            shown,
            [
                (
                    Some(4),
                    Some("HorizontalPodAutoscaler web scales the MyApp")
                ),
                (Some(2), None),
                (None, None)
            ]
        );
        assert_eq!(s.current_replicas, Some(6));
        assert_eq!(run(&p, &[], &["c1"]).current_replicas, None);
    }

    #[test]
    fn the_division_shows_per_cluster_and_a_failed_over_cluster_is_no_error() {
        use crate::schedule::{Assignment, Schedule};
        use flotilla_crds::federated::SchedulingReason;
        let mut p = plan(&[
            ("c1", rendered("h1")),
            ("c2", rendered("h2")),
            ("c3", ClusterPlan::Keep(KeepReason::FailedOver)),
        ]);
        let assign = |replicas, reason| Assignment { replicas, reason };
        p.schedule = Some(Schedule {
            divided: true,
            clusters: [
                ("c1".into(), assign(8, SchedulingReason::Weight)),
                ("c2".into(), assign(4, SchedulingReason::Failover)),
                ("c3".into(), assign(3, SchedulingReason::FailedOver)),
            ]
            .into(),
            ..Schedule::default()
        });
        let s = run(
            &p,
            &[
                ("c1", report("h1", true, 8)),
                ("c2", report("h2", true, 4)),
                ("c3", report("old", true, 3)),
            ],
            &["c1", "c2"],
        );
        let c = |name: &str| s.clusters.iter().find(|c| c.name == name).unwrap();
        assert_eq!(c("c1").replicas, Some(8));
        assert_eq!(c("c2").scheduling_reason, Some(SchedulingReason::Failover));
        assert_eq!(c("c3").replicas, Some(3));
        assert!(c("c3").message.contains("failover grace period"));
        // The failed-over copy is neither placed nor an error; its replicas are not
        // counted in the desired total, its ready ones are still running.
        assert_eq!((s.placed_clusters, s.ready_clusters), (2, 2));
        assert_eq!(cond(&s, "Propagated").status, "True");
        assert_eq!(cond(&s, "Ready").status, "True");
        assert_eq!(s.replicas, Some(12));
        assert_eq!(s.ready_replicas, 15);
    }

    #[test]
    fn stale_hash_is_pending_not_ready() {
        let p = plan(&[("c1", rendered("new"))]);
        let s = run(&p, &[("c1", report("old", true, 3))], &["c1"]);
        assert_eq!(cond(&s, "Propagated").reason, "Pending");
        assert_eq!(cond(&s, "Ready").status, "False");
        assert!(!s.clusters[0].ready);
    }

    /// A MyApp changed in the member is not propagated, even with the right hash (the
    /// annotation rides along with a hand edit): the cluster says who changed what.
    #[test]
    fn a_drifted_cluster_is_not_propagated_and_names_the_drift() {
        let p = plan(&[("c1", rendered("h")), ("c2", rendered("h"))]);
        let drifted = report("h", true, 3).with_words(Words {
            drift: Some("spec.image by kubectl-edit".into()),
            ..Words::default()
        });
        let s = run(
            &p,
            &[("c1", drifted), ("c2", report("h", true, 3))],
            &["c1", "c2"],
        );
        let propagated = cond(&s, "Propagated");
        assert_eq!(
            (propagated.status.as_str(), propagated.reason.as_str()),
            ("False", "Drifted")
        );
        assert!(
            propagated
                .message
                .contains("c1: its MyApp was changed in the member (spec.image by kubectl-edit)"),
            "{}",
            propagated.message
        );
        assert_eq!(cond(&s, "Ready").status, "False");
        assert!(!s.clusters[0].ready && s.clusters[1].ready);
    }

    /// A held cluster is placed and not Ready, named last in Propagated as held (not
    /// as an error); the rollout's state shows, and Reconciling goes on while it
    /// progresses.
    #[test]
    fn a_held_cluster_is_placed_not_ready_and_no_error() {
        let mut p = plan(&[("c1", rendered("h1")), ("c2", crate::plan::HELD)]);
        p.rollout = Some(RolloutStatus {
            state: "Progressing".into(),
            ..Default::default()
        });
        let s = run(&p, &[("c1", report("h1", true, 3))], &["c1", "c2"]);
        assert_eq!((s.placed_clusters, s.ready_clusters), (2, 1));
        assert_eq!(s.failed_clusters, 0);
        let propagated = cond(&s, "Propagated");
        assert_eq!(propagated.reason, "RolloutHeld");
        assert!(propagated.message.starts_with("c2: held until its wave"));
        assert_eq!(cond(&s, "Ready").status, "False");
        assert_eq!(cond(&s, "Reconciling").status, "True");
        assert_eq!(cond(&s, "Stalled").status, "False");
        assert_eq!(
            s.rollout.as_ref().map(|r| r.state.as_str()),
            Some("Progressing")
        );
        // Paused: Stalled, with the rollout's message.
        p.rollout = Some(RolloutStatus {
            state: "Paused".into(),
            message: "paused at wave 1 of 2".into(),
            ..Default::default()
        });
        let s = run(&p, &[("c1", report("h1", true, 3))], &["c1", "c2"]);
        let stalled = cond(&s, "Stalled");
        assert_eq!(
            (stalled.status.as_str(), stalled.reason.as_str()),
            ("True", "RolloutPaused")
        );
        assert_eq!(stalled.message, "paused at wave 1 of 2");
        assert_eq!(cond(&s, "Reconciling").status, "False");
    }

    #[test]
    fn one_clusters_error_is_shown_for_that_cluster_only() {
        let p = plan(&[
            ("c1", rendered("h1")),
            (
                "c2",
                failed(
                    "spec.overrides[0].clusterOverrides[0]",
                    "/spec/x",
                    "nothing here",
                ),
            ),
        ]);
        let s = run(&p, &[("c1", report("h1", true, 3))], &["c1", "c2"]);
        assert!(s.clusters[0].ready && s.clusters[0].message.is_empty());
        assert!(s.clusters[1].message.contains("/spec/x"));
        let c = cond(&s, "Propagated");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "RenderFailed")
        );
        assert!(c.message.starts_with("c2: spec.overrides[0]"));
        assert_eq!((s.placed_clusters, s.ready_clusters), (1, 1));
        let ready = cond(&s, "Ready");
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "RenderFailed"),
            "c2 keeps its previous version, so the app is not Ready everywhere"
        );
        assert_eq!(cond(&s, "Stalled").status, "True");
    }

    #[test]
    fn disconnected_agent_and_apply_errors_are_named() {
        let p = plan(&[("c1", rendered("h1")), ("c2", rendered("h2"))]);
        let failed = report("h2", false, 0).with_words(Words {
            apply_error: Some("admission webhook denied".into()),
            ..Words::default()
        });
        let s = run(
            &p,
            &[("c1", report("h1", true, 3)), ("c2", failed)],
            &["c2"],
        );
        assert!(
            s.clusters[0]
                .message
                .contains("not heartbeated within the grace")
        );
        assert!(s.clusters[1].message.contains("admission webhook denied"));
        assert_eq!(cond(&s, "Propagated").reason, "ApplyFailed");
    }

    #[test]
    fn not_ready_explains_why() {
        let p = plan(&[("c1", rendered("h1"))]);
        // The agent's Degraded condition, when True (the hub's wire decoding picks it).
        let r = Report {
            hash: "h1".into(),
            exists: true,
            ready_replicas: 1,
            observed_generation: 1,
            generation: 1,
            ..Default::default()
        }
        .with_words(Words {
            degraded: Some(("ImageMissing".into(), "spec.image is not set".into())),
            ..Words::default()
        });
        let s = run(&p, &[("c1", r)], &["c1"]);
        assert_eq!(
            cond(&s, "Ready").message,
            "0 of 1 cluster(s) ready; c1: ImageMissing: spec.image is not set"
        );
        let mut r = report("h1", true, 3);
        r.generation = 2;
        let s = run(&p, &[("c1", r)], &["c1"]);
        assert!(
            !s.clusters[0].ready,
            "a status older than the spec is not ready"
        );
    }

    #[test]
    fn no_clusters_and_invalid_placement() {
        let s = run(&plan(&[]), &[], &[]);
        assert_eq!(cond(&s, "Ready").reason, "NoClusters");
        assert_eq!(cond(&s, "Propagated").status, "True");
        let mut p = plan(&[]);
        p.placement_error = Some(AppError::Placement(SelectorError {
            field: "spec.placement.clusterSelector.matchExpressions[0]".into(),
            reason: "operator In needs at least one value".into(),
        }));
        let s = run(&p, &[], &[]);
        assert_eq!(cond(&s, "Propagated").reason, "InvalidPlacement");
    }

    #[test]
    fn a_refused_app_names_the_rule_in_both_conditions() {
        let mut p = plan(&[]);
        p.placement_error = Some(AppError::Refused(Refusal::NamespaceForbidden(Forbidden {
            namespace: "kube-system".into(),
            rule: Rule::System,
        })));
        let s = run(&p, &[], &[]);
        for type_ in ["Propagated", "Ready"] {
            let c = cond(&s, type_);
            assert_eq!(
                (c.status.as_str(), c.reason.as_str()),
                ("False", "NamespaceForbidden")
            );
            assert_eq!(
                c.message,
                "namespace kube-system is forbidden: Kubernetes system namespaces are never placed into"
            );
        }
        let stalled = cond(&s, "Stalled");
        assert_eq!(
            (stalled.status.as_str(), stalled.reason.as_str()),
            ("True", "NamespaceForbidden"),
            "nothing moves until the app or the rule changes"
        );
        assert!(s.clusters.is_empty());
    }

    #[test]
    fn transition_time_is_kept_while_status_holds() {
        let p = plan(&[("c1", rendered("h1"))]);
        let first = run(&p, &[("c1", report("h1", true, 3))], &["c1"]);
        let later = Time(Timestamp::from_second(1_800_000_000).unwrap());
        let reports: Reports = [("c1".into(), report("h1", true, 3))].into();
        let reachable: HashSet<String> = ["c1".to_owned()].into();
        let inputs = Inputs {
            plan: &p,
            deleting_on: None,
            reports: Some(&reports),
            reachable: &reachable,
        };
        let again = compute(&inputs, Some(&first), &later);
        assert_eq!(again, first, "nothing changed, so nothing to write");
        let none = compute(
            &Inputs {
                plan: &p,
                deleting_on: None,
                reports: None,
                reachable: &reachable,
            },
            Some(&first),
            &later,
        );
        assert_eq!(cond(&none, "Ready").last_transition_time, later);
    }

    #[test]
    fn reasons_order_by_urgency() {
        assert!(Reason::RenderFailed < Reason::ApplyFailed);
        assert!(Reason::ApplyFailed < Reason::AgentDisconnected);
        assert!(Reason::AgentDisconnected < Reason::Pending);
        let p = plan(&[("c1", rendered("h1")), ("c2", rendered("h2"))]);
        let s = run(&p, &[("c1", report("old", true, 1))], &["c1"]);
        assert_eq!(cond(&s, "Propagated").reason, "AgentDisconnected");
    }

    #[test]
    fn reports_read_as_held_present_absent_or_failed() {
        let r = |exists: bool, error: Option<&str>| {
            Report {
                exists,
                ..Default::default()
            }
            .with_words(Words {
                apply_error: error.map(str::to_owned),
                ..Words::default()
            })
            .held()
        };
        assert_eq!(r(true, None), Held::Present);
        assert_eq!(r(false, None), Held::Absent);
        assert_eq!(r(false, Some("namespace \"x\" not found")), Held::Failed);
        assert_eq!(r(true, Some("webhook denied")), Held::Failed);
    }

    #[test]
    fn an_apply_error_clears_when_a_good_report_follows() {
        let p = plan(&[("c1", rendered("h1"))]);
        let failed = report("h1", false, 0).with_words(Words {
            apply_error: Some("namespace \"team\" not found".into()),
            ..Words::default()
        });
        let s = run(&p, &[("c1", failed)], &["c1"]);
        assert_eq!(cond(&s, "Propagated").reason, "ApplyFailed");
        let s = run(&p, &[("c1", report("h1", true, 1))], &["c1"]);
        assert_eq!(cond(&s, "Propagated").status, "True");
        assert!(s.clusters[0].message.is_empty());
    }

    #[test]
    fn conditions_carry_the_observed_generation() {
        let s = run(&plan(&[("c1", rendered("h1"))]), &[], &["c1"]);
        assert!(
            s.conditions
                .iter()
                .all(|c| c.observed_generation == Some(4))
        );
    }

    /// kstatus's reading of a custom resource (sigs.k8s.io/cli-utils `kstatus`, the
    /// generic conditions): an older `observedGeneration` or `Reconciling` is InProgress,
    /// `Stalled` is Failed, anything else is Current.
    fn kstatus(generation: i64, s: &FederatedMyAppStatus) -> &'static str {
        let is_true = |t: &str| condition::is_true(&s.conditions, t) == Some(true);
        if s.observed_generation.is_none_or(|g| g < generation) || is_true("Reconciling") {
            "InProgress"
        } else if is_true("Stalled") {
            "Failed"
        } else {
            "Current"
        }
    }

    /// One cluster as a test sets it up: its plan, its report and whether it is reachable.
    #[derive(Debug, Clone)]
    enum Case {
        Ready,
        NotReady,
        OldVersion,
        NoReport,
        ApplyFailed,
        Disconnected,
        RenderFailed,
        FailedOver,
    }

    fn case() -> impl proptest::strategy::Strategy<Value = Case> {
        use proptest::prelude::*;
        prop_oneof![
            4 => Just(Case::Ready),
            1 => Just(Case::NotReady),
            1 => Just(Case::OldVersion),
            1 => Just(Case::NoReport),
            1 => Just(Case::ApplyFailed),
            1 => Just(Case::Disconnected),
            1 => Just(Case::RenderFailed),
            1 => Just(Case::FailedOver),
        ]
    }

    proptest::proptest! {
        /// GitOps tools see Current exactly when `Ready` is True, i.e. when every
        /// selected cluster runs the current version Ready; a cluster the template
        /// cannot be rendered for, or an invalid placement, is Failed; the two
        /// abnormal-true conditions are never True together.
        #[test]
        fn kstatus_reads_ready_as_current(
            cases in proptest::collection::vec(case(), 0..6),
            invalid_placement in proptest::bool::weighted(0.1),
            deleting in proptest::bool::weighted(0.1),
        ) {
            let mut entries = Vec::new();
            let (mut reports, mut reachable) = (BTreeMap::new(), HashSet::new());
            for (i, c) in cases.iter().enumerate() {
                let (name, hash) = (format!("c{i}"), format!("h{i}"));
                let planned = match c {
                    // An app that cannot be planned keeps every cluster as it is.
                    _ if invalid_placement => ClusterPlan::Keep(KeepReason::Unplanned),
                    Case::RenderFailed => failed("spec.overrides[0]", "/spec/x", "missing"),
                    Case::FailedOver => ClusterPlan::Keep(KeepReason::FailedOver),
                    _ => rendered(&hash),
                };
                let r = match c {
                    Case::Ready | Case::Disconnected => Some(report(&hash, true, 1)),
                    Case::NotReady => Some(report(&hash, false, 0)),
                    Case::OldVersion => Some(report("older", true, 1)),
                    Case::ApplyFailed => Some(report(&hash, false, 0).with_words(Words {
                        apply_error: Some("webhook denied".into()),
                        ..Words::default()
                    })),
                    _ => None,
                };
                if let Some(r) = r {
                    reports.insert(name.as_str().into(), r);
                }
                if !matches!(c, Case::Disconnected) {
                    reachable.insert(name.clone());
                }
                entries.push((name.into(), planned));
            }
            let mut p = AppPlan {
                generation: Some(4),
                clusters: entries.into_iter().collect(),
                ..Default::default()
            };
            if invalid_placement {
                p.placement_error = Some(AppError::Placement(SelectorError {
                    field: "spec.placement.clusterSelector".into(),
                    reason: "bad".into(),
                }));
            }
            let waiting = ["c0".to_owned()];
            let s = compute(
                &Inputs {
                    plan: &p,
                    deleting_on: deleting.then_some(&waiting[..]),
                    reports: Some(&reports),
                    reachable: &reachable,
                },
                None,
                &now(),
            );
            let ready = cond(&s, "Ready").status == "True";
            let reading = kstatus(4, &s);
            proptest::prop_assert_eq!(reading == "Current", ready && !deleting, "{:?}", s.conditions);
            let everywhere = !invalid_placement
                && cases.iter().any(|c| !matches!(c, Case::FailedOver))
                && cases.iter().all(|c| matches!(c, Case::Ready | Case::FailedOver));
            proptest::prop_assert_eq!(ready, everywhere, "{:?} {:?}", cases, s.conditions);
            let stalls = invalid_placement
                || cases.iter().any(|c| matches!(c, Case::RenderFailed))
                || cases.iter().all(|c| matches!(c, Case::RenderFailed | Case::FailedOver));
            proptest::prop_assert_eq!(reading == "Failed", stalls && !deleting, "{:?}", s.conditions);
            proptest::prop_assert!(
                !(cond(&s, "Reconciling").status == "True" && cond(&s, "Stalled").status == "True")
            );
            proptest::prop_assert_eq!(kstatus(5, &s), "InProgress", "a newer spec is not planned yet");
        }
    }
}
