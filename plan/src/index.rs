//! Index: what every member cluster should run, built from plans (`AppPlan::desired`),
//! and what each connected agent reports it runs. Pure state: every method returns the
//! messages to push and does no I/O, so that the hub's `dispatch` decides when and how
//! they travel.
//!
//! What it guarantees (DESIGN.md, safety rules 1–3): an app's desired state never moves
//! back to an older generation; a deletion waits for every registered cluster that has
//! the MyApp, may have it (an Apply in flight), or is not connected to say; a cluster is
//! known not to hold a MyApp only from its agent's own word (Hello or a report).
//!
//! A cluster's word is not enough to hold a deletion forever, though: a cluster that only
//! *claims* an app (this hub never placed or sent it there, and the app's spec does not
//! place it there) is sent the Delete and waited for at most [`CLAIM_WAIT`] (review H2: a
//! lying agent claiming `ns/x` in its Hello stalled the deletion of `ns/x` until an admin
//! unjoined it). Time is passed in, never read here.
//!
//! Two implementations of one state machine: [`Index`], string-keyed maps, the reference
//! that the unit tests below pin rule by rule; and [`compact::CompactIndex`], interned ids
//! and one dense table per app (0.43x the bytes a pair, BENCHMARKS.md), which the hub
//! runs. The differential property test in `compact` holds the second to the first after
//! every step of random operation sequences; `Index` goes once the compact one has run
//! in the fleet for a while.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use flotilla_crds::AppKey;

use crate::placement::ClusterName;
use crate::render::RenderedMyApp;

pub mod compact;

/// What one cluster should have for one app.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Desired {
    /// Exactly this MyApp.
    Apply(Arc<RenderedMyApp>),
    /// Whatever the member has now: the app is placed there but cannot be rendered (an
    /// invalid override, say). Never a reason to delete what runs.
    Keep,
    /// Stop managing it but leave it running (deleted with `kubefed.io/orphan`).
    Release,
}

/// A message for one cluster's agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Apply(Arc<RenderedMyApp>),
    Delete { orphan: bool },
}

/// A change for one cluster's agent; the key is the index's shared handle, so that the
/// queue of a fleet connecting at once holds a pointer per pair, not a copy of the key.
pub type Push = (String, Arc<AppKey>, Change);

/// What an agent said about one of its MyApps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// It manages the MyApp.
    Present,
    /// It manages the MyApp, and someone changed its spec there since it was applied.
    Drifted,
    /// It does not (deleted, released, or never there).
    Absent,
    /// Applying it failed; the agent retries by itself.
    Failed,
}

/// cluster → app → desired state, with its number of `Apply` entries kept in step: the
/// pairs gauge reads it after every app change, and counting would take O(pairs). An
/// app's clusters share one key, not a copy each.
#[derive(Debug, Default)]
struct DesiredPairs {
    by_cluster: HashMap<String, HashMap<Arc<AppKey>, Desired>>,
    applied: usize,
}

impl DesiredPairs {
    fn get(&self, cluster: &str) -> Option<&HashMap<Arc<AppKey>, Desired>> {
        self.by_cluster.get(cluster)
    }

    fn insert(&mut self, cluster: &str, key: &Arc<AppKey>, want: Desired) -> Option<Desired> {
        self.applied += usize::from(is_apply(&want));
        // Looked up before it is entered: a cluster's map exists for all but its first
        // app, and `entry` would copy the name every time.
        let apps = match self.by_cluster.get_mut(cluster) {
            Some(apps) => apps,
            None => self.by_cluster.entry(cluster.to_owned()).or_default(),
        };
        let previous = apps.insert(key.clone(), want);
        self.applied -= usize::from(previous.as_ref().is_some_and(is_apply));
        previous
    }

    /// The cluster's own copy of `key` when it has one, to share rather than copy.
    fn shared_key(&self, cluster: &str, key: &AppKey) -> Arc<AppKey> {
        match self.get(cluster).and_then(|d| d.get_key_value(key)) {
            Some((shared, _)) => shared.clone(),
            None => Arc::new(key.clone()),
        }
    }

    fn remove(&mut self, cluster: &str, key: &AppKey) -> Option<Desired> {
        let removed = self.by_cluster.get_mut(cluster)?.remove(key);
        self.applied -= usize::from(removed.as_ref().is_some_and(is_apply));
        removed
    }

    fn remove_everywhere(&mut self, key: &AppKey) {
        for apps in self.by_cluster.values_mut() {
            let removed = apps.remove(key);
            self.applied -= usize::from(removed.as_ref().is_some_and(is_apply));
        }
    }

    fn retain_clusters(&mut self, registered: &BTreeSet<String>) {
        self.by_cluster.retain(|cluster, apps| {
            let keep = registered.contains(cluster);
            if !keep {
                self.applied -= apps.values().filter(|d| is_apply(d)).count();
            }
            keep
        });
    }
}

fn is_apply(want: &Desired) -> bool {
    matches!(want, Desired::Apply(_))
}

/// The namespaces an agent's word covers (its Hello's `scope`). The agent lists and
/// watches only these, so what it says of a MyApp elsewhere (present or absent) is not
/// known to it, and not believed: such a MyApp is unknown, as on a cluster whose agent
/// is away.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Scope {
    /// Every namespace.
    #[default]
    All,
    /// Only these.
    Namespaces(BTreeSet<String>),
}

impl Scope {
    /// Hello's list: empty for every namespace.
    pub fn of(namespaces: impl IntoIterator<Item = String>) -> Self {
        let namespaces: BTreeSet<String> = namespaces.into_iter().collect();
        match namespaces.is_empty() {
            true => Self::All,
            false => Self::Namespaces(namespaces),
        }
    }

    pub fn covers(&self, key: &AppKey) -> bool {
        match self {
            Self::All => true,
            Self::Namespaces(namespaces) => namespaces.contains(&key.namespace),
        }
    }
}

/// How long a deletion waits for a cluster that only claims the app, by default.
pub const CLAIM_WAIT: Duration = Duration::from_secs(600);

/// A wait longer than any hub runs: as good as never ending, and short enough to add
/// to the clock (`--claim-wait` takes any duration; centuries would overflow `Instant`).
const LONGEST_CLAIM_WAIT: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

#[derive(Debug)]
struct ClaimWait(Duration);

impl ClaimWait {
    fn new(wait: Duration) -> Self {
        Self(wait.min(LONGEST_CLAIM_WAIT))
    }
}

impl Default for ClaimWait {
    fn default() -> Self {
        Self(CLAIM_WAIT)
    }
}

#[derive(Debug, Default)]
pub struct Index {
    /// cluster → app → desired state.
    desired: DesiredPairs,
    /// app → clusters with an entry in `desired`, to find them without a scan.
    placed: HashMap<AppKey, BTreeSet<ClusterName>>,
    /// app → the newest generation planned; older plans are ignored.
    generation: HashMap<AppKey, i64>,
    /// cluster → apps its agent manages, for clusters whose agent said Hello since it
    /// last connected; absent for the others, whose state is unknown.
    present: HashMap<String, HashSet<Arc<AppKey>>>,
    /// cluster → the scope of its connected agent, for agents that cover fewer than all
    /// (never [`Scope::All`], which an absent entry means); `present` holds only MyApps
    /// inside it.
    scopes: HashMap<String, Scope>,
    /// app being deleted → clusters that have not confirmed it is gone (or released).
    deleting: HashMap<AppKey, BTreeSet<String>>,
    /// app → clusters a plan took it off that have not said they no longer hold it (an
    /// agent away when its Delete was due): a deletion waits for them too.
    departed: HashMap<AppKey, BTreeSet<String>>,
    /// Deleted apps no finalizer holds (it was removed by hand): forgotten as soon as
    /// every cluster confirmed, since no reconcile will come to do it.
    unowned: HashSet<AppKey>,
    /// cluster → apps its agent reported drifted this session, whose Apply was sent
    /// again once: a drift the Apply cannot undo is not answered again until it clears.
    drifted: HashMap<String, HashSet<AppKey>>,
    /// app being deleted → clusters waited for only on their own claim, and when that
    /// wait ends.
    claimed: HashMap<AppKey, BTreeMap<String, Instant>>,
    claim_wait: ClaimWait,
    /// Claims whose wait ended since the last [`Index::take_unheeded_claims`].
    unheeded: Vec<(AppKey, String)>,
}

