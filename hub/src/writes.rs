//! Writes to the host: what the two status writers (FederatedMyApp and MemberCluster)
//! share, so that host writes grow with real changes and never with load.
//!
//! - A status is written as a JSON merge patch of what changed against the object as the
//!   hub's cache holds it ([`merge_patch`]: a field that is gone becomes `null`, so no
//!   list is nulled by hand), with that object's `resourceVersion` as precondition: a
//!   stale cache gets a conflict, never a lost field. While the cache has not yet shown
//!   this hub's own last write, nothing is computed against it ([`Written`]).
//! - The answer is classified ([`Failure`]): a status the apiserver rejects (invalid,
//!   too large) is reported once and not sent again until it changes; conflicts, 429,
//!   5xx and transport errors are retried with backoff ([`Retries`]).
//! - Writes pass a token bucket ([`Budget`]), and the coalescing window widens with the
//!   backlog ([`window`]), so that a burst becomes fewer, later writes rather than a
//!   storm.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;

use kube::api::{Patch, PatchParams};
use kube::core::Request;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use serde_json::{Map, Value};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A JSON patch (RFC 6902) from its operations written as JSON: the hub's conditional
/// writes (a `test` first), which a merge patch cannot express.
pub fn json_patch(ops: Value) -> json_patch::Patch {
    serde_json::from_value(ops).expect("JSON patch operations written by the hub")
}

/// The field manager of every status the hub writes.
pub const FIELD_MANAGER: &str = "flotilla-hub";

/// The JSON merge patch (RFC 7386) that turns `old` into `new`; `None` when they are
/// equal. Objects are compared field by field, so only what changed is sent; a field of
/// `old` missing from `new` becomes `null` (removed); anything else is replaced whole.
pub fn merge_patch(old: &Value, new: &Value) -> Option<Value> {
    match (old, new) {
        (Value::Object(old), Value::Object(new)) => {
            let mut patch = Map::new();
            for (key, value) in new {
                let changed = match old.get(key) {
                    Some(before) => merge_patch(before, value),
                    None => Some(value.clone()),
                };
                if let Some(change) = changed {
                    patch.insert(key.clone(), change);
                }
            }
            for key in old.keys().filter(|k| !new.contains_key(*k)) {
                patch.insert(key.clone(), Value::Null);
            }
            (!patch.is_empty()).then_some(Value::Object(patch))
        }
        _ => (old != new).then(|| new.clone()),
    }
}

/// The patch of `status` from `old` to `new`, guarded by `resource_version`.
pub fn status_patch(old: &Value, new: &Value, resource_version: &str) -> Option<Value> {
    let status = merge_patch(old, new)?;
    Some(serde_json::json!({
        "metadata": {"resourceVersion": resource_version},
        "status": status,
    }))
}

/// What comes back from a status patch: only the new resourceVersion is read.
#[derive(Deserialize)]
struct Returned {
    metadata: WrittenMeta,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WrittenMeta {
    resource_version: Option<String>,
}

/// What sending a patch gives: the new resourceVersion and the bytes sent.
pub type Answer = Result<(String, usize), kube::Error>;

/// Sends a status patch to `resource_url` (an `Api`'s) for object `name`; returns the new
/// resourceVersion and the bytes sent. The object that comes back is not decoded.
pub async fn send(client: &kube::Client, resource_url: &str, name: &str, patch: &Value) -> Answer {
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    };
    let mut req = Request::new(resource_url)
        .patch_subresource("status", name, &params, &Patch::Merge(patch))
        .map_err(kube::Error::BuildRequest)?;
    req.extensions_mut().insert("patch_subresource");
    let bytes = req.body().len();
    let answer: Returned = client.request(req).await?;
    Ok((answer.metadata.resource_version.unwrap_or_default(), bytes))
}

