//! The MyApp conversion webhook: `POST /convert` (ConversionReview v1) over HTTPS.
//! [`convert`] holds the pure conversion, [`tls`] the serving certificate, [`crd`] how
//! the CRD is pointed at this server.

pub mod convert;
pub mod crd;
pub mod tls;

use std::net::SocketAddr;
use std::path::PathBuf;
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
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crd::Endpoint;
use flotilla_common::http::Gate;
use tls::{Identity, TlsError};

#[derive(Clone, Debug)]
pub struct WebhookConfig {
    pub addr: SocketAddr,
    /// PEM certificate and key to serve; without them the agent makes its own CA.
    pub cert_files: Option<(PathBuf, PathBuf)>,
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
}

/// Points the MyApp CRD at this webhook, retrying while the apiserver does not take it
/// (it may be starting, as after an outage, with this agent): an agent that exited then
/// would wait for its Pod's restart backoff. Refusals of the agent's credential or
/// permissions (401, 403) are not retried: they need a person.
async fn publish(
    client: Client,
    conversion: &CustomResourceConversion,
) -> Result<(), WebhookError> {
    let backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(10))
        .with_jitter()
        .without_max_times();
    (|| crd::publish(client.clone(), conversion))
        .retry(backoff)
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
    let identity = match &config.cert_files {
        Some((cert, key)) => Identity::from_files(cert, key)?,
        None => {
            let mut hosts = vec!["localhost".to_string(), "127.0.0.1".to_string()];
            hosts.extend(config.endpoint.iter().flat_map(Endpoint::hosts));
            Identity::self_signed(&hosts)?
        }
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
        tokio::select! {
            published = publish(client, &conversion) => published?,
            () = shutdown.cancelled() => return Ok(()),
        }
        info!(?endpoint, "MyApp CRD now converts through this webhook");
    }
    ready.open();
    let service = TowerToHyperService::new(router());
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    debug!(error = %e, "accept failed");
                    continue;
                }
            },
            () = shutdown.cancelled() => return Ok(()),
        };
        let acceptor = acceptor.clone();
        let service = service.clone();
        tokio::spawn(async move {
            let tls = match acceptor.accept(stream).await {
                Ok(tls) => tls,
                Err(e) => return debug!(%peer, error = %e, "TLS handshake failed"),
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
}
