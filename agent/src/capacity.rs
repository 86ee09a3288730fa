//! Capacity: the member cluster's room for more pods, from the nodes' allocatable CPU
//! and memory minus what the pods bound to them request. The hub divides replicas by it
//! (`replicaScheduling.mode: Capacity`), so no scheduler-estimator runs in the member.
//!
//! Counted nodes are Ready and not cordoned; counted pods are bound to one of them and
//! not finished. A pod requests what the kube-scheduler charges it: the larger of its
//! containers' sum and its largest init container, plus its overhead. Taints, affinity
//! and per-node pod limits are not modelled: this is an estimate, and the member's own
//! scheduler still decides.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_common::listed::{self, Listed};
use flotilla_crds::member::{ClusterCapacity, Resources};
use flotilla_proto::v1 as pb;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Container, Node, Pod};
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tracing::{debug, warn};

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

/// Nodes and unfinished pods, cached (trimmed to what [`compute`] reads: the agent's
/// footprint must not grow with the pods' specs).
#[derive(Clone)]
pub struct Source {
    nodes: Store<Node>,
    pods: Store<Pod>,
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
    let (pods, pod_writer) = reflector::store::<Pod>();
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
            watcher(Api::<Pod>::all(client), unfinished).modify(trim_pod),
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

fn trim_pod(pod: &mut Pod) {
    pod.metadata.managed_fields = None;
    pod.metadata.annotations = None;
    pod.metadata.labels = None;
    pod.metadata.owner_references = None;
    if let Some(spec) = pod.spec.as_mut() {
        spec.volumes = None;
        spec.affinity = None;
        spec.tolerations = None;
        for c in spec
            .containers
            .iter_mut()
            .chain(spec.init_containers.iter_mut().flatten())
        {
            let resources = c.resources.take();
            *c = Container {
                name: std::mem::take(&mut c.name),
                resources,
                ..Container::default()
            };
        }
    }
    if let Some(status) = pod.status.as_mut() {
        *status = k8s_openapi::api::core::v1::PodStatus {
            phase: status.phase.take(),
            ..Default::default()
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(yaml: &str) -> Arc<Node> {
        Arc::new(serde_yaml::from_str(yaml).expect("a Node"))
    }

    fn pod(yaml: &str) -> Arc<Pod> {
        Arc::new(serde_yaml::from_str(yaml).expect("a Pod"))
    }

    fn ready_node(name: &str, cpu: &str, memory: &str) -> Arc<Node> {
        node(&format!(
            "metadata: {{name: {name}}}\nstatus:\n  allocatable: {{cpu: '{cpu}', memory: '{memory}', pods: '110'}}\n  \
             conditions: [{{type: Ready, status: 'True'}}]\n"
        ))
    }

    fn bound(name: &str, node: &str, containers: &str) -> Arc<Pod> {
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
    fn trimming_keeps_what_compute_reads() {
        let mut p = Pod::clone(&pod(
            "metadata: {name: p, namespace: ns, labels: {a: b}}\nspec:\n  nodeName: n\n  \
             containers: [{name: x, image: nginx, args: [a, b], resources: {requests: {cpu: 100m}}}]\nstatus: {phase: Running, podIP: 10.0.0.1}\n",
        ));
        let before = pod_request(&p);
        trim_pod(&mut p);
        assert_eq!(pod_request(&p), before);
        assert_eq!(p.spec.as_ref().unwrap().node_name.as_deref(), Some("n"));
        assert_eq!(p.spec.as_ref().unwrap().containers[0].image, None);
        assert_eq!(p.status.as_ref().unwrap().phase.as_deref(), Some("Running"));
        assert_eq!(p.status.as_ref().unwrap().pod_ip, None);
        let mut n = Node::clone(&ready_node("a", "4", "8Gi"));
        trim_node(&mut n);
        assert_eq!(compute(&[Arc::new(n)], &[]).0.nodes, 1);
    }
}
