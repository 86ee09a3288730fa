//! Controller: the effects a FederatedMyApp asks of the host, beside the planner (which
//! alone writes the index). It keeps the finalizer: added to every app, removed from a
//! deleted one only once the board shows that the planner planned its deletion and every
//! registered cluster that had the MyApp or had it queued confirmed it gone, or released
//! (rule 3). It publishes an Event when a plan's errors change. Only the leader writes:
//! a standby's reconciles do nothing, and every app is reconciled again when it leads.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use flotilla_common::listed;
use flotilla_common::metrics::Metrics;
use flotilla_crds::FederatedMyApp;
use flotilla_plan::index::AppKey;
use flotilla_plan::planner::{held_by_hub, key_of};
use futures::{Stream, StreamExt};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::Controller;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use parking_lot::Mutex;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::status::{PlanErrors, StatusBoard};

pub use flotilla_crds::federated::HUB_FINALIZER as FINALIZER;
pub const CONTROLLER: &str = "federatedmyapp";
/// How often a deletion waiting for agents' confirmations is looked at again, besides
/// the planner's word when they are all in.
const DELETION_RECHECK: Duration = Duration::from_secs(1);
/// Retry delay after a failed reconcile (apiserver unreachable, a conflict).
const RETRY: Duration = Duration::from_secs(5);

pub struct Context {
    pub client: kube::Client,
    pub status: Arc<StatusBoard>,
    pub notices: Arc<Notices>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    /// True while this hub leads: only the leader writes to the host.
    pub leading: watch::Receiver<bool>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("updating the finalizer of {app}: {source}")]
    Finalizer { app: AppKey, source: kube::Error },
}

impl Error {
    /// The error's class, as the `error` label of the errors metric.
    fn kind(&self) -> &'static str {
        match self {
            Error::Finalizer { .. } => "finalizer",
        }
    }
}

/// What the planner tells the controller, each with a reconcile of the app: a plan whose
/// errors changed (Events to publish, while leading: a standby's would repeat the
/// leader's), and a deletion every cluster confirmed (a finalizer to remove).
pub struct Notices {
    errors: Mutex<HashMap<AppKey, PlanErrors>>,
    /// Deleted apps → clusters that only claimed them, no longer waited for.
    unheeded: Mutex<HashMap<AppKey, Vec<String>>>,
    wake: mpsc::UnboundedSender<ObjectRef<FederatedMyApp>>,
    leading: watch::Receiver<bool>,
}

impl Notices {
    /// The notices, and the reconciles they ask for (for [`run`]).
    pub fn new(
        leading: watch::Receiver<bool>,
    ) -> (Self, mpsc::UnboundedReceiver<ObjectRef<FederatedMyApp>>) {
        let (wake, woken) = mpsc::unbounded_channel();
        let notices = Self {
            errors: Mutex::default(),
            unheeded: Mutex::default(),
            wake,
            leading,
        };
        (notices, woken)
    }

    pub fn errors_changed(&self, key: &AppKey, errors: PlanErrors) {
        if *self.leading.borrow() {
            self.errors.lock().insert(key.clone(), errors);
            self.reconcile(key);
        }
    }

    /// The deletion of `key` went on without `clusters`, which only claimed it.
    pub fn claims_unheeded(&self, key: &AppKey, clusters: Vec<String>) {
        if *self.leading.borrow() {
            self.unheeded
                .lock()
                .entry(key.clone())
                .or_default()
                .extend(clusters);
            self.reconcile(key);
        }
    }

    fn take_unheeded(&self, key: &AppKey) -> Vec<String> {
        self.unheeded.lock().remove(key).unwrap_or_default()
    }

    pub fn deletion_confirmed(&self, key: &AppKey) {
        self.reconcile(key);
    }

    fn reconcile(&self, key: &AppKey) {
        let _ = (self.wake).send(ObjectRef::new(&key.name).within(&key.namespace));
    }

    fn take_errors(&self, key: &AppKey) -> Option<PlanErrors> {
        self.errors.lock().remove(key)
    }
}

/// Runs the FederatedMyApp controller until `shutdown`: every app `applied` (a new
/// generation, from the planner's watch), every app the planner names in `woken`, and
/// every app whenever this hub starts to lead.
pub async fn run(
    ctx: Arc<Context>,
    apps: Store<FederatedMyApp>,
    applied: impl Stream<Item = FederatedMyApp> + Send + 'static,
    woken: mpsc::UnboundedReceiver<ObjectRef<FederatedMyApp>>,
    listed: listed::Listed,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let queue = ctx.metrics.queue(CONTROLLER);
    let applied = applied.map({
        let queue = queue.clone();
        move |app| {
            queue.triggered(key_of(&app).to_string());
            Ok(app)
        }
    });
    let woken = tokio_stream::wrappers::UnboundedReceiverStream::new(woken);
    let run = Controller::for_stream(applied, apps)
        .reconcile_on(woken)
        .reconcile_all_on(starts_to_lead(ctx.leading.clone()))
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(reconcile, error_policy, ctx)
        .for_each(|result| {
            // Due, but deleted meanwhile: no reconcile starts to take it off the queue.
            if let Err(kube::runtime::controller::Error::ObjectNotFound(obj)) = result {
                queue.dequeued(
                    &AppKey::new(obj.namespace.unwrap_or_default(), obj.name).to_string(),
                );
            }
            std::future::ready(())
        });
    listed.run_controller(run, &shutdown).await;
    if shutdown.is_cancelled() {
        Ok(())
    } else {
        anyhow::bail!("the FederatedMyApp controller ended")
    }
}

