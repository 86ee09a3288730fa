//! The election's metrics, per Lease: process-wide, so that every registry built by
//! `crate::metrics::Metrics` exports them without the callers of `elect` passing one.

use std::sync::LazyLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeaseLabels {
    /// `namespace/name` of the Lease.
    lease: String,
}

#[derive(Default)]
struct Families {
    transitions: Family<LeaseLabels, Counter>,
    leading: Family<LeaseLabels, Gauge>,
    failed: Family<LeaseLabels, Counter>,
}

static FAMILIES: LazyLock<Families> = LazyLock::new(Families::default);

/// Registers the election's metrics into `registry`.
pub fn register(registry: &mut Registry) {
    let f = &*FAMILIES;
    // The `_total` suffix is added by the encoder.
    registry.register(
        "flotilla_leader_transitions",
        "Times this process started or stopped leading, per Lease",
        f.transitions.clone(),
    );
    registry.register(
        "flotilla_leader_is_leader",
        "1 while this process leads, per Lease",
        f.leading.clone(),
    );
    registry.register(
        "flotilla_leader_failed_attempts",
        "Attempts to acquire or renew the Lease that failed or timed out (a leader steps down only after the renew deadline)",
        f.failed.clone(),
    );
}

/// One Lease's series.
#[derive(Clone, Debug)]
pub struct LeaseMetrics {
    transitions: Counter,
    leading: Gauge,
    failed: Counter,
}

impl LeaseMetrics {
    pub fn new(lease: &str) -> Self {
        let labels = LeaseLabels {
            lease: lease.to_owned(),
        };
        let f = &*FAMILIES;
        let m = Self {
            transitions: f.transitions.get_or_create(&labels).clone(),
            leading: f.leading.get_or_create(&labels).clone(),
            failed: f.failed.get_or_create(&labels).clone(),
        };
        m.leading.set(0);
        m
    }

    pub fn leading(&self, leading: bool) {
        self.transitions.inc();
        self.leading.set(i64::from(leading));
    }

    pub fn failed(&self) {
        self.failed.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registry_exports_the_series_of_every_lease() {
        let mut registry = Registry::default();
        register(&mut registry);
        let m = LeaseMetrics::new("ns/metrics-test");
        m.leading(true);
        m.leading(false);
        m.leading(true);
        m.failed();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "flotilla_leader_transitions_total{lease=\"ns/metrics-test\"} 3",
            "flotilla_leader_is_leader{lease=\"ns/metrics-test\"} 1",
            "flotilla_leader_failed_attempts_total{lease=\"ns/metrics-test\"} 1",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }
}
