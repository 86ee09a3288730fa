//! Bounds: the member's autoscaler of a MyApp gets the bounds the hub writes on that
//! MyApp ([`flotilla_crds::bounds`]): this cluster's share of the FederatedMyApp's
//! `spec.autoscaling` minimum and maximum replicas.
//!
//! The autoscaler is the HorizontalPodAutoscaler [`Autoscalers::of`] finds. One that a
//! KEDA ScaledObject owns gets its bounds through the ScaledObject (`minReplicaCount`,
//! `maxReplicaCount`): KEDA would revert an edit of its HPA. Any other gets them in its
//! own `minReplicas`, `maxReplicas`. Only those two fields are written, by server-side
//! apply under a field manager of their own ([`FIELD_MANAGER`]), and only when they
//! differ; nothing else of the autoscaler is touched, and a MyApp without one is only
//! logged: the member brings its HPA or ScaledObject.
//!
//! Looked at once every MyApp and autoscaler has been listed, then whenever a MyApp's
//! bounds or an HPA's spec change, and every [`RESYNC`] (a ScaledObject is not watched:
//! an edit of one shows as KEDA's change of its HPA, or at the resync). A failed write is
//! tried again after [`RETRY`]. Namespaces the agent would not apply into are never
//! written.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_crds::bounds::Bounds;
use futures::StreamExt;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio::sync::broadcast::error::RecvError;
use tokio_util::time::DelayQueue;
use tracing::{debug, info, warn};

use crate::autoscale::Autoscalers;
use crate::cache::{Key, Managed, Stores, is_managed};
use crate::scaler::Scope;

/// The field manager of the bounds: the agent's other managers never own them.
pub const FIELD_MANAGER: &str = "flotilla-bounds";
/// Every MyApp's bounds are checked again this often.
pub const RESYNC: Duration = Duration::from_secs(300);
pub const RETRY: Duration = Duration::from_secs(5);

const KEDA_GROUP: &str = "keda.sh";
const HPA_KIND: &str = "HorizontalPodAutoscaler";
const SCALED_OBJECT_KIND: &str = "ScaledObject";

/// The object that holds an autoscaler's bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// The HorizontalPodAutoscaler itself.
    Hpa { name: String },
    /// The KEDA ScaledObject that owns the HorizontalPodAutoscaler.
    ScaledObject { name: String },
}

impl Holder {
    /// Where `hpa`'s bounds are set: its owning ScaledObject if any, else itself.
    pub fn of(hpa: &HorizontalPodAutoscaler) -> Holder {
        let scaled_object = hpa.owner_references().iter().find(|owner| {
            owner.kind == SCALED_OBJECT_KIND
                && owner.api_version.split_once('/').map(|(group, _)| group) == Some(KEDA_GROUP)
        });
        match scaled_object {
            Some(owner) => Holder::ScaledObject {
                name: owner.name.clone(),
            },
            None => Holder::Hpa {
                name: hpa.name_any(),
            },
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Holder::Hpa { .. } => HPA_KIND,
            Holder::ScaledObject { .. } => SCALED_OBJECT_KIND,
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Holder::Hpa { name } | Holder::ScaledObject { name } => name,
        }
    }

    /// The names of the minimum and the maximum in the holder's `spec`.
    fn fields(&self) -> [&'static str; 2] {
        match self {
            Holder::Hpa { .. } => ["minReplicas", "maxReplicas"],
            Holder::ScaledObject { .. } => ["minReplicaCount", "maxReplicaCount"],
        }
    }

    fn api_version(&self) -> &'static str {
        match self {
            Holder::Hpa { .. } => "autoscaling/v2",
            Holder::ScaledObject { .. } => "keda.sh/v1alpha1",
        }
    }

    /// The server-side apply patch that sets `bounds` on the holder in `namespace`, or
    /// `None` when its `spec` (as read) has them already.
    pub fn patch(&self, namespace: &str, spec: &Value, bounds: &Bounds) -> Option<Value> {
        let [min, max] = self.fields();
        let has = |field: &str, want: u32| spec[field].as_u64() == Some(u64::from(want));
        if has(min, bounds.min) && has(max, bounds.max) {
            return None;
        }
        Some(json!({
            "apiVersion": self.api_version(),
            "kind": self.kind(),
            "metadata": {"name": self.name(), "namespace": namespace},
            "spec": {min: bounds.min, max: bounds.max},
        }))
    }
}

