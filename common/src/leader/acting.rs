//! Running work only while this process leads: the loop the hub's status and
//! MemberCluster writers and the agent's session and operator each need.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Work that had not stopped `grace` after it was told to.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the work did not stop within {grace:?} of {cause}; it must not go on without the Lease")]
pub struct NotStopped {
    pub grace: Duration,
    /// `"losing the Lease"` or `"shutdown"`.
    pub cause: &'static str,
}

/// Runs `work(stop)` each time this process starts leading, until `shutdown`:
///
/// - waits until `leading` is true; returns `Ok(None)` if `shutdown` fires (or the
///   election ends) first;
/// - starts `work` with `stop`, a child of `shutdown` that is cancelled when the lead is
///   lost and at shutdown;
/// - work that ends by itself while leading ends the loop: `Ok(Some(output))` (usually
///   the caller then ends the process: a task that matters stopped);
/// - when the lead is lost, cancels `stop`, waits for the work to end and waits to lead
///   again; at shutdown (or when the election ends) the same, then returns `Ok(None)`;
/// - work that has not ended `grace` after `stop` is dropped, and the loop returns
///   [`NotStopped`]: end the process then (its Deployment restarts it), since a
///   process that cannot stop acting must not go on.
///
/// `grace`: [`super::LeaderArgs::stop_grace`], the time between `leading` turning false
/// and the earliest moment another replica may take the Lease. The output of work
/// stopped by `stop` is dropped.
///
/// ```text
/// // hub/src/status.rs, write_loop:
/// let ended = leader::while_leading(leading, &shutdown, grace, |stop| {
///     self.write_while_leading(&client, &apps, window, stop)
/// })
/// .await?;
/// ended.unwrap_or(Ok(()))
/// ```
pub async fn while_leading<W, T>(
    mut leading: watch::Receiver<bool>,
    shutdown: &CancellationToken,
    grace: Duration,
    mut work: impl FnMut(CancellationToken) -> W,
) -> Result<Option<T>, NotStopped>
where
    W: Future<Output = T>,
{
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Ok(None),
            led = leading.wait_for(|l| *l) => if led.is_err() { return Ok(None) },
        }
        let stop = shutdown.child_token();
        let running = work(stop.clone());
        tokio::pin!(running);
        let (cause, again) = tokio::select! {
            biased;
            _ = shutdown.cancelled() => ("shutdown", false),
            lost = leading.wait_for(|l| !*l) => ("losing the Lease", lost.is_ok()),
            out = &mut running => return Ok(Some(out)),
        };
        stop.cancel();
        if tokio::time::timeout(grace, running).await.is_err() {
            return Err(NotStopped { grace, cause });
        }
        if !again || shutdown.is_cancelled() {
            return Ok(None);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::FutureExt;
    use futures::future::BoxFuture;

    use super::*;

    const GRACE: Duration = Duration::from_secs(5);

    /// Work that stops when told, counting its starts and how many run at once.
    fn obedient(
        starts: Arc<AtomicUsize>,
        running: Arc<AtomicUsize>,
    ) -> impl FnMut(CancellationToken) -> BoxFuture<'static, &'static str> {
        move |stop| {
            starts.fetch_add(1, Ordering::SeqCst);
            let running = running.clone();
            async move {
                assert_eq!(running.fetch_add(1, Ordering::SeqCst), 0, "one at a time");
                stop.cancelled().await;
                running.fetch_sub(1, Ordering::SeqCst);
                "stopped"
            }
            .boxed()
        }
    }

    async fn settle() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn work_runs_only_while_leading_and_again_after_a_new_lead() {
        let (tx, rx) = watch::channel(false);
        let shutdown = CancellationToken::new();
        let (starts, running) = (Arc::default(), Arc::new(AtomicUsize::new(0)));
        let work = obedient(Arc::clone(&starts), Arc::clone(&running));
        let looped = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { while_leading(rx, &shutdown, GRACE, work).await }
        });
        settle().await;
        assert_eq!(starts.load(Ordering::SeqCst), 0, "a standby does nothing");
        tx.send_replace(true);
        settle().await;
        assert_eq!(running.load(Ordering::SeqCst), 1);
        tx.send_replace(false);
        settle().await;
        assert_eq!(
            running.load(Ordering::SeqCst),
            0,
            "stopped on losing the lead"
        );
        tx.send_replace(true);
        settle().await;
        assert_eq!(
            (
                starts.load(Ordering::SeqCst),
                running.load(Ordering::SeqCst)
            ),
            (2, 1)
        );
        shutdown.cancel();
        assert_eq!(looped.await.unwrap(), Ok(None));
        assert_eq!(running.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_before_leading_never_starts_the_work() {
        let (_tx, rx) = watch::channel(false);
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        let starts = Arc::new(AtomicUsize::new(0));
        let work = obedient(Arc::clone(&starts), Arc::default());
        assert_eq!(while_leading(rx, &shutdown, GRACE, work).await, Ok(None));
        assert_eq!(starts.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_end_of_the_election_stops_the_work() {
        let (tx, rx) = watch::channel(true);
        let shutdown = CancellationToken::new();
        let running = Arc::new(AtomicUsize::new(0));
        let work = obedient(Arc::default(), Arc::clone(&running));
        let looped = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { while_leading(rx, &shutdown, GRACE, work).await }
        });
        settle().await;
        drop(tx);
        assert_eq!(looped.await.unwrap(), Ok(None));
        assert_eq!(running.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn work_that_ends_by_itself_ends_the_loop_with_its_output() {
        let (_tx, rx) = watch::channel(true);
        let shutdown = CancellationToken::new();
        let ended = while_leading(rx, &shutdown, GRACE, |_stop| async { 7 }).await;
        assert_eq!(ended, Ok(Some(7)));
    }

    #[tokio::test(start_paused = true)]
    async fn work_that_ignores_stop_is_dropped_after_the_grace() {
        let (tx, rx) = watch::channel(true);
        let shutdown = CancellationToken::new();
        let looped = tokio::spawn({
            let shutdown = shutdown.clone();
            async move {
                while_leading(rx, &shutdown, GRACE, |_stop| {
                    futures::future::pending::<()>()
                })
                .await
            }
        });
        settle().await;
        let lost = tokio::time::Instant::now();
        tx.send_replace(false);
        let ended = looped.await.unwrap();
        assert_eq!(
            ended,
            Err(NotStopped {
                grace: GRACE,
                cause: "losing the Lease"
            })
        );
        assert_eq!(lost.elapsed(), GRACE);
    }
}
