//! Planner: the one writer of the index. One task takes every trigger from one merged
//! stream (an app applied, an app gone, the registered clusters changed, a plan's
//! recheck), takes one snapshot of the registered clusters after its last await, and
//! plans with `flotilla_plan::planner`: the index through the dispatcher (which pushes
//! the changes to agents), the plans to the status board. No plan can land after a plan
//! made from newer clusters (rule 1: a member list read before an await once planned a
//! joining cluster out again and sent it a Delete).
//!
//! Nothing is planned before the three stores (FederatedMyApps, MemberClusters,
//! ClusterGrants) have listed (rule 2): a plan made from a partial list would tell
//! agents to delete what is wanted, or read a namespace whose grants are not listed yet
//! as one without a grant. The grants are read from their store with the clusters, in
//! the same snapshot. The first pass plans every
//! app, deletions too (an orphaning delete must reach agents as a release, never as a
//! missing entry that they would collect), then opens the gate for agents; an agent is
//! admitted only once every app was planned with its cluster registered
//! (`Dispatcher::planned_for`). A standby plans as the leader does, and so stays warm:
//! only the leader serves agents and writes to the host.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::Hash;
use std::sync::Arc;

use anyhow::Context as _;
use flotilla_common::http::Gate;
use flotilla_common::listed::Listed;
use flotilla_crds::{ClusterGrant, FederatedMyApp, MemberCluster};
use flotilla_plan::AppPlan;
use flotilla_plan::admission::Admission;
use flotilla_plan::grants::Grants;
use flotilla_plan::index::{AppKey, Desired};
use flotilla_plan::placement::{ClusterName, ClusterNames};
use flotilla_plan::planner::{self, Apps, Effects, Trigger, key_of, orphans};
use flotilla_plan::rollout::Observed;
use futures::{Stream, StreamExt};
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::controller::Notices;
use crate::dispatch::Dispatcher;
use crate::membership::MemberChanges;
use crate::status::{Planned, StatusBoard};

/// Triggers taken at once, with one member snapshot.
const BATCH: usize = 1024;

/// What the planner writes to, and reads from, and what it admits.
pub struct Planner {
    pub admission: Admission,
    pub dispatcher: Arc<Dispatcher>,
    pub status: Arc<StatusBoard>,
    pub notices: Arc<Notices>,
    pub apps: Store<FederatedMyApp>,
    pub members: Store<MemberCluster>,
    pub grants: Store<ClusterGrant>,
    /// `--require-namespace-grant`: a namespace without a ClusterGrant places nowhere.
    pub require_grant: bool,
}

/// Where the planner's triggers come from.
pub struct Inputs {
    /// Apps applied and gone, from [`watch_apps`].
    pub apps: mpsc::UnboundedReceiver<Trigger>,
    /// Bumped by the MemberCluster watch whenever the registered clusters change.
    pub members: watch::Receiver<MemberChanges>,
    /// Bumped by [`watch_grants`] whenever the ClusterGrants change.
    pub grants: watch::Receiver<()>,
    pub apps_listed: Listed,
    pub members_listed: Listed,
    pub grants_listed: Listed,
}

