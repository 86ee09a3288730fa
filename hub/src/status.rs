//! Status: the board of plans and agents' reports, and the writer of
//! `FederatedMyApp.status` (the status itself is `flotilla_plan::status::compute`).
//!
//! Reports land on a board in memory; the writer computes the status of each app marked
//! since its last round, from a snapshot taken under the board's lock and outside it, and
//! writes only what changed ([`crate::writes`]: merge patches, a budget, backoff).
//!
//! What "connected" means to a status: a cluster is reachable while its MemberCluster is
//! Ready (the heartbeat grace; [`StatusBoard::set_reachable`], from the MemberCluster
//! watch), never because a session closed: a session that ends and returns within the
//! grace (a hub failover, a step-down, a network blip) changes no status. A hub that just
//! took the lead has no report yet; an app with a reachable cluster whose agent has not
//! yet given this hub its reports ([`StatusBoard::heard`]) waits, so that the new
//! leader's first write is not a false "Pending".

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use arcstr::ArcStr;
use flotilla_crds::FederatedMyApp;
use flotilla_crds::federated::FederatedMyAppStatus;
use flotilla_plan::index::AppKey;
use flotilla_plan::placement::ClusterName;
use flotilla_plan::planner::Trigger;
use flotilla_plan::rollout::{Observed, Seen};
use flotilla_plan::status::{Inputs, Report, Reports, compute, detail};
use flotilla_plan::{AppPlan, ClusterPlan};
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use parking_lot::Mutex;
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::inventory::decisions::chosen;
use crate::writes::{self, Budget, Failure, Tracker, Write, WriteMetrics};
use flotilla_common::coalesce::Pending;

/// The `kind` label of this writer's metrics.
const KIND: &str = "federatedmyapp";
/// Status patches in flight at once.
const CONCURRENCY: usize = 8;