/// Why a write did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The object is gone: nothing to write.
    Gone,
    /// Our copy was stale (resourceVersion precondition): retried once the cache moves.
    Conflict,
    /// The apiserver refuses this status (invalid, too large): sending it again cannot
    /// help; reported once, retried only when the status changes.
    Rejected(String),
    /// Overload, a server error, a broken connection: retried with backoff.
    Transient(String),
}

impl Failure {
    pub fn of(e: &kube::Error) -> Failure {
        match e {
            kube::Error::Api(s) => match s.code {
                404 => Failure::Gone,
                409 => Failure::Conflict,
                400 | 413 | 422 => Failure::Rejected(s.message.clone()),
                // etcd's own size limit comes back as a server error.
                _ if s.message.contains("request is too large") => {
                    Failure::Rejected(s.message.clone())
                }
                _ => Failure::Transient(format!("{} ({})", s.message, s.code)),
            },
            other => Failure::Transient(other.to_string()),
        }
    }

    /// The `result` label of the writes metric.
    pub fn label(&self) -> &'static str {
        match self {
            Failure::Gone => "gone",
            Failure::Conflict => "conflict",
            Failure::Rejected(_) => "rejected",
            Failure::Transient(_) => "error",
        }
    }
}

/// First retry after a failed write; it doubles up to [`RETRY_MAX`].
pub const RETRY_FIRST: Duration = Duration::from_millis(500);
pub const RETRY_MAX: Duration = Duration::from_secs(60);
/// How soon a key whose cached object lags this hub's own write is looked at again.
pub const STALE_RECHECK: Duration = Duration::from_millis(100);

/// Keys to look at again later: after a failure (with backoff) or a stale cache.
#[derive(Debug)]
struct Retries<K> {
    due: HashMap<K, (u32, Instant)>,
}

impl<K> Default for Retries<K> {
    fn default() -> Self {
        Self {
            due: HashMap::new(),
        }
    }
}

impl<K: Hash + Eq + Clone> Retries<K> {
    /// A write of `key` failed: returns when it is tried again (backoff doubles).
    fn failed(&mut self, key: K, now: Instant) -> Duration {
        let attempts = self.due.get(&key).map_or(0, |(n, _)| *n);
        let delay = RETRY_FIRST
            .saturating_mul(1 << attempts.min(16))
            .min(RETRY_MAX);
        self.due.insert(key, (attempts + 1, now + delay));
        delay
    }

    /// Look at `key` again after `delay`, keeping its backoff.
    fn later(&mut self, key: K, now: Instant, delay: Duration) {
        let attempts = self.due.get(&key).map_or(0, |(n, _)| *n);
        self.due.insert(key, (attempts, now + delay));
    }

    fn succeeded(&mut self, key: &K) {
        self.due.remove(key);
    }

    /// Whether `key` waits for a later time (not yet due).
    fn waiting(&self, key: &K, now: Instant) -> bool {
        self.due.get(key).is_some_and(|(_, at)| *at > now)
    }

    /// The keys whose time has come (they stay recorded until they succeed).
    fn due(&self, now: Instant) -> Vec<K> {
        let due = self.due.iter().filter(|(_, (_, at))| *at <= now);
        due.map(|(k, _)| k.clone()).collect()
    }

    /// When the next key is due.
    fn next(&self, now: Instant) -> Option<Duration> {
        let earliest = self.due.values().map(|(_, at)| *at).min()?;
        Some(earliest.saturating_duration_since(now))
    }

    fn forget(&mut self, key: &K) {
        self.due.remove(key);
    }
}

/// The resourceVersions around this hub's latest write of each key (before, after), kept
/// until the cache shows something else than the "before": until then the cache is stale
/// and nothing is computed against it.
#[derive(Debug)]
struct Written<K> {
    last: HashMap<K, (String, String)>,
}

impl<K> Default for Written<K> {
    fn default() -> Self {
        Self {
            last: HashMap::new(),
        }
    }
}

