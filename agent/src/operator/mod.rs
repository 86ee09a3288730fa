//! The MyApp controller: each MyApp becomes a ConfigMap and a Deployment (see
//! [`children`]), and its status mirrors the Deployment (see [`status`]).
//!
//! - The MyApp watch passes only generation changes, so status writes (ours, or the hub's
//!   readers') never cause spec work; owned Deployments and ConfigMaps are watched in
//!   full, so a rollout's progress updates the status and a hand edit or delete is put
//!   back at once.
//! - Every successful reconcile is repeated after the resync period.
//! - Children are written by server-side apply with the field manager
//!   [`FIELD_MANAGER`], forcing ownership of the fields the operator sets. Only the
//!   MyApp's own children are written: an object of a child's name that the MyApp does
//!   not control is never adopted ([`status::Problem::NotOwned`]).
//! - Errors are per object: one failing MyApp is retried on its own and never holds up
//!   the others.
//! - While an autoscaler scales a MyApp's Deployment, the Deployment is applied without
//!   `replicas` (handed over first, see [`crate::replicas`]); when it goes, the next
//!   reconcile (the autoscaler's change triggers one) applies the MyApp's replicas again.

pub mod children;
pub mod status;

use std::sync::Arc;
use std::time::Duration;

use flotilla_crds::MyApp;
use futures::future::join_all;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::api::{PartialObjectMeta, Patch, PatchParams};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::{WatchStreamExt, predicates, reflector, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::autoscale::{Autoscalers, Target};
use crate::cache::{key, key_of};
use crate::replicas;
use children::{BuildError, CHILD_MANAGED_BY};
use flotilla_common::http::Gate;
use flotilla_common::listed;
use flotilla_common::metrics::{Metrics, WorkQueue};
use flotilla_crds::MANAGED_BY_LABEL;
use status::Problem;

/// The `controller` label of the metrics and the reporting controller of Events.
pub const CONTROLLER: &str = "myapp";
pub const FIELD_MANAGER: &str = "flotilla-operator";
/// Retry delay after a failure: transient (apiserver unreachable, conflict, ...) or a
/// spec the apiserver rejects. Under 10 s, so that one stuck MyApp alone counts more than
/// the 0.1 errors/s of the seed's `HighReconciliationErrorRate` alert.
const RETRY: Duration = Duration::from_secs(5);

/// Which namespaces the operator watches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Namespaces {
    All,
    Only(Vec<String>),
}

#[derive(Clone, Debug)]
pub struct OperatorConfig {
    pub namespaces: Namespaces,
    /// Every MyApp is reconciled again after this long even without a change.
    pub resync: Duration,
    /// Reconciles running at once (0: unbounded).
    pub concurrency: u16,
    /// `reportingInstance` of Events, e.g. the pod name.
    pub instance: Option<String>,
}

impl Default for OperatorConfig {
    fn default() -> Self {
        Self {
            namespaces: Namespaces::All,
            resync: Duration::from_secs(3600),
            concurrency: 16,
            instance: None,
        }
    }
}

