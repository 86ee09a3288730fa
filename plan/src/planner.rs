//! Planner: which apps each trigger plans again, and what each plan writes. The hub's
//! `planner` task is the one writer of the index: it feeds this core one trigger at a
//! time with one snapshot of the registered clusters, taken after its last await, so
//! that a plan made from older clusters can never land after one made from newer ones
//! (a member list read before an await once planned a joining cluster out again, and
//! sent it a Delete: DESIGN.md rule 1). Pure: the apps, the clusters, the time and the
//! effects are passed in.
//!
//! - An app applied (a new generation, its deletion included) is planned from the app as
//!   the store holds it now: an app being deleted is planned as a deletion (every cluster
//!   its spec places it on is waited for, rule 3), looked at again every
//!   [`DELETION_RECHECK`] until every cluster confirmed.
//! - An app gone from the host (a Delete event, or missing from a re-list) is dropped:
//!   its MyApps are deleted, or released with `kubefed.io/orphan`, even if its finalizer
//!   was removed by hand. A new object of the same name takes over what the old one
//!   placed, and calls off its deletion: its MyApps are the host's wish again (rule 1).
//!   Releases (`kubefed.io/orphan`) go on, and the new object waits for them.
//! - A change of what placement reads of the registered clusters plans the apps it can
//!   affect (those whose placement or namespace's grants take a moved cluster before or
//!   after, and those whose plan failed as a whole; every app the first time), then
//!   says which clusters every app was planned for (agents are admitted only then). It
//!   is looked for at every trigger, so that no plan uses clusters the index was not
//!   told about; a change of capacity alone plans the apps divided by capacity.
//! - A change of the ClusterGrants plans every app of each namespace whose grants
//!   changed, with the clusters of the same snapshot. It too is looked for at every
//!   trigger, so that no plan uses grants other than the latest the hub listed. A grant
//!   withdrawn keeps what runs ([`crate::grants`]).
//! - A recheck plans the apps whose plan asked to be looked at again by now (a grace
//!   period, a rollout's soak or progress deadline that ends).
//! - A progressive app ([`crate::rollout`]) is planned again when what its agents report
//!   changes the revision or readiness of one of its clusters (`Observed`).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_crds::FederatedMyApp;
use flotilla_crds::federated::{HUB_FINALIZER, ORPHAN_ANNOTATION, Placement, SchedulingMode};
use flotilla_crds::member::ClusterCapacity;
use kube::ResourceExt;
use kube::core::SelectorExt;

use crate::admission::Admission;
use crate::grants::Grants;
use crate::index::{AppKey, Desired};
use crate::placement::{ClusterName, Labels, Member, Members};
use crate::plan::{AppPlan, plan, plan_each};
use crate::rollout::{self, Observed};

/// Apps planned at once on every core ([`plan_each`]) before their plans are taken one
/// after another: enough to keep the cores busy, few enough that a re-plan holds few new
/// plans beside the ones they replace.
pub const PLAN_CHUNK: usize = 64;

/// How often an app is planned again while it waits: a deletion for clusters to confirm,
/// a new object for the deletion of an older one of the same name.
pub const DELETION_RECHECK: Duration = Duration::from_secs(1);

/// Something that may change what apps want.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trigger {
    /// The app was created or its generation changed (its deletion included).
    Applied(AppKey),
    /// The app left the host: a Delete event, or missing from a re-list (or listed as
    /// another object under the same name). `orphan`: its `kubefed.io/orphan` as last
    /// seen.
    Gone { key: AppKey, orphan: bool },
    /// The registered clusters may have changed.
    Members,
    /// The ClusterGrants may have changed.
    Grants,
    /// Some plan asked to be looked at again by now.
    Recheck,
    /// What the agents report of a progressive app changed the revision or readiness of
    /// one of its clusters: its rollout may move.
    Observed(AppKey),
}

/// The FederatedMyApps as the host lists them now.
pub trait Apps {
    fn get(&self, key: &AppKey) -> Option<Arc<FederatedMyApp>>;
    fn all(&self) -> Vec<Arc<FederatedMyApp>>;
}

/// A fixed list of apps, as tests and benchmarks hold them.
impl Apps for Vec<Arc<FederatedMyApp>> {
    fn get(&self, key: &AppKey) -> Option<Arc<FederatedMyApp>> {
        self.iter().find(|a| key_of(a) == *key).cloned()
    }
    fn all(&self) -> Vec<Arc<FederatedMyApp>> {
        self.clone()
    }
}

