//! The fleet as the MemberCluster watch last showed it, kept one event at a time: what
//! placement reads of each registered cluster (its shape), the capacity each reports,
//! and which clusters are Ready. An Apply or a Delete costs its own cluster's entry, not
//! a pass over the fleet (at 10,000 clusters every status write was one); a completed
//! list (the start, a re-list) is read whole.

use std::collections::{HashMap, HashSet};

use flotilla_crds::MemberCluster;
use flotilla_crds::condition;
use flotilla_crds::member::ClusterCapacity;
use flotilla_plan::placement::{Labels, Member};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::Store;

/// What placement reads of one cluster ([`flotilla_plan::planner::shape`]'s entry):
/// labels, cordon, and NotReady or not.
type Shape = (Labels, bool, bool);

#[derive(Debug, Default, PartialEq)]
pub struct Fleet {
    /// Registered clusters (not being deleted).
    shapes: HashMap<String, Shape>,
    capacities: HashMap<String, Option<ClusterCapacity>>,
    /// Every MemberCluster whose `Ready` is True, being deleted or not.
    ready: HashSet<String>,
}

/// What one event changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Moved {
    /// A cluster came, went, or changed what placement reads.
    pub shape: bool,
    /// A registered cluster's capacity changed.
    pub capacity: bool,
    /// A cluster's readiness changed.
    pub ready: bool,
}

impl Fleet {
    /// The fleet as `store` holds it now.
    pub fn of(store: &Store<MemberCluster>) -> Self {
        let mut fleet = Fleet::default();
        let now = Timestamp::now();
        for m in store.state() {
            fleet.apply_at(&m, now);
        }
        fleet
    }

    /// What changed from `before` to this.
    pub fn moved_since(&self, before: &Fleet) -> Moved {
        Moved {
            shape: self.shapes != before.shapes,
            capacity: self.capacities != before.capacities,
            ready: self.ready != before.ready,
        }
    }

    /// A MemberCluster was created or changed.
    pub fn apply(&mut self, m: &MemberCluster) -> Moved {
        self.apply_at(m, Timestamp::now())
    }

    fn apply_at(&mut self, m: &MemberCluster, now: Timestamp) -> Moved {
        let name = m.name_any();
        let conditions = m.status.as_ref().map_or(&[][..], |s| &s.conditions);
        let ready = condition::is_true(conditions, "Ready") == Some(true);
        let mut moved = Moved {
            ready: self.set_ready(&name, ready),
            ..Moved::default()
        };
        if m.metadata.deletion_timestamp.is_some() {
            // Placement no longer reads a cluster being deleted.
            moved.shape = self.shapes.remove(&name).is_some();
            moved.capacity = self.capacities.remove(&name).is_some();
            return moved;
        }
        let member = Member::from_cluster(m, now);
        let shape = (
            member.labels,
            member.unschedulable,
            member.not_ready_for.is_some(),
        );
        moved.shape = self.shapes.get(&name) != Some(&shape);
        moved.capacity = self.capacities.get(&name) != Some(&member.capacity);
        if moved.shape {
            self.shapes.insert(name.clone(), shape);
        }
        if moved.capacity {
            self.capacities.insert(name, member.capacity);
        }
        moved
    }

    /// A MemberCluster is gone.
    pub fn delete(&mut self, name: &str) -> Moved {
        Moved {
            shape: self.shapes.remove(name).is_some(),
            capacity: self.capacities.remove(name).is_some(),
            ready: self.set_ready(name, false),
        }
    }

    /// The clusters whose `Ready` is True.
    pub fn ready(&self) -> &HashSet<String> {
        &self.ready
    }

