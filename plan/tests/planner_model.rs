//! A model of the hub around its planning core: random interleavings of app events
//! (applied with growing generations, deleted with or without `kubefed.io/orphan`, the
//! finalizer removed by hand, re-created under the same name), membership events (join,
//! leave, labels, readiness), ClusterGrants given and withdrawn (in the default mode and
//! with grants required), agents (connect, disconnect, take their queue; what they
//! apply is reported back Ready and plans the app again) and rechecks,
//! fed to `Planner` over a real `Index` as the hub's planner task feeds it: one trigger at
//! a time, with the apps and clusters as they are when it is taken.
//!
//! What must hold:
//! - no plan pushes a Delete for a MyApp the host wants on that cluster at that moment
//!   (a plan made from a stale member list would), nor for one its placement chooses
//!   there but a grant does not cover (withdrawing a grant is not a deletion); an agent's connect or report never
//!   makes the index push a Delete for a MyApp the app's latest plan wants there (it may
//!   lag the host by the triggers not yet taken, never contradict the planner);
//! - a finalizer is released only when no connected cluster holds the MyApp or has it
//!   queued, and no registered cluster holds a copy it was sent (rule 3);
//! - at the end, every trigger processed and every agent connected, each member runs
//!   exactly what the plan of the final state renders for it (gated by its rollout, for
//!   the progressive variant, with what the agents reported), the index desires exactly
//!   that, and no deletion waits.

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_crds::{ClusterGrant, FederatedMyApp};
use flotilla_plan::admission::Admission;
use flotilla_plan::grants::Grants;
use flotilla_plan::index::{AppKey, Change, Desired, Held, Index, Push, Scope};
use flotilla_plan::placement::{ClusterName, Member, Members};
use flotilla_plan::planner::{Apps, Effects, Planner, Trigger};
use flotilla_plan::rollout::{self, Observed, Seen};
use flotilla_plan::{AppPlan, plan};
use proptest::prelude::*;
use serde_json::json;

const APPS: u8 = 3;
const CLUSTERS: u8 = 4;
const TIERS: [&str; 3] = ["a", "b", "c"];

fn cluster(c: u8) -> String {
    format!("c{c}")
}

fn key(a: u8) -> AppKey {
    AppKey::new("default", format!("app{a}"))
}

#[derive(Debug, Clone)]
enum Event {
    Apply {
        app: u8,
        variant: u8,
        replicas: u8,
    },
    AddFinalizer(u8),
    Orphan(u8, bool),
    Delete(u8),
    RemoveFinalizer(u8),
    /// The controller removes the finalizer of every deletion the board says is done.
    Release,
    Join {
        cluster: u8,
        tier: u8,
    },
    Leave(u8),
    Relabel {
        cluster: u8,
        tier: u8,
    },
    Ready(u8, bool),
    /// ClusterGrant `g{grant}` in the apps' namespace grants the clusters of a tier.
    Grant {
        grant: u8,
        tier: u8,
    },
    Withdraw(u8),
    Connect(u8),
    Disconnect(u8),
    /// The cluster's agent carries out what its queue holds.
    AgentStep(u8),
    Tick(u8),
    /// The planner takes up to this many triggers.
    Process(u8),
}

fn event() -> impl Strategy<Value = Event> {
    let app = || 0..APPS;
    let c = || 0..CLUSTERS;
    prop_oneof![
        3 => (app(), 0u8..5, 1u8..4).prop_map(|(app, variant, replicas)| Event::Apply { app, variant, replicas }),
        1 => app().prop_map(Event::AddFinalizer),
        1 => (app(), any::<bool>()).prop_map(|(a, o)| Event::Orphan(a, o)),
        1 => app().prop_map(Event::Delete),
        1 => app().prop_map(Event::RemoveFinalizer),
        1 => Just(Event::Release),
        1 => (c(), 0u8..3).prop_map(|(cluster, tier)| Event::Join { cluster, tier }),
        1 => c().prop_map(Event::Leave),
        1 => (c(), 0u8..3).prop_map(|(cluster, tier)| Event::Relabel { cluster, tier }),
        1 => (c(), any::<bool>()).prop_map(|(c, r)| Event::Ready(c, r)),
        1 => (0u8..2, 0u8..3).prop_map(|(grant, tier)| Event::Grant { grant, tier }),
        1 => (0u8..2).prop_map(Event::Withdraw),
        2 => c().prop_map(Event::Connect),
        1 => c().prop_map(Event::Disconnect),
        3 => c().prop_map(Event::AgentStep),
        1 => (1u8..4).prop_map(Event::Tick),
        3 => (1u8..4).prop_map(Event::Process),
    ]
}

