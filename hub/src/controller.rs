//! Controller: reconciles each FederatedMyApp into the index (placement, render), keeps
//! the finalizer, publishes Events, and re-renders every app when the set of registered
//! clusters or their labels change.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use flotilla_common::metrics::Metrics;
use flotilla_crds::federated::ORPHAN_ANNOTATION;
use flotilla_crds::{FederatedMyApp, MemberCluster};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::{Resource, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use crate::dispatch::Dispatcher;
use crate::index::{AppKey, Desired};
use crate::placement::{Member, Members};
use crate::render::{self, ClusterError};
use crate::status::{Outcome, Plan, StatusBoard};

/// Holds each FederatedMyApp until every member has deleted (or released) its MyApp.
pub const FINALIZER: &str = "core.kubefed.io/flotilla-hub";
pub const CONTROLLER: &str = "federatedmyapp";
/// How often a deletion waiting for agents' confirmations is looked at again.
const DELETION_RECHECK: Duration = Duration::from_secs(1);

pub struct Context {
    pub client: kube::Client,
    pub dispatcher: Arc<Dispatcher>,
    pub status: Arc<StatusBoard>,
    pub members: Store<MemberCluster>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("updating the finalizer of {app}: {source}")]
    Finalizer { app: AppKey, source: kube::Error },
}

pub fn key_of(app: &FederatedMyApp) -> AppKey {
    AppKey::new(
        app.namespace().unwrap_or_else(|| "default".into()),
        app.name_any(),
    )
}

/// Registered clusters (labels, cordon, readiness, capacity), leaving out those being
/// deleted.
pub fn registered(members: &Store<MemberCluster>) -> Members {
    let now = k8s_openapi::jiff::Timestamp::now();
    members
        .state()
        .iter()
        .filter(|m| m.metadata.deletion_timestamp.is_none())
        .map(|m| (m.name_any(), Member::from_cluster(m, now)))
        .collect()
}

/// What each cluster should have, and what status will say about it. Pure.
pub fn plan_app(app: &FederatedMyApp, members: &Members) -> (Plan, BTreeMap<String, Desired>) {
    let mut plan = Plan {
        generation: app.metadata.generation,
        ..Default::default()
    };
    let mut desired = BTreeMap::new();
    match render::render(app, members) {
        Err(e) => {
            // Where it runs now is unknown: leave every cluster's copy as it is.
            plan.placement_error = Some(e.to_string());
            desired.extend(members.keys().map(|c| (c.clone(), Desired::Keep)));
        }
        Ok(rendered) => {
            for (cluster, result) in rendered.clusters {
                let outcome = match result {
                    Ok(r) => {
                        let hash = r.hash.clone();
                        desired.insert(cluster.clone(), Desired::Apply(Arc::new(r)));
                        Outcome::Rendered { hash }
                    }
                    Err(ClusterError::UnknownCluster) => Outcome::Failed {
                        message: ClusterError::UnknownCluster.to_string(),
                    },
                    Err(e) => {
                        desired.insert(cluster.clone(), Desired::Keep);
                        Outcome::Failed {
                            message: e.to_string(),
                        }
                    }
                };
                plan.clusters.insert(cluster, outcome);
            }
        }
    }
    (plan, desired)
}

/// Renders an app into the index without touching the apiserver: used for the first
/// pass at start, before agents are let in, and by every reconcile.
pub fn index_app(app: &FederatedMyApp, ctx: &Context) -> Plan {
    let key = key_of(app);
    let (plan, desired) = plan_app(app, &registered(&ctx.members));
    ctx.dispatcher.set_app(&key, desired);
    plan
}

/// Carries a deletion into the index (pure, like [`index_app`]): returns the clusters
/// that have not yet confirmed the MyApp is gone, or released with `kubefed.io/orphan`.
pub fn index_deletion(app: &FederatedMyApp, ctx: &Context) -> (Plan, Vec<String>) {
    let key = key_of(app);
    let orphan = app
        .annotations()
        .get(ORPHAN_ANNOTATION)
        .is_some_and(|v| v == "true");
    let (plan, _) = plan_app(app, &registered(&ctx.members));
    let placed: Vec<String> = plan.clusters.keys().cloned().collect();
    let waiting = ctx.dispatcher.delete_app(&key, orphan, &placed);
    (plan, waiting)
}

pub async fn reconcile(app: Arc<FederatedMyApp>, ctx: Arc<Context>) -> Result<Action, Error> {
    let timer = ctx.metrics.reconcile(CONTROLLER);
    let result = reconcile_app(&app, &ctx).await;
    timer.done(result.is_ok());
    result
}

