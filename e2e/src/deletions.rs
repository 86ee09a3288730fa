//! The deletion log: a watch on every member that records each deletion of a managed
//! MyApp during a test, so that the test can assert nothing was deleted that the desired
//! state did not ask for.
//!
//! A watch can miss a DELETE (the apiserver was down, the watch expired): on every
//! re-list, a managed MyApp known before and absent now is recorded as deleted; one whose
//! UID changed under the same name was deleted and re-created, and is recorded too.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use futures::StreamExt;
use kube::ResourceExt;
use kube::api::{Api, DynamicObject};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::task::JoinHandle;

use crate::converge::{Key, myapp_resource};
use flotilla_crds::{HASH_ANNOTATION, MANAGED_BY_LABEL, MANAGED_BY_VALUE};
use flotilla_lab::Env;

/// One managed MyApp that went away.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deletion {
    pub cluster: String,
    /// `namespace/name`.
    pub key: Key,
    pub uid: String,
    /// Its content-hash annotation when last seen.
    pub hash: Option<String>,
    /// How it was seen: a DELETE event, absent from a re-list, or re-created.
    pub seen: Seen,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    Deleted,
    AbsentOnRelist,
    Recreated,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Known {
    uid: String,
    hash: Option<String>,
    managed: bool,
}

/// The watch state of one cluster: pure, fed with watcher events.
#[derive(Debug, Default)]
pub struct Tracker {
    cluster: String,
    known: HashMap<Key, Known>,
    /// Keys seen in the re-list under way, if one is.
    relist: Option<HashSet<Key>>,
    /// Whether the first list finished (deletions before it are not seen).
    synced: bool,
    deletions: Vec<Deletion>,
}

fn key_of(o: &DynamicObject) -> Key {
    format!("{}/{}", o.namespace().unwrap_or_default(), o.name_any())
}

fn known_of(o: &DynamicObject) -> Known {
    Known {
        uid: o.uid().unwrap_or_default(),
        hash: o.annotations().get(HASH_ANNOTATION).cloned(),
        managed: o.labels().get(MANAGED_BY_LABEL).map(String::as_str) == Some(MANAGED_BY_VALUE),
    }
}

impl Tracker {
    pub fn new(cluster: &str) -> Tracker {
        Tracker {
            cluster: cluster.into(),
            ..Default::default()
        }
    }

    fn record(&mut self, key: Key, k: Known, seen: Seen) {
        if k.managed {
            self.deletions.push(Deletion {
                cluster: self.cluster.clone(),
                key,
                uid: k.uid,
                hash: k.hash,
                seen,
            });
        }
    }

    fn applied(&mut self, o: &DynamicObject) {
        let key = key_of(o);
        let now = known_of(o);
        if let Some(relist) = &mut self.relist {
            relist.insert(key.clone());
        }
        if let Some(before) = self.known.insert(key.clone(), now.clone())
            && before.uid != now.uid
        {
            self.record(key, before, Seen::Recreated);
        }
    }

    pub fn on_event(&mut self, event: watcher::Event<DynamicObject>) {
        match event {
            watcher::Event::Init => self.relist = Some(HashSet::new()),
            watcher::Event::InitApply(o) | watcher::Event::Apply(o) => self.applied(&o),
            watcher::Event::Delete(o) => {
                let key = key_of(&o);
                // The last state decides: a MyApp released (label removed) before it was
                // deleted is no longer Flotilla's.
                self.known.remove(&key);
                self.record(key, known_of(&o), Seen::Deleted);
            }
            watcher::Event::InitDone => {
                if let Some(seen) = self.relist.take() {
                    let gone: Vec<Key> = self
                        .known
                        .keys()
                        .filter(|k| !seen.contains(*k))
                        .cloned()
                        .collect();
                    for key in gone {
                        if let Some(k) = self.known.remove(&key) {
                            self.record(key, k, Seen::AbsentOnRelist);
                        }
                    }
                }
                self.synced = true;
            }
        }
    }

    pub fn deletions(&self) -> &[Deletion] {
        &self.deletions
    }
}

