//! Rollout: which placed clusters may be sent a new revision now (`spec.rollout`, after
//! Open Cluster Management's `RolloutStrategy`). Pure: the plan, what the agents
//! report and the time are passed in.
//!
//! A revision is what a cluster's MyApp runs, its replica count aside: the prefix of a
//! progressive app's content hash ([`crate::render::revisioned_hash`]), so the hub reads
//! it from every report, and recomputes where a rollout stands from reports alone after
//! its own restart (never from memory it could have lost).
//!
//! The gate only ever turns an Apply into `Keep(Held)`: a cluster not yet reached keeps
//! what it runs (nothing is deleted, nothing rolled back). A cluster that already runs
//! the current revision is never held, so a change of its replicas (scheduling,
//! capacity, failover) goes through. A held cluster that runs the last complete revision
//! takes its new share of replicas of that revision ([`resize_held`], from the copy of the
//! spec `status.rollout.lastComplete` keeps); any other held cluster keeps its count
//! until its wave. Going back to a complete revision is never held.
//!
//! Waves go in order; the first wave not complete is the current one, and no later
//! cluster is sent the revision until it is. A wave is complete when each of its
//! clusters runs the revision Ready for `minSuccessSeconds`, or is NotReady as a
//! MemberCluster (unreachable: it leaves the wave, so a lost cluster does not stall the
//! rollout; it still gets the revision when it returns), and at least one of them ran
//! it Ready (no wave moves on without evidence: not when every cluster of it is
//! NotReady, e.g. every agent still reconnecting to a hub that just restarted). A cluster that runs
//! the revision Degraded, or not Ready past `progressDeadlineSeconds` after the hub first
//! saw it there, or whose agent fails to apply it, halts the rollout: no wave after the
//! current one starts until it recovers or the spec changes. "Since" is as this hub saw
//! it: a hub restart starts a soak (and a deadline) again.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use arcstr::ArcStr;
use flotilla_crds::FederatedMyApp;
use flotilla_crds::federated::{CompletedRevision, Rollout, RolloutStatus, RolloutType};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use kube::core::SelectorExt;

use crate::placement::{Members, parse_selector};
use crate::plan::{AppPlan, ClusterPlan, HELD, KeepReason};
use crate::render::revision_of;
use crate::status::{CONDITION_MESSAGE_MAX, cut};

/// Distinct revisions `status.rollout.revision` names (overrides render one per class of
/// clusters); the rest are counted.
const REVISIONS_SHOWN: usize = 3;

/// `progressDeadlineSeconds` when unset.
pub const DEFAULT_PROGRESS_DEADLINE: Duration = Duration::from_secs(600);

/// Whether the app rolls out in waves (and its hashes carry the revision).
pub fn progressive(app: &FederatedMyApp) -> bool {
    app.spec
        .rollout
        .as_ref()
        .is_some_and(|r| r.type_ != RolloutType::All)
}

/// What the hub saw of one cluster's copy of the app, from its agent's reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// The content hash of the MyApp the member runs (the status board's shared copy).
    pub hash: ArcStr,
    /// Ready, at its latest generation.
    pub ready: bool,
    /// Its `Degraded` condition, in words, when True.
    pub degraded: Option<String>,
    /// Why the agent could not apply the latest MyApp sent.
    pub apply_error: Option<String>,
    /// When this hub first saw this hash with this readiness.
    pub since: Instant,
}

/// What the hub saw of an app, by cluster.
pub type Observed = BTreeMap<ArcStr, Seen>;

/// Where one placed cluster stands against the revision it should run.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Standing {
    /// It does not run the revision (or nothing is known of it yet).
    Behind,
    /// It does not run the revision, and its agent's last apply failed (which one, the
    /// report does not say): halts the rollout once reached, held until then.
    Refused(String),
    /// Runs it, not Ready yet (deadline at).
    Starting(Instant),
    /// Runs it Ready, soaking until.
    Soaking(Instant),
    /// Runs it Ready for the soak.
    Done,
    /// Why it halts the rollout.
    Failing(String),
}

struct Settings {
    soak: Duration,
    deadline: Duration,
    paused: bool,
}

impl Settings {
    fn of(r: &Rollout) -> Self {
        let secs = |s: Option<i32>| s.map(|s| Duration::from_secs(s.max(0) as u64));
        Self {
            soak: secs(r.min_success_seconds).unwrap_or_default(),
            deadline: secs(r.progress_deadline_seconds).unwrap_or(DEFAULT_PROGRESS_DEADLINE),
            paused: r.paused,
        }
    }
}

