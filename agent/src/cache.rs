//! Cache: the agent's reflectors of MyApps, and what a cached MyApp tells.
//!
//! MyApps are cached trimmed to their readers ([`trim_for_session`],
//! [`trim_for_operator`]): the session's cache of managed MyApps (with a
//! feed of the keys that changed, for the reports) and the operator's cache of all
//! MyApps. A cache never decides a deletion on its own: Hello lists the apiserver, and a
//! delete reads it again on a miss (see `sync`).
//!
//! An agent with `--allowed-namespace` watches only those namespaces, so that
//! RoleBindings there give it what it reads: a reflector per namespace ([`Stores`]),
//! since one store fed by several watches is emptied by each one's re-list.

use std::collections::BTreeSet;
use std::sync::Arc;

use flotilla_common::listed::{self, Listed, NeverListed};
use flotilla_crds::{HASH_ANNOTATION, MANAGED_BY_LABEL, MANAGED_BY_VALUE, MyApp, MyAppSpec};
pub use flotilla_proto::AppKey as Key;
use futures::{Stream, StreamExt};
use kube::core::NamespaceResourceScope;
use kube::runtime::reflector::{self, ObjectRef, Store, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::broadcast;
use tracing::warn;

/// Whether Flotilla manages this MyApp (it carries the managed-by label): nothing else is
/// ever touched.
pub fn is_managed(app: &MyApp) -> bool {
    app.labels()
        .get(MANAGED_BY_LABEL)
        .is_some_and(|v| v == MANAGED_BY_VALUE)
}

/// The key of the MyApp `name` in `namespace`: the one place that says what a MyApp
/// without a namespace (none exists) is keyed by.
pub fn key(namespace: Option<String>, name: &str) -> Key {
    Key::new(namespace.unwrap_or_default(), name)
}

pub fn key_of(app: &impl ResourceExt) -> Key {
    key(app.namespace(), &app.name_any())
}

/// A cache of MyApps: one store for every namespace, or one per namespace watched.
#[derive(Clone)]
pub struct Stores(Arc<[(Option<String>, Store<MyApp>)]>);

impl Stores {
    /// One store of every namespace.
    pub fn all(store: Store<MyApp>) -> Self {
        Self(Arc::new([(None, store)]))
    }

    /// The MyApp at `key`, if cached.
    pub fn get(&self, key: &Key) -> Option<Arc<MyApp>> {
        let (_, store) = (self.0.iter())
            .find(|(namespace, _)| namespace.as_ref().is_none_or(|n| *n == key.namespace))?;
        store.get(&ObjectRef::new(&key.name).within(&key.namespace))
    }

    /// Every cached MyApp.
    pub fn state(&self) -> Vec<Arc<MyApp>> {
        self.0.iter().flat_map(|(_, store)| store.state()).collect()
    }

    /// The key of every cached MyApp.
    pub fn keys(&self) -> Vec<Key> {
        self.state().iter().map(|app| key_of(&**app)).collect()
    }
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

/// Trims a MyApp to what any reader of a cached one needs: the field managers' sets
/// (`metadata.managedFields`, each a JSON tree as large as the fields it names) and
/// kubectl's last-applied copy go; nothing reads them from a cache.
fn trim(app: &mut MyApp) {
    app.metadata.managed_fields = None;
    if let Some(annotations) = app.metadata.annotations.as_mut() {
        annotations.remove(LAST_APPLIED);
    }
}

/// What the session reads of a cached managed MyApp (after `trim`): name, namespace,
/// uid (the delete precondition), resource version, generation, deletion timestamp, the
/// labels (the managed-by label), the annotations (content hash, assigned replicas,
/// bounds, drift note), `spec.replicas` and the status but its selector. The rest of the
/// spec is the operator's to read; the session applies what the hub sends.
pub fn trim_for_session(app: &mut MyApp) {
    trim(app);
    app.metadata.owner_references = None;
    app.spec = MyAppSpec {
        replicas: app.spec.replicas,
        ..MyAppSpec::default()
    };
    if let Some(status) = app.status.as_mut() {
        status.selector = None;
    }
}

/// What the operator reads of a cached MyApp (after `trim`): name, namespace, uid (the
/// children's owner reference), generation, deletion timestamp, spec and the whole
/// status (compared with the one it computes). Children are labelled from the MyApp's
/// name, never its labels, and nothing it does reads an annotation.
pub fn trim_for_operator(app: &mut MyApp) {
    trim(app);
    app.metadata.labels = None;
    app.metadata.annotations = None;
}

/// The cache's own note of a managed MyApp's drift ([`crate::drift`]), made from its
/// field managers before the cache drops them ([`trim_for_session`]). Never written to the apiserver; one found
/// there is not believed.
pub const DRIFT_NOTE: &str = "agent.flotilla.io/drift";

/// Notes the MyApp's drift ([`DRIFT_NOTE`]) for the cache, from its field managers.
pub fn note_drift(app: &mut MyApp) {
    let drift = crate::drift::of(app.managed_fields());
    let annotations = &mut app.metadata.annotations;
    if let Some(a) = annotations.as_mut() {
        a.remove(DRIFT_NOTE);
    }
    if let Some(drift) = drift {
        annotations
            .get_or_insert_with(Default::default)
            .insert(DRIFT_NOTE.into(), drift);
    }
}

/// The drift noted in a cached MyApp, if any.
pub fn drift(app: &MyApp) -> Option<&String> {
    app.annotations().get(DRIFT_NOTE)
}

/// A reflector of MyApps that caches them trimmed by `trim_for` ([`trim_for_session`] or
/// [`trim_for_operator`]).
pub fn reflect<S>(
    writer: Writer<MyApp>,
    events: S,
    trim_for: fn(&mut MyApp),
) -> impl Stream<Item = S::Item>
where
    S: Stream<Item = Result<watcher::Event<MyApp>, watcher::Error>>,
{
    reflector::reflector(writer, events.modify(trim_for))
}

/// The MyApps this agent manages, cached, with a feed of the keys that changed.
#[derive(Clone)]
pub struct Managed {
    pub store: Stores,
    listed: Vec<Listed>,
    pub changes: broadcast::Sender<Key>,
}

impl Managed {
    /// Resolves once every namespace watched has been listed.
    pub async fn listed(&self) -> Result<(), NeverListed> {
        listed::all(&self.listed).await
    }
}

/// An `Api` per namespace of `namespaces`, each with its namespace, or one of every
/// namespace (`None`) without them: what an agent with `--allowed-namespace` lists and
/// watches, and nothing else.
pub fn apis<K>(
    client: &Client,
    namespaces: Option<&BTreeSet<String>>,
) -> Vec<(Option<String>, Api<K>)>
where
    K: Resource<Scope = NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespaces {
        None => vec![(None, Api::all(client.clone()))],
        Some(namespaces) => (namespaces.iter())
            .map(|n| (Some(n.clone()), Api::namespaced(client.clone(), n)))
            .collect(),
    }
}

/// The selector of the MyApps Flotilla manages.
pub fn managed_selector() -> String {
    format!("{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}")
}

/// Watches managed MyApps in `scope`'s namespaces, or in every namespace without one;
/// the future runs the watches.
pub fn watch_managed(
    client: Client,
    scope: Option<&BTreeSet<String>>,
) -> (Managed, impl std::future::Future<Output = ()> + use<>) {
    let (changes, _) = broadcast::channel(1024);
    let mut stores = Vec::new();
    let mut listed = Vec::new();
    let mut runs = Vec::new();
    for (namespace, api) in apis::<MyApp>(&client, scope) {
        let (store, writer) = reflector::store::<MyApp>();
        let config = watcher::Config::default().labels(&managed_selector());
        let (stream, done) = listed::track(
            reflect(
                writer,
                watcher(api, config).modify(note_drift),
                trim_for_session,
            )
            .default_backoff(),
        );
        let stream = stream.touched_objects();
        let feed = changes.clone();
        runs.push(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(app) => {
                        let _ = feed.send(key_of(&app));
                    }
                    Err(e) => warn!(error = %e, "watching managed MyApps"),
                }
            }
        });
        stores.push((namespace, store));
        listed.push(done);
    }
    let run = async move {
        futures::future::join_all(runs).await;
    };
    let managed = Managed {
        store: Stores(stores.into()),
        listed,
        changes,
    };
    (managed, run)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The session's cache notes drift from the field managers it then drops; a note
    /// found on the apiserver's object is not believed.
    #[test]
    fn drift_is_noted_from_the_field_managers_and_a_forged_note_is_dropped() {
        let app = |annotations: serde_json::Value, editor: &str| -> MyApp {
            serde_json::from_value(json!({
                "apiVersion": "app.example.com/v1", "kind": "MyApp",
                "metadata": {"name": "a", "namespace": "ns", "annotations": annotations,
                    "managedFields": [
                        {"manager": "flotilla-agent", "operation": "Apply",
                         "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:image": {}}}},
                        {"manager": editor, "operation": "Update",
                         "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:config": {}}}},
                    ]},
                "spec": {"image": "nginx"},
            }))
            .unwrap()
        };
        let mut edited = app(json!({}), "kubectl-edit");
        note_drift(&mut edited);
        assert_eq!(
            drift(&edited).map(String::as_str),
            Some("spec.config by kubectl-edit")
        );
        let mut forged = app(json!({DRIFT_NOTE: "spec.image by me"}), "flotilla-agent");
        note_drift(&mut forged);
        assert_eq!(drift(&forged), None);
    }

    fn full_app() -> MyApp {
        serde_json::from_value(json!({
            "apiVersion": "app.example.com/v1", "kind": "MyApp",
            "metadata": {
                "name": "a", "namespace": "ns", "uid": "u-1", "resourceVersion": "7", "generation": 2,
                "deletionTimestamp": "2026-12-06T00:00:00Z",
                "labels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE, "team": "x"},
                "annotations": {HASH_ANNOTATION: "abc", LAST_APPLIED: "{\"spec\":{}}", "note": "kept"},
                "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "o", "uid": "u-0"}],
                "managedFields": [{
                    "manager": "flotilla-agent", "operation": "Apply", "apiVersion": "app.example.com/v1",
                    "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:replicas": {}, "f:image": {}}}
                }]
            },
            "spec": {"replicas": 3, "image": "nginx:1.27", "config": {"k": "v"}},
            "status": {"ready": true, "readyReplicas": 3, "replicas": 3, "selector": "app=a",
                "observedGeneration": 2,
                "conditions": [{"type": "Ready", "status": "True", "reason": "Available", "message": "m",
                    "lastTransitionTime": "2026-12-06T00:00:00Z"}]}
        }))
        .unwrap()
    }

    /// `app` as a reflector trimming by `trim_for` caches it.
    async fn cached(app: &MyApp, trim_for: fn(&mut MyApp)) -> serde_json::Value {
        let (store, writer) = reflector::store::<MyApp>();
        let events = futures::stream::iter([
            Ok(watcher::Event::Init),
            Ok(watcher::Event::InitApply(app.clone())),
            Ok(watcher::Event::InitDone),
        ]);
        reflect(writer, events, trim_for)
            .for_each(|_| async {})
            .await;
        let cached = Stores::all(store)
            .get(&Key::new("ns", "a"))
            .expect("cached");
        serde_json::to_value(&*cached).unwrap()
    }

    /// The session's cache holds no field managers, no last-applied copy and of the spec
    /// only `replicas`; everything else it reads stays as the apiserver sent it: the
    /// managed-by label and content hash that Hello, the reports and the deletion
    /// decisions read, the uid of the delete precondition, generation, deletion
    /// timestamp, and the status the reports carry.
    #[tokio::test]
    async fn the_session_caches_what_it_reads() {
        let cached = cached(&full_app(), trim_for_session).await;
        let mut want = serde_json::to_value(full_app()).unwrap();
        let meta = want["metadata"].as_object_mut().unwrap();
        meta.remove("managedFields");
        meta.remove("ownerReferences");
        meta["annotations"]
            .as_object_mut()
            .unwrap()
            .remove(LAST_APPLIED);
        want["spec"] = json!({"replicas": 3});
        want["status"].as_object_mut().unwrap().remove("selector");
        assert_eq!(cached, want);
        let app: MyApp = serde_json::from_value(cached).unwrap();
        assert!(is_managed(&app));
        assert_eq!(applied_hash(&app), "abc");
        assert_eq!(key_of(&app), Key::new("ns", "a"));
    }

    /// The operator's cache holds no field managers, labels or annotations; name,
    /// namespace, uid, generation, deletion timestamp, spec and status stay whole.
    #[tokio::test]
    async fn the_operator_caches_what_it_reads() {
        let cached = cached(&full_app(), trim_for_operator).await;
        let mut want = serde_json::to_value(full_app()).unwrap();
        let meta = want["metadata"].as_object_mut().unwrap();
        meta.remove("managedFields");
        meta.remove("labels");
        meta.remove("annotations");
        assert_eq!(cached, want);
    }
}