/// Where plans go: the index (through the hub's dispatcher, which pushes its changes to
/// agents) and the status board.
pub trait Effects {
    /// Makes `desired` the app's desired state ([`crate::index::compact::CompactIndex::set_app`]); false
    /// while the deletion of an earlier object of the same name holds it back.
    fn set_app(
        &mut self,
        key: &AppKey,
        generation: Option<i64>,
        desired: BTreeMap<ClusterName, Desired>,
    ) -> bool;
    /// Deletes the app where it is or may be; returns the clusters still to confirm.
    fn delete_app(&mut self, key: &AppKey, orphan: bool, placed: &[String]) -> Vec<String>;
    /// The app's object is gone; `replaced`: another of the same name is listed.
    fn drop_app(&mut self, key: &AppKey, orphan: bool, replaced: bool);
    /// Every app was planned for exactly these registered clusters.
    fn planned_for(&mut self, registered: BTreeSet<String>);
    /// The app's plan for status (and, when its errors changed, Events); `deleting_on`:
    /// the clusters a deletion waits for.
    fn publish(&mut self, key: &AppKey, plan: AppPlan, deleting_on: Option<Vec<String>>);
    /// The app is gone: status forgets it.
    fn forget(&mut self, key: &AppKey);
    /// What the agents report of the app, for its rollout's gate (asked only of a
    /// progressive app).
    fn observed(&self, key: &AppKey) -> Observed;
}

/// The key of a FederatedMyApp: its namespace and name.
pub fn key_of(app: &FederatedMyApp) -> AppKey {
    AppKey::new(
        app.namespace().unwrap_or_else(|| "default".into()),
        app.name_any(),
    )
}

/// Whether the app asks its MyApps to be released, not deleted, with it.
pub fn orphans(app: &FederatedMyApp) -> bool {
    app.annotations()
        .get(ORPHAN_ANNOTATION)
        .is_some_and(|v| v == "true")
}

/// Whether the hub's finalizer is on the app: nothing is sent to a member before it is.
pub fn held_by_hub(app: &FederatedMyApp) -> bool {
    app.finalizers().iter().any(|f| f == HUB_FINALIZER)
}

fn by_capacity(app: &FederatedMyApp) -> bool {
    let scheduling = app.spec.placement.replica_scheduling.as_ref();
    scheduling.is_some_and(|r| r.mode == SchedulingMode::Capacity)
}

/// One cluster's [`shape`]: its name, labels, cordon, and NotReady or not.
pub type ShapeEntry = (ClusterName, Labels, bool, bool);

/// What placement and scheduling read of each registered cluster besides its capacity.
/// Readiness counts as ready or not: how long a cluster has been NotReady moves with the
/// clock, and each plan asks to be looked at again when a grace period ends.
pub fn shape(members: &Members) -> Vec<ShapeEntry> {
    members
        .iter()
        .map(|(name, m)| {
            let (labels, unschedulable, not_ready) = shape_of(m);
            (name.clone(), labels.clone(), unschedulable, not_ready)
        })
        .collect()
}

/// The fields of one cluster that make its [`ShapeEntry`], in one place for [`shape`]
/// and [`has_shape`] both.
fn shape_of(m: &Member) -> (&Labels, bool, bool) {
    (&m.labels, m.unschedulable, m.not_ready_for.is_some())
}

/// Whether `members` have this [`shape`], compared where they stand: every trigger
/// looks, and building the shape of 10,000 clusters to compare took ~12 ms a trigger.
fn has_shape(members: &Members, shape: &[ShapeEntry]) -> bool {
    members.len() == shape.len()
        && members.iter().zip(shape).all(|((name, m), entry)| {
            let (was_name, labels, unschedulable, not_ready) = entry;
            name == was_name && shape_of(m) == (labels, *unschedulable, *not_ready)
        })
}

/// Each registered cluster's capacity, in name order.
pub fn capacity(members: &Members) -> Vec<Option<ClusterCapacity>> {
    members.values().map(|m| m.capacity.clone()).collect()
}

/// One registered cluster whose shape moved: its labels before and after (`None`: not
/// registered then).
#[derive(Debug)]
struct Moved<'a> {
    name: &'a str,
    before: Option<&'a Labels>,
    after: Option<&'a Labels>,
}

impl<'a> Moved<'a> {
    /// Its labels before and after, where it was registered.
    fn labels(&self) -> impl Iterator<Item = &'a Labels> + Clone + use<'a> {
        self.before.into_iter().chain(self.after)
    }
}