fn standing(target: &str, seen: Option<&Seen>, s: &Settings, now: Instant) -> Standing {
    let Some(seen) = seen else {
        return Standing::Behind;
    };
    let refused = (seen.apply_error.as_ref()).map(|e| format!("applying the MyApp failed: {e}"));
    if revision_of(&seen.hash) != Some(target) {
        return refused.map_or(Standing::Behind, Standing::Refused);
    }
    if let Some(why) = refused {
        return Standing::Failing(why);
    }
    if let Some(d) = &seen.degraded {
        return Standing::Failing(format!("Degraded at revision {target}: {d}"));
    }
    match seen.ready {
        true if now >= seen.since + s.soak => Standing::Done,
        true => Standing::Soaking(seen.since + s.soak),
        // Words that do not change while it lasts: an Event repeats them once.
        false if now >= seen.since + s.deadline => Standing::Failing(format!(
            "not Ready within progressDeadlineSeconds ({}) of running revision {target}",
            s.deadline.as_secs()
        )),
        false => Standing::Starting(seen.since + s.deadline),
    }
}

/// One wave: its name and clusters.
type Wave = (String, Vec<String>);

/// At most how many clusters a wave holds, out of `placed`; a warning when the value is
/// not one (then 1, the careful choice).
fn concurrency(max: Option<&IntOrString>, placed: usize) -> (usize, Option<String>) {
    let placed = placed.max(1);
    let bad = |v: String| {
        let w = format!(
            "spec.rollout.maxConcurrency {v} is not a positive number or percentage: 1 cluster per wave"
        );
        (1, Some(w))
    };
    match max {
        None => (placed, None),
        Some(IntOrString::Int(n)) if *n >= 1 => ((*n as usize).min(placed), None),
        Some(IntOrString::Int(n)) => bad(n.to_string()),
        Some(IntOrString::String(s)) => {
            let pct = s
                .strip_suffix('%')
                .and_then(|p| p.trim().parse::<u64>().ok());
            match pct {
                Some(p) if p >= 1 => {
                    let n = (p as usize * placed).div_ceil(100);
                    (n.clamp(1, placed), None)
                }
                _ => bad(format!("{s:?}")),
            }
        }
    }
}

/// The waves over `placed` (sorted): Progressive cuts them in name order,
/// ProgressivePerGroup one per group (clusters in no group last), each cut by
/// `maxConcurrency` when set. Empty waves are dropped.
fn waves(
    r: &Rollout,
    placed: &[String],
    members: &Members,
    warnings: &mut Vec<String>,
) -> Vec<Wave> {
    let (max, warning) = concurrency(r.max_concurrency.as_ref(), placed.len());
    warnings.extend(warning);
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    if r.type_ == RolloutType::ProgressivePerGroup {
        let mut left: BTreeSet<&String> = placed.iter().collect();
        for (i, g) in r.groups.iter().enumerate() {
            let name = g.name.clone().unwrap_or_else(|| format!("group-{}", i + 1));
            let named: BTreeSet<&str> = g.clusters.iter().map(|c| c.name.as_str()).collect();
            let field = format!("spec.rollout.groups[{i}].clusterSelector");
            let selector = g
                .cluster_selector
                .as_ref()
                .map(|s| parse_selector(s, &field));
            let selector = match selector.transpose() {
                Ok(s) => s,
                Err(e) => {
                    warnings.push(format!("{e}: the group selects no cluster by label"));
                    None
                }
            };
            let selects = |c: &str| {
                let labels = members.get(c).map(|m| &m.labels);
                selector
                    .as_ref()
                    .zip(labels)
                    .is_some_and(|(s, l)| s.matches(l))
            };
            let taken: Vec<String> = left
                .iter()
                .filter(|c| named.contains(c.as_str()) || selects(c))
                .map(|c| (*c).clone())
                .collect();
            for c in &taken {
                left.remove(c);
            }
            groups.push((name, taken));
        }
        groups.push(("rest".to_owned(), left.into_iter().cloned().collect()));
    } else {
        groups.push((String::new(), placed.to_vec()));
    }
    let mut out = Vec::new();
    for (name, clusters) in groups.into_iter().filter(|(_, c)| !c.is_empty()) {
        let chunks: Vec<&[String]> = clusters.chunks(max).collect();
        let many = chunks.len() > 1;
        for (j, chunk) in chunks.into_iter().enumerate() {
            let label = match (name.is_empty(), many) {
                (true, _) => format!("clusters {}", chunk.join(", ")),
                (false, false) => name.clone(),
                (false, true) => format!("{name} part {}", j + 1),
            };
            out.push((label, chunk.to_vec()));
        }
    }
    out
}