impl Planner {
    /// Waits until the three stores have listed, plans every app, opens `gate`, then
    /// plans what each trigger may have changed until `shutdown`.
    pub async fn run(
        self,
        mut inputs: Inputs,
        gate: Gate,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let wait = |what: &'static str, listed: Listed| async move {
            listed
                .wait()
                .await
                .with_context(|| format!("the {what} watch"))?;
            info!("{what}s listed");
            anyhow::Ok(())
        };
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            r = async {
                tokio::try_join!(
                    wait("FederatedMyApp", inputs.apps_listed.clone()),
                    wait("MemberCluster", inputs.members_listed.clone()),
                    wait("ClusterGrant", inputs.grants_listed.clone()),
                )
            } => { r?; }
        }
        let mut core = planner::Planner::new(self.admission.clone());
        inputs.members.borrow_and_update();
        inputs.grants.borrow_and_update();
        let mut grants = Grants::new(self.require_grant, std::iter::empty());
        let mut names = ClusterNames::default();
        self.plan(&mut core, vec![Trigger::Members], &mut grants, &mut names);
        gate.open();
        info!(
            apps = self.apps.state().len(),
            clusters = self.members.state().len(),
            "every app planned; accepting agents"
        );
        while let Some(batch) = next_batch(&mut inputs, &core, &shutdown).await? {
            self.plan(&mut core, batch, &mut grants, &mut names);
        }
        Ok(())
    }

    /// Plans `batch` with one snapshot of the registered clusters and the grants, taken
    /// now: after the last await, so that no plan after it can use older ones. `last`:
    /// the grants of the previous batch, to say what changed. `names`: the clusters'
    /// names of the previous batch, so that plans of every batch share one copy of each.
    fn plan(
        &self,
        core: &mut planner::Planner,
        batch: Vec<Trigger>,
        last: &mut Grants,
        names: &mut ClusterNames,
    ) {
        let members = names.registered_of(self.members.state().iter().map(|m| &**m));
        let grants = Grants::new(self.require_grant, self.grants.state().iter().map(|g| &**g));
        if grants != *last {
            log_grant_changes(&grants, last);
            *last = grants.clone();
        }
        let now = Instant::now().into_std();
        let apps = AppStore(&self.apps);
        let mut writes = Writes {
            dispatcher: &self.dispatcher,
            status: &self.status,
            notices: &self.notices,
        };
        // A burst of reports asks to plan a progressive app once, not once per report.
        let mut observed = HashSet::new();
        for trigger in batch {
            if let Trigger::Observed(key) = &trigger
                && !observed.insert(key.clone())
            {
                continue;
            }
            core.handle(trigger, &apps, (&members, &grants), now, &mut writes);
        }
    }
}

/// Says what a change of the grants means where a user should hear it: a namespace whose
/// last grant is gone may place on every cluster again (the default mode), a grant with
/// an invalid selector grants nothing by it.
fn log_grant_changes(grants: &Grants, before: &Grants) {
    for namespace in grants.widened(before) {
        warn!(
            %namespace,
            "namespace has no ClusterGrant left: its FederatedMyApps may be placed on every cluster again (run the hub with --require-namespace-grant to place such a namespace nowhere)"
        );
    }
    for (field, reason) in grants.invalid() {
        warn!(%field, %reason, "invalid ClusterGrant selector: it grants no cluster");
    }
    let namespaces = grants.changed(before);
    info!(
        ?namespaces,
        "ClusterGrants changed: planning these namespaces again"
    );
}

/// Waits for the next triggers: whatever the app watch queued, a membership change, a
/// change of the grants, or the earliest recheck. `None` at shutdown.
async fn next_batch(
    inputs: &mut Inputs,
    core: &planner::Planner,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<Vec<Trigger>>> {
    let recheck = async {
        match core.next_recheck() {
            Some(at) => tokio::time::sleep_until(Instant::from_std(at)).await,
            None => std::future::pending().await,
        }
    };
    let first = tokio::select! {
        biased;
        _ = shutdown.cancelled() => return Ok(None),
        trigger = inputs.apps.recv() => match trigger {
            Some(trigger) => trigger,
            None if shutdown.is_cancelled() => return Ok(None),
            None => anyhow::bail!("the FederatedMyApp watch ended"),
        },
        changed = inputs.members.changed() => {
            if changed.is_err() && shutdown.is_cancelled() {
                // The membership watch stopped first.
                return Ok(None);
            }
            changed.context("the MemberCluster watch ended")?;
            Trigger::Members
        }
        changed = inputs.grants.changed() => {
            if changed.is_err() && shutdown.is_cancelled() {
                return Ok(None);
            }
            changed.context("the ClusterGrant watch ended")?;
            Trigger::Grants
        }
        () = recheck => Trigger::Recheck,
    };
    let mut batch = vec![first];
    while batch.len() < BATCH {
        match inputs.apps.try_recv() {
            Ok(trigger) => batch.push(trigger),
            Err(_) => break,
        }
    }
    Ok(Some(batch))
}

/// The FederatedMyApp store as the planner reads it.
struct AppStore<'a>(&'a Store<FederatedMyApp>);

impl Apps for AppStore<'_> {
    fn get(&self, key: &AppKey) -> Option<Arc<FederatedMyApp>> {
        self.0
            .get(&ObjectRef::new(&key.name).within(&key.namespace))
    }

    fn all(&self) -> Vec<Arc<FederatedMyApp>> {
        self.0.state()
    }
}

