//! Autoscale: which MyApps an autoscaler in this cluster scales, directly (its
//! `scaleTargetRef` names the MyApp, through its `/scale` subresource) or through the
//! MyApp's Deployment. While one does, the replicas it scales are its own: the agent
//! leaves `spec.replicas` out of the MyApp it applies, the operator leaves `replicas` out
//! of the Deployment (see [`crate::replicas`]).
//!
//! Autoscalers are HorizontalPodAutoscalers (`autoscaling/v2`). A KEDA ScaledObject
//! scales through the HorizontalPodAutoscaler KEDA creates for it (`keda-hpa-<name>`, the
//! same `scaleTargetRef`), so it is seen through that one.
//!
//! The cache may lag the apiserver by a watch event; whoever is about to overwrite
//! replicas that someone else set asks [`Autoscalers::of_fresh`], which lists them.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use flotilla_common::listed::{self, Listed, NeverListed};
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use kube::api::ListParams;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::broadcast;
use tracing::{info, warn};

use crate::cache::{self, Key};
use crate::operator::children;

/// What an autoscaler scales of a MyApp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The MyApp itself: it owns the MyApp's `spec.replicas`.
    MyApp,
    /// The MyApp's Deployment: it owns the Deployment's `replicas`.
    Deployment,
}

/// One autoscaler and what it scales.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Autoscaler {
    /// The HorizontalPodAutoscaler's name.
    pub name: String,
    pub target: Target,
}

impl fmt::Display for Autoscaler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let target = match self.target {
            Target::MyApp => "the MyApp",
            Target::Deployment => "its Deployment",
        };
        write!(f, "HorizontalPodAutoscaler {} scales {target}", self.name)
    }
}

/// The MyApp an HPA scales and how, when it scales a MyApp or a MyApp's Deployment.
pub fn scaled_by(hpa: &HorizontalPodAutoscaler) -> Option<(Key, Autoscaler)> {
    let namespace = hpa.namespace()?;
    let target = &hpa.spec.as_ref()?.scale_target_ref;
    let group = target
        .api_version
        .as_deref()
        .map_or("", |v| v.rsplit_once('/').map_or("", |(group, _)| group));
    let (app, how) = match (group, target.kind.as_str()) {
        (flotilla_crds::myapp::GROUP, "MyApp") => (target.name.as_str(), Target::MyApp),
        ("apps", "Deployment") => (
            children::app_of_deployment(&target.name)?,
            Target::Deployment,
        ),
        _ => return None,
    };
    let autoscaler = Autoscaler {
        name: hpa.name_any(),
        target: how,
    };
    Some((Key::new(namespace, app), autoscaler))
}

/// The HPAs of the cluster, cached, with a feed of the MyApps whose autoscaler changed.
#[derive(Clone)]
pub struct Autoscalers {
    client: Client,
    /// One store per namespace watched, or one of every namespace.
    stores: Arc<[Store<HorizontalPodAutoscaler>]>,
    listed: Vec<Listed>,
    changes: broadcast::Sender<Key>,
}

impl Autoscalers {
    /// The autoscaler of the MyApp at `key`, as the cache shows it. With several (a
    /// misconfiguration the HPA controller refuses too), the first by name.
    pub fn of(&self, key: &Key) -> Option<Autoscaler> {
        let hpas = self.stores.iter().flat_map(Store::state);
        first(hpas.collect::<Vec<_>>().iter().map(|hpa| &**hpa), key)
    }

    /// Resolves once every namespace watched has been listed.
    pub async fn listed(&self) -> Result<(), NeverListed> {
        listed::all(&self.listed).await
    }

    /// The HorizontalPodAutoscaler [`Autoscalers::of`] names, as the cache shows it.
    pub fn hpa_of(&self, key: &Key) -> Option<Arc<HorizontalPodAutoscaler>> {
        let autoscaler = self.of(key)?;
        let reference = ObjectRef::new(&autoscaler.name).within(&key.namespace);
        self.stores.iter().find_map(|store| store.get(&reference))
    }

    /// The autoscaler of the MyApp at `key`, listed from the apiserver: asked before
    /// overwriting replicas that someone else set.
    pub async fn of_fresh(&self, key: &Key) -> Result<Option<Autoscaler>, kube::Error> {
        let api: Api<HorizontalPodAutoscaler> =
            Api::namespaced(self.client.clone(), &key.namespace);
        let listed = api.list(&ListParams::default()).await?;
        Ok(first(listed.items.iter(), key))
    }

    /// MyApps whose autoscaler appeared, changed or went away.
    pub fn subscribe(&self) -> broadcast::Receiver<Key> {
        self.changes.subscribe()
    }
}

fn first<'a>(
    hpas: impl Iterator<Item = &'a HorizontalPodAutoscaler>,
    key: &Key,
) -> Option<Autoscaler> {
    hpas.filter_map(scaled_by)
        .filter(|(scaled, _)| scaled == key)
        .map(|(_, autoscaler)| autoscaler)
        .min_by(|a, b| a.name.cmp(&b.name))
}