/// The clusters whose shape differs between `before` and `after` (both in name order).
fn moved<'a>(before: &'a [ShapeEntry], after: &'a [ShapeEntry]) -> Vec<Moved<'a>> {
    let index = |shape: &'a [ShapeEntry]| -> HashMap<&'a str, &'a ShapeEntry> {
        shape.iter().map(|e| (&*e.0, e)).collect()
    };
    let (was, is) = (index(before), index(after));
    let names: BTreeSet<&str> = was.keys().chain(is.keys()).copied().collect();
    names
        .into_iter()
        .filter(|name| was.get(name) != is.get(name))
        .map(|name| Moved {
            name,
            before: was.get(name).map(|e| &e.1),
            after: is.get(name).map(|e| &e.1),
        })
        .collect()
}

/// Whether `placement` takes the moved cluster before or after its move. A selector
/// that does not parse fails the app's plan as a whole (it is planned anyway).
fn may_place(placement: &Placement, moved: &Moved<'_>) -> bool {
    if let Some(named) = &placement.clusters {
        return named.iter().any(|c| c.name == moved.name);
    }
    let Some(selector) = &placement.cluster_selector else {
        return false;
    };
    let Ok(selector) = crate::placement::parse_selector(selector, "") else {
        return true;
    };
    [moved.before, moved.after]
        .into_iter()
        .flatten()
        .any(|labels| selector.matches(labels))
}

/// What the registered clusters were when every app was last planned: their shape,
/// and their capacity when the apps divided by capacity were.
#[derive(Debug, PartialEq)]
struct PlannedFor {
    shape: Vec<ShapeEntry>,
    capacity: Vec<Option<ClusterCapacity>>,
}

/// When each app wants to be planned again.
#[derive(Debug, Default)]
struct Rechecks {
    due: BTreeSet<(Instant, AppKey)>,
    at: HashMap<AppKey, Instant>,
}

impl Rechecks {
    fn set(&mut self, key: &AppKey, at: Option<Instant>) {
        if let Some(old) = self.at.remove(key) {
            self.due.remove(&(old, key.clone()));
        }
        if let Some(at) = at {
            self.due.insert((at, key.clone()));
            self.at.insert(key.clone(), at);
        }
    }

    /// Takes the apps due by `now`.
    fn take_due(&mut self, now: Instant) -> Vec<AppKey> {
        let mut keys = Vec::new();
        while let Some((at, _)) = self.due.first()
            && *at <= now
        {
            let (_, key) = self.due.pop_first().expect("just looked");
            self.at.remove(&key);
            keys.push(key);
        }
        keys
    }

    fn next(&self) -> Option<Instant> {
        self.due.first().map(|(at, _)| *at)
    }
}

/// The planner's state: what the clusters were when every app was last planned, the
/// grants every app was last planned with, and when each app wants another look; and
/// what it admits.
#[derive(Debug, Default)]
pub struct Planner {
    admission: Admission,
    planned_for: Option<PlannedFor>,
    grants: Grants,
    rechecks: Rechecks,
    /// Apps whose last plan failed as a whole (it keeps every registered cluster).
    unplanned: HashSet<AppKey>,
}

impl Planner {
    /// A planner that plans only the apps `admission` admits.
    pub fn new(admission: Admission) -> Self {
        Self {
            admission,
            ..Self::default()
        }
    }

    /// Plans what `trigger` may have changed, with the apps, the registered clusters and
    /// the grants as they are now. Whatever the trigger, clusters of another shape than
    /// every app was planned for are planned for first (the apps they can affect), so
    /// that no plan uses clusters the index was not told about; then the apps of each
    /// namespace whose grants changed.
    pub fn handle(
        &mut self,
        trigger: Trigger,
        apps: &impl Apps,
        (members, grants): (&Members, &Grants),
        now: Instant,
        fx: &mut impl Effects,
    ) {
        let replanned = self.plan_for_shape(apps, members, grants, now, fx);
        let regranted = self.plan_for_grants(apps, members, grants, now, fx);
        let members = (members, grants);
        match trigger {
            Trigger::Applied(key) | Trigger::Observed(key) => {
                let planned = replanned.contains(&key) || regranted.contains(&key.namespace);
                if let Some(app) = apps.get(&key).filter(|_| !planned) {
                    self.plan_app(&app, members, now, fx);
                }
            }
            Trigger::Gone { key, orphan } => {
                self.rechecks.set(&key, None);
                self.unplanned.remove(&key);
                let replacement = apps.get(&key);
                fx.drop_app(&key, orphan, replacement.is_some());
                fx.forget(&key);
                if let Some(app) = replacement {
                    self.plan_app(&app, members, now, fx);
                }
            }
            Trigger::Members => self.plan_for_capacity(apps, members, now, fx),
            // Planned above, as every trigger is looked at for it.
            Trigger::Grants => {}
            Trigger::Recheck => {
                let due = self.rechecks.take_due(now);
                let due: Vec<_> = due.iter().filter_map(|key| apps.get(key)).collect();
                self.plan_apps(&due, members, now, fx);
            }
        }
    }

