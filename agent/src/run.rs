//! `flotilla-agent run` and `flotilla-agent operator`: one supervised process (see
//! `flotilla_common::supervise`) of four tasks, as the hub's `run` wires its own:
//!
//! - `http`: /healthz, /readyz and /metrics;
//! - `webhook`: the MyApp conversion webhook, served by every replica (standbys too);
//! - `leader-election`: the campaign for the agent Lease;
//! - `acting`: what only the Lease holder does: the MyApp operator and, for `run`, the
//!   hub session. It starts each time this agent gains the Lease and stops each time it
//!   loses it.
//!
//! On a lost Lease both the session and the operator stop (the operator's readiness
//! gate closes), before another agent may acquire the Lease, and both start anew when
//! this agent wins it again: one agent per member acts. Keeping the operator through a
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

use crate::cache;
use crate::capacity;
use crate::cli::OperatorArgs;
use crate::operator;
use crate::session::{self, SessionConfig};
use crate::webhook::run_webhook;

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
    let metrics = Arc::new(Metrics::default());
    let readiness = Readiness::default();
    let operator_ready = readiness.gate("operator");
    let webhook_ready = readiness.gate("webhook");
    let mut tasks = Supervisor::new(shutdown.clone(), SHUTDOWN_GRACE);

    let addr = args.http_addr;
    let endpoints = http::serve(
        addr,
        http::router(metrics.clone(), readiness),
        shutdown.clone(),
    );
    tasks.spawn("http", async move {
        (endpoints.await).with_context(|| format!("serving /healthz, /readyz, /metrics on {addr}"))
    });
    let webhook = run_webhook(
        client.clone(),
        args.webhook.webhook_config(),
        webhook_ready,
        shutdown.clone(),
    );
    tasks.spawn("webhook", async move {
        webhook.await.context("conversion webhook")
    });
    let config = args.operator_config();
    let ready = operator_ready.clone();
    let act = move |stop: CancellationToken| {
        let hub = hub_session(client.clone(), session.clone(), stop.clone());
        let operator = operator::run_operator(
            client.clone(),
            config.clone(),
            metrics.clone(),
            ready.clone(),
            stop,
        );
        async move {
            tokio::join!(operator, hub);
        }
    };
    let election = Election {
        leading,
        campaign,
        // A leader steps down this long before its Lease expires: the work must have
        // stopped before another agent can acquire it.
        stop_within: args.leader.lease_renew_margin,
    };
    spawn_elected(&mut tasks, election, act, move || operator_ready.close());
    info!(http = %args.http_addr, "flotilla-agent starting");
    tasks.run().await?;
    info!("flotilla-agent stopped");
    Ok(())
}

/// The outcome of `leader::elect`.
struct Election {
    leading: watch::Receiver<bool>,
    campaign: BoxFuture<'static, ()>,
    /// How long the work may take to stop after a loss: until another agent may
    /// acquire the Lease.
    stop_within: Duration,
}

/// Adds the campaign and the work it gates (`act`, while this agent holds the Lease)
/// to `tasks`; `on_lost` runs each time the work stopped after a loss.
fn spawn_elected<A, W>(
    tasks: &mut Supervisor,
    election: Election,
    act: A,
    on_lost: impl Fn() + Send + 'static,
) where
    A: FnMut(CancellationToken) -> W + Send + 'static,
    W: Future<Output = ()> + Send + 'static,
{
    let Election {
        leading,
        campaign,
        stop_within,
    } = election;
    tasks.spawn("leader-election", async move {
        campaign.await;
        Ok(())
    });
    let shutdown = tasks.shutdown();
    tasks.spawn("acting", async move {
        act_while_leading(leading, stop_within, &shutdown, act, on_lost).await
    });
}

/// Runs `act` while this agent holds the Lease, until shutdown. One that loses it (its
/// apiserver gone for longer than the Lease, another agent took over) stops acting
/// before anything else (`on_lost`) and waits as a standby again, so that two agents
/// never act at once. Work that does not stop within `grace` (before another agent
/// may take over) ends the process instead, which its Deployment restarts: a process
/// that cannot stop acting must not go on. Ok when shutdown stopped it, or when the work
/// or the election ended on their own (the supervisor then stops the process).
async fn act_while_leading<W>(
    active: watch::Receiver<bool>,
    grace: Duration,
    shutdown: &CancellationToken,
    mut act: impl FnMut(CancellationToken) -> W,
    on_lost: impl Fn(),
) -> anyhow::Result<()>
where
    W: Future<Output = ()>,
{
    loop {
        if !became_active(active.clone(), shutdown).await {
            return Ok(());
        }
        let stop = shutdown.child_token();
        let work = act(stop.clone());
        tokio::pin!(work);
        tokio::select! {
            // Stopped on its own: the process restarts whole.
            () = &mut work => return Ok(()),
            () = lost(active.clone()) => {}
            () = shutdown.cancelled() => {}
        }
        stop.cancel();
        if tokio::time::timeout(grace, work).await.is_err() {
            anyhow::bail!(
                "the agent's work did not stop within {grace:?} of {}; exiting",
                if shutdown.is_cancelled() {
                    "shutdown"
                } else {
                    "losing the agent Lease"
                }
            );
        }
        if shutdown.is_cancelled() {
            return Ok(());
        }
        on_lost();
        warn!("lost the agent Lease: stopped acting");
    }
}

