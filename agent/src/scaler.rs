//! The seed's KEDA external scaler (issue 22 item 3): the agent serves KEDA's
//! `externalscaler.ExternalScaler` gRPC interface on `--scaler-addr` (port 9090 in the
//! member install, port `scaler` of the Service `flotilla-agent`), so that a ScaledObject
//! with an `external` trigger scales a MyApp by a metric the MyApp's own pods export.
//!
//! The trigger's metadata (KEDA passes it on every call):
//! - `metricName` (required): the series the app's pods export in Prometheus text, e.g.
//!   the seed's `custom_metric_queue_length`;
//! - `threshold` (required, > 0): the metric's target per replica (the HPA's
//!   AverageValue), e.g. the seed's `"100"`;
//! - `myApp` (required): the MyApp, in the ScaledObject's namespace, whose pods are read
//!   (the seed's names are mapped by adding it);
//! - `activationThreshold` (default 0): the scaler is active above it;
//! - `metricsPort` (default 8080) and `metricsPath` (default `/metrics`): where each pod
//!   serves its metrics;
//! - `aggregation` (default `sum`): how the pods' readings combine: `sum` (each pod
//!   reports its own backlog), `max` or `average` (each reports the same shared queue);
//! - `metricScope` (default `cluster`): `federation` when the metric is global (one queue
//!   every cluster's pods read): the value answered is then this cluster's share of it,
//!   the MyApp's `flotilla.io/autoscaling-metric-share` (see [`flotilla_crds::bounds`]),
//!   so that the clusters together scale once. A MyApp without it is read whole (warned
//!   once).
//!
//! A reading lists the MyApp's Ready pods (by the Deployment's selector labels) and GETs
//! each one's metrics (2 s each, 1 MiB at most); pods that do not answer, or export no
//! such series, are left out and logged; with none left the call fails (KEDA then keeps
//! its last decision or its fallback), since no answer is not a zero. Only MyApps the
//! agent would apply are read: a namespace the tenancy policy forbids, or outside the
//! operator's `--namespace`, is refused.

use std::collections::{BTreeSet, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use flotilla_crds::MyApp;
use flotilla_crds::bounds::{Bounds, SHARE_ANNOTATION};
use flotilla_crds::tenancy::NamespacePolicy;
use flotilla_proto::externalscaler::external_scaler_server::{
    ExternalScaler, ExternalScalerServer,
};
use flotilla_proto::externalscaler::{
    GetMetricSpecResponse, GetMetricsRequest, GetMetricsResponse, IsActiveResponse, MetricSpec,
    MetricValue, ScaledObjectRef,
};
use futures::{StreamExt, stream};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::operator::Namespaces;
use crate::operator::children::selector_labels;

/// One pod's metrics: answered within this, or left out.
const POD_TIMEOUT: Duration = Duration::from_secs(2);
/// One pod's metrics text is read up to this; a larger body leaves the pod out.
const BODY_MAX: usize = 1 << 20;
/// Pods read at once.
const CONCURRENT_READS: usize = 16;
/// How often `StreamIsActive` reads the metric again (it sends only changes).
const STREAM_EVERY: Duration = Duration::from_secs(5);

/// How the pods' readings combine into the MyApp's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aggregation {
    Sum,
    Max,
    Average,
}

impl Aggregation {
    fn of(self, values: &[f64]) -> f64 {
        match self {
            Aggregation::Sum => values.iter().sum(),
            Aggregation::Max => values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            Aggregation::Average => values.iter().sum::<f64>() / values.len() as f64,
        }
    }
}

/// Whose the metric is: this cluster's, or the federation's (this cluster answers its
/// share).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricScope {
    Cluster,
    Federation,
}

impl MetricScope {
    /// The value this cluster answers for `reading`: under `Federation` its share of
    /// it, whole when the MyApp carries no `bounds`.
    pub fn value(self, reading: f64, bounds: Option<&Bounds>) -> f64 {
        match (self, bounds) {
            (MetricScope::Federation, Some(bounds)) => bounds.share_of(reading),
            _ => reading,
        }
    }
}