    /// When the earliest plan wants another look.
    pub fn next_recheck(&self) -> Option<Instant> {
        self.rechecks.next()
    }

    /// Plans the apps a change of what placement reads of the registered clusters can
    /// affect (every app the first time), then says which clusters every app was planned
    /// for: a cluster that left is no longer waited for, a new one's agent may be
    /// admitted. Returns the apps it planned.
    ///
    /// A plan reads the registered clusters through placement and through its
    /// namespace's grants, each of which takes or leaves each cluster on its own
    /// ([`crate::placement::place`], [`Grants::granted`]); everything after them
    /// (schedule, render, rollout) reads the placed clusters. So an app is affected by a
    /// moved cluster only if its placement ([`may_place`]) or a grant of its namespace
    /// ([`Grants::taking`]) takes that cluster before or after the move, or if it
    /// could not be planned at all, since such a plan keeps every registered cluster
    /// ([`AppPlan::placement_error`]). The namespaces whose grants take a moved cluster
    /// are found once per change, not once per app.
    fn plan_for_shape(
        &mut self,
        apps: &impl Apps,
        members: &Members,
        grants: &Grants,
        now: Instant,
        fx: &mut impl Effects,
    ) -> HashSet<AppKey> {
        if (self.planned_for.as_ref()).is_some_and(|p| has_shape(members, &p.shape)) {
            return HashSet::new();
        }
        let shape = shape(members);
        let before = self.planned_for.take();
        let moved = before.as_ref().map(|p| moved(&p.shape, &shape));
        if moved.is_none() {
            // Every app is planned with these grants.
            self.grants = grants.clone();
        }
        // The namespaces a grant of which takes a moved cluster before or after its move.
        let taken: BTreeSet<&str> = (moved.iter().flatten())
            .flat_map(|m| grants.taking(m.name, m.labels()))
            .collect();
        let (planned, affected): (HashSet<AppKey>, Vec<_>) = (apps.all().into_iter())
            .map(|app| (key_of(&app), app))
            .filter(|(key, app)| {
                moved.as_ref().is_none_or(|moved| {
                    self.unplanned.contains(key)
                        || taken.contains(key.namespace.as_str())
                        || moved.iter().any(|m| may_place(&app.spec.placement, m))
                })
            })
            .unzip();
        self.plan_apps(&affected, (members, grants), now, fx);
        fx.planned_for(members.keys().map(|c| c.to_string()).collect());
        self.planned_for = Some(PlannedFor {
            shape,
            capacity: capacity(members),
        });
        planned
    }

    /// Plans the apps of each namespace whose grants changed; returns those namespaces.
    fn plan_for_grants(
        &mut self,
        apps: &impl Apps,
        members: &Members,
        grants: &Grants,
        now: Instant,
        fx: &mut impl Effects,
    ) -> BTreeSet<String> {
        let changed = grants.changed(&self.grants);
        if changed.is_empty() {
            return changed;
        }
        self.grants = grants.clone();
        let apps: Vec<_> = (apps.all().into_iter())
            .filter(|a| changed.contains(&key_of(a).namespace))
            .collect();
        self.plan_apps(&apps, (members, grants), now, fx);
        changed
    }

    /// Plans the apps divided by capacity when the clusters' capacity changed.
    fn plan_for_capacity(
        &mut self,
        apps: &impl Apps,
        members: (&Members, &Grants),
        now: Instant,
        fx: &mut impl Effects,
    ) {
        let capacity = capacity(members.0);
        match &mut self.planned_for {
            Some(p) if p.capacity != capacity => p.capacity = capacity,
            _ => return,
        }
        let apps: Vec<_> = apps.all().into_iter().filter(|a| by_capacity(a)).collect();
        self.plan_apps(&apps, members, now, fx);
    }

    /// [`Self::plan_app`] for each app, in this order, each plan itself made on every
    /// core a chunk at a time: only what a plan does to the index and the board is done
    /// one app after another.
    fn plan_apps(
        &mut self,
        apps: &[Arc<FederatedMyApp>],
        (members, grants): (&Members, &Grants),
        now: Instant,
        fx: &mut impl Effects,
    ) {
        for chunk in apps.chunks(PLAN_CHUNK) {
            let plans = plan_each(chunk, members, &self.admission, grants);
            for (app, plan) in chunk.iter().zip(plans) {
                self.take_plan(app, plan, (members, grants), now, fx);
            }
        }
    }

