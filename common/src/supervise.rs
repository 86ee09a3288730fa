//! Supervision: a process is a set of named tasks that live as long as it does. When one
//! ends before shutdown was asked for (an error, or a server that stopped by itself), the
//! others are cancelled and the process exits non-zero naming that task, as linkerd's
//! policy-controller runtime does: a half-running process that still says ready is worse
//! than a restart.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// Why the process stopped when it was not asked to.
#[derive(Debug, thiserror::Error)]
pub enum Stopped {
    #[error("{task} failed: {error:#}")]
    Failed {
        task: &'static str,
        error: anyhow::Error,
    },
    #[error("{task} ended on its own")]
    Ended { task: &'static str },
    #[error("{task} panicked")]
    Panicked { task: &'static str },
}

/// The tasks of one process and the token that stops them all.
pub struct Supervisor {
    shutdown: CancellationToken,
    tasks: JoinSet<(&'static str, anyhow::Result<()>)>,
    names: Vec<(tokio::task::Id, &'static str)>,
    /// How long tasks get to finish once shutdown has begun before they are aborted.
    grace: Duration,
}

impl Supervisor {
    pub fn new(shutdown: CancellationToken, grace: Duration) -> Self {
        Self {
            shutdown,
            tasks: JoinSet::new(),
            names: Vec::new(),
            grace,
        }
    }

    /// The token every task must watch to stop.
    pub fn shutdown(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Runs `task` until shutdown; it must return when the token is cancelled. Returning
    /// earlier, with or without an error, stops the process.
    pub fn spawn<F>(&mut self, name: &'static str, task: F)
    where
        F: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let handle = self.tasks.spawn(async move { (name, task.await) });
        self.names.push((handle.id(), name));
    }

    /// Waits until shutdown is asked for or a task ends; then cancels the rest and waits
    /// for them (at most the grace period). Ok only for a requested shutdown in which
    /// every task ended cleanly.
    pub async fn run(mut self) -> Result<(), Stopped> {
        let mut first: Option<Stopped> = None;
        tokio::select! {
            biased;
            _ = self.shutdown.cancelled() => {}
            Some(done) = self.tasks.join_next() => {
                let stopped = self.outcome(done);
                error!(error = %stopped, "a critical task stopped: shutting down");
                first = Some(stopped);
                self.shutdown.cancel();
            }
        }
        let drained = tokio::time::timeout(self.grace, async {
            while let Some(done) = self.tasks.join_next().await {
                let stopped = self.outcome(done);
                if let Stopped::Ended { task } = stopped {
                    info!(task, "stopped");
                } else {
                    warn!(error = %stopped, "a task failed while shutting down");
                    first.get_or_insert(stopped);
                }
            }
        })
        .await;
        if drained.is_err() {
            let left: Vec<&str> = self.names.iter().map(|(_, n)| *n).collect();
            warn!(tasks = ?left, grace = ?self.grace, "tasks still running after the grace period: aborting them");
            self.tasks.abort_all();
        }
        first.map_or(Ok(()), Err)
    }

    fn outcome(
        &mut self,
        done: Result<(&'static str, anyhow::Result<()>), tokio::task::JoinError>,
    ) -> Stopped {
        match done {
            Ok((task, result)) => {
                self.names.retain(|(_, n)| *n != task);
                match result {
                    Ok(()) => Stopped::Ended { task },
                    Err(error) => Stopped::Failed { task, error },
                }
            }
            Err(e) => {
                let id = e.id();
                let task = self
                    .names
                    .iter()
                    .find(|(i, _)| *i == id)
                    .map_or("a task", |(_, n)| *n);
                self.names.retain(|(i, _)| *i != id);
                Stopped::Panicked { task }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    async fn until_cancelled(
        token: CancellationToken,
        stopped: Arc<AtomicBool>,
    ) -> anyhow::Result<()> {
        token.cancelled().await;
        stopped.store(true, Ordering::SeqCst);
        Ok(())
    }

    #[tokio::test]
    async fn a_failing_task_stops_the_others_and_is_named() {
        let mut s = Supervisor::new(CancellationToken::new(), Duration::from_secs(5));
        let other = Arc::new(AtomicBool::new(false));
        s.spawn("http", until_cancelled(s.shutdown(), other.clone()));
        s.spawn("grpc", async {
            anyhow::bail!("binding 127.0.0.1:7443: address in use")
        });
        let err = s.run().await.unwrap_err();
        assert_eq!(
            err.to_string(),
            "grpc failed: binding 127.0.0.1:7443: address in use"
        );
        assert!(other.load(Ordering::SeqCst), "the other task was cancelled");
    }

    #[tokio::test]
    async fn a_task_ending_early_without_error_is_still_a_failure() {
        let mut s = Supervisor::new(CancellationToken::new(), Duration::from_secs(5));
        s.spawn("member-watch", async { Ok(()) });
        let token = s.shutdown();
        assert_eq!(
            s.run().await.unwrap_err().to_string(),
            "member-watch ended on its own"
        );
        assert!(token.is_cancelled());
    }

    #[tokio::test]
    async fn a_panic_is_named() {
        let mut s = Supervisor::new(CancellationToken::new(), Duration::from_secs(5));
        s.spawn("controller", async { panic!("boom") });
        assert_eq!(
            s.run().await.unwrap_err().to_string(),
            "controller panicked"
        );
    }

    #[tokio::test]
    async fn a_requested_shutdown_is_ok_and_waits_for_every_task() {
        let token = CancellationToken::new();
        let mut s = Supervisor::new(token.clone(), Duration::from_secs(5));
        let (a, b) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        s.spawn("a", until_cancelled(s.shutdown(), a.clone()));
        s.spawn("b", until_cancelled(s.shutdown(), b.clone()));
        token.cancel();
        s.run().await.unwrap();
        assert!(a.load(Ordering::SeqCst) && b.load(Ordering::SeqCst));
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_that_ignores_shutdown_is_aborted_after_the_grace_period() {
        let token = CancellationToken::new();
        let mut s = Supervisor::new(token.clone(), Duration::from_secs(2));
        s.spawn("stuck", std::future::pending());
        token.cancel();
        let started = tokio::time::Instant::now();
        s.run().await.unwrap();
        assert_eq!(started.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test]
    async fn an_error_during_shutdown_is_reported() {
        let token = CancellationToken::new();
        let mut s = Supervisor::new(token.clone(), Duration::from_secs(5));
        let t = s.shutdown();
        s.spawn("grpc", async move {
            t.cancelled().await;
            anyhow::bail!("draining failed")
        });
        token.cancel();
        assert_eq!(
            s.run().await.unwrap_err().to_string(),
            "grpc failed: draining failed"
        );
    }
}
