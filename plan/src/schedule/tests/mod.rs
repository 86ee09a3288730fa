//! The schedule's tests: one FederatedMyApp's placement over registered clusters, step
//! by step ([`Case`] runs the whole pipeline), the properties of the whole, and the
//! apportionment maths on its own.

mod apportion;
mod bounds;
mod capacity;
mod division;
mod previous;
mod properties;
mod spread;
mod transition;

use super::*;
use crate::placement::Member;
use flotilla_crds::member::ClusterCapacity;

use SchedulingReason::*;

fn placement(yaml: &str) -> Placement {
    serde_yaml::from_str(yaml).expect("valid placement YAML")
}

fn member(labels: &[(&str, &str)]) -> Member {
    Member::with_labels(
        labels
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect(),
    )
}

fn three() -> Members {
    [
        ("c1", member(&[("region", "eu")])),
        ("c2", member(&[("region", "eu")])),
        ("c3", member(&[("region", "us")])),
    ]
    .into_iter()
    .map(|(n, m)| (n.into(), m))
    .collect()
}

struct Case {
    placement: Placement,
    members: Members,
    template_replicas: Option<i32>,
    request: Resources,
    previous: BTreeMap<String, Previous>,
    spec_changed: bool,
    autoscaling: Option<Autoscaling>,
    previous_min: BTreeMap<String, u32>,
}

impl Case {
    fn new(yaml: &str) -> Self {
        Self {
            placement: placement(yaml),
            members: three(),
            template_replicas: None,
            request: DEFAULT_REQUEST,
            previous: BTreeMap::new(),
            spec_changed: false,
            autoscaling: None,
            previous_min: BTreeMap::new(),
        }
    }

    fn run(&self) -> Result<Schedule, ScheduleError> {
        let placed: Vec<ClusterName> = self.members.keys().cloned().collect();
        schedule(&Inputs {
            placement: &self.placement,
            placed: &placed,
            members: &self.members,
            template_replicas: self.template_replicas,
            request: self.request,
            previous: self.previous.clone(),
            spec_changed: self.spec_changed,
            autoscaling: self.autoscaling,
            previous_min: self.previous_min.clone(),
        })
    }

    fn ok(&self) -> Schedule {
        self.run().expect("the division is feasible")
    }

    /// What the status says after this division, with every cluster's share Ready.
    fn settle(&mut self, s: &Schedule) {
        self.previous = s
            .clusters
            .iter()
            .map(|(c, a)| {
                let prev = Previous {
                    replicas: a.replicas,
                    ready_replicas: a.replicas,
                    reason: Some(a.reason),
                };
                (c.to_string(), prev)
            })
            .collect();
        self.previous_min = s
            .bounds
            .iter()
            .map(|(c, b)| (c.to_string(), b.min))
            .collect();
        self.spec_changed = false;
    }

    fn set_ready(&mut self, cluster: &str, ready: u32) {
        self.previous.get_mut(cluster).unwrap().ready_replicas = ready;
    }
}

fn shares(s: &Schedule) -> Vec<(u32, SchedulingReason)> {
    s.clusters
        .values()
        .map(|a| (a.replicas, a.reason))
        .collect()
}

const WEIGHTED_2_1_1: &str = "replicaScheduling: {mode: Weighted, totalReplicas: 12, preferences: [{clusterNames: [c1], weight: 2}]}";

fn capacity(cpu_free_millis: i64) -> ClusterCapacity {
    ClusterCapacity {
        nodes: 1,
        allocatable: Resources {
            cpu_millis: cpu_free_millis,
            memory_bytes: 1 << 40,
        },
        requested: Resources::default(),
        largest_free: Resources {
            cpu_millis: cpu_free_millis,
            memory_bytes: 1 << 40,
        },
    }
}

fn with_capacity(c: &mut Case, cpu: [i64; 3]) {
    for (name, cpu) in ["c1", "c2", "c3"].iter().zip(cpu) {
        c.members.get_mut(*name).unwrap().capacity = Some(capacity(cpu));
    }
}

impl Schedule {
    fn with_reason(mut self, cluster: &str, reason: SchedulingReason) -> Self {
        self.clusters.get_mut(cluster).unwrap().reason = reason;
        self
    }
}

const FAILOVER: &str = "replicaScheduling: {mode: Weighted, totalReplicas: 12, preferences: [{clusterNames: [c1], weight: 2}]}\nfailover: {gracePeriodSeconds: 60}";
