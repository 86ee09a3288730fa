//! Controller: reconciles each FederatedMyApp into the index (`flotilla_plan::plan`),
//! keeps the finalizer, publishes Events, and plans every app again when the registered
//! clusters change.
//!
//! Nothing is planned before both stores (FederatedMyApps and MemberClusters) have
//! listed: a plan made from a partial list would tell agents to delete what is wanted.
//! The first full pass opens the gate for reconciles and for agents.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_common::http::Gate;
use flotilla_common::listed;
use flotilla_common::metrics::Metrics;
use flotilla_crds::federated::{ORPHAN_ANNOTATION, SchedulingMode};
use flotilla_crds::{FederatedMyApp, MemberCluster};
use futures::{Stream, StreamExt, TryStreamExt};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::runtime::{Controller, WatchStreamExt, predicates, watcher};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use flotilla_plan::index::AppKey;
use flotilla_plan::placement::Members;
use flotilla_plan::plan;

use crate::dispatch::Dispatcher;
use crate::membership::{MemberChanges, registered};
use crate::status::{Planned, StatusBoard};

/// Holds each FederatedMyApp until every member has deleted (or released) its MyApp.
pub const FINALIZER: &str = "core.kubefed.io/flotilla-hub";
pub const CONTROLLER: &str = "federatedmyapp";
/// How often a deletion waiting for agents' confirmations is looked at again.
const DELETION_RECHECK: Duration = Duration::from_secs(1);
/// Retry delay after a failed reconcile (apiserver unreachable, a conflict).
const RETRY: Duration = Duration::from_secs(5);
/// How often a standby looks at an app again, so that it takes over within this long
/// once it leads.
const STANDBY_RECHECK: Duration = Duration::from_secs(2);

pub struct Context {
    pub client: kube::Client,
    pub dispatcher: Arc<Dispatcher>,
    pub status: Arc<StatusBoard>,
    pub members: Store<MemberCluster>,
    pub apps: Store<FederatedMyApp>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    /// True once the first full pass planned every app.
    pub planned: watch::Receiver<bool>,
    /// True while this hub leads: only the leader writes to the host.
    pub leading: watch::Receiver<bool>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("updating the finalizer of {app}: {source}")]
    Finalizer { app: AppKey, source: kube::Error },
    #[error("the hub is shutting down")]
    ShuttingDown,
}

impl Error {
    /// The error's class, as the `error` label of the errors metric.
    fn kind(&self) -> &'static str {
        match self {
            Error::Finalizer { .. } => "finalizer",
            Error::ShuttingDown => "shutdown",
        }
    }
}

pub fn key_of(app: &FederatedMyApp) -> AppKey {
    AppKey::new(
        app.namespace().unwrap_or_else(|| "default".into()),
        app.name_any(),
    )
}

fn orphans(app: &FederatedMyApp) -> bool {
    app.annotations()
        .get(ORPHAN_ANNOTATION)
        .is_some_and(|v| v == "true")
}

/// Plans one app into the index, without the apiserver; returns the plan for the
/// status board.
fn index_app(app: &FederatedMyApp, members: &Members, ctx: &Context) -> Planned {
    let key = key_of(app);
    let plan = plan(app, members);
    ctx.dispatcher
        .set_app(&key, app.metadata.generation, plan.desired());
    Planned {
        plan,
        deleting_on: None,
    }
}

/// Carries a deletion into the index (pure, like [`index_app`]): returns the plan with
/// the clusters that have not yet confirmed the MyApp is gone, or released with
/// `kubefed.io/orphan`. Only registered clusters are waited for: a cluster named in the
/// placement that never joined, or that left, holds nothing the hub could ask about.
fn index_deletion(app: &FederatedMyApp, members: &Members, ctx: &Context) -> Planned {
    let plan = plan(app, members);
    let placed: Vec<String> = plan.desired().into_keys().collect();
    let waiting = ctx
        .dispatcher
        .delete_app(&key_of(app), orphans(app), &placed);
    Planned {
        plan,
        deleting_on: Some(waiting),
    }
}