impl Index {
    /// An index whose deletions wait `wait` for a cluster that only claims the app.
    pub fn with_claim_wait(wait: Duration) -> Self {
        Self {
            claim_wait: ClaimWait::new(wait),
            ..Self::default()
        }
    }

    /// Makes `plan` the app's desired state; clusters outside it lose the app. A plan
    /// for an older generation than one already planned, or for an app being deleted,
    /// changes nothing.
    pub fn set_app(
        &mut self,
        key: &AppKey,
        generation: Option<i64>,
        plan: BTreeMap<ClusterName, Desired>,
    ) -> Vec<Push> {
        if self.deleting.contains_key(key) {
            return Vec::new();
        }
        if let Some(g) = generation {
            match self.generation.get(key) {
                Some(seen) if g < *seen => return Vec::new(),
                _ => self.generation.insert(key.clone(), g),
            };
        }
        let mut pushes = Vec::new();
        let shared = Arc::new(key.clone());
        let before = self.placed.remove(key).unwrap_or_default();
        let departed = self.departed.entry(key.clone()).or_default();
        for cluster in before.iter().filter(|c| !plan.contains_key(*c)) {
            self.desired.remove(cluster, key);
            departed.insert(cluster.to_string());
            pushes.push((
                cluster.to_string(),
                shared.clone(),
                Change::Delete { orphan: false },
            ));
        }
        departed.retain(|c| !plan.contains_key(c.as_str()));
        if departed.is_empty() {
            self.departed.remove(key);
        }
        for (cluster, want) in &plan {
            let previous = self.desired.insert(cluster, &shared, want.clone());
            if let Desired::Apply(rendered) = want {
                let unchanged =
                    matches!(&previous, Some(Desired::Apply(p)) if p.hash == rendered.hash);
                if !unchanged {
                    pushes.push((
                        cluster.to_string(),
                        shared.clone(),
                        Change::Apply(rendered.clone()),
                    ));
                }
            }
        }
        self.placed.insert(key.clone(), plan.into_keys().collect());
        pushes
    }

    /// Starts (or continues: called again until it is over) deleting an app: every
    /// cluster that has or may have it gets a Delete and is waited for. `also` names the
    /// registered clusters its spec places it on, which must confirm too even if this hub
    /// never saw them hold it (after a restart, say). A cluster that only claims the app
    /// is waited for until `now` is past the claim wait, then left out (see
    /// [`Index::take_unheeded_claims`]).
    pub fn delete_app(
        &mut self,
        key: &AppKey,
        orphan: bool,
        also: &[String],
        now: Instant,
    ) -> Vec<Push> {
        let placed = self.placed.remove(key).unwrap_or_default();
        let mut trusted: BTreeSet<String> = placed.iter().map(|c| c.to_string()).collect();
        trusted.extend(self.departed.remove(key).unwrap_or_default());
        trusted.extend(also.iter().cloned());
        let mut candidates = trusted.clone();
        candidates.extend(
            self.present
                .iter()
                .filter(|(_, apps)| apps.contains(key))
                .map(|(c, _)| c.clone()),
        );
        let candidates: Vec<(String, Option<bool>)> = (candidates.into_iter())
            .map(|cluster| {
                let held = self.holds(&cluster, key);
                (cluster, held)
            })
            .collect();
        let mut pushes = Vec::new();
        let shared = Arc::new(key.clone());
        let waiting = self.deleting.entry(key.clone()).or_default();
        let claimed = self.claimed.entry(key.clone()).or_default();
        for (cluster, held) in candidates {
            let before = self.desired.remove(&cluster, key);
            // A connected agent that has not reported the MyApp may still be applying an
            // Apply sent this session: only "never sent, never held" is known absence.
            let may_hold = match held {
                Some(held) => held || matches!(before, Some(Desired::Apply(_) | Desired::Keep)),
                None => true,
            };
            if !may_hold {
                continue;
            }
            // Waited for on the hub's own word (now, or by an earlier call): for good.
            // Only on its agent's claim: for a while, unless the app is orphaned: a
            // copy the claimer really holds would otherwise be collected (deleted) at its
            // next sync instead of released, so an orphaning delete waits as before.
            let claim_only = !orphan
                && !trusted.contains(&cluster)
                && (claimed.contains_key(&cluster) || !waiting.contains(&cluster));
            if !claim_only {
                claimed.remove(&cluster);
            } else if let Some(ends) = claimed.get(&cluster) {
                if now >= *ends {
                    continue;
                }
            } else {
                // First heard of: sent the Delete at least once, however short the wait.
                claimed.insert(cluster.clone(), now + self.claim_wait.0);
            }
            if held.is_some() && before != Some(Desired::Release) {
                pushes.push((cluster.clone(), shared.clone(), Change::Delete { orphan }));
            }
            if orphan {
                // Kept in the desired set so that reconnecting agents release it rather
                // than collect it as an orphan.
                self.desired.insert(&cluster, &shared, Desired::Release);
            }
            waiting.insert(cluster);
        }
        // Also those no longer connected, which the loop above does not visit.
        for (cluster, ends) in claimed.iter() {
            if now >= *ends && !trusted.contains(cluster) && waiting.remove(cluster) {
                self.unheeded.push((key.clone(), cluster.clone()));
            }
        }
        if claimed.is_empty() {
            self.claimed.remove(key);
        }
        pushes
    }

    /// The clusters whose claim-only wait on `key`'s deletion ended since the last call
    /// for it: the deletion went on without them (the hub says so in an Event and its
    /// log).
    pub fn take_unheeded_claims(&mut self, key: &AppKey) -> Vec<String> {
        let (mine, others) = std::mem::take(&mut self.unheeded)
            .into_iter()
            .partition(|(app, _)| app == key);
        self.unheeded = others;
        mine.into_iter().map(|(_, cluster)| cluster).collect()
    }

    /// The app vanished from the host without its finalizer (removed by hand): delete it
    /// now like any deletion rather than by surprise at the next restart, and forget it
    /// once every cluster confirmed. Unknown apps (our own finalizer already released
    /// them) change nothing.
    pub fn drop_app(&mut self, key: &AppKey, orphan: bool, now: Instant) -> Vec<Push> {
        if !self.placed.contains_key(key) && !self.deleting.contains_key(key) {
            return Vec::new();
        }
        let pushes = self.delete_app(key, orphan, &[], now);
        if self.deleting.get(key).is_some_and(BTreeSet::is_empty) {
            self.forget(key);
        } else {
            self.unowned.insert(key.clone());
        }
        pushes
    }

    /// The app's object left the host and another of the same name is already listed
    /// (deleted without our finalizer and created again, or so a re-list shows it).
    /// Unless the old one asked to be orphaned (or is being released), what it placed is
    /// left to the new one's plan, whatever that one's generation: the host wants those
    /// MyApps again (rule 1), so a deletion under way is called off and the next
    /// [`Index::set_app`] deletes only what the new plan leaves out. Releases go on as
    /// [`Index::drop_app`] does them.
    pub fn replace_app(&mut self, key: &AppKey, orphan: bool, now: Instant) -> Vec<Push> {
        let releasing =
            (self.desired.by_cluster.values()).any(|apps| apps.get(key) == Some(&Desired::Release));
        if orphan || releasing {
            return self.drop_app(key, true, now);
        }
        self.deleting.remove(key);
        self.claimed.remove(key);
        self.unowned.remove(key);
        self.generation.remove(key);
        Vec::new()
    }

    /// Whether the app is being deleted: plans for it change nothing until it is
    /// forgotten.
    pub fn is_deleting(&self, key: &AppKey) -> bool {
        self.deleting.contains_key(key)
    }

