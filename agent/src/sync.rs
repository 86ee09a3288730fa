//! Sync: carries the hub's Apply and Delete into the member cluster.
//!
//! MyApps are written by server-side apply under the agent's own field manager and carry
//! the `app.kubernetes.io/managed-by: flotilla` label. The agent deletes a MyApp only when
//! the hub says so, or after SyncComplete when it manages it and the hub no longer wants
//! it; a MyApp without the label is never touched.

use std::collections::HashSet;

use flotilla_crds::{HASH_ANNOTATION, MANAGED_BY_LABEL, MANAGED_BY_VALUE, MyApp};
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

pub const FIELD_MANAGER: &str = "flotilla-agent";

/// A MyApp's namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("the manifest is not a MyApp for {key}: {reason}")]
    BadManifest { key: Key, reason: String },
    #[error("a MyApp {key} exists that Flotilla does not manage; it is left alone")]
    NotManaged { key: Key },
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
    Key {
        namespace: app.namespace().unwrap_or_default(),
        name: app.name_any(),
    }
}

/// The applied content hash of a managed MyApp.
pub fn applied_hash(app: &MyApp) -> String {
    app.annotations()
        .get(HASH_ANNOTATION)
        .cloned()
        .unwrap_or_default()
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

    /// Deletes a managed MyApp; its UID is a precondition, so a MyApp recreated by
    /// someone else meanwhile is not deleted.
    pub async fn delete(&self, key: &Key) -> Result<(), SyncError> {
        let Some(app) = self.get_managed(key) else {
            return Ok(());
        };
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: app.uid(),
                resource_version: None,
            }),
            ..Default::default()
        };
        match self.api(&key.namespace).delete(&key.name, &params).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(()),
            Err(source) => Err(SyncError::Api {
                action: "deleting",
                key: key.clone(),
                source,
            }),
        }
    }

    /// Stops managing a MyApp but leaves it running (`kubefed.io/orphan`).
    pub async fn release(&self, key: &Key) -> Result<(), SyncError> {
        if self.get_managed(key).is_none() {
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

    /// Managed MyApps the hub no longer wants.
    pub fn orphans(&self, desired: &HashSet<Key>) -> Vec<Key> {
        let mut orphans: Vec<Key> = self
            .managed
            .state()
            .iter()
            .map(|a| key_of(a))
            .filter(|k| !desired.contains(k))
            .collect();
        orphans.sort();
        orphans
    }
}
