//! The MyApp conversion webhook: `POST /convert` (ConversionReview v1) over HTTPS.
//! [`convert`] holds the pure conversion, [`tls`] the serving certificate, [`ca`] the CA
//! the replicas share, [`crd`] how the CRD is pointed at this server.

pub mod ca;
pub mod convert;
pub mod crd;
pub mod tls;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::{Json, Router};
use backon::{ExponentialBuilder, Retryable};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceConversion;
use kube::Client;
use kube::core::conversion::ConversionReview;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crd::Endpoint;
use flotilla_common::http::Gate;
use flotilla_common::tls::Ca;
use tls::{Identity, TlsError};

#[derive(Clone, Debug)]
pub struct WebhookConfig {
    pub addr: SocketAddr,
    /// PEM certificate and key to serve; without them the agent makes its own CA.
    pub cert_files: Option<(PathBuf, PathBuf)>,
    /// The Secret (namespace, name) holding the CA the replicas share, when the agent
    /// makes its own and publishes it (`endpoint`); without it, a new CA at every start.
    pub ca_secret: Option<(String, String)>,
    /// Where the apiserver reaches this server; when set, the agent writes it (and its
    /// CA) into the MyApp CRD at start.
    pub endpoint: Option<Endpoint>,
}

#[derive(thiserror::Error, Debug)]
pub enum WebhookError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("listening on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("pointing the MyApp CRD at the webhook: {0}")]
    Publish(#[source] kube::Error),
    #[error("the webhook's CA: {0}")]
    Ca(#[from] ca::CaError),
}

/// A client that has not finished its TLS handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; one past it is closed at once. The apiserver keeps a
/// few; the cap keeps anyone else from holding the agent's file descriptors.
const MAX_CONNECTIONS: usize = 64;

fn retry_backoff() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(10))
        .with_jitter()
        .without_max_times()
}

/// The shared CA (see [`ca::shared`]), retried like [`publish`]: an apiserver not
/// answering yet is waited for; a refusal or a Secret without a usable CA ends it.
async fn shared_ca(client: Client, namespace: &str, name: &str) -> Result<Ca, WebhookError> {
    Ok((|| ca::shared(client.clone(), namespace, name))
        .retry(retry_backoff())
        .when(|e| !e.needs_a_person())
        .notify(|e, delay| warn!(error = %e, ?delay, "reading the webhook's CA; retrying"))
        .await?)
}

/// Points the MyApp CRD at this webhook, retrying while the apiserver does not take it
/// (it may be starting, as after an outage, with this agent): an agent that exited then
/// would wait for its Pod's restart backoff. Refusals of the agent's credential or
/// permissions (401, 403) are not retried: they need a person.
async fn publish(
    client: Client,
    conversion: &CustomResourceConversion,
) -> Result<bool, WebhookError> {
    (|| crd::publish(client.clone(), conversion))
        .retry(retry_backoff())
        .when(|e| !matches!(e, kube::Error::Api(s) if matches!(s.code, 401 | 403)))
        .notify(
            |e, delay| warn!(error = %e, ?delay, "pointing the MyApp CRD at the webhook; retrying"),
        )
        .await
        .map_err(WebhookError::Publish)
}

pub fn router() -> Router {
    Router::new().route(
        crd::PATH,
        post(|Json(review): Json<ConversionReview>| async { Json(convert::review(review)) }),
    )
}

/// Serves the webhook until `shutdown` fires; opens `ready` once it listens and the CRD
/// points at it (see [`publish`]).
pub async fn run_webhook(
    client: Client,
    config: WebhookConfig,
    ready: Gate,
    shutdown: CancellationToken,
) -> Result<(), WebhookError> {
    let mut hosts = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    hosts.extend(config.endpoint.iter().flat_map(Endpoint::hosts));
    let identity = match (&config.cert_files, &config.ca_secret, &config.endpoint) {
        (Some((cert, key)), _, _) => Identity::from_files(cert, key)?,
        (None, Some((namespace, name)), Some(_)) => {
            let ca = tokio::select! {
                ca = shared_ca(client.clone(), namespace, name) => ca?,
                () = shutdown.cancelled() => return Ok(()),
            };
            Identity::issued_by(&ca, &hosts)?
        }
        _ => Identity::self_signed(&hosts)?,
    };
    let acceptor = TlsAcceptor::from(identity.server_config()?);
    let listener = TcpListener::bind(config.addr)
        .await
        .map_err(|source| WebhookError::Listen {
            addr: config.addr,
            source,
        })?;
    info!(addr = %config.addr, "serving the conversion webhook at {}", crd::PATH);
    if let Some(endpoint) = &config.endpoint {
        let conversion = crd::conversion(endpoint, identity.ca_pem.as_deref());
        let changed = tokio::select! {
            published = publish(client, &conversion) => published?,
            () = shutdown.cancelled() => return Ok(()),
        };
        if changed {
            info!(?endpoint, "MyApp CRD now converts through this webhook");
        } else {
            info!(
                ?endpoint,
                "MyApp CRD already converts through this webhook, with this CA"
            );
        }
    }
    ready.open();
    serve(listener, acceptor, Limits::default(), shutdown).await;
    Ok(())
}