/// Holds back what the rollout has not reached yet: turns the Apply of each placed
/// cluster beyond the current wave that does not run its revision into
/// `Keep(Held)`, and writes where the rollout stands into `plan.rollout`. Returns when
/// to look again (a soak or a deadline ends), if ever. Does nothing for type All, nor to
/// an app that cannot be planned.
pub fn gate(
    app: &FederatedMyApp,
    plan: &mut AppPlan,
    members: &Members,
    observed: &Observed,
    now: Instant,
) -> Option<Duration> {
    let rollout = app.spec.rollout.as_ref().filter(|_| progressive(app))?;
    if plan.placement_error.is_some() {
        return None;
    }
    let settings = Settings::of(rollout);
    // Each placed cluster that is sent a MyApp, with the revision it should run.
    let targets: BTreeMap<String, String> = (plan.clusters.iter())
        .filter_map(|(c, p)| {
            let hash = &p.rendered()?.hash;
            Some((c.to_string(), revision_of(hash).unwrap_or(hash).to_owned()))
        })
        .collect();
    let placed: Vec<String> = targets.keys().cloned().collect();
    let waves = waves(rollout, &placed, members, &mut plan.warnings);
    let standing: BTreeMap<&String, Standing> = (targets.iter())
        .map(|(c, t)| (c, standing(t, observed.get(c.as_str()), &settings, now)))
        .collect();
    let away = |c: &str| members.get(c).is_none_or(|m| m.not_ready_for.is_some());
    let mut walk = walk(&waves, &standing, settings.paused, &away);
    // Going back to a revision a rollout completed is never held: it ran Ready on every
    // cluster (an abort, or the template set back by hand, reaches them all at once).
    let last = last_complete(app);
    let known_good: BTreeSet<&str> = last.map_or_else(BTreeSet::new, |l| {
        l.revisions.iter().map(String::as_str).collect()
    });
    walk.held
        .retain(|c| !known_good.contains(targets[c].as_str()));
    for c in &walk.held {
        // Each is a key already, with its shared name: no new copy of it.
        match plan.clusters.get_mut(c.as_str()) {
            Some(planned) => *planned = HELD,
            None => _ = plan.clusters.insert(c.as_str().into(), HELD),
        }
    }
    let view = View {
        waves: &waves,
        standing: &standing,
        walk: &walk,
        paused: settings.paused,
        now,
    };
    let mut status = view.status(&targets, &away);
    status.last_complete = match status.state == "Complete" && !targets.is_empty() {
        true => Some(completed(app, &targets, &mut plan.warnings)),
        false => last.cloned(),
    };
    plan.rollout = Some(status);
    walk.recheck.map(|at| at.saturating_duration_since(now))
}

/// A held cluster still takes its new share of replicas (a new division, capacity,
/// failover elsewhere): one that runs a revision of the last complete rollout is sent
/// that revision again, rendered from its kept spec (`plan_stable` plans the app with
/// it) with the replicas the current division gives. Only when the render is the very
/// revision the cluster runs: its replica count is all that changes. Any other held
/// cluster keeps what it runs, count included.
pub fn resize_held(
    app: &FederatedMyApp,
    plan: &mut AppPlan,
    observed: &Observed,
    plan_stable: impl FnOnce(&FederatedMyApp) -> AppPlan,
) {
    let held = |p: &ClusterPlan| *p == HELD;
    if !plan.clusters.values().any(held) {
        return;
    }
    let Some((last, template)) = last_complete(app).and_then(|l| Some((l, l.template.clone()?)))
    else {
        return;
    };
    let mut stable = app.clone();
    (stable.spec.template, stable.spec.overrides) = (template, last.overrides.clone());
    let stable = plan_stable(&stable);
    for (cluster, planned) in plan.clusters.iter_mut().filter(|(_, p)| held(p)) {
        let runs = observed.get(&**cluster).and_then(|s| revision_of(&s.hash));
        let Some(ClusterPlan::Apply(render)) = stable.clusters.get(cluster) else {
            continue;
        };
        let again = revision_of(&render.hash);
        if runs.is_some()
            && runs == again
            && last.revisions.iter().any(|r| Some(r.as_str()) == runs)
        {
            *planned = ClusterPlan::Keep(KeepReason::Held {
                resized: Some(render.clone()),
            });
        }
    }
}

