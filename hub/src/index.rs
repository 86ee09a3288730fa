//! Index: what every member cluster should run, built from render outcomes, and what
//! each connected agent reports it runs. Pure state: every method returns the messages
//! to push and does no I/O, so that `dispatch` decides when and how they travel.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use crate::render::RenderedMyApp;

/// A MyApp's namespace and name: the same on the host (its FederatedMyApp) and members.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AppKey {
    pub namespace: String,
    pub name: String,
}

impl AppKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for AppKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

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

pub type Push = (String, AppKey, Change);

#[derive(Debug, Default)]
pub struct Index {
    /// cluster → app → desired state.
    desired: HashMap<String, HashMap<AppKey, Desired>>,
    /// app → clusters with an entry in `desired`, to find them without a scan.
    placed: HashMap<AppKey, BTreeSet<String>>,
    /// cluster → apps its agent manages, for clusters whose agent said Hello since it
    /// last connected; absent for the others, whose state is unknown.
    present: HashMap<String, HashSet<AppKey>>,
    /// app being deleted → clusters that have not confirmed it is gone (or released).
    deleting: HashMap<AppKey, BTreeSet<String>>,
}

impl Index {
    /// Makes `plan` the app's desired state; clusters outside it lose the app.
    pub fn set_app(&mut self, key: &AppKey, plan: BTreeMap<String, Desired>) -> Vec<Push> {
        let mut pushes = Vec::new();
        let before = self.placed.remove(key).unwrap_or_default();
        for cluster in before.iter().filter(|c| !plan.contains_key(*c)) {
            self.desired.get_mut(cluster).map(|d| d.remove(key));
            pushes.push((
                cluster.clone(),
                key.clone(),
                Change::Delete { orphan: false },
            ));
        }
        for (cluster, want) in &plan {
            let previous = self
                .desired
                .entry(cluster.clone())
                .or_default()
                .insert(key.clone(), want.clone());
            if let Desired::Apply(rendered) = want {
                let unchanged =
                    matches!(&previous, Some(Desired::Apply(p)) if p.hash == rendered.hash);
                if !unchanged {
                    pushes.push((
                        cluster.clone(),
                        key.clone(),
                        Change::Apply(rendered.clone()),
                    ));
                }
            }
        }
        self.placed.insert(key.clone(), plan.into_keys().collect());
        pushes
    }

    /// Starts (or continues) deleting an app: every cluster that has or may have it gets
    /// a Delete; `also` names clusters it is placed on by its spec, which must confirm
    /// too even if this hub never saw them hold it.
    pub fn delete_app(&mut self, key: &AppKey, orphan: bool, also: &[String]) -> Vec<Push> {
        let mut candidates: BTreeSet<String> = self.placed.remove(key).unwrap_or_default();
        candidates.extend(also.iter().cloned());
        candidates.extend(
            self.present
                .iter()
                .filter(|(_, apps)| apps.contains(key))
                .map(|(c, _)| c.clone()),
        );
        let mut pushes = Vec::new();
        let waiting = self.deleting.entry(key.clone()).or_default();
        for cluster in candidates {
            let desired = self.desired.entry(cluster.clone()).or_default();
            let already = desired.get(key) == Some(&Desired::Release);
            desired.remove(key);
            match self.present.get(&cluster) {
                // Known not to hold it: nothing to wait for.
                Some(apps) if !apps.contains(key) => continue,
                Some(_) if !already => {
                    pushes.push((cluster.clone(), key.clone(), Change::Delete { orphan }));
                }
                _ => {}
            }
            if orphan {
                // Kept in the desired set so that reconnecting agents release it rather
                // than collect it as an orphan.
                desired.insert(key.clone(), Desired::Release);
            }
            waiting.insert(cluster);
        }
        pushes
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
        for d in self.desired.values_mut() {
            d.remove(key);
        }
        self.placed.remove(key);
    }

