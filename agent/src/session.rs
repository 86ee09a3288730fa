//! Session: the agent's stream with the hub.
//!
//! Dials out (the hub never needs credentials for this cluster), says Hello with the hash
//! of every MyApp it manages as the apiserver lists them, carries Apply/Delete/SyncComplete
//! into `sync`, retries what failed with backoff, and reports status changes and
//! heartbeats back. On any failure it dials again with jittered exponential backoff,
//! reading the token file anew each time so a rotated token needs no restart; what it
//! applied keeps running meanwhile (nothing is deleted on disconnect).
//!
//! After SyncComplete it collects only MyApps that this session's Hello listed, and only
//! when they are at most `max_collect_share` of them: a larger collection is held until a
//! user confirms it on the hub (the circuit breaker).

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use flotilla_common::listed::{self, Listed};

use crate::capacity;
use flotilla_crds::{MANAGED_BY_LABEL, MANAGED_BY_VALUE, MyApp};
use flotilla_proto::WireKey;
use flotilla_proto::client::{self, Dial, DialError};
use flotilla_proto::v1::{self as pb, agent_message, hub_message};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client, ResourceExt};
use parking_lot::Mutex;
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::report::status_report;
use crate::sync::{Key, Sync, SyncError, applied_hash, key_of};

#[derive(Clone)]
pub struct SessionConfig {
    /// `https://host:port` of the hub's gRPC endpoint.
    pub hub: String,
    pub cluster: String,
    /// Holds `<cluster>.<secret>` from `flotilla-hub join`; read before every dial.
    pub token_file: PathBuf,
    /// PEM of the CA that signed the hub's certificate.
    pub ca_pem: Vec<u8>,
    /// The name to verify the hub's certificate against, if not the URL's host.
    pub server_name: Option<String>,
    pub heartbeat: Duration,
    /// The largest share (0–1) of the MyApps listed in Hello that one SyncComplete may
    /// collect without a confirmation.
    pub max_collect_share: f64,
    /// Capacity goes to the hub at most this often, and only when it changed; None: never.
    pub capacity_interval: Option<Duration>,
    /// The hub's requests carried out at once (each MyApp's one at a time, in order).
    pub concurrency: usize,
}

/// The MyApps this agent manages, cached, with a feed of the keys that changed.
#[derive(Clone)]
pub struct Managed {
    pub store: Store<MyApp>,
    pub listed: Listed,
    pub changes: broadcast::Sender<Key>,
}

/// Watches managed MyApps in every namespace; the future runs the watch.
pub fn watch_managed(client: Client) -> (Managed, impl std::future::Future<Output = ()>) {
    let (store, writer) = reflector::store::<MyApp>();
    let (changes, _) = broadcast::channel(1024);
    let config =
        watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"));
    let (stream, listed) = listed::track(
        crate::sync::reflect(writer, watcher(Api::<MyApp>::all(client), config)).default_backoff(),
    );
    let stream = stream.touched_objects();
    let feed = changes.clone();
    let run = async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(app) => {
                    let _ = feed.send(key_of(&app));
                }
                Err(e) => warn!(error = %e, "watching managed MyApps"),
            }
        }
    };
    (
        Managed {
            store,
            listed,
            changes,
        },
        run,
    )
}

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Dial(#[from] DialError),
    #[error("reading the token file {path}: {source}")]
    Token {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("listing this cluster's managed MyApps for Hello: {0}")]
    List(kube::Error),
    #[error("the stream broke: {0}")]
    Stream(tonic::Status),
}

/// Reconnect delays: 200 ms doubling to 30 s, with jitter so that agents restarted
/// together do not reconnect together.
fn reconnect_backoff() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(30))
        .with_jitter()
        .without_max_times()
}