/// Watches HPAs in `namespaces`, or in every namespace without them (a reflector each:
/// see [`crate::cache`]); the future runs the watches.
pub fn watch(
    client: Client,
    namespaces: Option<&BTreeSet<String>>,
) -> (Autoscalers, impl Future<Output = ()> + use<>) {
    let (changes, _) = broadcast::channel(256);
    let (mut stores, mut listed, mut runs) = (Vec::new(), Vec::new(), Vec::new());
    for (_, api) in cache::apis::<HorizontalPodAutoscaler>(&client, namespaces) {
        let (store, writer) = reflector::store::<HorizontalPodAutoscaler>();
        let (stream, done) = listed::track(
            reflector::reflector(writer, watcher(api, watcher::Config::default()))
                .default_backoff(),
        );
        runs.push(follow(stream, changes.clone()));
        stores.push(store);
        listed.push(done);
    }
    let autoscalers = Autoscalers {
        client,
        stores: stores.into(),
        listed,
        changes,
    };
    (autoscalers, futures::future::join_all(runs).map(drop))
}

/// Feeds the MyApps whose autoscaler appeared, changed or went away, from one watch.
async fn follow(
    stream: impl futures::Stream<Item = Result<watcher::Event<HorizontalPodAutoscaler>, watcher::Error>>,
    feed: broadcast::Sender<Key>,
) {
    // What each HPA scaled when last seen: a changed or deleted one changes that MyApp
    // too.
    let mut scaled: HashMap<ObjectRef<HorizontalPodAutoscaler>, Key> = HashMap::new();
    // The HPAs a re-list shows: one deleted during a watch gap is missing from it.
    let mut relisted: HashSet<ObjectRef<HorizontalPodAutoscaler>> = HashSet::new();
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        let event = match event {
            Ok(event) => event,
            Err(e) => {
                warn!(error = %e, "watching HorizontalPodAutoscalers");
                continue;
            }
        };
        let (hpa, deleted) = match event {
            watcher::Event::Apply(hpa) => (hpa, false),
            watcher::Event::InitApply(hpa) => {
                relisted.insert(ObjectRef::from_obj(&hpa));
                (hpa, false)
            }
            watcher::Event::Delete(hpa) => (hpa, true),
            watcher::Event::Init => {
                relisted.clear();
                continue;
            }
            watcher::Event::InitDone => {
                let gone: Vec<_> = scaled
                    .keys()
                    .filter(|r| !relisted.contains(*r))
                    .cloned()
                    .collect();
                for reference in gone {
                    if let Some(key) = scaled.remove(&reference) {
                        let _ = feed.send(key);
                    }
                }
                continue;
            }
        };
        let reference = ObjectRef::from_obj(&hpa);
        let now = (!deleted).then(|| scaled_by(&hpa)).flatten();
        let before = match &now {
            Some((key, _)) => scaled.insert(reference, key.clone()),
            None => scaled.remove(&reference),
        };
        if let Some((key, autoscaler)) = &now
            && before.as_ref() != Some(key)
        {
            info!(app = %key, "{autoscaler}: its replicas are the autoscaler's");
        }
        for key in before.into_iter().chain(now.map(|(key, _)| key)) {
            let _ = feed.send(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn hpa(name: &str, api_version: &str, kind: &str, target: &str) -> HorizontalPodAutoscaler {
        serde_json::from_value(json!({
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"scaleTargetRef": {"apiVersion": api_version, "kind": kind, "name": target},
                     "minReplicas": 2, "maxReplicas": 5}
        }))
        .unwrap()
    }

    #[test]
    fn an_hpa_scales_a_myapp_at_any_version_or_its_deployment() {
        let key = Key::new("ns", "web");
        for version in ["app.example.com/v1", "app.example.com/v1alpha1"] {
            let (scaled, autoscaler) = scaled_by(&hpa("h", version, "MyApp", "web")).unwrap();
            assert_eq!((scaled, autoscaler.target), (key.clone(), Target::MyApp));
        }
        let (scaled, autoscaler) =
            scaled_by(&hpa("h", "apps/v1", "Deployment", "web-deploy")).unwrap();
        assert_eq!((scaled, autoscaler.target), (key, Target::Deployment));
        assert_eq!(
            autoscaler.to_string(),
            "HorizontalPodAutoscaler h scales its Deployment"
        );
    }

    #[test]
    fn other_targets_are_not_a_myapps() {
        for (version, kind, name) in [
            ("apps/v1", "Deployment", "web"),
            ("apps/v1", "StatefulSet", "web-deploy"),
            ("other.io/v1", "MyApp", "web"),
            ("v1", "MyApp", "web"),
        ] {
            assert_eq!(
                scaled_by(&hpa("h", version, kind, name)),
                None,
                "{kind} {name}"
            );
        }
    }

    #[test]
    fn of_several_the_first_by_name_counts() {
        let hpas = [
            hpa("b", "app.example.com/v1", "MyApp", "web"),
            hpa("a", "apps/v1", "Deployment", "web-deploy"),
            hpa("0", "app.example.com/v1", "MyApp", "other"),
        ];
        let found = first(hpas.iter(), &Key::new("ns", "web")).unwrap();
        assert_eq!(
            (found.name.as_str(), found.target),
            ("a", Target::Deployment)
        );
    }
}