/// The last complete rollout the app's status records.
fn last_complete(app: &FederatedMyApp) -> Option<&CompletedRevision> {
    let rollout = app.status.as_ref()?.rollout.as_ref()?;
    rollout.last_complete.as_ref()
}

/// Revisions a completed rollout keeps (one per class of clusters); past them, going
/// back to the others is rolled out in waves like any revision.
const REVISIONS_KEPT: usize = 1000;

/// At most this much of the spec (`template` and `overrides`, as JSON) is copied into
/// status when a rollout completes: past it, `rollout abort` has nothing to put back.
pub const COPY_MAX: usize = 64 * 1024;

/// The revision `app` completed, with a copy of what rendered it when it fits.
fn completed(
    app: &FederatedMyApp,
    targets: &BTreeMap<String, String>,
    warnings: &mut Vec<String>,
) -> CompletedRevision {
    let revisions: BTreeSet<&String> = targets.values().collect();
    let spec = &app.spec;
    let size =
        serde_json::to_vec(&(&spec.template, &spec.overrides)).map_or(usize::MAX, |v| v.len());
    let fits = size <= COPY_MAX;
    if !fits {
        warnings.push(format!(
            "spec.template and spec.overrides ({size} bytes) exceed {COPY_MAX}: status.rollout.lastComplete keeps no copy of them, so rollout abort cannot put this revision back"
        ));
    }
    CompletedRevision {
        generation: app.metadata.generation.unwrap_or_default(),
        revisions: revisions
            .into_iter()
            .take(REVISIONS_KEPT)
            .cloned()
            .collect(),
        template: fits.then(|| spec.template.clone()),
        overrides: match fits {
            true => spec.overrides.clone(),
            false => Vec::new(),
        },
    }
}

/// `status.rollout` as written: the plan's, keeping the newer `lastComplete` of the
/// plan's and the one the object shows (a plan made before the object showed the last
/// completion must not write an older one over it).
pub fn with_newest_completion(
    planned: Option<&RolloutStatus>,
    shown: Option<&RolloutStatus>,
) -> Option<RolloutStatus> {
    let mut rollout = planned?.clone();
    let generation = |r: Option<&CompletedRevision>| r.map(|c| c.generation);
    let shown = shown.and_then(|r| r.last_complete.as_ref());
    if generation(shown) > generation(rollout.last_complete.as_ref()) {
        rollout.last_complete = shown.cloned();
    }
    Some(rollout)
}

/// The waves walked in order.
struct Walk {
    /// Clusters not to send the revision yet.
    held: Vec<String>,
    /// The first wave not complete.
    current: Option<usize>,
    /// The earliest soak or deadline to end in the current wave.
    recheck: Option<Instant>,
}

/// Every wave up to the first not complete is open (none when paused); a cluster of a
/// closed wave that does not run the revision is held.
fn walk(
    waves: &[Wave],
    standing: &BTreeMap<&String, Standing>,
    paused: bool,
    away: &impl Fn(&str) -> bool,
) -> Walk {
    let mut walk = Walk {
        held: Vec::new(),
        current: None,
        recheck: None,
    };
    let behind = |c: &String| matches!(standing[c], Standing::Behind | Standing::Refused(_));
    // Whether a wave after each one has a cluster still to reach: a soak gates only
    // those (so a rollout every cluster of which runs the revision Ready is complete,
    // also when a hub restart started its soaks again).
    let mut waiting_after = vec![false; waves.len()];
    for i in (0..waves.len().saturating_sub(1)).rev() {
        waiting_after[i] = waiting_after[i + 1] || waves[i + 1].1.iter().any(behind);
    }
    for (i, (_, clusters)) in waves.iter().enumerate() {
        let open = !paused && walk.current.is_none();
        let held = clusters.iter().filter(|c| !open && behind(c));
        walk.held.extend(held.cloned());
        if walk.current.is_some() {
            continue;
        }
        // A NotReady cluster does not hold its wave back, but a wave moves on only on the
        // evidence of one cluster at least: one whose clusters are all NotReady (a lost
        // canary, every agent still reconnecting to a hub that restarted) waits.
        let (mut complete, mut evidence) = (true, false);
        for c in clusters.iter().filter(|c| !away(c)) {
            match &standing[c] {
                Standing::Done => evidence = true,
                Standing::Soaking(_) if !waiting_after[i] => evidence = true,
                Standing::Soaking(at) | Standing::Starting(at) => {
                    walk.recheck = Some(walk.recheck.map_or(*at, |r| r.min(*at)));
                    complete = false;
                }
                Standing::Behind | Standing::Refused(_) | Standing::Failing(_) => complete = false,
            }
        }
        if !complete || !evidence {
            walk.current = Some(i);
        }
    }
    walk
}

