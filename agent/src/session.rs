//! Session: the agent's transport to the hub.
//!
//! Dials out (the hub never needs credentials for this cluster), reading the token anew
//! before each dial so a rotated token needs no restart (and storing a token the hub
//! renews, see [`token`]); says Hello with the hash of
//! every MyApp it manages as the apiserver lists them (not the cache, so that the hub
//! takes nothing for absent that exists); then hands the hub's messages, decoded as
//! [`HubCommand`]s, to [`sync`] and sends what [`report`] says. On any failure it dials
//! again with jittered exponential backoff; what it applied keeps running meanwhile
//! (nothing is deleted on disconnect).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use flotilla_crds::MyApp;
use flotilla_proto::WireKey;
use flotilla_proto::client::{self, Dial, DialError, HubClient};
use flotilla_proto::v1::{self as pb, agent_message, hub_message};
use futures::StreamExt;
use kube::api::ListParams;
use kube::{Client, ResourceExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::autoscale::Autoscalers;
use crate::cache::{self, Key, Managed, applied_hash, key_of};
use crate::collect::{Breaker, Collector};
use crate::sync::{self, Applier};
use crate::tenancy::Guard;
use crate::token::{self, TokenError, TokenStore};
use crate::{capacity, identity, report};
use secrecy::SecretString;

#[derive(Clone)]
pub struct SessionConfig {
    /// `https://host:port` of the hub's gRPC endpoint.
    pub hub: String,
    pub cluster: String,
    /// Holds `<cluster>.<secret>` from `flotilla-hub join`; read before every dial, and
    /// where a renewed token is stored.
    pub token: Arc<TokenStore>,
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
    /// The namespaces no MyApp is applied into, whatever the hub sends.
    pub guard: Guard,
}

/// A message from the hub, as the agent acts on it.
#[derive(Debug, PartialEq)]
pub enum HubCommand {
    Apply {
        key: Key,
        manifest: bytes::Bytes,
    },
    Delete {
        key: Key,
        orphan: bool,
    },
    /// The hub sent everything it wants here: `desired` is that set.
    SyncComplete {
        desired: HashSet<Key>,
        confirmed_collection: u32,
    },
}

impl HubCommand {
    /// None for a message without a kind or without a valid key: skipped.
    pub fn decode(message: pb::HubMessage) -> Option<HubCommand> {
        Some(match message.kind? {
            hub_message::Kind::Apply(apply) => HubCommand::Apply {
                key: Key::from_wire(apply.key)?,
                manifest: apply.manifest,
            },
            hub_message::Kind::Delete(delete) => HubCommand::Delete {
                key: Key::from_wire(delete.key)?,
                orphan: delete.orphan,
            },
            hub_message::Kind::SyncComplete(complete) => HubCommand::SyncComplete {
                desired: (complete.desired.into_iter())
                    .filter_map(|k| Key::from_wire(Some(k)))
                    .collect(),
                confirmed_collection: complete.confirmed_collection,
            },
            // Stored by the session itself (`store_renewals`), never queued as work.
            hub_message::Kind::RenewToken(_) => return None,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Dial(#[from] DialError),
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error("listing this cluster's managed MyApps for Hello: {0}")]
    List(kube::Error),
    #[error("the stream broke: {0}")]
    Stream(tonic::Status),
    #[error("the cluster's ID for Hello: {0}")]
    Identity(#[from] identity::IdentityError),
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
    autoscalers: Autoscalers,
    shutdown: CancellationToken,
) {
    let applier = Applier::new(client.clone(), managed.store.clone(), autoscalers.clone());
    let applier = Arc::new(applier.with_guard(config.guard.clone()));
    let mut backoff = reconnect_backoff().build();
    loop {
        let started = Instant::now();
        let result = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = one_session(&client, &config, &managed, capacity.as_ref(), &autoscalers, &applier) => r,
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

async fn one_session(
    client: &Client,
    config: &SessionConfig,
    managed: &Managed,
    capacity: Option<&capacity::Source>,
    autoscalers: &Autoscalers,
    applier: &Applier,
) -> Result<(), SessionError> {
    let mut hub = dial(client, config).await?;
    let _ = managed.listed().await;
    // Nothing is applied before the autoscalers are known: it could take their replicas.
    let _ = autoscalers.listed().await;
    // Subscribed before the list in Hello, so that no change falls between them.
    let changes = managed.changes.subscribe();
    let scaled = autoscalers.subscribe();
    let (hello, listed) = hello(client, config).await?;
    let (tx, inbound) = client::open_session(&mut hub, hello, 256).await?;
    info!(hub = %config.hub, cluster = %config.cluster, managed = listed.len(), "connected to the hub");
    let (renewals, renewals_rx) = mpsc::unbounded_channel();
    let storer = tokio::spawn(store_renewals(
        (client.clone(), config.token.clone()),
        renewals_rx,
        tx.clone(),
    ));
    let (notices, notices_rx) = mpsc::unbounded_channel();
    let reporter = tokio::spawn(report::report_loop(
        managed.store.clone(),
        autoscalers.clone(),
        [changes, scaled],
        notices_rx,
        tx,
        config.heartbeat,
        // A new limiter per session: the hub hears the current capacity first.
        capacity
            .cloned()
            .zip(config.capacity_interval.map(capacity::Limiter::new)),
    ));
    let collector = Collector {
        cluster: config.cluster.clone(),
        managed: managed.store.clone(),
        breaker: Breaker::new(listed, config.max_collect_share),
    };
    // A renewed token goes to its own task: storing it never waits behind applies.
    let commands = inbound.filter_map(move |m| {
        std::future::ready(match m {
            Ok(pb::HubMessage {
                kind: Some(hub_message::Kind::RenewToken(renew)),
            }) => {
                let _ = renewals.send(renew);
                None
            }
            m => m.map(HubCommand::decode).transpose(),
        })
    });
    let result = sync::carry_out(commands, applier, &collector, config.concurrency, &notices).await;
    reporter.abort();
    // Never aborted mid-store: the next dial reads the token after every store of this
    // session has finished, so the hub may take the token it sees as the one held.
    let _ = storer.await;
    result.map_err(SessionError::Stream)
}

const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// Stores each token the hub renews, then answers with its hash (or why it could not be
/// stored: the hub then keeps the current token valid and tries again later).
async fn store_renewals(
    (client, store): (Client, Arc<TokenStore>),
    mut renewals: mpsc::UnboundedReceiver<pb::RenewToken>,
    tx: mpsc::Sender<pb::AgentMessage>,
) {
    while let Some(renew) = renewals.recv().await {
        let token_sha256 = token::sha256(&renew.token);
        let token: SecretString = renew.token.into();
        let error = match store.write(&client, &token).await {
            Ok(()) => {
                info!(store = ?store, expires_at_unix = renew.expires_at_unix, "stored the token the hub renewed");
                String::new()
            }
            Err(e) => {
                warn!(error = %e, "storing the token the hub renewed failed; the current one is kept");
                e.to_string()
            }
        };
        let answer = pb::AgentMessage {
            kind: Some(agent_message::Kind::TokenRenewed(pb::TokenRenewed {
                token_sha256,
                error,
            })),
        };
        // An answer the hub does not read within the heartbeat's order of time is lost
        // with its session; the hub sends the token again.
        match tokio::time::timeout(ANSWER_TIMEOUT, tx.send(answer)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) | Err(_) => return,
        }
    }
}

/// Connects to the hub with the token stored now.
async fn dial(client: &Client, config: &SessionConfig) -> Result<HubClient, SessionError> {
    let token = config.token.read(client).await?;
    Ok(client::connect(&Dial {
        hub: config.hub.clone(),
        ca_pem: config.ca_pem.clone(),
        server_name: config.server_name.clone(),
        token,
        keepalive: Duration::from_secs(10),
        keepalive_timeout: Duration::from_secs(10),
    })
    .await?)
}

/// Hello, and the keys it lists: every managed MyApp as the apiserver has it now (not
/// the cache), so that the hub takes nothing for absent that exists. With
/// `--allowed-namespace`, the MyApps of those namespaces, and Hello says so: the hub
/// then takes no word of this agent's on any other namespace.
async fn hello(
    client: &Client,
    config: &SessionConfig,
) -> Result<(pb::Hello, HashSet<Key>), SessionError> {
    let kubernetes_version = client
        .apiserver_version()
        .await
        .map(|v| v.git_version)
        .unwrap_or_default();
    let params = ListParams::default().labels(&cache::managed_selector());
    let scope = config.guard.policy().allowed();
    let mut listed = Vec::new();
    for (_, api) in cache::apis::<MyApp>(client, scope) {
        listed.extend(api.list(&params).await.map_err(SessionError::List)?.items);
    }
    let hello = pb::Hello {
        cluster: config.cluster.clone(),
        agent_version: env!("CARGO_PKG_VERSION").into(),
        kubernetes_version,
        managed: listed
            .iter()
            .map(|a| pb::Managed {
                key: Some(key_of(a).to_wire()),
                // A MyApp changed by hand is not what its hash says: an empty one has
                // the hub send its Apply again.
                hash: match crate::drift::of(a.managed_fields()) {
                    Some(_) => String::new(),
                    None => applied_hash(a),
                },
            })
            .collect(),
        cluster_uid: identity::cluster_uid(client).await,
        cluster_id: identity::cluster_id(client).await?.unwrap_or_default(),
        renews_token: true,
        scope: scope.into_iter().flatten().cloned().collect(),
    };
    Ok((hello, listed.iter().map(key_of).collect()))
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

    /// Every message the hub sends becomes a command; one without a valid key (or
    /// without a kind) is skipped; SyncComplete drops keys with an empty part.
    #[test]
    fn hub_messages_decode_to_commands() {
        let key = |ns: &str, name: &str| {
            Some(pb::ObjectKey {
                namespace: ns.into(),
                name: name.into(),
            })
        };
        let message = |kind| pb::HubMessage { kind: Some(kind) };
        let apply = hub_message::Kind::Apply(pb::Apply {
            key: key("ns", "a"),
            manifest: bytes::Bytes::from_static(b"{}"),
            ..Default::default()
        });
        assert_eq!(
            HubCommand::decode(message(apply)),
            Some(HubCommand::Apply {
                key: Key::new("ns", "a"),
                manifest: bytes::Bytes::from_static(b"{}"),
            })
        );
        let delete = hub_message::Kind::Delete(pb::Delete {
            key: key("ns", "a"),
            orphan: true,
        });
        assert_eq!(
            HubCommand::decode(message(delete)),
            Some(HubCommand::Delete {
                key: Key::new("ns", "a"),
                orphan: true
            })
        );
        let complete = hub_message::Kind::SyncComplete(pb::SyncComplete {
            desired: vec![key("ns", "a").unwrap(), key("", "b").unwrap()],
            confirmed_collection: 3,
        });
        assert_eq!(
            HubCommand::decode(message(complete)),
            Some(HubCommand::SyncComplete {
                desired: [Key::new("ns", "a")].into(),
                confirmed_collection: 3
            })
        );
        let keyless = hub_message::Kind::Delete(pb::Delete {
            key: key("ns", ""),
            orphan: false,
        });
        assert_eq!(HubCommand::decode(message(keyless)), None);
        assert_eq!(HubCommand::decode(pb::HubMessage { kind: None }), None);
    }
}
