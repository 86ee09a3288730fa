//! Sync: carries the hub's requests into the member cluster.
//!
//! [`carry_out`] takes the session's commands in order, keeps them in a [`KeyedQueue`]
//! (latest wish per MyApp, one at a time each, retried with backoff), and has the
//! [`Applier`] do each. After SyncComplete it asks [`collect`](crate::collect) which
//! orphans go.
//!
//! MyApps are written by server-side apply under the agent's own field manager and carry
//! the `app.kubernetes.io/managed-by: flotilla` label. The agent deletes a MyApp only when
//! the hub says so, or after SyncComplete when it manages it, listed it in this session's
//! Hello, and the hub no longer wants it; a MyApp without the label is never touched.
//! While an autoscaler scales a MyApp, its `spec.replicas` is left out of the apply (see
//! [`replicas`]); the federation's value rides along in an annotation.
//! "Gone" is only ever said after the apiserver confirmed it, never from a cache miss.

use std::collections::HashSet;
use std::sync::Arc;

use flotilla_crds::{HASH_ANNOTATION, MANAGED_BY_LABEL, MANAGED_BY_VALUE, MyApp};
use futures::stream::FuturesUnordered;
use futures::{Stream, StreamExt};
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::autoscale::{Autoscalers, Target};
use crate::cache::{Key, Stores, is_managed};
use crate::collect::{Collection, Collector};
use crate::queue::{Failed, KeyedQueue, retry_backoff};
use crate::replicas;
use crate::report::Notice;
use crate::session::HubCommand;
use crate::tenancy::Guard;

pub const FIELD_MANAGER: &str = "flotilla-agent";

/// What the hub asked for one MyApp.
#[derive(Clone, Debug, PartialEq)]
pub enum Request {
    Apply {
        manifest: bytes::Bytes,
    },
    /// `orphan`: stop managing it but leave it running (`kubefed.io/orphan`).
    Delete {
        orphan: bool,
    },
}

