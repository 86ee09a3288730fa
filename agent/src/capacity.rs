//! Capacity: the member cluster's room for more pods, from the nodes' allocatable CPU
//! and memory minus what the pods bound to them request. The hub divides replicas by it
//! (`replicaScheduling.mode: Capacity`), so no scheduler-estimator runs in the member.
//!
//! Counted nodes are Ready and not cordoned; counted pods are bound to one of them and
//! not finished. A pod requests what the kube-scheduler charges it: the larger of its
//! containers' sum and its largest init container, plus its overhead. Taints, affinity
//! and per-node pod limits are not modelled: this is an estimate, and the member's own
//! scheduler still decides.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_common::listed::{self, Listed};
use flotilla_crds::member::{ClusterCapacity, QuantityError, Resources};
use flotilla_proto::v1 as pb;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::NamespaceResourceScope;
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde::{Deserialize, Deserializer};
use tracing::{debug, warn};

/// A Pod as the capacity watch decodes and keeps it: only what [`compute`] reads (the
/// node it is bound to, its phase, and its containers', init containers' and overhead's
/// CPU and memory requests), so that the agent's footprint does not grow with the pods'
/// specs. The rest of the object is skipped while decoding; the metadata is decoded
/// whole (the reflector needs an [`ObjectMeta`]), then trimmed ([`trim_pod`]).
///
/// It is the `v1` `Pod` resource to kube ([`kube::Resource`] by hand below), so that
/// kube's own watcher and reflector (lists, relists, watch resumption) run on it.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ChargedPod {
    #[serde(default, deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: Option<ChargedPodSpec>,
    #[serde(default)]
    pub status: Option<ChargedPodStatus>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChargedPodSpec {
    #[serde(default)]
    pub node_name: Option<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub containers: Vec<ChargedContainer>,
    #[serde(default)]
    pub init_containers: Option<Vec<ChargedContainer>>,
    #[serde(default)]
    pub overhead: Option<ChargedQuantities>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct ChargedContainer {
    #[serde(default, deserialize_with = "null_as_default")]
    pub name: String,
    #[serde(default)]
    pub resources: Option<ChargedResources>,
}

/// A container's `resources`, without its limits and claims.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ChargedResources {
    #[serde(default)]
    pub requests: Option<ChargedQuantities>,
}

/// The two entries of a resource list that [`Resources::from_list`] reads; the others
/// (`ephemeral-storage`, extended resources) are skipped while decoding. Two fields
/// rather than a map: a `BTreeMap`'s first entry allocates a node of ~540 bytes, nearly
/// as much as all the rest of a pod kept here.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ChargedQuantities {
    #[serde(default)]
    pub cpu: Option<Quantity>,
    #[serde(default)]
    pub memory: Option<Quantity>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct ChargedPodStatus {
    #[serde(default)]
    pub phase: Option<String>,
}

impl ChargedQuantities {
    /// As [`Resources::from_list`] reads the list these came from (a list of two at
    /// most, built for the call: the figures and the errors are that function's own).
    fn resources(&self) -> Result<Resources, QuantityError> {
        let list: BTreeMap<String, Quantity> = [("cpu", &self.cpu), ("memory", &self.memory)]
            .into_iter()
            .filter_map(|(key, q)| Some((key.to_owned(), q.clone()?)))
            .collect();
        Resources::from_list(&list)
    }
}

/// `null` as an absent field, as k8s-openapi decodes the fields it defaults.
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// The `v1` `Pod` resource (namespaced), as k8s-openapi declares it for [`Pod`].
impl kube::Resource for ChargedPod {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        <Pod as k8s_openapi::Resource>::KIND.into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        <Pod as k8s_openapi::Resource>::GROUP.into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        <Pod as k8s_openapi::Resource>::VERSION.into()
    }

    fn api_version(_: &()) -> Cow<'_, str> {
        <Pod as k8s_openapi::Resource>::API_VERSION.into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        <Pod as k8s_openapi::Resource>::URL_PATH_SEGMENT.into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The cluster's capacity now, and what could not be read (naming the node or pod and