/// A ScaledObject trigger's metadata, read.
#[derive(Debug, Clone, PartialEq)]
pub struct Trigger {
    pub myapp: String,
    pub metric: String,
    pub threshold: f64,
    pub activation: f64,
    pub port: u16,
    pub path: String,
    pub aggregation: Aggregation,
    pub scope: MetricScope,
}

impl Trigger {
    /// The trigger of `so`, or an error naming the ScaledObject and the key at fault.
    pub fn parse(so: &ScaledObjectRef) -> Result<Trigger, String> {
        let meta = &so.scaler_metadata;
        let at = |key: &str| {
            format!(
                "ScaledObject {}/{}: trigger metadata {key}",
                so.namespace, so.name
            )
        };
        let required = |key: &str| {
            (meta.get(key).map(|v| v.trim()))
                .filter(|v| !v.is_empty())
                .map(str::to_owned)
                .ok_or_else(|| format!("{} is required", at(key)))
        };
        let number = |key: &str, default: f64| -> Result<f64, String> {
            match meta.get(key) {
                None => Ok(default),
                Some(v) => (v.trim().parse::<f64>().ok())
                    .filter(|n| n.is_finite() && *n >= 0.0)
                    .ok_or_else(|| format!("{} {v:?}: not a number ≥ 0", at(key))),
            }
        };
        let threshold = number("threshold", 0.0)?;
        if !meta.contains_key("threshold") || threshold <= 0.0 {
            return Err(format!("{} must be a number > 0", at("threshold")));
        }
        let port = match meta.get("metricsPort") {
            None => 8080,
            Some(v) => (v.trim().parse::<u16>().ok())
                .filter(|p| *p > 0)
                .ok_or_else(|| format!("{} {v:?}: not a port (1-65535)", at("metricsPort")))?,
        };
        let path = meta.get("metricsPath").map_or("/metrics", |p| p.as_str());
        if !path.starts_with('/') || path.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(format!(
                "{} {path:?}: not an absolute path",
                at("metricsPath")
            ));
        }
        let aggregation = match meta.get("aggregation").map(|a| a.trim()) {
            None | Some("sum") => Aggregation::Sum,
            Some("max") => Aggregation::Max,
            Some("average") => Aggregation::Average,
            Some(other) => {
                return Err(format!(
                    "{} {other:?}: one of sum, max, average",
                    at("aggregation")
                ));
            }
        };
        let scope = match meta.get("metricScope").map(|s| s.trim()) {
            None | Some("cluster") => MetricScope::Cluster,
            Some("federation") => MetricScope::Federation,
            Some(other) => {
                return Err(format!(
                    "{} {other:?}: one of cluster, federation",
                    at("metricScope")
                ));
            }
        };
        Ok(Trigger {
            myapp: required("myApp")?,
            metric: required("metricName")?,
            threshold,
            activation: number("activationThreshold", 0.0)?,
            port,
            path: path.to_owned(),
            aggregation,
            scope,
        })
    }
}

/// The sum of every series named `metric` in one pod's Prometheus text (a gauge split by
/// labels adds up); `None` if there is none.
pub fn read_metric(text: &str, metric: &str) -> Option<f64> {
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).ok()?;
    let values: Vec<f64> = (scrape.samples.iter())
        .filter(|s| s.metric == metric)
        .filter_map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => Some(v),
            _ => None,
        })
        .filter(|v| v.is_finite())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// Which MyApps the scaler reads: those the agent would apply.
#[derive(Debug, Clone)]
pub struct Scope {
    /// The operator's `--namespace` (all when empty).
    pub operator: Namespaces,
    /// The session's tenancy policy (none for `flotilla-agent operator`).
    pub tenancy: Option<NamespacePolicy>,
}

impl Scope {
    pub fn admits(&self, namespace: &str) -> Result<(), String> {
        if let Namespaces::Only(only) = &self.operator
            && !only.iter().any(|n| n == namespace)
        {
            return Err(format!(
                "namespace {namespace:?} is outside the operator's --namespace"
            ));
        }
        match &self.tenancy {
            Some(policy) => policy.check(namespace).map_err(|f| f.to_string()),
            None => Ok(()),
        }
    }