/// Dials the hub again and again until `shutdown`.
pub async fn run(
    client: Client,
    config: SessionConfig,
    managed: Managed,
    capacity: Option<capacity::Source>,
    shutdown: CancellationToken,
) {
    let sync = Arc::new(Sync::new(client.clone(), managed.store.clone()));
    let mut backoff = reconnect_backoff().build();
    loop {
        let started = Instant::now();
        let result = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = one_session(&client, &config, &managed, capacity.as_ref(), &sync) => r,
        };
        match result {
            Ok(()) => info!("the hub ended the session"),
            Err(e) => warn!(error = %e, "session with the hub failed"),
        }
        if started.elapsed() > Duration::from_secs(30) {
            backoff = reconnect_backoff().build();
        }
        let delay = backoff.next().unwrap_or(Duration::from_secs(30));
        debug!(?delay, "reconnecting");
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// What the hub asked for a MyApp, kept while it fails so that it can be retried.
#[derive(Clone)]
enum Wanted {
    Apply { manifest: bytes::Bytes },
    Delete { orphan: bool },
}

struct Failure {
    wanted: Wanted,
    error: String,
    attempts: u32,
    /// None: retrying the same request cannot help (a manifest the agent refuses).
    due: Option<Instant>,
}

/// Failed requests of this session, by MyApp; a newer request for the same MyApp
/// replaces the failed one.
#[derive(Default)]
struct Retries(Mutex<HashMap<Key, Failure>>);

impl Retries {
    fn failed(&self, key: &Key, wanted: Wanted, error: String, retry: bool) {
        let mut map = self.0.lock();
        let attempts = map.get(key).map_or(0, |f| f.attempts) + 1;
        // 1 s doubling to 5 min: a missing namespace or a webhook that is down heals
        // by itself, and the retry must not hammer the apiserver meanwhile.
        let delay = Duration::from_secs(1u64 << attempts.min(9).saturating_sub(1))
            .min(Duration::from_secs(300));
        map.insert(
            key.clone(),
            Failure {
                wanted,
                error,
                attempts,
                due: retry.then(|| Instant::now() + delay),
            },
        );
    }

    fn clear(&self, key: &Key) {
        self.0.lock().remove(key);
    }

    fn error(&self, key: &Key) -> Option<String> {
        self.0.lock().get(key).map(|f| f.error.clone())
    }

    /// The failed requests due for another try, each handed out once: the failure (its
    /// error, its count) stays until the try succeeds or a newer request replaces it.
    fn take_due(&self) -> Vec<(Key, Wanted)> {
        let now = Instant::now();
        self.0
            .lock()
            .iter_mut()
            .filter(|(_, f)| f.due.is_some_and(|due| due <= now))
            .map(|(k, f)| {
                f.due = None;
                (k.clone(), f.wanted.clone())
            })
            .collect()
    }
}

/// The hub's requests waiting to be carried out: up to `limit` at once, never two for
/// one MyApp at once, in the order they came. A newer request for a MyApp replaces the
/// one still waiting (only the latest wish counts), so that a MyApp's requests are never
/// carried out out of order.
struct Worklist {
    waiting: HashMap<Key, Wanted>,
    /// Waiting keys in arrival order.
    order: VecDeque<Key>,
    running: HashSet<Key>,
    limit: usize,
}

impl Worklist {
    fn new(limit: usize) -> Self {
        Self {
            waiting: HashMap::new(),
            order: VecDeque::new(),
            running: HashSet::new(),
            limit: limit.max(1),
        }
    }

    /// A request from the hub.
    fn push(&mut self, key: Key, wanted: Wanted) {
        if self.waiting.insert(key.clone(), wanted).is_none() {
            self.order.push_back(key);
        }
    }

    /// A retry: never over a newer request that waits.
    fn push_retry(&mut self, key: Key, wanted: Wanted) {
        if !self.waiting.contains_key(&key) {
            self.push(key, wanted);
        }
    }

    /// The next request to start, if one may start now.
    fn next(&mut self) -> Option<(Key, Wanted)> {
        if self.running.len() >= self.limit {
            return None;
        }
        let at = self.order.iter().position(|k| !self.running.contains(k))?;
        let key = self.order.remove(at)?;
        let wanted = self.waiting.remove(&key)?;
        self.running.insert(key.clone());
        Some((key, wanted))
    }

    /// A request ended; true if a newer request for the same MyApp waits (it came while
    /// this one ran, and replaces it).
    fn done(&mut self, key: &Key) -> bool {
        self.running.remove(key);
        self.waiting.contains_key(key)
    }

    /// Whether to read more of the hub's requests: past a backlog the session stops
    /// reading, so that the hub's stream is held back rather than the agent's memory
    /// growing.
    fn has_room(&self) -> bool {
        self.waiting.len() < self.limit * 4
    }
}

/// The UID of `kube-system`: the identity of this physical cluster.
async fn cluster_uid(client: &Client) -> String {
    Api::<Namespace>::all(client.clone())
        .get_opt("kube-system")
        .await
        .ok()
        .flatten()
        .and_then(|ns| ns.uid())
        .unwrap_or_default()
}

async fn one_session(
    client: &Client,
    config: &SessionConfig,
    managed: &Managed,
    capacity: Option<&capacity::Source>,
    sync: &Sync,
) -> Result<(), SessionError> {
    let token = tokio::fs::read_to_string(&config.token_file)
        .await
        .map_err(|source| SessionError::Token {
            path: config.token_file.clone(),
            source,
        })?;
    let mut hub = client::connect(&Dial {
        hub: config.hub.clone(),
        ca_pem: config.ca_pem.clone(),
        server_name: config.server_name.clone(),
        token: token.trim().to_owned(),
        keepalive: Duration::from_secs(10),
        keepalive_timeout: Duration::from_secs(10),
    })
    .await?;
    let _ = managed.listed.wait().await;
    let kubernetes_version = client
        .apiserver_version()
        .await
        .map(|v| v.git_version)
        .unwrap_or_default();
    // Subscribed before the list in Hello, so that no change falls between them.
    let changes = managed.changes.subscribe();
    let listed = sync.list_managed().await.map_err(SessionError::List)?;
    let hello = pb::Hello {
        cluster: config.cluster.clone(),
        agent_version: env!("CARGO_PKG_VERSION").into(),
        kubernetes_version,
        managed: listed
            .iter()
            .map(|a| pb::Managed {
                key: Some(key_of(a).to_wire()),
                hash: applied_hash(a),
            })
            .collect(),
        cluster_uid: cluster_uid(client).await,
    };
    let listed: HashSet<Key> = listed.iter().map(key_of).collect();
    let (tx, mut inbound) = client::open_session(&mut hub, hello, 256).await?;
    info!(hub = %config.hub, cluster = %config.cluster, managed = listed.len(), "connected to the hub");

    let retries = Arc::new(Retries::default());
    let (touched, touched_rx) = mpsc::unbounded_channel();
    let reporter = tokio::spawn(report_loop(
        managed.store.clone(),
        changes,
        touched_rx,
        retries.clone(),
        tx.clone(),
        config.heartbeat,
        // A new limiter per session: the hub hears the current capacity first.
        capacity
            .cloned()
            .zip(config.capacity_interval.map(capacity::Limiter::new)),
    ));
    let breaker = Breaker {
        listed,
        max_share: config.max_collect_share,
    };
    let handler = Handler {
        sync,
        retries: &retries,
        touched: &touched,
    };
    let mut retry_tick = tokio::time::interval(Duration::from_secs(1));
    let mut work = Worklist::new(config.concurrency);
    let mut running = FuturesUnordered::new();
    let result = async {
        loop {
            while let Some((key, wanted)) = work.next() {
                let handler = &handler;
                running.push(async move {
                    let outcome = handler.carry_out(&key, &wanted).await;
                    (key, wanted, outcome)
                });
            }
            let message = tokio::select! {
                m = inbound.message(), if work.has_room() => m.map_err(SessionError::Stream)?,
                Some((key, wanted, outcome)) = running.next() => {
                    let superseded = work.done(&key);
                    handler.record(&key, wanted, outcome, superseded);
                    continue;
                }
                _ = retry_tick.tick() => {
                    for (key, wanted) in retries.take_due() {
                        work.push_retry(key, wanted);
                    }
                    continue;
                }
            };
            let Some(message) = message else { break };
            match message.kind {
                Some(hub_message::Kind::Apply(apply)) => {
                    let Some(key) = Key::from_wire(apply.key) else { continue };
                    retries.clear(&key);
                    work.push(key, Wanted::Apply { manifest: apply.manifest });
                }
                Some(hub_message::Kind::Delete(delete)) => {
                    let Some(key) = Key::from_wire(delete.key) else { continue };
                    retries.clear(&key);
                    work.push(key, Wanted::Delete { orphan: delete.orphan });
                }
                Some(hub_message::Kind::SyncComplete(complete)) => {
                    let desired: HashSet<Key> = complete
                        .desired
                        .into_iter()
                        .filter_map(|k| Key::from_wire(Some(k)))
                        .collect();
                    let orphans = breaker.orphans(&managed.store, &desired);
                    info!(desired = desired.len(), orphans = orphans.len(), "initial sync complete");
                    if !breaker.allows(orphans.len(), complete.confirmed_collection) {
                        warn!(
                            would_collect = orphans.len(),
                            managed = breaker.listed.len(),
                            max_share = breaker.max_share,
                            "circuit breaker: not collecting orphans; confirm on the hub with `kubectl annotate membercluster {} flotilla.io/confirm-collection={}`",
                            config.cluster,
                            orphans.len()
                        );
                        let blocked = pb::CollectionBlocked {
                            would_collect: orphans.len() as u32,
                            managed: breaker.listed.len() as u32,
                        };
                        let _ = tx.send(agent(agent_message::Kind::CollectionBlocked(blocked))).await;
                        continue;
                    }
                    for orphan in orphans {
                        info!(app = %orphan, "collecting an orphan the hub no longer wants");
                        retries.clear(&orphan);
                        work.push(orphan, Wanted::Delete { orphan: false });
                    }
                }
                None => {}
            }
        }
        Ok(())
    }
    .await;
    reporter.abort();
    result
}

/// Orphan collection: what may be collected, and how much at once.
struct Breaker {
    /// The MyApps this session's Hello listed: nothing else is ever collected.
    listed: HashSet<Key>,
    max_share: f64,
}

impl Breaker {
    fn orphans(&self, store: &Store<MyApp>, desired: &HashSet<Key>) -> Vec<Key> {
        let mut orphans: Vec<Key> = store
            .state()
            .iter()
            .map(|a| key_of(a))
            .filter(|k| self.listed.contains(k) && !desired.contains(k))
            .collect();
        orphans.sort();
        orphans
    }

    fn allows(&self, orphans: usize, confirmed: u32) -> bool {
        orphans as f64 <= self.max_share * self.listed.len() as f64 || orphans <= confirmed as usize
    }
}

struct Handler<'a> {
    sync: &'a Sync,
    retries: &'a Retries,
    /// Keys whose report must be recomputed (a failure began or ended).
    touched: &'a mpsc::UnboundedSender<Key>,
}