impl<K: Hash + Eq> Written<K> {
    fn record(&mut self, key: K, before: String, after: String) {
        if !after.is_empty() {
            self.last.insert(key, (before, after));
        }
    }

    /// Whether the cached object (at `cached`) predates this hub's last write of `key`.
    fn stale(&mut self, key: &K, cached: &str) -> bool {
        match self.last.get(key) {
            Some((before, _)) if before == cached => true,
            Some(_) => {
                self.last.remove(key);
                false
            }
            None => false,
        }
    }

    fn forget(&mut self, key: &K) {
        self.last.remove(key);
    }
}

/// One patch to send: computed against the cached object at `version`, the status it
/// carries known by its digest.
#[derive(Debug)]
pub struct Write<K> {
    pub key: K,
    pub patch: Value,
    pub version: String,
    pub digest: u64,
}

/// The digest of a status, to know a rejected one when it comes again.
pub fn digest(status: &Value) -> u64 {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    status.to_string().hash(&mut h);
    h.finish()
}

/// A writer's memory of its keys while its hub leads: backoff, its own last writes, the
/// statuses rejected.
#[derive(Debug)]
pub struct Tracker<K> {
    retries: Retries<K>,
    written: Written<K>,
    rejected: HashMap<K, u64>,
}

impl<K> Default for Tracker<K> {
    fn default() -> Self {
        Self {
            retries: Retries::default(),
            written: Written::default(),
            rejected: HashMap::new(),
        }
    }
}

impl<K: Hash + Eq + Clone> Tracker<K> {
    /// Whether `key` may be written now against a cache at `version`: not backing off,
    /// and the cache has seen this hub's last write (else it is looked at again soon).
    pub fn may_write(&mut self, key: &K, version: &str, now: Instant) -> bool {
        if self.retries.waiting(key, now) {
            return false;
        }
        if self.written.stale(key, version) {
            self.retries.later(key.clone(), now, STALE_RECHECK);
            return false;
        }
        true
    }

    /// `key` shows what it should: nothing to retry.
    pub fn unchanged(&mut self, key: &K) {
        self.retries.succeeded(key);
    }

    /// The patch for `key` from `old` to `new` at `version`, unless there is nothing to
    /// send (no change, or the status the apiserver rejected last).
    pub fn patch(&mut self, key: &K, old: &Value, new: &Value, version: &str) -> Option<Write<K>> {
        let Some(patch) = status_patch(old, new, version) else {
            self.retries.succeeded(key);
            return None;
        };
        let digest = digest(new);
        (self.rejected.get(key) != Some(&digest)).then(|| Write {
            key: key.clone(),
            patch,
            version: version.to_owned(),
            digest,
        })
    }

    /// Takes in the answer to `write`: the bytes sent when written, else what failed and,
    /// for a retry, when.
    pub fn settle(
        &mut self,
        write: Write<K>,
        answer: Answer,
        now: Instant,
    ) -> Result<usize, (Failure, Option<Duration>)> {
        let key = write.key;
        let failure = match answer {
            Ok((version, bytes)) => {
                self.retries.succeeded(&key);
                self.rejected.remove(&key);
                self.written.record(key, write.version, version);
                return Ok(bytes);
            }
            Err(e) => Failure::of(&e),
        };
        let retry = match &failure {
            Failure::Gone => {
                self.forget(&key);
                None
            }
            Failure::Conflict | Failure::Transient(_) => Some(self.retries.failed(key, now)),
            Failure::Rejected(_) => {
                self.retries.forget(&key);
                self.rejected.insert(key, write.digest);
                None
            }
        };
        Err((failure, retry))
    }

    /// Try `key` again later, with the backoff of a failed write: returns when.
    pub fn back_off(&mut self, key: &K, now: Instant) -> Duration {
        self.retries.failed(key.clone(), now)
    }

    /// The keys whose retry is due, and how long until the next one.
    pub fn due(&self, now: Instant) -> Vec<K> {
        self.retries.due(now)
    }