/// the field), so that a typo in one object shows rather than skewing the sum silently.
pub fn compute(nodes: &[Arc<Node>], pods: &[Arc<ChargedPod>]) -> (ClusterCapacity, Vec<String>) {
    let mut problems = Vec::new();
    let mut free: BTreeMap<String, (Resources, Resources)> = BTreeMap::new();
    for node in nodes.iter().filter(|n| schedulable(n)) {
        let name = node.name_any();
        let allocatable = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
        let allocatable = match allocatable.map(Resources::from_list).transpose() {
            Ok(a) => a.unwrap_or_default(),
            Err(e) => {
                problems.push(format!("node {name}: status.allocatable.{e}"));
                continue;
            }
        };
        free.insert(name, (allocatable, Resources::default()));
    }
    for pod in pods.iter().filter(|p| !finished(p)) {
        let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()) else {
            continue;
        };
        let Some((_, requested)) = free.get_mut(node) else {
            continue;
        };
        match pod_request(pod) {
            Ok(r) => *requested = requested.saturating_add(r),
            Err(e) => problems.push(format!(
                "pod {}/{}: {e}",
                pod.namespace().unwrap_or_default(),
                pod.name_any()
            )),
        }
    }
    let mut capacity = ClusterCapacity {
        nodes: free.len() as i32,
        ..ClusterCapacity::default()
    };
    for (allocatable, requested) in free.values() {
        capacity.allocatable = capacity.allocatable.saturating_add(*allocatable);
        capacity.requested = capacity.requested.saturating_add(*requested);
        let left = Resources {
            cpu_millis: (allocatable.cpu_millis - requested.cpu_millis).max(0),
            memory_bytes: (allocatable.memory_bytes - requested.memory_bytes).max(0),
        };
        capacity.largest_free = capacity.largest_free.max(left);
    }
    (capacity, problems)
}

fn schedulable(node: &Node) -> bool {
    let cordoned = node
        .spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false);
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    ready && !cordoned
}

fn finished(pod: &ChargedPod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, Some("Succeeded" | "Failed"))
}

/// What the kube-scheduler charges a pod: max(sum of containers, largest init
/// container) + overhead, per resource.
pub fn pod_request(pod: &ChargedPod) -> Result<Resources, String> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(Resources::default());
    };
    let requests = |c: &ChargedContainer, field: &str| {
        let list = c.resources.as_ref().and_then(|r| r.requests.as_ref());
        list.map(ChargedQuantities::resources)
            .transpose()
            .map(Option::unwrap_or_default)
            .map_err(|e| format!("spec.{field}[{}].resources.requests.{e}", c.name))
    };
    let mut sum = Resources::default();
    for c in &spec.containers {
        sum = sum.saturating_add(requests(c, "containers")?);
    }
    let mut init = Resources::default();
    for c in spec.init_containers.iter().flatten() {
        init = init.max(requests(c, "initContainers")?);
    }
    let overhead = spec
        .overhead
        .as_ref()
        .map(ChargedQuantities::resources)
        .transpose()
        .map_err(|e| format!("spec.overhead.{e}"))?
        .unwrap_or_default();
    Ok(sum.max(init).saturating_add(overhead))
}

pub fn to_pb(c: &ClusterCapacity) -> pb::Capacity {
    let r = |r: &Resources| pb::Resources {
        cpu_millis: r.cpu_millis,
        memory_bytes: r.memory_bytes,
    };
    pb::Capacity {
        nodes: c.nodes,
        allocatable: Some(r(&c.allocatable)),
        requested: Some(r(&c.requested)),
        largest_free: Some(r(&c.largest_free)),
    }
}

/// Sends a capacity only when it moved by a quantum ([`ClusterCapacity::moved`]: a node
/// came or went, or a figure moved by at least 5 % and one default request) since the
/// last one sent, and at most once per `interval`; a new session starts a new limiter,
/// so the hub always hears the current value first. Pods coming and going one at a time
/// are no news: a quiet cluster sends nothing.
#[derive(Debug)]
pub struct Limiter {
    interval: Duration,
    last: Option<(Instant, ClusterCapacity)>,
}

impl Limiter {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: None,
        }
    }

    /// Whether `capacity` should go out at `now`; if so it counts as sent.
    pub fn admit(&mut self, capacity: &ClusterCapacity, now: Instant) -> bool {
        let send = match &self.last {
            None => true,
            Some((at, sent)) => {
                ClusterCapacity::moved(sent, capacity) && now.duration_since(*at) >= self.interval
            }
        };
        if send {
            self.last = Some((now, capacity.clone()));
        }
        send
    }
}

/// Nodes and unfinished pods, cached (trimmed to what [`compute`] reads, the pods decoded
/// as [`ChargedPod`]s: the agent's footprint must not grow with the pods' specs).
#[derive(Clone)]
pub struct Source {
    nodes: Store<Node>,
    pods: Store<ChargedPod>,
    listed: [Listed; 2],
}

