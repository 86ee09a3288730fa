//! The MyApp conversion webhook: `POST /convert` (ConversionReview v1) over HTTPS.
//! [`convert`] holds the pure conversion, [`tls`] the serving certificate, [`crd`] how
//! the CRD is pointed at this server.

pub mod convert;
pub mod crd;
pub mod tls;

use std::net::SocketAddr;
use std::path::PathBuf;

use axum::routing::post;
use axum::{Json, Router};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use kube::Client;
use kube::core::conversion::ConversionReview;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

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

pub fn router() -> Router {
    Router::new().route(
        crd::PATH,
        post(|Json(review): Json<ConversionReview>| async { Json(convert::review(review)) }),
    )
}

/// Serves the webhook until `shutdown` fires; opens `ready` once it listens and the CRD
/// points at it.
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
        crd::publish(client, &conversion)
            .await
            .map_err(WebhookError::Publish)?;
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