    /// An agent said Hello with the hashes of the apps it manages: what it lacks or has
    /// stale, and the whole desired key set for its SyncComplete.
    pub fn connect(
        &mut self,
        cluster: &str,
        managed: &HashMap<AppKey, String>,
    ) -> (Vec<Push>, Vec<AppKey>) {
        self.present
            .insert(cluster.to_owned(), managed.keys().cloned().collect());
        let mut pushes = Vec::new();
        let desired = self.desired.entry(cluster.to_owned()).or_default();
        let mut keys: Vec<AppKey> = desired.keys().cloned().collect();
        keys.sort();
        for key in &keys {
            match (&desired[key], managed.get(key)) {
                (Desired::Apply(r), hash) if hash != Some(&r.hash) => {
                    pushes.push((cluster.to_owned(), key.clone(), Change::Apply(r.clone())));
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
        let gone: Vec<AppKey> = self
            .deleting
            .iter()
            .filter(|(key, waiting)| waiting.contains(cluster) && !managed.contains_key(*key))
            .map(|(key, _)| key.clone())
            .collect();
        for key in gone {
            self.confirm_gone(cluster, &key);
        }
        (pushes, keys)
    }

    /// The agent went away: what it holds is unknown until it says Hello again.
    pub fn disconnect(&mut self, cluster: &str) {
        self.present.remove(cluster);
    }

    /// The agent reported an app as managed (`exists`) or no longer managed.
    pub fn report(&mut self, cluster: &str, key: &AppKey, exists: bool) {
        let Some(apps) = self.present.get_mut(cluster) else {
            return;
        };
        if exists {
            apps.insert(key.clone());
        } else {
            apps.remove(key);
            self.confirm_gone(cluster, key);
        }
    }

    fn confirm_gone(&mut self, cluster: &str, key: &AppKey) {
        if let Some(waiting) = self.deleting.get_mut(key) {
            waiting.remove(cluster);
            if let Some(d) = self.desired.get_mut(cluster)
                && d.get(key) == Some(&Desired::Release)
            {
                d.remove(key);
            }
        }
    }

    /// Whether `key` is an app this cluster should have: status for anything else is
    /// refused.
    pub fn is_placed(&self, cluster: &str, key: &AppKey) -> bool {
        self.desired
            .get(cluster)
            .is_some_and(|d| d.contains_key(key))
            || self.deleting.get(key).is_some_and(|w| w.contains(cluster))
    }

    /// Number of (cluster, app) pairs with an `Apply`.
    pub fn applied_pairs(&self) -> usize {
        self.desired
            .values()
            .flat_map(|d| d.values())
            .filter(|d| matches!(d, Desired::Apply(_)))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn rendered(hash: &str) -> Desired {
        Desired::Apply(Arc::new(RenderedMyApp {
            hash: hash.into(),
            json: Bytes::from_static(b"{}"),
        }))
    }

    fn key(n: &str) -> AppKey {
        AppKey::new("default", n)
    }

    fn plan(entries: &[(&str, Desired)]) -> BTreeMap<String, Desired> {
        entries
            .iter()
            .map(|(c, d)| ((*c).to_owned(), d.clone()))
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
            kinds(&ix.set_app(&key("a"), p.clone())),
            [t("c1", "a", "apply h1"), t("c2", "a", "apply h2")]
        );
        assert!(
            ix.set_app(&key("a"), p).is_empty(),
            "same hashes push nothing"
        );
        let p = plan(&[("c1", rendered("h1")), ("c2", rendered("h3"))]);
        assert_eq!(kinds(&ix.set_app(&key("a"), p)), [t("c2", "a", "apply h3")]);
    }

    #[test]
    fn leaving_the_placement_deletes_and_keep_never_does() {
        let mut ix = Index::default();
        ix.set_app(
            &key("a"),
            plan(&[("c1", rendered("h1")), ("c2", rendered("h2"))]),
        );
        let pushes = ix.set_app(&key("a"), plan(&[("c1", Desired::Keep)]));
        assert_eq!(kinds(&pushes), [t("c2", "a", "delete orphan=false")]);
        let (pushes, keys) = ix.connect("c1", &hello(&[("a", "old")]));
        assert!(pushes.is_empty(), "Keep leaves the member's copy alone");
        assert_eq!(keys, [key("a")], "and protects it from orphan collection");
    }

    #[test]
    fn connect_sends_only_what_differs_and_lists_the_desired_set() {
        let mut ix = Index::default();
        for (n, h) in [("a", "ha"), ("b", "hb"), ("c", "hc")] {
            ix.set_app(&key(n), plan(&[("c1", rendered(h))]));
        }
        let (pushes, keys) = ix.connect(
            "c1",
            &hello(&[("a", "ha"), ("b", "stale"), ("zombie", "hz")]),
        );
        assert_eq!(
            kinds(&pushes),
            [t("c1", "b", "apply hb"), t("c1", "c", "apply hc")]
        );
        assert_eq!(
            keys,
            [key("a"), key("b"), key("c")],
            "zombie is left to orphan collection"
        );
    }

    #[test]
    fn reconnect_with_everything_current_sends_nothing() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), plan(&[("c1", rendered("ha"))]));
        ix.connect("c1", &HashMap::new());
        ix.disconnect("c1");
        let (pushes, _) = ix.connect("c1", &hello(&[("a", "ha")]));
        assert!(pushes.is_empty());
    }

