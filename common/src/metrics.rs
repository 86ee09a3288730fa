//! Prometheus metrics under controller-runtime's names, so that existing dashboards and
//! the seed's `HighReconciliationErrorRate` alert work unchanged.

use std::sync::Arc;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabels {
    controller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    controller: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    controller: String,
    error: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    name: String,
}

/// The process's metric registry; every component registers into it at start.
pub struct Metrics {
    registry: Registry,
    reconciles: Family<ResultLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    duration: Family<ControllerLabels, Histogram>,
    depth: Family<QueueLabels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let reconciles = Family::<ResultLabels, Counter>::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let duration = Family::<ControllerLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.005, 2.0, 12))
        });
        let depth = Family::<QueueLabels, Gauge>::default();
        // The `_total` suffix is added by the encoder.
        registry.register(
            "controller_runtime_reconcile",
            "Total number of reconciliations per controller",
            reconciles.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_errors",
            "Total number of reconciliation errors per controller",
            errors.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_time_seconds",
            "Length of time per reconciliation per controller",
            duration.clone(),
        );
        // kube-runtime does not expose its scheduler queue; the gauge counts the objects
        // whose reconcile has started and not finished.
        registry.register(
            "workqueue_depth",
            "Current depth of workqueue",
            depth.clone(),
        );
        Self {
            registry,
            reconciles,
            errors,
            duration,
            depth,
        }
    }
}

impl Metrics {
    /// The registry, for a component's own metrics; register them before sharing.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// Prometheus text exposition of every registered metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }

    /// Starts timing one reconcile of `controller`. It is recorded when the returned
    /// guard drops: as a success, as an error of the kind given to [`Reconcile::failed`],
    /// or as `cancelled` when the reconcile future was dropped before it finished.
    pub fn reconcile(self: &Arc<Self>, controller: &str) -> Reconcile {
        let labels = QueueLabels {
            name: controller.to_string(),
        };
        self.depth.get_or_create(&labels).inc();
        Reconcile {
            metrics: self.clone(),
            controller: controller.to_string(),
            start: Instant::now(),
            outcome: None,
        }
    }
}

/// One reconcile in flight.
pub struct Reconcile {
    metrics: Arc<Metrics>,
    controller: String,
    start: Instant,
    outcome: Option<Result<(), &'static str>>,
}

impl Reconcile {
    pub fn succeeded(&mut self) {
        self.outcome = Some(Ok(()));
    }

    /// `kind` names the class of error (a short snake_case word), as a label.
    pub fn failed(&mut self, kind: &'static str) {
        self.outcome = Some(Err(kind));
    }
}

impl Drop for Reconcile {
    fn drop(&mut self) {
        let m = &self.metrics;
        let result = match self.outcome {
            Some(Ok(())) => "success",
            Some(Err(_)) => "error",
            None => "cancelled",
        };
        m.reconciles
            .get_or_create(&ResultLabels {
                controller: self.controller.clone(),
                result,
            })
            .inc();
        if let Some(Err(error)) = self.outcome {
            m.errors
                .get_or_create(&ErrorLabels {
                    controller: self.controller.clone(),
                    error,
                })
                .inc();
        }
        m.duration
            .get_or_create(&ControllerLabels {
                controller: self.controller.clone(),
            })
            .observe(self.start.elapsed().as_secs_f64());
        m.depth
            .get_or_create(&QueueLabels {
                name: self.controller.clone(),
            })
            .dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposes_controller_runtime_names() {
        let metrics = Arc::new(Metrics::default());
        metrics.reconcile("myapp").succeeded();
        metrics.reconcile("myapp").failed("apply");
        let pending = metrics.reconcile("myapp");
        let text = metrics.encode();
        assert!(
            text.contains(
                r#"controller_runtime_reconcile_total{controller="myapp",result="success"} 1"#
            ),
            "{text}"
        );
        assert!(text.contains(
            r#"controller_runtime_reconcile_total{controller="myapp",result="error"} 1"#
        ));
        assert!(text.contains(
            r#"controller_runtime_reconcile_errors_total{controller="myapp",error="apply"} 1"#
        ));
        assert!(
            text.contains(
                r#"controller_runtime_reconcile_time_seconds_count{controller="myapp"} 2"#
            )
        );
        assert!(text.contains(r#"workqueue_depth{name="myapp"} 1"#));
        drop(pending);
        let text = metrics.encode();
        assert!(text.contains(r#"workqueue_depth{name="myapp"} 0"#));
        assert!(
            text.contains(
                r#"controller_runtime_reconcile_total{controller="myapp",result="cancelled"} 1"#
            ),
            "a reconcile dropped before it finished is still counted"
        );
    }
}
