//! Queue: the hub's requests of one session, by MyApp, carried out up to `limit` at once.
//!
//! - Only the latest wish counts: a newer request for a MyApp replaces the one still
//!   waiting, and the failure of an older one.
//! - A MyApp's requests run one at a time, in the order they came: never out of order.
//! - A request that fails is tried again with backoff (1 s doubling to 5 min) until it
//!   succeeds or a newer request for its MyApp replaces it (safety rule 5); a request the
//!   agent refuses (a bad manifest) is not, since the same bytes cannot do better.
//! - A failure that a newer request superseded while it ran is dropped, never retried:
//!   retried after the newer request, it would undo it (a failed Delete retried after the
//!   Apply of a MyApp created again would delete it).
//! - Retries come due on a timer (`DelayQueue`); nothing polls.

use std::collections::{HashMap, VecDeque};
use std::future::{pending, poll_fn};
use std::hash::Hash;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use tokio_util::time::{DelayQueue, delay_queue};

/// How one try of a request failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failed {
    pub error: String,
    /// False when trying the same request again cannot help (a refused manifest).
    pub retry: bool,
}

/// 1 s doubling to 5 min: a missing namespace or a webhook that is down heals by itself,
/// and the retries must not hammer the apiserver meanwhile.
pub fn retry_backoff() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_secs(1))
        .with_max_delay(Duration::from_secs(300))
        .without_max_times()
}

/// The last failure of a MyApp's latest request, kept for its report and its retry.
struct Failure<R> {
    request: R,
    error: String,
    backoff: ExponentialBackoff,
    /// The retry on the timer; None while the retry waits or runs, or when retrying
    /// cannot help.
    timer: Option<delay_queue::Key>,
}

pub struct KeyedQueue<K, R> {
    waiting: HashMap<K, R>,
    /// Waiting keys in arrival order.
    order: VecDeque<K>,
    /// The request of each key in flight.
    running: HashMap<K, R>,
    failed: HashMap<K, Failure<R>>,
    timers: DelayQueue<K>,
    limit: usize,
    backoff: ExponentialBuilder,
}

