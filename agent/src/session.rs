//! Session: the agent's stream with the hub.
//!
//! Dials out (the hub never needs credentials for this cluster), says Hello with the hash
//! of every MyApp it manages, carries Apply/Delete/SyncComplete into `sync`, and reports
//! status changes and heartbeats back. On any failure it dials again with jittered
//! exponential backoff; what it applied keeps running meanwhile (nothing is deleted on
//! disconnect).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_crds::{MANAGED_BY_LABEL, MANAGED_BY_VALUE, MyApp};
use flotilla_proto::v1::federation_client::FederationClient;
use flotilla_proto::v1::{self as pb, agent_message, hub_message};
use futures::StreamExt;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
use tracing::{debug, info, warn};

use crate::report::{key_pb, status_report};
use crate::sync::{Key, Sync, applied_hash, key_of};

pub struct SessionConfig {
    /// `https://host:port` of the hub's gRPC endpoint.
    pub hub: String,
    pub cluster: String,
    /// `<cluster>.<secret>`, from `flotilla-hub join`.
    pub token: String,
    /// PEM of the CA that signed the hub's certificate.
    pub ca_pem: Vec<u8>,
    /// The name to verify the hub's certificate against, if not the URL's host.
    pub server_name: Option<String>,
    pub heartbeat: Duration,
}

/// The MyApps this agent manages, cached, with a feed of the keys that changed.
#[derive(Clone)]
pub struct Managed {
    pub store: Store<MyApp>,
    pub changes: broadcast::Sender<Key>,
}

