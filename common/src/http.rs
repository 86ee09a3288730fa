//! Plain-HTTP endpoints for the kubelet and Prometheus: `/healthz` (the process serves),
//! `/readyz` (every registered component has started), `/metrics`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// Named readiness gates; `/readyz` answers 200 once all of them are open.
#[derive(Clone, Default)]
pub struct Readiness {
    gates: Arc<Mutex<BTreeMap<String, bool>>>,
}

impl Readiness {
    /// Registers a closed gate; the component opens it once it can do its work.
    pub fn gate(&self, name: &str) -> Gate {
        self.lock().insert(name.to_string(), false);
        Gate {
            name: name.to_string(),
            readiness: self.clone(),
        }
    }

    /// The gates still closed, empty when ready.
    pub fn waiting(&self) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|(_, open)| !**open)
            .map(|(name, _)| name.clone())
            .collect()
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, BTreeMap<String, bool>> {
        self.gates.lock()
    }
}

#[derive(Clone)]
pub struct Gate {
    name: String,
    readiness: Readiness,
}

impl Gate {
    pub fn open(&self) {
        self.readiness.lock().insert(self.name.clone(), true);
    }

    /// Closes the gate again (a hub that stopped leading, say).
    pub fn close(&self) {
        self.readiness.lock().insert(self.name.clone(), false);
    }
}

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    readiness: Readiness,
}

pub fn router(metrics: Arc<Metrics>, readiness: Readiness) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(AppState { metrics, readiness })
}

async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    let waiting = state.readiness.waiting();
    if waiting.is_empty() {
        (StatusCode::OK, "ok".to_string())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("waiting for: {}", waiting.join(", ")),
        )
    }
}

async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

/// Serves `router` on `addr` until `shutdown` fires.
pub async fn serve(
    addr: SocketAddr,
    router: Router,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving /healthz, /readyz, /metrics");
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_once_every_gate_is_open() {
        let readiness = Readiness::default();
        assert!(readiness.waiting().is_empty());
        let operator = readiness.gate("operator");
        let webhook = readiness.gate("webhook");
        assert_eq!(readiness.waiting(), ["operator", "webhook"]);
        operator.open();
        assert_eq!(readiness.waiting(), ["webhook"]);
        webhook.open();
        assert!(readiness.waiting().is_empty());
        operator.close();
        assert_eq!(readiness.waiting(), ["operator"]);
    }
}