/// A FederatedMyApp as the host holds it.
#[derive(Debug, Clone)]
struct App {
    uid: u32,
    generation: i64,
    variant: u8,
    replicas: u8,
    finalizer: bool,
    orphan: bool,
    deleting: bool,
}

impl App {
    fn object(&self, key: &AppKey) -> Arc<FederatedMyApp> {
        let placement = match self.variant {
            0 => json!({"clusterSelector": {"matchLabels": {"tier": "a"}}}),
            1 => json!({"clusters": [{"name": "c0"}, {"name": "c3"}]}),
            2 => json!({"clusterSelector": {"matchLabels": {"tier": "b"}},
                        "replicaScheduling": {"mode": "Weighted", "totalReplicas": 3},
                        "failover": {"gracePeriodSeconds": 2}}),
            _ => json!({"clusterSelector": {}}),
        };
        // Variant 4 rolls out one cluster at a time, each soaking a second.
        let rollout = match self.variant {
            4 => json!({"type": "Progressive", "maxConcurrency": 1, "minSuccessSeconds": 1}),
            _ => json!(null),
        };
        // Variant 3 cannot render for c1 (11 replicas break the schema): c1 keeps.
        let overrides = match self.variant {
            3 => {
                json!([{"clusterName": "c1", "clusterOverrides": [{"path": "/spec/replicas", "value": 11}]}])
            }
            _ => json!([]),
        };
        let mut object = json!({
            "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
            "metadata": {"name": key.name, "namespace": key.namespace,
                         "uid": format!("uid-{}", self.uid), "generation": self.generation,
                         "finalizers": [flotilla_crds::federated::HUB_FINALIZER],
                         "annotations": {"kubefed.io/orphan": self.orphan.to_string()}},
            "spec": {"placement": placement, "overrides": overrides, "rollout": rollout,
                     "template": {"spec": {"replicas": self.replicas, "image": "nginx:1.27"}}},
        });
        if self.deleting {
            object["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        Arc::new(serde_json::from_value(object).expect("a valid FederatedMyApp"))
    }
}

/// The host: FederatedMyApps, registered clusters and ClusterGrants.
#[derive(Default)]
struct Host {
    apps: BTreeMap<AppKey, (App, Arc<FederatedMyApp>)>,
    /// Registered cluster → its tier label and since when it is NotReady.
    registered: BTreeMap<String, (u8, Option<Instant>)>,
    /// ClusterGrant `g{n}` → the tier it grants.
    grant_objects: BTreeMap<u8, u8>,
    /// The grants as the planner reads them.
    grants: Grants,
    next_uid: u32,
}

impl Apps for Host {
    fn get(&self, key: &AppKey) -> Option<Arc<FederatedMyApp>> {
        self.apps.get(key).map(|(_, o)| o.clone())
    }

    fn all(&self) -> Vec<Arc<FederatedMyApp>> {
        self.apps.values().map(|(_, o)| o.clone()).collect()
    }
}

impl Host {
    fn members(&self, now: Instant) -> Members {
        self.registered
            .iter()
            .map(|(name, (tier, since))| {
                let labels = [("tier".to_owned(), TIERS[*tier as usize].to_owned())].into();
                let member = Member {
                    not_ready_for: since.map(|s| now - s),
                    ..Member::with_labels(labels)
                };
                (name.as_str().into(), member)
            })
            .collect()
    }

    fn set_grants(&mut self) {
        let objects: Vec<ClusterGrant> = (self.grant_objects.iter())
            .map(|(g, tier)| {
                let object = json!({
                    "apiVersion": "flotilla.io/v1alpha1", "kind": "ClusterGrant",
                    "metadata": {"name": format!("g{g}"), "namespace": "default"},
                    "spec": {"clusterSelector": {"matchLabels": {"tier": TIERS[*tier as usize]}}},
                });
                serde_json::from_value(object).expect("a valid ClusterGrant")
            })
            .collect();
        self.grants = Grants::new(self.grants.required, &objects);
    }

    fn set(&mut self, key: &AppKey, app: App) {
        let object = app.object(key);
        self.apps.insert(key.clone(), (app, object));
    }

    /// Whether the host wants the MyApp `key` on `cluster` now: as the grants say, or as
    /// its placement would without them (a cluster not granted keeps what it runs, so no
    /// grant, given or withdrawn, is ever a reason to delete).
    fn wants(&self, cluster: &str, key: &AppKey, now: Instant) -> bool {
        self.apps.get(key).is_some_and(|(app, object)| {
            let members = self.members(now);
            let wants = |grants: &Grants| {
                plan(object, &members, &Admission::default(), grants)
                    .desired()
                    .contains_key(cluster)
            };
            !app.deleting && (wants(&self.grants) || wants(&Grants::default()))
        })
    }
}

/// What the hub's dispatcher and status board do with the planner's effects: the index,
/// each app's deletion waits as published, and the pushes to route.
#[derive(Default)]
struct Hub {
    index: Index,
    deleting_on: BTreeMap<AppKey, Option<Vec<String>>>,
    /// The clusters each app's latest plan wants it on.
    wanted: BTreeMap<AppKey, BTreeSet<String>>,
    planned_for: BTreeSet<String>,
    pushed: Vec<Push>,
    /// The model's clock as the planner's effects read it (the hub's dispatcher reads
    /// the real one).
    clock: Option<Instant>,
    /// What agents reported applying, as the status board keeps it: each MyApp Ready
    /// at once, since it was applied.
    observed: BTreeMap<AppKey, Observed>,
}

impl Effects for Hub {
    fn set_app(
        &mut self,
        key: &AppKey,
        generation: Option<i64>,
        desired: BTreeMap<ClusterName, Desired>,
    ) -> bool {
        let taken = !self.index.is_deleting(key);
        let pushes = self.index.set_app(key, generation, desired);
        self.pushed.extend(pushes);
        taken
    }

    fn delete_app(&mut self, key: &AppKey, orphan: bool, placed: &[String]) -> Vec<String> {
        let now = self
            .clock
            .expect("the model sets the clock before planning");
        let pushes = self.index.delete_app(key, orphan, placed, now);
        self.pushed.extend(pushes);
        self.index.deletion_waiting_on(key)
    }

    fn drop_app(&mut self, key: &AppKey, orphan: bool, replaced: bool) {
        let now = self
            .clock
            .expect("the model sets the clock before planning");
        let pushes = match replaced {
            true => self.index.replace_app(key, orphan, now),
            false => self.index.drop_app(key, orphan, now),
        };
        self.pushed.extend(pushes);
    }

    fn planned_for(&mut self, registered: BTreeSet<String>) {
        self.index.retain_clusters(&registered);
        self.planned_for = registered;
    }

    fn publish(&mut self, key: &AppKey, plan: AppPlan, deleting_on: Option<Vec<String>>) {
        let wanted = match deleting_on {
            None => plan.desired().into_keys().map(|c| c.to_string()).collect(),
            Some(_) => BTreeSet::new(),
        };
        self.wanted.insert(key.clone(), wanted);
        self.deleting_on.insert(key.clone(), deleting_on);
    }

    fn forget(&mut self, key: &AppKey) {
        self.wanted.remove(key);
        self.deleting_on.remove(key);
    }

    fn observed(&self, key: &AppKey) -> Observed {
        self.observed.get(key).cloned().unwrap_or_default()
    }
}

#[derive(Debug, Clone)]
enum Message {
    Change(Change),
    SyncComplete(Vec<AppKey>),
}

/// A member cluster and its agent.
#[derive(Default)]
struct Agent {
    connected: bool,
    /// Its session's queue: one slot per MyApp (newest wins in place) and one for
    /// SyncComplete, as the dispatcher keeps it.
    queue: Vec<(Option<AppKey>, Message)>,
    /// MyApp → its content hash and whether the agent manages it (not released).
    myapps: BTreeMap<AppKey, (String, bool)>,
    /// MyApps the hub sent it since it last registered.
    sent: HashSet<AppKey>,
}

impl Agent {
    fn push(&mut self, slot: Option<AppKey>, message: Message) {
        match self.queue.iter_mut().find(|(s, _)| *s == slot) {
            Some(queued) => queued.1 = message,
            None => self.queue.push((slot, message)),
        }
    }

    fn holds(&self, key: &AppKey) -> bool {
        self.myapps.get(key).is_some_and(|(_, managed)| *managed)
    }

    fn has_queued_apply(&self, key: &AppKey) -> bool {
        (self.queue.iter())
            .any(|(s, m)| s.as_ref() == Some(key) && matches!(m, Message::Change(Change::Apply(_))))
    }
}

/// What made the index push.
#[derive(Debug, Clone, Copy)]
enum From {
    Plan,
    Agent,
}

struct Model {
    host: Host,
    hub: Hub,
    planner: Planner,
    agents: Vec<Agent>,
    triggers: VecDeque<Trigger>,
    now: Instant,
}

impl Model {
    fn new(grants_required: bool) -> Model {
        let mut host = Host::default();
        host.grants.required = grants_required;
        for (c, tier) in [(0, 0), (1, 1), (2, 0)] {
            host.registered.insert(cluster(c), (tier, None));
        }
        Model {
            host,
            hub: Hub::default(),
            planner: Planner::default(),
            agents: (0..CLUSTERS).map(|_| Agent::default()).collect(),
            // Both stores listed: the first full pass comes before anything else.
            triggers: VecDeque::from([Trigger::Members]),
            now: Instant::now(),
        }
    }

    fn trigger(&mut self, t: Trigger) {
        let collapses = matches!(t, Trigger::Members | Trigger::Grants | Trigger::Recheck);
        if !(collapses && self.triggers.contains(&t)) {
            self.triggers.push_back(t);
        }
    }

    fn run(&mut self, event: &Event) -> Result<(), TestCaseError> {
        match *event {
            Event::Apply {
                app,
                variant,
                replicas,
            } => self.apply(app, variant, replicas),
            Event::AddFinalizer(a) => self.edit(a, |app| app.finalizer |= !app.deleting),
            Event::Orphan(a, orphan) => self.edit(a, |app| app.orphan = orphan),
            Event::Delete(a) => self.delete(a),
            Event::RemoveFinalizer(a) => self.remove_finalizer(a),
            Event::Release => self.release()?,
            Event::Join { cluster: c, tier } => self.join(c, tier),
            Event::Leave(c) => self.leave(c),
            Event::Relabel { cluster: c, tier } => self.relabel(c, tier),
            Event::Ready(c, ready) => self.ready(c, ready),
            Event::Grant { grant, tier } => {
                self.host.grant_objects.insert(grant, tier);
                self.host.set_grants();
                self.trigger(Trigger::Grants);
            }
            Event::Withdraw(grant) => {
                self.host.grant_objects.remove(&grant);
                self.host.set_grants();
                self.trigger(Trigger::Grants);
            }
            Event::Connect(c) => self.connect(c)?,
            Event::Disconnect(c) => self.disconnect(c),
            Event::AgentStep(c) => self.agent_step(c)?,
            Event::Tick(s) => self.tick(Duration::from_secs(u64::from(s))),
            Event::Process(n) => self.process(usize::from(n))?,
        }
        Ok(())
    }

    fn apply(&mut self, a: u8, variant: u8, replicas: u8) {
        let key = key(a);
        let app = match self.host.apps.get(&key) {
            Some((app, _)) if app.deleting => return,
            Some((app, _)) => App {
                generation: app.generation + 1,
                variant,
                replicas,
                ..app.clone()
            },
            None => {
                self.host.next_uid += 1;
                App {
                    uid: self.host.next_uid,
                    generation: 1,
                    variant,
                    replicas,
                    finalizer: false,
                    orphan: false,
                    deleting: false,
                }
            }
        };
        self.host.set(&key, app);
        self.trigger(Trigger::Applied(key));
    }

    /// A metadata change: no new generation, no trigger.
    fn edit(&mut self, a: u8, change: impl FnOnce(&mut App)) {
        let key = key(a);
        if let Some((app, _)) = self.host.apps.get(&key) {
            let mut app = app.clone();
            change(&mut app);
            self.host.set(&key, app);
        }
    }

    fn delete(&mut self, a: u8) {
        let key = key(a);
        let Some((app, _)) = self.host.apps.get(&key) else {
            return;
        };
        if app.deleting {
            return;
        }
        if app.finalizer {
            let app = App {
                deleting: true,
                generation: app.generation + 1,
                ..app.clone()
            };
            self.host.set(&key, app);
            self.trigger(Trigger::Applied(key));
        } else {
            self.gone(&key);
        }
    }

    fn gone(&mut self, key: &AppKey) {
        if let Some((app, _)) = self.host.apps.remove(key) {
            self.trigger(Trigger::Gone {
                key: key.clone(),
                orphan: app.orphan,
            });
        }
    }

    fn remove_finalizer(&mut self, a: u8) {
        let key = key(a);
        match self.host.apps.get(&key) {
            Some((app, _)) if app.deleting && app.finalizer => self.gone(&key),
            Some(_) => self.edit(a, |app| app.finalizer = false),
            None => {}
        }
    }

    /// The controller: a deletion every cluster confirmed loses its finalizer. Rule 3:
    /// nothing that holds the MyApp, or was sent it, may be left unconfirmed.
    fn release(&mut self) -> Result<(), TestCaseError> {
        let done: Vec<AppKey> = (self.host.apps.iter())
            .filter(|(k, (app, _))| {
                app.deleting
                    && app.finalizer
                    && self.hub.deleting_on.get(*k) == Some(&Some(Vec::new()))
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in done {
            for (c, agent) in self.agents.iter().enumerate() {
                if !self.host.registered.contains_key(&cluster(c as u8)) {
                    continue;
                }
                let unconfirmed = (agent.connected && agent.has_queued_apply(&key))
                    || (agent.holds(&key) && (agent.connected || agent.sent.contains(&key)));
                prop_assert!(
                    !unconfirmed,
                    "finalizer of {key} released while c{c} may hold it"
                );
            }
            self.gone(&key);
        }
        Ok(())
    }

    fn join(&mut self, c: u8, tier: u8) {
        if self.host.registered.contains_key(&cluster(c)) {
            return;
        }
        self.host.registered.insert(cluster(c), (tier, None));
        self.trigger(Trigger::Members);
    }

    fn leave(&mut self, c: u8) {
        if self.host.registered.remove(&cluster(c)).is_none() {
            return;
        }
        // Its credential goes with it: the session is closed; the cluster keeps what it
        // runs.
        self.disconnect(c);
        self.agents[c as usize].sent.clear();
        self.trigger(Trigger::Members);
    }

    fn relabel(&mut self, c: u8, tier: u8) {
        if let Some(registered) = self.host.registered.get_mut(&cluster(c)) {
            registered.0 = tier;
            self.trigger(Trigger::Members);
        }
    }

    fn ready(&mut self, c: u8, ready: bool) {
        let now = self.now;
        if let Some((_, since)) = self.host.registered.get_mut(&cluster(c))
            && since.is_none() != ready
        {
            *since = (!ready).then_some(now);
            self.trigger(Trigger::Members);
        }
    }

    /// An agent is admitted while its cluster is registered (its credential valid), once
    /// every app was planned with it.
    fn connect(&mut self, c: u8) -> Result<(), TestCaseError> {
        let name = cluster(c);
        let agent = &mut self.agents[c as usize];
        let admitted =
            self.host.registered.contains_key(&name) && self.hub.planned_for.contains(&name);
        if agent.connected || !admitted {
            return Ok(());
        }
        agent.connected = true;
        let managed = (agent.myapps.iter())
            .filter(|(_, (_, managed))| *managed)
            .map(|(k, (hash, _))| (k.clone(), hash.clone()))
            .collect();
        let (pushes, desired) = self.hub.index.connect(&name, &managed, Scope::All);
        self.route(pushes, From::Agent)?;
        let desired = desired.iter().map(|k| AppKey::clone(k)).collect();
        self.agents[c as usize].push(None, Message::SyncComplete(desired));
        Ok(())
    }

    fn disconnect(&mut self, c: u8) {
        let agent = &mut self.agents[c as usize];
        if agent.connected {
            agent.connected = false;
            agent.queue.clear();
            self.hub.index.disconnect(&cluster(c));
        }
    }

    fn agent_step(&mut self, c: u8) -> Result<(), TestCaseError> {
        let agent = &mut self.agents[c as usize];
        if !agent.connected {
            return Ok(());
        }
        let mut reports = Vec::new();
        let mut applied = Vec::new();
        for (slot, message) in std::mem::take(&mut agent.queue) {
            match (slot, message) {
                (Some(key), Message::Change(Change::Apply(r))) => {
                    agent.myapps.insert(key.clone(), (r.hash.clone(), true));
                    agent.sent.insert(key.clone());
                    applied.push((key.clone(), r.hash.clone()));
                    reports.push((key, Held::Present));
                }
                (Some(key), Message::Change(Change::Delete { orphan })) => {
                    match orphan {
                        true => agent.myapps.get_mut(&key).map(|m| m.1 = false),
                        false => agent.myapps.remove(&key).map(drop),
                    };
                    reports.push((key, Held::Absent));
                }
                (_, Message::SyncComplete(desired)) => {
                    let orphans: Vec<AppKey> = (agent.myapps.iter())
                        .filter(|(k, (_, managed))| *managed && !desired.contains(k))
                        .map(|(k, _)| k.clone())
                        .collect();
                    for key in orphans {
                        agent.myapps.remove(&key);
                        reports.push((key, Held::Absent));
                    }
                }
                (None, Message::Change(_)) => unreachable!("a change has its MyApp's slot"),
            }
        }
        let name = cluster(c);
        // The board tells the planner of a new hash (the hub does for progressive apps
        // only; another plan of the others is harmless).
        for (key, hash) in applied {
            let seen = self.hub.observed.entry(key.clone()).or_default();
            if seen.get(name.as_str()).is_none_or(|s| *s.hash != hash) {
                let (ready, degraded, apply_error, since) = (true, None, None, self.now);
                let s = Seen {
                    hash: hash.into(),
                    ready,
                    degraded,
                    apply_error,
                    since,
                };
                seen.insert(name.as_str().into(), s);
                self.trigger(Trigger::Observed(key));
            }
        }
        for (key, held) in reports {
            if self.hub.index.is_placed(&name, &key) {
                let pushes = self.hub.index.report(&name, &key, held);
                self.route(pushes, From::Agent)?;
            }
        }
        Ok(())
    }

    fn tick(&mut self, by: Duration) {
        self.now += by;
        if self.planner.next_recheck().is_some_and(|at| at <= self.now) {
            self.trigger(Trigger::Recheck);
        }
    }

    fn process(&mut self, n: usize) -> Result<(), TestCaseError> {
        for _ in 0..n {
            let Some(trigger) = self.triggers.pop_front() else {
                break;
            };
            let members = self.host.members(self.now);
            self.hub.clock = Some(self.now);
            (self.planner).handle(
                trigger,
                &self.host,
                (&members, &self.host.grants),
                self.now,
                &mut self.hub,
            );
            let pushes = std::mem::take(&mut self.hub.pushed);
            self.route(pushes, From::Plan)?;
        }
        Ok(())
    }

    /// Queues each push for its cluster's agent, if connected. A Delete from a plan must
    /// be for a MyApp the host does not want there now; one from an agent's connect or
    /// report, for a MyApp the app's latest plan does not want there.
    fn route(&mut self, pushes: Vec<Push>, from: From) -> Result<(), TestCaseError> {
        for (c, key, change) in pushes {
            if change == (Change::Delete { orphan: false }) {
                let wanted = match from {
                    From::Plan => self.host.wants(&c, &key, self.now),
                    From::Agent => self.hub.wanted.get(&key).is_some_and(|w| w.contains(&c)),
                };
                prop_assert!(
                    !wanted,
                    "a Delete of {key} pushed to {c} ({from:?}), which wants it there"
                );
            }
            let agent = &mut self.agents[c[1..].parse::<usize>().expect("cN")];
            if agent.connected {
                agent.push(Some(AppKey::clone(&key)), Message::Change(change));
            }
        }
        Ok(())
    }

    /// Every trigger processed, every registered agent connected and done, every
    /// finished deletion released, every recheck due taken.
    fn settle(&mut self) -> Result<(), TestCaseError> {
        for _ in 0..100 {
            self.process(usize::MAX)?;
            for c in 0..CLUSTERS {
                self.connect(c)?;
                self.agent_step(c)?;
            }
            self.release()?;
            let idle = self.agents.iter().all(|a| a.queue.is_empty());
            if !self.triggers.is_empty() || !idle {
                continue;
            }
            match self.planner.next_recheck() {
                Some(at) => self.tick(at.saturating_duration_since(self.now)),
                None => return Ok(()),
            }
        }
        Err(TestCaseError::fail(format!(
            "the model did not settle: triggers {:?}, recheck in {:?}, deletions {:?}",
            self.triggers,
            self.planner
                .next_recheck()
                .map(|at| at.saturating_duration_since(self.now)),
            self.hub.deleting_on
        )))
    }

    /// Each member runs exactly the final state's plan, the index desires exactly that,
    /// and nothing waits.
    fn check_final(&self) -> Result<(), TestCaseError> {
        let members = self.host.members(self.now);
        let mut want: BTreeMap<String, BTreeMap<AppKey, Desired>> = BTreeMap::new();
        for (key, (app, object)) in &self.host.apps {
            prop_assert!(!app.deleting, "{key} still being deleted");
            let mut planned = plan(object, &members, &Admission::default(), &self.host.grants);
            let observed = self.hub.observed(key);
            rollout::gate(object, &mut planned, &members, &observed, self.now);
            for (c, d) in planned.desired() {
                want.entry(c.to_string())
                    .or_default()
                    .insert(key.clone(), d);
            }
        }
        for c in self.host.registered.keys() {
            let wanted = want.remove(c).unwrap_or_default();
            let keys: Vec<&AppKey> = wanted.keys().collect();
            let desired = self.hub.index.desired_shared(c);
            prop_assert_eq!(
                desired.iter().map(|k| &**k).collect::<Vec<_>>(),
                keys,
                "desired keys on {}",
                c
            );
            let agent = &self.agents[c[1..].parse::<usize>().expect("cN")];
            for (key, (hash, managed)) in &agent.myapps {
                let ok = match wanted.get(key) {
                    Some(Desired::Apply(r)) => *managed && r.hash == *hash,
                    Some(Desired::Keep) => true,
                    Some(Desired::Release) | None => !managed,
                };
                prop_assert!(ok, "{} holds {} ({}, managed {})", c, key, hash, managed);
            }
            for (key, d) in &wanted {
                if matches!(d, Desired::Apply(_)) {
                    prop_assert!(agent.holds(key), "{} lacks {}", c, key);
                }
            }
        }
        for a in 0..APPS {
            prop_assert!(!self.hub.index.is_deleting(&key(a)), "app{} deleting", a);
            let published = self.hub.deleting_on.get(&key(a));
            prop_assert_eq!(published.is_some(), self.host.apps.contains_key(&key(a)));
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_interleaving_ends_with_the_plan_of_the_final_state(
        events in proptest::collection::vec(event(), 1..80),
        grants_required in any::<bool>(),
    ) {
        let mut model = Model::new(grants_required);
        for e in &events {
            model.run(e)?;
        }
        model.settle()?;
        model.check_final()?;
    }
}

/// Issue 19 item 4 at the core's level: a new app and a cluster joining its placement,
/// interleaved with the finalizer being added (which once made the reconcile plan with
/// the clusters it read before that PATCH, and send the joining cluster a Delete). The
/// planner takes its clusters when it takes each trigger: the app ends on the joining
/// cluster, and `route` fails the test on any Delete pushed there.
#[test]
fn a_cluster_that_joins_while_a_new_app_is_finalized_keeps_it() {
    let mut model = Model::new(false);
    let events = [
        Event::Process(1),
        Event::Connect(0),
        // Placed on c0 and c3; c3 is not registered yet.
        Event::Apply {
            app: 0,
            variant: 1,
            replicas: 1,
        },
        Event::Join {
            cluster: 3,
            tier: 0,
        },
        Event::Process(1),
        Event::Connect(3),
        Event::AgentStep(3),
        // The finalizer PATCH returns: nothing to plan.
        Event::AddFinalizer(0),
        Event::Process(3),
        Event::AgentStep(3),
    ];
    for e in &events {
        model.run(e).unwrap();
    }
    model.settle().unwrap();
    model.check_final().unwrap();
    assert!(model.agents[3].holds(&key(0)), "c3 runs the app");
}