    /// Plans one app into the index and the board, and notes when to look again.
    fn plan_app(
        &mut self,
        app: &FederatedMyApp,
        (members, grants): (&Members, &Grants),
        now: Instant,
        fx: &mut impl Effects,
    ) {
        let plan = plan(app, members, &self.admission, grants);
        self.take_plan(app, plan, (members, grants), now, fx);
    }

    /// Writes `plan`, just made for `app` from these clusters and grants, into the index
    /// and the board, and notes when to look again.
    fn take_plan(
        &mut self,
        app: &FederatedMyApp,
        mut plan: AppPlan,
        (members, grants): (&Members, &Grants),
        now: Instant,
        fx: &mut impl Effects,
    ) {
        let key = key_of(app);
        match plan.placement_error {
            Some(_) => self.unplanned.insert(key.clone()),
            None => self.unplanned.remove(&key),
        };
        let recheck = if app.metadata.deletion_timestamp.is_some() {
            // Every registered cluster the spec places it on must confirm, even one this
            // hub never saw hold it (after a restart, say).
            let placed: Vec<String> = plan.desired().into_keys().map(|c| c.to_string()).collect();
            let waiting = fx.delete_app(&key, orphans(app), &placed);
            let recheck = (!waiting.is_empty()).then_some(DELETION_RECHECK);
            fx.publish(&key, plan, Some(waiting));
            recheck
        } else {
            // A deletion is never held; a live app's new revision waits for its wave.
            let gated = match rollout::progressive(app) {
                true => {
                    let observed = fx.observed(&key);
                    let recheck = rollout::gate(app, &mut plan, members, &observed, now);
                    rollout::resize_held(app, &mut plan, &observed, |stable| {
                        crate::plan::plan(stable, members, &self.admission, grants)
                    });
                    recheck
                }
                false => None,
            };
            let generation = app.metadata.generation;
            let desired = match held_by_hub(app) {
                true => plan.desired(),
                // Nothing is sent before the hub's finalizer holds the object (rule 3):
                // one deleted before then goes at once, and a hub that restarts meanwhile
                // never learns that its MyApps were to be released, not collected. Every
                // cluster it places the app on keeps what it has (a finalizer removed by
                // hand takes nothing away, and an agent's sync collects nothing of it);
                // the finalizer's arrival plans it again.
                false => (plan.desired().into_keys())
                    .map(|cluster| (cluster, Desired::Keep))
                    .collect(),
            };
            let mut taken = fx.set_app(&key, generation, desired.clone());
            if !taken {
                // This object is live: the deletion the index holds is an earlier one's
                // (deleted without our finalizer). The host wants these MyApps again
                // (rule 1): unless that one is releasing them, this plan takes over.
                fx.drop_app(&key, false, true);
                taken = fx.set_app(&key, generation, desired);
            }
            // A grace period that ends, or replacements that may be Ready, change the
            // division with no change to the app.
            // A soak or a progress deadline that ends moves the rollout on.
            let recheck = match taken {
                true => {
                    let scheduled = plan.schedule.as_ref().and_then(|s| s.recheck_after);
                    scheduled.into_iter().chain(gated).min()
                }
                false => Some(DELETION_RECHECK),
            };
            fx.publish(&key, plan, None);
            recheck
        };
        self.rechecks.set(&key, recheck.map(|after| now + after));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::Seen;
    use flotilla_crds::ClusterGrant;
    use serde_json::json;

    struct One(Arc<FederatedMyApp>);

    impl Apps for One {
        fn get(&self, key: &AppKey) -> Option<Arc<FederatedMyApp>> {
            (key_of(&self.0) == *key).then(|| self.0.clone())
        }
        fn all(&self) -> Vec<Arc<FederatedMyApp>> {
            vec![self.0.clone()]
        }
    }

    /// The last desired set and rollout state, and what the agents report.
    #[derive(Default)]
    struct Fx {
        desired: BTreeMap<ClusterName, Desired>,
        state: Option<String>,
        observed: Observed,
    }

    impl Effects for Fx {
        fn set_app(
            &mut self,
            _: &AppKey,
            _: Option<i64>,
            d: BTreeMap<ClusterName, Desired>,
        ) -> bool {
            self.desired = d;
            true
        }
        fn delete_app(&mut self, _: &AppKey, _: bool, _: &[String]) -> Vec<String> {
            Vec::new()
        }
        fn drop_app(&mut self, _: &AppKey, _: bool, _: bool) {}
        fn planned_for(&mut self, _: BTreeSet<String>) {}
        fn publish(&mut self, _: &AppKey, plan: AppPlan, _: Option<Vec<String>>) {
            self.state = plan.rollout.map(|r| r.state);
        }
        fn forget(&mut self, _: &AppKey) {}
        fn observed(&self, _: &AppKey) -> Observed {
            self.observed.clone()
        }
    }

    /// Nothing is sent before the hub's finalizer is on the object (a copy sent before
    /// then is lost to a deletion: CI once saw an orphaning delete collected that way
    /// across a hub SIGKILL), and a finalizer removed by hand from a live app takes
    /// nothing away: its clusters keep what they have.
    #[test]
    fn nothing_is_placed_before_the_hubs_finalizer_holds_the_app() {
        let yaml = |finalizers: &str| {
            format!(
                "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {{name: web, namespace: prod, generation: 1{finalizers}}}\n\
                 spec:\n  placement: {{clusters: [{{name: c1}}]}}\n  template: {{spec: {{replicas: 1, image: 'nginx:2'}}}}\n"
            )
        };
        let bare: FederatedMyApp = serde_yaml::from_str(&yaml("")).unwrap();
        let held: FederatedMyApp =
            serde_yaml::from_str(&yaml(", finalizers: [core.kubefed.io/flotilla-hub]")).unwrap();
        let key = key_of(&bare);
        let members: Members = [("c1".into(), Default::default())].into();
        let (mut planner, mut fx, t0) = (Planner::default(), Fx::default(), Instant::now());
        let mut plan_with = |app: &FederatedMyApp, fx: &mut Fx| {
            let apps = One(Arc::new(app.clone()));
            planner.handle(
                Trigger::Applied(key.clone()),
                &apps,
                (&members, &Grants::default()),
                t0,
                fx,
            );
        };
        // Kept, not sent: whatever c1 may hold stays, and nothing reaches it.
        plan_with(&bare, &mut fx);
        assert_eq!(fx.desired, [("c1".into(), Desired::Keep)].into());
        plan_with(&held, &mut fx);
        assert!(matches!(fx.desired["c1"], Desired::Apply(_)));
        plan_with(&bare, &mut fx);
        assert_eq!(fx.desired["c1"], Desired::Keep, "nothing taken away");
    }

    /// The planner gates a progressive app with what the agents report, plans it again
    /// on `Observed`, and asks to be woken when the soak ends.
    #[test]
    fn a_progressive_app_is_gated_replanned_on_reports_and_woken_after_the_soak() {
        let app: FederatedMyApp = serde_yaml::from_str(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: web, namespace: prod, generation: 1, finalizers: [core.kubefed.io/flotilla-hub]}\n\
             spec:\n  placement: {clusters: [{name: c1}, {name: c2}]}\n  template: {spec: {replicas: 1, image: 'nginx:2'}}\n  \
             rollout: {type: Progressive, maxConcurrency: 1, minSuccessSeconds: 30}\n",
        )
        .unwrap();
        let key = key_of(&app);
        let apps = One(Arc::new(app));
        let members: Members = ["c1", "c2"].map(|c| (c.into(), Default::default())).into();
        let (mut planner, mut fx, t0) = (Planner::default(), Fx::default(), Instant::now());
        planner.handle(
            Trigger::Applied(key.clone()),
            &apps,
            (&members, &Grants::default()),
            t0,
            &mut fx,
        );
        assert!(matches!(fx.desired["c1"], Desired::Apply(_)));
        assert_eq!(fx.desired["c2"], Desired::Keep, "held");
        assert_eq!(fx.state.as_deref(), Some("Progressing"));
        assert_eq!(
            planner.next_recheck(),
            None,
            "nothing to wait for but reports"
        );
        // c1 reports the revision Ready: woken when its soak ends, c2 opened then.
        let Desired::Apply(r) = &fx.desired["c1"] else {
            unreachable!()
        };
        let seen = Seen {
            hash: r.hash.as_str().into(),
            ready: true,
            degraded: None,
            apply_error: None,
            since: t0,
        };
        fx.observed.insert("c1".into(), seen);
        planner.handle(
            Trigger::Observed(key.clone()),
            &apps,
            (&members, &Grants::default()),
            t0,
            &mut fx,
        );
        assert_eq!(fx.desired["c2"], Desired::Keep);
        assert_eq!(planner.next_recheck(), Some(t0 + Duration::from_secs(30)));
        let later = t0 + Duration::from_secs(30);
        planner.handle(
            Trigger::Recheck,
            &apps,
            (&members, &Grants::default()),
            later,
            &mut fx,
        );
        assert!(matches!(fx.desired["c2"], Desired::Apply(_)));
        assert_eq!(fx.state.as_deref(), Some("Progressing"), "wave 2 of 2");
    }