/// Fires each time this hub starts to lead (not at start if it already does: the
/// initial list reconciles every app then).
fn starts_to_lead(leading: watch::Receiver<bool>) -> impl Stream<Item = ()> + Send {
    futures::stream::unfold(leading, |mut leading| async move {
        leading.wait_for(|l| !*l).await.ok()?;
        leading.wait_for(|l| *l).await.ok()?;
        Some(((), leading))
    })
}

pub async fn reconcile(app: Arc<FederatedMyApp>, ctx: Arc<Context>) -> Result<Action, Error> {
    let key = key_of(&app).to_string();
    let mut timer = ctx.metrics.reconcile(CONTROLLER, &key);
    let result = reconcile_app(&app, &ctx).await;
    match &result {
        Ok(_) => timer.succeeded(),
        Err(e) => timer.failed(e.kind()),
    }
    Ok(match result? {
        Some(after) => {
            ctx.metrics.queue(CONTROLLER).requeued(key, after);
            Action::requeue(after)
        }
        None => Action::await_change(),
    })
}

// The finalizer is handled here rather than with `kube::runtime::finalizer`: that helper
// removes the finalizer whenever cleanup returns Ok, so waiting for agents to confirm
// would have to be reported as a reconcile error, which feeds the error-rate alert.
/// Returns when to look again, if the app wants another look without a change.
async fn reconcile_app(app: &FederatedMyApp, ctx: &Context) -> Result<Option<Duration>, Error> {
    if !*ctx.leading.borrow() {
        // Planned like on the leader, written by nobody.
        return Ok(None);
    }
    let key = key_of(app);
    let api: Api<FederatedMyApp> = Api::namespaced(ctx.client.clone(), &key.namespace);
    let has_finalizer = held_by_hub(app);
    if app.metadata.deletion_timestamp.is_some() {
        if !has_finalizer {
            return Ok(None);
        }
        for cluster in ctx.notices.take_unheeded(&key) {
            let note = format!(
                "cluster {cluster} said it holds this MyApp, which this hub never placed or sent there, and did not confirm its Delete within --claim-wait: the deletion goes on without it (a MyApp it really holds is collected when its agent next syncs)"
            );
            ctx.event(app, EventType::Warning, "ClaimUnconfirmed", note)
                .await;
        }
        if !ctx.status.deletion_confirmed(&key) {
            return Ok(Some(DELETION_RECHECK));
        }
        let rest = app
            .finalizers()
            .iter()
            .filter(|f| *f != FINALIZER)
            .cloned()
            .collect();
        set_finalizers(&api, app, rest).await?;
        info!(app = %key, "deleted from (or released by) every member cluster");
        return Ok(None);
    }
    if !has_finalizer {
        let mut finalizers = app.finalizers().to_vec();
        finalizers.push(FINALIZER.into());
        set_finalizers(&api, app, finalizers).await?;
    }
    if let Some((placement_error, failures)) = ctx.notices.take_errors(&key) {
        for (cluster, reason, message) in failures {
            let note = format!("cluster {cluster}: {message}");
            ctx.event(app, EventType::Warning, reason, note).await;
        }
        if let Some((reason, e)) = placement_error {
            ctx.event(app, EventType::Warning, reason, e).await;
        }
    }
    Ok(None)
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

pub fn error_policy(app: Arc<FederatedMyApp>, error: &Error, ctx: Arc<Context>) -> Action {
    let key = key_of(&app);
    warn!(app = %key, %error, "reconcile failed; retrying");
    ctx.metrics
        .queue(CONTROLLER)
        .requeued(key.to_string(), RETRY);
    Action::requeue(RETRY)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Errors are announced by the leader only (a standby's Events would repeat the
    /// leader's at every failover), once each, and each notice asks for a reconcile.
    #[test]
    fn notices_wake_the_app_and_errors_are_announced_once_by_the_leader() {
        let (leading_tx, leading) = watch::channel(false);
        let (notices, mut woken) = Notices::new(leading);
        let key = AppKey::new("ns", "a");
        let errors: PlanErrors = (Some(("InvalidPlacement", "bad selector".into())), vec![]);
        notices.errors_changed(&key, errors.clone());
        assert!(notices.take_errors(&key).is_none());
        assert!(woken.try_recv().is_err(), "nothing to do on a standby");
        leading_tx.send_replace(true);
        notices.errors_changed(&key, errors.clone());
        assert_eq!(notices.take_errors(&key), Some(errors));
        assert_eq!(notices.take_errors(&key), None);
        notices.deletion_confirmed(&key);
        for _ in 0..2 {
            let woke = woken.try_recv().unwrap();
            assert_eq!(
                (woke.name.as_str(), woke.namespace.as_deref()),
                ("a", Some("ns"))
            );
        }
    }
}
