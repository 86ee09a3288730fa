//! Collection: after SyncComplete, the MyApps this agent manages that the hub no longer
//! wants (orphans) are deleted; this module says which.
//!
//! Only MyApps that this session's Hello listed are ever collected (one created since,
//! by another hub or by hand, is not), and only when they are at most `max_share` of
//! them: a larger collection (a host that lost its FederatedMyApps, a wrong kubeconfig)
//! is held until a user confirms it on the hub with the annotation
//! [`CONFIRM_COLLECTION_ANNOTATION`] on the MemberCluster (the circuit breaker).

use std::collections::HashSet;

use flotilla_crds::{CONFIRM_COLLECTION_ANNOTATION, MyApp};
use flotilla_proto::v1 as pb;
use tracing::{info, warn};

use crate::cache::{Key, Stores, key_of};

/// What the breaker allows: the share of a session's listed MyApps one SyncComplete may
/// take without a confirmation.
pub struct Breaker {
    /// The MyApps this session's Hello listed: nothing else is ever collected.
    listed: HashSet<Key>,
    max_share: f64,
}

impl Breaker {
    pub fn new(listed: HashSet<Key>, max_share: f64) -> Self {
        Self { listed, max_share }
    }

    /// Whether collecting `orphans` MyApps may go ahead: at most the share, or exactly
    /// what a user confirmed (a confirmation of 7 is no approval of 6 or of 4,294,967,295:
    /// a count that changed is held back and shown again).
    pub fn allows(&self, orphans: usize, confirmed: u32) -> bool {
        orphans as f64 <= self.max_share * self.listed.len() as f64
            || (confirmed > 0 && orphans == confirmed as usize)
    }

    /// The MyApps in `managed` (the cache) that Hello listed and the hub neither wants
    /// nor told this session to delete or release (`told`), sorted.
    pub fn orphans(
        &self,
        managed: &[std::sync::Arc<MyApp>],
        desired: &HashSet<Key>,
        told: &HashSet<Key>,
    ) -> Vec<Key> {
        let mut orphans: Vec<Key> = managed
            .iter()
            .map(|a| key_of(&**a))
            .filter(|k| self.listed.contains(k) && !desired.contains(k) && !told.contains(k))
            .collect();
        orphans.sort();
        orphans
    }
}

/// What SyncComplete leads to.
#[derive(Debug, PartialEq)]
pub enum Collection {
    /// Delete these (possibly none).
    Orphans(Vec<Key>),
    /// The breaker holds them back; the hub hears so.
    Held(pb::CollectionBlocked),
}

/// The collection of one session.
pub struct Collector {
    pub cluster: String,
    pub managed: Stores,
    pub breaker: Breaker,
}

impl Collector {
    /// The orphans to delete after a SyncComplete that listed `desired`, or why none go;
    /// `told`: the MyApps the hub told this session to delete or release.
    pub fn collect(
        &self,
        desired: &HashSet<Key>,
        told: &HashSet<Key>,
        confirmed: u32,
    ) -> Collection {
        let orphans = self.breaker.orphans(&self.managed.state(), desired, told);
        info!(
            desired = desired.len(),
            orphans = orphans.len(),
            "initial sync complete"
        );
        if self.breaker.allows(orphans.len(), confirmed) {
            return Collection::Orphans(orphans);
        }
        let listed = self.breaker.listed.len();
        warn!(
            would_collect = orphans.len(),
            managed = listed,
            max_share = self.breaker.max_share,
            "circuit breaker: not collecting orphans; confirm on the hub with `kubectl annotate membercluster {} {CONFIRM_COLLECTION_ANNOTATION}={}`",
            self.cluster,
            orphans.len()
        );
        Collection::Held(pb::CollectionBlocked {
            would_collect: orphans.len() as u32,
            managed: listed as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(n: usize) -> HashSet<Key> {
        (0..n).map(|i| Key::new("ns", format!("a{i}"))).collect()
    }

    #[test]
    fn the_breaker_allows_a_share_or_a_confirmed_count() {
        let b = Breaker::new(keys(10), 0.5);
        assert!(b.allows(0, 0));
        assert!(b.allows(5, 0));
        assert!(!b.allows(6, 0));
        assert!(b.allows(6, 6), "a user confirmed exactly this many");
        assert!(!b.allows(7, 6));
        assert!(
            !b.allows(6, 7),
            "a confirmation is of one count, not of fewer"
        );
        assert!(!b.allows(6, u32::MAX), "no blanket approval");
        assert!(Breaker::new(keys(0), 0.5).allows(0, 0));
    }

    fn collector(listed: &[&str], cached: &[&str], max_share: f64) -> Collector {
        Collector {
            cluster: "c1".into(),
            managed: crate::store_of(cached),
            breaker: Breaker::new(
                listed.iter().map(|n| Key::new("ns", *n)).collect(),
                max_share,
            ),
        }
    }

    /// Only what Hello listed and the hub no longer wants: not a MyApp the cache holds
    /// that Hello did not list (created since), nor one the hub wants.
    #[test]
    fn only_listed_unwanted_myapps_are_orphans() {
        let c = collector(&["a", "b", "c", "d"], &["a", "b", "c", "d", "new"], 0.5);
        let desired = [Key::new("ns", "a"), Key::new("ns", "b")].into();
        assert_eq!(
            c.collect(&desired, &HashSet::new(), 0),
            Collection::Orphans(vec![Key::new("ns", "c"), Key::new("ns", "d")])
        );
    }

    /// More than the share: held back, and the hub is told how many of how many.
    #[test]
    fn a_mass_collection_is_held_until_confirmed() {
        let c = collector(&["a", "b", "c", "d"], &["a", "b", "c", "d"], 0.5);
        let desired = [Key::new("ns", "a")].into();
        assert_eq!(
            c.collect(&desired, &HashSet::new(), 0),
            Collection::Held(pb::CollectionBlocked {
                would_collect: 3,
                managed: 4
            })
        );
        assert!(
            matches!(c.collect(&desired, &HashSet::new(), 3), Collection::Orphans(o) if o.len() == 3)
        );
    }

    /// What the hub told the session to delete or release is not an orphan: it goes by
    /// that word (a release stays a release), and does not count against the breaker,
    /// which once held back a collection after a hub restart for a MyApp the new hub was
    /// deleting explicitly.
    #[test]
    fn myapps_the_hub_told_to_delete_or_release_are_not_orphans() {
        let c = collector(&["a", "b", "c", "d"], &["a", "b", "c", "d"], 0.5);
        let desired = [Key::new("ns", "a")].into();
        let told = [Key::new("ns", "b"), Key::new("ns", "c")].into();
        assert_eq!(
            c.collect(&desired, &told, 0),
            Collection::Orphans(vec![Key::new("ns", "d")])
        );
    }
}
