//! Wire → domain: what the hub reads out of an agent's messages, as the planning core's
//! types (`flotilla-plan` knows no protobuf). The hub's wire module will hold these with
//! every other conversion (issue 18, item 4).
//!
//! Every value is bounded here, before it reaches memory that outlives the message or
//! any arithmetic: strings cut to the maxima below, numbers clamped to `0..=` theirs.

use flotilla_crds::member::{ClusterCapacity, Resources};
use flotilla_plan::status::{Report, Words};
use flotilla_proto::v1 as pb;

use crate::edge::Refusal;

/// A MemberCluster's name (a DNS subdomain).
pub const NAME_MAX: usize = 253;
/// Hello's versions and cluster UID (a UID is 36 bytes).
pub const HELLO_STRING_MAX: usize = 128;
/// A content hash: hex SHA-256.
pub const HASH_MAX: usize = 64;
/// A condition's reason (a CamelCase word in Kubernetes).
pub const REASON_MAX: usize = 128;
/// A Degraded message or an apply error, kept per cluster and app. Status shows at most
/// 256 bytes of it per cluster (`flotilla_plan::status::CLUSTER_MESSAGE_MAX`); the rest
/// is for `flotilla-hub status`.
pub const MESSAGE_MAX: usize = 1024;
/// A namespace's name (a DNS label).
pub const NAMESPACE_MAX: usize = 63;
/// Namespaces in a Hello's scope: more than any agent's `--allowed-namespace` list.
pub const SCOPE_MAX: usize = 1000;
/// Nodes in one cluster (Kubernetes supports 5,000).
pub const NODES_MAX: i32 = 1_000_000;
/// CPU of one cluster: a billion cores, in millicores.
pub const CPU_MILLIS_MAX: i64 = 1_000_000_000_000;
/// Memory of one cluster: 1 EiB. With CPU above, no difference or sum over a fleet of
/// clusters comes near `i64::MAX`.
pub const MEMORY_BYTES_MAX: i64 = 1 << 60;

/// A value read off the wire, and the first bound it broke, if any (counted and logged
/// by the caller, who knows the cluster).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bounded<T> {
    pub value: T,
    pub refused: Option<Refusal>,
}

/// `s` cut to at most `max` bytes (on a character boundary).
pub(crate) fn capped(mut s: String, max: usize) -> String {
    if s.len() > max {
        let end = (0..=max)
            .rev()
            .find(|i| s.is_char_boundary(*i))
            .unwrap_or(0);
        s.truncate(end);
    }
    s
}

/// Tracks the first bound broken while reading one message.
#[derive(Default)]
struct Bounds(Option<Refusal>);

impl Bounds {
    /// `s` cut to at most `max` bytes, on a character boundary.
    fn string(&mut self, s: String, max: usize) -> String {
        if s.len() > max {
            self.0.get_or_insert(Refusal::LongString);
        }
        capped(s, max)
    }

    /// `n` within `0..=max`.
    fn number<N: Ord + Default + Copy>(&mut self, n: N, max: N) -> N {
        let clamped = n.clamp(N::default(), max);
        if clamped != n {
            self.0.get_or_insert(Refusal::NumberOutOfRange);
        }
        clamped
    }

    fn done<T>(self, value: T) -> Bounded<T> {
        Bounded {
            value,
            refused: self.0,
        }
    }
}

/// A Hello as the hub reads it (it logs and shows these strings): versions cut to
/// [`HELLO_STRING_MAX`]. The cluster name, UID and ID identify the member, so past
/// [`NAME_MAX`] and [`HELLO_STRING_MAX`] the Hello is refused rather than cut (a cut could
/// make them look like real ones). So is a scope with an empty namespace, one past
/// [`NAMESPACE_MAX`], or more than [`SCOPE_MAX`] of them: a cut would widen what the
/// agent's silence is taken to mean.
pub fn hello_from_pb(mut h: pb::Hello) -> Result<Bounded<pb::Hello>, Refusal> {
    if h.cluster.len() > NAME_MAX
        || h.cluster_uid.len() > HELLO_STRING_MAX
        || h.cluster_id.len() > HELLO_STRING_MAX
        || h.scope.len() > SCOPE_MAX
        || (h.scope.iter()).any(|ns| ns.is_empty() || ns.len() > NAMESPACE_MAX)
    {
        return Err(Refusal::LongString);
    }
    let mut bounds = Bounds::default();
    h.agent_version = bounds.string(h.agent_version, HELLO_STRING_MAX);
    h.kubernetes_version = bounds.string(h.kubernetes_version, HELLO_STRING_MAX);
    Ok(bounds.done(h))
}