impl Source {
    /// The capacity now; None until both watches have listed (a partial list would
    /// report room that is not there, or none that is).
    pub fn now(&self) -> Option<ClusterCapacity> {
        if !self.listed.iter().all(Listed::is_listed) {
            return None;
        }
        let (capacity, problems) = compute(&self.nodes.state(), &self.pods.state());
        for problem in problems {
            debug!(%problem, "left out of the capacity");
        }
        Some(capacity)
    }
}

/// The capacity source, and the watches that keep it current: run the future in the
/// agent's process. A watch error (e.g. RBAC without nodes or pods) is logged and
/// retried with backoff; the hub then has no capacity for this cluster.
pub fn watch(client: Client) -> (Source, impl Future<Output = ()> + Send + 'static) {
    let (nodes, node_writer) = reflector::store::<Node>();
    let (pods, pod_writer) = reflector::store::<ChargedPod>();
    let (node_events, nodes_listed) = listed::track(
        reflector(
            node_writer,
            watcher(Api::<Node>::all(client.clone()), watcher::Config::default()).modify(trim_node),
        )
        .default_backoff(),
    );
    let unfinished = watcher::Config::default()
        .fields("status.phase!=Succeeded,status.phase!=Failed,spec.nodeName!=");
    let (pod_events, pods_listed) = listed::track(
        reflector(
            pod_writer,
            watcher(Api::<ChargedPod>::all(client), unfinished).modify(trim_pod),
        )
        .default_backoff(),
    );
    let run = futures::stream::select(node_events.map_ok(drop), pod_events.map_ok(drop)).for_each(
        |event| async move {
            if let Err(e) = event {
                warn!(error = %e, "watching nodes and pods for the cluster's capacity");
            }
        },
    );
    let source = Source {
        nodes,
        pods,
        listed: [nodes_listed, pods_listed],
    };
    (source, run)
}

fn trim_node(node: &mut Node) {
    node.metadata.managed_fields = None;
    node.metadata.annotations = None;
    node.metadata.labels = None;
    if let Some(s) = node.status.as_mut() {
        s.images = None;
        s.capacity = None;
        s.node_info = None;
        s.addresses = None;
        s.volumes_attached = None;
        s.volumes_in_use = None;
        s.daemon_endpoints = None;
    }
}

