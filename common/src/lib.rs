//! What the hub and the agent both run beside their own work: `/healthz`, `/readyz` and
//! `/metrics` (`http`), controller-runtime metric names (`metrics`), logs (`telemetry`)
//! and one shutdown signal (`shutdown`).

pub mod http;
pub mod metrics;
pub mod shutdown;
pub mod telemetry;
