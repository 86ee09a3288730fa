//! Coalescing: keys whose state changed, collected until a writer takes them all at once,
//! so that a burst of changes to one object costs one write per window, not one per
//! change. Used by every status writer.

use std::collections::HashSet;
use std::hash::Hash;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub struct Pending<K> {
    keys: Mutex<HashSet<K>>,
    wake: Notify,
}

impl<K> Default for Pending<K> {
    fn default() -> Self {
        Self {
            keys: Mutex::new(HashSet::new()),
            wake: Notify::new(),
        }
    }
}

impl<K: Hash + Eq> Pending<K> {
    pub fn mark(&self, key: K) {
        self.keys.lock().insert(key);
        self.wake.notify_one();
    }

    /// Marks every key given and wakes the taker, unless none was given: an empty call
    /// must not leave a wake-up behind (the taker would take nothing). A key already
    /// marked still wakes it: a take cancelled in its window (leadership lost) leaves
    /// its keys marked and no wake-up, and the next leader marks them again.
    pub fn mark_all(&self, keys: impl IntoIterator<Item = K>) {
        let mut keys = keys.into_iter().peekable();
        if keys.peek().is_none() {
            return;
        }
        self.keys.lock().extend(keys);
        self.wake.notify_one();
    }

    pub fn forget(&self, key: &K) {
        self.keys.lock().remove(key);
    }

    /// Waits until a key is marked (or `tick` passes, if given), lets `window` pass so
    /// that more changes join, and takes every marked key. `None` once `shutdown` fires.
    pub async fn take(
        &self,
        window: Duration,
        tick: Option<Duration>,
        shutdown: &CancellationToken,
    ) -> Option<Vec<K>> {
        let tick = async {
            match tick {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = self.wake.notified() => {}
            _ = tick => {}
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(window) => {}
        }
        Some(self.keys.lock().drain().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_burst_is_taken_once_after_the_window() {
        let p = Pending::default();
        let stop = CancellationToken::new();
        for k in ["a", "b", "a", "a"] {
            p.mark(k);
        }
        let started = tokio::time::Instant::now();
        let mut keys = p
            .take(Duration::from_millis(200), None, &stop)
            .await
            .unwrap();
        keys.sort();
        assert_eq!(keys, ["a", "b"]);
        assert_eq!(started.elapsed(), Duration::from_millis(200));
        p.mark_all(["c"]);
        p.forget(&"c");
        assert_eq!(
            p.take(Duration::ZERO, Some(Duration::from_secs(1)), &stop)
                .await,
            Some(vec![]),
            "a tick with nothing marked"
        );
        stop.cancel();
        assert_eq!(p.take(Duration::ZERO, None, &stop).await, None);
    }

    #[tokio::test(start_paused = true)]
    async fn marking_nothing_wakes_nobody() {
        let p = Pending::<&str>::default();
        let stop = CancellationToken::new();
        p.mark_all([]);
        let started = tokio::time::Instant::now();
        let (window, tick) = (Duration::from_secs(1), Duration::from_secs(300));
        assert_eq!(p.take(window, Some(tick), &stop).await, Some(vec![]));
        assert_eq!(started.elapsed(), tick + window, "woken before the tick");
    }

    #[tokio::test(start_paused = true)]
    async fn keys_left_by_a_cancelled_take_wake_the_next_when_marked_again() {
        let p = Pending::default();
        let stop = CancellationToken::new();
        let (window, tick) = (Duration::from_secs(1), Duration::from_secs(300));
        p.mark("a");
        let cancelled = tokio::time::timeout(window / 2, p.take(window, None, &stop)).await;
        assert!(cancelled.is_err(), "the take was cancelled in its window");
        p.mark_all(["a"]);
        let started = tokio::time::Instant::now();
        assert_eq!(p.take(window, Some(tick), &stop).await, Some(vec!["a"]));
        assert_eq!(started.elapsed(), window, "left waiting for the tick");
    }
}
