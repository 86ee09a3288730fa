//! The election loop of one candidate (client-go's `LeaderElector.Run`): one attempt
//! every retry period, each under its own deadline; the lead ends when the renew
//! deadline passes without a renewal, on a timer, even while a call hangs; nothing is
//! released on failure, only at shutdown, within a short bound.

use std::time::Instant;

use k8s_openapi::jiff::Timestamp;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::decide::{Candidate, Stored, Write};
use super::lease::{CallError, LeaseApi};

/// Where the campaign tells whether it leads, and how its attempts go.
pub trait Sink: Send {
    /// Called with each change (starting from `false`).
    fn publish(&mut self, leading: bool);
    fn attempt_failed(&mut self) {}
}

/// The local monotonic clock (tokio's, so that tests can pause and advance it).
pub fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

async fn sleep_until(t: Instant) {
    tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await
}

/// Runs `me`'s campaign on `api` until `shutdown`, then releases the Lease if it holds
/// it. `wall` stamps the times written into the Lease (informative only: no decision
/// reads them). Dropping the future publishes `false`.
pub async fn run<A, S, W>(api: A, mut me: Candidate, wall: W, sink: S, shutdown: CancellationToken)
where
    A: LeaseApi,
    S: Sink,
    W: Fn() -> Timestamp + Send + Sync,
{
    let mut out = Out {
        sink,
        leading: false,
        identity: me.identity().to_owned(),
        failures: 0,
    };
    let mut next = now();
    loop {
        let lead_ends = me.lead_ends();
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            _ = sleep_until(lead_ends.unwrap_or(next)), if lead_ends.is_some_and(|e| e < next) => {
                out.set(me.leading(now()));
                continue;
            }
            _ = sleep_until(next) => {}
        }
        let started = now();
        let deadline = tokio::time::Instant::from_std(me.attempt_deadline(started));
        let result = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            r = tokio::time::timeout_at(deadline, attempt(&api, &mut me, &wall, started)) => r,
        };
        let leading = me.leading(now());
        out.attempted(result.unwrap_or(Err(Failure::TimedOut)), leading, &me);
        out.set(leading);
        next = me.next_attempt(started);
    }
    out.set(false);
    let bound = me.timings().release_timeout();
    match tokio::time::timeout(bound, release(&api, &mut me, &wall)).await {
        Ok(Ok(true)) => info!(identity = %out.identity, "released the Lease"),
        Ok(Ok(false)) => {}
        Ok(Err(e)) => {
            warn!(identity = %out.identity, error = %e, "releasing the Lease at shutdown; it expires on its own")
        }
        Err(_) => {
            warn!(identity = %out.identity, ?bound, "releasing the Lease at shutdown timed out; it expires on its own")
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error(transparent)]
    Call(#[from] CallError),
    #[error("the attempt timed out")]
    TimedOut,
}

/// One attempt to acquire or renew. A leader first renews the version it wrote last
/// without reading (client-go's fast path); on any failure, and for a standby, it reads
/// the Lease and writes only if it holds it or it expired.
async fn attempt<A: LeaseApi, W: Fn() -> Timestamp>(
    api: &A,
    me: &mut Candidate,
    wall: &W,
    started: Instant,
) -> Result<(), Failure> {
    if let Some(Write::Update { record, version }) = me.renewal(started, wall()) {
        match api.update(&record, &version).await {
            Ok(stored) => {
                me.wrote(stored, started, now());
                return Ok(());
            }
            Err(e) => {
                debug!(identity = me.identity(), error = %e, "fast renewal failed; reading the Lease")
            }
        }
    }
    let read = api.get().await?;
    let Some(write) = me.observe(read, now(), wall()) else {
        return Ok(());
    };
    let stored = write_to(api, write).await?;
    me.wrote(stored, started, now());
    Ok(())
}

async fn write_to<A: LeaseApi>(api: &A, write: Write) -> Result<Stored, CallError> {
    match write {
        Write::Create(record) => api.create(&record).await,
        Write::Update { record, version } => api.update(&record, &version).await,
    }
}

/// Empties the holder of the Lease if this candidate holds it (re-reading once if it
/// changed meanwhile, e.g. by a renewal that was in flight at shutdown). True if released.
async fn release<A: LeaseApi, W: Fn() -> Timestamp>(
    api: &A,
    me: &mut Candidate,
    wall: &W,
) -> Result<bool, CallError> {
    let Some(write) = me.release(wall()) else {
        return Ok(false);
    };
    match write_to(api, write).await {
        Ok(_) => return Ok(true),
        Err(CallError::Conflict) => {}
        Err(e) => return Err(e),
    }
    me.seen(api.get().await?, now());
    match me.release(wall()) {
        Some(write) => write_to(api, write).await.map(|_| true),
        None => Ok(false),
    }
}

/// The sink, fed only changes, and `false` when dropped (an aborted campaign).
struct Out<S: Sink> {
    sink: S,
    leading: bool,
    identity: String,
    /// Failed attempts in a row.
    failures: u32,
}

impl<S: Sink> Out<S> {
    fn set(&mut self, leading: bool) {
        if leading != self.leading {
            self.leading = leading;
            info!(identity = %self.identity, leading, "leadership changed");
            self.sink.publish(leading);
        }
    }

    /// Logs a failed attempt once per run of failures (each while leading), and the
    /// recovery.
    fn attempted(&mut self, result: Result<(), Failure>, leading: bool, me: &Candidate) {
        match result {
            Ok(()) if self.failures > 0 => {
                info!(identity = %self.identity, failed = self.failures, "the Lease answers again");
                self.failures = 0;
            }
            Ok(()) => {}
            Err(e) => {
                self.failures += 1;
                self.sink.attempt_failed();
                if leading {
                    let left = me
                        .lead_ends()
                        .map(|end| end.saturating_duration_since(now()));
                    warn!(identity = %self.identity, error = %e, failed = self.failures, ?left, "renewing the Lease failed; still leading until the renew deadline");
                } else if self.failures == 1 {
                    warn!(identity = %self.identity, error = %e, "reading or acquiring the Lease failed; retrying");
                } else {
                    debug!(identity = %self.identity, error = %e, failed = self.failures, "the Lease still fails");
                }
            }
        }
    }
}

impl<S: Sink> Drop for Out<S> {
    fn drop(&mut self) {
        self.set(false);
    }
}