/// Watches managed MyApps in every namespace; the future runs the watch.
pub fn watch_managed(client: Client) -> (Managed, impl std::future::Future<Output = ()>) {
    let (store, writer) = reflector::store::<MyApp>();
    let (changes, _) = broadcast::channel(1024);
    let config =
        watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"));
    let stream = reflector(writer, watcher(Api::<MyApp>::all(client), config))
        .default_backoff()
        .touched_objects();
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
    (Managed { store, changes }, run)
}

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("connecting to the hub at {hub}: {source}")]
    Connect {
        hub: String,
        source: tonic::transport::Error,
    },
    #[error("the hub refused the session: {0}")]
    Refused(tonic::Status),
    #[error("the stream broke: {0}")]
    Stream(tonic::Status),
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// Dials the hub again and again until `shutdown`.
pub async fn run(
    client: Client,
    config: SessionConfig,
    managed: Managed,
    shutdown: CancellationToken,
) {
    let sync = Arc::new(Sync::new(client.clone(), managed.store.clone()));
    let mut backoff = Backoff::default();
    loop {
        let started = Instant::now();
        let result = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = one_session(&client, &config, &managed, &sync) => r,
        };
        match result {
            Ok(()) => info!("the hub ended the session"),
            Err(e) => warn!(error = %e, "session with the hub failed"),
        }
        if started.elapsed() > Duration::from_secs(30) {
            backoff = Backoff::default();
        }
        let delay = backoff.next();
        debug!(?delay, "reconnecting");
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// Exponential backoff from 200 ms to 30 s, with jitter so that agents restarted
/// together do not reconnect together.
#[derive(Default)]
struct Backoff {
    attempt: u32,
}

impl Backoff {
    fn next(&mut self) -> Duration {
        let ceiling = Duration::from_millis(200)
            .saturating_mul(1 << self.attempt.min(8))
            .min(Duration::from_secs(30));
        self.attempt += 1;
        ceiling / 2 + ceiling.mul_f64(rand::random::<f64>() / 2.0)
    }
}

async fn one_session(
    client: &Client,
    config: &SessionConfig,
    managed: &Managed,
    sync: &Sync,
) -> Result<(), SessionError> {
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&config.ca_pem));
    if let Some(name) = &config.server_name {
        tls = tls.domain_name(name.clone());
    }
    let connect = |source| SessionError::Connect {
        hub: config.hub.clone(),
        source,
    };
    let channel = Endpoint::from_shared(config.hub.clone())
        .map_err(|e| SessionError::Config(format!("hub address {:?}: {e}", config.hub)))?
        .tls_config(tls)
        .map_err(connect)?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(20))
        .connect()
        .await
        .map_err(connect)?;
    let bearer: tonic::metadata::MetadataValue<_> = format!("Bearer {}", config.token)
        .parse()
        .map_err(|_| SessionError::Config("the token is not a valid header value".into()))?;
    let mut hub =
        FederationClient::with_interceptor(channel, move |mut request: tonic::Request<()>| {
            request
                .metadata_mut()
                .insert("authorization", bearer.clone());
            Ok(request)
        });

    let _ = managed.store.wait_until_ready().await;
    let kubernetes_version = client
        .apiserver_version()
        .await
        .map(|v| v.git_version)
        .unwrap_or_default();
    let (tx, rx) = mpsc::channel(256);
    // Subscribed before the snapshot in Hello, so that no change falls between them.
    let changes = managed.changes.subscribe();
    let hello = pb::Hello {
        cluster: config.cluster.clone(),
        agent_version: env!("CARGO_PKG_VERSION").into(),
        kubernetes_version,
        managed: managed
            .store
            .state()
            .iter()
            .map(|a| pb::Managed {
                key: Some(key_pb(&key_of(a))),
                hash: applied_hash(a),
            })
            .collect(),
    };
    let hello_count = hello.managed.len();
    let _ = tx.send(agent(agent_message::Kind::Hello(hello))).await;
    let mut inbound = hub
        .session(ReceiverStream::new(rx))
        .await
        .map_err(SessionError::Refused)?
        .into_inner();
    info!(hub = %config.hub, cluster = %config.cluster, managed = hello_count, "connected to the hub");

    let reporter = tokio::spawn(report_loop(
        managed.store.clone(),
        changes,
        tx.clone(),
        config.heartbeat,
    ));
    let result = async {
        while let Some(message) = inbound.message().await.map_err(SessionError::Stream)? {
            match message.kind {
                Some(hub_message::Kind::Apply(apply)) => {
                    let Some(key) = key(apply.key) else { continue };
                    if let Err(e) = sync.apply(&key, &apply.manifest).await {
                        warn!(app = %key, error = %e, "apply failed");
                        let mut report =
                            status_report(&key, current(&managed.store, &key).as_deref());
                        report.apply_error = e.to_string();
                        report.hash = apply.hash;
                        let _ = tx.send(agent(agent_message::Kind::Status(report))).await;
                    }
                }
                Some(hub_message::Kind::Delete(delete)) => {
                    let Some(key) = key(delete.key) else { continue };
                    let done = if delete.orphan {
                        sync.release(&key).await
                    } else {
                        sync.delete(&key).await
                    };
                    report_removal(
                        &tx,
                        &key,
                        done,
                        if delete.orphan { "released" } else { "deleted" },
                    )
                    .await;
                }
                Some(hub_message::Kind::SyncComplete(complete)) => {
                    let desired: HashSet<Key> = complete
                        .desired
                        .into_iter()
                        .filter_map(|k| key(Some(k)))
                        .collect();
                    let orphans = sync.orphans(&desired);
                    info!(
                        desired = desired.len(),
                        orphans = orphans.len(),
                        "initial sync complete"
                    );
                    for orphan in orphans {
                        let done = sync.delete(&orphan).await;
                        report_removal(&tx, &orphan, done, "deleted as an orphan").await;
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

async fn report_removal(
    tx: &mpsc::Sender<pb::AgentMessage>,
    key: &Key,
    done: Result<(), crate::sync::SyncError>,
    what: &str,
) {
    let mut report = status_report(key, None);
    match done {
        Ok(()) => info!(app = %key, "{what}"),
        Err(e) => {
            warn!(app = %key, error = %e, "removal failed");
            report.exists = true;
            report.apply_error = e.to_string();
        }
    }
    let _ = tx.send(agent(agent_message::Kind::Status(report))).await;
}

fn current(store: &Store<MyApp>, key: &Key) -> Option<Arc<MyApp>> {
    store.get(&ObjectRef::new(&key.name).within(&key.namespace))
}

fn key(k: Option<pb::ObjectKey>) -> Option<Key> {
    k.filter(|k| !k.namespace.is_empty() && !k.name.is_empty())
        .map(|k| Key {
            namespace: k.namespace,
            name: k.name,
        })
}

fn agent(kind: agent_message::Kind) -> pb::AgentMessage {
    pb::AgentMessage { kind: Some(kind) }
}

/// Sends every managed MyApp's status once, then each change, and a heartbeat every
/// `heartbeat`; a report equal to the last one sent is not sent again.
async fn report_loop(
    store: Store<MyApp>,
    mut changes: broadcast::Receiver<Key>,
    tx: mpsc::Sender<pb::AgentMessage>,
    heartbeat: Duration,
) {
    let mut sent: HashMap<Key, pb::StatusReport> = HashMap::new();
    let mut keys: Vec<Key> = store.state().iter().map(|a| key_of(a)).collect();
    let mut tick = tokio::time::interval(heartbeat);
    loop {
        for key in keys.drain(..) {
            let report = status_report(&key, current(&store, &key).as_deref());
            if sent.get(&key) != Some(&report) {
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
    fn backoff_grows_with_jitter_and_is_capped() {
        let mut b = Backoff::default();
        let first = b.next();
        assert!(
            first >= Duration::from_millis(100) && first <= Duration::from_millis(200),
            "{first:?}"
        );
        for _ in 0..20 {
            let d = b.next();
            assert!(
                d <= Duration::from_secs(30) && d >= Duration::from_millis(100),
                "{d:?}"
            );
        }
        assert!(
            b.next() >= Duration::from_secs(15),
            "capped at 30s, jitter at most halves it"
        );
    }
}