impl<K, R> KeyedQueue<K, R>
where
    K: Clone + Eq + Hash,
    R: Clone,
{
    pub fn new(limit: usize, backoff: ExponentialBuilder) -> Self {
        Self {
            waiting: HashMap::new(),
            order: VecDeque::new(),
            running: HashMap::new(),
            failed: HashMap::new(),
            timers: DelayQueue::new(),
            limit: limit.max(1),
            backoff,
        }
    }

    /// A new request for `key`: it replaces the one waiting, and any failure (and retry)
    /// of an older one.
    pub fn push(&mut self, key: K, request: R) {
        if let Some(timer) = self.failed.remove(&key).and_then(|f| f.timer) {
            self.timers.remove(&timer);
        }
        self.wait(key, request);
    }

    fn wait(&mut self, key: K, request: R) {
        if self.waiting.insert(key.clone(), request).is_none() {
            self.order.push_back(key);
        }
    }

    /// Hands out the next request to carry out, if one may start now: the oldest waiting
    /// one whose key has none in flight.
    pub fn start(&mut self) -> Option<(K, R)> {
        if self.running.len() >= self.limit {
            return None;
        }
        let at = self
            .order
            .iter()
            .position(|k| !self.running.contains_key(k))?;
        let key = self.order.remove(at)?;
        let request = self.waiting.remove(&key)?;
        self.running.insert(key.clone(), request.clone());
        Some((key, request))
    }

    /// A request handed out by [`start`](Self::start) ended. Returns the error to report
    /// for `key` from now on: None when it succeeded, or when a newer request came
    /// meanwhile (the failure is then dropped: see the module's header).
    pub fn done(&mut self, key: &K, result: Result<(), Failed>) -> Option<String> {
        let request = self.running.remove(key)?;
        let superseded = self.waiting.contains_key(key);
        let failed = match result {
            Err(failed) if !superseded => failed,
            _ => {
                if let Some(timer) = self.failed.remove(key).and_then(|f| f.timer) {
                    self.timers.remove(&timer);
                }
                return None;
            }
        };
        let failure = self.failed.entry(key.clone()).or_insert_with(|| Failure {
            request,
            error: String::new(),
            backoff: self.backoff.build(),
            timer: None,
        });
        failure.error = failed.error;
        if failed.retry {
            let delay = failure.backoff.next().unwrap_or(Duration::from_secs(300));
            failure.timer = Some(self.timers.insert(key.clone(), delay));
        }
        Some(failure.error.clone())
    }

    /// Waits until a failed request is due for another try, and queues it; never
    /// resolves while none is scheduled. Cancel-safe.
    pub async fn retry_due(&mut self) {
        let Some(expired) = poll_fn(|cx| self.timers.poll_expired(cx)).await else {
            return pending().await;
        };
        let key = expired.into_inner();
        if let Some(failure) = self.failed.get_mut(&key) {
            failure.timer = None;
            let request = failure.request.clone();
            self.wait(key, request);
        }
    }

    /// The error of `key`'s last failed try, until a try succeeds or a newer request
    /// replaces it.
    pub fn error(&self, key: &K) -> Option<&str> {
        self.failed.get(key).map(|f| f.error.as_str())
    }

    /// Whether to take more requests: past a backlog the session stops reading, so that
    /// the hub's stream is held back rather than the agent's memory growing.
    pub fn has_room(&self) -> bool {
        self.waiting.len() < self.limit * 4
    }

    /// Nothing waits, runs or is scheduled for a retry.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.timers.is_empty()
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;
    use tokio::time::Instant;

    fn queue(limit: usize) -> KeyedQueue<&'static str, u32> {
        KeyedQueue::new(limit, retry_backoff())
    }

    fn fail(error: &str) -> Result<(), Failed> {
        Err(Failed {
            error: error.into(),
            retry: true,
        })
    }

    /// Queues every retry due by now (the clock is paused: advancing it fires them).
    async fn take_due(q: &mut KeyedQueue<&'static str, u32>) {
        while tokio::time::timeout(Duration::from_millis(1), q.retry_due())
            .await
            .is_ok()
        {}
    }

    /// Up to the limit at once, in arrival order, one per MyApp at a time; a newer
    /// request replaces the one waiting.
    #[tokio::test(start_paused = true)]
    async fn runs_each_key_in_order_and_only_its_latest_wish() {
        let mut q = queue(2);
        q.push("a", 1);
        q.push("b", 1);
        q.push("c", 1);
        assert_eq!(q.start(), Some(("a", 1)));
        assert_eq!(q.start(), Some(("b", 1)));
        assert_eq!(q.start(), None, "two at once");
        // While a's first runs, a 2 then a 3 come: only 3 is left to do.
        q.push("a", 2);
        q.push("a", 3);
        assert_eq!(q.done(&"b", Ok(())), None);
        assert_eq!(q.start(), Some(("c", 1)), "a waits for its first to end");
        assert_eq!(q.start(), None);
        q.done(&"a", Ok(()));
        assert_eq!(q.start(), Some(("a", 3)));
        q.done(&"a", Ok(()));
        q.done(&"c", Ok(()));
        assert!(q.is_idle());
    }

    /// A failing request is tried again after 1 s, 2 s, 4 s...; its error stays until
    /// a try succeeds.
    #[tokio::test(start_paused = true)]
    async fn failures_are_retried_with_backoff_until_they_succeed() {
        let mut q = queue(8);
        q.push("a", 1);
        for delay in [1, 2, 4, 8] {
            let (k, r) = q.start().unwrap();
            assert_eq!((k, r), ("a", 1));
            assert_eq!(q.done(&k, fail("boom")).as_deref(), Some("boom"));
            let failed_at = Instant::now();
            take_due(&mut q).await;
            assert_eq!(q.start(), None, "not due before its delay");
            tokio::time::sleep_until(failed_at + Duration::from_secs(delay)).await;
            take_due(&mut q).await;
            assert_eq!(q.error(&"a"), Some("boom"), "the error stays while retried");
        }
        let (k, _) = q.start().unwrap();
        assert_eq!(q.done(&k, Ok(())), None);
        assert_eq!(q.error(&"a"), None);
        assert!(q.is_idle());
    }

    /// The delay doubles up to 5 min and stays there.
    #[test]
    fn the_retry_delay_is_capped_at_five_minutes() {
        let delays: Vec<u64> = retry_backoff()
            .build()
            .take(12)
            .map(|d| d.as_secs())
            .collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]);
    }

    /// A refused request is reported and not retried.
    #[tokio::test(start_paused = true)]
    async fn a_refused_request_is_not_retried() {
        let mut q = queue(8);
        q.push("a", 1);
        let (k, _) = q.start().unwrap();
        let refused = Failed {
            error: "bad manifest".into(),
            retry: false,
        };
        assert_eq!(q.done(&k, Err(refused)).as_deref(), Some("bad manifest"));
        tokio::time::sleep(Duration::from_secs(3600)).await;
        take_due(&mut q).await;
        assert_eq!(q.start(), None);
        assert!(q.is_idle());
        assert_eq!(q.error(&"a"), Some("bad manifest"));
        // A new request replaces it.
        q.push("a", 2);
        assert_eq!(q.error(&"a"), None);
        assert_eq!(q.start(), Some(("a", 2)));
    }

    /// A request that fails after a newer one for the same MyApp came is not kept for a
    /// retry: retried after the newer one (a Delete after the Apply of a MyApp created
    /// again), it would undo it.
    #[tokio::test(start_paused = true)]
    async fn a_failure_a_newer_request_replaced_is_never_retried() {
        let mut q = queue(8);
        q.push("a", 1); // the Delete
        let (k, _) = q.start().unwrap();
        q.push("a", 2); // the Apply of the MyApp created again, while the Delete runs
        assert_eq!(q.done(&k, fail("timeout")), None, "nothing to report");
        assert_eq!(q.start(), Some(("a", 2)));
        assert_eq!(q.done(&"a", Ok(())), None);
        tokio::time::sleep(Duration::from_secs(3600)).await;
        take_due(&mut q).await;
        assert_eq!(q.start(), None, "the failed Delete would be retried");
        assert!(q.is_idle());
    }

    /// A newer request cancels a scheduled retry, and its own backoff starts afresh.
    #[tokio::test(start_paused = true)]
    async fn a_newer_request_replaces_a_scheduled_retry() {
        let mut q = queue(8);
        q.push("a", 1);
        for _ in 0..3 {
            let (k, _) = q.start().unwrap();
            q.done(&k, fail("boom"));
            tokio::time::sleep(Duration::from_secs(10)).await;
            take_due(&mut q).await;
        }
        let (k, _) = q.start().unwrap();
        q.done(&k, fail("boom"));
        q.push("a", 2);
        assert!(q.error(&"a").is_none());
        let (k, r) = q.start().unwrap();
        assert_eq!(r, 2);
        q.done(&k, fail("again"));
        let failed_at = Instant::now();
        tokio::time::sleep(Duration::from_secs(1)).await;
        take_due(&mut q).await;
        assert_eq!(q.start(), Some(("a", 2)), "retried after 1 s, not 16 s");
        assert!(failed_at.elapsed() < Duration::from_secs(2));
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// A new request for key `0..KEYS`.
        Push(u8),
        /// The in-flight request at this index (modulo their number) ends so.
        Finish(usize, Ending),
        /// Time passes.
        Wait(u16),
    }

    #[derive(Clone, Copy, Debug)]
    enum Ending {
        Ok,
        Fail,
        Refuse,
    }

    const KEYS: u8 = 4;

    fn op() -> impl Strategy<Value = Op> {
        let ending = prop_oneof![Just(Ending::Ok), Just(Ending::Fail), Just(Ending::Refuse)];
        prop_oneof![
            3 => (0..KEYS).prop_map(Op::Push),
            3 => (any::<usize>(), ending).prop_map(|(i, e)| Op::Finish(i, e)),
            1 => (0u16..400).prop_map(Op::Wait),
        ]
    }

    /// What the test saw the queue do.
    #[derive(Default)]
    struct Model {
        /// The latest request pushed for each key (requests are numbered in push order).
        latest: HashMap<&'static str, u32>,
        in_flight: Vec<(&'static str, u32)>,
        /// Requests that failed after a newer one for their key came.
        superseded: HashSet<u32>,
        /// Requests refused, and failures' times.
        refused: HashSet<u32>,
        failed_at: HashMap<u32, Instant>,
        /// The last request of each key carried out successfully.
        delivered: HashMap<&'static str, u32>,
    }

    const NAMES: [&str; KEYS as usize] = ["a", "b", "c", "d"];

    impl Model {
        /// Starts what the queue hands out, checking each hand-out.
        fn start(&mut self, q: &mut KeyedQueue<&'static str, u32>) -> Result<(), TestCaseError> {
            while let Some((k, r)) = q.start() {
                prop_assert!(
                    !self.in_flight.iter().any(|(f, _)| *f == k),
                    "two requests of {k} in flight"
                );
                prop_assert_eq!(Some(&r), self.latest.get(k), "{} ran a stale request", k);
                prop_assert!(
                    !self.superseded.contains(&r),
                    "superseded failure {r} retried"
                );
                prop_assert!(!self.refused.contains(&r), "refused request {r} retried");
                if let Some(at) = self.failed_at.get(&r) {
                    prop_assert!(at.elapsed() >= Duration::from_secs(1), "retried at once");
                }
                self.in_flight.push((k, r));
                prop_assert!(self.in_flight.len() <= q.limit());
            }
            Ok(())
        }

        fn finish(&mut self, q: &mut KeyedQueue<&'static str, u32>, at: usize, ending: Ending) {
            if self.in_flight.is_empty() {
                return;
            }
            let (k, r) = self.in_flight.remove(at % self.in_flight.len());
            let newer = self.latest[k] != r;
            let result = match ending {
                Ending::Ok => {
                    self.delivered.insert(k, r);
                    Ok(())
                }
                Ending::Fail | Ending::Refuse => {
                    if newer {
                        self.superseded.insert(r);
                    } else if matches!(ending, Ending::Refuse) {
                        self.refused.insert(r);
                    }
                    self.failed_at.insert(r, Instant::now());
                    Err(Failed {
                        error: format!("try of {r} failed"),
                        retry: matches!(ending, Ending::Fail),
                    })
                }
            };
            q.done(&k, result);
        }
    }

    fn run_ops(limit: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut q = queue(limit);
            let mut m = Model::default();
            for (n, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Push(k) => {
                        let k = NAMES[k as usize];
                        m.latest.insert(k, n as u32);
                        q.push(k, n as u32);
                    }
                    Op::Finish(at, ending) => m.finish(&mut q, at, ending),
                    Op::Wait(secs) => {
                        tokio::time::sleep(Duration::from_secs(secs.into())).await;
                        take_due(&mut q).await;
                    }
                }
                m.start(&mut q)?;
            }
            // From now on every try succeeds: every latest request is carried out, but
            // those refused.
            for _ in 0..100 {
                while !m.in_flight.is_empty() {
                    m.finish(&mut q, 0, Ending::Ok);
                }
                tokio::time::sleep(Duration::from_secs(301)).await;
                take_due(&mut q).await;
                m.start(&mut q)?;
                if q.is_idle() && m.in_flight.is_empty() {
                    break;
                }
            }
            prop_assert!(q.is_idle(), "work left after every try succeeded");
            for (k, latest) in &m.latest {
                if !m.refused.contains(latest) {
                    prop_assert_eq!(
                        m.delivered.get(k),
                        Some(latest),
                        "{} never got its latest",
                        k
                    );
                }
            }
            Ok(())
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Whatever the order of requests, endings and time: never two requests of one
        /// key at once, never more than the limit, every hand-out is the key's latest
        /// request (so each key's order is kept and a superseded failure is never
        /// retried), and once tries succeed every latest request is carried out.
        #[test]
        fn the_queue_keeps_order_and_delivers_every_latest_wish(
            limit in 1usize..4,
            ops in proptest::collection::vec(op(), 0..120),
        ) {
            run_ops(limit, ops)?;
        }
    }
}
