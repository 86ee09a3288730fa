//! Prometheus metrics under controller-runtime's names, so that existing dashboards and
//! the seed's `HighReconciliationErrorRate` alert work unchanged.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    active: Family<ControllerLabels, Gauge>,
    depth: Family<QueueLabels, Gauge>,
    queues: Mutex<HashMap<String, WorkQueue>>,
}

/// What kube-runtime's scheduler holds for one controller, mirrored from the outside
/// (it exposes nothing): the objects due for a reconcile that has not started, each with
/// the earliest time it is due, as the scheduler keeps it. Its depth is what
/// controller-runtime's `workqueue_depth` counts: due and waiting, not running, not
/// requeued for later.
#[derive(Clone, Default)]
pub struct WorkQueue {
    due: Arc<Mutex<HashMap<String, Instant>>>,
}

impl WorkQueue {
    /// A watch event asks for `key` to be reconciled now.
    pub fn triggered(&self, key: String) {
        self.schedule(key, Instant::now());
    }

    /// A reconcile of `key` asked for another one `after` from now.
    pub fn requeued(&self, key: String, after: Duration) {
        self.schedule(key, Instant::now() + after);
    }

    /// `key` left the queue: its reconcile started, or the object is gone.
    pub fn dequeued(&self, key: &str) {
        self.lock().remove(key);
    }

    fn schedule(&self, key: String, at: Instant) {
        self.lock()
            .entry(key)
            .and_modify(|due| *due = (*due).min(at))
            .or_insert(at);
    }

    fn depth(&self, now: Instant) -> usize {
        self.lock().values().filter(|due| **due <= now).count()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        // The map stays consistent whatever panicked while holding it.
        self.due.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let reconciles = Family::<ResultLabels, Counter>::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let duration = Family::<ControllerLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.005, 2.0, 12))
        });
        let active = Family::<ControllerLabels, Gauge>::default();
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
        registry.register(
            "controller_runtime_active_workers",
            "Number of currently used workers per controller",
            active.clone(),
        );
        // Set from each controller's WorkQueue when the metrics are read.
        registry.register(
            "workqueue_depth",
            "Current depth of workqueue",
            depth.clone(),
        );
        // The leader election's (`flotilla_leader_*`), whichever Lease this process elects on.
        crate::leader::register_metrics(&mut registry);
        Self {
            registry,
            reconciles,
            errors,
            duration,
            active,
            depth,
            queues: Mutex::default(),
        }
    }
}

impl Metrics {
    /// The registry, for a component's own metrics; register them before sharing.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// The queue of `controller`, to be told of its triggers and requeues.
    pub fn queue(&self, controller: &str) -> WorkQueue {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        queues.entry(controller.to_string()).or_default().clone()
    }

    /// Prometheus text exposition of every registered metric.
    pub fn encode(&self) -> String {
        let now = Instant::now();
        for (name, queue) in self.queues.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let depth = i64::try_from(queue.depth(now)).unwrap_or(i64::MAX);
            self.depth
                .get_or_create(&QueueLabels { name: name.clone() })
                .set(depth);
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }

    /// Starts timing one reconcile of `key` by `controller`, taking it off the queue. It
    /// is recorded when the returned guard drops: as a success, as an error of the kind
    /// given to [`Reconcile::failed`], or as `cancelled` when the reconcile future was
    /// dropped before it finished.
    pub fn reconcile(self: &Arc<Self>, controller: &str, key: &str) -> Reconcile {
        self.queue(controller).dequeued(key);
        self.active
            .get_or_create(&ControllerLabels {
                controller: controller.to_string(),
            })
            .inc();
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
        m.active
            .get_or_create(&ControllerLabels {
                controller: self.controller.clone(),
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
        metrics.reconcile("myapp", "ns/a").succeeded();
        metrics.reconcile("myapp", "ns/a").failed("apply");
        let running = metrics.reconcile("myapp", "ns/b");
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
        assert!(text.contains(r#"controller_runtime_active_workers{controller="myapp"} 1"#));
        assert!(
            text.contains(r#"workqueue_depth{name="myapp"} 0"#),
            "a running reconcile is not queued: {text}"
        );
        drop(running);
        let text = metrics.encode();
        assert!(text.contains(r#"controller_runtime_active_workers{controller="myapp"} 0"#));
        assert!(
            text.contains(
                r#"controller_runtime_reconcile_total{controller="myapp",result="cancelled"} 1"#
            ),
            "a reconcile dropped before it finished is still counted"
        );
    }

    fn depth(metrics: &Metrics) -> String {
        let text = metrics.encode();
        text.lines()
            .find(|l| l.starts_with(r#"workqueue_depth{name="myapp"}"#))
            .unwrap_or_else(|| panic!("no depth in {text}"))
            .rsplit(' ')
            .next()
            .unwrap()
            .to_string()
    }

    #[test]
    fn depth_counts_each_due_object_once_until_its_reconcile_starts() {
        let metrics = Arc::new(Metrics::default());
        let queue = metrics.queue("myapp");
        assert_eq!(depth(&metrics), "0");
        queue.triggered("ns/a".into());
        queue.triggered("ns/a".into());
        queue.triggered("ns/b".into());
        assert_eq!(
            depth(&metrics),
            "2",
            "one entry per object, as in the scheduler"
        );
        queue.requeued("ns/c".into(), Duration::from_secs(3600));
        assert_eq!(
            depth(&metrics),
            "2",
            "a requeue for later is not in the queue yet"
        );
        queue.requeued("ns/a".into(), Duration::from_secs(3600));
        assert_eq!(depth(&metrics), "2", "the earliest due time wins");
        let a = metrics.reconcile("myapp", "ns/a");
        assert_eq!(depth(&metrics), "1");
        queue.triggered("ns/a".into());
        assert_eq!(
            depth(&metrics),
            "2",
            "a change while running queues it again"
        );
        drop(a);
        queue.dequeued("ns/b"); // gone before its turn
        queue.requeued("ns/d".into(), Duration::ZERO);
        assert_eq!(depth(&metrics), "2", "ns/a again and ns/d, due now");
        queue.triggered("ns/c".into());
        assert_eq!(
            depth(&metrics),
            "3",
            "a trigger brings a later requeue forward"
        );
    }
}