    /// The namespaces whose HorizontalPodAutoscalers the agent watches: those of the
    /// MyApps its operator reconciles and those its session may apply; `None` for every
    /// namespace.
    pub fn autoscaler_namespaces(&self) -> Option<BTreeSet<String>> {
        let Namespaces::Only(operator) = &self.operator else {
            return None;
        };
        let mut namespaces: BTreeSet<String> = operator.iter().cloned().collect();
        if let Some(policy) = &self.tenancy {
            namespaces.extend(policy.allowed()?.iter().cloned());
        }
        Some(namespaces)
    }
}

/// The service: reads MyApps' pods through the member's apiserver.
#[derive(Clone)]
pub struct Scaler {
    client: kube::Client,
    scope: Arc<Scope>,
    http: HttpClient<HttpConnector, Empty<Bytes>>,
    /// MyApps read whole under `metricScope: federation` (no share), already warned of.
    read_whole: Arc<Mutex<HashSet<String>>>,
}

impl Scaler {
    pub fn new(client: kube::Client, scope: Scope) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(POD_TIMEOUT));
        Self {
            client,
            scope: Arc::new(scope),
            http: HttpClient::builder(TokioExecutor::new()).build(connector),
            read_whole: Arc::default(),
        }
    }

    /// The trigger of `so`, if its namespace is in scope.
    fn trigger(&self, so: &ScaledObjectRef) -> Result<Trigger, Status> {
        let trigger = Trigger::parse(so).map_err(Status::invalid_argument)?;
        (self.scope.admits(&so.namespace)).map_err(|why| {
            Status::permission_denied(format!("ScaledObject {}/{}: {why}", so.namespace, so.name))
        })?;
        Ok(trigger)
    }

    /// The value KEDA gets now: the MyApp's, or under `metricScope: federation` this
    /// cluster's share of it.
    pub async fn value(&self, namespace: &str, t: &Trigger) -> Result<f64, Status> {
        let bounds = match t.scope {
            MetricScope::Cluster => None,
            MetricScope::Federation => self.share(namespace, &t.myapp).await?,
        };
        Ok(t.scope
            .value(self.measure(namespace, t).await?, bounds.as_ref()))
    }

    /// The bounds (with the metric share) on the MyApp `name`; none is warned of once.
    /// Read live, as the pods are: KEDA asks once per ScaledObject per polling interval
    /// (30 s by default), and the scaler serves on standby replicas too, where a cache
    /// would mean a watch of every MyApp and Pod on each replica to save one GET.
    async fn share(&self, namespace: &str, name: &str) -> Result<Option<Bounds>, Status> {
        let app = Api::<MyApp>::namespaced(self.client.clone(), namespace)
            .get(name)
            .await
            .map_err(|e| Status::unavailable(format!("reading MyApp {namespace}/{name}: {e}")))?;
        let bounds = Bounds::of(app.annotations())
            .map_err(|e| Status::failed_precondition(format!("MyApp {namespace}/{name}: {e}")))?;
        let myapp = format!("{namespace}/{name}");
        if bounds.is_some() {
            self.read_whole.lock().remove(&myapp);
        } else if self.read_whole.lock().insert(myapp.clone()) {
            warn!(%myapp, "metricScope federation, but the MyApp carries no {SHARE_ANNOTATION}: its metric is read whole");
        }
        Ok(bounds)
    }

    /// The MyApp's value now: its Ready pods' readings, combined.
    pub async fn measure(&self, namespace: &str, t: &Trigger) -> Result<f64, Status> {
        let selector = (selector_labels(&t.myapp).iter())
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        let pods = Api::<Pod>::namespaced(self.client.clone(), namespace)
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| {
                Status::unavailable(format!(
                    "listing the pods of MyApp {namespace}/{}: {e}",
                    t.myapp
                ))
            })?;
        let ips: Vec<String> = pods.items.iter().filter_map(ready_ip).collect();
        let readings: Vec<Result<f64, String>> = stream::iter(ips.iter().cloned())
            .map(|ip| self.read_pod(ip, t))
            .buffer_unordered(CONCURRENT_READS)
            .collect()
            .await;
        let (values, failures): (Vec<_>, Vec<_>) = readings.into_iter().partition(Result::is_ok);
        let values: Vec<f64> = values.into_iter().flatten().collect();
        let failures: Vec<String> = failures.into_iter().filter_map(Result::err).collect();
        if values.is_empty() {
            return Err(Status::unavailable(format!(
                "MyApp {namespace}/{}: no Ready pod gave {} ({} Ready; {})",
                t.myapp,
                t.metric,
                ips.len(),
                if failures.is_empty() {
                    "none to read".to_owned()
                } else {
                    failures.join("; ")
                }
            )));
        }
        if !failures.is_empty() {
            warn!(myapp = %format!("{namespace}/{}", t.myapp), metric = %t.metric, left_out = ?failures, "pods left out of the scaler's reading");
        }
        Ok(t.aggregation.of(&values))
    }

    async fn read_pod(&self, ip: String, t: &Trigger) -> Result<f64, String> {
        let host = if ip.contains(':') {
            format!("[{ip}]")
        } else {
            ip.to_owned()
        };
        let url = format!("http://{host}:{}{}", t.port, t.path);
        let get = async {
            let uri = url.parse().map_err(|e| format!("{e}"))?;
            let response = self.http.get(uri).await.map_err(|e| e.to_string())?;
            if !response.status().is_success() {
                return Err(format!("answered {}", response.status()));
            }
            let body = Limited::new(response.into_body(), BODY_MAX)
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            let text = String::from_utf8_lossy(&body);
            read_metric(&text, &t.metric).ok_or_else(|| format!("exports no series {}", t.metric))
        };
        match tokio::time::timeout(POD_TIMEOUT, get).await {
            Ok(reading) => reading.map_err(|e| format!("GET {url}: {e}")),
            Err(_) => Err(format!("GET {url}: no answer within {POD_TIMEOUT:?}")),
        }
    }
}