#[derive(thiserror::Error, Debug)]
pub enum Error {
    #[error("cannot build children: {0}")]
    Build(#[from] BuildError),
    #[error("applying {kind} {name}: {source}")]
    Apply {
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("reading {kind} {name}: {source}")]
    Read {
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing the MyApp status: {0}")]
    Status(#[source] kube::Error),
}

impl Error {
    /// The error's class, as the `error` label of the errors metric.
    fn kind(&self) -> &'static str {
        match self {
            Error::Build(_) => "build",
            Error::Apply { .. } => "apply",
            Error::Read { .. } => "read",
            Error::Status(_) => "status",
        }
    }
}

struct Context {
    client: Client,
    /// Publishes Warnings: one that repeats while its cause lasts is merged into one
    /// Event (a series) through the recorder's cache.
    warnings: Recorder,
    reporter: Reporter,
    metrics: Arc<Metrics>,
    resync: Duration,
    autoscalers: Autoscalers,
}

/// Runs the MyApp controller until `shutdown` fires, opening `ready` once every watched
/// namespace has been listed and closing it when it stops. Meant to run beside the hub session in `flotilla-agent
/// run`, and alone in `flotilla-agent operator`.
pub async fn run_operator(
    client: Client,
    config: OperatorConfig,
    metrics: Arc<Metrics>,
    autoscalers: Autoscalers,
    ready: Gate,
    shutdown: CancellationToken,
) {
    let reporter = Reporter {
        controller: FIELD_MANAGER.into(),
        instance: config.instance.clone(),
    };
    let ctx = Arc::new(Context {
        warnings: Recorder::new(client.clone(), reporter.clone()),
        reporter,
        client: client.clone(),
        metrics,
        resync: config.resync,
        autoscalers,
    });
    // One controller per namespace when restricted: a reflector store cannot merge
    // several watches, and a namespaced watch needs no cluster-wide list permission.
    let scopes: Vec<Option<String>> = match &config.namespaces {
        Namespaces::All => vec![None],
        Namespaces::Only(list) => list.iter().cloned().map(Some).collect(),
    };
    let mut listings = Vec::new();
    let mut controllers = Vec::new();
    for scope in scopes {
        let (reader, writer) = reflector::store::<MyApp>();
        let (apps, listed) = listed::track(
            crate::cache::reflect(
                writer,
                watcher(
                    api::<MyApp>(&client, scope.as_deref()),
                    watcher::Config::default(),
                ),
                crate::cache::trim_for_operator,
            )
            .default_backoff(),
        );
        listings.push(listed.clone());
        let queue = ctx.metrics.queue(CONTROLLER);
        let apps = apps
            .applied_objects()
            .predicate_filter(predicates::generation, Default::default())
            .inspect_ok({
                let queue = queue.clone();
                move |app| queue.triggered(key_of(app).to_string())
            });
        let owned =
            watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={CHILD_MANAGED_BY}"));
        let run = Controller::for_stream(apps, reader)
            .owns_stream(child_changes::<Deployment>(
                &client,
                scope.as_deref(),
                &owned,
                &queue,
            ))
            .owns_stream(child_changes::<ConfigMap>(
                &client,
                scope.as_deref(),
                &owned,
                &queue,
            ))
            .reconcile_on(autoscaler_changes(&ctx.autoscalers, scope.clone(), &queue))
            .with_config(controller::Config::default().concurrency(config.concurrency))
            .graceful_shutdown_on(shutdown.clone().cancelled_owned())
            .run(reconcile, error_policy, ctx.clone())
            .for_each(move |result| {
                match result {
                    Ok((app, _)) => {
                        debug!(namespace = app.namespace, name = app.name, "reconciled")
                    }
                    // Reconcile failures were logged by the error policy.
                    Err(controller::Error::ReconcilerFailed(..)) => {}
                    // Due, but deleted meanwhile: no reconcile starts to take it off the queue.
                    Err(controller::Error::ObjectNotFound(app)) => {
                        queue.dequeued(&key(app.namespace.clone(), &app.name).to_string())
                    }
                    Err(e) => debug!(error = %e, "controller"),
                }
                std::future::ready(())
            });
        let stop = shutdown.clone();
        controllers.push(async move { listed.run_controller(run, &stop).await });
    }
    info!(namespaces = ?config.namespaces, resync = ?config.resync, "MyApp operator starting");
    let gate = ready.clone();
    let synced = async move {
        for listed in listings {
            // Only fails if the watch ended, i.e. at shutdown.
            if listed.wait().await.is_err() {
                return;
            }
        }
        ready.open();
        info!("MyApp operator synced");
    };
    tokio::join!(join_all(controllers), synced);
    // Not ready while stopped: an agent that lost its Lease is a standby until it acts
    // again (and a new operator opens the gate once it has listed).
    gate.close();
    info!("MyApp operator stopped");
}

fn api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// How a reconcile that ran to its end left the MyApp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Settled {
    /// As specified, or waiting on the user without failing (no image yet).
    Synced,
    /// The apiserver rejects a child built from the spec: counted as a reconcile error
    /// and retried, so that the error-rate alert sees a MyApp stuck this way.
    Rejected,
    /// A child's name is taken by an object this MyApp does not control: counted as a
    /// reconcile error and looked at again soon (nothing watches that object for us).
    NotOwned,
    /// Deleted meanwhile.
    Gone,
}

/// Changes to the operator's children of kind `K` (metadata only, as `owns` watches
/// them), each queueing the MyApp that controls the child: watched here, rather than
/// by `owns`, so that the work queue sees the trigger.
fn child_changes<K>(
    client: &Client,
    namespace: Option<&str>,
    owned: &watcher::Config,
    queue: &WorkQueue,
) -> impl futures::Stream<Item = Result<PartialObjectMeta<K>, watcher::Error>> + Send + 'static
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let queue = queue.clone();
    watcher(
        api::<PartialObjectMeta<K>>(client, namespace),
        owned.clone(),
    )
    .default_backoff()
    .touched_objects()
    .inspect_ok(move |child| {
        let owner = child
            .owner_references()
            .iter()
            .find(|o| o.controller == Some(true) && o.kind == "MyApp");
        if let Some(owner) = owner {
            queue.triggered(key(child.namespace(), &owner.name).to_string());
        }
    })
}