/// Carries out `commands` until they end (the session ended), up to `concurrency`
/// requests at once; tells `notices` how each try ended and when a collection is held
/// back. Requests still running when the session ends are dropped: the next session's
/// Hello tells the hub where each MyApp stands.
pub async fn carry_out<S, E>(
    commands: S,
    applier: &Applier,
    collector: &Collector,
    concurrency: usize,
    notices: &mpsc::UnboundedSender<Notice>,
) -> Result<(), E>
where
    S: Stream<Item = Result<HubCommand, E>>,
{
    let mut commands = std::pin::pin!(commands);
    let mut queue = KeyedQueue::new(concurrency, retry_backoff());
    let mut running = FuturesUnordered::new();
    // The MyApps the hub told this session to delete or release: they go by that word,
    // never as orphans (a collection would turn a release into a deletion, and would
    // count them against the circuit breaker for nothing).
    let mut told_to_delete: HashSet<Key> = HashSet::new();
    loop {
        while let Some((key, request)) = queue.start() {
            running.push(async move {
                let apply = matches!(request, Request::Apply { .. });
                let result = applier.carry_out(&key, &request).await;
                (key, apply, result)
            });
        }
        let command = tokio::select! {
            command = commands.next(), if queue.has_room() => command,
            Some((key, apply, result)) = running.next() => {
                let applied = apply && result.is_ok();
                let error = queue.done(&key, result);
                let _ = notices.send(Notice::Tried { key, error, applied });
                continue;
            }
            () = queue.retry_due() => continue,
        };
        match command.transpose()? {
            None => return Ok(()),
            Some(HubCommand::Apply { key, manifest }) => {
                told_to_delete.remove(&key);
                queue.push(key, Request::Apply { manifest });
            }
            Some(HubCommand::Delete { key, orphan }) => {
                told_to_delete.insert(key.clone());
                queue.push(key, Request::Delete { orphan });
            }
            Some(HubCommand::SyncComplete {
                desired,
                confirmed_collection,
            }) => match collector.collect(&desired, &told_to_delete, confirmed_collection) {
                Collection::Orphans(orphans) => {
                    for orphan in orphans {
                        info!(app = %orphan, "collecting an orphan the hub no longer wants");
                        queue.push(orphan, Request::Delete { orphan: false });
                    }
                }
                Collection::Held(blocked) => {
                    let _ = notices.send(Notice::CollectionBlocked(blocked));
                }
            },
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("the manifest is not a MyApp for {key}: {reason}")]
    BadManifest { key: Key, reason: String },
    #[error("MyApp {key} refused: {forbidden}")]
    Forbidden {
        key: Key,
        forbidden: flotilla_crds::tenancy::Forbidden,
    },
    #[error("a MyApp {key} exists that Flotilla does not manage; it is left alone")]
    NotManaged { key: Key },
    #[error("MyApp {key} was replaced while it was being deleted; retrying")]
    Replaced { key: Key },
    #[error("{action} MyApp {key}: {source}")]
    Api {
        action: &'static str,
        key: Key,
        source: kube::Error,
    },
}

/// Writes the hub's MyApps into the member cluster.
pub struct Applier {
    client: Client,
    /// MyApps carrying the managed-by label, kept by the agent's reflector.
    managed: Stores,
    autoscalers: Autoscalers,
    /// The namespaces never applied into (the default policy unless told otherwise).
    guard: Guard,
}

impl Applier {
    pub fn new(client: Client, managed: Stores, autoscalers: Autoscalers) -> Self {
        Self {
            client,
            managed,
            autoscalers,
            guard: Guard::default(),
        }
    }

    /// Refuses what `guard` forbids instead of the default policy.
    pub fn with_guard(self, guard: Guard) -> Self {
        Self { guard, ..self }
    }

    fn api(&self, namespace: &str) -> Api<MyApp> {
        Api::namespaced(self.client.clone(), namespace)
    }

    /// Does what the hub asked, once.
    pub async fn carry_out(&self, key: &Key, request: &Request) -> Result<(), Failed> {
        let done = match request {
            Request::Apply { manifest } => self.apply(key, manifest).await,
            Request::Delete { orphan: true } => self.release(key).await,
            Request::Delete { orphan: false } => self.delete(key).await,
        };
        match done {
            Ok(()) => {
                debug!(app = %key, "done");
                Ok(())
            }
            Err(e @ (SyncError::BadManifest { .. } | SyncError::Forbidden { .. })) => {
                // Retrying the same bytes cannot help: reported, not retried.
                warn!(app = %key, error = %e, "refused");
                Err(Failed {
                    error: e.to_string(),
                    retry: false,
                })
            }
            Err(e) => {
                warn!(app = %key, error = %e, "failed; will retry");
                Err(Failed {
                    error: e.to_string(),
                    retry: true,
                })
            }
        }
    }

    pub async fn apply(&self, key: &Key, manifest: &[u8]) -> Result<(), SyncError> {
        // Before anything is read: a forbidden namespace costs the apiserver nothing.
        self.guard
            .check(key)
            .map_err(|forbidden| SyncError::Forbidden {
                key: key.clone(),
                forbidden,
            })?;
        let bad = |reason: String| SyncError::BadManifest {
            key: key.clone(),
            reason,
        };
        let mut value: Value = serde_json::from_slice(manifest).map_err(|e| bad(e.to_string()))?;
        let (kind, namespace, name, label) = (
            value["kind"].as_str(),
            value["metadata"]["namespace"].as_str(),
            value["metadata"]["name"].as_str(),
            value["metadata"]["labels"][MANAGED_BY_LABEL].as_str(),
        );
        if kind != Some("MyApp")
            || namespace != Some(key.namespace.as_str())
            || name != Some(key.name.as_str())
        {
            return Err(bad("kind, namespace or name differ from the message".into()));
        }
        if label != Some(MANAGED_BY_VALUE) {
            return Err(bad(format!(
                "the label {MANAGED_BY_LABEL}={MANAGED_BY_VALUE} is missing"
            )));
        }
        let api = self.api(&key.namespace);
        if self.managed.get(key).is_none() {
            // Not one of ours (as far as the cache knows): make sure no one else's is there.
            match api.get_opt(&key.name).await {
                Ok(Some(existing)) if !is_managed(&existing) => {
                    return Err(SyncError::NotManaged { key: key.clone() });
                }
                Ok(_) => {}
                Err(source) => {
                    return Err(SyncError::Api {
                        action: "reading",
                        key: key.clone(),
                        source,
                    });
                }
            }
        }
        self.give_way(key, &mut value).await?;
        api.patch(
            &key.name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&value),
        )
        .await
        .map(drop)
        .map_err(|source| SyncError::Api {
            action: "applying",
            key: key.clone(),
            source,
        })
    }

    /// Records the federation's replicas on the manifest, and leaves `spec.replicas` out
    /// of it while an autoscaler scales the MyApp (handing them over first, see
    /// [`replicas`]). A MyApp not created yet starts with the federation's replicas.
    async fn give_way(&self, key: &Key, manifest: &mut Value) -> Result<(), SyncError> {
        let api_error = |action, source| SyncError::Api {
            action,
            key: key.clone(),
            source,
        };
        let assigned = replicas::record_assigned(manifest);
        let autoscaler = match self.autoscalers.of(key) {
            Some(autoscaler) => Some(autoscaler),
            // The cache may not show yet an autoscaler that just scaled it: look again
            // before overwriting replicas someone else set (a LIST: not on every change
            // of the federation's own, where it doubled the propagation latency).
            None if self
                .managed
                .get(key)
                .is_some_and(|app| replicas::set_by_someone_else(&app, assigned)) =>
            {
                let fresh = self.autoscalers.of_fresh(key).await;
                fresh.map_err(|e| api_error("listing the autoscalers of", e))?
            }
            None => None,
        };
        let Some(autoscaler) = autoscaler.filter(|a| a.target == Target::MyApp) else {
            return Ok(());
        };
        let api = self.api(&key.namespace);
        // Read afresh: the cache keeps no field managers.
        let live = api.get_opt(&key.name).await;
        let Some(live) = live.map_err(|e| api_error("reading", e))? else {
            return Ok(());
        };
        replicas::hand_over(&api, &live, FIELD_MANAGER, replicas::myapp_replicas)
            .await
            .map_err(|e| api_error("handing spec.replicas over to the autoscaler of", e))?;
        if let Some(spec) = manifest["spec"].as_object_mut() {
            spec.remove("replicas");
        }
        debug!(app = %key, %autoscaler, assigned, "spec.replicas left to the autoscaler");
        Ok(())
    }

    /// The managed MyApp at `key`, from the cache or, on a miss or when `fresh`, from
    /// the apiserver: a MyApp applied a moment ago may not have reached the cache yet.
    async fn find_managed(&self, key: &Key, fresh: bool) -> Result<Option<Arc<MyApp>>, SyncError> {
        if !fresh && let Some(app) = self.managed.get(key) {
            return Ok(Some(app));
        }
        match self.api(&key.namespace).get_opt(&key.name).await {
            Ok(app) => Ok(app.filter(is_managed).map(Arc::new)),
            Err(source) => Err(SyncError::Api {
                action: "reading",
                key: key.clone(),
                source,
            }),
        }
    }

    /// Deletes a managed MyApp; its UID is a precondition, so a MyApp recreated by
    /// someone else meanwhile is not deleted. Ok means the apiserver confirmed it gone.
    pub async fn delete(&self, key: &Key) -> Result<(), SyncError> {
        let api = self.api(&key.namespace);
        // Twice at most: a conflict means the cached MyApp was replaced since; the second
        // try reads the apiserver.
        for fresh in [false, true] {
            let Some(app) = self.find_managed(key, fresh).await? else {
                return Ok(());
            };
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: app.uid(),
                    resource_version: None,
                }),
                ..Default::default()
            };
            match api.delete(&key.name, &params).await {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
                Err(kube::Error::Api(e)) if e.code == 409 => continue,
                Err(source) => {
                    return Err(SyncError::Api {
                        action: "deleting",
                        key: key.clone(),
                        source,
                    });
                }
            }
        }
        Err(SyncError::Replaced { key: key.clone() })
    }

    /// Stops managing a MyApp but leaves it running (`kubefed.io/orphan`).
    pub async fn release(&self, key: &Key) -> Result<(), SyncError> {
        if self.find_managed(key, false).await?.is_none() {
            return Ok(());
        }
        let patch = json!({"metadata": {"labels": {MANAGED_BY_LABEL: null}, "annotations": {HASH_ANNOTATION: null}}});
        match self
            .api(&key.namespace)
            .patch(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(source) => Err(SyncError::Api {
                action: "releasing",
                key: key.clone(),
                source,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::time::{Duration, Instant};

    use futures::stream;

    use super::*;
    use crate::collect::Breaker;
    use flotilla_proto::v1 as pb;

    /// Carries out `commands` (then waits for more) with an applier whose apiserver never
    /// answers, over a cache and a Hello that hold `ns/a`..`ns/d`; returns the notices
    /// until `until` says enough.
    async fn notices_of(
        commands: Vec<HubCommand>,
        until: impl Fn(&[(Instant, Notice)]) -> bool,
    ) -> Vec<(Instant, Notice)> {
        let names = ["a", "b", "c", "d"];
        let store = crate::store_of(&names);
        let applier = Applier::new(
            crate::unreachable_client(),
            store.clone(),
            crate::no_autoscalers(),
        );
        let collector = Collector {
            cluster: "c1".into(),
            managed: store,
            breaker: Breaker::new(names.iter().map(|n| Key::new("ns", *n)).collect(), 0.5),
        };
        let commands = stream::iter(commands.into_iter().map(Ok::<_, ()>)).chain(stream::pending());
        let (tx, mut rx) = mpsc::unbounded_channel();
        let work = carry_out(commands, &applier, &collector, 4, &tx);
        let mut seen = Vec::new();
        let watch = async {
            while !until(&seen) {
                if let Ok(notice) = tokio::time::timeout(Duration::from_millis(50), rx.recv()).await
                {
                    seen.push((Instant::now(), notice.unwrap()));
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), async {
            tokio::select! {
                _ = work => panic!("the commands never end"),
                () = watch => {}
            }
        })
        .await
        .expect("the notices did not come");
        seen
    }

    fn sync_complete(desired: &[&str], confirmed: u32) -> HubCommand {
        HubCommand::SyncComplete {
            desired: desired.iter().map(|n| Key::new("ns", *n)).collect(),
            confirmed_collection: confirmed,
        }
    }

    /// What the hub told the session to delete or release before its SyncComplete (as it
    /// does for a FederatedMyApp being deleted when an agent reconnects) is not counted
    /// as an orphan: here 3 of 4 would trip the breaker; only `d` is collected, and the
    /// release of `c` stays a release.
    #[tokio::test]
    async fn what_the_hub_told_to_delete_or_release_is_not_collected() {
        let delete = |name: &str, orphan| HubCommand::Delete {
            key: Key::new("ns", name),
            orphan,
        };
        let commands = vec![
            delete("b", false),
            delete("c", true),
            sync_complete(&["a"], 0),
        ];
        let blocked = |s: &[(Instant, Notice)]| {
            s.iter()
                .any(|(_, n)| matches!(n, Notice::CollectionBlocked(_)))
        };
        let tried = |s: &[(Instant, Notice)], name: &str| {
            s.iter()
                .any(|(_, n)| matches!(n, Notice::Tried { key, .. } if key.name == name))
        };
        let seen = notices_of(commands, |s| {
            blocked(s) || ["b", "c", "d"].iter().all(|n| tried(s, n))
        })
        .await;
        for (_, notice) in &seen {
            match notice {
                Notice::CollectionBlocked(b) => panic!("the breaker tripped: {b:?}"),
                Notice::Tried { key, error, .. } if key.name == "c" => {
                    let error = error.as_deref().unwrap_or_default();
                    assert!(error.starts_with("releasing"), "{error}");
                }
                Notice::Tried { .. } => {}
            }
        }
    }

    /// More than the share: nothing is tried, the hub hears of it.
    #[tokio::test]
    async fn a_mass_collection_is_held_and_nothing_is_deleted() {
        let seen = notices_of(vec![sync_complete(&["a"], 0)], |s| !s.is_empty()).await;
        assert_eq!(
            seen[0].1,
            Notice::CollectionBlocked(pb::CollectionBlocked {
                would_collect: 3,
                managed: 4
            })
        );
    }

    /// An orphan within the share is deleted; the delete fails (the apiserver is gone),
    /// is reported, and is tried again a second later.
    #[tokio::test]
    async fn an_orphan_is_deleted_and_a_failed_delete_retried() {
        let seen = notices_of(vec![sync_complete(&["a", "b", "c"], 0)], |s| s.len() >= 2).await;
        for (_, notice) in &seen {
            assert!(
                matches!(notice, Notice::Tried { key, error: Some(e), .. } if key.name == "d" && e.contains("MyApp ns/d")),
                "{notice:?}"
            );
        }
        assert!(
            seen[1].0 - seen[0].0 >= Duration::from_secs(1),
            "retried at once"
        );
    }

    /// A Delete that fails after an Apply for the same MyApp came is not retried (it
    /// would delete what the Apply created); the Apply's own outcome is reported (here a
    /// refusal, never retried either).
    #[tokio::test]
    async fn a_failed_delete_superseded_by_an_apply_is_not_retried() {
        let key = Key::new("ns", "a");
        let commands = vec![
            HubCommand::Delete {
                key: key.clone(),
                orphan: false,
            },
            HubCommand::Apply {
                key: key.clone(),
                manifest: bytes::Bytes::from_static(b"not json"),
            },
        ];
        let started = Instant::now();
        let seen = notices_of(commands, |_| {
            started.elapsed() > Duration::from_millis(2500)
        })
        .await;
        let notices: Vec<&Notice> = seen.iter().map(|(_, n)| n).collect();
        assert_eq!(notices.len(), 2, "{notices:?}");
        assert_eq!(
            notices[0],
            &Notice::Tried {
                key: key.clone(),
                error: None,
                applied: false,
            },
            "the failed Delete is dropped"
        );
        assert!(
            matches!(notices[1], Notice::Tried { error: Some(e), .. } if e.contains("not a MyApp")),
            "{notices:?}"
        );
    }

    #[tokio::test]
    async fn a_broken_stream_ends_the_work_with_its_error() {
        let store = crate::store_of(&[]);
        let applier = Applier::new(
            crate::unreachable_client(),
            store.clone(),
            crate::no_autoscalers(),
        );
        let collector = Collector {
            cluster: "c1".into(),
            managed: store,
            breaker: Breaker::new(HashSet::new(), 0.5),
        };
        let (tx, _rx) = mpsc::unbounded_channel();
        let commands = stream::iter([Err("reset")]);
        assert_eq!(
            carry_out(commands, &applier, &collector, 4, &tx).await,
            Err("reset")
        );
        let ended = stream::iter(Vec::<Result<HubCommand, ()>>::new());
        assert_eq!(carry_out(ended, &applier, &collector, 4, &tx).await, Ok(()));
    }
}