/// How one try of a request ended.
enum Outcome {
    Done,
    /// `retry`: false when retrying the same request cannot help (a refused manifest).
    Failed {
        error: String,
        retry: bool,
    },
}

impl Handler<'_> {
    /// Does what the hub asked, once.
    async fn carry_out(&self, key: &Key, wanted: &Wanted) -> Outcome {
        let done = match wanted {
            Wanted::Apply { manifest, .. } => self.sync.apply(key, manifest).await,
            Wanted::Delete { orphan: true } => self.sync.release(key).await,
            Wanted::Delete { orphan: false } => self.sync.delete(key).await,
        };
        match done {
            Ok(()) => {
                debug!(app = %key, "done");
                Outcome::Done
            }
            Err(e @ SyncError::BadManifest { .. }) => {
                // Retrying the same bytes cannot help: reported, not retried.
                warn!(app = %key, error = %e, "refused");
                Outcome::Failed {
                    error: e.to_string(),
                    retry: false,
                }
            }
            Err(e) => {
                warn!(app = %key, error = %e, "failed; will retry");
                Outcome::Failed {
                    error: e.to_string(),
                    retry: true,
                }
            }
        }
    }

    /// Keeps a failure for its report and its retry, until a try succeeds; but not when
    /// a newer request for the MyApp came meanwhile (`superseded`): retried after it, the
    /// old request would undo it (a failed Delete retried after the Apply of a MyApp
    /// created again would delete it).
    fn record(&self, key: &Key, wanted: Wanted, outcome: Outcome, superseded: bool) {
        match outcome {
            Outcome::Done => self.retries.clear(key),
            Outcome::Failed { .. } if superseded => {}
            Outcome::Failed { error, retry } => self.retries.failed(key, wanted, error, retry),
        }
        let _ = self.touched.send(key.clone());
    }
}