fn scaled_object_resource() -> ApiResource {
    ApiResource {
        group: KEDA_GROUP.into(),
        version: "v1alpha1".into(),
        api_version: "keda.sh/v1alpha1".into(),
        kind: SCALED_OBJECT_KIND.into(),
        plural: "scaledobjects".into(),
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

/// How many bounds were written, by the kind of object that holds them.
#[derive(Clone, Debug, Default)]
pub struct Written(Family<KindLabels, Counter>);

impl Written {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "flotilla_agent_autoscaler_bounds_written",
            "Bounds (min and max replicas) the agent wrote on a member autoscaler, by the kind of object written (HorizontalPodAutoscaler, ScaledObject)",
            self.0.clone(),
        );
    }

    fn inc(&self, kind: &'static str) {
        self.0.get_or_create(&KindLabels { kind }).inc();
    }
}

/// What was last said of a MyApp's bounds, so that each state is logged once.
#[derive(Debug, Clone, PartialEq)]
enum Said {
    Malformed(String),
    OutOfScope,
    NoAutoscaler,
    /// Found on this holder, or written there, while the HPA's spec was at this version.
    Set(Holder, Bounds, SpecVersion),
}

/// Which spec of which HPA: a change of the spec (KEDA's too, when its ScaledObject
/// changed) is looked at, the HPA controller's status updates are not.
#[derive(Debug, Clone, PartialEq)]
struct SpecVersion {
    uid: Option<String>,
    generation: Option<i64>,
}

impl SpecVersion {
    fn of(hpa: &HorizontalPodAutoscaler) -> Self {
        Self {
            uid: hpa.metadata.uid.clone(),
            generation: hpa.metadata.generation,
        }
    }
}

/// Sets bounds on the member's autoscalers until the feeds end (the agent stops acting).
pub async fn run(
    client: Client,
    managed: Managed,
    autoscalers: Autoscalers,
    scope: Scope,
    written: Written,
) {
    let mut apps = managed.changes.subscribe();
    let mut scaled = autoscalers.subscribe();
    if managed.listed().await.is_err() || autoscalers.listed().await.is_err() {
        return;
    }
    let bounder = Bounder {
        client,
        store: managed.store,
        autoscalers,
        scope,
        written,
    };
    let mut said: HashMap<Key, Said> = HashMap::new();
    let mut retries = DelayQueue::new();
    let mut resync = tokio::time::interval(RESYNC);
    resync.tick().await;
    let mut due = bounder.store.keys();
    loop {
        for key in due.drain(..) {
            if let Err(e) = bounder.bound(&key, &mut said).await {
                warn!(app = %key, error = %format!("{e:#}"), "setting the autoscaler's bounds; retrying");
                retries.insert(key, RETRY);
            }
        }
        let next = tokio::select! {
            change = apps.recv() => change,
            change = scaled.recv() => change,
            Some(retry) = retries.next() => Ok(retry.into_inner()),
            // As after a lagged feed: everything is looked at again.
            _ = resync.tick() => Err(RecvError::Lagged(0)),
        };
        match next {
            Ok(key) => due.push(key),
            Err(RecvError::Lagged(_)) => {
                // What is in place is read again.
                said.retain(|_, s| !matches!(s, Said::Set(..)));
                due = bounder.store.keys();
            }
            Err(RecvError::Closed) => return,
        }
    }
}

struct Bounder {
    client: Client,
    store: Stores,
    autoscalers: Autoscalers,
    scope: Scope,
    written: Written,
}

impl Bounder {
    /// Sets the bounds of the MyApp at `key` on its autoscaler, if it has both.
    async fn bound(&self, key: &Key, said: &mut HashMap<Key, Said>) -> anyhow::Result<()> {
        let Some(app) = self
            .store
            .get(key)
            .filter(|app| is_managed(app) && app.metadata.deletion_timestamp.is_none())
        else {
            said.remove(key);
            return Ok(());
        };
        let bounds = match Bounds::of(app.annotations()) {
            Ok(Some(bounds)) => bounds,
            Ok(None) => {
                said.remove(key);
                return Ok(());
            }
            Err(e) => {
                if say(said, key, Said::Malformed(e.to_string())) {
                    warn!(app = %key, annotation = e.annotation, "MyApp {key}: {e}; its autoscaler's bounds are left as they are");
                }
                return Ok(());
            }
        };
        if let Err(why) = self.scope.admits(&key.namespace) {
            if say(said, key, Said::OutOfScope) {
                info!(app = %key, "MyApp {key}: {why}; its autoscaler's bounds are not written");
            }
            return Ok(());
        }
        let Some(hpa) = self.autoscalers.hpa_of(key) else {
            if say(said, key, Said::NoAutoscaler) {
                info!(app = %key, %bounds, "MyApp {key} has bounds but no HorizontalPodAutoscaler or ScaledObject scales it");
            }
            return Ok(());
        };
        let holder = Holder::of(&hpa);
        let set = Said::Set(holder.clone(), bounds, SpecVersion::of(&hpa));
        if said.get(key) == Some(&set) {
            return Ok(());
        }
        let Some(spec) = self.spec_of(&holder, &hpa, &key.namespace).await? else {
            debug!(app = %key, "ScaledObject {}/{} is gone", key.namespace, holder.name());
            return Ok(());
        };
        if let Some(patch) = holder.patch(&key.namespace, &spec, &bounds) {
            self.apply(&holder, &key.namespace, patch).await?;
            self.written.inc(holder.kind());
            info!(app = %key, "{} {}/{}: replicas {}..{} (MyApp {key}'s bounds)", holder.kind(), key.namespace, holder.name(), bounds.min, bounds.max);
        }
        said.insert(key.clone(), set);
        Ok(())
    }