/// What a user must fix in a plan, in words: the app's error (with its reason), and
/// each cluster's (cluster, reason, message).
pub type PlanErrors = (
    Option<(&'static str, String)>,
    Vec<(String, &'static str, String)>,
);

/// One app's plan as the board holds it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Planned {
    pub plan: AppPlan,
    /// The app is being deleted and these clusters have not confirmed it.
    pub deleting_on: Option<Vec<String>>,
}

impl Planned {
    /// The clusters its status reports on.
    fn clusters(&self) -> impl Iterator<Item = &ClusterName> {
        self.plan.reported().map(|(c, _)| c)
    }

    /// Whether its status reports on `cluster`.
    fn reports_on(&self, cluster: &str) -> bool {
        let p = self.plan.clusters.get(cluster);
        p.is_some_and(ClusterPlan::is_reported)
    }

    /// What a user must fix: the app's error (or its halted rollout) and each
    /// cluster's, in words.
    pub fn errors(&self) -> PlanErrors {
        let failed = self
            .plan
            .reported()
            .filter_map(|(c, p)| Some((c.to_string(), p.error_reason(), p.error()?)));
        let halted = (self.plan.rollout.as_ref())
            .filter(|r| r.state == "Halted")
            .map(|r| ("RolloutHalted", r.message.clone()));
        let app = (self.plan.placement_error.as_ref()).map(|e| (e.reason(), e.to_string()));
        (app.or(halted), failed.collect())
    }

    /// Whether its rollout gate reads the agents' reports.
    fn progressive(&self) -> bool {
        self.plan.rollout.is_some()
    }
}

#[derive(Default)]
struct Board {
    plans: HashMap<AppKey, Arc<Planned>>,
    /// cluster → apps whose plan names it, so that a change of one cluster finds them
    /// without scanning every plan. One shared key per app.
    apps_on: HashMap<ClusterName, HashSet<Arc<AppKey>>>,
    reports: HashMap<AppKey, Arc<Reports>>,
    /// Clusters whose MemberCluster is Ready.
    reachable: Arc<HashSet<String>>,
    /// Clusters whose agent has given this hub its reports since it took the lead (the
    /// agent sends every report before its first heartbeat).
    heard: Arc<HashSet<String>>,
    /// What progressive apps' rollouts read of the reports.
    rollouts: HashMap<AppKey, Rollout>,
    /// The one copy of each cluster name and hash the reports hold.
    strings: Interner,
}

/// One shared copy of each string: a fleet's reports repeat a few cluster names and
/// hashes (an app's clusters mostly run the same bytes), a million times on a big hub.
#[derive(Default)]
struct Interner {
    set: HashSet<ArcStr>,
    /// Its size after the last sweep: strings nothing else holds any more are dropped
    /// when it has doubled, so it stays within twice what the reports hold (and a
    /// member that sends a new hash with every report cannot grow it).
    swept: usize,
}

impl Interner {
    /// Strings kept before the first sweep.
    const FLOOR: usize = 1024;

    fn get(&mut self, s: &str) -> ArcStr {
        if let Some(shared) = self.set.get(s) {
            return shared.clone();
        }
        if self.set.len() >= 2 * self.swept.max(Self::FLOOR) {
            self.set
                .retain(|shared| ArcStr::strong_count(shared) > Some(1));
            self.swept = self.set.len();
        }
        let shared = ArcStr::from(s);
        self.set.insert(shared.clone());
        shared
    }
}

/// What one progressive app's rollout read of the reports, and when.
#[derive(Default)]
struct Rollout {
    /// By cluster: the hash and readiness last seen, and since when this hub sees them
    /// (a rollout's soak and deadline count from it).
    since: HashMap<ArcStr, (ArcStr, bool, std::time::Instant)>,
    /// Reports that moved the rollout so far.
    moved: u64,
    /// `moved` when the planner last read the reports, and when the plan on the board
    /// did: a status computed from a plan gated on fewer reports than the board holds
    /// waits for the next plan (it could show clusters held that the reports release,
    /// e.g. every cluster after a hub restart).
    read: u64,
    gated: u64,
}

impl Board {
    /// Makes `plan` the app's plan, moving the app between the clusters' sets.
    fn insert_plan(&mut self, key: &AppKey, plan: Planned) {
        let shared = Arc::new(key.clone());
        for cluster in plan.clusters() {
            self.apps_on
                .entry(cluster.clone())
                .or_default()
                .replace(shared.clone());
        }
        if let Some(previous) = self.plans.insert(key.clone(), Arc::new(plan)) {
            let now: HashSet<&ClusterName> = self.plans[key].clusters().collect();
            let left = previous.clusters().filter(|c| !now.contains(c));
            remove_from(&mut self.apps_on, left, key);
        }
    }

    fn remove_plan(&mut self, key: &AppKey) {
        if let Some(plan) = self.plans.remove(key) {
            remove_from(&mut self.apps_on, plan.clusters(), key);
        }
    }

    fn apps_on(&self, cluster: &str) -> Vec<AppKey> {
        let apps = self.apps_on.get(cluster).into_iter().flatten();
        apps.map(|k| AppKey::clone(k)).collect()
    }
}

fn remove_from<'a>(
    apps_on: &mut HashMap<ClusterName, HashSet<Arc<AppKey>>>,
    clusters: impl Iterator<Item = &'a ClusterName>,
    key: &AppKey,
) {
    for cluster in clusters {
        if let Some(apps) = apps_on.get_mut(cluster) {
            apps.remove(key);
            if apps.is_empty() {
                apps_on.remove(cluster);
            }
        }
    }
}

/// The inputs of some apps' statuses, copied out of the board (shared, not cloned).
struct Snapshot {
    apps: Vec<(AppKey, Arc<Planned>, Option<Arc<Reports>>)>,
    reachable: Arc<HashSet<String>>,
    /// Reachable clusters not yet heard from: the apps on them wait.
    unheard: Vec<String>,
    /// Progressive apps whose plan was gated on fewer reports than the board holds.
    stale: HashSet<AppKey>,
}