    // ---- a member change plans only the apps it can affect ----

    /// Many apps; their latest desired state and plan, by key.
    #[derive(Default)]
    struct Recorded {
        desired: BTreeMap<AppKey, BTreeMap<ClusterName, Desired>>,
        plans: BTreeMap<AppKey, AppPlan>,
    }

    impl Effects for Recorded {
        fn set_app(
            &mut self,
            key: &AppKey,
            _: Option<i64>,
            d: BTreeMap<ClusterName, Desired>,
        ) -> bool {
            self.desired.insert(key.clone(), d);
            true
        }
        fn delete_app(&mut self, _: &AppKey, _: bool, _: &[String]) -> Vec<String> {
            Vec::new()
        }
        fn drop_app(&mut self, _: &AppKey, _: bool, _: bool) {}
        fn planned_for(&mut self, _: BTreeSet<String>) {}
        fn publish(&mut self, key: &AppKey, plan: AppPlan, _: Option<Vec<String>>) {
            self.plans.insert(key.clone(), plan);
        }
        fn forget(&mut self, _: &AppKey) {}
        fn observed(&self, _: &AppKey) -> Observed {
            Observed::default()
        }
    }

    /// Apps of every kind of placement: by name (one never registered), by selector,
    /// every cluster, none, a selector that does not parse, a division that may not fit.
    fn many() -> Vec<Arc<FederatedMyApp>> {
        let placements = [
            "{clusters: [{name: c0}, {name: c2}]}",
            "{clusters: [{name: c5}]}",
            "{clusterSelector: {matchLabels: {zone: a}}}",
            "{clusterSelector: {matchExpressions: [{key: zone, operator: In, values: [a, b]}]}}",
            "{clusterSelector: {}}",
            "{}",
            "{clusterSelector: {matchExpressions: [{key: zone, operator: Sideways}]}}",
            "{clusterSelector: {matchLabels: {zone: b}}, replicaScheduling: {mode: Weighted, totalReplicas: 12}}",
            "{clusterSelector: {matchLabels: {zone: c}}, replicaScheduling: {mode: Weighted, totalReplicas: 3}, spread: {minClusters: 2}}",
        ];
        let apps = placements.iter().enumerate().map(|(i, placement)| {
            let yaml = format!(
                "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {{name: app{i}, namespace: prod, generation: 1, finalizers: [core.kubefed.io/flotilla-hub]}}\n\
                 spec:\n  placement: {placement}\n  template: {{spec: {{replicas: 2, image: 'nginx:2'}}}}\n"
            );
            Arc::new(serde_yaml::from_str::<FederatedMyApp>(&yaml).expect("valid app"))
        });
        apps.collect()
    }