/// The planner's effects: the index through the dispatcher, plans on the status board,
/// and what the controller must hear of them.
struct Writes<'a> {
    dispatcher: &'a Dispatcher,
    status: &'a StatusBoard,
    notices: &'a Notices,
}

impl Effects for Writes<'_> {
    fn set_app(
        &mut self,
        key: &AppKey,
        generation: Option<i64>,
        desired: BTreeMap<ClusterName, Desired>,
    ) -> bool {
        self.dispatcher.set_app(key, generation, desired)
    }

    fn delete_app(&mut self, key: &AppKey, orphan: bool, placed: &[String]) -> Vec<String> {
        let (waiting, unheeded) = self.dispatcher.delete_app(key, orphan, placed);
        if !unheeded.is_empty() {
            self.notices.claims_unheeded(key, unheeded);
        }
        waiting
    }

    fn drop_app(&mut self, key: &AppKey, orphan: bool, replaced: bool) {
        self.dispatcher.drop_app(key, orphan, replaced);
    }

    fn planned_for(&mut self, registered: BTreeSet<String>) {
        self.dispatcher.planned_for(registered);
    }

    fn publish(&mut self, key: &AppKey, plan: AppPlan, deleting_on: Option<Vec<String>>) {
        let confirmed = deleting_on.as_ref().is_some_and(Vec::is_empty);
        let planned = Planned { plan, deleting_on };
        let errors = planned.errors();
        let live = planned.deleting_on.is_none();
        if self.status.set_plan(key, planned) && live {
            self.notices.errors_changed(key, errors);
        }
        if confirmed {
            self.notices.deletion_confirmed(key);
        }
    }

    fn forget(&mut self, key: &AppKey) {
        self.status.forget(key);
    }

    fn observed(&self, key: &AppKey) -> Observed {
        self.status.observed(key)
    }
}

/// Runs the FederatedMyApp watch (`events` drives the store) until it ends: tells the
/// planner of every app applied (a new generation) or gone, and hands applied apps to
/// the controller. A watch never ends by itself; if it does, the hub must stop.
pub async fn watch_apps(
    events: impl Stream<Item = Result<watcher::Event<FederatedMyApp>, watcher::Error>> + Send,
    triggers: mpsc::UnboundedSender<Trigger>,
    controller: mpsc::UnboundedSender<FederatedMyApp>,
) -> anyhow::Result<()> {
    let mut departures = Departures::new(|app: &FederatedMyApp| (key_of(app), orphans(app)));
    let mut applied = Applied::default();
    let mut events = std::pin::pin!(events);
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            // The watch retries with backoff; say why it had to.
            Err(e) => {
                warn!(error = %e, "watching FederatedMyApps");
                continue;
            }
        };
        for (key, orphan) in departures.gone(&event) {
            let _ = triggers.send(Trigger::Gone { key, orphan });
        }
        for app in applied.take(event) {
            let _ = triggers.send(Trigger::Applied(key_of(&app)));
            let _ = controller.send(app);
        }
    }
    anyhow::bail!("the FederatedMyApp watch ended")
}

/// Runs the ClusterGrant watch (`events` drives the store) until it ends: bumps
/// `changed` whenever the store shows a change (a re-list's at its `InitDone`, when the
/// store swaps in the new list). A watch never ends by itself; if it does, the hub must
/// stop.
pub async fn watch_grants(
    events: impl Stream<Item = Result<watcher::Event<ClusterGrant>, watcher::Error>> + Send,
    changed: watch::Sender<()>,
) -> anyhow::Result<()> {
    let mut events = std::pin::pin!(events);
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
            Ok(_) => {
                changed.send_replace(());
            }
            // The watch retries with backoff; say why it had to.
            Err(e) => warn!(
                error = %e,
                "watching ClusterGrants (the hub plans nothing until they are listed; is their CRD installed? `flotilla-hub crds | kubectl apply -f -`)"
            ),
        }
    }
    anyhow::bail!("the ClusterGrant watch ended")
}