    #[test]
    fn delete_waits_for_every_holder_to_confirm() {
        let mut ix = Index::default();
        ix.set_app(
            &key("a"),
            plan(&[("c1", rendered("h")), ("c2", rendered("h"))]),
        );
        ix.connect("c1", &hello(&[("a", "h")]));
        // c2 never connected: it is waited for, and gets its Delete through orphan
        // collection when it does.
        let pushes = ix.delete_app(&key("a"), false, &[]);
        assert_eq!(kinds(&pushes), [t("c1", "a", "delete orphan=false")]);
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1", "c2"]);
        ix.report("c1", &key("a"), false);
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c2"]);
        let (pushes, keys) = ix.connect("c2", &hello(&[("a", "h")]));
        assert!(
            pushes.is_empty() && keys.is_empty(),
            "not desired: the agent collects it"
        );
        ix.report("c2", &key("a"), false);
        assert!(ix.deletion_waiting_on(&key("a")).is_empty());
    }

    #[test]
    fn delete_skips_connected_clusters_that_do_not_hold_it() {
        let mut ix = Index::default();
        ix.connect("c1", &HashMap::new());
        let pushes = ix.delete_app(&key("a"), false, &["c1".into()]);
        assert!(pushes.is_empty());
        assert!(ix.deletion_waiting_on(&key("a")).is_empty());
    }

    #[test]
    fn disconnected_spec_clusters_are_waited_for_after_a_hub_restart() {
        let mut ix = Index::default();
        ix.delete_app(&key("a"), false, &["c1".into()]);
        assert_eq!(ix.deletion_waiting_on(&key("a")), ["c1"]);
        ix.connect("c1", &HashMap::new());
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
            plan(&[("c1", rendered("h")), ("c2", rendered("h"))]),
        );
        ix.connect("c1", &hello(&[("a", "h")]));
        let pushes = ix.delete_app(&key("a"), true, &[]);
        assert_eq!(kinds(&pushes), [t("c1", "a", "delete orphan=true")]);
        assert!(
            ix.delete_app(&key("a"), true, &[]).is_empty(),
            "a retried cleanup does not resend"
        );
        let (pushes, keys) = ix.connect("c2", &hello(&[("a", "h")]));
        assert_eq!(kinds(&pushes), [t("c2", "a", "delete orphan=true")]);
        assert_eq!(
            keys,
            [key("a")],
            "listed as desired, so c2 does not collect it"
        );
        ix.report("c1", &key("a"), false);
        ix.report("c2", &key("a"), false);
        assert!(ix.deletion_waiting_on(&key("a")).is_empty());
        let (_, keys) = ix.connect("c2", &HashMap::new());
        assert!(
            keys.is_empty(),
            "released entries are dropped once confirmed"
        );
    }

    #[test]
    fn status_is_accepted_only_for_placed_apps() {
        let mut ix = Index::default();
        ix.set_app(&key("a"), plan(&[("c1", rendered("h"))]));
        assert!(ix.is_placed("c1", &key("a")));
        assert!(!ix.is_placed("c2", &key("a")));
        assert!(!ix.is_placed("c1", &key("b")));
    }

    #[test]
    fn applied_pairs_counts_apply_entries() {
        let mut ix = Index::default();
        ix.set_app(
            &key("a"),
            plan(&[("c1", rendered("h")), ("c2", Desired::Keep)]),
        );
        ix.set_app(&key("b"), plan(&[("c1", rendered("h"))]));
        assert_eq!(ix.applied_pairs(), 2);
    }
}