    /// A change to one cluster: registered with these labels, cordon and readiness, or
    /// gone.
    type Step = (u8, Option<(u8, bool, bool)>);

    /// `len` changes among six clusters, three zones, cordoned or not, ready or not.
    fn steps(len: std::ops::Range<usize>) -> impl proptest::strategy::Strategy<Value = Vec<Step>> {
        let change = (0u8..3, proptest::bool::ANY, proptest::bool::ANY);
        proptest::collection::vec((0u8..6, proptest::option::of(change)), len)
    }

    fn apply(members: &mut Members, (n, change): Step) {
        let name = format!("c{n}");
        match change {
            None => {
                members.remove(name.as_str());
            }
            Some((zone, cordoned, not_ready)) => {
                let zone = ["a", "b", "c"][zone as usize % 3];
                let member = Member {
                    labels: [("zone".to_owned(), zone.to_owned())].into(),
                    unschedulable: cordoned,
                    not_ready_for: not_ready.then_some(Duration::ZERO),
                    capacity: None,
                };
                members.insert(name.into(), member);
            }
        }
    }

    /// The grants of the apps' namespace: none (every cluster), one zone's, cluster c1
    /// by name, or none where one is required (no cluster).
    fn grants_of(n: u8) -> Grants {
        let spec = match n {
            0..3 => {
                let zone = ["a", "b", "c"][n as usize];
                json!({"clusterSelector": {"matchLabels": {"zone": zone}}})
            }
            3 => json!({"clusters": ["c1"]}),
            _ => return Grants::new(n == 5, []),
        };
        let grant = json!({
            "apiVersion": "flotilla.io/v1alpha1", "kind": "ClusterGrant",
            "metadata": {"name": "g", "namespace": "prod"}, "spec": spec,
        });
        let grant: ClusterGrant = serde_json::from_value(grant).expect("a ClusterGrant");
        Grants::new(false, [&grant])
    }

