//! Report: what the agent tells the hub in a session. Every managed MyApp's status once,
//! then each change (of the MyApp, or of the autoscaler that owns its replicas); the
//! error of a request that keeps failing until it succeeds; a collection the circuit
//! breaker holds back; a heartbeat every `heartbeat`, with the cluster's capacity when
//! the limiter lets it through. A status report equal to the
//! last one sent is not sent again, but the outcome of a request the hub made always is.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use flotilla_crds::MyApp;
use flotilla_proto::WireKey;
use flotilla_proto::v1::{self as pb, agent_message};
use prost::Message;
use sha2::{Digest as _, Sha256};
use tokio::sync::{broadcast, mpsc};

use crate::autoscale::{Autoscaler, Autoscalers};
use crate::cache::{self, Key, Stores, applied_hash, is_managed};
use crate::capacity;

/// What the session's work tells the report loop.
#[derive(Debug, PartialEq)]
pub enum Notice {
    /// A try of the hub's request for `key` ended; `error` until one succeeds. `applied`:
    /// it was an Apply, and the apiserver took it.
    Tried {
        key: Key,
        error: Option<String>,
        applied: bool,
    },
    /// The circuit breaker holds back a collection.
    CollectionBlocked(pb::CollectionBlocked),
}

fn agent(kind: agent_message::Kind) -> pb::AgentMessage {
    pb::AgentMessage { kind: Some(kind) }
}

/// The reports of one session, sent on `tx` until it closes (see the module's header).
pub async fn report_loop(
    store: Stores,
    autoscalers: Autoscalers,
    [mut changes, mut scaled]: [broadcast::Receiver<Key>; 2],
    mut notices: mpsc::UnboundedReceiver<Notice>,
    tx: mpsc::Sender<pb::AgentMessage>,
    heartbeat: Duration,
    mut capacity: Option<(capacity::Source, capacity::Limiter)>,
) {
    let mut reports = Reports::new(store, autoscalers);
    let mut tick = tokio::time::interval(heartbeat);
    loop {
        for report in reports.take() {
            let status = agent(agent_message::Kind::Status(report));
            if tx.send(status).await.is_err() {
                return;
            }
        }
        let open = tokio::select! {
            _ = tick.tick() => heartbeat_and_capacity(&tx, capacity.as_mut()).await,
            Some(notice) = notices.recv() => match notice {
                Notice::Tried { key, error, applied } => reports.tried(key, error, applied),
                Notice::CollectionBlocked(blocked) => {
                    let blocked = agent(agent_message::Kind::CollectionBlocked(blocked));
                    tx.send(blocked).await.is_ok()
                }
            },
            change = changes.recv() => reports.feed(change),
            change = scaled.recv() => reports.feed(change),
        };
        if !open {
            return;
        }
    }
}

/// What the hub heard last of each MyApp, and which reports are due. The changing
/// methods return true (the loop goes on).
struct Reports {
    store: Stores,
    autoscalers: Autoscalers,
    /// The last report sent of each MyApp, as a digest: a copy of each would hold
    /// ~1.5 KB a MyApp for the session's life.
    sent: HashMap<Key, Digest>,
    /// The error of each MyApp whose latest request keeps failing.
    errors: HashMap<Key, String>,
    due: Vec<Key>,
    /// Due even if unchanged: the outcome of a request the hub made is always sent, as
    /// the hub may be waiting for exactly that confirmation.
    forced: HashSet<Key>,
}

impl Reports {
    fn new(store: Stores, autoscalers: Autoscalers) -> Self {
        let mut reports = Reports {
            store,
            autoscalers,
            sent: HashMap::new(),
            errors: HashMap::new(),
            due: Vec::new(),
            forced: HashSet::new(),
        };
        reports.all();
        reports
    }

    /// Every MyApp cached, and every one reported before.
    fn all(&mut self) -> bool {
        let cached = self.store.state().into_iter().map(|a| cache::key_of(&*a));
        self.due = cached.chain(self.sent.keys().cloned()).collect();
        true
    }

    fn changed(&mut self, key: Key) -> bool {
        self.due.push(key);
        true
    }

    /// A MyApp (or its autoscaler) changed; false once the feed is closed.
    fn feed(&mut self, change: Result<Key, broadcast::error::RecvError>) -> bool {
        match change {
            Ok(key) => self.changed(key),
            // Fell behind: resend whatever differs.
            Err(broadcast::error::RecvError::Lagged(_)) => self.all(),
            Err(broadcast::error::RecvError::Closed) => false,
        }
    }