/// The MyApps (in `namespace`, or all) whose autoscaler appeared, changed or went away.
fn autoscaler_changes(
    autoscalers: &Autoscalers,
    namespace: Option<String>,
    queue: &WorkQueue,
) -> impl futures::Stream<Item = reflector::ObjectRef<MyApp>> + Send + 'static {
    let changes = autoscalers.subscribe();
    let queue = queue.clone();
    futures::stream::unfold(changes, |mut changes| async move {
        loop {
            match changes.recv().await {
                Ok(key) => return Some((key, changes)),
                // Missed changes are caught by the resync.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            }
        }
    })
    .filter(move |key| std::future::ready(namespace.as_ref().is_none_or(|ns| *ns == key.namespace)))
    .map(move |key| {
        queue.triggered(key.to_string());
        reflector::ObjectRef::new(&key.name).within(&key.namespace)
    })
}

async fn reconcile(app: Arc<MyApp>, ctx: Arc<Context>) -> Result<Action, Error> {
    let key = key_of(&*app).to_string();
    let mut timer = ctx.metrics.reconcile(CONTROLLER, &key);
    let result = reconcile_app(&app, &ctx).await;
    match &result {
        Ok(Settled::Rejected) => timer.failed("invalid_spec"),
        Ok(Settled::NotOwned) => timer.failed("not_owned"),
        Ok(_) => timer.succeeded(),
        Err(e) => timer.failed(e.kind()),
    }
    if let Err(e) = &result {
        ctx.event(
            &app,
            EventType::Warning,
            "ReconcileFailed",
            "Reconcile",
            e.to_string(),
        )
        .await;
    }
    let after = match result? {
        Settled::Synced => ctx.resync,
        Settled::Rejected | Settled::NotOwned => RETRY,
        Settled::Gone => return Ok(Action::await_change()),
    };
    ctx.metrics.queue(CONTROLLER).requeued(key, after);
    Ok(Action::requeue(after))
}

fn error_policy(app: Arc<MyApp>, error: &Error, ctx: Arc<Context>) -> Action {
    warn!(namespace = app.namespace(), name = app.name_any(), error = %error, "reconcile failed; retrying");
    let key = key_of(&*app).to_string();
    ctx.metrics.queue(CONTROLLER).requeued(key, RETRY);
    Action::requeue(RETRY)
}

#[tracing::instrument(skip_all, fields(namespace = app.namespace(), name = app.name_any()))]
async fn reconcile_app(app: &MyApp, ctx: &Context) -> Result<Settled, Error> {
    if app.metadata.deletion_timestamp.is_some() {
        // The garbage collector removes the children through their owner references.
        return Ok(Settled::Gone);
    }
    let namespace = app.namespace().ok_or(BuildError::Unnamed)?;
    let config_map = children::config_map(app)?;
    let mut deployment = children::deployment(app)?;
    let config_maps: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &namespace);
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), &namespace);

    // The ConfigMap goes first, so that pods of a new checksum mount the config it names.
    let mut problem = match apply(&config_maps, &config_map, app).await {
        Ok(Some((_, change))) => {
            ctx.announce(app, "ConfigMap", &config_map, change).await;
            None
        }
        Ok(None) => Some(not_owned("ConfigMap", &config_map)),
        Err(e) => rejected(e).map_err(|source| Error::Apply {
            kind: "ConfigMap",
            name: name(&config_map),
            source,
        })?,
    };
    let current = match (deployment.as_mut(), &problem) {
        (Some(deployment), None) => {
            match apply_deployment(ctx, app, &deployments, deployment).await {
                Ok(Some((applied, change))) => {
                    ctx.announce(app, "Deployment", &*deployment, change).await;
                    Some(applied)
                }
                Ok(None) => {
                    problem = Some(not_owned("Deployment", &*deployment));
                    None
                }
                Err(e) => {
                    problem = rejected(e).map_err(|source| Error::Apply {
                        kind: "Deployment",
                        name: name(&*deployment),
                        source,
                    })?;
                    None
                }
            }
        }
        (None, _) => {
            problem = Some(Problem::ImageMissing);
            None
        }
        (Some(_), Some(_)) => None,
    };
    // With a problem, an existing Deployment of this MyApp is left untouched, and still
    // reported; someone else's says nothing about this MyApp.
    let current = match current {
        Some(d) => Some(d),
        None => {
            let name = children::deployment_name(&app.name_any());
            let existing = deployments
                .get_opt(&name)
                .await
                .map_err(|source| Error::Read {
                    kind: "Deployment",
                    name,
                    source,
                })?;
            existing.filter(|d| children::controlled_by(d, app))
        }
    };
    if let Some(p) = &problem {
        ctx.event(
            app,
            EventType::Warning,
            p.reason(),
            "Reconcile",
            p.message(),
        )
        .await;
    }

    let status = status::compute(app, current.as_ref(), problem.as_ref(), Timestamp::now());
    if app.status.as_ref() != Some(&status) {
        let apps: Api<MyApp> = Api::namespaced(ctx.client.clone(), &namespace);
        let patch = Patch::Merge(serde_json::json!({ "status": status }));
        match apps
            .patch_status(&app.name_any(), &PatchParams::default(), &patch)
            .await
        {
            Ok(_) => debug!(
                ready = status.ready,
                ready_replicas = status.ready_replicas,
                "status written"
            ),
            // Deleted meanwhile: nothing left to report on.
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Settled::Gone),
            Err(e) => return Err(Error::Status(e)),
        }
    }
    Ok(match problem {
        Some(Problem::InvalidSpec(_)) => Settled::Rejected,
        Some(Problem::NotOwned { .. }) => Settled::NotOwned,
        Some(Problem::ImageMissing) | None => Settled::Synced,
    })
}