impl Snapshot {
    /// Whether the app's status waits for an agent's reports, or for the plan that
    /// reads them.
    fn waits(&self, key: &AppKey, planned: &Planned) -> bool {
        self.stale.contains(key) || self.unheard.iter().any(|c| planned.reports_on(c))
    }

    fn inputs<'a>(&'a self, planned: &'a Planned, reports: Option<&'a Reports>) -> Inputs<'a> {
        Inputs {
            plan: &planned.plan,
            deleting_on: planned.deleting_on.as_deref(),
            reports,
            reachable: &self.reachable,
        }
    }
}

/// Plans and reports of every app, and the apps whose status must be looked at again.
#[derive(Default)]
pub struct StatusBoard {
    board: Mutex<Board>,
    dirty: Pending<AppKey>,
    /// Apps whose chosen clusters changed, for their PlacementDecisions.
    pub placements: Pending<AppKey>,
    /// The planner, told when a report moves a progressive app's rollout.
    planner: OnceLock<mpsc::UnboundedSender<Trigger>>,
}

/// A cluster's report as a rollout reads it: the hash, and Ready at its generation.
fn rollout_view(r: &Report) -> (bool, bool, bool) {
    let ready = r.exists && r.ready && r.observed_generation >= r.generation;
    (ready, r.degraded().is_some(), r.apply_error().is_some())
}

impl StatusBoard {
    /// Records the plan; true when its errors differ from the previous plan's (worth an
    /// Event).
    pub fn set_plan(&self, key: &AppKey, plan: Planned) -> bool {
        let mut b = self.board.lock();
        let previous = b.plans.get(key);
        let before = previous.map(|p| p.errors()).unwrap_or_default();
        let changed = before != plan.errors();
        let moved = previous.is_none_or(|p| chosen(&p.plan) != chosen(&plan.plan));
        if let Some(r) = b.rollouts.get_mut(key) {
            r.gated = if plan.progressive() { r.read } else { r.moved };
        }
        b.insert_plan(key, plan);
        drop(b);
        self.dirty.mark(key.clone());
        if moved {
            self.placements.mark(key.clone());
        }
        changed
    }

    /// Where a report that moves a progressive app's rollout is told (once, at start).
    pub fn notify_planner(&self, planner: mpsc::UnboundedSender<Trigger>) {
        let _ = self.planner.set(planner);
    }

    pub fn report(&self, cluster: &str, key: &AppKey, mut report: Report) {
        let mut guard = self.board.lock();
        let b = &mut *guard;
        let progressive = b.plans.get(key).is_some_and(|p| p.progressive());
        let reports = b.reports.entry(key.clone()).or_default();
        let before = reports.get(cluster);
        if before == Some(&report) {
            return;
        }
        report.hash = b.strings.get(&report.hash);
        let cluster = b.strings.get(cluster);
        // Only a progressive app's rollout reads the hash and readiness over time.
        let moves = progressive
            && before
                .is_none_or(|r| r.hash != report.hash || rollout_view(r) != rollout_view(&report));
        if moves {
            let (ready, _, _) = rollout_view(&report);
            let rollout = b.rollouts.entry(key.clone()).or_default();
            rollout.moved += 1;
            let same = |(h, r, _): &(ArcStr, bool, _)| *h == report.hash && *r == ready;
            if !rollout.since.get(&cluster).is_some_and(same) {
                let seen = (report.hash.clone(), ready, std::time::Instant::now());
                rollout.since.insert(cluster.clone(), seen);
            }
        }
        Arc::make_mut(reports).insert(cluster, report);
        drop(guard);
        self.dirty.mark(key.clone());
        if moves && let Some(planner) = self.planner.get() {
            let _ = planner.send(Trigger::Observed(key.clone()));
        }
    }