    /// The holder's live `spec`: the cached HPA's, or the ScaledObject's as read now
    /// (`None` when there is none, or no ScaledObject CRD).
    async fn spec_of(
        &self,
        holder: &Holder,
        hpa: &Arc<HorizontalPodAutoscaler>,
        namespace: &str,
    ) -> anyhow::Result<Option<Value>> {
        match holder {
            Holder::Hpa { .. } => Ok(Some(serde_json::to_value(&hpa.spec)?)),
            Holder::ScaledObject { name } => {
                let found = (self.scaled_objects(namespace).get_opt(name).await)
                    .with_context(|| format!("reading ScaledObject {namespace}/{name}"))?;
                Ok(found.map(|so| so.data["spec"].clone()))
            }
        }
    }

    /// Applies `patch`. Were the holder deleted just before, the apply would create it:
    /// both schemas require `scaleTargetRef`, so the apiserver refuses that.
    async fn apply(&self, holder: &Holder, namespace: &str, patch: Value) -> anyhow::Result<()> {
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let patch = Patch::Apply(&patch);
        let name = holder.name();
        let applied = match holder {
            Holder::Hpa { .. } => {
                let api: Api<HorizontalPodAutoscaler> =
                    Api::namespaced(self.client.clone(), namespace);
                api.patch(name, &params, &patch).await.map(drop)
            }
            Holder::ScaledObject { .. } => (self.scaled_objects(namespace))
                .patch(name, &params, &patch)
                .await
                .map(drop),
        };
        applied.with_context(|| {
            let [min, max] = holder.fields();
            let kind = holder.kind();
            format!("setting spec.{min} and spec.{max} of {kind} {namespace}/{name}")
        })
    }

    fn scaled_objects(&self, namespace: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), namespace, &scaled_object_resource())
    }
}

/// Records `now` as what was said of `key`; whether it is new (to be logged).
fn say(said: &mut HashMap<Key, Said>, key: &Key, now: Said) -> bool {
    said.insert(key.clone(), now.clone()) != Some(now)
}

#[cfg(test)]
mod tests {
    use flotilla_crds::bounds::{MAX_ANNOTATION, MIN_ANNOTATION, SHARE_ANNOTATION};
    use flotilla_crds::tenancy::NamespacePolicy;
    use flotilla_crds::{MANAGED_BY_LABEL, MANAGED_BY_VALUE};
    use kube::runtime::watcher::Event;

    use super::*;
    use crate::operator::Namespaces;