/// What a server-side apply did to the object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Written {
    Created,
    Updated,
    Unchanged,
}

/// Server-side applies `object`, a child of `app`, telling whether it was created or its
/// spec changed: the generation where the type has one, else the resource version.
/// `None`: an object of that name exists that `app` does not control, and is left as
/// it is (a forced apply would adopt it).
async fn apply<K>(
    api: &Api<K>,
    object: &K,
    app: &MyApp,
) -> Result<Option<(K, Written)>, kube::Error>
where
    K: Resource + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    let before = api.get_opt(&name(object)).await?;
    if foreign(before.as_ref(), app) {
        return Ok(None);
    }
    apply_over(api, object, before).await.map(Some)
}

/// An object of a child's name that `app` does not control: never adopted.
fn foreign<K: Resource>(before: Option<&K>, app: &MyApp) -> bool {
    before.is_some_and(|b| !children::controlled_by(b, app))
}

/// Applies the Deployment, without `replicas` while an autoscaler scales it (handed over
/// first). A Deployment not created yet starts with the MyApp's replicas. `None`, as for
/// [`apply`]: someone else's Deployment of that name, left as it is.
async fn apply_deployment(
    ctx: &Context,
    app: &MyApp,
    api: &Api<Deployment>,
    deployment: &mut Deployment,
) -> Result<Option<(Deployment, Written)>, kube::Error> {
    let before = api.get_opt(&name(deployment)).await?;
    if foreign(before.as_ref(), app) {
        return Ok(None);
    }
    let key = key_of(app);
    let wanted = deployment.spec.as_ref().and_then(|s| s.replicas);
    let live = before.as_ref().and_then(|d| d.spec.as_ref()?.replicas);
    let autoscaler = match ctx.autoscalers.of(&key) {
        Some(autoscaler) => Some(autoscaler),
        // The cache may not show yet an autoscaler that just scaled it: look again
        // before overwriting replicas someone else set (only then: a LIST on each change
        // of the MyApp's own replicas would cost every such change a round trip).
        None if live != wanted && before.as_ref().is_some_and(replicas_written_by_another) => {
            ctx.autoscalers.of_fresh(&key).await?
        }
        None => None,
    };
    if let (Some(autoscaler), Some(live)) = (autoscaler, &before)
        && autoscaler.target == Target::Deployment
    {
        replicas::hand_over(api, live, FIELD_MANAGER, replicas::spec_replicas).await?;
        if let Some(spec) = deployment.spec.as_mut() {
            spec.replicas = None;
        }
        debug!(%autoscaler, "Deployment replicas left to the autoscaler");
    }
    apply_over(api, deployment, before).await.map(Some)
}

/// Whether a manager other than the operator's own apply owns the Deployment's replicas
/// (an autoscaler's write through `/scale`, `kubectl scale`, the hand-back keeper).
fn replicas_written_by_another(deployment: &Deployment) -> bool {
    let fields = deployment.managed_fields();
    replicas::owned_by_another(fields, FIELD_MANAGER, replicas::spec_replicas)
}

