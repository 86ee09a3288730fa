//! Sync: carries the hub's Apply and Delete into the member cluster.
//!
//! MyApps are written by server-side apply under the agent's own field manager and carry
//! the `app.kubernetes.io/managed-by: flotilla` label. The agent deletes a MyApp only when
//! the hub says so, or after SyncComplete when it manages it, listed it in this session's
//! Hello, and the hub no longer wants it; a MyApp without the label is never touched.
//! "Gone" is only ever said after the apiserver confirmed it, never from a cache miss.

use std::sync::Arc;

use flotilla_crds::{HASH_ANNOTATION, MANAGED_BY_LABEL, MANAGED_BY_VALUE, MyApp};
pub use flotilla_proto::AppKey as Key;
use futures::Stream;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::reflector::{self, ObjectRef, Store, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

pub const FIELD_MANAGER: &str = "flotilla-agent";

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("the manifest is not a MyApp for {key}: {reason}")]
    BadManifest { key: Key, reason: String },
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

pub fn is_managed(app: &MyApp) -> bool {
    app.labels()
        .get(MANAGED_BY_LABEL)
        .is_some_and(|v| v == MANAGED_BY_VALUE)
}

pub fn key_of(app: &MyApp) -> Key {
    Key::new(app.namespace().unwrap_or_default(), app.name_any())
}

/// The applied content hash of a managed MyApp.
pub fn applied_hash(app: &MyApp) -> String {
    app.annotations()
        .get(HASH_ANNOTATION)
        .cloned()
        .unwrap_or_default()
}

/// kubectl's copy of the object it last applied (client-side apply).
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Trims a MyApp to what the agent reads of a cached one: the field managers' sets
/// (`metadata.managedFields`, each a JSON tree as large as the fields it names) and
/// kubectl's last-applied copy go; nothing reads them from a cache. Everything a
/// decision reads stays: name, namespace, uid, resource version, generation, deletion
/// timestamp, owner references, the labels (the managed-by label), the other
/// annotations (the content hash), spec and status.
pub fn trim(app: &mut MyApp) {
    app.metadata.managed_fields = None;
    if let Some(annotations) = app.metadata.annotations.as_mut() {
        annotations.remove(LAST_APPLIED);
    }
}

/// A reflector of MyApps that caches them trimmed ([`trim`]): the managed MyApps of the
/// session, and all MyApps of the operator.
pub fn reflect<S>(writer: Writer<MyApp>, events: S) -> impl Stream<Item = S::Item>
where
    S: Stream<Item = Result<watcher::Event<MyApp>, watcher::Error>>,
{
    reflector::reflector(writer, events.modify(trim))
}

pub struct Sync {
    client: Client,
    /// MyApps carrying the managed-by label, kept by the agent's reflector.
    managed: Store<MyApp>,
}

impl Sync {
    pub fn new(client: Client, managed: Store<MyApp>) -> Self {
        Self { client, managed }
    }

    fn api(&self, namespace: &str) -> Api<MyApp> {
        Api::namespaced(self.client.clone(), namespace)
    }

    fn get_managed(&self, key: &Key) -> Option<std::sync::Arc<MyApp>> {
        self.managed
            .get(&ObjectRef::new(&key.name).within(&key.namespace))
    }

    pub async fn apply(&self, key: &Key, manifest: &[u8]) -> Result<(), SyncError> {
        let bad = |reason: String| SyncError::BadManifest {
            key: key.clone(),
            reason,
        };
        let value: Value = serde_json::from_slice(manifest).map_err(|e| bad(e.to_string()))?;
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
        if self.get_managed(key).is_none() {
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

    /// Every managed MyApp as the apiserver has it now (not the cache): what Hello
    /// lists, so that the hub takes nothing for absent that exists.
    pub async fn list_managed(&self) -> Result<Vec<MyApp>, kube::Error> {
        let params =
            ListParams::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"));
        Ok(Api::<MyApp>::all(self.client.clone())
            .list(&params)
            .await?
            .items)
    }

    /// The managed MyApp at `key`, from the cache or, on a miss or when `fresh`, from
    /// the apiserver: a MyApp applied a moment ago may not have reached the cache yet.
    async fn find_managed(&self, key: &Key, fresh: bool) -> Result<Option<Arc<MyApp>>, SyncError> {
        if !fresh && let Some(app) = self.get_managed(key) {
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
    use super::*;
    use futures::StreamExt;

    /// The caches of the session and of the operator hold no field managers and no
    /// last-applied copy (most of a cached MyApp's memory), and everything else as the
    /// apiserver sent it: the managed-by label and content hash that Hello, the reports
    /// and the deletion decisions read, the uid of the delete precondition, generation,
    /// spec and status.
    #[tokio::test]
    async fn cached_myapps_keep_what_is_read_and_drop_managed_fields() {
        let app: MyApp = serde_json::from_value(json!({
            "apiVersion": "app.example.com/v1", "kind": "MyApp",
            "metadata": {
                "name": "a", "namespace": "ns", "uid": "u-1", "resourceVersion": "7", "generation": 2,
                "labels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE, "team": "x"},
                "annotations": {HASH_ANNOTATION: "abc", LAST_APPLIED: "{\"spec\":{}}", "note": "kept"},
                "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "o", "uid": "u-0"}],
                "managedFields": [{
                    "manager": "flotilla-agent", "operation": "Apply", "apiVersion": "app.example.com/v1",
                    "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:replicas": {}, "f:image": {}}}
                }]
            },
            "spec": {"replicas": 3, "image": "nginx:1.27", "config": {"k": "v"}},
            "status": {"ready": true, "readyReplicas": 3, "observedGeneration": 2}
        }))
        .unwrap();
        let (store, writer) = reflector::store::<MyApp>();
        let events = futures::stream::iter([
            Ok(watcher::Event::Init),
            Ok(watcher::Event::InitApply(app.clone())),
            Ok(watcher::Event::InitDone),
        ]);
        reflect(writer, events).for_each(|_| async {}).await;
        let cached = store
            .get(&ObjectRef::new("a").within("ns"))
            .expect("cached");
        assert_eq!(cached.metadata.managed_fields, None);
        assert!(!cached.annotations().contains_key(LAST_APPLIED));
        assert!(is_managed(&cached));
        assert_eq!(applied_hash(&cached), "abc");
        let mut want = app;
        want.metadata.managed_fields = None;
        want.annotations_mut().remove(LAST_APPLIED);
        assert_eq!(
            serde_json::to_value(&*cached).unwrap(),
            serde_json::to_value(&want).unwrap(),
            "nothing else changed"
        );
    }
}