    /// What the agents report of a progressive app, for its rollout gate: a report
    /// seen for the first time is seen since now.
    pub fn observed(&self, key: &AppKey) -> Observed {
        let now = std::time::Instant::now();
        let mut b = self.board.lock();
        let Some(reports) = b.reports.get(key).cloned() else {
            return Observed::new();
        };
        let rollout = b.rollouts.entry(key.clone()).or_default();
        rollout.read = rollout.moved;
        let since = &mut rollout.since;
        let seen = reports.iter().map(|(cluster, r)| {
            let (ready, _, _) = rollout_view(r);
            let fresh = (r.hash.clone(), ready, now);
            let entry = since
                .entry(cluster.clone())
                .or_insert_with(|| fresh.clone());
            if entry.0 != r.hash || entry.1 != ready {
                *entry = fresh;
            }
            let seen = Seen {
                hash: r.hash.clone(),
                ready,
                degraded: (r.degraded()).map(|(reason, m)| format!("{reason}: {m}")),
                apply_error: r.apply_error().map(str::to_owned),
                since: entry.2,
            };
            (cluster.clone(), seen)
        });
        seen.collect()
    }

    /// The clusters whose MemberCluster is Ready now: the apps on those that changed may
    /// read differently. A cluster that is no longer reachable must give its reports
    /// again when it comes back.
    pub fn set_reachable(&self, ready: HashSet<String>) {
        let mut b = self.board.lock();
        let changed: Vec<String> = ready.symmetric_difference(&b.reachable).cloned().collect();
        if changed.is_empty() {
            return;
        }
        let heard = Arc::make_mut(&mut b.heard);
        heard.retain(|c| ready.contains(c));
        b.reachable = Arc::new(ready);
        let keys: Vec<AppKey> = changed.iter().flat_map(|c| b.apps_on(c)).collect();
        drop(b);
        self.dirty.mark_all(keys);
    }

    /// One cluster's `Ready` changed (a MemberCluster event), at the cost of that
    /// cluster, not of the fleet. A cluster that is no longer Ready is no longer heard:
    /// its agent gives its reports again when it returns.
    pub fn set_ready(&self, cluster: &str, ready: bool) {
        let mut b = self.board.lock();
        if b.reachable.contains(cluster) == ready {
            return;
        }
        if ready {
            Arc::make_mut(&mut b.reachable).insert(cluster.to_owned());
        } else {
            Arc::make_mut(&mut b.reachable).remove(cluster);
            Arc::make_mut(&mut b.heard).remove(cluster);
        }
        let keys = b.apps_on(cluster);
        drop(b);
        self.dirty.mark_all(keys);
    }

    #[cfg(test)]
    pub(crate) fn reachable(&self) -> HashSet<String> {
        (*self.board.lock().reachable).clone()
    }

    /// The cluster's agent has given this hub every report (it heartbeated after them).
    pub fn heard(&self, cluster: &str) {
        let mut b = self.board.lock();
        if b.heard.contains(cluster) {
            return;
        }
        Arc::make_mut(&mut b.heard).insert(cluster.to_owned());
        let keys = b.apps_on(cluster);
        drop(b);
        self.dirty.mark_all(keys);
    }

    /// Whether the app's deletion was planned and every cluster confirmed it.
    pub fn deletion_confirmed(&self, key: &AppKey) -> bool {
        let b = self.board.lock();
        let deleting_on = b.plans.get(key).and_then(|p| p.deleting_on.as_ref());
        deleting_on.is_some_and(Vec::is_empty)
    }

    pub fn forget(&self, key: &AppKey) {
        let mut b = self.board.lock();
        b.remove_plan(key);
        b.reports.remove(key);
        b.rollouts.remove(key);
        self.dirty.forget(key);
        self.placements.forget(key);
    }

    /// The app's plan as the board holds it.
    pub fn planned(&self, key: &AppKey) -> Option<Arc<Planned>> {
        self.board.lock().plans.get(key).cloned()
    }

    /// Every app the board holds a plan for.
    pub fn apps(&self) -> Vec<AppKey> {
        self.board.lock().plans.keys().cloned().collect()
    }