    /// Clusters that still hold an app being deleted; empty once it is gone everywhere.
    pub fn deletion_waiting_on(&self, key: &AppKey) -> Vec<String> {
        self.deleting
            .get(key)
            .map(|c| c.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Forgets a deleted app once its finalizer is gone.
    pub fn forget(&mut self, key: &AppKey) {
        self.deleting.remove(key);
        self.claimed.remove(key);
        self.unowned.remove(key);
        self.generation.remove(key);
        self.departed.remove(key);
        self.desired.remove_everywhere(key);
        self.placed.remove(key);
        for apps in self.drifted.values_mut() {
            apps.remove(key);
        }
    }

    /// The registered clusters changed: a cluster that left is no longer waited for, and
    /// what it was told to release is forgotten with it. A deletion no finalizer holds
    /// that waited only for clusters that left is over.
    pub fn retain_clusters(&mut self, registered: &BTreeSet<String>) {
        for waiting in self.deleting.values_mut() {
            waiting.retain(|c| registered.contains(c));
        }
        let over: Vec<AppKey> = (self.unowned.iter())
            .filter(|key| self.deleting.get(*key).is_none_or(BTreeSet::is_empty))
            .cloned()
            .collect();
        for key in over {
            self.forget(&key);
        }
        self.desired.retain_clusters(registered);
        self.present.retain(|c, _| registered.contains(c));
        self.scopes.retain(|c, _| registered.contains(c));
        self.drifted.retain(|c, _| registered.contains(c));
        self.claimed.retain(|_, clusters| {
            clusters.retain(|c, _| registered.contains(c));
            !clusters.is_empty()
        });
        for clusters in self.placed.values_mut() {
            clusters.retain(|c| registered.contains(&**c));
        }
        self.departed.retain(|_, clusters| {
            clusters.retain(|c| registered.contains(c));
            !clusters.is_empty()
        });
    }

    /// An agent said Hello with the hashes of the apps it manages in `scope`: what it
    /// lacks or has stale, and the whole desired key set for its SyncComplete. Only
    /// MyApps inside the scope are known held or known absent; a Hello that lists one
    /// outside it is not believed on that one.
    pub fn connect(
        &mut self,
        cluster: &str,
        managed: &HashMap<AppKey, String>,
        scope: Scope,
    ) -> (Vec<Push>, Vec<Arc<AppKey>>) {
        // `managed` is read only inside the scope (no filtered copy of it is made).
        let held = (managed.keys())
            .filter(|key| scope.covers(key))
            .map(|key| self.desired.shared_key(cluster, key))
            .collect();
        self.present.insert(cluster.to_owned(), held);
        let mut pushes = Vec::new();
        let keys = self.desired_shared(cluster);
        if let Some(desired) = self.desired.get(cluster) {
            for key in &keys {
                let hash = managed.get(&**key).filter(|_| scope.covers(key));
                match (&desired[key], hash) {
                    (Desired::Apply(r), hash) if hash != Some(&r.hash) => {
                        let apply = Change::Apply(r.clone());
                        pushes.push((cluster.to_owned(), key.clone(), apply));
                    }
                    (Desired::Release, Some(_)) => {
                        pushes.push((
                            cluster.to_owned(),
                            key.clone(),
                            Change::Delete { orphan: true },
                        ));
                    }
                    _ => {}
                }
            }
        }
        match scope {
            Scope::All => self.scopes.remove(cluster),
            narrowed => self.scopes.insert(cluster.to_owned(), narrowed),
        };
        self.settle_deletions(cluster, managed, &keys, &mut pushes);
        (pushes, keys)
    }

    /// After a Hello: deletions (and departures) waiting on the cluster that its agent
    /// says it does not hold are confirmed; one it still holds is sent its Delete.
    /// `managed` is the Hello's whole list, read only where the agent's scope (stored
    /// before) covers the app.
    fn settle_deletions(
        &mut self,
        cluster: &str,
        managed: &HashMap<AppKey, String>,
        keys: &[Arc<AppKey>],
        pushes: &mut Vec<Push>,
    ) {
        let mut gone = Vec::new();
        for (key, waiting) in &self.deleting {
            if !waiting.contains(cluster) {
                continue;
            }
            if !self.covers(cluster, key) {
                // Unknown to this agent: waited for as if it were away.
            } else if !managed.contains_key(key) {
                gone.push(key.clone());
            } else if keys.binary_search_by(|k| (**k).cmp(key)).is_err() {
                // A deletion the agent still holds is sent as an explicit Delete: it is
                // the host's word for that object, not a collection for the circuit
                // breaker to hold back.
                pushes.push((
                    cluster.to_owned(),
                    self.desired.shared_key(cluster, key),
                    Change::Delete { orphan: false },
                ));
            }
        }
        gone.extend(
            (self.departed.iter())
                .filter(|(key, clusters)| {
                    clusters.contains(cluster)
                        && self.covers(cluster, key)
                        && !managed.contains_key(*key)
                })
                .map(|(key, _)| key.clone()),
        );
        for key in gone {
            self.confirm_gone(cluster, &key);
        }
    }

    /// The keys the cluster should have, for a SyncComplete, in order: the index's own
    /// handles, so that the SyncCompletes of a fleet connecting at once hold one pointer
    /// per key while they wait behind the Applies, not a copy of each.
    pub fn desired_shared(&self, cluster: &str) -> Vec<Arc<AppKey>> {
        let mut keys: Vec<Arc<AppKey>> = (self.desired.get(cluster))
            .map(|d| d.keys().cloned().collect())
            .unwrap_or_default();
        keys.sort();
        keys
    }

    /// The agent went away: what it holds is unknown until it says Hello again.
    pub fn disconnect(&mut self, cluster: &str) {
        self.present.remove(cluster);
        self.scopes.remove(cluster);
        self.drifted.remove(cluster);
    }

    /// The agent reported on an app. A desired MyApp reported absent (deleted by hand in
    /// the member, say) is sent again; a failed one is retried by the agent itself. A
    /// report on a MyApp outside the agent's scope changes nothing.
    pub fn report(&mut self, cluster: &str, key: &AppKey, held: Held) -> Vec<Push> {
        if !self.covers(cluster, key) {
            return Vec::new();
        }
        let Some(apps) = self.present.get_mut(cluster) else {
            return Vec::new();
        };
        let drifted = self.drifted.entry(cluster.to_owned()).or_default();
        if held != Held::Drifted {
            drifted.remove(key);
        }
        match held {
            Held::Present => {
                apps.insert(self.desired.shared_key(cluster, key));
                Vec::new()
            }
            Held::Drifted => {
                apps.insert(self.desired.shared_key(cluster, key));
                if !drifted.insert(key.clone()) {
                    return Vec::new();
                }
                match self.desired.get(cluster).and_then(|d| d.get_key_value(key)) {
                    Some((shared, Desired::Apply(r))) => {
                        vec![(cluster.to_owned(), shared.clone(), Change::Apply(r.clone()))]
                    }
                    _ => Vec::new(),
                }
            }
            Held::Failed => Vec::new(),
            Held::Absent => {
                apps.remove(key);
                self.confirm_gone(cluster, key);
                match self.desired.get(cluster).and_then(|d| d.get_key_value(key)) {
                    Some((shared, Desired::Apply(r))) => {
                        vec![(cluster.to_owned(), shared.clone(), Change::Apply(r.clone()))]
                    }
                    _ => Vec::new(),
                }
            }
        }
    }

    /// Whether the cluster's connected agent holds the app, by its own word; `None` when
    /// it cannot say (away, or the app is outside its scope).
    fn holds(&self, cluster: &str, key: &AppKey) -> Option<bool> {
        let apps = self.present.get(cluster)?;
        self.covers(cluster, key).then(|| apps.contains(key))
    }

    /// Whether the app is inside the scope of the cluster's agent (or no agent said).
    fn covers(&self, cluster: &str, key: &AppKey) -> bool {
        (self.scopes.get(cluster)).is_none_or(|scope| scope.covers(key))
    }

    /// Why a connected cluster cannot confirm the app's deletion, when the reason is its
    /// agent's scope: the namespaces it covers.
    pub fn scope_excludes(&self, cluster: &str, key: &AppKey) -> Option<&BTreeSet<String>> {
        match self.scopes.get(cluster)? {
            Scope::Namespaces(namespaces) if !namespaces.contains(&key.namespace) => {
                Some(namespaces)
            }
            _ => None,
        }
    }

    /// The cluster's agent said it does not hold the app (its Hello, or a report).
    fn confirm_gone(&mut self, cluster: &str, key: &AppKey) {
        if let Some(departed) = self.departed.get_mut(key) {
            departed.remove(cluster);
            if departed.is_empty() {
                self.departed.remove(key);
            }
        }
        let Some(waiting) = self.deleting.get_mut(key) else {
            return;
        };
        waiting.remove(cluster);
        let done = waiting.is_empty();
        if self.desired.get(cluster).and_then(|d| d.get(key)) == Some(&Desired::Release) {
            self.desired.remove(cluster, key);
        }
        if done && self.unowned.contains(key) {
            self.forget(key);
        }
    }

    /// Whether `key` is this cluster's to report on: an app it should have, is deleting,
    /// was taken off it without a word since, or last said it holds (a MyApp that just
    /// left its placement). Status for anything else is refused.
    pub fn is_placed(&self, cluster: &str, key: &AppKey) -> bool {
        self.is_assigned(cluster, key) || self.present.get(cluster).is_some_and(|p| p.contains(key))
    }

    /// Whether `key` is this cluster's on the hub's own word: an app it should have, is
    /// deleting, or was taken off it without a word since (not one it only claims).
    pub fn is_assigned(&self, cluster: &str, key: &AppKey) -> bool {
        self.desired
            .get(cluster)
            .is_some_and(|d| d.contains_key(key))
            || self.deleting.get(key).is_some_and(|w| w.contains(cluster))
            || self.departed.get(key).is_some_and(|d| d.contains(cluster))
    }

    /// Number of (cluster, app) pairs with an `Apply`.
    pub fn applied_pairs(&self) -> usize {
        self.desired.applied
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    /// The tests' clock: one instant, moved on by hand where time matters.
    pub(super) fn now() -> Instant {
        static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *T0.get_or_init(Instant::now)
    }

    pub(super) fn rendered(hash: &str) -> Desired {
        Desired::Apply(Arc::new(RenderedMyApp {
            hash: hash.into(),
            json: Bytes::from_static(b"{}"),
        }))
    }

    fn key(n: &str) -> AppKey {
        AppKey::new("default", n)
    }

    fn plan(entries: &[(&str, Desired)]) -> BTreeMap<ClusterName, Desired> {
        entries
            .iter()
            .map(|(c, d)| ((*c).into(), d.clone()))
            .collect()
    }

    fn kinds(pushes: &[Push]) -> Vec<(String, String, String)> {
        pushes
            .iter()
            .map(|(c, k, ch)| {
                let what = match ch {
                    Change::Apply(r) => format!("apply {}", r.hash),
                    Change::Delete { orphan } => format!("delete orphan={orphan}"),
                };
                (c.clone(), k.name.clone(), what)
            })
            .collect()
    }

    fn t(c: &str, k: &str, w: &str) -> (String, String, String) {
        (c.into(), k.into(), w.into())
    }

    fn hello(entries: &[(&str, &str)]) -> HashMap<AppKey, String> {
        entries
            .iter()
            .map(|(k, h)| (key(k), (*h).to_owned()))
            .collect()
    }

    #[test]
    fn new_app_is_applied_where_placed_and_unchanged_hashes_are_not_resent() {
        let mut ix = Index::default();
        let p = plan(&[("c1", rendered("h1")), ("c2", rendered("h2"))]);
        assert_eq!(
            kinds(&ix.set_app(&key("a"), None, p.clone())),
            [t("c1", "a", "apply h1"), t("c2", "a", "apply h2")]
        );
        assert!(
            ix.set_app(&key("a"), None, p).is_empty(),
            "same hashes push nothing"
        );
        let p = plan(&[("c1", rendered("h1")), ("c2", rendered("h3"))]);
        assert_eq!(
            kinds(&ix.set_app(&key("a"), None, p)),
            [t("c2", "a", "apply h3")]
        );
    }

    #[test]
    fn leaving_the_placement_deletes_and_keep_never_does() {
        let mut ix = Index::default();
        ix.set_app(
            &key("a"),
            None,
            plan(&[("c1", rendered("h1")), ("c2", rendered("h2"))]),
        );
        let pushes = ix.set_app(&key("a"), None, plan(&[("c1", Desired::Keep)]));
        assert_eq!(kinds(&pushes), [t("c2", "a", "delete orphan=false")]);
        let (pushes, keys) = ix.connect("c1", &hello(&[("a", "old")]), Scope::All);
        assert!(pushes.is_empty(), "Keep leaves the member's copy alone");
        assert_eq!(
            keys,
            [key("a").into()],
            "and protects it from orphan collection"
        );
    }

    #[test]
    fn connect_sends_only_what_differs_and_lists_the_desired_set() {
        let mut ix = Index::default();
        for (n, h) in [("a", "ha"), ("b", "hb"), ("c", "hc")] {
            ix.set_app(&key(n), None, plan(&[("c1", rendered(h))]));
        }
        let (pushes, keys) = ix.connect(
            "c1",
            &hello(&[("a", "ha"), ("b", "stale"), ("zombie", "hz")]),
            Scope::All,
        );
        assert_eq!(
            kinds(&pushes),
            [t("c1", "b", "apply hb"), t("c1", "c", "apply hc")]
        );
        assert_eq!(
            keys,
            [key("a").into(), key("b").into(), key("c").into()],
            "zombie is left to orphan collection"
        );
    }

    #[test]
    fn reconnect_with_everything_current_sends_nothing() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), None, plan(&[("c1", rendered("ha"))]));
        ix.connect("c1", &HashMap::new(), Scope::All);
        ix.disconnect("c1");
        let (pushes, _) = ix.connect("c1", &hello(&[("a", "ha")]), Scope::All);
        assert!(pushes.is_empty());
    }