    /// The outcome is reported, even if it reads like the last report; but a MyApp just
    /// applied that the cache does not show yet is reported when the watch brings it:
    /// read from the cache now, it would say "gone", which the hub takes as a confirmed
    /// deletion (and answers with the Apply again).
    fn tried(&mut self, key: Key, error: Option<String>, applied: bool) -> bool {
        match error {
            Some(error) => self.errors.insert(key.clone(), error),
            None => self.errors.remove(&key),
        };
        if applied && self.store.get(&key).is_none() {
            return true;
        }
        self.forced.insert(key.clone());
        self.changed(key)
    }

    /// The reports due that differ from the last sent, or are forced.
    fn take(&mut self) -> Vec<pb::StatusReport> {
        let mut out = Vec::new();
        for key in std::mem::take(&mut self.due) {
            let app = self.store.get(&key);
            let autoscaler = self.autoscalers.of(&key);
            let mut report = status_report(&key, app.as_deref(), autoscaler.as_ref());
            if let Some(error) = self.errors.get(&key) {
                report.apply_error = error.clone();
            }
            let digest = digest(&report);
            if self.forced.remove(&key) || self.sent.get(&key) != Some(&digest) {
                self.sent.insert(key, digest);
                out.push(report);
            }
        }
        out
    }
}

/// A report's digest: the first half of the SHA-256 of its encoding, which prost writes
/// the same way every time for the same report (fields in order, no maps).
type Digest = [u8; 16];

fn digest(report: &pb::StatusReport) -> Digest {
    let hash = Sha256::digest(report.encode_to_vec());
    let mut digest = Digest::default();
    digest.copy_from_slice(&hash[..16]);
    digest
}

/// A heartbeat, and the capacity if it changed and the limiter lets it through; false
/// when the session is gone.
async fn heartbeat_and_capacity(
    tx: &mpsc::Sender<pb::AgentMessage>,
    capacity: Option<&mut (capacity::Source, capacity::Limiter)>,
) -> bool {
    let beat = agent(agent_message::Kind::Heartbeat(pb::Heartbeat {}));
    if tx.send(beat).await.is_err() {
        return false;
    }
    let Some((source, limiter)) = capacity else {
        return true;
    };
    let Some(now) = source.now() else { return true };
    if !limiter.admit(&now, std::time::Instant::now()) {
        return true;
    }
    let message = agent(agent_message::Kind::Capacity(capacity::to_pb(&now)));
    tx.send(message).await.is_ok()
}