/// The apps a watch shows applied: each new object, new generation or arrival of the
/// hub's finalizer once. Those of a
/// (re-)list only at its `InitDone`, when the store shows them: the planner reads the
/// app from the store, and a trigger it took while the store still held the old object
/// would plan that, and no later trigger would come for the new generation (a deletion
/// or a placement change made while the watch was down would never be planned).
#[derive(Default)]
struct Applied {
    /// The UID, generation and whether the hub's finalizer was on, last handed on, by app.
    seen: HashMap<AppKey, (Option<String>, Option<i64>, bool)>,
    /// The list in progress, from `Init` to `InitDone`.
    relist: Option<Vec<FederatedMyApp>>,
}

impl Applied {
    fn take(&mut self, event: watcher::Event<FederatedMyApp>) -> Vec<FederatedMyApp> {
        match event {
            watcher::Event::Init => self.relist = Some(Vec::new()),
            watcher::Event::InitApply(app) => self.relist.get_or_insert_default().push(app),
            watcher::Event::InitDone => {
                let listed = self.relist.take().unwrap_or_default();
                let keys: HashSet<AppKey> = listed.iter().map(key_of).collect();
                self.seen.retain(|key, _| keys.contains(key));
                return listed.into_iter().filter(|app| self.is_new(app)).collect();
            }
            watcher::Event::Apply(app) => {
                if self.is_new(&app) {
                    return vec![app];
                }
            }
            watcher::Event::Delete(app) => {
                self.seen.remove(&key_of(&app));
            }
        }
        Vec::new()
    }

    fn is_new(&mut self, app: &FederatedMyApp) -> bool {
        // The hub's finalizer arriving on a live app is news too: the planner sends
        // nothing before it. (Its removal once a deletion is done is not.)
        let held = app.metadata.deletion_timestamp.is_none() && planner::held_by_hub(app);
        let now = (app.uid(), app.metadata.generation, held);
        self.seen.insert(key_of(app), now.clone()) != Some(now)
    }
}

/// Which objects a watch shows gone: those it reports deleted, and those a re-list no
/// longer holds, or holds as another object of the same name (deleted, and perhaps
/// created again, while the watch was down, e.g. across an apiserver restart: no Delete
/// event ever comes for them). Only two complete lists are compared, never a partial
/// one. Each object is remembered by its key, its UID and `V` (the app's orphan wish).
struct Departures<K, Key, V> {
    describe: fn(&K) -> (Key, V),
    /// Each object as last seen.
    seen: HashMap<Key, (Option<String>, V)>,
    /// The list in progress, from `Init` to `InitDone`.
    relist: Option<HashMap<Key, (Option<String>, V)>>,
}

impl<K: ResourceExt, Key: Hash + Eq + Clone, V> Departures<K, Key, V> {
    fn new(describe: fn(&K) -> (Key, V)) -> Self {
        Self {
            describe,
            seen: HashMap::new(),
            relist: None,
        }
    }

    fn entry(&self, object: &K) -> (Key, (Option<String>, V)) {
        let (key, value) = (self.describe)(object);
        (key, (object.uid(), value))
    }