    #[test]
    fn delete_waits_for_every_holder_to_confirm() {
        let mut ix = Index::default();
        ix.set_app(
            &key("a"),
            None,
            plan(&[("c1", rendered("h")), ("c2", rendered("h"))]),
        );
        ix.connect("c1", &hello(&[("a", "h")]), Scope::All);
        // c2 never connected: it is waited for, and gets its Delete through orphan
        // collection when it does.
        let pushes = ix.delete_app(&key("a"), false, &[], now());
        assert_eq!(kinds(&pushes), [t("c1", "a", "delete orphan=false")]);
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1", "c2"]);
        ix.report("c1", &key("a"), Held::Absent);
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c2"]);
        let (pushes, keys) = ix.connect("c2", &hello(&[("a", "h")]), Scope::All);
        assert_eq!(
            kinds(&pushes),
            [t("c2", "a", "delete orphan=false")],
            "an explicit Delete, never left to orphan collection"
        );
        assert!(keys.is_empty());
        ix.report("c2", &key("a"), Held::Absent);
        assert!(ix.deletion_waiting_on(&key("a")).is_empty());
    }

    #[test]
    fn delete_skips_connected_clusters_that_do_not_hold_it() {
        let mut ix = Index::default();
        ix.connect("c1", &HashMap::new(), Scope::All);
        let pushes = ix.delete_app(&key("a"), false, &["c1".into()], now());
        assert!(pushes.is_empty());
        assert!(ix.deletion_waiting_on(&key("a")).is_empty());
    }