    pub fn next(&self, now: Instant) -> Option<Duration> {
        self.retries.next(now)
    }

    pub fn forget(&mut self, key: &K) {
        self.retries.forget(key);
        self.written.forget(key);
        self.rejected.remove(key);
    }
}

/// A token bucket: `rate` writes a second on average, `burst` at once.
#[derive(Debug)]
pub struct Budget {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Budget {
    pub fn new(rate: f64, burst: u32, now: Instant) -> Self {
        let burst = f64::from(burst.max(1));
        Self {
            rate: rate.max(0.001),
            burst,
            tokens: burst,
            last: now,
        }
    }

    /// Takes one write if the bucket holds one now; never runs into debt (what is
    /// refused waits for a later look).
    pub fn try_take(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.last = now;
        let taken = self.tokens >= 1.0;
        if taken {
            self.tokens -= 1.0;
        }
        taken
    }

    /// Reserves one write: how long to wait before making it (a write beyond the
    /// bucket is a debt paid by waiting).
    pub fn reserve(&mut self, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.last = now;
        self.tokens -= 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate)
        }
    }
}

/// The longest a change waits to be coalesced with others.
pub const WINDOW_MAX: Duration = Duration::from_secs(5);
/// How much each write of the last round widens the window.
const WINDOW_PER_WRITE: Duration = Duration::from_millis(5);

/// The coalescing window after a round of `backlog` writes: `base` when quiet, wider
/// with the backlog (1,000 writes: 5 s), never past [`WINDOW_MAX`].
pub fn window(base: Duration, backlog: usize) -> Duration {
    let widened = WINDOW_PER_WRITE.saturating_mul(u32::try_from(backlog).unwrap_or(u32::MAX));
    base.saturating_add(widened).min(WINDOW_MAX.max(base))
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WriteLabels {
    kind: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

/// The writers' figures: writes by kind and result, bytes sent, the last round's backlog.
#[derive(Clone, Default)]
pub struct WriteMetrics {
    writes: Family<WriteLabels, Counter>,
    bytes: Family<KindLabels, Counter>,
    backlog: Family<KindLabels, Gauge>,
}

impl WriteMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "flotilla_hub_status_writes",
            "Status writes to the host, by kind (federatedmyapp, membercluster) and result (written, conflict, rejected, error, gone)",
            self.writes.clone(),
        );
        registry.register(
            "flotilla_hub_status_write_bytes",
            "Bytes of the status patches sent to the host, by kind",
            self.bytes.clone(),
        );
        registry.register(
            "flotilla_hub_status_backlog",
            "Status writes in the writer's last round, by kind",
            self.backlog.clone(),
        );
    }

    pub fn result(&self, kind: &'static str, result: &'static str) {
        let labels = WriteLabels { kind, result };
        self.writes.get_or_create(&labels).inc();
    }

    pub fn written(&self, kind: &'static str, bytes: usize) {
        self.result(kind, "written");
        let labels = KindLabels { kind };
        self.bytes.get_or_create(&labels).inc_by(bytes as u64);
    }

    pub fn backlog(&self, kind: &'static str, writes: usize) {
        let labels = KindLabels { kind };
        self.backlog.get_or_create(&labels).set(writes as i64);
    }
}

