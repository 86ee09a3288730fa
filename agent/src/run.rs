//! `flotilla-agent webhook` ([`serve_webhook`]: the webhook and the HTTP endpoints alone),
//! and `flotilla-agent run` and `flotilla-agent operator`: one supervised process (see
//! `flotilla_common::supervise`) of four tasks, as the hub's `run` wires its own:
//!
//! - `http`: /healthz, /readyz and /metrics;
//! - `webhook`: the MyApp conversion webhook, served by every replica (standbys too);
//! - `leader-election`: the campaign for the agent Lease;
//! - `acting`: what only the Lease holder does: the MyApp operator and, for `run`, the
//!   hub session (with the hand-back and the autoscalers' bounds). It starts each time this agent gains the Lease and stops each time it
//!   loses it.
//!
//! On a lost Lease (renewals failed for the renew deadline) both the session and the
//! operator stop (the operator's readiness gate closes) within the stop grace, lease
//! duration − renew deadline, before another agent may acquire the Lease, and both start
//! anew when this agent wins it again: one agent per member acts. Keeping the operator through a
//! short loss would save a re-list, but a loss is known to be short only once it ended,
//! and two operators of one cluster must never write at once.
//!
//! No state leaves the process alive and not working: work that does not stop before
//! another agent may acquire the Lease ends the process (its Pod restarts), so does any task
//! that ends on its own; SIGTERM ends it within [`SHUTDOWN_GRACE`] whatever it was doing
//! (tasks still running then are aborted).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use flotilla_common::http::{self, Readiness};
use flotilla_common::kubeconfig::KubeArgs;
use flotilla_common::leader;
use flotilla_common::metrics::Metrics;
use flotilla_common::shutdown;
use flotilla_common::supervise::Supervisor;
use futures::future::BoxFuture;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::autoscale::{self, Autoscalers};
use crate::bounds;
use crate::cache;
use crate::capacity;
use crate::cli::{OperatorArgs, WebhookServeArgs};
use crate::handback;
use crate::operator;
use crate::scaler;
use crate::session::{self, SessionConfig};
use crate::webhook::{WebhookConfig, run_webhook};

/// How long the tasks get to stop after SIGTERM before they are aborted: less than the
/// Pod's `terminationGracePeriodSeconds` (15 s) minus margin, so that SIGTERM ends the
/// agent within 10 s in any state.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(8);

/// Runs the agent until SIGTERM: the operator, the webhook and the HTTP endpoints, and
/// with a session config the hub session too.
pub async fn serve(
    kube: &KubeArgs,
    args: OperatorArgs,
    session: Option<SessionConfig>,
) -> anyhow::Result<()> {
    let shutdown = shutdown::on_signal().context("installing the SIGTERM handler")?;
    let kube_config = kube.config().await.context("connecting to Kubernetes")?;
    let client = kube::Client::try_from(kube_config.clone()).context("connecting to Kubernetes")?;
    let (leading, campaign) =
        leader::elect(kube_config, &args.leader, leader::AGENT, shutdown.clone())?;
    let mut metrics = Metrics::default();
    let bounds_written = bounds::Written::default();
    if let Some(session) = &session {
        session.guard.register(metrics.registry_mut());
        bounds_written.register(metrics.registry_mut());
        let forbidden: Vec<&str> = session.guard.forbidden().collect();
        info!(?forbidden, "MyApps in these namespaces are refused");
    }
    let metrics = Arc::new(metrics);
    let readiness = Readiness::default();
    let operator_ready = readiness.gate("operator");
    let mut tasks = Supervisor::new(shutdown.clone(), SHUTDOWN_GRACE);
    let endpoints = Endpoints {
        http_addr: args.http_addr,
        metrics: metrics.clone(),
        readiness,
        webhook: args.webhook.webhook_config(),
    };
    endpoints.spawn(&mut tasks, client.clone(), &shutdown);
    let config = args.operator_config();
    // The namespaces the agent applies into: the only ones the scaler reads and the
    // bounds are written in.
    let scope = scaler::Scope {
        operator: config.namespaces.clone(),
        tenancy: session.as_ref().map(|s| s.guard.policy().clone()),
    };
    if let Some(addr) = args.scaler_addr {
        // On every replica, leading or not: it only reads.
        let scaler = scaler::Scaler::new(client.clone(), scope.clone());
        tasks.spawn(
            "external-scaler",
            scaler::serve(addr, scaler, shutdown.clone()),
        );
    }
    let act = move |stop: CancellationToken| {
        let (autoscalers, autoscalers_watch) =
            autoscale::watch(client.clone(), scope.autoscaler_namespaces().as_ref());
        let hub = hub_session(
            client.clone(),
            session.clone(),
            autoscalers.clone(),
            scope.clone(),
            bounds_written.clone(),
            stop.clone(),
        );
        let operator = operator::run_operator(
            client.clone(),
            config.clone(),
            metrics.clone(),
            autoscalers,
            operator_ready.clone(),
            stop,
        );
        // Boxed: together they are too large a future for a worker thread's stack.
        let (operator, hub) = (Box::pin(operator), Box::pin(hub));
        let autoscalers_watch = Box::pin(autoscalers_watch);
        async move {
            tokio::select! {
                _ = async { tokio::join!(operator, hub) } => {}
                () = autoscalers_watch => {}
            }
        }
    };
    let election = Election {
        leading,
        campaign,
        stop_grace: args.leader.stop_grace()?,
    };
    spawn_elected(&mut tasks, election, act);
    info!(http = %args.http_addr, "flotilla-agent starting");
    tasks.run().await?;
    info!("flotilla-agent stopped");
    Ok(())
}