    proptest::proptest! {
        /// Comparing clusters with a shape where they stand says what building their
        /// shape and comparing it says: the same clusters, and the same with one thing
        /// of one cluster changed (readiness, cordon, labels, or the cluster itself).
        #[test]
        fn a_shape_compared_in_place_is_the_shape_compared(
            steps in steps(0..12),
            tweak in 0u8..6,
            which in 0usize..6,
        ) {
            let mut a = Members::new();
            for step in steps {
                apply(&mut a, step);
            }
            let mut b = a.clone();
            let name = b.keys().nth(which % b.len().max(1)).cloned();
            match (tweak, name.and_then(|n| b.get_mut(&n).map(|m| (n, m)))) {
                (1, Some((_, m))) => m.not_ready_for = m.not_ready_for.xor(Some(Duration::ZERO)),
                (2, Some((_, m))) => m.unschedulable = !m.unschedulable,
                (3, Some((_, m))) => {
                    m.labels.insert("zone".into(), "elsewhere".into());
                }
                (4, Some((n, _))) => {
                    b.remove(&n);
                }
                (5, _) => apply(&mut b, (7, Some((0, false, false)))),
                _ => {}
            }
            proptest::prop_assert_eq!(has_shape(&a, &shape(&b)), shape(&a) == shape(&b));
            proptest::prop_assert_eq!(has_shape(&b, &shape(&a)), shape(&a) == shape(&b));
        }

        /// After every change of the registered clusters, each app's desired state and
        /// plan are what planning every app from scratch gives, whatever the apps'
        /// namespace is granted: nothing asked, a zone, a cluster by name, or nothing.
        #[test]
        fn a_member_change_plans_exactly_the_apps_it_can_affect(
            steps in steps(1..25),
            grant in 0u8..6,
        ) {
            let apps = many();
            let grants = grants_of(grant);
            let t0 = Instant::now();
            let mut members = Members::new();
            let (mut planner, mut fx) = (Planner::default(), Recorded::default());
            for step in steps {
                apply(&mut members, step);
                planner.handle(Trigger::Members, &apps, (&members, &grants), t0, &mut fx);
                let mut fresh = Recorded::default();
                Planner::default().handle(Trigger::Members, &apps, (&members, &grants), t0, &mut fresh);
                proptest::prop_assert_eq!(&fx.plans, &fresh.plans);
                proptest::prop_assert_eq!(&fx.desired, &fresh.desired);
            }
        }
    }

    /// Plans made on every core are the plans made one by one, in the apps' order, over
    /// more apps than a chunk holds and whatever their namespace is granted.
    #[test]
    fn plans_made_on_every_core_are_the_plans_made_one_by_one() {
        let apps: Vec<Arc<FederatedMyApp>> = (0..2 * PLAN_CHUNK / 9 + 1)
            .flat_map(|round| {
                many().into_iter().map(move |app| {
                    let mut app = Arc::unwrap_or_clone(app);
                    app.metadata.name = Some(format!("{}-{round}", app.name_any()));
                    Arc::new(app)
                })
            })
            .collect();
        assert!(apps.len() > 2 * PLAN_CHUNK);
        let mut members = Members::new();
        for n in 0..6 {
            apply(&mut members, (n, Some((n % 3, n == 4, n != 2))));
        }
        let admission = Admission::default();
        for grant in 0..6 {
            let grants = grants_of(grant);
            let one_by_one: Vec<AppPlan> = (apps.iter())
                .map(|app| plan(app, &members, &admission, &grants))
                .collect();
            assert_eq!(plan_each(&apps, &members, &admission, &grants), one_by_one);
        }
    }

    /// A new cluster in zone c is news only to the apps that can take it (every
    /// cluster's, zone c's) and to those whose plans fail as a whole (a selector that
    /// does not parse; 12 replicas that zone b's one cluster cannot hold).
    #[test]
    fn a_new_cluster_plans_only_the_apps_that_can_take_it() {
        let apps = many();
        let (grants, t0) = (Grants::default(), Instant::now());
        let mut members = Members::new();
        apply(&mut members, (0, Some((0, false, false))));
        apply(&mut members, (1, Some((1, false, false))));
        let (mut planner, mut fx) = (Planner::default(), Recorded::default());
        planner.handle(Trigger::Members, &apps, (&members, &grants), t0, &mut fx);
        assert_eq!(fx.plans.len(), 9, "the first time, every app");
        fx.plans.clear();
        apply(&mut members, (3, Some((2, false, false))));
        planner.handle(Trigger::Members, &apps, (&members, &grants), t0, &mut fx);
        let planned: Vec<&str> = fx.plans.keys().map(|k| k.name.as_str()).collect();
        assert_eq!(planned, ["app4", "app6", "app7", "app8"]);
    }
}