fn current(store: &Store<MyApp>, key: &Key) -> Option<Arc<MyApp>> {
    store.get(&ObjectRef::new(&key.name).within(&key.namespace))
}

fn agent(kind: agent_message::Kind) -> pb::AgentMessage {
    pb::AgentMessage { kind: Some(kind) }
}

/// Sends every managed MyApp's status once, then each change, and a heartbeat every
/// `heartbeat` (with the cluster's capacity when the limiter lets it through); a report
/// equal to the last one sent is not sent again. A report carries the error of a failing
/// request for its MyApp until that request succeeds.
async fn report_loop(
    store: Store<MyApp>,
    mut changes: broadcast::Receiver<Key>,
    mut touched: mpsc::UnboundedReceiver<Key>,
    retries: Arc<Retries>,
    tx: mpsc::Sender<pb::AgentMessage>,
    heartbeat: Duration,
    mut capacity: Option<(capacity::Source, capacity::Limiter)>,
) {
    let mut sent: HashMap<Key, pb::StatusReport> = HashMap::new();
    let mut keys: Vec<Key> = store.state().iter().map(|a| key_of(a)).collect();
    let mut tick = tokio::time::interval(heartbeat);
    let mut forced: HashSet<Key> = HashSet::new();
    loop {
        for key in keys.drain(..) {
            let mut report = status_report(&key, current(&store, &key).as_deref());
            if let Some(error) = retries.error(&key) {
                report.apply_error = error;
            }
            // The outcome of a request the hub made is always sent, even if it reads like
            // the last report: the hub may be waiting for exactly that confirmation.
            if forced.remove(&key) || sent.get(&key) != Some(&report) {
                sent.insert(key, report.clone());
                if tx
                    .send(agent(agent_message::Kind::Status(report)))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
        tokio::select! {
            _ = tick.tick() => {
                if tx.send(agent(agent_message::Kind::Heartbeat(pb::Heartbeat {}))).await.is_err() {
                    return;
                }
                let Some((source, limiter)) = capacity.as_mut() else { continue };
                let Some(now) = source.now() else { continue };
                if limiter.admit(&now, std::time::Instant::now())
                    && tx.send(agent(agent_message::Kind::Capacity(capacity::to_pb(&now)))).await.is_err()
                {
                    return;
                }
            }
            Some(key) = touched.recv() => {
                forced.insert(key.clone());
                keys.push(key);
            }
            change = changes.recv() => match change {
                Ok(key) => keys.push(key),
                // Fell behind: resend whatever differs.
                Err(broadcast::error::RecvError::Lagged(_)) => keys = store.state().iter().map(|a| key_of(a)).chain(sent.keys().cloned()).collect(),
                Err(broadcast::error::RecvError::Closed) => return,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_backoff_grows_with_jitter_and_is_capped() {
        let mut b = reconnect_backoff().build();
        let first = b.next().unwrap();
        assert!(
            first >= Duration::from_millis(200) && first <= Duration::from_millis(400),
            "{first:?}"
        );
        let later: Vec<Duration> = b.take(30).collect();
        assert_eq!(later.len(), 30, "never gives up");
        assert!(
            later.iter().all(|d| *d <= Duration::from_secs(60)),
            "{later:?}"
        );
        assert!(later.last().unwrap() >= &Duration::from_secs(30));
    }

    #[test]
    fn the_breaker_allows_a_share_or_a_confirmed_count() {
        let keys = |n: usize| (0..n).map(|i| Key::new("ns", format!("a{i}"))).collect();
        let b = Breaker {
            listed: keys(10),
            max_share: 0.5,
        };
        assert!(b.allows(0, 0));
        assert!(b.allows(5, 0));
        assert!(!b.allows(6, 0));
        assert!(b.allows(6, 6), "a user confirmed exactly this many");
        assert!(!b.allows(7, 6));
        let empty = Breaker {
            listed: keys(0),
            max_share: 0.5,
        };
        assert!(empty.allows(0, 0));
    }

    fn apply(v: &'static str) -> Wanted {
        Wanted::Apply {
            manifest: bytes::Bytes::from_static(v.as_bytes()),
        }
    }

    fn what(w: &Wanted) -> String {
        match w {
            Wanted::Apply { manifest } => String::from_utf8_lossy(manifest).into_owned(),
            Wanted::Delete { orphan } => format!("delete(orphan={orphan})"),
        }
    }

    /// Up to the limit at once, in arrival order, one per MyApp at a time; a newer
    /// request replaces the one waiting; a retry never replaces a newer request.
    #[test]
    fn the_worklist_runs_each_app_in_order_and_only_its_latest_wish() {
        let (a, b, c) = (
            Key::new("ns", "a"),
            Key::new("ns", "b"),
            Key::new("ns", "c"),
        );
        let mut w = Worklist::new(2);
        w.push(a.clone(), apply("a1"));
        w.push(b.clone(), apply("b1"));
        w.push(c.clone(), apply("c1"));
        let started: Vec<_> = std::iter::from_fn(|| w.next()).collect();
        assert_eq!(
            started
                .iter()
                .map(|(k, w)| (k.name.as_str(), what(w)))
                .collect::<Vec<_>>(),
            [("a", "a1".into()), ("b", "b1".into())],
            "two at once, in arrival order"
        );
        // While a1 runs, a2 then a delete of a come: only the delete is left to do.
        w.push(a.clone(), apply("a2"));
        w.push(a.clone(), Wanted::Delete { orphan: false });
        w.push_retry(a.clone(), apply("a1"));
        w.done(&b);
        let (k, wanted) = w.next().unwrap();
        assert_eq!(
            (k.name.as_str(), what(&wanted)),
            ("c", "c1".into()),
            "a waits for a1 to end"
        );
        assert!(w.next().is_none(), "two are running");
        w.done(&a);
        let (k, wanted) = w.next().unwrap();
        assert_eq!(
            (k.name.as_str(), what(&wanted)),
            ("a", "delete(orphan=false)".into())
        );
        w.done(&a);
        w.done(&c);
        assert!(w.next().is_none());
        // A retry is taken when nothing newer waits.
        w.push_retry(b.clone(), apply("b1"));
        assert_eq!(what(&w.next().unwrap().1), "b1");
    }

    /// Whatever the order of requests, completions and retries: never two requests of
    /// one MyApp at once, never more than the limit, and each MyApp's last request is
    /// the last one carried out for it.
    #[test]
    fn the_worklist_keeps_order_under_any_interleaving() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut random = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..200 {
            let mut w = Worklist::new(1 + random(3) as usize);
            let mut last_pushed: HashMap<Key, String> = HashMap::new();
            let mut last_run: HashMap<Key, String> = HashMap::new();
            let mut running: Vec<Key> = Vec::new();
            for step in 0..300 {
                match random(3) {
                    0 => {
                        let key = Key::new("ns", format!("a{}", random(5)));
                        let v = format!("v{step}");
                        w.push(
                            key.clone(),
                            Wanted::Apply {
                                manifest: v.clone().into(),
                            },
                        );
                        last_pushed.insert(key, v);
                    }
                    1 if !running.is_empty() => {
                        let key = running.remove(random(running.len() as u64) as usize);
                        w.done(&key);
                    }
                    _ => {}
                }
                while let Some((key, wanted)) = w.next() {
                    assert!(!running.contains(&key), "{key} started twice at once");
                    running.push(key.clone());
                    last_run.insert(key, what(&wanted));
                }
                assert!(running.len() <= w.limit);
            }
            for key in running.drain(..) {
                w.done(&key);
            }
            while let Some((key, wanted)) = w.next() {
                last_run.insert(key.clone(), what(&wanted));
                w.done(&key);
            }
            assert_eq!(last_run, last_pushed);
        }
    }

    /// A handler whose every request fails, retryably (its apiserver never answers).
    struct Failing {
        sync: Sync,
        retries: Retries,
        touched: mpsc::UnboundedSender<Key>,
        _reports: mpsc::UnboundedReceiver<Key>,
    }

    impl Failing {
        fn new() -> Failing {
            let (store, _writer) = reflector::store::<MyApp>();
            let (touched, reports) = mpsc::unbounded_channel();
            Failing {
                sync: Sync::new(crate::unreachable_client(), store),
                retries: Retries::default(),
                touched,
                _reports: reports,
            }
        }

        fn handler(&self) -> Handler<'_> {
            Handler {
                sync: &self.sync,
                retries: &self.retries,
                touched: &self.touched,
            }
        }
    }

    /// Each try that fails counts, so that the delay doubles: a try used to clear its
    /// own failure first, and a MyApp that kept failing was retried every second.
    #[tokio::test]
    async fn a_retry_that_fails_again_counts() {
        let f = Failing::new();
        let (handler, retries) = (f.handler(), &f.retries);
        let k = Key::new("ns", "a");
        let release = Wanted::Delete { orphan: true };
        for _ in 0..2 {
            let outcome = handler.carry_out(&k, &release).await;
            handler.record(&k, release.clone(), outcome, false);
        }
        assert_eq!(retries.0.lock()[&k].attempts, 2);
    }

    /// A request that fails after a newer one for the same MyApp came is not kept for a
    /// retry: retried after the newer one (a Delete after the Apply of a MyApp created
    /// again), it would undo it.
    #[tokio::test]
    async fn a_failure_a_newer_request_replaced_is_never_retried() {
        let f = Failing::new();
        let (handler, retries) = (f.handler(), &f.retries);
        let k = Key::new("ns", "a");
        let mut work = Worklist::new(8);
        work.push(k.clone(), Wanted::Delete { orphan: false });
        let (key, delete) = work.next().unwrap();
        // While the Delete runs (and fails), the MyApp is created again.
        retries.clear(&k);
        work.push(k.clone(), apply("again"));
        let outcome = handler.carry_out(&key, &delete).await;
        assert!(matches!(outcome, Outcome::Failed { retry: true, .. }));
        let superseded = work.done(&key);
        assert!(superseded);
        handler.record(&key, delete, outcome, superseded);
        retries
            .0
            .lock()
            .values_mut()
            .for_each(|f| f.due = Some(Instant::now()));
        assert!(
            retries.take_due().is_empty(),
            "the failed Delete would be retried"
        );
        assert_eq!(what(&work.next().unwrap().1), "again");
    }

    /// A failing request is tried again after 1 s, 2 s, 4 s...; a due retry is handed
    /// out once, and its error stays until a try succeeds.
    #[test]
    fn retries_back_off_and_are_handed_out_once() {
        let r = Retries::default();
        let k = Key::new("ns", "a");
        for attempts in 1..=3u32 {
            r.failed(&k, Wanted::Delete { orphan: false }, "boom".into(), true);
            let f = &r.0.lock()[&k];
            assert_eq!(f.attempts, attempts);
            let delay = f.due.unwrap() - Instant::now();
            let want = Duration::from_secs(1 << (attempts - 1));
            assert!(
                delay <= want && delay > want - Duration::from_millis(500),
                "{delay:?}"
            );
        }
        r.0.lock().get_mut(&k).unwrap().due = Some(Instant::now());
        assert_eq!(r.take_due().len(), 1);
        assert!(r.take_due().is_empty(), "handed out once while it is tried");
        assert_eq!(
            r.error(&k).as_deref(),
            Some("boom"),
            "the error stays until success"
        );
    }

    #[test]
    fn failures_back_off_and_a_new_request_replaces_them() {
        let r = Retries::default();
        let k = Key::new("ns", "a");
        r.failed(&k, Wanted::Delete { orphan: false }, "boom".into(), true);
        assert_eq!(r.error(&k).as_deref(), Some("boom"));
        assert!(r.take_due().is_empty(), "not due before its delay");
        r.clear(&k);
        assert_eq!(r.error(&k), None);
        r.failed(
            &k,
            Wanted::Delete { orphan: true },
            "bad manifest".into(),
            false,
        );
        assert_eq!(r.error(&k).as_deref(), Some("bad manifest"));
        assert!(
            r.0.lock()[&k].due.is_none(),
            "refused requests are not retried"
        );
    }
}
