//! [`CompactIndex`]: the [`Index`](super::Index) state machine kept compactly, for a hub
//! with thousands of clusters and apps: the same methods, the same answers, the same
//! safety rules.
//!
//! Every app and cluster name is interned once to a small id. Each app holds one dense
//! table of small per-pair records (its clusters, sorted by id: the desired state and a
//! byte of flags) where `Index` keeps a dozen maps keyed by strings; each cluster holds
//! the reverse (which apps have a record for it), its agent's scope and whether it is
//! connected. The maps that remain hash with foldhash.
//!
//! Ids do not leak over a long-running hub's churn: a pair record goes as soon as nothing
//! is left in it, an app's or a cluster's record as soon as it has no pair and no state of
//! its own, and its id is then reused by the next new name. What outlives the records
//! (claims, unheeded claims) is kept by name, never by an id that may be reused.
//!
//! `Index` is the oracle: `tests::the_compact_index_answers_as_the_index_does` drives both
//! over random operation sequences and compares every answer after every step.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::Hash;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{AppKey, Change, ClaimWait, Desired, Held, Push, Scope, is_apply};
use crate::placement::ClusterName;

type FastMap<K, V> = foldhash::HashMap<K, V>;
type FastSet<T> = foldhash::HashSet<T>;

/// An interned app.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct AppId(u32);

/// An interned cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct ClusterId(u32);

/// Names to small ids, each name stored once (the map and the record share it), the id of
/// a released name reused by the next new one: the records, indexed by id, never outnumber
/// the most names alive at once.
#[derive(Debug)]
struct Interner<N, R> {
    ids: FastMap<N, u32>,
    /// By id: the name and its record; `None` while the id is free.
    slots: Vec<Option<(N, R)>>,
    free: Vec<u32>,
}