/// Drops what decoding a [`ChargedPod`] still keeps and [`compute`] does not read: the
/// metadata beyond the pod's identity.
fn trim_pod(pod: &mut ChargedPod) {
    pod.metadata.managed_fields = None;
    pod.metadata.annotations = None;
    pod.metadata.labels = None;
    pod.metadata.owner_references = None;
    pod.metadata.finalizers = None;
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        Container, NodeCondition, NodeSpec, NodeStatus, PodSpec, PodStatus, ResourceRequirements,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, OwnerReference};
    use proptest::prelude::*;

    /// Today's algorithm over full k8s-openapi `Pod`s, moved here unchanged from when the
    /// watch kept whole (trimmed) `Pod`s: the oracle that the [`ChargedPod`] path is held
    /// to (`slim_pods_are_charged_as_full_pods`).
    mod full_pod {
        use std::collections::BTreeMap;
        use std::sync::Arc;

        use flotilla_crds::member::{ClusterCapacity, Resources};
        use k8s_openapi::api::core::v1::{Container, Node, Pod};
        use kube::ResourceExt;

        /// The cluster's capacity now, and what could not be read (naming the node or pod and
        /// the field), so that a typo in one object shows rather than skewing the sum silently.
        pub fn compute(nodes: &[Arc<Node>], pods: &[Arc<Pod>]) -> (ClusterCapacity, Vec<String>) {
            let mut problems = Vec::new();
            let mut free: BTreeMap<String, (Resources, Resources)> = BTreeMap::new();
            for node in nodes.iter().filter(|n| schedulable(n)) {
                let name = node.name_any();
                let allocatable = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
                let allocatable = match allocatable.map(Resources::from_list).transpose() {
                    Ok(a) => a.unwrap_or_default(),
                    Err(e) => {
                        problems.push(format!("node {name}: status.allocatable.{e}"));
                        continue;
                    }
                };
                free.insert(name, (allocatable, Resources::default()));
            }
            for pod in pods.iter().filter(|p| !finished(p)) {
                let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()) else {
                    continue;
                };
                let Some((_, requested)) = free.get_mut(node) else {
                    continue;
                };
                match pod_request(pod) {
                    Ok(r) => *requested = requested.saturating_add(r),
                    Err(e) => problems.push(format!(
                        "pod {}/{}: {e}",
                        pod.namespace().unwrap_or_default(),
                        pod.name_any()
                    )),
                }
            }
            let mut capacity = ClusterCapacity {
                nodes: free.len() as i32,
                ..ClusterCapacity::default()
            };
            for (allocatable, requested) in free.values() {
                capacity.allocatable = capacity.allocatable.saturating_add(*allocatable);
                capacity.requested = capacity.requested.saturating_add(*requested);
                let left = Resources {
                    cpu_millis: (allocatable.cpu_millis - requested.cpu_millis).max(0),
                    memory_bytes: (allocatable.memory_bytes - requested.memory_bytes).max(0),
                };
                capacity.largest_free = capacity.largest_free.max(left);
            }
            (capacity, problems)
        }

        fn schedulable(node: &Node) -> bool {
            let cordoned = node
                .spec
                .as_ref()
                .and_then(|s| s.unschedulable)
                .unwrap_or(false);
            let ready = node
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            ready && !cordoned
        }

        fn finished(pod: &Pod) -> bool {
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            matches!(phase, Some("Succeeded" | "Failed"))
        }

        /// What the kube-scheduler charges a pod: max(sum of containers, largest init
        /// container) + overhead, per resource.
        pub fn pod_request(pod: &Pod) -> Result<Resources, String> {
            let Some(spec) = pod.spec.as_ref() else {
                return Ok(Resources::default());
            };
            let requests = |c: &Container, field: &str| {
                let list = c.resources.as_ref().and_then(|r| r.requests.as_ref());
                list.map(Resources::from_list)
                    .transpose()
                    .map(Option::unwrap_or_default)
                    .map_err(|e| format!("spec.{field}[{}].resources.requests.{e}", c.name))
            };
            let mut sum = Resources::default();
            for c in &spec.containers {
                sum = sum.saturating_add(requests(c, "containers")?);
            }
            let mut init = Resources::default();
            for c in spec.init_containers.iter().flatten() {
                init = init.max(requests(c, "initContainers")?);
            }
            let overhead = spec
                .overhead
                .as_ref()
                .map(Resources::from_list)
                .transpose()
                .map_err(|e| format!("spec.overhead.{e}"))?
                .unwrap_or_default();
            Ok(sum.max(init).saturating_add(overhead))
        }
    }

    fn node(yaml: &str) -> Arc<Node> {
        Arc::new(serde_yaml::from_str(yaml).expect("a Node"))
    }

    fn pod(yaml: &str) -> Arc<ChargedPod> {
        Arc::new(serde_yaml::from_str(yaml).expect("a Pod"))
    }

    /// A full pod as the watch keeps it: decoded from its JSON as a [`ChargedPod`], trimmed.
    fn slim(pod: &Pod) -> ChargedPod {
        let json = serde_json::to_value(pod).expect("a Pod's JSON");
        let mut slim: ChargedPod = serde_json::from_value(json).expect("a ChargedPod");
        trim_pod(&mut slim);
        slim
    }

    fn ready_node(name: &str, cpu: &str, memory: &str) -> Arc<Node> {
        node(&format!(
            "metadata: {{name: {name}}}\nstatus:\n  allocatable: {{cpu: '{cpu}', memory: '{memory}', pods: '110'}}\n  \
             conditions: [{{type: Ready, status: 'True'}}]\n"
        ))
    }

    fn bound(name: &str, node: &str, containers: &str) -> Arc<ChargedPod> {
        pod(&format!(
            "metadata: {{name: {name}, namespace: ns}}\nspec:\n  nodeName: {node}\n  containers: {containers}\nstatus: {{phase: Running}}\n"
        ))
    }

    #[test]
    fn nothing_at_all() {
        assert_eq!(compute(&[], &[]), (ClusterCapacity::default(), vec![]));
    }

    #[test]
    fn only_ready_uncordoned_nodes_count() {
        let nodes = [
            ready_node("a", "4", "8Gi"),
            node(
                "metadata: {name: b}\nspec: {unschedulable: true}\nstatus:\n  allocatable: {cpu: '4'}\n  conditions: [{type: Ready, status: 'True'}]\n",
            ),
            node(
                "metadata: {name: c}\nstatus:\n  allocatable: {cpu: '4'}\n  conditions: [{type: Ready, status: 'False'}]\n",
            ),
            node("metadata: {name: d}\nstatus: {allocatable: {cpu: '4'}}\n"),
        ];
        let (c, problems) = compute(&nodes, &[]);
        assert!(problems.is_empty());
        assert_eq!(c.nodes, 1);
        assert_eq!(c.allocatable.cpu_millis, 4000);
        assert_eq!(c.allocatable.memory_bytes, 8 << 30);
    }

    #[test]
    fn requests_of_bound_unfinished_pods_are_subtracted() {
        let nodes = [ready_node("a", "4", "8Gi"), ready_node("b", "2", "16Gi")];
        let pods = [
            bound(
                "web",
                "a",
                "[{name: x, resources: {requests: {cpu: 1500m, memory: 1Gi}}}, {name: y, resources: {requests: {cpu: 500m}}}]",
            ),
            bound(
                "big",
                "b",
                "[{name: x, resources: {requests: {memory: 12Gi}}}]",
            ),
            pod(
                "metadata: {name: done}\nspec:\n  nodeName: a\n  containers: [{name: x, resources: {requests: {cpu: '2'}}}]\nstatus: {phase: Succeeded}\n",
            ),
            pod(
                "metadata: {name: pending}\nspec:\n  containers: [{name: x, resources: {requests: {cpu: '2'}}}]\n",
            ),
            bound(
                "elsewhere",
                "gone-node",
                "[{name: x, resources: {requests: {cpu: '2'}}}]",
            ),
        ];
        let (c, problems) = compute(&nodes, &pods);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(c.nodes, 2);
        assert_eq!(
            c.requested,
            Resources {
                cpu_millis: 2000,
                memory_bytes: 13 << 30
            }
        );
        // a: 2 CPU and 7Gi free; b: 2 CPU and 4Gi free.
        assert_eq!(
            c.largest_free,
            Resources {
                cpu_millis: 2000,
                memory_bytes: 7 << 30
            }
        );
    }

    #[test]
    fn overcommitted_nodes_have_no_room_not_negative_room() {
        let nodes = [ready_node("a", "1", "1Gi")];
        let pods = [bound(
            "hog",
            "a",
            "[{name: x, resources: {requests: {cpu: '3', memory: 2Gi}}}]",
        )];
        let (c, _) = compute(&nodes, &pods);
        assert_eq!(c.largest_free, Resources::default());
        assert_eq!(c.requested.cpu_millis, 3000);
    }

    #[test]
    fn init_containers_and_overhead_count_as_the_scheduler_counts_them() {
        let p = pod("metadata: {name: p}\nspec:\n  overhead: {cpu: 100m}\n  \
             initContainers: [{name: i1, resources: {requests: {cpu: '2', memory: 64Mi}}}, {name: i2, resources: {requests: {memory: 1Gi}}}]\n  \
             containers: [{name: a, resources: {requests: {cpu: 500m, memory: 128Mi}}}, {name: b, resources: {requests: {cpu: 500m, memory: 128Mi}}}]\n");
        assert_eq!(
            pod_request(&p),
            Ok(Resources {
                cpu_millis: 2100,
                memory_bytes: 1 << 30
            })
        );
        assert_eq!(
            pod_request(&pod("metadata: {name: empty}\n")),
            Ok(Resources::default())
        );
    }

    #[test]
    fn unreadable_quantities_are_reported_naming_the_object_and_field() {
        let nodes = [
            ready_node("a", "4", "8Gi"),
            node(
                "metadata: {name: bad}\nstatus:\n  allocatable: {cpu: 'four'}\n  conditions: [{type: Ready, status: 'True'}]\n",
            ),
        ];
        let pods = [bound(
            "web",
            "a",
            "[{name: x, resources: {requests: {memory: 1Gb}}}]",
        )];
        let (c, problems) = compute(&nodes, &pods);
        assert_eq!(c.nodes, 1);
        assert_eq!(
            problems,
            [
                r#"node bad: status.allocatable.cpu: "four" is not a quantity: expected a number"#,
                r#"pod ns/web: spec.containers[x].resources.requests.memory: "1Gb" is not a quantity: unknown suffix "Gb""#,
            ]
        );
    }

    #[test]
    fn to_pb_carries_every_field() {
        let c = ClusterCapacity {
            nodes: 3,
            allocatable: Resources {
                cpu_millis: 1,
                memory_bytes: 2,
            },
            requested: Resources {
                cpu_millis: 3,
                memory_bytes: 4,
            },
            largest_free: Resources {
                cpu_millis: 5,
                memory_bytes: 6,
            },
        };
        let p = to_pb(&c);
        assert_eq!(p.nodes, 3);
        assert_eq!(p.allocatable.unwrap().memory_bytes, 2);
        assert_eq!(p.requested.unwrap().cpu_millis, 3);
        assert_eq!(p.largest_free.unwrap().memory_bytes, 6);
    }

    #[test]
    fn limiter_sends_moves_of_a_quantum_at_most_once_per_interval() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut l = Limiter::new(Duration::from_secs(10));
        let a = ClusterCapacity {
            nodes: 3,
            allocatable: Resources {
                cpu_millis: 24_000,
                memory_bytes: 48 << 30,
            },
            ..Default::default()
        };
        let requesting = |cpu_millis| ClusterCapacity {
            requested: Resources {
                cpu_millis,
                memory_bytes: 0,
            },
            ..a.clone()
        };
        let b = ClusterCapacity {
            nodes: 4,
            ..a.clone()
        };
        assert!(l.admit(&a, t0), "the first one always goes");
        assert!(!l.admit(&a, t0 + 60 * s), "unchanged: nothing to send");
        assert!(!l.admit(&b, t0 + 5 * s), "changed, but too soon");
        assert!(l.admit(&b, t0 + 10 * s));
        assert!(!l.admit(&a, t0 + 11 * s));
        assert!(l.admit(&a, t0 + 20 * s));
        // One more pod requesting 50m: no news; a few more, past one default request: news.
        assert!(!l.admit(&requesting(50), t0 + 40 * s));
        assert!(!l.admit(&requesting(99), t0 + 50 * s));
        assert!(l.admit(&requesting(100), t0 + 60 * s));
        // Small steps do not add up unseen: each is judged against what was sent.
        assert!(!l.admit(&requesting(150), t0 + 70 * s));
        assert!(l.admit(&requesting(200), t0 + 80 * s));
    }

    #[test]
    fn the_slim_pod_trimmed_keeps_what_compute_reads() {
        let full: Pod = serde_yaml::from_str(
            "metadata:\n  name: p\n  namespace: ns\n  uid: u1\n  resourceVersion: '7'\n  labels: {a: b}\n  annotations: {c: d}\n  \
             finalizers: [f]\n  ownerReferences: [{apiVersion: apps/v1, kind: ReplicaSet, name: r, uid: u0}]\n  \
             managedFields: [{manager: m, operation: Update}]\nspec:\n  nodeName: n\n  overhead: {cpu: 10m, memory: 1Mi}\n  \
             initContainers: [{name: i, image: busybox, resources: {requests: {cpu: '1'}, limits: {cpu: '2'}}}]\n  \
             containers: [{name: x, image: nginx, args: [a, b], resources: {requests: {cpu: 100m, memory: 1Gi, ephemeral-storage: lots}, limits: {memory: 2Gi}}}]\n  \
             volumes: [{name: v, emptyDir: {}}]\n  tolerations: [{key: k, operator: Exists}]\n\
             status: {phase: Running, podIP: 10.0.0.1, conditions: [{type: Ready, status: 'True'}]}\n",
        )
        .expect("a Pod");
        let p = slim(&full);
        assert_eq!(pod_request(&p), full_pod::pod_request(&full));
        assert_eq!(
            pod_request(&p),
            Ok(Resources {
                cpu_millis: 1010,
                memory_bytes: (1 << 30) + (1 << 20)
            })
        );
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("n"));
        assert_eq!(spec.containers[0].name, "x");
        assert_eq!(spec.init_containers.as_ref().unwrap()[0].name, "i");
        assert_eq!(p.status.as_ref().unwrap().phase.as_deref(), Some("Running"));
        // The reflector's key (and the problems' names) stay; the rest of the metadata goes.
        assert_eq!(
            (p.name_any(), p.namespace()),
            ("p".to_owned(), Some("ns".to_owned()))
        );
        assert_eq!(
            (p.uid(), p.resource_version()),
            (Some("u1".into()), Some("7".into()))
        );
        let m = &p.metadata;
        assert_eq!(m.labels, None);
        assert_eq!(m.annotations, None);
        assert_eq!(m.finalizers, None);
        assert_eq!(m.owner_references, None);
        assert_eq!(m.managed_fields, None);
        let mut n = Node::clone(&ready_node("a", "4", "8Gi"));
        trim_node(&mut n);
        assert_eq!(compute(&[Arc::new(n)], &[]).0.nodes, 1);
    }

    #[test]
    fn the_slim_pod_is_the_v1_pod_resource_to_kube() {
        use kube::Resource;
        assert_eq!(ChargedPod::url_path(&(), None), "/api/v1/pods");
        assert_eq!(ChargedPod::url_path(&(), None), Pod::url_path(&(), None));
        assert_eq!(
            ChargedPod::url_path(&(), Some("ns")),
            Pod::url_path(&(), Some("ns"))
        );
        assert_eq!(
            (
                ChargedPod::kind(&()),
                ChargedPod::group(&()),
                ChargedPod::version(&()),
                ChargedPod::api_version(&()),
                ChargedPod::plural(&()),
            ),
            (
                Pod::kind(&()),
                Pod::group(&()),
                Pod::version(&()),
                Pod::api_version(&()),
                Pod::plural(&()),
            )
        );
        // What the watcher decodes: lists (items without kind), watch events, bookmarks;
        // nulls read as absent fields, as k8s-openapi reads them.
        let list: kube::core::ObjectList<ChargedPod> = serde_json::from_value(serde_json::json!({
            "kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "5"},
            "items": [{
                "metadata": {"name": "a", "namespace": "ns", "labels": null},
                "spec": {"nodeName": "n", "containers": null, "initContainers": null, "overhead": null},
                "status": {"phase": "Pending", "conditions": []},
            }],
        }))
        .expect("a pod list");
        let a = &list.items[0];
        assert_eq!(a.name_any(), "a");
        assert!(a.spec.as_ref().unwrap().containers.is_empty());
        assert_eq!(pod_request(a), Ok(Resources::default()));
        let added: kube::core::WatchEvent<ChargedPod> = serde_json::from_value(serde_json::json!({
            "type": "ADDED",
            "object": {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "b", "namespace": "ns"},
                "spec": {"nodeName": "n", "containers": [
                    {"name": "x", "resources": {"requests": {"cpu": 2, "memory": "1Gi"}}},
                ]},
            },
        }))
        .expect("an ADDED event");
        let kube::core::WatchEvent::Added(b) = added else {
            panic!("not ADDED: {added:?}")
        };
        assert_eq!(
            pod_request(&b),
            Ok(Resources {
                cpu_millis: 2000,
                memory_bytes: 1 << 30
            })
        );
        let bookmark: kube::core::WatchEvent<ChargedPod> =
            serde_json::from_value(serde_json::json!({
                "type": "BOOKMARK",
                "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"resourceVersion": "9"}},
            }))
            .expect("a BOOKMARK event");
        assert!(matches!(bookmark, kube::core::WatchEvent::Bookmark(_)));
    }

    const NODE_NAMES: &[&str] = &["a", "b", "c", "d"];
    const POD_NODES: &[&str] = &["a", "b", "c", "gone"];
    const PHASES: &[Option<&str>] = &[
        None,
        Some("Pending"),
        Some("Running"),
        Some("Succeeded"),
        Some("Failed"),
    ];
    const CPUS: &[&str] = &["0", "100m", "250m", "1", "1500m", "2", "0.5", "2e3m"];
    const MEMORIES: &[&str] = &["0", "64Mi", "128974848", "1Gi", "1G", "1.5Gi"];
    const UNREADABLE: &[&str] = &["lots", "-1", "1Gb", ""];

    /// A quantity, mostly present and readable (an unreadable one leaves its pod out).
    fn arb_quantity(readable: &'static [&'static str]) -> impl Strategy<Value = Option<Quantity>> {
        let q = prop_oneof![
            19 => prop::sample::select(readable),
            1 => prop::sample::select(UNREADABLE),
        ];
        prop::option::weighted(0.8, q.prop_map(|q| Quantity(q.to_owned())))
    }

    /// A resource list: cpu and memory (absent, readable or not), and at times a resource
    /// that capacity does not read (readable or not: either way it is no problem).
    fn arb_list() -> impl Strategy<Value = BTreeMap<String, Quantity>> {
        (
            arb_quantity(CPUS),
            arb_quantity(MEMORIES),
            prop::option::weighted(0.3, arb_quantity(MEMORIES)),
        )
            .prop_map(|(cpu, memory, storage)| {
                [
                    ("cpu", cpu),
                    ("memory", memory),
                    ("ephemeral-storage", storage.flatten()),
                ]
                .into_iter()
                .filter_map(|(key, q)| Some((key.to_owned(), q?)))
                .collect()
            })
    }

    fn arb_container(prefix: &'static str) -> impl Strategy<Value = Container> {
        let resources = (
            prop::option::weighted(0.9, arb_list()),
            prop::option::of(arb_list()),
        );
        (0..3u8, prop::option::weighted(0.9, resources)).prop_map(move |(n, resources)| Container {
            name: format!("{prefix}{n}"),
            image: Some("nginx".into()),
            args: Some(vec!["--serve".into()]),
            resources: resources.map(|(requests, limits)| ResourceRequirements {
                requests,
                limits,
                ..ResourceRequirements::default()
            }),
            ..Container::default()
        })
    }

    /// A full Pod, as the apiserver could send it: bound or not, in any phase, with what
    /// capacity reads and some of what it does not.
    fn arb_pod() -> impl Strategy<Value = Pod> {
        let spec = (
            prop::option::weighted(0.9, prop::sample::select(POD_NODES)),
            prop::collection::vec(arb_container("c"), 0..=3),
            prop::option::of(prop::collection::vec(arb_container("i"), 0..=2)),
            prop::option::weighted(0.3, arb_list()),
        )
            .prop_map(|(node, containers, init_containers, overhead)| PodSpec {
                node_name: node.map(str::to_owned),
                containers,
                init_containers,
                overhead,
                service_account_name: Some("default".into()),
                ..PodSpec::default()
            });
        let status = prop::sample::select(PHASES).prop_map(|phase| PodStatus {
            phase: phase.map(str::to_owned),
            pod_ip: Some("10.0.0.1".into()),
            ..PodStatus::default()
        });
        let spec = prop::option::weighted(0.95, spec);
        let status = prop::option::weighted(0.9, status);
        (spec, status).prop_map(|(spec, status)| Pod {
            metadata: ObjectMeta {
                namespace: Some("ns".into()),
                uid: Some("u".into()),
                labels: Some([("app".to_owned(), "x".to_owned())].into()),
                annotations: Some([("note".to_owned(), "y".to_owned())].into()),
                owner_references: Some(vec![OwnerReference {
                    api_version: "apps/v1".into(),
                    kind: "ReplicaSet".into(),
                    name: "x".into(),
                    uid: "r".into(),
                    ..OwnerReference::default()
                }]),
                managed_fields: Some(vec![ManagedFieldsEntry {
                    manager: Some("kubelet".into()),
                    ..ManagedFieldsEntry::default()
                }]),
                ..ObjectMeta::default()
            },
            spec,
            status,
        })
    }

    fn arb_node() -> impl Strategy<Value = Node> {
        (
            prop::sample::select(NODE_NAMES),
            prop::bool::weighted(0.9),
            prop::bool::weighted(0.1),
            arb_list(),
        )
            .prop_map(|(name, ready, cordoned, allocatable)| Node {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    ..ObjectMeta::default()
                },
                spec: Some(NodeSpec {
                    unschedulable: Some(cordoned),
                    ..NodeSpec::default()
                }),
                status: Some(NodeStatus {
                    allocatable: Some(allocatable),
                    conditions: Some(vec![NodeCondition {
                        type_: "Ready".into(),
                        status: if ready { "True" } else { "False" }.into(),
                        ..NodeCondition::default()
                    }]),
                    ..NodeStatus::default()
                }),
            })
    }

    proptest! {
        /// The oracle check: pods as the watch keeps them (the full Pod's JSON decoded as
        /// a ChargedPod, trimmed) are counted and charged as today's algorithm counts and
        /// charges the full Pods, and the same problems are reported.
        #[test]
        fn slim_pods_are_charged_as_full_pods(
            nodes in prop::collection::vec(arb_node(), 1..=4),
            pods in prop::collection::vec(arb_pod(), 0..=8),
        ) {
            let nodes: Vec<Arc<Node>> = nodes.into_iter().map(Arc::new).collect();
            let full: Vec<Arc<Pod>> = (pods.into_iter().enumerate())
                .map(|(i, mut p)| {
                    p.metadata.name = Some(format!("p{i}"));
                    Arc::new(p)
                })
                .collect();
            let slims: Vec<Arc<ChargedPod>> = full.iter().map(|p| Arc::new(slim(p))).collect();
            for (s, f) in slims.iter().zip(&full) {
                prop_assert_eq!(pod_request(s), full_pod::pod_request(f));
            }
            prop_assert_eq!(compute(&nodes, &slims), full_pod::compute(&nodes, &full));
        }
    }
}