/// Runs `work` whenever this hub leads, until `shutdown` (or `work` returns, with what it
/// returns). Losing the lead drops the work in flight and calls `on_lost`; the next lead
/// calls `work` afresh. What every writer of the host does only as the leader.
pub async fn while_leading<F, W>(
    mut leading: watch::Receiver<bool>,
    shutdown: &CancellationToken,
    mut work: W,
    mut on_lost: impl FnMut(),
) -> anyhow::Result<()>
where
    W: FnMut() -> F,
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            led = leading.wait_for(|l| *l) => { led?; }
        }
        let mut lost = leading.clone();
        let lost = async move {
            let _ = lost.wait_for(|l| !*l).await;
        };
        tokio::select! {
            _ = lost => on_lost(),
            r = work() => return r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_merge_patch_carries_only_what_changed_and_nulls_what_is_gone() {
        let old = json!({"a": 1, "b": {"x": 1, "y": 2}, "list": [1, 2], "gone": "z"});
        let new = json!({"a": 1, "b": {"x": 1, "y": 3}, "list": [1], "added": true});
        let patch = merge_patch(&old, &new).unwrap();
        assert_eq!(
            patch,
            json!({"b": {"y": 3}, "list": [1], "added": true, "gone": null})
        );
        let mut applied = old.clone();
        json_patch::merge(&mut applied, &patch);
        assert_eq!(applied, new, "applying the patch gives the new object");
        assert_eq!(merge_patch(&new, &new), None);
        assert_eq!(
            merge_patch(&json!(1), &json!({"a": 1})),
            Some(json!({"a": 1}))
        );
    }

    #[test]
    fn a_status_patch_is_guarded_by_the_cached_version() {
        let p = status_patch(&json!({}), &json!({"n": 1}), "42").unwrap();
        assert_eq!(
            p,
            json!({"metadata": {"resourceVersion": "42"}, "status": {"n": 1}})
        );
        assert_eq!(status_patch(&json!({"n": 1}), &json!({"n": 1}), "42"), None);
    }

    fn api_error(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, "")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn answers_are_classified() {
        assert_eq!(Failure::of(&api_error(404, "")), Failure::Gone);
        assert_eq!(Failure::of(&api_error(409, "")), Failure::Conflict);
        assert!(matches!(Failure::of(&api_error(422, "bad")), Failure::Rejected(m) if m == "bad"));
        assert!(matches!(
            Failure::of(&api_error(413, "")),
            Failure::Rejected(_)
        ));
        assert!(matches!(
            Failure::of(&api_error(500, "etcdserver: request is too large")),
            Failure::Rejected(_)
        ));
        assert!(matches!(
            Failure::of(&api_error(429, "")),
            Failure::Transient(_)
        ));
        assert!(matches!(
            Failure::of(&api_error(503, "")),
            Failure::Transient(_)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_and_stay_until_they_succeed() {
        let mut r = Retries::default();
        let t = Instant::now();
        assert_eq!(r.failed("a", t), RETRY_FIRST);
        assert_eq!(r.failed("a", t), RETRY_FIRST * 2);
        assert!(r.waiting(&"a", t));
        assert!(r.due(t).is_empty());
        assert_eq!(r.next(t), Some(RETRY_FIRST * 2));
        assert_eq!(r.due(t + RETRY_FIRST * 2), ["a"]);
        for _ in 0..20 {
            r.failed("a", t);
        }
        assert_eq!(r.next(t), Some(RETRY_MAX), "capped");
        r.later("b", t, STALE_RECHECK);
        assert_eq!(r.next(t), Some(STALE_RECHECK));
        r.succeeded(&"a");
        r.forget(&"b");
        assert_eq!(r.next(t), None);
    }

    #[test]
    fn a_cache_that_has_not_seen_our_write_is_stale() {
        let mut w = Written::default();
        w.record("a", "1".into(), "2".into());
        assert!(w.stale(&"a", "1"));
        assert!(!w.stale(&"a", "2"), "caught up");
        assert!(!w.stale(&"a", "1"), "forgotten once caught up");
        w.record("b", "1".into(), String::new());
        assert!(
            !w.stale(&"b", "1"),
            "no version came back: nothing to wait for"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_tracker_settles_each_answer() {
        let t = Instant::now();
        let mut tr = Tracker::default();
        let (old, new) = (json!({"n": 1}), json!({"n": 2}));
        assert!(tr.patch(&"a", &old, &old, "1").is_none(), "nothing changed");
        let write = tr.patch(&"a", &old, &new, "1").unwrap();
        let digest = write.digest;
        assert_eq!(tr.settle(write, Ok(("2".into(), 40)), t), Ok(40));
        assert!(
            !tr.may_write(&"a", "1", t),
            "the cache has not seen our write"
        );
        assert!(tr.may_write(&"a", "2", t + STALE_RECHECK));
        let write = tr.patch(&"a", &old, &new, "2").unwrap();
        let answer = tr.settle(write, Err(api_error(503, "busy")), t);
        assert!(matches!(answer, Err((Failure::Transient(_), Some(d))) if d == RETRY_FIRST));
        assert!(!tr.may_write(&"a", "2", t), "backing off");
        assert_eq!(tr.due(t + RETRY_FIRST), ["a"]);
        let write = tr.patch(&"a", &old, &new, "2").unwrap();
        let answer = tr.settle(write, Err(api_error(422, "invalid")), t);
        assert!(matches!(answer, Err((Failure::Rejected(_), None))));
        assert!(tr.patch(&"a", &old, &new, "2").is_none(), "not sent again");
        assert_eq!(digest, super::digest(&new));
        assert!(
            tr.patch(&"a", &old, &json!({"n": 3}), "2").is_some(),
            "a new status is"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_budget_lets_a_burst_through_then_paces() {
        let t = Instant::now();
        let mut b = Budget::new(10.0, 3, t);
        let waits: Vec<Duration> = (0..5).map(|_| b.reserve(t)).collect();
        assert_eq!(waits[..3], [Duration::ZERO; 3]);
        assert_eq!(waits[3], Duration::from_millis(100));
        assert_eq!(waits[4], Duration::from_millis(200));
        // A second later the debt is paid and the bucket holds 8 of 3 tokens, capped.
        let later = t + Duration::from_secs(1);
        assert_eq!(b.reserve(later), Duration::ZERO);
        assert_eq!(b.reserve(later), Duration::ZERO);
        assert_eq!(b.reserve(later), Duration::ZERO);
        assert_eq!(b.reserve(later), Duration::from_millis(100));
    }

    #[test]
    fn the_window_widens_with_the_backlog() {
        let base = Duration::from_millis(200);
        assert_eq!(window(base, 0), base);
        assert_eq!(window(base, 100), Duration::from_millis(700));
        assert_eq!(window(base, 1000), WINDOW_MAX);
        assert_eq!(window(Duration::from_secs(9), 0), Duration::from_secs(9));
    }

    /// The work runs only while leading: losing the lead drops it and calls `on_lost`,
    /// the next lead starts it afresh, shutdown ends the loop while waiting to lead.
    #[tokio::test(start_paused = true)]
    async fn work_runs_only_while_leading() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let (lead, leading) = watch::channel(false);
        let shutdown = CancellationToken::new();
        let (started, lost) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let work = || {
            started.fetch_add(1, SeqCst);
            std::future::pending::<anyhow::Result<()>>()
        };
        let run = while_leading(leading, &shutdown, work, || {
            lost.fetch_add(1, SeqCst);
        });
        let script = async {
            let settle = || tokio::time::sleep(Duration::from_millis(10));
            settle().await;
            assert_eq!(started.load(SeqCst), 0, "started while following");
            lead.send(true).unwrap();
            settle().await;
            assert_eq!((started.load(SeqCst), lost.load(SeqCst)), (1, 0));
            lead.send(false).unwrap();
            settle().await;
            assert_eq!((started.load(SeqCst), lost.load(SeqCst)), (1, 1));
            lead.send(true).unwrap();
            settle().await;
            assert_eq!((started.load(SeqCst), lost.load(SeqCst)), (2, 1));
            lead.send(false).unwrap();
            settle().await;
            shutdown.cancel();
        };
        let (result, ()) = tokio::join!(run, script);
        assert!(result.is_ok());
        assert_eq!((started.load(SeqCst), lost.load(SeqCst)), (2, 2));
    }
}
