//! What the hub and the agent both run beside their own work: `/healthz`, `/readyz` and
//! `/metrics` (`http`), controller-runtime metric names (`metrics`), logs (`telemetry`),
//! one shutdown signal (`shutdown`), task supervision (`supervise`), coalesced status
//! writes (`coalesce`), a private CA for TLS endpoints (`tls`), and the
//! `--kubeconfig`/`--context` flags (`kubeconfig`), the `--forbidden-namespace` flag (`tenancy`), when a watch has listed (`listed`), and which replica is active (`leader`).

pub mod coalesce;
pub mod http;
pub mod kubeconfig;
pub mod leader;
pub mod listed;
pub mod metrics;
pub mod shutdown;
pub mod supervise;
pub mod telemetry;
pub mod tenancy;
pub mod tls;