/// The report for a MyApp as it stands, with the autoscaler that owns its replicas, or
/// for one that is gone (or no longer managed).
pub fn status_report(
    key: &Key,
    app: Option<&MyApp>,
    autoscaler: Option<&Autoscaler>,
) -> pb::StatusReport {
    let Some(app) = app.filter(|a| is_managed(a)) else {
        return pb::StatusReport {
            key: Some(key.to_wire()),
            exists: false,
            ..Default::default()
        };
    };
    let status = app.status.clone().unwrap_or_default();
    pb::StatusReport {
        key: Some(key.to_wire()),
        hash: applied_hash(app),
        exists: true,
        ready: status.ready,
        ready_replicas: status.ready_replicas,
        observed_generation: status.observed_generation.unwrap_or_default(),
        generation: app.metadata.generation.unwrap_or_default(),
        conditions: status
            .conditions
            .iter()
            .map(|c| pb::Condition {
                r#type: c.type_.clone(),
                status: c.status.clone(),
                reason: c.reason.clone(),
                message: c.message.clone(),
            })
            .collect(),
        apply_error: String::new(),
        replicas: status.replicas,
        autoscaler: autoscaler.map(ToString::to_string).unwrap_or_default(),
        drift: cache::drift(app).cloned().unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_crds::MyAppStatus;

    fn kind(m: Option<pb::AgentMessage>) -> agent_message::Kind {
        m.expect("a message").kind.expect("a kind")
    }

    /// A failing request's error rides on its MyApp's report until a try succeeds, each
    /// outcome is sent even when it reads like the last report, a change that alters
    /// nothing is not, and a held-back collection is passed on.
    #[tokio::test(start_paused = true)]
    async fn outcomes_are_reported_and_unchanged_reports_are_not() {
        let a = Key::new("ns", "a");
        let (changes_tx, changes) = broadcast::channel(16);
        let (_scaled_tx, scaled) = broadcast::channel(16);
        let (notices_tx, notices) = mpsc::unbounded_channel();
        let (tx, mut rx) = mpsc::channel(16);
        let task = tokio::spawn(report_loop(
            crate::store_of(&["a"]),
            crate::no_autoscalers(),
            [changes, scaled],
            notices,
            tx,
            Duration::from_secs(10),
            None,
        ));
        let status = |m| match kind(m) {
            agent_message::Kind::Status(r) => {
                (Key::from_wire(r.key).unwrap(), r.exists, r.apply_error)
            }
            other => panic!("not a status report: {other:?}"),
        };
        assert_eq!(status(rx.recv().await), (a.clone(), true, String::new()));
        assert!(matches!(
            kind(rx.recv().await),
            agent_message::Kind::Heartbeat(_)
        ));
        for _ in 0..2 {
            let error = Some("boom".to_string());
            notices_tx
                .send(Notice::Tried {
                    key: a.clone(),
                    error,
                    applied: false,
                })
                .unwrap();
            assert_eq!(status(rx.recv().await), (a.clone(), true, "boom".into()));
        }
        notices_tx
            .send(Notice::Tried {
                key: a.clone(),
                error: None,
                applied: true,
            })
            .unwrap();
        assert_eq!(status(rx.recv().await), (a.clone(), true, String::new()));
        changes_tx.send(a.clone()).unwrap();
        let blocked = pb::CollectionBlocked {
            would_collect: 3,
            managed: 4,
        };
        notices_tx.send(Notice::CollectionBlocked(blocked)).unwrap();
        assert_eq!(
            kind(rx.recv().await),
            agent_message::Kind::CollectionBlocked(blocked),
            "the unchanged report was sent again"
        );
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(matches!(
            kind(rx.recv().await),
            agent_message::Kind::Heartbeat(_)
        ));
        drop(rx);
        tokio::time::sleep(Duration::from_secs(10)).await;
        task.await.unwrap();
    }

    fn key() -> Key {
        Key::new("ns", "a")
    }

    /// A MyApp applied before the watch shows it is not reported gone (the hub would take
    /// that as a confirmed deletion): it is reported once the cache holds it. A deletion
    /// the apiserver confirmed is reported at once, whatever the cache still shows.
    #[tokio::test]
    async fn an_apply_the_cache_does_not_show_yet_is_not_reported_gone() {
        let (store, mut writer) = kube::runtime::reflector::store::<MyApp>();
        writer.apply_watcher_event(&kube::runtime::watcher::Event::InitDone);
        let mut reports = Reports::new(Stores::all(store.clone()), crate::no_autoscalers());
        assert!(reports.take().is_empty());
        reports.tried(key(), None, true);
        assert!(
            reports.take().is_empty(),
            "reported before the cache shows it"
        );
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(managed(
            r#"{"app.kubernetes.io/managed-by":"flotilla"}"#,
        )));
        reports.changed(key());
        let shown: Vec<_> = reports.take().into_iter().map(|r| r.exists).collect();
        assert_eq!(shown, [true]);
        reports.tried(key(), None, false);
        let confirmed: Vec<_> = reports.take().into_iter().map(|r| r.exists).collect();
        assert_eq!(
            confirmed,
            [true],
            "a Delete's outcome is sent even if unchanged"
        );
    }

    fn managed(labels: &str) -> MyApp {
        serde_json::from_str(&format!(
            r#"{{"apiVersion":"app.example.com/v1","kind":"MyApp","metadata":{{"name":"a","namespace":"ns","generation":3,
               "labels":{labels},"annotations":{{"flotilla.io/content-hash":"abc"}}}},"spec":{{}}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn managed_app_reports_its_hash_and_status() {
        let mut app = managed(r#"{"app.kubernetes.io/managed-by":"flotilla"}"#);
        app.status = Some(MyAppStatus {
            ready: true,
            ready_replicas: 3,
            replicas: Some(4),
            observed_generation: Some(3),
            ..MyAppStatus::default()
        });
        let hpa = Autoscaler {
            name: "web".into(),
            target: crate::autoscale::Target::MyApp,
        };
        let r = status_report(&key(), Some(&app), Some(&hpa));
        assert_eq!(
            (r.replicas, r.autoscaler.as_str()),
            (Some(4), "HorizontalPodAutoscaler web scales the MyApp")
        );
        assert!(r.exists && r.ready);
        assert_eq!(
            (
                r.hash.as_str(),
                r.ready_replicas,
                r.observed_generation,
                r.generation
            ),
            ("abc", 3, 3, 3)
        );
    }

    #[test]
    fn missing_or_unmanaged_apps_report_as_gone() {
        assert!(!status_report(&key(), None, None).exists);
        let app = managed(r#"{"app.kubernetes.io/managed-by":"someone-else"}"#);
        let r = status_report(&key(), Some(&app), None);
        assert!(!r.exists);
        assert!(
            r.hash.is_empty(),
            "nothing of an unmanaged MyApp is reported"
        );
    }
}