    /// An agent narrowed to namespace `team` cannot see `default`: its Hello's silence
    /// on default/a (placed there earlier) is not absence, and neither is a report. The
    /// deletion waits for it, and says whose scope is the reason, until an agent that
    /// covers `default` says it is gone.
    #[test]
    fn a_deletion_waits_for_a_cluster_whose_agent_does_not_cover_the_namespace() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), None, plan(&[("c1", rendered("h"))]));
        let team = Scope::of(["team".to_owned()]);
        let (pushes, _) = ix.connect("c1", &hello(&[("a", "h")]), team.clone());
        assert_eq!(
            kinds(&pushes),
            [t("c1", "a", "apply h")],
            "its own listing of default/a is not believed either"
        );
        let pushes = ix.delete_app(&key("a"), false, &[], now());
        assert!(
            pushes.is_empty(),
            "no Delete for an agent that cannot see it"
        );
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1"]);
        assert!(ix.report("c1", &key("a"), Held::Absent).is_empty());
        ix.connect("c1", &HashMap::new(), team);
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1"]);
        let why = ix.scope_excludes("c1", &key("a")).cloned();
        assert_eq!(why, Some(BTreeSet::from(["team".to_owned()])));

        ix.disconnect("c1");
        assert_eq!(ix.scope_excludes("c1", &key("a")), None);
        ix.connect("c1", &HashMap::new(), Scope::All);
        assert!(ix.deletion_waiting_on(&key("a")).is_empty());
    }

    #[test]
    fn disconnected_spec_clusters_are_waited_for_after_a_hub_restart() {
        let mut ix = Index::default();
        ix.delete_app(&key("a"), false, &["c1".into()], now());
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1"]);
        ix.connect("c1", &HashMap::new(), Scope::All);
        assert!(
            ix.deletion_waiting_on(&key("a")).is_empty(),
            "Hello without it confirms"
        );
    }

    #[test]
    fn orphan_delete_releases_and_survives_reconnects() {
        let mut ix = Index::default();
        ix.set_app(
            &key("a"),
            None,
            plan(&[("c1", rendered("h")), ("c2", rendered("h"))]),
        );
        ix.connect("c1", &hello(&[("a", "h")]), Scope::All);
        let pushes = ix.delete_app(&key("a"), true, &[], now());
        assert_eq!(kinds(&pushes), [t("c1", "a", "delete orphan=true")]);
        assert!(
            ix.delete_app(&key("a"), true, &[], now()).is_empty(),
            "a retried cleanup does not resend"
        );
        let (pushes, keys) = ix.connect("c2", &hello(&[("a", "h")]), Scope::All);
        assert_eq!(kinds(&pushes), [t("c2", "a", "delete orphan=true")]);
        assert_eq!(
            keys,
            [key("a").into()],
            "listed as desired, so c2 does not collect it"
        );
        ix.report("c1", &key("a"), Held::Absent);
        ix.report("c2", &key("a"), Held::Absent);
        assert!(ix.deletion_waiting_on(&key("a")).is_empty());
        let (_, keys) = ix.connect("c2", &HashMap::new(), Scope::All);
        assert!(
            keys.is_empty(),
            "released entries are dropped once confirmed"
        );
    }

    #[test]
    fn a_cluster_that_only_claims_an_app_is_waited_for_until_the_claim_wait_ends() {
        let wait = Duration::from_secs(10);
        let mut ix = Index::with_claim_wait(wait);
        // c1 says Hello holding other/app, which this hub never placed or sent anywhere.
        let claimed = AppKey::new("other", "app");
        ix.connect(
            "c1",
            &HashMap::from([(claimed.clone(), "h".to_owned())]),
            Scope::All,
        );
        let pushes = ix.delete_app(&claimed, false, &[], now());
        assert_eq!(kinds(&pushes), [t("c1", "app", "delete orphan=false")]);
        assert_eq!(ix.deletion_waiting_on(&claimed), ["c1"]);
        ix.delete_app(
            &claimed,
            false,
            &[],
            now() + wait - Duration::from_millis(1),
        );
        assert_eq!(ix.deletion_waiting_on(&claimed), ["c1"], "within the wait");
        assert!(ix.take_unheeded_claims(&claimed).is_empty());
        ix.delete_app(&claimed, false, &[], now() + wait);
        assert!(ix.deletion_waiting_on(&claimed).is_empty(), "past the wait");
        assert_eq!(ix.take_unheeded_claims(&claimed), ["c1"]);
        ix.delete_app(&claimed, false, &[], now() + wait * 2);
        assert!(
            ix.deletion_waiting_on(&claimed).is_empty(),
            "not waited for again"
        );
        assert!(ix.take_unheeded_claims(&claimed).is_empty(), "said once");
    }

    /// `--claim-wait` takes any duration: one too long to add to the clock waits as
    /// good as forever instead of overflowing inside the dispatcher's lock.
    #[test]
    fn a_claim_wait_too_long_for_the_clock_never_ends() {
        let mut ix = Index::with_claim_wait(Duration::MAX);
        ix.connect("c1", &hello(&[("a", "h")]), Scope::All);
        let pushes = ix.delete_app(&key("a"), false, &[], now());
        assert_eq!(kinds(&pushes), [t("c1", "a", "delete orphan=false")]);
        let centuries = now() + Duration::from_secs(50 * 365 * 24 * 3600);
        ix.delete_app(&key("a"), false, &[], centuries);
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1"]);
        assert!(ix.take_unheeded_claims(&key("a")).is_empty());
    }

    /// An orphaning delete waits for a claimer however long it takes: past the wait its
    /// copy would be collected, not released, when it syncs again.
    #[test]
    fn an_orphaning_delete_waits_for_a_claimer_for_good() {
        let mut ix = Index::with_claim_wait(Duration::ZERO);
        ix.connect("c1", &hello(&[("a", "h")]), Scope::All);
        let pushes = ix.delete_app(&key("a"), true, &[], now());
        assert_eq!(kinds(&pushes), [t("c1", "a", "delete orphan=true")]);
        ix.delete_app(&key("a"), true, &[], now() + Duration::from_secs(86_400));
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1"]);
        assert!(ix.take_unheeded_claims(&key("a")).is_empty());
        ix.report("c1", &key("a"), Held::Absent);
        assert!(ix.deletion_waiting_on(&key("a")).is_empty(), "released");
    }

    #[test]
    fn a_claim_is_sent_its_delete_even_with_no_wait() {
        let mut ix = Index::with_claim_wait(Duration::ZERO);
        ix.connect("c1", &hello(&[("a", "h"), ("b", "h")]), Scope::All);
        let pushes = ix.delete_app(&key("a"), false, &[], now());
        assert_eq!(kinds(&pushes), [t("c1", "a", "delete orphan=false")]);
        assert!(ix.deletion_waiting_on(&key("a")).is_empty());
        ix.delete_app(&key("b"), false, &[], now());
        // Each app's unheeded claims are taken by that app's name alone.
        assert_eq!(ix.take_unheeded_claims(&key("a")), ["c1"]);
        assert!(ix.take_unheeded_claims(&key("a")).is_empty());
        assert_eq!(ix.take_unheeded_claims(&key("b")), ["c1"]);
    }

    #[test]
    fn a_claiming_cluster_that_went_away_is_not_waited_for_past_the_claim_wait() {
        let wait = Duration::from_secs(10);
        let mut ix = Index::with_claim_wait(wait);
        ix.connect("c1", &hello(&[("a", "h")]), Scope::All);
        ix.delete_app(&key("a"), false, &[], now());
        ix.disconnect("c1");
        ix.delete_app(&key("a"), false, &[], now() + wait);
        assert!(ix.deletion_waiting_on(&key("a")).is_empty());
        assert_eq!(ix.take_unheeded_claims(&key("a")), ["c1"]);
    }

    #[test]
    fn a_cluster_the_hub_placed_sent_or_the_spec_names_is_waited_for_however_long_it_takes() {
        let mut ix = Index::with_claim_wait(Duration::from_secs(10));
        let later = now() + Duration::from_secs(86_400 * 365);
        // c1: placed and held; c2: the plan took it off while its agent was away; c3:
        // the spec places it there (a hub restarted since it was applied), and c3 holds it.
        ix.set_app(
            &key("a"),
            None,
            plan(&[("c1", rendered("h")), ("c2", rendered("h"))]),
        );
        ix.set_app(&key("a"), None, plan(&[("c1", rendered("h"))]));
        ix.connect("c1", &hello(&[("a", "h")]), Scope::All);
        ix.connect("c3", &hello(&[("a", "h")]), Scope::All);
        ix.delete_app(&key("a"), false, &["c3".into()], now());
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1", "c2", "c3"]);
        for at in [now() + Duration::from_secs(11), later] {
            ix.delete_app(&key("a"), false, &["c3".into()], at);
            assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1", "c2", "c3"]);
        }
        // Even once the spec no longer names c3 (the recheck passes what it places now).
        ix.delete_app(&key("a"), false, &[], later);
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1", "c2", "c3"]);
        assert!(ix.take_unheeded_claims(&key("a")).is_empty());
        // An Apply in flight to a connected agent that has not reported it yet.
        ix.set_app(&key("b"), None, plan(&[("c4", rendered("h"))]));
        ix.connect("c4", &HashMap::new(), Scope::All);
        ix.delete_app(&key("b"), false, &[], now());
        ix.delete_app(&key("b"), false, &[], later);
        assert_eq!(ix.deletion_waiting_on(&key("b")), ["c4"]);
    }

    #[test]
    fn status_is_accepted_only_for_placed_apps() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), None, plan(&[("c1", rendered("h"))]));
        assert!(ix.is_placed("c1", &key("a")));
        assert!(!ix.is_placed("c2", &key("a")));
        assert!(!ix.is_placed("c1", &key("b")));
        // Claimed in a Hello: reported on, but not the hub's word.
        ix.connect("c2", &hello(&[("b", "h")]), Scope::All);
        assert!(ix.is_placed("c2", &key("b")));
        assert!(!ix.is_assigned("c2", &key("b")));
        assert!(ix.is_assigned("c1", &key("a")));
    }

    #[test]
    fn applied_pairs_counts_apply_entries() {
        let mut ix = Index::default();
        ix.set_app(
            &key("a"),
            None,
            plan(&[("c1", rendered("h")), ("c2", Desired::Keep)]),
        );
        ix.set_app(&key("b"), None, plan(&[("c1", rendered("h"))]));
        assert_eq!(ix.applied_pairs(), 2);
    }

    /// The apps and the clusters that operations name: few, so that sequences of them
    /// overlap.
    pub(super) const APPS: u8 = 4;
    pub(super) const CLUSTERS: u8 = 4;

    /// Every operation on the index, on a few apps and clusters, so that sequences of
    /// them overlap.
    #[derive(Debug, Clone)]
    pub(super) enum Op {
        Set(u8, Option<i64>, Vec<(u8, u8)>),
        Delete(u8, bool, Vec<u8>),
        Drop(u8, bool),
        Replace(u8, bool),
        Forget(u8),
        Retain(Vec<u8>),
        /// A Hello from the cluster, scoped to the namespaces of a bit mask ([`scope`]).
        Connect(u8, Vec<(u8, u8)>, u8),
        Disconnect(u8),
        Report(u8, u8, u8),
        /// The hub takes the app's unheeded claims (after each deletion step).
        TakeUnheeded(u8),
        /// Time passes, in seconds: the caller's clock moves on.
        Wait(u8),
    }

    fn arb_op() -> impl proptest::strategy::Strategy<Value = Op> {
        arb_op_among(APPS, CLUSTERS)
    }

    /// Operations on the first `apps` apps and `clusters` clusters: the fewer, the more
    /// often a sequence comes back to the same pair.
    pub(super) fn arb_op_among(
        apps: u8,
        clusters: u8,
    ) -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let app = move || 0..apps;
        let cluster = move || 0..clusters;
        let clusters = || proptest::collection::vec(cluster(), 0..4);
        // (cluster, what): 0–2 an Apply with that hash, 3 Keep, 4 Release.
        let plan = proptest::collection::vec((cluster(), 0u8..5), 0..4);
        // Weighted towards what builds state (plans, Hellos, reports, deletions), so that
        // sequences reach what needs several steps: a drift answered, then a new session.
        prop_oneof![
            3 => (app(), proptest::option::of(0i64..3), plan).prop_map(|(a, g, p)| Op::Set(a, g, p)),
            2 => (app(), any::<bool>(), clusters()).prop_map(|(a, o, c)| Op::Delete(a, o, c)),
            1 => (app(), any::<bool>()).prop_map(|(a, o)| Op::Drop(a, o)),
            1 => (app(), any::<bool>()).prop_map(|(a, o)| Op::Replace(a, o)),
            1 => app().prop_map(Op::Forget),
            1 => clusters().prop_map(Op::Retain),
            3 => (
                cluster(),
                proptest::collection::vec((app(), 0u8..3), 0..4),
                0u8..8
            )
                .prop_map(|(c, m, s)| Op::Connect(c, m, s)),
            2 => cluster().prop_map(Op::Disconnect),
            4 => (cluster(), app(), 0u8..4).prop_map(|(c, a, h)| Op::Report(c, a, h)),
            1 => app().prop_map(Op::TakeUnheeded),
            1 => (0u8..4).prop_map(Op::Wait),
        ]
    }

    /// App `a` lives in namespace `ns{a % 2}`, so that scopes cover some apps and not others.
    pub(super) fn app(a: u8) -> AppKey {
        AppKey::new(format!("ns{}", a % 2), format!("a{a}"))
    }

    pub(super) fn cluster(c: u8) -> String {
        format!("c{c}")
    }

    /// The namespaces of the mask's bits: `ns0`, `ns1`, and `ns2`, where no app lives;
    /// none is every namespace.
    pub(super) fn scope(mask: u8) -> Scope {
        Scope::of(
            (0..3)
                .filter(|bit| mask & (1 << bit) != 0)
                .map(|n| format!("ns{n}")),
        )
    }

    /// A plan of [`Op::Set`]'s entries.
    pub(super) fn plan_of(entries: Vec<(u8, u8)>) -> BTreeMap<ClusterName, Desired> {
        (entries.into_iter())
            .map(|(c, what)| {
                let want = match what {
                    3 => Desired::Keep,
                    4 => Desired::Release,
                    h => rendered(&format!("h{h}")),
                };
                (cluster(c).into(), want)
            })
            .collect()
    }

    /// A Hello's list of [`Op::Connect`]'s entries.
    pub(super) fn hello_of(managed: Vec<(u8, u8)>) -> HashMap<AppKey, String> {
        (managed.into_iter())
            .map(|(a, h)| (app(a), format!("h{h}")))
            .collect()
    }

    pub(super) fn held(h: u8) -> Held {
        [Held::Present, Held::Absent, Held::Failed, Held::Drifted][usize::from(h)]
    }

    /// What an operation returned, to compare two indexes' answers.
    #[derive(Debug, PartialEq)]
    pub(super) enum Outcome {
        Pushes(Vec<Push>),
        Connected(Vec<Push>, Vec<Arc<AppKey>>),
        Unheeded(Vec<String>),
        Nothing,
    }

    /// Runs an [`Op`] on an index at the instant `at`, and returns what it returned. A
    /// macro, not a function, so that it drives `Index` and the `CompactIndex` checked
    /// against it alike: the two share their methods, not a trait.
    macro_rules! run {
        ($ix:expr, $op:expr, $at:expr) => {{
            use $crate::index::tests::{Op, Outcome, app, cluster, held, hello_of, plan_of, scope};
            let (ix, at) = ($ix, $at);
            match $op {
                Op::Set(a, generation, entries) => {
                    Outcome::Pushes(ix.set_app(&app(a), generation, plan_of(entries)))
                }
                Op::Delete(a, orphan, also) => {
                    let also: Vec<String> = also.into_iter().map(cluster).collect();
                    Outcome::Pushes(ix.delete_app(&app(a), orphan, &also, at))
                }
                Op::Drop(a, orphan) => Outcome::Pushes(ix.drop_app(&app(a), orphan, at)),
                Op::Replace(a, orphan) => Outcome::Pushes(ix.replace_app(&app(a), orphan, at)),
                Op::Forget(a) => {
                    ix.forget(&app(a));
                    Outcome::Nothing
                }
                Op::Retain(clusters) => {
                    ix.retain_clusters(&clusters.into_iter().map(cluster).collect());
                    Outcome::Nothing
                }
                Op::Connect(c, managed, namespaces) => {
                    let (pushes, keys) =
                        ix.connect(&cluster(c), &hello_of(managed), scope(namespaces));
                    Outcome::Connected(pushes, keys)
                }
                Op::Disconnect(c) => {
                    ix.disconnect(&cluster(c));
                    Outcome::Nothing
                }
                Op::Report(c, a, h) => Outcome::Pushes(ix.report(&cluster(c), &app(a), held(h))),
                Op::TakeUnheeded(a) => Outcome::Unheeded(ix.take_unheeded_claims(&app(a))),
                Op::Wait(_) => Outcome::Nothing,
            }
        }};
    }
    pub(super) use run;

    proptest::proptest! {
        /// Rule 3 against the claim wait: time lets a deletion go on only without a
        /// cluster that was waited for on its own claim alone.
        #[test]
        fn time_releases_only_claim_only_waiters(
            ops in proptest::collection::vec(arb_op(), 1..40)
        ) {
            let mut ix = Index::with_claim_wait(Duration::from_secs(1));
            for op in ops {
                run!(&mut ix, op, now());
            }
            let deleting: Vec<AppKey> = ix.deleting.keys().cloned().collect();
            for app in deleting {
                let before: BTreeSet<String> = ix.deletion_waiting_on(&app).into_iter().collect();
                let claimed: BTreeSet<String> = ix
                    .claimed
                    .get(&app)
                    .map(|c| c.keys().cloned().collect())
                    .unwrap_or_default();
                ix.delete_app(&app, false, &[], now() + Duration::from_secs(86_400));
                let after: BTreeSet<String> = ix.deletion_waiting_on(&app).into_iter().collect();
                for gone in before.difference(&after) {
                    proptest::prop_assert!(
                        claimed.contains(gone),
                        "{app}: {gone} was placed, sent or named, and time released it"
                    );
                }
            }
        }
    }

    proptest::proptest! {
        /// An agent's word counts only inside its scope: a Hello or a report never ends
        /// the wait of a deletion, or of a departure, for an app outside the scope of
        /// the agent that sent it (nor for one outside the scope it had when it reported).
        #[test]
        fn an_agent_confirms_nothing_outside_its_scope(
            ops in proptest::collection::vec(arb_op(), 1..40)
        ) {
            let mut ix = Index::default();
            for op in ops {
                let (c, outside): (String, Vec<AppKey>) = match &op {
                    Op::Connect(c, _, namespaces) => {
                        let scope = scope(*namespaces);
                        (cluster(*c), (0..APPS).map(app).filter(|k| !scope.covers(k)).collect())
                    }
                    Op::Report(c, a, _) if ix.scope_excludes(&cluster(*c), &app(*a)).is_some() => {
                        (cluster(*c), vec![app(*a)])
                    }
                    _ => (String::new(), Vec::new()),
                };
                let waited = |ix: &Index| -> Vec<(bool, bool)> {
                    (outside.iter())
                        .map(|k| (ix.deletion_waiting_on(k).contains(&c), ix.is_assigned(&c, k)))
                        .collect()
                };
                let before = waited(&ix);
                run!(&mut ix, op.clone(), now());
                let after = waited(&ix);
                for ((k, was), is) in outside.iter().zip(&before).zip(&after) {
                    let kept = |held_before: bool, held_after: bool| held_after || !held_before;
                    proptest::prop_assert!(
                        kept(was.0, is.0) && kept(was.1, is.1),
                        "{op:?}: {c} confirmed {k} outside its scope"
                    );
                }
            }
        }

        #[test]
        fn the_applied_count_always_equals_a_full_count(
            ops in proptest::collection::vec(arb_op(), 1..40)
        ) {
            let mut ix = Index::default();
            for op in ops {
                run!(&mut ix, op, now());
                let counted = ix
                    .desired
                    .by_cluster
                    .values()
                    .flat_map(|d| d.values())
                    .filter(|d| is_apply(d))
                    .count();
                proptest::prop_assert_eq!(ix.applied_pairs(), counted);
            }
        }
    }

    #[test]
    fn an_older_generation_never_replaces_a_newer_one() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), Some(5), plan(&[("c1", rendered("v5"))]));
        assert!(
            ix.set_app(&key("a"), Some(4), plan(&[("c1", rendered("v4"))]))
                .is_empty()
        );
        assert!(
            ix.set_app(&key("a"), Some(4), plan(&[])).is_empty(),
            "nor removes a cluster"
        );
        let (pushes, _) = ix.connect("c1", &HashMap::new(), Scope::All);
        assert_eq!(kinds(&pushes), [t("c1", "a", "apply v5")]);
        // The same generation re-planned (membership changed) is applied.
        assert_eq!(
            kinds(&ix.set_app(&key("a"), Some(5), plan(&[("c1", rendered("v5b"))]))),
            [t("c1", "a", "apply v5b")]
        );
    }

    #[test]
    fn a_plan_for_an_app_being_deleted_is_ignored() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), Some(1), plan(&[("c1", rendered("h"))]));
        ix.delete_app(&key("a"), false, &[], now());
        assert!(
            ix.set_app(&key("a"), Some(1), plan(&[("c1", rendered("h"))]))
                .is_empty()
        );
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1"]);
    }

    #[test]
    fn delete_while_an_apply_is_in_flight_sends_delete_and_waits() {
        let mut ix = Index::default();
        ix.connect("c1", &HashMap::new(), Scope::All);
        let pushes = ix.set_app(&key("a"), None, plan(&[("c1", rendered("h"))]));
        assert_eq!(kinds(&pushes), [t("c1", "a", "apply h")]);
        // No report yet: the agent may be applying it right now.
        let pushes = ix.delete_app(&key("a"), false, &[], now());
        assert_eq!(kinds(&pushes), [t("c1", "a", "delete orphan=false")]);
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1"]);
        ix.report("c1", &key("a"), Held::Present);
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1"]);
        ix.report("c1", &key("a"), Held::Absent);
        assert!(ix.deletion_waiting_on(&key("a")).is_empty());
    }

    #[test]
    fn an_orphaning_delete_while_an_apply_is_in_flight_releases_it() {
        let mut ix = Index::default();
        ix.connect("c1", &HashMap::new(), Scope::All);
        ix.set_app(&key("a"), None, plan(&[("c1", rendered("h"))]));
        let pushes = ix.delete_app(&key("a"), true, &[], now());
        assert_eq!(kinds(&pushes), [t("c1", "a", "delete orphan=true")]);
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1"]);
    }

    #[test]
    fn a_cluster_that_leaves_is_no_longer_waited_for() {
        let mut ix = Index::default();
        ix.set_app(
            &key("a"),
            None,
            plan(&[("c1", rendered("h")), ("c2", rendered("h"))]),
        );
        ix.delete_app(&key("a"), true, &[], now());
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1", "c2"]);
        ix.retain_clusters(&["c1".to_owned()].into());
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1"]);
        ix.connect("c1", &HashMap::new(), Scope::All);
        assert!(ix.deletion_waiting_on(&key("a")).is_empty());
    }

    /// Found by the planner's model test: an app deleted without its finalizer whose
    /// only holder then left stayed "being deleted" for ever, and so did a new app of
    /// the same name.
    #[test]
    fn an_unowned_deletion_whose_holders_all_left_is_over() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), Some(1), plan(&[("c1", rendered("h"))]));
        ix.drop_app(&key("a"), false, now());
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1"]);
        ix.retain_clusters(&BTreeSet::new());
        assert!(!ix.is_deleting(&key("a")));
        assert_eq!(
            kinds(&ix.set_app(&key("a"), Some(1), plan(&[("c2", rendered("h"))]))),
            [t("c2", "a", "apply h")]
        );
    }

    /// Found by the planner's model test: an app taken off a cluster whose agent was away
    /// (its Delete went nowhere), then deleted, waits for that cluster too (rule 3); its
    /// Hello says whether it still holds the MyApp.
    #[test]
    fn a_deletion_waits_for_a_cluster_the_app_left_while_its_agent_was_away() {
        let mut ix = Index::default();
        ix.connect("c1", &HashMap::new(), Scope::All);
        ix.set_app(&key("a"), Some(1), plan(&[("c1", rendered("h"))]));
        ix.report("c1", &key("a"), Held::Present);
        ix.disconnect("c1");
        ix.set_app(&key("a"), Some(2), plan(&[]));
        assert!(ix.is_placed("c1", &key("a")), "c1 may still hold it");
        ix.delete_app(&key("a"), false, &[], now());
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1"]);
        let (pushes, _) = ix.connect("c1", &hello(&[("a", "h")]), Scope::All);
        assert_eq!(kinds(&pushes), [t("c1", "a", "delete orphan=false")]);
        ix.report("c1", &key("a"), Held::Absent);
        assert!(ix.deletion_waiting_on(&key("a")).is_empty());
        assert!(!ix.is_placed("c1", &key("a")));
        // Taken off a connected cluster that says it no longer holds it: nothing waits.
        ix.set_app(&key("b"), Some(1), plan(&[("c1", rendered("h"))]));
        ix.set_app(&key("b"), Some(2), plan(&[]));
        ix.report("c1", &key("b"), Held::Absent);
        ix.disconnect("c1");
        ix.delete_app(&key("b"), false, &[], now());
        assert!(ix.deletion_waiting_on(&key("b")).is_empty());
    }

    #[test]
    fn a_desired_myapp_reported_absent_is_sent_again_but_a_failed_one_is_not() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), None, plan(&[("c1", rendered("h"))]));
        ix.connect("c1", &hello(&[("a", "h")]), Scope::All);
        assert_eq!(
            kinds(&ix.report("c1", &key("a"), Held::Absent)),
            [t("c1", "a", "apply h")],
            "deleted by hand in the member: restored"
        );
        assert!(ix.report("c1", &key("a"), Held::Failed).is_empty());
        assert!(ix.report("c1", &key("b"), Held::Absent).is_empty());
        ix.set_app(&key("a"), None, plan(&[("c1", Desired::Keep)]));
        assert!(
            ix.report("c1", &key("a"), Held::Absent).is_empty(),
            "Keep sends nothing"
        );
    }

    /// A MyApp changed in the member is sent again, once per drift: a drift the Apply
    /// cannot undo (a field the hub's MyApp does not set) is not answered in a loop; a
    /// report without it, or a new session, starts over. Only an Apply is re-sent.
    #[test]
    fn a_drifted_myapp_is_sent_again_once_per_drift() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), None, plan(&[("c1", rendered("h"))]));
        ix.set_app(&key("k"), None, plan(&[("c1", Desired::Keep)]));
        ix.connect("c1", &hello(&[("a", "h"), ("k", "h0")]), Scope::All);
        let drifted = |ix: &mut Index| kinds(&ix.report("c1", &key("a"), Held::Drifted));
        assert_eq!(drifted(&mut ix), [t("c1", "a", "apply h")]);
        assert!(drifted(&mut ix).is_empty(), "the same drift again");
        assert!(ix.report("c1", &key("a"), Held::Present).is_empty());
        assert_eq!(drifted(&mut ix), [t("c1", "a", "apply h")], "a new drift");
        ix.disconnect("c1");
        ix.connect("c1", &hello(&[("a", "h")]), Scope::All);
        assert_eq!(drifted(&mut ix), [t("c1", "a", "apply h")], "a new session");
        assert!(
            ix.report("c1", &key("k"), Held::Drifted).is_empty(),
            "a kept MyApp is not the hub's to re-apply"
        );
    }

    #[test]
    fn reports_from_disconnected_clusters_change_nothing() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), None, plan(&[("c1", rendered("h"))]));
        assert!(ix.report("c1", &key("a"), Held::Absent).is_empty());
    }

    #[test]
    fn an_app_deleted_without_its_finalizer_is_deleted_now_and_then_forgotten() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), None, plan(&[("c1", rendered("h"))]));
        ix.connect("c1", &hello(&[("a", "h")]), Scope::All);
        assert_eq!(
            kinds(&ix.drop_app(&key("a"), false, now())),
            [t("c1", "a", "delete orphan=false")]
        );
        ix.report("c1", &key("a"), Held::Absent);
        assert!(!ix.is_placed("c1", &key("a")), "forgotten once confirmed");
        assert!(
            ix.drop_app(&key("a"), false, now()).is_empty(),
            "unknown apps change nothing"
        );
        let (_, keys) = ix.connect("c2", &HashMap::new(), Scope::All);
        assert!(keys.is_empty());
    }

    /// Deleted without the finalizer and created again under the same name: the new
    /// object's plan (generation 1 after 7) decides, and only what it leaves out goes.
    #[test]
    fn a_new_object_under_the_same_name_takes_over_what_the_old_one_placed() {
        let mut ix = Index::default();
        let p = plan(&[("c1", rendered("h")), ("c2", rendered("h"))]);
        ix.set_app(&key("a"), Some(7), p);
        ix.connect("c1", &hello(&[("a", "h")]), Scope::All);
        assert!(ix.replace_app(&key("a"), false, now()).is_empty());
        assert!(!ix.is_deleting(&key("a")));
        let pushes = ix.set_app(&key("a"), Some(1), plan(&[("c1", rendered("h"))]));
        assert_eq!(
            kinds(&pushes),
            [t("c2", "a", "delete orphan=false")],
            "c1 keeps its MyApp: the new object wants it"
        );
    }

    /// The old object was being deleted (finalizer removed by hand mid-way, say) when the
    /// new one appeared: the deletion is called off, the new plan is applied.
    #[test]
    fn a_new_object_under_the_same_name_calls_off_a_deletion() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), Some(3), plan(&[("c1", rendered("h"))]));
        ix.delete_app(&key("a"), false, &[], now());
        assert!(ix.is_deleting(&key("a")));
        ix.replace_app(&key("a"), false, now());
        assert!(!ix.is_deleting(&key("a")));
        assert!(ix.deletion_waiting_on(&key("a")).is_empty());
        let pushes = ix.set_app(&key("a"), Some(1), plan(&[("c1", rendered("h"))]));
        assert_eq!(kinds(&pushes), [t("c1", "a", "apply h")]);
    }

    /// An old object that asked to be orphaned is released first; the new one waits.
    #[test]
    fn a_replaced_object_that_asked_to_be_orphaned_is_released_first() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), Some(3), plan(&[("c1", rendered("h"))]));
        ix.connect("c1", &hello(&[("a", "h")]), Scope::All);
        assert_eq!(
            kinds(&ix.replace_app(&key("a"), true, now())),
            [t("c1", "a", "delete orphan=true")]
        );
        assert!(ix.is_deleting(&key("a")));
        assert!(
            ix.set_app(&key("a"), Some(1), plan(&[("c1", rendered("h2"))]))
                .is_empty()
        );
        ix.report("c1", &key("a"), Held::Absent);
        assert!(!ix.is_deleting(&key("a")), "forgotten once released");
        assert_eq!(
            kinds(&ix.set_app(&key("a"), Some(1), plan(&[("c1", rendered("h2"))]))),
            [t("c1", "a", "apply h2")]
        );
    }

    #[test]
    fn a_cluster_reports_on_what_it_holds_after_the_app_left_its_placement() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), None, plan(&[("c1", rendered("h"))]));
        ix.connect("c1", &hello(&[("a", "h")]), Scope::All);
        ix.set_app(&key("a"), None, plan(&[]));
        assert!(
            ix.is_placed("c1", &key("a")),
            "its removal is still c1's to confirm"
        );
        ix.report("c1", &key("a"), Held::Absent);
        assert!(!ix.is_placed("c1", &key("a")));
        // Deleting the app now waits for nobody: c1 said it no longer holds it.
        ix.delete_app(&key("a"), false, &[], now());
        assert!(ix.deletion_waiting_on(&key("a")).is_empty());
    }
}