// The finalizer is handled here rather than with `kube::runtime::finalizer`: that helper
// removes the finalizer whenever cleanup returns Ok, so waiting for agents to confirm
// would have to be reported as a reconcile error, which feeds the error-rate alert.
async fn reconcile_app(app: &FederatedMyApp, ctx: &Context) -> Result<Action, Error> {
    let key = key_of(app);
    let api: Api<FederatedMyApp> = Api::namespaced(ctx.client.clone(), &key.namespace);
    let has_finalizer = app.finalizers().iter().any(|f| f == FINALIZER);
    if app.metadata.deletion_timestamp.is_some() {
        if !has_finalizer {
            return Ok(Action::await_change());
        }
        let (plan, waiting) = index_deletion(app, ctx);
        if !waiting.is_empty() {
            ctx.status.set_plan(
                &key,
                Plan {
                    deleting_on: Some(waiting),
                    ..plan
                },
            );
            return Ok(Action::requeue(DELETION_RECHECK));
        }
        let rest = app
            .finalizers()
            .iter()
            .filter(|f| *f != FINALIZER)
            .cloned()
            .collect();
        set_finalizers(&api, app, rest).await?;
        ctx.dispatcher.forget(&key);
        ctx.status.forget(&key);
        info!(app = %key, "deleted from (or released by) every member cluster");
        return Ok(Action::await_change());
    }
    if !has_finalizer {
        let mut finalizers = app.finalizers().to_vec();
        finalizers.push(FINALIZER.into());
        set_finalizers(&api, app, finalizers).await?;
    }
    let plan = index_app(app, ctx);
    let failures: Vec<(String, String)> = plan
        .clusters
        .iter()
        .filter_map(|(c, o)| match o {
            Outcome::Failed { message } => Some((c.clone(), message.clone())),
            Outcome::Rendered { .. } => None,
        })
        .collect();
    let placement_error = plan.placement_error.clone();
    if ctx.status.set_plan(&key, plan) {
        for (cluster, message) in failures {
            ctx.event(
                app,
                EventType::Warning,
                "RenderFailed",
                format!("cluster {cluster}: {message}"),
            )
            .await;
        }
        if let Some(e) = placement_error {
            ctx.event(app, EventType::Warning, "InvalidPlacement", e)
                .await;
        }
    }
    Ok(Action::await_change())
}

/// Replaces the finalizer list, guarded by the resourceVersion it was computed from.
async fn set_finalizers(
    api: &Api<FederatedMyApp>,
    app: &FederatedMyApp,
    finalizers: Vec<String>,
) -> Result<(), Error> {
    let patch =
        json!({"metadata": {"finalizers": finalizers, "resourceVersion": app.resource_version()}});
    api.patch(
        &app.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .map(drop)
    .map_err(|source| Error::Finalizer {
        app: key_of(app),
        source,
    })
}

impl Context {
    async fn event(&self, app: &FederatedMyApp, type_: EventType, reason: &str, note: String) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "Render".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &app.object_ref(&())).await {
            warn!(app = %key_of(app), error = %e, "publishing an Event failed");
        }
    }
}

pub fn error_policy(app: Arc<FederatedMyApp>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(app = %key_of(&app), %error, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn app(yaml: &str) -> FederatedMyApp {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn failed_clusters_keep_their_copy_and_unknown_ones_get_nothing() {
        let a = app(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: a, namespace: n, generation: 3}\n\
                     spec:\n  placement: {clusters: [{name: c1}, {name: c2}, {name: ghost}]}\n  template: {spec: {replicas: 2}}\n  \
                     overrides:\n  - clusterName: c2\n    clusterOverrides: [{path: /spec/replicas, value: 99}]\n",
        );
        let members: Members = [
            ("c1".to_owned(), Default::default()),
            ("c2".to_owned(), Default::default()),
        ]
        .into();
        let (plan, desired) = plan_app(&a, &members);
        assert_eq!(plan.generation, Some(3));
        assert!(matches!(desired["c1"], Desired::Apply(_)));
        assert_eq!(desired["c2"], Desired::Keep);
        assert!(!desired.contains_key("ghost"));
        assert!(
            matches!(&plan.clusters["ghost"], Outcome::Failed { message } if message.contains("not a registered MemberCluster"))
        );
        assert!(
            matches!(&plan.clusters["c2"], Outcome::Failed { message } if message.contains("maximum of 10"))
        );
    }

    #[test]
    fn an_invalid_placement_keeps_every_cluster_as_it_is() {
        let a = app(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: a}\n\
                     spec:\n  placement: {clusterSelector: {matchExpressions: [{key: k, operator: Bogus}]}}\n",
        );
        let members: Members = [("c1".to_owned(), Default::default())].into();
        let (plan, desired) = plan_app(&a, &members);
        assert!(plan.placement_error.unwrap().contains("unknown operator"));
        assert_eq!(desired["c1"], Desired::Keep);
    }
}