/// An agent's capacity report as `MemberCluster.status.capacity` shows it, every figure
/// within `0..=` its maximum.
pub fn capacity_from_pb(c: &pb::Capacity) -> Bounded<ClusterCapacity> {
    let mut bounds = Bounds::default();
    let mut r = |r: &Option<pb::Resources>| {
        r.as_ref().map_or_else(Resources::default, |r| Resources {
            cpu_millis: bounds.number(r.cpu_millis, CPU_MILLIS_MAX),
            memory_bytes: bounds.number(r.memory_bytes, MEMORY_BYTES_MAX),
        })
    };
    let allocatable = r(&c.allocatable);
    let requested = r(&c.requested);
    let largest_free = r(&c.largest_free);
    let nodes = bounds.number(c.nodes, NODES_MAX);
    bounds.done(ClusterCapacity {
        nodes,
        allocatable,
        requested,
        largest_free,
    })
}

/// A `StatusReport` as the hub reads it: the MyApp's `Degraded` condition when True, an
/// apply error only when there is one; strings cut to their maximum, counts and
/// generations not negative.
pub fn report_from_pb(r: pb::StatusReport) -> Bounded<Report> {
    let mut bounds = Bounds::default();
    let degraded = r
        .conditions
        .into_iter()
        .find(|c| c.r#type == "Degraded" && c.status == "True")
        .map(|c| {
            (
                bounds.string(c.reason, REASON_MAX),
                bounds.string(c.message, MESSAGE_MAX),
            )
        });
    let words = Words {
        degraded,
        apply_error: Some(bounds.string(r.apply_error, MESSAGE_MAX)).filter(|e| !e.is_empty()),
        autoscaler: Some(bounds.string(r.autoscaler, REASON_MAX)).filter(|a| !a.is_empty()),
        drift: Some(bounds.string(r.drift, MESSAGE_MAX)).filter(|d| !d.is_empty()),
    };
    let report = Report {
        hash: bounds.string(r.hash, HASH_MAX).into(),
        exists: r.exists,
        ready: r.ready,
        ready_replicas: bounds.number(r.ready_replicas, i32::MAX),
        observed_generation: bounds.number(r.observed_generation, i64::MAX),
        generation: bounds.number(r.generation, i64::MAX),
        replicas: r.replicas.map(|n| bounds.number(n, i32::MAX)),
        words: None,
    }
    .with_words(words);
    bounds.done(report)
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
        let c = capacity_from_pb(&wire).value;
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
        })
        .value;
        assert_eq!(
            r.degraded(),
            Some(&("ImageMissing".into(), "spec.image is not set".into()))
        );
        assert_eq!((&*r.hash, r.ready_replicas), ("h1", 1));
    }

    #[test]
    fn reports_read_as_held_present_absent_or_failed() {
        let r = |exists: bool, error: &str| {
            report_from_pb(pb::StatusReport {
                exists,
                apply_error: error.into(),
                ..Default::default()
            })
            .value
            .held()
        };
        assert_eq!(r(true, ""), Held::Present);
        assert_eq!(r(false, ""), Held::Absent);
        assert_eq!(r(false, "namespace \"x\" not found"), Held::Failed);
        assert_eq!(r(true, "webhook denied"), Held::Failed);
        let drifted = report_from_pb(pb::StatusReport {
            exists: true,
            drift: "spec.image by kubectl-edit".into(),
            ..Default::default()
        });
        assert_eq!(drifted.value.held(), Held::Drifted);
        let huge = report_from_pb(pb::StatusReport {
            exists: true,
            drift: "x".repeat(1 << 20),
            ..Default::default()
        });
        assert!(
            huge.value.drift().unwrap().len() <= MESSAGE_MAX,
            "a drift note is cut"
        );
    }

    fn condition(reason: String, message: String) -> pb::Condition {
        pb::Condition {
            r#type: "Degraded".into(),
            status: "True".into(),
            reason,
            message,
        }
    }

    #[test]
    fn strings_are_cut_on_a_character_boundary_within_their_maximum() {
        // "é" is two bytes and "🦀" four: cut at the limit, they would split.
        let cases = [
            (String::new(), 0),
            ("a".repeat(MESSAGE_MAX), MESSAGE_MAX),
            ("a".repeat(MESSAGE_MAX + 1), MESSAGE_MAX),
            ("é".repeat(MESSAGE_MAX), MESSAGE_MAX),
            (format!("a{}", "é".repeat(MESSAGE_MAX)), MESSAGE_MAX - 1),
            (format!("a{}", "🦀".repeat(MESSAGE_MAX)), MESSAGE_MAX - 3),
            ("x".repeat(16 << 20), MESSAGE_MAX),
        ];
        for (input, kept) in cases {
            let long = input.len() > MESSAGE_MAX;
            let r = report_from_pb(pb::StatusReport {
                apply_error: input.clone(),
                conditions: vec![condition(input.clone(), input.clone())],
                ..Default::default()
            });
            let (reason, message) = r.value.degraded().unwrap().clone();
            let error = r.value.apply_error().unwrap_or_default().to_owned();
            assert_eq!(
                (message.len(), error.len()),
                (kept, kept),
                "{}",
                input.len()
            );
            assert!(input.starts_with(&message) && input.starts_with(&error));
            assert!(reason.len() <= REASON_MAX && input.starts_with(&reason));
            let reason_long = input.len() > REASON_MAX;
            assert_eq!(
                r.refused,
                (long || reason_long).then_some(Refusal::LongString),
                "{}",
                input.len()
            );
        }
    }

    #[test]
    fn a_hash_longer_than_a_sha256_is_cut() {
        let r = report_from_pb(pb::StatusReport {
            hash: "f".repeat(1 << 20),
            ..Default::default()
        });
        assert_eq!(r.value.hash.len(), HASH_MAX);
        assert_eq!(r.refused, Some(Refusal::LongString));
        let ok = report_from_pb(pb::StatusReport {
            hash: "f".repeat(HASH_MAX),
            ..Default::default()
        });
        assert_eq!(ok.refused, None);
    }

    #[test]
    fn report_numbers_are_never_negative() {
        for n in [i32::MIN, -1, 0, 1, i32::MAX] {
            let r = report_from_pb(pb::StatusReport {
                ready_replicas: n,
                observed_generation: i64::from(n),
                generation: i64::from(n),
                ..Default::default()
            });
            assert_eq!(r.value.ready_replicas, n.max(0));
            assert_eq!(r.value.generation, i64::from(n.max(0)));
            assert_eq!(r.refused, (n < 0).then_some(Refusal::NumberOutOfRange));
        }
        for g in [i64::MIN, i64::MAX] {
            let r = report_from_pb(pb::StatusReport {
                observed_generation: g,
                generation: g,
                ..Default::default()
            });
            assert_eq!(r.value.observed_generation, g.max(0));
        }
    }

    #[test]
    fn capacity_figures_are_clamped_so_no_arithmetic_on_them_overflows() {
        let extremes = [
            i64::MIN,
            -1,
            0,
            1,
            CPU_MILLIS_MAX,
            MEMORY_BYTES_MAX,
            i64::MAX,
        ];
        for a in extremes {
            for b in extremes {
                let res = |cpu, mem| {
                    Some(pb::Resources {
                        cpu_millis: cpu,
                        memory_bytes: mem,
                    })
                };
                let c = capacity_from_pb(&pb::Capacity {
                    nodes: i32::try_from(a.clamp(i32::MIN.into(), i32::MAX.into())).unwrap(),
                    allocatable: res(a, b),
                    requested: res(b, a),
                    largest_free: res(a, a),
                });
                let v = &c.value;
                for r in [&v.allocatable, &v.requested, &v.largest_free] {
                    assert!((0..=CPU_MILLIS_MAX).contains(&r.cpu_millis));
                    assert!((0..=MEMORY_BYTES_MAX).contains(&r.memory_bytes));
                }
                assert!((0..=NODES_MAX).contains(&v.nodes));
                let in_range = |n: i64| (0..=CPU_MILLIS_MAX.min(MEMORY_BYTES_MAX)).contains(&n);
                assert_eq!(
                    c.refused.is_none(),
                    in_range(a) && in_range(b) && (0..=i64::from(NODES_MAX)).contains(&a),
                    "{a} {b}"
                );
                // What the planner computes from it (a debug build panics on overflow).
                let request = Resources {
                    cpu_millis: 1,
                    memory_bytes: 1,
                };
                let room = v.room_for(&request);
                assert!(room >= 0);
                let fleet: i64 = (0..10_000).map(|_| room).fold(0i64, |s, r| {
                    s.checked_add(r)
                        .expect("a fleet of 10,000 such clusters sums")
                });
                assert!(fleet >= 0);
            }
        }
    }

    #[test]
    fn hello_versions_are_cut_and_identities_past_their_length_refused() {
        let hello = |cluster: String, uid: String, version: String| pb::Hello {
            cluster,
            cluster_uid: uid,
            agent_version: version.clone(),
            kubernetes_version: version,
            ..Default::default()
        };
        let uid = "0b6c1f9e-2d3a-4c5b-8e7f-9a0b1c2d3e4f".to_owned();
        let ok = hello_from_pb(hello("c1".into(), uid.clone(), "v1.34.4".into())).unwrap();
        assert_eq!(ok.refused, None);
        assert_eq!(ok.value.kubernetes_version, "v1.34.4");

        let long = hello_from_pb(hello("c1".into(), uid.clone(), "é".repeat(1 << 20))).unwrap();
        assert_eq!(long.refused, Some(Refusal::LongString));
        assert_eq!(long.value.agent_version.len(), HELLO_STRING_MAX);
        assert_eq!(long.value.kubernetes_version.len(), HELLO_STRING_MAX);

        let name = "a".repeat(NAME_MAX);
        assert!(hello_from_pb(hello(name.clone(), uid.clone(), String::new())).is_ok());
        assert_eq!(
            hello_from_pb(hello(format!("{name}a"), uid.clone(), String::new())),
            Err(Refusal::LongString)
        );
        assert_eq!(
            hello_from_pb(hello(
                "c1".into(),
                "u".repeat(HELLO_STRING_MAX + 1),
                String::new()
            )),
            Err(Refusal::LongString)
        );
        // The stated cluster ID identifies the member as the UID does: refused, not cut.
        let with_id = |id: String| pb::Hello {
            cluster_id: id,
            ..hello("c1".into(), uid.clone(), String::new())
        };
        let id = hello_from_pb(with_id("i".repeat(HELLO_STRING_MAX))).unwrap();
        assert_eq!(id.value.cluster_id.len(), HELLO_STRING_MAX);
        assert_eq!(
            hello_from_pb(with_id("i".repeat(HELLO_STRING_MAX + 1))),
            Err(Refusal::LongString)
        );
        // A scope is refused, not cut: fewer namespaces would cover more than it said.
        let with_scope = |scope: Vec<String>| pb::Hello {
            scope,
            ..hello("c1".into(), uid.clone(), String::new())
        };
        let longest = "n".repeat(NAMESPACE_MAX);
        let ok = hello_from_pb(with_scope(vec!["team".into(), longest.clone()])).unwrap();
        assert_eq!(ok.value.scope, ["team", &longest]);
        for refused in [
            vec![format!("{longest}n")],
            vec!["team".into(), String::new()],
            vec!["n".into(); SCOPE_MAX + 1],
        ] {
            assert_eq!(hello_from_pb(with_scope(refused)), Err(Refusal::LongString));
        }
    }
}