/// Plans every app (or, after a change of capacity only, those divided by capacity) for
/// the registered clusters as they are now, then tells the dispatcher which clusters
/// that was, so that their agents may be admitted. Returns when the earliest plan wants
/// another look (a failover grace period ends, replacements may be Ready).
pub fn plan_all(ctx: &Context, scope: Scope) -> Option<Duration> {
    let members = registered(&ctx.members);
    let mut recheck: Option<Duration> = None;
    for app in ctx.apps.state() {
        if scope == Scope::ByCapacity && !by_capacity(&app) {
            continue;
        }
        let planned = match app.metadata.deletion_timestamp {
            None => index_app(&app, &members, ctx),
            Some(_) => index_deletion(&app, &members, ctx),
        };
        let schedule = planned.plan.schedule.as_ref();
        if let Some(after) = schedule.and_then(|s| s.recheck_after) {
            recheck = Some(recheck.map_or(after, |r| r.min(after)));
        }
        ctx.status.set_plan(&key_of(&app), planned);
    }
    ctx.dispatcher
        .planned_for(members.into_keys().collect::<BTreeSet<_>>());
    recheck
}

/// The next planning pass's deadline after a pass over `scope` that wants `wanted`.
fn next_recheck(
    scope: Scope,
    current: Option<Instant>,
    wanted: Option<Instant>,
) -> Option<Instant> {
    match scope {
        Scope::All => wanted,
        Scope::ByCapacity => current.into_iter().chain(wanted).min(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    All,
    /// Only clusters' capacity changed: nothing else depends on it.
    ByCapacity,
}

fn by_capacity(app: &FederatedMyApp) -> bool {
    let scheduling = app.spec.placement.replica_scheduling.as_ref();
    scheduling.is_some_and(|r| r.mode == SchedulingMode::Capacity)
}

/// When each store has listed.
pub struct Listed {
    pub apps: listed::Listed,
    pub members: listed::Listed,
}

/// Waits until both stores have listed, plans every app (deletions too: an orphaning
/// delete must reach agents as a release, never as a missing entry that they would
/// collect), opens `planned` and `gate`, then plans again on every membership change and
/// whenever a plan asked to be looked at again.
pub async fn plan_loop(
    ctx: Arc<Context>,
    listed: Listed,
    planned: watch::Sender<bool>,
    gate: Gate,
    mut members_changed: watch::Receiver<MemberChanges>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let wait = |what: &'static str, listed: listed::Listed| async move {
        listed
            .wait()
            .await
            .with_context(|| format!("the {what} watch"))?;
        info!("{what}s listed");
        anyhow::Ok(())
    };
    tokio::select! {
        _ = shutdown.cancelled() => return Ok(()),
        r = async {
            tokio::try_join!(wait("FederatedMyApp", listed.apps), wait("MemberCluster", listed.members))
        } => { r?; }
    }
    let mut seen = *members_changed.borrow_and_update();
    let mut scope = Scope::All;
    // When some plan wants another look. A pass over every app replaces it; a pass over
    // the Capacity apps only can bring it forward, never drop the others' wish.
    let mut recheck_at: Option<Instant> = None;
    loop {
        let wanted = plan_all(&ctx, scope).map(|after| Instant::now() + after);
        recheck_at = next_recheck(scope, recheck_at, wanted);
        if !*planned.borrow() {
            planned.send_replace(true);
            gate.open();
            info!(
                apps = ctx.apps.state().len(),
                clusters = ctx.members.state().len(),
                "every app planned; accepting agents"
            );
        }
        let recheck = async {
            match recheck_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        scope = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = recheck => Scope::All,
            changed = members_changed.changed() => {
                if changed.is_err() && shutdown.is_cancelled() {
                    // The membership watch stopped first.
                    return Ok(());
                }
                changed?;
                let now = *members_changed.borrow_and_update();
                let scope = if now.clusters == seen.clusters { Scope::ByCapacity } else { Scope::All };
                seen = now;
                scope
            }
        };
    }
}

/// Runs the FederatedMyApp controller over the reflector's `events` until `shutdown`.
/// Deletions that bypass the finalizer are carried into the index as they happen, or at
/// the end of the re-list that shows them.
pub async fn run(
    ctx: Arc<Context>,
    events: impl Stream<Item = Result<watcher::Event<FederatedMyApp>, watcher::Error>> + Send + 'static,
    listed: listed::Listed,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let on_delete = ctx.clone();
    let queue = ctx.metrics.queue(CONTROLLER);
    let events = watched(events, move |key, orphan| deleted(key, orphan, &on_delete)).inspect_ok({
        let queue = queue.clone();
        move |app| queue.triggered(key_of(app).to_string())
    });
    let run = Controller::for_stream(events, ctx.apps.clone())
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(reconcile, error_policy, ctx)
        .for_each(|result| {
            match result {
                // The watch retries with backoff; say why it had to. Reconcile failures
                // were logged by the error policy.
                Err(e @ kube::runtime::controller::Error::QueueError(_)) => {
                    warn!(error = %e, "watching FederatedMyApps")
                }
                // Due, but deleted meanwhile: no reconcile starts to take it off the queue.
                Err(kube::runtime::controller::Error::ObjectNotFound(obj)) => queue.dequeued(
                    &AppKey::new(obj.namespace.unwrap_or_default(), obj.name).to_string(),
                ),
                _ => {}
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

/// Applied objects whose generation changed, reporting deletions to `on_delete` first
/// (with whether the app asked to be orphaned).
fn watched(
    events: impl Stream<Item = Result<watcher::Event<FederatedMyApp>, watcher::Error>> + Send,
    on_delete: impl Fn(&AppKey, bool) + Send + Sync + 'static,
) -> impl Stream<Item = Result<FederatedMyApp, watcher::Error>> + Send {
    let mut seen = Seen::default();
    events
        .inspect_ok(move |event| {
            for (key, orphan) in seen.deleted(event) {
                on_delete(&key, orphan);
            }
        })
        .applied_objects()
        .predicate_filter(predicates::generation, Default::default())
}

/// The apps the watch has shown, to tell which are gone: those it reports deleted, and
/// those a re-list no longer holds (deleted while the watch was down, e.g. across an
/// apiserver restart: no Delete event ever comes for them). Only two complete lists are
/// compared, never a partial one.
#[derive(Default)]
struct Seen {
    /// Each app, with whether it asked to be orphaned, as last seen.
    apps: HashMap<AppKey, bool>,
    /// The list in progress, from `Init` to `InitDone`.
    relist: Option<HashMap<AppKey, bool>>,
}

impl Seen {
    /// Takes in one event; returns the apps it shows deleted.
    fn deleted(&mut self, event: &watcher::Event<FederatedMyApp>) -> Vec<(AppKey, bool)> {
        match event {
            watcher::Event::Init => {
                self.relist = Some(HashMap::new());
                Vec::new()
            }
            watcher::Event::InitApply(app) => {
                if let Some(listed) = &mut self.relist {
                    listed.insert(key_of(app), orphans(app));
                }
                Vec::new()
            }
            watcher::Event::InitDone => match self.relist.take() {
                Some(listed) => {
                    let before = std::mem::replace(&mut self.apps, listed);
                    before
                        .into_iter()
                        .filter(|(key, _)| !self.apps.contains_key(key))
                        .collect()
                }
                None => Vec::new(),
            },
            watcher::Event::Apply(app) => {
                self.apps.insert(key_of(app), orphans(app));
                Vec::new()
            }
            watcher::Event::Delete(app) => {
                self.apps.remove(&key_of(app));
                vec![(key_of(app), orphans(app))]
            }
        }
    }
}

/// A FederatedMyApp vanished from the host. Through our finalizer that changes nothing;
/// with the finalizer removed by hand, its MyApps are deleted now (or released, with
/// `kubefed.io/orphan`) instead of by surprise at the next hub restart.
fn deleted(key: &AppKey, orphan: bool, ctx: &Context) {
    ctx.dispatcher.drop_app(key, orphan);
    ctx.status.forget(key);
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
    let mut planned = ctx.planned.clone();
    planned
        .wait_for(|p| *p)
        .await
        .map_err(|_| Error::ShuttingDown)?;
    let key = key_of(app);
    let api: Api<FederatedMyApp> = Api::namespaced(ctx.client.clone(), &key.namespace);
    let has_finalizer = app.finalizers().iter().any(|f| f == FINALIZER);
    let members = registered(&ctx.members);
    let leading = *ctx.leading.borrow();
    if app.metadata.deletion_timestamp.is_some() {
        if !has_finalizer {
            return Ok(None);
        }
        let plan = index_deletion(app, &members, ctx);
        let waiting = !plan.deleting_on.as_ref().is_some_and(Vec::is_empty);
        ctx.status.set_plan(&key, plan);
        if waiting || !leading {
            return Ok(Some(DELETION_RECHECK));
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
        return Ok(None);
    }
    if !leading {
        // Warm: planned like on the leader, written by nobody.
        ctx.status.set_plan(&key, index_app(app, &members, ctx));
        return Ok(Some(STANDBY_RECHECK));
    }
    if !has_finalizer {
        let mut finalizers = app.finalizers().to_vec();
        finalizers.push(FINALIZER.into());
        set_finalizers(&api, app, finalizers).await?;
    }
    let planned = index_app(app, &members, ctx);
    let failures: Vec<(String, String)> = planned
        .plan
        .reported()
        .filter_map(|(c, p)| Some((c.clone(), p.error()?)))
        .collect();
    let placement_error = planned
        .plan
        .placement_error
        .as_ref()
        .map(ToString::to_string);
    // A grace period that ends, or replacements that may be Ready, change the division
    // with no change to the app: look again by then.
    let recheck = planned.plan.schedule.as_ref().and_then(|s| s.recheck_after);
    if ctx.status.set_plan(&key, planned) {
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
    Ok(recheck)
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

    fn app(yaml: &str) -> FederatedMyApp {
        serde_yaml::from_str(yaml).unwrap()
    }

    /// A capacity-only pass (every few seconds while pods come and go) must not drop
    /// the look again a Weighted app's make-before-break asked for.
    #[test]
    fn a_capacity_only_pass_keeps_the_other_apps_recheck() {
        let now = Instant::now();
        let (soon, later) = (now + Duration::from_secs(1), now + Duration::from_secs(5));
        assert_eq!(
            next_recheck(Scope::ByCapacity, Some(later), None),
            Some(later)
        );
        assert_eq!(
            next_recheck(Scope::ByCapacity, Some(later), Some(soon)),
            Some(soon)
        );
        assert_eq!(
            next_recheck(Scope::ByCapacity, Some(soon), Some(later)),
            Some(soon)
        );
        assert_eq!(next_recheck(Scope::ByCapacity, None, None), None);
        // A full pass knows every app's wish.
        assert_eq!(
            next_recheck(Scope::All, Some(soon), Some(later)),
            Some(later)
        );
        assert_eq!(next_recheck(Scope::All, Some(soon), None), None);
    }

    fn named(name: &str, orphan: bool) -> FederatedMyApp {
        let mut a = app(&format!(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {{name: {name}, namespace: n}}\nspec: {{}}\n"
        ));
        if orphan {
            a.annotations_mut()
                .insert(ORPHAN_ANNOTATION.into(), "true".into());
        }
        a
    }

    fn list(seen: &mut Seen, apps: &[FederatedMyApp]) -> Vec<(AppKey, bool)> {
        let mut gone = seen.deleted(&watcher::Event::Init);
        for a in apps {
            gone.extend(seen.deleted(&watcher::Event::InitApply(a.clone())));
        }
        gone.extend(seen.deleted(&watcher::Event::InitDone));
        gone
    }

    /// An app deleted (finalizer removed by hand) while the watch was down is in no
    /// event: the re-list that no longer holds it must report it, with its orphan wish;
    /// the first list reports nothing, and neither does a list cut short.
    #[test]
    fn a_relist_reports_the_apps_it_no_longer_holds() {
        let key = |name: &str| AppKey::new("n", name);
        let mut seen = Seen::default();
        let (a, b, c) = (named("a", false), named("b", true), named("c", false));
        assert_eq!(list(&mut seen, &[a.clone(), b.clone()]), vec![]);
        assert_eq!(seen.deleted(&watcher::Event::Apply(c.clone())), vec![]);
        // A list that restarts before its end reports nothing of its partial view.
        seen.deleted(&watcher::Event::Init);
        seen.deleted(&watcher::Event::InitApply(a.clone()));
        let mut gone = list(&mut seen, std::slice::from_ref(&a));
        gone.sort_by_key(|(key, _)| key.to_string());
        assert_eq!(gone, vec![(key("b"), true), (key("c"), false)]);
        // Once reported, never again; a Delete event reports its app once.
        assert_eq!(list(&mut seen, std::slice::from_ref(&a)), vec![]);
        assert_eq!(
            seen.deleted(&watcher::Event::Delete(a.clone())),
            vec![(key("a"), false)]
        );
        assert_eq!(list(&mut seen, &[]), vec![]);
    }
}