/// `flotilla-agent webhook`: the conversion webhook and the HTTP endpoints until
/// SIGTERM; no operator, no session, no election (every replica serves).
pub async fn serve_webhook(kube: &KubeArgs, args: WebhookServeArgs) -> anyhow::Result<()> {
    let shutdown = shutdown::on_signal().context("installing the SIGTERM handler")?;
    let kube_config = kube.config().await.context("connecting to Kubernetes")?;
    let client = kube::Client::try_from(kube_config).context("connecting to Kubernetes")?;
    let mut tasks = Supervisor::new(shutdown.clone(), SHUTDOWN_GRACE);
    let endpoints = Endpoints {
        http_addr: args.http_addr,
        metrics: Default::default(),
        readiness: Readiness::default(),
        webhook: args.webhook.webhook_config(),
    };
    endpoints.spawn(&mut tasks, client, &shutdown);
    info!(http = %args.http_addr, webhook = %args.webhook.webhook_addr, "flotilla-agent webhook starting");
    tasks.run().await?;
    info!("flotilla-agent webhook stopped");
    Ok(())
}

/// What every agent process serves, leading or not: /healthz, /readyz and /metrics, and
/// the MyApp conversion webhook (ready once its certificate is loaded).
struct Endpoints {
    http_addr: std::net::SocketAddr,
    metrics: Arc<Metrics>,
    readiness: Readiness,
    webhook: WebhookConfig,
}

impl Endpoints {
    fn spawn(self, tasks: &mut Supervisor, client: kube::Client, shutdown: &CancellationToken) {
        let webhook_ready = self.readiness.gate("webhook");
        let addr = self.http_addr;
        let router = http::router(self.metrics, self.readiness);
        let endpoints = http::serve(addr, router, shutdown.clone());
        tasks.spawn("http", async move {
            (endpoints.await)
                .with_context(|| format!("serving /healthz, /readyz, /metrics on {addr}"))
        });
        let webhook = run_webhook(client, self.webhook, webhook_ready, shutdown.clone());
        tasks.spawn("webhook", async move {
            webhook.await.context("conversion webhook")
        });
    }
}

/// The outcome of `leader::elect`.
struct Election {
    leading: watch::Receiver<bool>,
    campaign: BoxFuture<'static, ()>,
    /// How long the work may take to stop once `leading` turned false: until another
    /// agent may acquire the Lease (`LeaderArgs::stop_grace`).
    stop_grace: Duration,
}

/// Adds the campaign and the work it gates to `tasks`: `act` runs while this agent holds
/// the Lease (see [`leader::while_leading`]). One that loses it (its apiserver failed
/// its renewals for the renew deadline) stops acting and waits as a standby again, so
/// that two agents never act at once; work that does not stop within the grace (before
/// another agent may take over) ends the process instead, which its Deployment
/// restarts: a process that cannot stop acting must not go on. Work or an election that
/// ends on its own ends the process too (the supervisor names the task).
fn spawn_elected<A, W>(tasks: &mut Supervisor, election: Election, mut act: A)
where
    A: FnMut(CancellationToken) -> W + Send + 'static,
    W: Future<Output = ()> + Send + 'static,
{
    let Election {
        leading,
        campaign,
        stop_grace,
    } = election;
    tasks.spawn("leader-election", async move {
        campaign.await;
        Ok(())
    });
    let shutdown = tasks.shutdown();
    tasks.spawn("acting", async move {
        if !*leading.borrow() {
            info!("standby: waiting for the agent Lease");
        }
        let stopping = shutdown.clone();
        let work = move |stop: CancellationToken| {
            info!("active: holding the agent Lease");
            let work = act(stop.clone());
            let stopping = stopping.clone();
            async move {
                work.await;
                if stop.is_cancelled() && !stopping.is_cancelled() {
                    warn!("lost the agent Lease: stopped acting");
                    info!("standby: waiting for the agent Lease");
                }
            }
        };
        leader::while_leading(leading, &shutdown, stop_grace, work).await?;
        Ok(())
    });
}