/// What one client may hold of the webhook listener.
#[derive(Clone, Copy, Debug)]
struct Limits {
    handshake_timeout: Duration,
    max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            handshake_timeout: HANDSHAKE_TIMEOUT,
            max_connections: MAX_CONNECTIONS,
        }
    }
}

/// Accepts and serves connections until `shutdown`: at most `max_connections` at once
/// (one past it is closed at once), each dropped if its TLS handshake has not finished
/// within `handshake_timeout`.
async fn serve(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    limits: Limits,
    shutdown: CancellationToken,
) {
    let service = TowerToHyperService::new(router());
    let connections = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    debug!(error = %e, "accept failed");
                    continue;
                }
            },
            () = shutdown.cancelled() => return,
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            debug!(%peer, "{} webhook connections open; closed", limits.max_connections);
            continue;
        };
        let acceptor = acceptor.clone();
        let service = service.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let handshake = acceptor.accept(stream);
            let tls = match tokio::time::timeout(limits.handshake_timeout, handshake).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => return debug!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => {
                    return debug!(%peer, "no TLS handshake within {:?}", limits.handshake_timeout);
                }
            };
            if let Err(e) = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tls), service)
                .await
            {
                debug!(%peer, error = %e, "webhook connection ended");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_common::http::Readiness;

    /// Started while its apiserver is down (restarted with it after an outage): the
    /// webhook waits for the apiserver, not ready, instead of ending the process; and
    /// it stops at shutdown meanwhile.
    #[tokio::test]
    async fn waits_for_an_apiserver_that_does_not_answer_yet() {
        let readiness = Readiness::default();
        let shutdown = CancellationToken::new();
        let config = WebhookConfig {
            addr: "127.0.0.1:0".parse().unwrap(),
            cert_files: None,
            ca_secret: Some(("flotilla-system".into(), "flotilla-agent-webhook-ca".into())),
            endpoint: Some(Endpoint::Url("https://127.0.0.1:9443/convert".into())),
        };
        let run = tokio::spawn(run_webhook(
            crate::unreachable_client(),
            config,
            readiness.gate("webhook"),
            shutdown.clone(),
        ));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(!run.is_finished(), "the webhook gave up: {:?}", run.await);
        assert_eq!(readiness.waiting(), ["webhook"]);
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("the webhook did not stop at shutdown")
            .unwrap()
            .unwrap();
    }

    /// Reads from `conn` until it closes; `Err` if it is still open after `within`.
    async fn closed_within(conn: &mut tokio::net::TcpStream, within: Duration) -> Result<(), ()> {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 64];
        tokio::time::timeout(within, async {
            while conn.read(&mut buf).await.is_ok_and(|n| n > 0) {}
        })
        .await
        .map_err(|_| ())
    }

    /// Clients that never start TLS hold a connection only until the handshake timeout,
    /// and no more than the cap of them at once: one past it is closed at once. Real
    /// sockets on loopback.
    #[tokio::test]
    async fn idle_clients_are_capped_and_timed_out() {
        let identity = Identity::self_signed(&["127.0.0.1".into()]).unwrap();
        let acceptor = TlsAcceptor::from(identity.server_config().unwrap());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = Limits {
            handshake_timeout: Duration::from_secs(3),
            max_connections: 2,
        };
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve(listener, acceptor, limits, shutdown.clone()));
        let connect = || tokio::net::TcpStream::connect(addr);
        let (mut a, mut b) = (connect().await.unwrap(), connect().await.unwrap());
        // Accepted in the order they came: the third is past the cap.
        let mut c = connect().await.unwrap();
        assert!(
            closed_within(&mut c, Duration::from_millis(500))
                .await
                .is_ok(),
            "a connection past the cap stays open"
        );
        assert!(
            closed_within(&mut a, Duration::from_millis(300))
                .await
                .is_err(),
            "closed before its handshake timeout"
        );
        for conn in [&mut a, &mut b] {
            assert!(
                closed_within(conn, Duration::from_secs(5)).await.is_ok(),
                "an idle client outlived the handshake timeout"
            );
        }
        // Their permits are back: a real client gets through.
        let mut d = connect().await.unwrap();
        assert!(
            closed_within(&mut d, Duration::from_millis(300))
                .await
                .is_err()
        );
        shutdown.cancel();
        server.await.unwrap();
    }
}
