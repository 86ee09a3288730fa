//! Wire → domain: what the hub reads out of an agent's messages, as the planning core's
//! types (`flotilla-plan` knows no protobuf). The hub's wire module will hold these with
//! every other conversion (issue 18, item 4).

use flotilla_crds::member::{ClusterCapacity, Resources};
use flotilla_plan::status::Report;
use flotilla_proto::v1 as pb;

/// An agent's capacity report as `MemberCluster.status.capacity` shows it.
pub fn capacity_from_pb(c: &pb::Capacity) -> ClusterCapacity {
    let r = |r: &Option<pb::Resources>| {
        r.as_ref().map_or_else(Resources::default, |r| Resources {
            cpu_millis: r.cpu_millis,
            memory_bytes: r.memory_bytes,
        })
    };
    ClusterCapacity {
        nodes: c.nodes,
        allocatable: r(&c.allocatable),
        requested: r(&c.requested),
        largest_free: r(&c.largest_free),
    }
}

/// A `StatusReport` as the hub reads it: the MyApp's `Degraded` condition when True, an
/// apply error only when there is one.
pub fn report_from_pb(r: pb::StatusReport) -> Report {
    let degraded = r
        .conditions
        .into_iter()
        .find(|c| c.r#type == "Degraded" && c.status == "True")
        .map(|c| (c.reason, c.message));
    Report {
        hash: r.hash,
        exists: r.exists,
        ready: r.ready,
        ready_replicas: r.ready_replicas,
        observed_generation: r.observed_generation,
        generation: r.generation,
        degraded,
        apply_error: Some(r.apply_error).filter(|e| !e.is_empty()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_plan::index::Held;

    #[test]
    fn capacity_from_the_wire() {
        let wire = pb::Capacity {
            nodes: 2,
            allocatable: Some(pb::Resources {
                cpu_millis: 4000,
                memory_bytes: 8,
            }),
            requested: None,
            largest_free: Some(pb::Resources {
                cpu_millis: 1,
                memory_bytes: 2,
            }),
        };
        let c = capacity_from_pb(&wire);
        assert_eq!(
            (
                c.nodes,
                c.allocatable.cpu_millis,
                c.allocatable.memory_bytes
            ),
            (2, 4000, 8)
        );
        assert_eq!(
            c.requested,
            Default::default(),
            "absent reads as nothing requested"
        );
        assert_eq!(
            (c.largest_free.cpu_millis, c.largest_free.memory_bytes),
            (1, 2)
        );
    }

    /// Of several Degraded conditions, the True one is what status explains.
    #[test]
    fn a_report_reads_the_true_degraded_condition() {
        let r = report_from_pb(pb::StatusReport {
            hash: "h1".into(),
            exists: true,
            ready_replicas: 1,
            observed_generation: 1,
            generation: 1,
            conditions: vec![
                pb::Condition {
                    r#type: "Degraded".into(),
                    status: "False".into(),
                    reason: "AsExpected".into(),
                    message: String::new(),
                },
                pb::Condition {
                    r#type: "Degraded".into(),
                    status: "True".into(),
                    reason: "ImageMissing".into(),
                    message: "spec.image is not set".into(),
                },
            ],
            ..Default::default()
        });
        assert_eq!(
            r.degraded,
            Some(("ImageMissing".into(), "spec.image is not set".into()))
        );
        assert_eq!((r.hash.as_str(), r.ready_replicas), ("h1", 1));
    }

    #[test]
    fn reports_read_as_held_present_absent_or_failed() {
        let r = |exists: bool, error: &str| {
            report_from_pb(pb::StatusReport {
                exists,
                apply_error: error.into(),
                ..Default::default()
            })
            .held()
        };
        assert_eq!(r(true, ""), Held::Present);
        assert_eq!(r(false, ""), Held::Absent);
        assert_eq!(r(false, "namespace \"x\" not found"), Held::Failed);
        assert_eq!(r(true, "webhook denied"), Held::Failed);
    }
}