/// Deletions of managed MyApps on every member, from the moment [`DeletionLog::start`]
/// returns until the log is dropped.
pub struct DeletionLog {
    trackers: Vec<Arc<Mutex<Tracker>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl DeletionLog {
    /// Watches every member; returns once each watch has listed what is there.
    pub async fn start(env: &Env) -> Result<DeletionLog> {
        let mut log = DeletionLog {
            trackers: Vec::new(),
            tasks: Vec::new(),
        };
        for member in env.members() {
            let client = env.client(member).await?;
            let tracker = Arc::new(Mutex::new(Tracker::new(member)));
            let api: Api<DynamicObject> = Api::all_with(client, &myapp_resource());
            let t = tracker.clone();
            log.tasks.push(tokio::spawn(async move {
                let stream = watcher(api, watcher::Config::default()).default_backoff();
                futures::pin_mut!(stream);
                while let Some(event) = stream.next().await {
                    // Errors are retried by the backoff; a gap shows on the re-list.
                    if let Ok(event) = event {
                        t.lock().on_event(event);
                    }
                }
            }));
            log.trackers.push(tracker);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while !log.trackers.iter().all(|t| t.lock().synced) {
            if Instant::now() > deadline {
                bail!("the deletion log's watches did not list the members within 30s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(log)
    }

    /// Every deletion seen so far, cluster by cluster.
    pub fn deletions(&self) -> Vec<Deletion> {
        self.trackers
            .iter()
            .flat_map(|t| t.lock().deletions().to_vec())
            .collect()
    }

    /// Deletions other than those of `expected` (cluster, key) pairs.
    pub fn unwanted(&self, expected: &BTreeSet<(String, Key)>) -> Vec<Deletion> {
        self.deletions()
            .into_iter()
            .filter(|d| !expected.contains(&(d.cluster.clone(), d.key.clone())))
            .collect()
    }

    /// Fails, listing them, if anything but `expected` was deleted.
    pub fn assert_clean(&self, expected: &BTreeSet<(String, Key)>) -> Result<()> {
        let unwanted = self.unwanted(expected);
        if unwanted.is_empty() {
            return Ok(());
        }
        let lines: Vec<String> = unwanted
            .iter()
            .map(|d| {
                format!(
                    "{}: MyApp {} (uid {}, content hash {}) {}",
                    d.cluster,
                    d.key,
                    d.uid,
                    d.hash.as_deref().unwrap_or("absent"),
                    match d.seen {
                        Seen::Deleted => "deleted",
                        Seen::AbsentOnRelist => "gone (seen on a re-list)",
                        Seen::Recreated => "deleted and re-created",
                    }
                )
            })
            .collect();
        bail!(
            "{} unwanted deletion(s) of managed MyApps:\n  {}",
            unwanted.len(),
            lines.join("\n  ")
        )
    }
}

impl Drop for DeletionLog {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use watcher::Event;

    fn obj(name: &str, uid: &str, managed: bool) -> DynamicObject {
        let labels = if managed {
            json!({MANAGED_BY_LABEL: MANAGED_BY_VALUE})
        } else {
            json!({"other": "x"})
        };
        serde_json::from_value(json!({
            "apiVersion": "app.example.com/v1", "kind": "MyApp",
            "metadata": {"name": name, "namespace": "ns", "uid": uid, "labels": labels,
                         "annotations": {HASH_ANNOTATION: format!("h-{uid}")}},
            "spec": {}
        }))
        .unwrap()
    }

    fn seen(t: &Tracker) -> Vec<(&str, &str, Seen)> {
        t.deletions()
            .iter()
            .map(|d| (d.key.as_str(), d.uid.as_str(), d.seen))
            .collect()
    }

    fn listed(t: &mut Tracker, objs: Vec<DynamicObject>) {
        t.on_event(Event::Init);
        for o in objs {
            t.on_event(Event::InitApply(o));
        }
        t.on_event(Event::InitDone);
    }

    #[test]
    fn what_existed_at_start_is_no_deletion() {
        let mut t = Tracker::new("c1");
        assert!(!t.synced);
        listed(&mut t, vec![obj("a", "1", true), obj("b", "2", false)]);
        assert!(t.synced);
        assert!(t.deletions().is_empty());
    }

    #[test]
    fn a_delete_of_a_managed_myapp_is_recorded_an_unmanaged_one_is_not() {
        let mut t = Tracker::new("c1");
        listed(&mut t, vec![]);
        t.on_event(Event::Apply(obj("a", "1", true)));
        t.on_event(Event::Apply(obj("b", "2", false)));
        t.on_event(Event::Delete(obj("a", "1", true)));
        t.on_event(Event::Delete(obj("b", "2", false)));
        assert_eq!(seen(&t), [("ns/a", "1", Seen::Deleted)]);
        assert_eq!(t.deletions()[0].cluster, "c1");
        assert_eq!(t.deletions()[0].hash.as_deref(), Some("h-1"));
    }

    #[test]
    fn a_released_myapp_deleted_later_is_not_flotillas() {
        let mut t = Tracker::new("c1");
        listed(&mut t, vec![obj("a", "1", true)]);
        t.on_event(Event::Apply(obj("a", "1", false)));
        t.on_event(Event::Delete(obj("a", "1", false)));
        assert!(t.deletions().is_empty());
    }

    #[test]
    fn a_gap_in_the_watch_shows_on_the_relist() {
        let mut t = Tracker::new("c1");
        listed(
            &mut t,
            vec![
                obj("a", "1", true),
                obj("b", "2", true),
                obj("u", "3", false),
            ],
        );
        // The apiserver went away; when it is back, only b is there, and c is new.
        listed(&mut t, vec![obj("b", "2", true), obj("c", "4", true)]);
        assert_eq!(seen(&t), [("ns/a", "1", Seen::AbsentOnRelist)]);
        // Nothing twice.
        listed(&mut t, vec![obj("b", "2", true), obj("c", "4", true)]);
        assert_eq!(t.deletions().len(), 1);
    }

    #[test]
    fn a_new_uid_under_the_same_name_was_a_deletion() {
        let mut t = Tracker::new("c1");
        listed(&mut t, vec![obj("a", "1", true)]);
        t.on_event(Event::Apply(obj("a", "9", true)));
        listed(&mut t, vec![obj("a", "10", true)]);
        assert_eq!(
            seen(&t),
            [
                ("ns/a", "1", Seen::Recreated),
                ("ns/a", "9", Seen::Recreated)
            ]
        );
        // An update of the same object is none.
        t.on_event(Event::Apply(obj("a", "10", true)));
        assert_eq!(t.deletions().len(), 2);
    }
}