    fn hpa(owners: Value, min: u32, max: u32) -> HorizontalPodAutoscaler {
        serde_json::from_value(json!({
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "keda-hpa-web", "namespace": "ns", "ownerReferences": owners},
            "spec": {"scaleTargetRef": {"apiVersion": "app.example.com/v1", "kind": "MyApp", "name": "web"},
                     "minReplicas": min, "maxReplicas": max}
        }))
        .unwrap()
    }

    fn owner(api_version: &str, kind: &str) -> Value {
        json!([{"apiVersion": api_version, "kind": kind, "name": "web-so", "uid": "u", "controller": true}])
    }

    const BOUNDS: Bounds = Bounds {
        min: 2,
        max: 5,
        parts: 5,
        whole: 16,
    };

    #[test]
    fn an_hpa_keda_owns_is_bounded_through_its_scaledobject() {
        let keda = hpa(owner("keda.sh/v1alpha1", "ScaledObject"), 1, 100);
        let holder = Holder::of(&keda);
        assert_eq!(
            holder,
            Holder::ScaledObject {
                name: "web-so".into()
            }
        );
        let spec = json!({"scaleTargetRef": {"name": "web"}, "minReplicaCount": 0});
        assert_eq!(
            holder.patch("ns", &spec, &BOUNDS),
            Some(json!({
                "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
                "metadata": {"name": "web-so", "namespace": "ns"},
                "spec": {"minReplicaCount": 2, "maxReplicaCount": 5},
            }))
        );
        for other in [
            owner("other.io/v1", "ScaledObject"),
            owner("keda.sh/v1alpha1", "ScaledJob"),
            json!([]),
        ] {
            let plain = hpa(other.clone(), 1, 3);
            assert_eq!(
                Holder::of(&plain),
                Holder::Hpa {
                    name: "keda-hpa-web".into()
                },
                "{other}"
            );
        }
    }

    #[test]
    fn an_hpa_is_patched_in_its_two_fields_and_only_when_they_differ() {
        let holder = Holder::Hpa { name: "web".into() };
        let spec =
            |min: u32, max: u32| serde_json::to_value(&hpa(json!([]), min, max).spec).unwrap();
        assert_eq!(
            holder.patch("ns", &spec(1, 10), &BOUNDS),
            Some(json!({
                "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": "web", "namespace": "ns"},
                "spec": {"minReplicas": 2, "maxReplicas": 5},
            }))
        );
        assert!(
            holder.patch("ns", &spec(2, 10), &BOUNDS).is_some(),
            "max differs"
        );
        assert_eq!(
            holder.patch("ns", &spec(2, 5), &BOUNDS),
            None,
            "equal: no write"
        );
        assert!(
            holder.patch("ns", &json!(null), &BOUNDS).is_some(),
            "none set"
        );
    }

    fn bounder(apps: Vec<Value>, scope: Scope) -> Bounder {
        let (store, mut writer) = kube::runtime::reflector::store();
        writer.apply_watcher_event(&Event::Init);
        for app in apps {
            writer.apply_watcher_event(&Event::InitApply(serde_json::from_value(app).unwrap()));
        }
        writer.apply_watcher_event(&Event::InitDone);
        Bounder {
            client: crate::unreachable_client(),
            store: Stores::all(store),
            autoscalers: crate::no_autoscalers(),
            scope,
            written: Written::default(),
        }
    }

    fn app(namespace: &str, name: &str, annotations: Value) -> Value {
        json!({
            "apiVersion": "app.example.com/v1", "kind": "MyApp",
            "metadata": {"name": name, "namespace": namespace, "annotations": annotations,
                         "labels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE}},
            "spec": {"image": "nginx:1.27"},
        })
    }

    /// Nothing here reaches the apiserver (which never answers in these tests): a MyApp
    /// without an autoscaler, with broken bounds, or in a namespace the agent would not
    /// apply into is only logged, once.
    #[tokio::test]
    async fn without_an_autoscaler_or_with_broken_bounds_nothing_is_written() {
        let good = json!({MIN_ANNOTATION: "2", MAX_ANNOTATION: "5", SHARE_ANNOTATION: "5/16"});
        let broken = json!({MIN_ANNOTATION: "2", MAX_ANNOTATION: "x", SHARE_ANNOTATION: "5/16"});
        let bounder = bounder(
            vec![
                app("ns", "lone", good.clone()),
                app("ns", "broken", broken),
                app("kube-system", "sys", good),
                app("ns", "plain", json!({})),
            ],
            Scope {
                operator: Namespaces::All,
                tenancy: Some(NamespacePolicy::new(
                    "flotilla-system",
                    Vec::<String>::new(),
                )),
            },
        );
        let mut said = HashMap::new();
        for name in ["lone", "broken", "plain", "gone"] {
            bounder
                .bound(&Key::new("ns", name), &mut said)
                .await
                .unwrap();
        }
        bounder
            .bound(&Key::new("kube-system", "sys"), &mut said)
            .await
            .unwrap();
        assert_eq!(said.get(&Key::new("ns", "lone")), Some(&Said::NoAutoscaler));
        assert!(
            matches!(said.get(&Key::new("ns", "broken")), Some(Said::Malformed(e)) if e.contains(MAX_ANNOTATION))
        );
        assert_eq!(
            said.get(&Key::new("kube-system", "sys")),
            Some(&Said::OutOfScope)
        );
        assert_eq!(said.len(), 3, "{said:?}");
        assert!(
            !say(&mut said, &Key::new("ns", "lone"), Said::NoAutoscaler),
            "once"
        );
    }
}