    /// This hub no longer leads: the sessions it heard are gone, and a later lead starts
    /// afresh.
    fn forget_sessions(&self) {
        let mut b = self.board.lock();
        b.reports.clear();
        b.rollouts.clear();
        b.heard = Arc::default();
    }

    fn snapshot(&self, keys: impl IntoIterator<Item = AppKey>) -> Snapshot {
        let b = self.board.lock();
        let apps: Vec<_> = keys
            .into_iter()
            .filter_map(|key| {
                let planned = b.plans.get(&key)?.clone();
                let reports = b.reports.get(&key).cloned();
                Some((key, planned, reports))
            })
            .collect();
        let unheard = b.reachable.iter().filter(|c| !b.heard.contains(*c));
        let stale = (apps.iter())
            .filter(|(key, _, _)| b.rollouts.get(key).is_some_and(|r| r.gated < r.moved))
            .map(|(key, _, _)| key.clone());
        Snapshot {
            stale: stale.collect(),
            apps,
            unheard: unheard.cloned().collect(),
            reachable: b.reachable.clone(),
        }
    }

    /// The app's status with every cluster listed and every message whole, as this hub
    /// sees it now (`flotilla-hub status NAME`).
    pub fn detail(
        &self,
        key: &AppKey,
        apps: &Store<FederatedMyApp>,
    ) -> Option<FederatedMyAppStatus> {
        let snapshot = self.snapshot([key.clone()]);
        let (_, planned, reports) = snapshot.apps.first()?;
        let current = apps.get(&ObjectRef::new(&key.name).within(&key.namespace));
        let previous = current.as_ref().and_then(|a| a.status.as_ref());
        let inputs = snapshot.inputs(planned, reports.as_deref());
        Some(detail(&inputs, previous, &Time(Timestamp::now())))
    }

    /// Writes the status of changed apps while this hub leads, until `shutdown`. On
    /// taking the lead every app is looked at once.
    pub async fn write_loop(
        self: Arc<Self>,
        writer: StatusWriter,
        leading: watch::Receiver<bool>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let (this, writer, shutdown_ref) = (&*self, &writer, &shutdown);
        let work = || {
            let all: Vec<AppKey> = this.board.lock().plans.keys().cloned().collect();
            this.dirty.mark_all(all);
            this.write_while_leading(writer, shutdown_ref)
        };
        writes::while_leading(leading, &shutdown, work, || this.forget_sessions()).await
    }

    async fn write_while_leading(
        &self,
        w: &StatusWriter,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        let mut round = Round::new(w);
        loop {
            let window = writes::window(w.window, round.backlog);
            let retry = round.tracker.next(Instant::now());
            let Some(keys) = self.dirty.take(window, retry, shutdown).await else {
                return Ok(());
            };
            let mut keys: HashSet<AppKey> = keys.into_iter().collect();
            keys.extend(round.tracker.due(Instant::now()));
            let due = self.prepare(keys, w, &mut round);
            round.backlog = due.len();
            w.metrics.backlog(KIND, due.len());
            self.send(due, w, &mut round).await;
        }
    }

    /// The patches to send now: each app's status computed outside the board's lock,
    /// compared with what its cached object shows.
    fn prepare(
        &self,
        keys: HashSet<AppKey>,
        w: &StatusWriter,
        round: &mut Round,
    ) -> Vec<Write<AppKey>> {
        let now = Instant::now();
        let snapshot = self.snapshot(keys);
        let time = Time(Timestamp::now());
        let mut due = Vec::new();
        for (key, planned, reports) in &snapshot.apps {
            if snapshot.waits(key, planned) {
                continue;
            }
            let Some(current) = w
                .apps
                .get(&ObjectRef::new(&key.name).within(&key.namespace))
            else {
                continue;
            };
            let version = current.resource_version().unwrap_or_default();
            if !round.tracker.may_write(key, &version, now) {
                continue;
            }
            let previous = current.status.as_ref();
            let inputs = snapshot.inputs(planned, reports.as_deref());
            let status = compute(&inputs, previous, &time);
            let (old, new) = (to_value(previous), to_value(Some(&status)));
            due.extend(round.tracker.patch(key, &old, &new, &version));
        }
        due
    }