    /// Whether `name`'s readiness changed.
    fn set_ready(&mut self, name: &str, ready: bool) -> bool {
        match ready {
            true => self.ready.insert(name.to_owned()),
            false => self.ready.remove(name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_crds::member::{MemberClusterStatus, Resources};
    use flotilla_plan::planner::{capacity, shape};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::runtime::{reflector, watcher};
    use proptest::prelude::*;

    fn member(
        name: &str,
        label: u8,
        cordoned: bool,
        ready: Option<bool>,
        cpu: Option<i64>,
    ) -> MemberCluster {
        let mut m = MemberCluster::new(name, Default::default());
        m.metadata.labels = Some([("zone".to_owned(), label.to_string())].into());
        m.spec.unschedulable = cordoned;
        let now = Time(Timestamp::now());
        m.status = Some(MemberClusterStatus {
            conditions: ready
                .map(|r| condition::new("Ready", r, "X", "", None, &now))
                .into_iter()
                .collect(),
            capacity: cpu.map(|cpu_millis| ClusterCapacity {
                nodes: 1,
                allocatable: Resources {
                    cpu_millis,
                    memory_bytes: 1,
                },
                ..ClusterCapacity::default()
            }),
            ..MemberClusterStatus::default()
        });
        m
    }

    /// The hub's old reading of the Ready clusters: a pass over the store.
    fn ready_clusters(store: &Store<MemberCluster>) -> HashSet<String> {
        let ready = store.state().into_iter().filter(|m| {
            let conditions = m.status.as_ref().map_or(&[][..], |s| &s.conditions);
            condition::is_true(conditions, "Ready") == Some(true)
        });
        ready.map(|m| m.name_any()).collect()
    }

    /// One watch event, or a whole list.
    #[derive(Debug, Clone)]
    enum Step {
        Apply(Box<MemberCluster>),
        Delete(String),
        Relist(Vec<MemberCluster>),
    }

    fn arb_member() -> impl Strategy<Value = MemberCluster> {
        (
            0u8..4,
            0u8..2,
            any::<bool>(),
            proptest::option::of(any::<bool>()),
            proptest::option::of(0i64..3),
            any::<bool>(),
        )
            .prop_map(|(n, label, cordoned, ready, cpu, deleting)| {
                let mut m = member(&format!("c{n}"), label, cordoned, ready, cpu);
                if deleting {
                    m.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
                }
                m
            })
    }

    fn arb_step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => arb_member().prop_map(|m| Step::Apply(Box::new(m))),
            1 => (0u8..4).prop_map(|n| Step::Delete(format!("c{n}"))),
            1 => proptest::collection::vec(arb_member(), 0..4).prop_map(Step::Relist),
        ]
    }

    proptest! {
        /// Kept one event at a time, the fleet moves exactly when a pass over the whole
        /// store (the hub's old reading: `registered`, `shape`, `capacity`, the Ready
        /// names) changes, and shows the same Ready clusters.
        #[test]
        fn one_event_at_a_time_is_a_pass_over_the_store(steps in proptest::collection::vec(arb_step(), 1..30)) {
            let (store, mut writer) = reflector::store::<MemberCluster>();
            writer.apply_watcher_event(&watcher::Event::Init);
            writer.apply_watcher_event(&watcher::Event::InitDone);
            let mut fleet = Fleet::of(&store);
            let whole = |store: &Store<MemberCluster>| {
                let registered = crate::membership::registered(store);
                (shape(&registered), capacity(&registered), ready_clusters(store))
            };
            let mut before = whole(&store);
            for step in steps {
                let moved = match step {
                    Step::Apply(m) => {
                        writer.apply_watcher_event(&watcher::Event::Apply((*m).clone()));
                        fleet.apply(&m)
                    }
                    Step::Delete(name) => {
                        let m = MemberCluster::new(&name, Default::default());
                        writer.apply_watcher_event(&watcher::Event::Delete(m));
                        fleet.delete(&name)
                    }
                    Step::Relist(list) => {
                        let mut unique = HashMap::new();
                        for m in list {
                            unique.insert(m.name_any(), m);
                        }
                        writer.apply_watcher_event(&watcher::Event::Init);
                        for m in unique.into_values() {
                            writer.apply_watcher_event(&watcher::Event::InitApply(m));
                        }
                        writer.apply_watcher_event(&watcher::Event::InitDone);
                        let relisted = Fleet::of(&store);
                        let moved = relisted.moved_since(&fleet);
                        fleet = relisted;
                        moved
                    }
                };
                let after = whole(&store);
                prop_assert_eq!(moved.shape, after.0 != before.0);
                // Capacity is read by position, so only within an unchanged shape (the
                // hub looks at it only then).
                if !moved.shape {
                    prop_assert_eq!(moved.capacity, after.1 != before.1);
                }
                prop_assert_eq!(moved.ready, after.2 != before.2);
                prop_assert_eq!(fleet.ready(), &after.2);
                before = after;
            }
        }
    }
}