/// The session with the hub, with the watches it reads and the tasks that act on the
/// MyApps it manages (hand-back, bounds), until `stop`.
async fn hub_session(
    client: kube::Client,
    session: Option<SessionConfig>,
    autoscalers: Autoscalers,
    scope: scaler::Scope,
    bounds_written: bounds::Written,
    stop: CancellationToken,
) {
    let Some(session) = session else { return };
    let (managed, watch) = cache::watch_managed(client.clone(), session.guard.policy().allowed());
    let (capacity, capacity_watch) = match session.capacity_interval {
        Some(_) => {
            let (source, watch) = capacity::watch(client.clone());
            (Some(source), futures::future::Either::Left(watch))
        }
        None => (
            None,
            futures::future::Either::Right(futures::future::pending()),
        ),
    };
    let handback = Box::pin(handback::run(
        client.clone(),
        managed.clone(),
        autoscalers.clone(),
    ));
    let bounds = Box::pin(bounds::run(
        client.clone(),
        managed.clone(),
        autoscalers.clone(),
        scope,
        bounds_written,
    ));
    tokio::select! {
        _ = Box::pin(session::run(client, session, managed, capacity, autoscalers, stop)) => {}
        _ = watch => {}
        _ = capacity_watch => {}
        _ = handback => {}
        _ = bounds => {}
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use flotilla_common::supervise::Stopped;
    use futures::FutureExt;
    use tokio::time::Instant;

    use super::*;

    /// The default timings' stop grace: lease duration 15 s − renew deadline 10 s.
    const STOP_GRACE: Duration = Duration::from_secs(5);

    /// The agent's tasks around a fake election whose campaign never ends, not even at
    /// shutdown (as one stuck in a release the apiserver never answers), and work that
    /// counts its starts and, while it runs, itself in `running`.
    struct Agent {
        lease: watch::Sender<bool>,
        sigterm: CancellationToken,
        started: Arc<AtomicUsize>,
        running: Arc<AtomicUsize>,
        run: tokio::task::JoinHandle<Result<(), Stopped>>,
    }

    /// Decrements its counter when the work ends, however it ends (also when aborted).
    struct Running(Arc<AtomicUsize>);

    impl Drop for Running {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl Agent {
        /// `obeys`: whether the work stops when told to.
        fn start(leading: bool, obeys: bool) -> Agent {
            let (lease, active) = watch::channel(leading);
            let sigterm = CancellationToken::new();
            let (started, running): (Arc<AtomicUsize>, Arc<AtomicUsize>) = Default::default();
            let mut tasks = Supervisor::new(sigterm.clone(), SHUTDOWN_GRACE);
            let http = sigterm.clone();
            tasks.spawn("http", async move {
                http.cancelled().await;
                Ok(())
            });
            let (s, r) = (Arc::clone(&started), Arc::clone(&running));
            let act = move |stop: CancellationToken| {
                s.fetch_add(1, Ordering::SeqCst);
                r.fetch_add(1, Ordering::SeqCst);
                let guard = Running(r.clone());
                async move {
                    let _guard = guard;
                    if obeys {
                        stop.cancelled().await
                    } else {
                        std::future::pending().await
                    }
                }
            };
            let election = Election {
                leading: active,
                campaign: std::future::pending().boxed(),
                stop_grace: STOP_GRACE,
            };
            spawn_elected(&mut tasks, election, act);
            Agent {
                lease,
                sigterm,
                started,
                running,
                run: tokio::spawn(tasks.run()),
            }
        }

        /// (starts, running now).
        fn counts(&self) -> (usize, usize) {
            let get = |c: &AtomicUsize| c.load(Ordering::SeqCst);
            (get(&self.started), get(&self.running))
        }

        /// SIGTERM: the process must end within the grace (plus a second).
        async fn sigterm(self) -> (Result<(), Stopped>, (usize, usize)) {
            let at = Instant::now();
            self.sigterm.cancel();
            let ended = tokio::time::timeout(SHUTDOWN_GRACE + Duration::from_secs(1), self.run)
                .await
                .expect("the agent did not end within the grace after SIGTERM")
                .unwrap();
            assert!(at.elapsed() <= SHUTDOWN_GRACE + Duration::from_secs(1));
            let counts = (
                self.started.load(Ordering::SeqCst),
                self.running.load(Ordering::SeqCst),
            );
            (ended, counts)
        }
    }

    async fn settle() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    /// A standby that never got the Lease (its campaign hangs) ends on SIGTERM.
    #[tokio::test(start_paused = true)]
    async fn sigterm_ends_a_standby() {
        let agent = Agent::start(false, true);
        settle().await;
        assert_eq!(agent.counts(), (0, 0));
        let (ended, counts) = agent.sigterm().await;
        ended.unwrap();
        assert_eq!(counts, (0, 0), "never acted");
    }

    /// The Lease holder ends on SIGTERM, its work stopped.
    #[tokio::test(start_paused = true)]
    async fn sigterm_ends_an_active_agent() {
        let agent = Agent::start(true, true);
        settle().await;
        assert_eq!(agent.counts(), (1, 1));
        let (ended, counts) = agent.sigterm().await;
        ended.unwrap();
        assert_eq!(counts, (1, 0));
    }

    /// The Lease lost and won back, twice (an overloaded apiserver): the work stops at
    /// each loss and starts anew at each gain (an agent stayed a standby for good, with
    /// /readyz "waiting for: operator", before); SIGTERM after a loss still ends it.
    #[tokio::test(start_paused = true)]
    async fn the_work_stops_at_each_loss_and_starts_again_at_each_gain() {
        let agent = Agent::start(true, true);
        settle().await;
        for n in 1..=2 {
            agent.lease.send_replace(false);
            settle().await;
            assert_eq!(agent.counts(), (n, 0), "stopped after loss {n}");
            agent.lease.send_replace(true);
            settle().await;
            assert_eq!(agent.counts(), (n + 1, 1), "started again after gain {n}");
        }
        agent.lease.send_replace(false);
        settle().await;
        assert_eq!(agent.counts(), (3, 0));
        let (ended, counts) = agent.sigterm().await;
        ended.unwrap();
        assert_eq!(counts, (3, 0));
    }

    /// Work that ignores SIGTERM is aborted at the end of the grace.
    #[tokio::test(start_paused = true)]
    async fn sigterm_ends_work_that_does_not_stop() {
        let agent = Agent::start(true, false);
        settle().await;
        let (ended, counts) = agent.sigterm().await;
        // The supervisor's grace is the longer: acting gave up first and says why.
        let error = ended.unwrap_err().to_string();
        assert!(
            error.contains("acting failed") && error.contains("shutdown"),
            "{error}"
        );
        assert_eq!(counts.1, 0, "aborted");
    }

    /// Work that does not stop after a loss is dropped before another agent may take
    /// the Lease (the stop grace), and the process ends (non-zero, naming the task).
    #[tokio::test(start_paused = true)]
    async fn work_that_does_not_stop_after_a_loss_ends_the_process() {
        let agent = Agent::start(true, false);
        settle().await;
        agent.lease.send_replace(false);
        tokio::time::sleep(STOP_GRACE + Duration::from_millis(10)).await;
        assert_eq!(agent.running.load(Ordering::SeqCst), 0, "still acting");
        let ended = tokio::time::timeout(SHUTDOWN_GRACE + Duration::from_secs(1), agent.run)
            .await
            .expect("the agent went on after a loss it could not stop for")
            .unwrap();
        let error = ended.unwrap_err().to_string();
        assert!(
            error.contains("acting failed") && error.contains("losing the Lease"),
            "{error}"
        );
    }

    /// An election that ends on its own (its channel closed) ends the process, naming
    /// the task.
    #[tokio::test(start_paused = true)]
    async fn an_election_that_ends_stops_the_process() {
        let agent = Agent::start(true, true);
        settle().await;
        drop(agent.lease);
        let ended = tokio::time::timeout(SHUTDOWN_GRACE + Duration::from_secs(1), agent.run)
            .await
            .expect("the agent went on without an election")
            .unwrap();
        let error = ended.unwrap_err().to_string();
        assert!(error.contains("acting ended on its own"), "{error}");
        assert_eq!(agent.running.load(Ordering::SeqCst), 0);
    }
}