impl<N, R> Default for Interner<N, R> {
    fn default() -> Self {
        Self {
            ids: FastMap::default(),
            slots: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<N: Hash + Eq + Clone, R: Default> Interner<N, R> {
    fn id<Q: Hash + Eq + ?Sized>(&self, name: &Q) -> Option<u32>
    where
        N: Borrow<Q>,
    {
        self.ids.get(name).copied()
    }

    /// The name's id, given a fresh record when it is new; `owned` makes the name to keep.
    fn intern<Q: Hash + Eq + ?Sized>(&mut self, name: &Q, owned: impl FnOnce() -> N) -> u32
    where
        N: Borrow<Q>,
    {
        if let Some(id) = self.id(name) {
            return id;
        }
        let name = owned();
        let slot = Some((name.clone(), R::default()));
        let id = match self.free.pop() {
            Some(id) => {
                self.slots[id as usize] = slot;
                id
            }
            None => {
                self.slots.push(slot);
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 names at once")
            }
        };
        self.ids.insert(name, id);
        id
    }

    fn slot(&self, id: u32) -> &(N, R) {
        self.slots[id as usize].as_ref().expect("a live id")
    }

    fn name(&self, id: u32) -> &N {
        &self.slot(id).0
    }

    fn get(&self, id: u32) -> &R {
        &self.slot(id).1
    }

    fn get_mut(&mut self, id: u32) -> &mut R {
        &mut self.slots[id as usize].as_mut().expect("a live id").1
    }

    /// The name and the record to change, at once.
    fn named_mut(&mut self, id: u32) -> (&N, &mut R) {
        let (name, record) = self.slots[id as usize].as_mut().expect("a live id");
        (name, record)
    }

    /// Forgets the name (its record is empty): its id is free for the next new name.
    fn release(&mut self, id: u32) {
        let (name, _) = self.slots[id as usize].take().expect("a live id");
        self.ids.remove(&name);
        self.free.push(id);
    }

    /// The live ids and their names.
    fn live(&self) -> impl Iterator<Item = (u32, &N)> {
        (0u32..)
            .zip(&self.slots)
            .filter_map(|(id, slot)| slot.as_ref().map(|(name, _)| (id, name)))
    }
}

/// What the index knows of one (app, cluster) pair besides its desired state, a bit each.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Flags(u8);

impl Flags {
    /// The app's latest plan places it on the cluster (`Index`'s `placed`).
    const PLACED: u8 = 1;
    /// A plan took the app off the cluster, which has not said since that it no longer
    /// holds it (`departed`).
    const DEPARTED: u8 = 1 << 1;
    /// The app's deletion waits for the cluster (`deleting`); set only while the app's
    /// record has a deletion.
    const WAITING: u8 = 1 << 2;
    /// The cluster's connected agent says it manages the MyApp (`present`).
    const PRESENT: u8 = 1 << 3;
    /// Its agent reported the MyApp drifted this session and the Apply was sent again
    /// (`drifted`).
    const DRIFTED: u8 = 1 << 4;

    /// Whether any of `bits` is set.
    fn has(self, bits: u8) -> bool {
        self.0 & bits != 0
    }

    fn set(&mut self, bits: u8) {
        self.0 |= bits;
    }

    fn clear(&mut self, bits: u8) {
        self.0 &= !bits;
    }
}

/// One cluster's record in an app's table: 24 bytes.
#[derive(Debug)]
struct Pair {
    cluster: ClusterId,
    flags: Flags,
    desired: Option<Desired>,
}

impl Pair {
    fn new(cluster: ClusterId) -> Self {
        Self {
            cluster,
            flags: Flags::default(),
            desired: None,
        }
    }

    fn is_empty(&self) -> bool {
        self.flags == Flags::default() && self.desired.is_none()
    }
}

/// The clusters an app's deletion waits for only on their own claim, and when that wait
/// ends. By name: a claim outlives its pair (a claimer that confirmed is still told from a
/// new one by it), and an id may be reused by another cluster meanwhile.
type Claims = BTreeMap<ClusterName, Instant>;

#[derive(Debug, Default)]
struct AppRecord {
    /// The newest generation planned; older plans are ignored.
    generation: Option<i64>,
    /// A plan was set (even one placing it nowhere) since the app was last deleted or
    /// forgotten: [`CompactIndex::drop_app`] acts on it.
    planned: bool,
    /// While the app is being deleted: its claims.
    deleting: Option<Claims>,
    /// Deleted with no finalizer to hold it: forgotten once every cluster confirmed.
    unowned: bool,
    /// Its clusters, sorted by id.
    pairs: Vec<Pair>,
}

impl AppRecord {
    fn find(&self, cluster: ClusterId) -> Result<usize, usize> {
        // An app placed on every cluster has each at its own id's index (ids are dense,
        // the table sorted by id): one probe rather than a search through a table of
        // thousands, each step a cache miss when a Hello or a round of reports reads
        // one pair of every app.
        let at = cluster.0 as usize;
        if self
            .pairs
            .get(at)
            .is_some_and(|pair| pair.cluster == cluster)
        {
            return Ok(at);
        }
        self.pairs
            .binary_search_by_key(&cluster, |pair| pair.cluster)
    }

    fn pair(&self, cluster: ClusterId) -> Option<&Pair> {
        self.find(cluster).ok().map(|i| &self.pairs[i])
    }

    fn pair_mut(&mut self, cluster: ClusterId) -> Option<&mut Pair> {
        self.find(cluster).ok().map(|i| &mut self.pairs[i])
    }

    fn waits_for_anyone(&self) -> bool {
        self.pairs.iter().any(|pair| pair.flags.has(Flags::WAITING))
    }

    fn is_unused(&self) -> bool {
        self.pairs.is_empty()
            && self.generation.is_none()
            && !self.planned
            && self.deleting.is_none()
            && !self.unowned
    }
}

/// What a Hello says of a cluster's pairs ([`CompactIndex::connect`]).
#[derive(Debug, Default)]
struct Hello {
    /// How many of the apps it lists (in its scope) have a pair for the cluster.
    listed: usize,
    /// The apps the cluster should have, each with what to send it, if anything.
    desired: Vec<(Arc<AppKey>, Option<Change>)>,
    /// Apps being deleted that the agent still holds.
    held: Vec<Arc<AppKey>>,
    /// Apps whose deletion or departure waits on the cluster, which its agent does not
    /// hold.
    gone: Vec<AppId>,
    /// Pairs nothing is left in (the agent no longer holds the app).
    emptied: Vec<AppId>,
}

#[derive(Debug, Default)]
struct ClusterRecord {
    /// The apps whose tables hold a pair for this cluster (the reverse of those tables), so
    /// that a Hello, a disconnect or the cluster's desired list reads the cluster's own
    /// pairs rather than every app.
    apps: FastSet<AppId>,
    /// Its agent said Hello since it last connected: what it holds is known.
    connected: bool,
    /// The connected agent's scope; `All` while none is connected.
    scope: Scope,
}

/// The same state machine as [`Index`](super::Index), with the same methods and answers;
/// see the module.
#[derive(Debug, Default)]
pub struct CompactIndex {
    apps: Interner<Arc<AppKey>, AppRecord>,
    clusters: Interner<ClusterName, ClusterRecord>,
    /// Number of pairs with an `Apply`, kept in step.
    applied: usize,
    claim_wait: ClaimWait,
    /// Claims whose wait ended since the last [`CompactIndex::take_unheeded_claims`], by
    /// name: their app may be forgotten, their cluster unregistered, before they are
    /// taken.
    unheeded: Vec<(Arc<AppKey>, ClusterName)>,
}

impl CompactIndex {
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
        if let Some(app) = self.app_id(key) {
            let record = self.app(app);
            let older =
                matches!((generation, record.generation), (Some(g), Some(seen)) if g < seen);
            if record.deleting.is_some() || older {
                return Vec::new();
            }
        }
        let app = self.intern_app(key);
        if generation.is_some() {
            self.app_mut(app).generation = generation;
        }
        let shared = self.key(app).clone();
        // The plan's clusters in its (name) order, and sorted by id to look them up.
        let placed: Vec<ClusterId> = (plan.keys())
            .map(|name| ClusterId(self.clusters.intern(name.as_str(), || name.clone())))
            .collect();
        let mut in_plan = placed.clone();
        in_plan.sort_unstable();
        // Taken off the clusters the last plan placed it on and this one leaves out, in
        // name order: each is sent its Delete and, until it says it no longer holds the
        // app, a deletion would wait for it (departed).
        let mut left: Vec<ClusterId> = (self.app(app).pairs.iter())
            .filter(|pair| {
                pair.flags.has(Flags::PLACED) && in_plan.binary_search(&pair.cluster).is_err()
            })
            .map(|pair| pair.cluster)
            .collect();
        self.sort_by_name(&mut left);
        let mut pushes = Vec::new();
        for cluster in left {
            self.set_desired(app, cluster, None);
            self.set_flags(app, cluster, Flags::DEPARTED);
            let delete = Change::Delete { orphan: false };
            pushes.push((self.name(cluster).to_string(), shared.clone(), delete));
        }
        for pair in &mut self.app_mut(app).pairs {
            if in_plan.binary_search(&pair.cluster).is_ok() {
                pair.flags.clear(Flags::DEPARTED);
            }
            pair.flags.clear(Flags::PLACED);
        }
        self.add_pairs(app, &placed);
        for (cluster, (name, want)) in placed.into_iter().zip(plan) {
            let rendered = match &want {
                Desired::Apply(rendered) => Some(rendered.clone()),
                Desired::Keep | Desired::Release => None,
            };
            let previous = self.set_desired(app, cluster, Some(want));
            self.set_flags(app, cluster, Flags::PLACED);
            if let Some(rendered) = rendered {
                let unchanged =
                    matches!(&previous, Some(Desired::Apply(p)) if p.hash == rendered.hash);
                if !unchanged {
                    pushes.push((name.to_string(), shared.clone(), Change::Apply(rendered)));
                }
            }
        }
        self.app_mut(app).planned = true;
        self.tidy_app(app);
        pushes
    }

    /// Starts (or continues: called again until it is over) deleting an app, as
    /// [`Index::delete_app`](super::Index::delete_app) does.
    pub fn delete_app(
        &mut self,
        key: &AppKey,
        orphan: bool,
        also: &[String],
        now: Instant,
    ) -> Vec<Push> {
        let app = self.intern_app(key);
        let pushes = self.start_deletion(app, orphan, also, now);
        self.tidy_app(app);
        pushes
    }

    /// [`CompactIndex::delete_app`] on an interned app, leaving its records to tidy.
    fn start_deletion(
        &mut self,
        app: AppId,
        orphan: bool,
        also: &[String],
        now: Instant,
    ) -> Vec<Push> {
        let trusted = self.mark_deleting(app, also);
        let is_trusted = |cluster: ClusterId| trusted.binary_search(&cluster).is_ok();
        // Visited in name order: the trusted, and the clusters whose connected agent says
        // it holds the app (a claim, when it is not trusted).
        let mut candidates: Vec<ClusterId> = (self.app(app).pairs.iter())
            .filter(|pair| is_trusted(pair.cluster) || pair.flags.has(Flags::PRESENT))
            .map(|pair| pair.cluster)
            .collect();
        self.sort_by_name(&mut candidates);
        let wait = self.claim_wait.0;
        let mut pushes = Vec::new();
        for cluster in candidates {
            let held = self.holds(app, cluster);
            let before = self.set_desired(app, cluster, None);
            // A connected agent that has not reported the MyApp may still be applying an
            // Apply sent this session: only "never sent, never held" is known absence.
            let may_hold = match held {
                Some(held) => held || matches!(before, Some(Desired::Apply(_) | Desired::Keep)),
                None => true,
            };
            if !may_hold {
                continue;
            }
            let name = self.name(cluster).clone();
            let waiting = self.is_waiting(app, cluster);
            let claims = self.claims_mut(app);
            // Waited for only on its agent's claim, and not for an orphaning delete: for a
            // while (see `Index::delete_app`).
            let claim_only =
                !orphan && !is_trusted(cluster) && (claims.contains_key(&name) || !waiting);
            if !claim_only {
                claims.remove(&name);
            } else if let Some(ends) = claims.get(&name) {
                if now >= *ends {
                    continue;
                }
            } else {
                // First heard of: sent the Delete at least once, however short the wait.
                claims.insert(name.clone(), now + wait);
            }
            if held.is_some() && before != Some(Desired::Release) {
                pushes.push((
                    name.to_string(),
                    self.key(app).clone(),
                    Change::Delete { orphan },
                ));
            }
            if orphan {
                // Kept in the desired set so that reconnecting agents release it rather
                // than collect it as an orphan.
                self.set_desired(app, cluster, Some(Desired::Release));
            }
            self.set_flags(app, cluster, Flags::WAITING);
        }
        self.unheed_ended_claims(app, &trusted, now);
        pushes
    }

    /// The app's deletion starts (or goes on): the clusters waited for on the hub's own
    /// word, sorted by id, are those its last plan placed it on, those a plan took it off
    /// without a word since, and `also` (its spec names them). Each of `also` gets a pair,
    /// so that tidying the app finds every cluster interned here.
    fn mark_deleting(&mut self, app: AppId, also: &[String]) -> Vec<ClusterId> {
        let mut trusted: Vec<ClusterId> =
            also.iter().map(|name| self.intern_cluster(name)).collect();
        for &cluster in &trusted {
            self.entry(app, cluster);
        }
        let record = self.app_mut(app);
        record.planned = false;
        record.deleting.get_or_insert_default();
        for pair in &mut record.pairs {
            if pair.flags.has(Flags::PLACED | Flags::DEPARTED) {
                trusted.push(pair.cluster);
            }
            pair.flags.clear(Flags::PLACED | Flags::DEPARTED);
        }
        trusted.sort_unstable();
        trusted.dedup();
        trusted
    }

    /// The claimers whose wait ended are no longer waited for, connected or not (the
    /// deletion's loop visits only those connected), and are told of once.
    fn unheed_ended_claims(&mut self, app: AppId, trusted: &[ClusterId], now: Instant) {
        let ended: Vec<ClusterName> = (self.claims_mut(app).iter())
            .filter(|(_, ends)| now >= **ends)
            .map(|(name, _)| name.clone())
            .collect();
        for name in ended {
            // A claimer without a record has no pair: it is not waited for.
            let Some(cluster) = self.cluster_id(&name) else {
                continue;
            };
            if trusted.binary_search(&cluster).is_err() && self.is_waiting(app, cluster) {
                self.clear_flags(app, cluster, Flags::WAITING);
                self.unheeded.push((self.key(app).clone(), name));
            }
        }
    }

    fn is_waiting(&self, app: AppId, cluster: ClusterId) -> bool {
        self.pair(app, cluster)
            .is_some_and(|pair| pair.flags.has(Flags::WAITING))
    }

    /// The clusters whose claim-only wait on `key`'s deletion ended since the last call
    /// for it: the deletion went on without them.
    pub fn take_unheeded_claims(&mut self, key: &AppKey) -> Vec<String> {
        let (mine, others): (Vec<_>, Vec<_>) = std::mem::take(&mut self.unheeded)
            .into_iter()
            .partition(|(app, _)| **app == *key);
        self.unheeded = others;
        mine.into_iter()
            .map(|(_, cluster)| cluster.to_string())
            .collect()
    }

    /// The app vanished from the host without its finalizer, as
    /// [`Index::drop_app`](super::Index::drop_app).
    pub fn drop_app(&mut self, key: &AppKey, orphan: bool, now: Instant) -> Vec<Push> {
        let Some(app) = self.app_id(key) else {
            return Vec::new();
        };
        let record = self.app(app);
        if !record.planned && record.deleting.is_none() {
            return Vec::new();
        }
        let pushes = self.start_deletion(app, orphan, &[], now);
        if self.app(app).waits_for_anyone() {
            self.app_mut(app).unowned = true;
        } else {
            self.clear_app(app);
        }
        self.tidy_app(app);
        pushes
    }

    /// The app's object left the host and another of the same name is already listed, as
    /// [`Index::replace_app`](super::Index::replace_app).
    pub fn replace_app(&mut self, key: &AppKey, orphan: bool, now: Instant) -> Vec<Push> {
        let app = self.app_id(key);
        let releasing = app.is_some_and(|app| {
            (self.app(app).pairs.iter()).any(|pair| pair.desired == Some(Desired::Release))
        });
        if orphan || releasing {
            return self.drop_app(key, true, now);
        }
        if let Some(app) = app {
            self.end_deletion(app);
            let record = self.app_mut(app);
            record.unowned = false;
            record.generation = None;
            self.tidy_app(app);
        }
        Vec::new()
    }

    /// Whether the app is being deleted: plans for it change nothing until it is
    /// forgotten.
    pub fn is_deleting(&self, key: &AppKey) -> bool {
        self.app_id(key)
            .is_some_and(|app| self.app(app).deleting.is_some())
    }

    /// Clusters that still hold an app being deleted; empty once it is gone everywhere.
    pub fn deletion_waiting_on(&self, key: &AppKey) -> Vec<String> {
        let Some(app) = self.app_id(key) else {
            return Vec::new();
        };
        let mut waiting: Vec<String> = (self.app(app).pairs.iter())
            .filter(|pair| pair.flags.has(Flags::WAITING))
            .map(|pair| self.name(pair.cluster).to_string())
            .collect();
        waiting.sort_unstable();
        waiting
    }

    /// Forgets a deleted app once its finalizer is gone.
    pub fn forget(&mut self, key: &AppKey) {
        if let Some(app) = self.app_id(key) {
            self.clear_app(app);
            self.tidy_app(app);
        }
    }

    /// [`CompactIndex::forget`] on an interned app, leaving its records to tidy: all but
    /// what agents say they hold.
    fn clear_app(&mut self, app: AppId) {
        self.end_deletion(app);
        let record = self.apps.get_mut(app.0);
        record.unowned = false;
        record.generation = None;
        record.planned = false;
        for pair in &mut record.pairs {
            let desired = pair.desired.take();
            self.applied -= usize::from(desired.as_ref().is_some_and(is_apply));
            pair.flags
                .clear(Flags::PLACED | Flags::DEPARTED | Flags::DRIFTED);
        }
    }

    /// The app is no longer being deleted: nobody is waited for, no claim is kept.
    fn end_deletion(&mut self, app: AppId) {
        let record = self.app_mut(app);
        record.deleting = None;
        for pair in &mut record.pairs {
            pair.flags.clear(Flags::WAITING);
        }
    }

    /// The registered clusters changed: a cluster that left is no longer waited for, and
    /// everything of it is forgotten. A deletion no finalizer holds that waited only for
    /// clusters that left is over.
    pub fn retain_clusters(&mut self, registered: &BTreeSet<String>) {
        let leaving: Vec<ClusterId> = (self.clusters.live())
            .filter(|(_, name)| !registered.contains(name.as_str()))
            .map(|(id, _)| ClusterId(id))
            .collect();
        let mut touched = Vec::new();
        for cluster in leaving {
            for app in std::mem::take(&mut self.cluster_mut(cluster).apps) {
                let record = self.apps.get_mut(app.0);
                let i = record.find(cluster).expect("the reverse index is in step");
                let pair = record.pairs.remove(i);
                self.applied -= usize::from(pair.desired.as_ref().is_some_and(is_apply));
                touched.push(app);
            }
            self.clusters.release(cluster.0);
        }
        let apps: Vec<AppId> = self.apps.live().map(|(id, _)| AppId(id)).collect();
        for app in apps {
            let record = self.apps.get_mut(app.0);
            if let Some(claims) = &mut record.deleting {
                claims.retain(|name, _| registered.contains(name.as_str()));
            }
            if record.unowned && !record.waits_for_anyone() {
                self.clear_app(app);
                touched.push(app);
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for app in touched {
            self.tidy_app(app);
        }
    }

    /// An agent said Hello with the hashes of the apps it manages in `scope`, as
    /// [`Index::connect`](super::Index::connect). The Deletes for apps being deleted that
    /// it still holds follow the diff, in key order (the oracle's are in no set order).
    pub fn connect(
        &mut self,
        cluster: &str,
        managed: &HashMap<AppKey, String>,
        scope: Scope,
    ) -> (Vec<Push>, Vec<Arc<AppKey>>) {
        let id = self.intern_cluster(cluster);
        let Hello {
            listed,
            mut desired,
            mut held,
            gone,
            emptied,
        } = self.read_hello(id, managed, &scope);
        // What it holds that has no pair for it yet (never placed there): a pair now.
        let covered = || managed.keys().filter(|key| scope.covers(key));
        if listed < covered().count() {
            for key in covered() {
                let app = self.intern_app(key);
                self.set_flags(app, id, Flags::PRESENT);
            }
        }
        let record = self.cluster_mut(id);
        record.connected = true;
        record.scope = scope;
        desired.sort_unstable_by(|(a, _), (b, _)| a.cmp(b));
        let mut pushes = Vec::new();
        let mut keys = Vec::with_capacity(desired.len());
        for (key, change) in desired {
            if let Some(change) = change {
                pushes.push((cluster.to_owned(), key.clone(), change));
            }
            keys.push(key);
        }
        // A deletion the agent still holds is sent as an explicit Delete: it is the host's
        // word for that object, not a collection for the circuit breaker to hold back.
        held.sort_unstable();
        let delete = |key| (cluster.to_owned(), key, Change::Delete { orphan: false });
        pushes.extend(held.into_iter().map(delete));
        for &app in &gone {
            self.confirm_gone(app, id);
        }
        for app in gone {
            self.tidy_app(app);
        }
        self.drop_empty_pairs(id, emptied);
        self.release_cluster_if_unused(id);
        (pushes, keys)
    }

    /// What a Hello (`managed`, in `scope`) says of the cluster's pairs, read in one pass
    /// with one lookup each (a fleet's Hellos read every pair): each pair's `PRESENT` is
    /// what the agent says now (outside its scope, nothing is believed).
    fn read_hello(
        &mut self,
        cluster: ClusterId,
        managed: &HashMap<AppKey, String>,
        scope: &Scope,
    ) -> Hello {
        let apps: Vec<AppId> = self.cluster(cluster).apps.iter().copied().collect();
        let mut hello = Hello::default();
        for app in apps {
            let (key, record) = self.apps.named_mut(app.0);
            let i = record.find(cluster).expect("the reverse index is in step");
            let pair = &mut record.pairs[i];
            let covered = scope.covers(key);
            let hash = covered.then(|| managed.get(&**key)).flatten();
            match hash {
                Some(_) => {
                    hello.listed += 1;
                    pair.flags.set(Flags::PRESENT);
                }
                None => pair.flags.clear(Flags::PRESENT),
            }
            if let Some(want) = &pair.desired {
                let change = match (want, hash) {
                    (Desired::Apply(r), hash) if hash != Some(&r.hash) => {
                        Some(Change::Apply(r.clone()))
                    }
                    (Desired::Release, Some(_)) => Some(Change::Delete { orphan: true }),
                    _ => None,
                };
                hello.desired.push((key.clone(), change));
            }
            // Outside the agent's scope the app is unknown to it: a deletion (or a
            // departure) waits for it as if the agent were away.
            if covered {
                if pair.flags.has(Flags::WAITING | Flags::DEPARTED) && hash.is_none() {
                    hello.gone.push(app);
                } else if pair.flags.has(Flags::WAITING) && pair.desired.is_none() {
                    hello.held.push(key.clone());
                }
            }
            if pair.is_empty() {
                hello.emptied.push(app);
            }
        }
        hello
    }

    /// The keys the cluster should have, for a SyncComplete, in order: the index's own
    /// handles.
    pub fn desired_shared(&self, cluster: &str) -> Vec<Arc<AppKey>> {
        let Some(id) = self.cluster_id(cluster) else {
            return Vec::new();
        };
        (self.desired_apps(id).into_iter())
            .map(|app| self.key(app).clone())
            .collect()
    }

    /// The apps the cluster should have, in key order.
    fn desired_apps(&self, cluster: ClusterId) -> Vec<AppId> {
        let mut apps: Vec<AppId> = (self.cluster(cluster).apps.iter())
            .filter(|&&app| self.pair(app, cluster).is_some_and(|p| p.desired.is_some()))
            .copied()
            .collect();
        apps.sort_unstable_by(|a, b| self.key(*a).cmp(self.key(*b)));
        apps
    }

    /// The agent went away: what it holds is unknown until it says Hello again.
    pub fn disconnect(&mut self, cluster: &str) {
        let Some(id) = self.cluster_id(cluster) else {
            return;
        };
        let apps: Vec<AppId> = self.cluster(id).apps.iter().copied().collect();
        for app in apps {
            self.clear_flags(app, id, Flags::PRESENT | Flags::DRIFTED);
        }
        let record = self.cluster_mut(id);
        record.connected = false;
        record.scope = Scope::All;
        self.tidy_cluster(id);
    }

    /// The agent reported on an app, as [`Index::report`](super::Index::report).
    pub fn report(&mut self, cluster: &str, key: &AppKey, held: Held) -> Vec<Push> {
        let Some(id) = self.cluster_id(cluster) else {
            return Vec::new();
        };
        let record = self.cluster(id);
        if !record.connected || !record.scope.covers(key) {
            return Vec::new();
        }
        match held {
            Held::Present => {
                let app = self.intern_app(key);
                let flags = &mut self.entry(app, id).flags;
                flags.set(Flags::PRESENT);
                flags.clear(Flags::DRIFTED);
                Vec::new()
            }
            Held::Drifted => {
                let app = self.intern_app(key);
                let flags = &mut self.entry(app, id).flags;
                flags.set(Flags::PRESENT);
                if flags.has(Flags::DRIFTED) {
                    // The same drift again: answered once only.
                    return Vec::new();
                }
                flags.set(Flags::DRIFTED);
                self.resend(app, id)
            }
            Held::Failed => {
                if let Some(app) = self.app_id(key) {
                    self.clear_flags(app, id, Flags::DRIFTED);
                    self.tidy_app(app);
                }
                Vec::new()
            }
            Held::Absent => {
                let Some(app) = self.app_id(key) else {
                    return Vec::new();
                };
                self.clear_flags(app, id, Flags::PRESENT | Flags::DRIFTED);
                self.confirm_gone(app, id);
                let pushes = self.resend(app, id);
                self.tidy_app(app);
                pushes
            }
        }
    }

    /// The app's Apply for the cluster again, when it should have one.
    fn resend(&self, app: AppId, cluster: ClusterId) -> Vec<Push> {
        match self.pair(app, cluster).and_then(|p| p.desired.as_ref()) {
            Some(Desired::Apply(r)) => {
                let name = self.name(cluster).to_string();
                vec![(name, self.key(app).clone(), Change::Apply(r.clone()))]
            }
            _ => Vec::new(),
        }
    }

    /// Whether the cluster's connected agent holds the app, by its own word; `None` when
    /// it cannot say (away, or the app is outside its scope).
    fn holds(&self, app: AppId, cluster: ClusterId) -> Option<bool> {
        let record = self.cluster(cluster);
        let known = record.connected && record.scope.covers(self.key(app));
        known.then(|| {
            self.pair(app, cluster)
                .is_some_and(|p| p.flags.has(Flags::PRESENT))
        })
    }

    /// Why a connected cluster cannot confirm the app's deletion, when the reason is its
    /// agent's scope: the namespaces it covers.
    pub fn scope_excludes(&self, cluster: &str, key: &AppKey) -> Option<&BTreeSet<String>> {
        match &self.cluster(self.cluster_id(cluster)?).scope {
            Scope::Namespaces(namespaces) if !namespaces.contains(&key.namespace) => {
                Some(namespaces)
            }
            _ => None,
        }
    }

    /// The cluster's agent said it does not hold the app (its Hello, or a report).
    fn confirm_gone(&mut self, app: AppId, cluster: ClusterId) {
        self.clear_flags(app, cluster, Flags::DEPARTED);
        if self.app(app).deleting.is_none() {
            return;
        }
        self.clear_flags(app, cluster, Flags::WAITING);
        if self.pair(app, cluster).and_then(|p| p.desired.as_ref()) == Some(&Desired::Release) {
            self.set_desired(app, cluster, None);
        }
        let record = self.app(app);
        if record.unowned && !record.waits_for_anyone() {
            self.clear_app(app);
        }
    }

    /// Whether `key` is this cluster's to report on: an app it should have, is deleting,
    /// was taken off it without a word since, or last said it holds.
    pub fn is_placed(&self, cluster: &str, key: &AppKey) -> bool {
        self.pair_of(cluster, key).is_some_and(|pair| {
            pair.desired.is_some()
                || (pair.flags).has(Flags::WAITING | Flags::DEPARTED | Flags::PRESENT)
        })
    }

    /// Whether `key` is this cluster's on the hub's own word: an app it should have, is
    /// deleting, or was taken off it without a word since (not one it only claims).
    pub fn is_assigned(&self, cluster: &str, key: &AppKey) -> bool {
        self.pair_of(cluster, key).is_some_and(|pair| {
            pair.desired.is_some() || pair.flags.has(Flags::WAITING | Flags::DEPARTED)
        })
    }

    /// Number of (cluster, app) pairs with an `Apply`.
    pub fn applied_pairs(&self) -> usize {
        self.applied
    }

    fn app_id(&self, key: &AppKey) -> Option<AppId> {
        self.apps.id(key).map(AppId)
    }

    fn intern_app(&mut self, key: &AppKey) -> AppId {
        AppId(self.apps.intern(key, || Arc::new(key.clone())))
    }

    fn cluster_id(&self, name: &str) -> Option<ClusterId> {
        self.clusters.id(name).map(ClusterId)
    }

    fn intern_cluster(&mut self, name: &str) -> ClusterId {
        ClusterId(self.clusters.intern(name, || ClusterName::from(name)))
    }

    fn app(&self, app: AppId) -> &AppRecord {
        self.apps.get(app.0)
    }

    fn app_mut(&mut self, app: AppId) -> &mut AppRecord {
        self.apps.get_mut(app.0)
    }

    fn cluster(&self, cluster: ClusterId) -> &ClusterRecord {
        self.clusters.get(cluster.0)
    }

    fn cluster_mut(&mut self, cluster: ClusterId) -> &mut ClusterRecord {
        self.clusters.get_mut(cluster.0)
    }

    /// The app's shared key.
    fn key(&self, app: AppId) -> &Arc<AppKey> {
        self.apps.name(app.0)
    }

    fn name(&self, cluster: ClusterId) -> &ClusterName {
        self.clusters.name(cluster.0)
    }

    fn sort_by_name(&self, clusters: &mut [ClusterId]) {
        clusters.sort_unstable_by(|a, b| self.name(*a).cmp(self.name(*b)));
    }

    fn claims_mut(&mut self, app: AppId) -> &mut Claims {
        (self.app_mut(app).deleting.as_mut()).expect("the app is being deleted")
    }

    fn pair(&self, app: AppId, cluster: ClusterId) -> Option<&Pair> {
        self.app(app).pair(cluster)
    }

    fn pair_of(&self, cluster: &str, key: &AppKey) -> Option<&Pair> {
        self.pair(self.app_id(key)?, self.cluster_id(cluster)?)
    }

    /// The pair's record, made empty when it has none.
    fn entry(&mut self, app: AppId, cluster: ClusterId) -> &mut Pair {
        let record = self.apps.get_mut(app.0);
        let i = match record.find(cluster) {
            Ok(i) => i,
            Err(i) => {
                record.pairs.insert(i, Pair::new(cluster));
                self.clusters.get_mut(cluster.0).apps.insert(app);
                i
            }
        };
        &mut record.pairs[i]
    }

    /// Enters empty pairs for those of `clusters` (distinct) the app has none for, in one
    /// go: one by one, each would move the rest of the sorted table, and a plan from cold
    /// enters every cluster of its app.
    fn add_pairs(&mut self, app: AppId, clusters: &[ClusterId]) {
        let record = self.apps.get_mut(app.0);
        let known = record.pairs.len();
        for &cluster in clusters {
            let table = &record.pairs[..known];
            if table
                .binary_search_by_key(&cluster, |pair| pair.cluster)
                .is_err()
            {
                record.pairs.push(Pair::new(cluster));
                self.clusters.get_mut(cluster.0).apps.insert(app);
            }
        }
        if record.pairs.len() > known {
            record.pairs.sort_unstable_by_key(|pair| pair.cluster);
        }
    }

    fn set_flags(&mut self, app: AppId, cluster: ClusterId, bits: u8) {
        self.entry(app, cluster).flags.set(bits);
    }

    fn clear_flags(&mut self, app: AppId, cluster: ClusterId, bits: u8) {
        if let Some(pair) = self.app_mut(app).pair_mut(cluster) {
            pair.flags.clear(bits);
        }
    }

    /// Replaces the pair's desired state, keeping the count of `Apply` pairs in step;
    /// returns the previous one.
    fn set_desired(
        &mut self,
        app: AppId,
        cluster: ClusterId,
        want: Option<Desired>,
    ) -> Option<Desired> {
        self.applied += usize::from(want.as_ref().is_some_and(is_apply));
        let previous = match want {
            Some(want) => self.entry(app, cluster).desired.replace(want),
            None => (self.app_mut(app).pair_mut(cluster)).and_then(|pair| pair.desired.take()),
        };
        self.applied -= usize::from(previous.as_ref().is_some_and(is_apply));
        previous
    }

    /// Drops the app's empty pairs, then the records (the app's, its clusters') that
    /// nothing is left in.
    fn tidy_app(&mut self, app: AppId) {
        let mut emptied = Vec::new();
        self.app_mut(app).pairs.retain(|pair| {
            let empty = pair.is_empty();
            if empty {
                emptied.push(pair.cluster);
            }
            !empty
        });
        for cluster in emptied {
            self.cluster_mut(cluster).apps.remove(&app);
            self.release_cluster_if_unused(cluster);
        }
        if self.app(app).is_unused() {
            self.apps.release(app.0);
        }
    }

    /// Drops the cluster's empty pairs, then the records (the cluster's, its apps') that
    /// nothing is left in.
    fn tidy_cluster(&mut self, cluster: ClusterId) {
        let apps: Vec<AppId> = self.cluster(cluster).apps.iter().copied().collect();
        self.drop_empty_pairs(cluster, apps);
        self.release_cluster_if_unused(cluster);
    }

    /// Drops the cluster's pairs of `apps` that are empty, then the apps' records that
    /// nothing is left in.
    fn drop_empty_pairs(&mut self, cluster: ClusterId, apps: Vec<AppId>) {
        for app in apps {
            let record = self.app_mut(app);
            if let Ok(i) = record.find(cluster)
                && record.pairs[i].is_empty()
            {
                record.pairs.remove(i);
                self.cluster_mut(cluster).apps.remove(&app);
                if self.app(app).is_unused() {
                    self.apps.release(app.0);
                }
            }
        }
    }

    fn release_cluster_if_unused(&mut self, cluster: ClusterId) {
        let record = self.cluster(cluster);
        if record.apps.is_empty() && !record.connected {
            self.clusters.release(cluster.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::index::Index;
    use crate::index::tests::{
        APPS, CLUSTERS, Op, Outcome, app, arb_op_among, cluster, now, rendered, run,
    };

    /// The oracle's outcome in the order the compact index gives it. The oracle lists a
    /// Hello's Deletes for apps being deleted that the agent still holds (after the
    /// diff of its desired keys, in key order) in the order of a `HashMap`; the compact
    /// index in key order. Nothing relies on that order: the hub queues a session's
    /// pushes as given (dispatch's `Pending::start` takes their increasing prefix as the
    /// initial diff and queues the rest in turn), and each is for a distinct key. Every
    /// other outcome is compared in the oracle's own order.
    fn canonical(outcome: Outcome) -> Outcome {
        match outcome {
            Outcome::Connected(pushes, keys) => {
                let (diff, mut deletes): (Vec<Push>, Vec<Push>) =
                    (pushes.into_iter()).partition(|(_, key, _)| keys.binary_search(key).is_ok());
                deletes.sort_by(|a, b| a.1.cmp(&b.1));
                Outcome::Connected(diff.into_iter().chain(deletes).collect(), keys)
            }
            other => other,
        }
    }

    /// How many apps and clusters a run's operations name.
    #[derive(Debug, Clone, Copy)]
    struct Universe {
        apps: u8,
        clusters: u8,
    }

    /// Every query of every app and cluster in play answers alike.
    fn same_answers(old: &Index, new: &CompactIndex, u: Universe) -> Result<(), TestCaseError> {
        prop_assert_eq!(old.applied_pairs(), new.applied_pairs());
        for a in 0..u.apps {
            let key = app(a);
            prop_assert_eq!(old.is_deleting(&key), new.is_deleting(&key), "{}", key);
            let waiting = old.deletion_waiting_on(&key);
            prop_assert_eq!(waiting, new.deletion_waiting_on(&key), "{}", key);
            for c in 0..u.clusters {
                let c = cluster(c);
                let placed = old.is_placed(&c, &key);
                prop_assert_eq!(placed, new.is_placed(&c, &key), "{} on {}", key, c);
                let assigned = old.is_assigned(&c, &key);
                prop_assert_eq!(assigned, new.is_assigned(&c, &key), "{} on {}", key, c);
                let excludes = old.scope_excludes(&c, &key);
                prop_assert_eq!(excludes, new.scope_excludes(&c, &key), "{} on {}", key, c);
            }
        }
        for c in 0..u.clusters {
            let c = cluster(c);
            prop_assert_eq!(old.desired_shared(&c), new.desired_shared(&c), "{}", c);
        }
        Ok(())
    }

    /// No record outlives what refers to it, so there is at most one per name in play
    /// however many came and went; the reverse index matches the per-app tables, and
    /// the count of Applies the pairs they hold.
    fn records_are_tidy(new: &CompactIndex, u: Universe) -> Result<(), TestCaseError> {
        prop_assert!(new.apps.slots.len() <= usize::from(u.apps));
        prop_assert!(new.clusters.slots.len() <= usize::from(u.clusters));
        let (mut pairs, mut applied) = (0, 0);
        for (id, key) in new.apps.live() {
            let record = new.apps.get(id);
            prop_assert!(
                !record.is_unused(),
                "the record of {} is kept for nothing",
                key
            );
            for pair in &record.pairs {
                prop_assert!(!pair.is_empty(), "an empty pair of {} is kept", key);
                let reverse = &new.clusters.get(pair.cluster.0).apps;
                prop_assert!(reverse.contains(&AppId(id)), "the reverse index is behind");
                applied += usize::from(pair.desired.as_ref().is_some_and(is_apply));
            }
            pairs += record.pairs.len();
        }
        let mut reverse = 0;
        for (id, name) in new.clusters.live() {
            let record = new.clusters.get(id);
            let used = record.connected || !record.apps.is_empty();
            prop_assert!(used, "the record of {} is kept for nothing", name);
            reverse += record.apps.len();
        }
        prop_assert_eq!(pairs, reverse, "the reverse index is ahead");
        prop_assert_eq!(new.applied, applied, "the count of Applies is off");
        Ok(())
    }

    /// A claim wait (`None`: the default) and operations on as few as one app and one
    /// cluster, or on all of them. (Drawn as the seeds in `proptest-regressions` expect.)
    fn arb_run() -> impl Strategy<Value = (Option<Duration>, Universe, Vec<Op>)> {
        let claim_wait = proptest::option::of((0u64..4).prop_map(Duration::from_secs));
        (claim_wait, 1..=APPS, 1..=CLUSTERS).prop_flat_map(|(claim_wait, apps, clusters)| {
            let ops = proptest::collection::vec(arb_op_among(apps, clusters), 1..100);
            (Just(claim_wait), Just(Universe { apps, clusters }), ops)
        })
    }

    /// Long runs over twelve apps and twelve clusters, whose names sort otherwise than
    /// their ids (`c10` before `c2`), and whose pairs outnumber what a short run reaches.
    fn arb_wide_run() -> impl Strategy<Value = (Option<Duration>, Universe, Vec<Op>)> {
        let u = Universe {
            apps: 12,
            clusters: 12,
        };
        // None (the default), seconds that time moves past, or too long to add to the clock.
        let claim_wait = proptest::option::of(prop_oneof![
            3 => (0u64..4).prop_map(Duration::from_secs),
            1 => Just(Duration::MAX),
        ]);
        let ops = proptest::collection::vec(arb_op_among(u.apps, u.clusters), 100..400);
        (claim_wait, Just(u), ops)
    }

    /// `Index` is the oracle: both are driven by the same operations, with time moving on
    /// past the claim wait, and answer alike after every one of them.
    fn differential(
        claim_wait: Option<Duration>,
        u: Universe,
        ops: Vec<Op>,
    ) -> Result<(), TestCaseError> {
        let (mut old, mut new) = match claim_wait {
            Some(wait) => (
                Index::with_claim_wait(wait),
                CompactIndex::with_claim_wait(wait),
            ),
            None => (Index::default(), CompactIndex::default()),
        };
        let mut clock = now();
        for op in ops {
            if let Op::Wait(seconds) = op {
                clock += Duration::from_secs(seconds.into());
            }
            let expected = canonical(run!(&mut old, op.clone(), clock));
            let got = run!(&mut new, op.clone(), clock);
            prop_assert_eq!(expected, got, "{:?}", op);
            same_answers(&old, &new, u)?;
            records_are_tidy(&new, u)?;
        }
        for a in 0..u.apps {
            let key = app(a);
            prop_assert_eq!(
                old.take_unheeded_claims(&key),
                new.take_unheeded_claims(&key)
            );
        }
        // Once every cluster left and every app was forgotten, nothing is left.
        new.retain_clusters(&BTreeSet::new());
        for a in 0..u.apps {
            new.forget(&app(a));
        }
        prop_assert_eq!(new.apps.live().count(), 0);
        prop_assert_eq!(new.clusters.live().count(), 0);
        prop_assert_eq!(new.applied_pairs(), 0);
        Ok(())
    }

    proptest::proptest! {
        #[test]
        fn the_compact_index_answers_as_the_index_does(
            (claim_wait, u, ops) in arb_run(),
        ) {
            differential(claim_wait, u, ops)?;
        }
    }

    proptest::proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn the_compact_index_answers_as_the_index_does_over_many_names(
            (claim_wait, u, ops) in arb_wide_run(),
        ) {
            differential(claim_wait, u, ops)?;
        }
    }

    /// A pair record is three words: its cluster's id and its flags in one, its desired
    /// state in two.
    #[test]
    fn a_pair_record_is_three_words() {
        assert_eq!(size_of::<Pair>(), 24);
    }

    /// As `Index`'s test of the same name: a wait too long to add to the clock never ends.
    #[test]
    fn a_claim_wait_too_long_for_the_clock_never_ends() {
        let mut ix = CompactIndex::with_claim_wait(Duration::MAX);
        let key = app(0);
        ix.connect(
            "c1",
            &HashMap::from([(key.clone(), "h".to_owned())]),
            Scope::All,
        );
        assert_eq!(ix.delete_app(&key, false, &[], now()).len(), 1);
        let centuries = now() + Duration::from_secs(50 * 365 * 24 * 3600);
        ix.delete_app(&key, false, &[], centuries);
        assert_eq!(ix.deletion_waiting_on(&key), ["c1"]);
        assert!(ix.take_unheeded_claims(&key).is_empty());
    }

    /// A hub's churn reuses ids: apps and clusters that come and go one after the other
    /// take one record each at a time.
    #[test]
    fn ids_are_reused_as_names_come_and_go() {
        let mut ix = CompactIndex::default();
        for n in 0..1_000 {
            let key = AppKey::new("default", format!("a{n}"));
            let c = format!("c{n}");
            let plan = BTreeMap::from([(ClusterName::from(c.as_str()), rendered("h"))]);
            ix.connect(&c, &HashMap::new(), Scope::All);
            ix.set_app(&key, Some(1), plan);
            ix.delete_app(&key, false, &[], now());
            ix.report(&c, &key, Held::Absent);
            ix.forget(&key);
            ix.disconnect(&c);
            ix.retain_clusters(&BTreeSet::new());
        }
        assert_eq!(ix.apps.slots.len(), 1);
        assert_eq!(ix.clusters.slots.len(), 1);
        assert_eq!(ix.apps.live().count(), 0);
    }
}