    /// Takes in one event; returns the objects it shows gone.
    fn gone(&mut self, event: &watcher::Event<K>) -> Vec<(Key, V)> {
        match event {
            watcher::Event::Init => self.relist = Some(HashMap::new()),
            watcher::Event::InitApply(object) => {
                let (key, entry) = self.entry(object);
                if let Some(listed) = &mut self.relist {
                    listed.insert(key, entry);
                }
            }
            watcher::Event::InitDone => {
                if let Some(listed) = self.relist.take() {
                    let before = std::mem::replace(&mut self.seen, listed);
                    return (before.into_iter())
                        .filter(|(key, (uid, _))| {
                            self.seen.get(key).is_none_or(|(now, _)| now != uid)
                        })
                        .map(|(key, (_, value))| (key, value))
                        .collect();
                }
            }
            watcher::Event::Apply(object) => {
                let (key, entry) = self.entry(object);
                self.seen.insert(key, entry);
            }
            watcher::Event::Delete(object) => {
                let (key, (_, value)) = self.entry(object);
                self.seen.remove(&key);
                return vec![(key, value)];
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_crds::federated::ORPHAN_ANNOTATION;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;

    fn named(name: &str, uid: &str, orphan: bool) -> FederatedMyApp {
        let mut a: FederatedMyApp = serde_yaml::from_str(&format!(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {{name: {name}, namespace: n, uid: {uid}}}\nspec: {{}}\n"
        ))
        .unwrap();
        if orphan {
            a.annotations_mut()
                .insert(ORPHAN_ANNOTATION.into(), "true".into());
        }
        a
    }

    type AppDepartures = Departures<FederatedMyApp, AppKey, bool>;

    fn departures() -> AppDepartures {
        Departures::new(|app: &FederatedMyApp| (key_of(app), orphans(app)))
    }

    fn list(d: &mut AppDepartures, apps: &[FederatedMyApp]) -> Vec<(AppKey, bool)> {
        let mut gone = d.gone(&watcher::Event::Init);
        for a in apps {
            gone.extend(d.gone(&watcher::Event::InitApply(a.clone())));
        }
        gone.extend(d.gone(&watcher::Event::InitDone));
        gone.sort_by_key(|(key, _)| key.to_string());
        gone
    }

    /// An app deleted (finalizer removed by hand) while the watch was down is in no
    /// event: the re-list that no longer holds it must report it, with its orphan wish;
    /// the first list reports nothing, and neither does a list cut short.
    #[test]
    fn a_relist_reports_the_apps_it_no_longer_holds() {
        let key = |name: &str| AppKey::new("n", name);
        let mut d = departures();
        let (a, b, c) = (
            named("a", "1", false),
            named("b", "2", true),
            named("c", "3", false),
        );
        assert_eq!(list(&mut d, &[a.clone(), b.clone()]), vec![]);
        assert_eq!(d.gone(&watcher::Event::Apply(c.clone())), vec![]);
        // A list that restarts before its end reports nothing of its partial view.
        d.gone(&watcher::Event::Init);
        d.gone(&watcher::Event::InitApply(a.clone()));
        let gone = list(&mut d, std::slice::from_ref(&a));
        assert_eq!(gone, vec![(key("b"), true), (key("c"), false)]);
        // Once reported, never again; a Delete event reports its app once.
        assert_eq!(list(&mut d, std::slice::from_ref(&a)), vec![]);
        assert_eq!(
            d.gone(&watcher::Event::Delete(a.clone())),
            vec![(key("a"), false)]
        );
        assert_eq!(list(&mut d, &[]), vec![]);
    }

    /// Deleted and created again under the same name while the watch was down: the
    /// re-list holds the name, but not the object it knew.
    #[test]
    fn a_relist_reports_an_app_replaced_under_the_same_name() {
        let mut d = departures();
        list(&mut d, &[named("a", "1", true), named("b", "2", false)]);
        let gone = list(&mut d, &[named("a", "9", false), named("b", "2", false)]);
        assert_eq!(gone, vec![(AppKey::new("n", "a"), true)]);
    }

    fn at(mut app: FederatedMyApp, generation: i64) -> FederatedMyApp {
        app.metadata.generation = Some(generation);
        app
    }

    fn names(apps: Vec<FederatedMyApp>) -> Vec<(String, Option<i64>)> {
        apps.into_iter()
            .map(|a| (a.name_any(), a.metadata.generation))
            .collect()
    }

    /// Each new object or generation once; a list's only at its InitDone, and a list
    /// that restarts before its end hands on nothing of its partial view.
    #[test]
    fn applied_apps_are_handed_on_once_and_a_lists_at_its_end() {
        use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
        let (a, b) = (named("a", "1", false), named("b", "2", false));
        let mut applied = Applied::default();
        assert!(applied.take(Init).is_empty());
        assert!(applied.take(InitApply(at(a.clone(), 1))).is_empty());
        assert!(applied.take(InitApply(at(b.clone(), 1))).is_empty());
        let first = names(applied.take(InitDone));
        assert_eq!(first, [("a".into(), Some(1)), ("b".into(), Some(1))]);
        assert!(
            applied.take(Apply(at(a.clone(), 1))).is_empty(),
            "same generation"
        );
        assert_eq!(
            names(applied.take(Apply(at(a.clone(), 2)))),
            [("a".into(), Some(2))]
        );
        // A re-list that restarts, then completes without b and with a's generation 3.
        applied.take(Init);
        assert!(applied.take(InitApply(at(a.clone(), 3))).is_empty());
        applied.take(Init);
        assert!(applied.take(InitApply(at(a.clone(), 3))).is_empty());
        assert_eq!(names(applied.take(InitDone)), [("a".into(), Some(3))]);
        // b, forgotten when the list no longer held it, is new when it comes back; so
        // is another object under a's name, and a after its Delete.
        assert_eq!(
            names(applied.take(Apply(at(b.clone(), 1)))),
            [("b".into(), Some(1))]
        );
        let a_again = at(named("a", "9", false), 3);
        assert_eq!(
            names(applied.take(Apply(a_again.clone()))),
            [("a".into(), Some(3))]
        );
        applied.take(Delete(a_again.clone()));
        assert_eq!(
            names(applied.take(Apply(a_again.clone()))),
            [("a".into(), Some(3))]
        );
        // The hub's finalizer arriving hands it on (the planner sent nothing before);
        // its removal at the end of a deletion does not.
        let mut held = a_again;
        held.finalizers_mut()
            .push(crate::controller::FINALIZER.into());
        assert_eq!(
            names(applied.take(Apply(held.clone()))),
            [("a".into(), Some(3))]
        );
        assert!(applied.take(Apply(held.clone())).is_empty(), "once");
        let mut deleting = at(held, 4);
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        assert_eq!(
            names(applied.take(Apply(deleting.clone()))),
            [("a".into(), Some(4))]
        );
        deleting.finalizers_mut().clear();
        assert!(
            applied.take(Apply(deleting)).is_empty(),
            "released: no news"
        );
    }

    /// Rule 2 for the grants: nothing is planned, and no agent admitted, until the
    /// ClusterGrants have listed (a strict hub would read a namespace whose grant is not
    /// listed yet as granted nothing); then the grants are planned with, and a grant
    /// deleted plans its namespace again and keeps what runs.
    #[tokio::test]
    async fn nothing_is_planned_before_the_grants_have_listed() {
        use flotilla_common::http::Readiness;
        use flotilla_plan::ClusterPlan;
        use watcher::Event::{Delete, Init, InitApply, InitDone};
        let (apps, apps_writer) = kube::runtime::reflector::store::<FederatedMyApp>();
        let (members, members_writer) = kube::runtime::reflector::store::<MemberCluster>();
        let (grants, grants_writer) = kube::runtime::reflector::store::<ClusterGrant>();
        let (app_tx, app_rx) = futures::channel::mpsc::unbounded();
        let (member_tx, member_rx) = futures::channel::mpsc::unbounded();
        let (grant_tx, grant_rx) = futures::channel::mpsc::unbounded();
        let (app_events, apps_listed) =
            flotilla_common::listed::track(kube::runtime::reflector(apps_writer, app_rx));
        let (member_events, members_listed) =
            flotilla_common::listed::track(kube::runtime::reflector(members_writer, member_rx));
        let (grant_events, grants_listed) =
            flotilla_common::listed::track(kube::runtime::reflector(grants_writer, grant_rx));
        let drained_apps = tokio::spawn(app_events.for_each(|_| async {}));
        let drained_members = tokio::spawn(member_events.for_each(|_| async {}));
        let (grants_changed, grants_rx) = watch::channel(());
        let grant_watch = tokio::spawn(watch_grants(grant_events, grants_changed));
        let (_members_changed, members_rx) = watch::channel(MemberChanges::default());
        let (_triggers, triggers_rx) = mpsc::unbounded_channel();
        let (_leading, leading) = watch::channel(true);
        let status = Arc::new(StatusBoard::default());
        let planner = Planner {
            admission: Admission::default(),
            dispatcher: Arc::new(Dispatcher::default()),
            status: status.clone(),
            notices: Arc::new(Notices::new(leading).0),
            apps,
            members,
            grants,
            require_grant: true,
        };
        let inputs = Inputs {
            apps: triggers_rx,
            members: members_rx,
            grants: grants_rx,
            apps_listed,
            members_listed,
            grants_listed,
        };
        let readiness = Readiness::default();
        let shutdown = CancellationToken::new();
        let run =
            tokio::spawn(planner.run(inputs, readiness.gate("initial-plan"), shutdown.clone()));

        let app: FederatedMyApp = serde_yaml::from_str(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: web, namespace: team, uid: u1, generation: 1}\n\
             spec:\n  placement: {clusterSelector: {}}\n  template: {spec: {replicas: 1, image: 'nginx:1.27'}}\n",
        )
        .unwrap();
        let grant: ClusterGrant = serde_yaml::from_str(
            "apiVersion: flotilla.io/v1alpha1\nkind: ClusterGrant\nmetadata: {name: g, namespace: team, uid: g1}\nspec: {clusters: [c1]}\n",
        )
        .unwrap();
        for event in [Init, InitApply(app), InitDone] {
            app_tx.unbounded_send(Ok(event)).unwrap();
        }
        for c in ["c1", "c2"] {
            let mc = MemberCluster::new(c, Default::default());
            member_tx.unbounded_send(Ok(InitApply(mc))).unwrap();
        }
        member_tx.unbounded_send(Ok(InitDone)).unwrap();
        grant_tx.unbounded_send(Ok(Init)).unwrap();
        grant_tx
            .unbounded_send(Ok(InitApply(grant.clone())))
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let key = AppKey::new("team", "web");
        assert_eq!(readiness.waiting(), ["initial-plan"], "admitted agents");
        assert!(
            status.planned(&key).is_none(),
            "planned before the grants listed"
        );

        grant_tx.unbounded_send(Ok(InitDone)).unwrap();
        let planned = |want: fn(&AppPlan) -> bool| {
            let (status, key) = (status.clone(), key.clone());
            async move {
                for _ in 0..100 {
                    if status.planned(&key).is_some_and(|p| want(&p.plan)) {
                        return true;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                false
            }
        };
        let granted = |p: &AppPlan| {
            p.clusters["c1"].rendered().is_some()
                && matches!(p.clusters["c2"], ClusterPlan::Keep(_))
        };
        assert!(planned(granted).await, "c1 alone, as granted");
        assert!(
            readiness.waiting().is_empty(),
            "agents admitted once planned"
        );

        grant_tx.unbounded_send(Ok(Delete(grant))).unwrap();
        let kept = |p: &AppPlan| {
            let desired = p.desired();
            p.placement_error
                .as_ref()
                .is_some_and(|e| e.reason() == "NotGranted")
                && desired.len() == 2
                && desired.values().all(|d| *d == Desired::Keep)
        };
        assert!(
            planned(kept).await,
            "the last grant gone: nothing granted, all kept"
        );
        shutdown.cancel();
        run.await.unwrap().unwrap();
        grant_watch.abort();
        for task in [drained_apps, drained_members] {
            task.abort();
        }
    }

    /// A re-list's new generation reaches the planner only once the store shows it: a
    /// trigger taken earlier would plan the old object, and none would follow.
    #[tokio::test]
    async fn a_relisted_app_is_announced_once_the_store_shows_it() {
        use watcher::Event::{Init, InitApply, InitDone};
        let (store, writer) = kube::runtime::reflector::store::<FederatedMyApp>();
        let (events, rx) = futures::channel::mpsc::unbounded();
        let (triggers, mut triggered) = mpsc::unbounded_channel();
        let (controller, _applied) = mpsc::unbounded_channel();
        let watch = tokio::spawn(watch_apps(
            kube::runtime::reflector(writer, rx),
            triggers,
            controller,
        ));
        let a = named("a", "1", false);
        let send = |event| events.unbounded_send(Ok(event)).unwrap();
        for event in [Init, InitApply(at(a.clone(), 1)), InitDone] {
            send(event);
        }
        assert!(matches!(triggered.recv().await, Some(Trigger::Applied(_))));
        // The watch restarts; the app changed meanwhile.
        send(Init);
        send(InitApply(at(a.clone(), 2)));
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            triggered.try_recv().is_err(),
            "announced before the store shows it"
        );
        send(InitDone);
        assert!(matches!(triggered.recv().await, Some(Trigger::Applied(_))));
        let shown = store.get(&ObjectRef::new("a").within("n")).unwrap();
        assert_eq!(shown.metadata.generation, Some(2));
        watch.abort();
    }
}