    /// Sends `due` through the budget, a few at a time, and settles each answer.
    async fn send(&self, due: Vec<Write<AppKey>>, w: &StatusWriter, round: &mut Round) {
        let (budget, client) = (round.budget.clone(), w.client.clone());
        let answers: Vec<(Write<AppKey>, writes::Answer)> = futures::stream::iter(due)
            .then(move |write| {
                let wait = budget.lock().reserve(Instant::now());
                async move {
                    tokio::time::sleep(wait).await;
                    write
                }
            })
            .map(move |write| {
                let client = client.clone();
                async move {
                    let api: Api<FederatedMyApp> =
                        Api::namespaced(client.clone(), &write.key.namespace);
                    let url = api.resource_url();
                    let answer = writes::send(&client, url, &write.key.name, &write.patch).await;
                    (write, answer)
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        for (write, answer) in answers {
            let key = write.key.clone();
            match round.tracker.settle(write, answer, Instant::now()) {
                Ok(bytes) => {
                    debug!(app = %key, bytes, "status written");
                    w.metrics.written(KIND, bytes);
                }
                Err((failure, retry_in)) => failed(w, &key, failure, retry_in).await,
            }
        }
    }
}

/// Says why a write failed (a rejected status once, with an Event).
async fn failed(w: &StatusWriter, key: &AppKey, failure: Failure, retry_in: Option<Duration>) {
    w.metrics.result(KIND, failure.label());
    match failure {
        Failure::Gone => {}
        Failure::Conflict => {
            debug!(app = %key, ?retry_in, "status conflict: the cached app was stale")
        }
        Failure::Transient(error) => {
            warn!(app = %key, %error, ?retry_in, "writing status failed; retrying")
        }
        Failure::Rejected(error) => {
            warn!(app = %key, %error, "the apiserver rejects this status; it is sent again only once it changes");
            rejected_event(w, key, &error).await;
        }
    }
}

/// A Warning Event on the app whose status the apiserver rejected, once per status.
async fn rejected_event(w: &StatusWriter, key: &AppKey, error: &str) {
    let Some(app) = w
        .apps
        .get(&ObjectRef::new(&key.name).within(&key.namespace))
    else {
        return;
    };
    let event = Event {
        type_: EventType::Warning,
        reason: "StatusRejected".into(),
        note: Some(format!(
            "the apiserver rejected the status Flotilla computed: {error}; it is not sent again until it changes (flotilla-hub status {} -n {} shows it)",
            key.name, key.namespace
        )),
        action: "WriteStatus".into(),
        secondary: None,
    };
    if let Err(e) = w.recorder.publish(&event, &app.object_ref(&())).await {
        warn!(app = %key, error = %e, "publishing the StatusRejected Event failed");
    }
}

fn to_value(status: Option<&FederatedMyAppStatus>) -> Value {
    status.map_or(Value::Object(Default::default()), |s| {
        serde_json::to_value(s).expect("a status serializes")
    })
}

/// How the FederatedMyApp status writer writes.
pub struct StatusWriter {
    pub client: kube::Client,
    pub apps: Store<FederatedMyApp>,
    pub recorder: Recorder,
    pub metrics: WriteMetrics,
    /// The coalescing window when quiet ([`writes::window`] widens it).
    pub window: Duration,
    /// The budget: writes per second on average, and at once.
    pub rate: f64,
    pub burst: u32,
}

/// The writer's memory while this hub leads.
struct Round {
    tracker: Tracker<AppKey>,
    budget: Arc<Mutex<Budget>>,
    /// Writes in the last round.
    backlog: usize,
}

impl Round {
    fn new(w: &StatusWriter) -> Self {
        Self {
            tracker: Tracker::default(),
            budget: Arc::new(Mutex::new(Budget::new(w.rate, w.burst, Instant::now()))),
            backlog: 0,
        }
    }
}

#[cfg(test)]
mod tests;