/// A pod that serves: Ready, not being deleted, with an IP.
fn ready_ip(pod: &Pod) -> Option<String> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready =
        (status.conditions.iter().flatten()).any(|c| c.type_ == "Ready" && c.status == "True");
    ready
        .then(|| status.pod_ip.clone())
        .flatten()
        .filter(|ip| !ip.is_empty())
}

#[tonic::async_trait]
impl ExternalScaler for Scaler {
    async fn is_active(
        &self,
        request: Request<ScaledObjectRef>,
    ) -> Result<Response<IsActiveResponse>, Status> {
        let so = request.into_inner();
        let t = self.trigger(&so)?;
        let value = self.value(&so.namespace, &t).await?;
        Ok(Response::new(IsActiveResponse {
            result: value > t.activation,
        }))
    }

    type StreamIsActiveStream = ReceiverStream<Result<IsActiveResponse, Status>>;

    async fn stream_is_active(
        &self,
        request: Request<ScaledObjectRef>,
    ) -> Result<Response<Self::StreamIsActiveStream>, Status> {
        let so = request.into_inner();
        let t = self.trigger(&so)?;
        let (tx, rx) = mpsc::channel(1);
        let scaler = self.clone();
        tokio::spawn(async move {
            let mut last = None;
            loop {
                // A failed reading says nothing: KEDA keeps what it was last told.
                if let Ok(value) = scaler.value(&so.namespace, &t).await {
                    let active = value > t.activation;
                    if last != Some(active) {
                        last = Some(active);
                        if tx
                            .send(Ok(IsActiveResponse { result: active }))
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                }
                tokio::select! {
                    _ = tx.closed() => return,
                    _ = tokio::time::sleep(STREAM_EVERY) => {}
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn get_metric_spec(
        &self,
        request: Request<ScaledObjectRef>,
    ) -> Result<Response<GetMetricSpecResponse>, Status> {
        let t = self.trigger(&request.into_inner())?;
        Ok(Response::new(GetMetricSpecResponse {
            metric_specs: vec![MetricSpec {
                metric_name: t.metric,
                target_size: t.threshold.ceil() as i64,
                target_size_float: t.threshold,
            }],
        }))
    }

    async fn get_metrics(
        &self,
        request: Request<GetMetricsRequest>,
    ) -> Result<Response<GetMetricsResponse>, Status> {
        let request = request.into_inner();
        let so = request.scaled_object_ref.unwrap_or_default();
        let t = self.trigger(&so)?;
        // KEDA may prefix the name it asks for (`s0-custom_metric_queue_length`); the value
        // is answered under the name asked.
        if !request.metric_name.is_empty() && !request.metric_name.ends_with(&t.metric) {
            return Err(Status::invalid_argument(format!(
                "ScaledObject {}/{}: asked for {:?}, the trigger measures {:?}",
                so.namespace, so.name, request.metric_name, t.metric
            )));
        }
        let value = self.value(&so.namespace, &t).await?;
        let name = if request.metric_name.is_empty() {
            t.metric
        } else {
            request.metric_name
        };
        Ok(Response::new(GetMetricsResponse {
            metric_values: vec![MetricValue {
                metric_name: name,
                metric_value: value.round() as i64,
                metric_value_float: value,
            }],
        }))
    }
}

/// Serves `scaler` on `addr` until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    scaler: Scaler,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the external scaler's address {addr}"))?;
    serve_on(listener, scaler, shutdown).await
}

/// Serves `scaler` on a bound listener until `shutdown`.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    scaler: Scaler,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let addr = listener.local_addr()?;
    info!(scaler = %addr, "serving KEDA's external scaler");
    tonic::transport::Server::builder()
        .add_service(ExternalScalerServer::new(scaler))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown.cancelled_owned(),
        )
        .await
        .with_context(|| format!("serving the external scaler on {addr}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn so(pairs: &[(&str, &str)]) -> ScaledObjectRef {
        ScaledObjectRef {
            name: "my-app-scaler".into(),
            namespace: "default".into(),
            scaler_metadata: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    /// The seed's trigger, with its names mapped (`myApp`).
    fn seed() -> Vec<(&'static str, &'static str)> {
        vec![
            (
                "scalerAddress",
                "flotilla-agent-scaler.flotilla-system:9090",
            ),
            ("metricName", "custom_metric_queue_length"),
            ("threshold", "100"),
            ("myApp", "my-app"),
        ]
    }

    #[test]
    fn the_seed_s_trigger_reads_with_defaults() {
        let t = Trigger::parse(&so(&seed())).unwrap();
        assert_eq!(
            t,
            Trigger {
                myapp: "my-app".into(),
                metric: "custom_metric_queue_length".into(),
                threshold: 100.0,
                activation: 0.0,
                port: 8080,
                path: "/metrics".into(),
                aggregation: Aggregation::Sum,
                scope: MetricScope::Cluster,
            }
        );
    }

    #[test]
    fn bad_metadata_names_the_scaledobject_and_the_key() {
        let without = |key: &str| {
            let pairs: Vec<_> = seed().into_iter().filter(|(k, _)| *k != key).collect();
            Trigger::parse(&so(&pairs)).unwrap_err()
        };
        for key in ["myApp", "metricName", "threshold"] {
            let e = without(key);
            assert!(
                e.contains("ScaledObject default/my-app-scaler") && e.contains(key),
                "{e}"
            );
        }
        let with = |key: &'static str, value: &'static str| {
            let mut pairs = seed();
            pairs.retain(|(k, _)| *k != key);
            pairs.push((key, value));
            Trigger::parse(&so(&pairs))
        };
        for (key, value) in [
            ("threshold", "0"),
            ("threshold", "-5"),
            ("threshold", "NaN"),
            ("threshold", "ten"),
            ("activationThreshold", "-1"),
            ("metricsPort", "0"),
            ("metricsPort", "70000"),
            ("metricsPath", "metrics"),
            ("metricsPath", "/a b"),
            ("aggregation", "median"),
            ("metricScope", "global"),
            ("myApp", "  "),
        ] {
            let e = with(key, value).unwrap_err();
            assert!(e.contains(key), "{key}={value}: {e}");
        }
        let t = with("aggregation", "average").unwrap();
        assert_eq!(t.aggregation, Aggregation::Average);
        assert_eq!(with("threshold", "2.5").unwrap().threshold, 2.5);
        assert_eq!(with("metricsPort", "9100").unwrap().port, 9100);
        let scope = |value| with("metricScope", value).unwrap().scope;
        assert_eq!(scope("federation"), MetricScope::Federation);
        assert_eq!(scope("cluster"), MetricScope::Cluster);
    }

    #[test]
    fn a_federation_s_metric_is_answered_in_this_cluster_s_share() {
        let bounds = Bounds {
            min: 2,
            max: 5,
            parts: 5,
            whole: 16,
        };
        assert_eq!(MetricScope::Federation.value(160.0, Some(&bounds)), 50.0);
        assert_eq!(MetricScope::Federation.value(160.0, None), 160.0, "whole");
        assert_eq!(MetricScope::Cluster.value(160.0, Some(&bounds)), 160.0);
    }

    #[test]
    fn a_pod_s_series_of_one_name_add_up_and_others_are_ignored() {
        let text = "# HELP custom_metric_queue_length Items waiting.\n\
                    # TYPE custom_metric_queue_length gauge\n\
                    custom_metric_queue_length{queue=\"a\"} 120\n\
                    custom_metric_queue_length{queue=\"b\"} 30.5\n\
                    custom_metric_queue_length_total 999\n\
                    other 7\n";
        assert_eq!(read_metric(text, "custom_metric_queue_length"), Some(150.5));
        assert_eq!(read_metric(text, "missing"), None);
        assert_eq!(read_metric("", "custom_metric_queue_length"), None);
        assert_eq!(read_metric("garbage {{{ \n", "garbage"), None);
    }

    #[test]
    fn readings_combine_by_the_trigger_s_aggregation() {
        let values = [10.0, 30.0, 20.0];
        assert_eq!(Aggregation::Sum.of(&values), 60.0);
        assert_eq!(Aggregation::Max.of(&values), 30.0);
        assert_eq!(Aggregation::Average.of(&values), 20.0);
    }

    #[test]
    fn the_scope_refuses_what_the_agent_would_not_apply() {
        let scope = Scope {
            operator: Namespaces::Only(vec!["team-a".into(), "kube-system".into()]),
            tenancy: Some(NamespacePolicy::new(
                "flotilla-system",
                Vec::<String>::new(),
            )),
        };
        assert!(scope.admits("team-a").is_ok());
        assert!(scope.admits("team-b").unwrap_err().contains("--namespace"));
        assert!(scope.admits("kube-system").is_err(), "forbidden by tenancy");
        let open = Scope {
            operator: Namespaces::All,
            tenancy: None,
        };
        assert!(open.admits("anywhere").is_ok());
    }

    /// HPAs are watched where the operator reconciles MyApps and where the session may
    /// apply them: everywhere as soon as either is everywhere.
    #[test]
    fn autoscalers_are_watched_where_the_operator_or_the_session_acts() {
        let only = |n: &[&str]| Namespaces::Only(n.iter().map(|s| s.to_string()).collect());
        let allowing = |n: &[&str]| Some(NamespacePolicy::default().allowing_only(n));
        let set = |n: &[&str]| Some(n.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>());
        let cases = [
            (Namespaces::All, allowing(&["a"]), None),
            (only(&["a"]), None, set(&["a"])),
            (only(&["a"]), Some(NamespacePolicy::default()), None),
            (only(&["a"]), allowing(&["a"]), set(&["a"])),
            (only(&["a"]), allowing(&["b", "c"]), set(&["a", "b", "c"])),
        ];
        for (operator, tenancy, want) in cases {
            let scope = Scope { operator, tenancy };
            assert_eq!(scope.autoscaler_namespaces(), want, "{scope:?}");
        }
    }
}