async fn apply_over<K>(
    api: &Api<K>,
    object: &K,
    before: Option<K>,
) -> Result<(K, Written), kube::Error>
where
    K: Resource + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    let name = name(object);
    let version = |o: &K| {
        o.meta()
            .generation
            .map(|g| g.to_string())
            .or_else(|| o.meta().resource_version.clone())
    };
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let after = api.patch(&name, &params, &Patch::Apply(object)).await?;
    let change = match before {
        None => Written::Created,
        Some(b) if version(&b) != version(&after) => Written::Updated,
        Some(_) => Written::Unchanged,
    };
    Ok((after, change))
}

fn not_owned<K: Resource>(kind: &'static str, child: &K) -> Problem {
    Problem::NotOwned {
        kind,
        name: name(child),
    }
}

/// A rejection of the object itself (4xx other than conflicts and throttling) is the
/// spec's problem, reported on the MyApp and retried until the spec changes; anything
/// else is transient and retried soon.
fn rejected(e: kube::Error) -> Result<Option<Problem>, kube::Error> {
    match &e {
        kube::Error::Api(s) if matches!(s.code, 400 | 422) => {
            Ok(Some(Problem::InvalidSpec(s.message.clone())))
        }
        _ => Err(e),
    }
}

fn name<K: Resource>(object: &K) -> String {
    object.meta().name.clone().unwrap_or_default()
}

impl Context {
    async fn announce<K: Resource>(&self, app: &MyApp, kind: &str, object: &K, change: Written) {
        let name = name(object);
        let (reason, note) = match change {
            Written::Created => (format!("{kind}Created"), format!("created {kind} {name}")),
            Written::Updated => (format!("{kind}Updated"), format!("updated {kind} {name}")),
            Written::Unchanged => return,
        };
        info!(namespace = app.namespace(), app = app.name_any(), "{note}");
        self.event(app, EventType::Normal, &reason, "Apply", note)
            .await;
    }

    /// Publishes an Event on the MyApp; a failure to publish is logged, never fatal.
    async fn event(&self, app: &MyApp, type_: EventType, reason: &str, action: &str, note: String) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: None,
        };
        // A Normal Event says what the agent wrote, once per write. Kept in the shared
        // recorder's cache (6 minutes, in a table that never shrinks), a fleet's apply
        // cost 5.7 MiB at 1,000 MyApps (BENCHMARKS.md), so it goes through its own.
        let once;
        let recorder = match type_ {
            EventType::Warning => &self.warnings,
            EventType::Normal => {
                once = Recorder::new(self.client.clone(), self.reporter.clone());
                &once
            }
        };
        if let Err(e) = recorder.publish(&event, &app.object_ref(&())).await {
            warn!(error = %e, reason, "cannot publish Event");
        }
    }
}

#[cfg(test)]
mod tests {
    use flotilla_common::http::Readiness;

    use super::*;

    /// An agent that loses its Lease while its apiserver has not answered yet (nothing
    /// listed) must stop acting: it hung for good here before, and ignored SIGTERM. A
    /// stopped operator is not ready (the gate an earlier operator opened closes), so
    /// that an agent that lost its Lease reads as a standby.
    #[tokio::test]
    async fn stops_when_its_apiserver_never_answered() {
        let client = crate::unreachable_client();
        let stop = CancellationToken::new();
        let readiness = Readiness::default();
        let gate = readiness.gate("operator");
        gate.open();
        let run = tokio::spawn(run_operator(
            client,
            OperatorConfig::default(),
            Arc::new(Metrics::default()),
            crate::no_autoscalers(),
            gate,
            stop.clone(),
        ));
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("the operator did not stop")
            .unwrap();
        assert_eq!(readiness.waiting(), ["operator"]);
    }

    /// Only a Deployment whose replicas another manager wrote makes the operator look for
    /// an autoscaler its cache may not show yet.
    #[test]
    fn replicas_the_operator_applied_alone_are_not_written_by_another() {
        use serde_json::{Value, json};
        let deployment = |entries: Value| -> Deployment {
            let metadata = json!({"name": "a-deployment", "managedFields": entries});
            serde_json::from_value(json!({ "metadata": metadata })).unwrap()
        };
        let replicas = json!({"f:spec": {"f:replicas": {}}});
        let applied = json!({"manager": FIELD_MANAGER, "operation": "Apply",
            "apiVersion": "apps/v1", "fieldsType": "FieldsV1", "fieldsV1": replicas});
        let scaled = json!({"manager": "kube-controller-manager",
            "operation": "Update", "subresource": "scale", "apiVersion": "apps/v1",
            "fieldsType": "FieldsV1", "fieldsV1": replicas});
        assert!(!replicas_written_by_another(&deployment(json!([applied]))));
        assert!(replicas_written_by_another(&deployment(json!([
            applied, scaled
        ]))));
        assert!(!replicas_written_by_another(&deployment(json!([]))));
    }
}