/// The session with the hub, with the watches it reads, until `stop`.
async fn hub_session(
    client: kube::Client,
    session: Option<SessionConfig>,
    stop: CancellationToken,
) {
    let Some(session) = session else { return };
    let (managed, watch) = cache::watch_managed(client.clone());
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
    tokio::select! {
        _ = session::run(client, session, managed, capacity, stop) => {}
        _ = watch => {}
        _ = capacity_watch => {}
    }
}

/// Waits until this agent holds the Lease (at once without `--leader-elect`); false
/// if the process stops first, or the election ended.
async fn became_active(mut active: watch::Receiver<bool>, shutdown: &CancellationToken) -> bool {
    if !*active.borrow() {
        info!("standby: waiting for the agent Lease");
    }
    let active = tokio::select! {
        _ = shutdown.cancelled() => return false,
        // An election that ended leads no more, whatever it said last (acting on its
        // last word spun: lost at once, active at once).
        held = active.wait_for(|a| *a) => held.is_ok(),
    } && active.has_changed().is_ok();
    if active {
        info!("active");
    }
    active
}

/// Resolves when the Lease is lost (or the election ended).
async fn lost(mut active: watch::Receiver<bool>) {
    let _ = active.wait_for(|a| !*a).await;
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use flotilla_common::supervise::Stopped;
    use futures::FutureExt;
    use tokio::time::Instant;

    use super::*;

    const STOP_WITHIN: Duration = Duration::from_secs(2);

    /// The agent's tasks around a fake election whose campaign never ends, not even at
    /// shutdown (as one stuck in a release the apiserver never answers), and work that
    /// counts its starts and, while it runs, itself in `running`.
    struct Agent {
        lease: watch::Sender<bool>,
        sigterm: CancellationToken,
        started: Arc<AtomicUsize>,
        running: Arc<AtomicUsize>,
        lost: Arc<AtomicUsize>,
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
            let (started, running, lost): (Arc<AtomicUsize>, Arc<AtomicUsize>, Arc<AtomicUsize>) =
                Default::default();
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
            let l = Arc::clone(&lost);
            let on_lost = move || {
                l.fetch_add(1, Ordering::SeqCst);
            };
            let election = Election {
                leading: active,
                campaign: std::future::pending().boxed(),
                stop_within: STOP_WITHIN,
            };
            spawn_elected(&mut tasks, election, act, on_lost);
            Agent {
                lease,
                sigterm,
                started,
                running,
                lost,
                run: tokio::spawn(tasks.run()),
            }
        }

        fn counts(&self) -> (usize, usize, usize) {
            let get = |c: &AtomicUsize| c.load(Ordering::SeqCst);
            (get(&self.started), get(&self.running), get(&self.lost))
        }

        /// SIGTERM: the process must end within the grace (plus a second).
        async fn sigterm(self) -> (Result<(), Stopped>, (usize, usize, usize)) {
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
                self.lost.load(Ordering::SeqCst),
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
        assert_eq!(agent.counts(), (0, 0, 0));
        let (ended, counts) = agent.sigterm().await;
        ended.unwrap();
        assert_eq!(counts, (0, 0, 0), "never acted");
    }

    /// The Lease holder ends on SIGTERM, its work stopped.
    #[tokio::test(start_paused = true)]
    async fn sigterm_ends_an_active_agent() {
        let agent = Agent::start(true, true);
        settle().await;
        assert_eq!(agent.counts(), (1, 1, 0));
        let (ended, counts) = agent.sigterm().await;
        ended.unwrap();
        assert_eq!(counts, (1, 0, 0));
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
            assert_eq!(agent.counts(), (n, 0, n), "stopped after loss {n}");
            agent.lease.send_replace(true);
            settle().await;
            assert_eq!(
                agent.counts(),
                (n + 1, 1, n),
                "started again after gain {n}"
            );
        }
        agent.lease.send_replace(false);
        settle().await;
        assert_eq!(agent.counts(), (3, 0, 3));
        let (ended, counts) = agent.sigterm().await;
        ended.unwrap();
        assert_eq!(counts, (3, 0, 3));
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
    /// the Lease, and the process ends (non-zero, naming the task) within the grace.
    #[tokio::test(start_paused = true)]
    async fn work_that_does_not_stop_after_a_loss_ends_the_process() {
        let agent = Agent::start(true, false);
        settle().await;
        agent.lease.send_replace(false);
        tokio::time::sleep(STOP_WITHIN + Duration::from_millis(10)).await;
        assert_eq!(agent.running.load(Ordering::SeqCst), 0, "still acting");
        let ended = tokio::time::timeout(SHUTDOWN_GRACE + Duration::from_secs(1), agent.run)
            .await
            .expect("the agent went on after a loss it could not stop for")
            .unwrap();
        let error = ended.unwrap_err().to_string();
        assert!(
            error.contains("acting failed") && error.contains("losing the agent Lease"),
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