/// What status says of the rollout.
struct View<'a> {
    waves: &'a [Wave],
    standing: &'a BTreeMap<&'a String, Standing>,
    walk: &'a Walk,
    paused: bool,
    now: Instant,
}

impl View<'_> {
    fn status(
        &self,
        targets: &BTreeMap<String, String>,
        away: &impl Fn(&str) -> bool,
    ) -> RolloutStatus {
        let (waves, current) = (self.waves, self.walk.current);
        // Only a cluster the rollout reached halts it (one not reached yet may be failing
        // at its old revision, which the new one may fix); one that left (NotReady)
        // halts nothing: it is not in the wave any more.
        let reached = waves.iter().take(current.map_or(waves.len(), |i| i + 1));
        let failing = reached
            .flat_map(|(_, cs)| cs)
            .find_map(|c| match &self.standing[c] {
                Standing::Failing(why) | Standing::Refused(why) if !away(c) => Some((c, why)),
                _ => None,
            });
        let behind = |s: &&Standing| matches!(s, Standing::Behind | Standing::Refused(_));
        let updated = self.standing.values().filter(|s| !behind(s)).count();
        let held = self.walk.held.len();
        let wave = current.map_or(waves.len(), |i| i + 1);
        let at = match current {
            Some(i) => format!("wave {wave} of {} ({})", waves.len(), waves[i].0),
            None => format!("wave {wave} of {}", waves.len()),
        };
        let (state, message) = match (current, failing) {
            (_, Some((c, why))) => (
                "Halted",
                format!(
                    "halted at {at}: cluster {c}: {why}; no further wave starts until it recovers or the spec changes"
                ),
            ),
            (Some(_), None) if self.paused => (
                "Paused",
                format!(
                    "paused at {at}: {held} cluster(s) wait for the revision; flotilla-hub rollout resume resumes it"
                ),
            ),
            (Some(i), None) => (
                "Progressing",
                progressing(&at, &waves[i].1, self.standing, self.now, away),
            ),
            (None, None) => ("Complete", String::new()),
        };
        RolloutStatus {
            revision: revisions(targets),
            state: state.to_owned(),
            wave: wave as i32,
            waves: waves.len() as i32,
            updated_clusters: updated as i32,
            held_clusters: held as i32,
            message: cut(message, CONDITION_MESSAGE_MAX),
            last_complete: None,
        }
    }
}

/// The distinct revisions, the first few by name and the count of the rest.
fn revisions(targets: &BTreeMap<String, String>) -> String {
    let revisions: BTreeSet<&String> = targets.values().collect();
    let shown: Vec<&str> = (revisions.iter().take(REVISIONS_SHOWN))
        .map(|r| r.as_str())
        .collect();
    let mut revision = shown.join(",");
    if revisions.len() > REVISIONS_SHOWN {
        revision.push_str(&format!(" and {} more", revisions.len() - REVISIONS_SHOWN));
    }
    revision
}

/// What the current wave waits for: its first cluster not done.
fn progressing(
    at: &str,
    wave: &[String],
    standing: &BTreeMap<&String, Standing>,
    now: Instant,
    away: &impl Fn(&str) -> bool,
) -> String {
    let waiting = wave.iter().filter(|c| !away(c)).find_map(|c| {
        let why = match &standing[c] {
            Standing::Behind => "waiting for its agent to run the revision".to_owned(),
            Standing::Starting(_) => "runs the revision, not Ready yet".to_owned(),
            Standing::Soaking(until) => format!(
                "Ready, soaking for {}s more",
                until.saturating_duration_since(now).as_secs()
            ),
            Standing::Done | Standing::Failing(_) | Standing::Refused(_) => return None,
        };
        Some(format!("{c}: {why}"))
    });
    let waiting = waiting.unwrap_or_else(|| {
        "every cluster of it is NotReady: waiting for one to run the revision Ready".into()
    });
    format!("{at}: {waiting}")
}

#[cfg(test)]
mod tests;
