//! `MemberCluster` (`core.kubefed.io/v1beta1`, cluster-scoped): a registered member.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A member cluster, created by `flotilla-hub join`. Its labels feed
/// `placement.clusterSelector`.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    doc = "MemberCluster is one member cluster registered with the Flotilla hub (by flotilla-hub join). Its labels feed placement selectors; its status shows the agent's heartbeat and the cluster's capacity.",
    group = "core.kubefed.io",
    version = "v1beta1",
    kind = "MemberCluster",
    plural = "memberclusters",
    shortname = "mc",
    category = "flotilla",
    status = "MemberClusterStatus",
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Unschedulable","type":"boolean","jsonPath":".spec.unschedulable"}"#,
    printcolumn = r#"{"name":"Nodes","type":"integer","jsonPath":".status.capacity.nodes"}"#,
    printcolumn = r#"{"name":"Kubernetes","type":"string","jsonPath":".status.kubernetesVersion"}"#,
    printcolumn = r#"{"name":"Agent","type":"string","jsonPath":".status.agentVersion"}"#,
    printcolumn = r#"{"name":"Since","type":"date","description":"When Ready last changed","jsonPath":".status.conditions[?(@.type==\"Ready\")].lastTransitionTime"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MemberClusterSpec {
    /// SHA-256 (hex) of the agent's bearer token. Only the hash is stored; clearing it
    /// revokes the agent (and its next token), `flotilla-hub join --rotate` issues a new
    /// one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_sha256: Option<String>,
    /// When the token expires; none: never (tokens issued before expiry existed). The hub
    /// renews it over the agent's session before then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_expires_at: Option<Time>,
    /// SHA-256 (hex) of the renewed token the hub sent the agent, accepted beside the
    /// current one until the agent proves it holds it (then it becomes the current one).
    /// Written by the hub.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_token_sha256: Option<String>,
    /// When the next token expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_token_expires_at: Option<Time>,
    /// Cordon: no new replicas are scheduled here; the replicas it runs stay
    /// (`flotilla-hub cordon NAME`, `flotilla-hub uncordon NAME`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unschedulable: bool,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemberClusterStatus {
    /// `Ready`: an agent is connected and heartbeating.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The agent's latest heartbeat as of the last status write. The status is written
    /// only when what it shows changes (readiness, versions, UID, a held-back collection,
    /// capacity), never for a heartbeat alone: this is when it last changed, not a sign
    /// of life. Liveness is the `Ready` condition (False after `--heartbeat-grace`
    /// without a heartbeat) and its `lastTransitionTime`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes_version: Option<String>,
    /// The only namespaces the agent watches (its `--allowed-namespace`); absent when it
    /// watches every namespace. The hub takes the agent's word on MyApps in these alone:
    /// a deletion of a MyApp elsewhere waits for this cluster (docs/security.md, RBAC).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub agent_namespaces: Vec<String>,
    /// UID of the member's `kube-system` namespace, pinned by the first agent that
    /// connects: the credential is bound to that physical cluster, and an agent running
    /// anywhere else is refused (unless it matches `clusterID`). Clear both (with
    /// `kubectl edit --subresource=status`) to move the registration to a rebuilt cluster.
    #[serde(
        default,
        rename = "clusterUID",
        skip_serializing_if = "Option::is_none"
    )]
    pub cluster_uid: Option<String>,
    /// The ID the member states itself (the `spec.value` of its About API ClusterProperty
    /// `cluster.clusterset.k8s.io`, KEP-2149), pinned beside `clusterUID`: an agent is
    /// accepted when it matches either, and both are then set to what it sent, so a
    /// cluster that gains a ClusterProperty, or is rebuilt under the same one, keeps its
    /// registration; an agent that matches neither is refused.
    #[serde(default, rename = "clusterID", skip_serializing_if = "Option::is_none")]
    pub cluster_id: Option<String>,
    /// The cluster's capacity as its agent last reported it: updated when a figure moved
    /// by 5 % and one default request (100m CPU, 200 MiB) or a node came or went, at most
    /// once per the hub's `--capacity-write-interval`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<ClusterCapacity>,
}

/// Ready, schedulable nodes' allocatable resources and what running pods request of them.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterCapacity {
    /// Nodes counted: Ready and not cordoned.
    pub nodes: i32,
    pub allocatable: Resources,
    /// Requests of the pods bound to those nodes that have not finished.
    pub requested: Resources,
    /// The most CPU free on any one node, and the most memory free on any one node (not
    /// necessarily the same node).
    pub largest_free: Resources,
}

impl ClusterCapacity {
    /// How many more pods requesting `request` fit: the free total divided by the
    /// request, per resource, and none when no single node has room for one. An estimate
    /// (free resources on different nodes add up here, not in the kube-scheduler).
    pub fn room_for(&self, request: &Resources) -> i64 {
        let free = Resources {
            cpu_millis: (self.allocatable.cpu_millis - self.requested.cpu_millis).max(0),
            memory_bytes: (self.allocatable.memory_bytes - self.requested.memory_bytes).max(0),
        };
        let per = |free: i64, largest: i64, req: i64| {
            if req <= 0 {
                i64::MAX
            } else if largest < req {
                0
            } else {
                free / req
            }
        };
        per(
            free.cpu_millis,
            self.largest_free.cpu_millis,
            request.cpu_millis,
        )
        .min(per(
            free.memory_bytes,
            self.largest_free.memory_bytes,
            request.memory_bytes,
        ))
    }
}

impl ClusterCapacity {
    /// Whether `now` differs enough from `before` to be worth reporting and writing: the
    /// node count changed, or a figure moved by at least 5 % of its value and by at least
    /// one [`DEFAULT_REQUEST`] (a pod coming or going alone is not news).
    pub fn moved(before: &ClusterCapacity, now: &ClusterCapacity) -> bool {
        let far = |a: i64, b: i64, quantum: i64| {
            a.abs_diff(b) >= (a.unsigned_abs() / 20).max(quantum as u64)
        };
        let resources = |a: &Resources, b: &Resources| {
            far(a.cpu_millis, b.cpu_millis, DEFAULT_REQUEST.cpu_millis)
                || far(a.memory_bytes, b.memory_bytes, DEFAULT_REQUEST.memory_bytes)
        };
        before.nodes != now.nodes
            || resources(&before.allocatable, &now.allocatable)
            || resources(&before.requested, &now.requested)
            || resources(&before.largest_free, &now.largest_free)
    }
}

/// A replica without requests counts as requesting what the kube-scheduler assumes for
/// scoring (its non-zero defaults: 100m CPU, 200 MiB).
pub const DEFAULT_REQUEST: Resources = Resources {
    cpu_millis: 100,
    memory_bytes: 200 * 1024 * 1024,
};

/// CPU and memory as whole numbers, so that the hub's arithmetic is exact.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Resources {
    pub cpu_millis: i64,
    pub memory_bytes: i64,
}

impl Resources {
    /// `cpu` and `memory` of a resource list (requests or allocatable); others ignored.
    pub fn from_list(list: &BTreeMap<String, Quantity>) -> Result<Self, QuantityError> {
        let get = |key: &str, scale: i32| match list.get(key) {
            Some(q) => parse_quantity(&q.0, scale).map_err(|reason| QuantityError {
                resource: key.to_owned(),
                value: q.0.clone(),
                reason,
            }),
            None => Ok(0),
        };
        Ok(Self {
            cpu_millis: get("cpu", 3)?,
            memory_bytes: get("memory", 0)?,
        })
    }

    pub fn saturating_add(self, other: Self) -> Self {
        Self {
            cpu_millis: self.cpu_millis.saturating_add(other.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_add(other.memory_bytes),
        }
    }

    /// Each resource's larger value.
    pub fn max(self, other: Self) -> Self {
        Self {
            cpu_millis: self.cpu_millis.max(other.cpu_millis),
            memory_bytes: self.memory_bytes.max(other.memory_bytes),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{resource}: {value:?} is not a quantity: {reason}")]
pub struct QuantityError {
    pub resource: String,
    pub value: String,
    pub reason: String,
}

/// A Kubernetes quantity (`100m`, `1.5Gi`, `2e3`, `512Mi`) times `10^scale`, rounded up
/// as `Quantity.MilliValue()` (scale 3) and `Value()` (scale 0) do. Negative quantities
/// are refused: requests and allocatable never are.
pub fn parse_quantity(s: &str, scale: i32) -> Result<i64, String> {
    let s = s.trim();
    let s = s.strip_prefix('+').unwrap_or(s);
    if s.starts_with('-') {
        return Err("negative".into());
    }
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(end);
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && frac.is_empty() || frac.contains('.') {
        return Err("expected a number".into());
    }
    let (exp2, exp10): (u32, i32) = match suffix {
        "" => (0, 0),
        "n" => (0, -9),
        "u" => (0, -6),
        "m" => (0, -3),
        "k" => (0, 3),
        "M" => (0, 6),
        "G" => (0, 9),
        "T" => (0, 12),
        "P" => (0, 15),
        "E" => (0, 18),
        "Ki" => (10, 0),
        "Mi" => (20, 0),
        "Gi" => (30, 0),
        "Ti" => (40, 0),
        "Pi" => (50, 0),
        "Ei" => (60, 0),
        e if e.starts_with(['e', 'E']) => (
            0,
            e[1..]
                .parse()
                .map_err(|_| format!("unknown suffix {suffix:?}"))?,
        ),
        _ => return Err(format!("unknown suffix {suffix:?}")),
    };
    let digits = format!("{whole}{frac}");
    let digits = digits.trim_start_matches('0');
    if digits.len() > 30 {
        return Err("too many digits".into());
    }
    let mantissa: u128 = if digits.is_empty() {
        0
    } else {
        digits.parse().map_err(|_| "expected a number")?
    };
    let mantissa = mantissa.checked_mul(1u128 << exp2).ok_or("too large")?;
    let exp = i64::from(exp10) - frac.len() as i64 + i64::from(scale);
    let value = if mantissa == 0 {
        0
    } else if exp >= 0 {
        10u128
            .checked_pow(u32::try_from(exp).map_err(|_| "too large")?)
            .and_then(|p| mantissa.checked_mul(p))
            .ok_or("too large")?
    } else if exp < -38 {
        1
    } else {
        mantissa.div_ceil(10u128.pow((-exp) as u32))
    };
    i64::try_from(value).map_err(|_| "too large".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_moves_by_a_quantum_or_a_node() {
        let gib = 1 << 30;
        let base = ClusterCapacity {
            nodes: 3,
            allocatable: Resources {
                cpu_millis: 32_000,
                memory_bytes: 64 * gib,
            },
            requested: Resources {
                cpu_millis: 1_000,
                memory_bytes: gib,
            },
            largest_free: Resources {
                cpu_millis: 10_000,
                memory_bytes: 20 * gib,
            },
        };
        let with = |f: &dyn Fn(&mut ClusterCapacity)| {
            let mut c = base.clone();
            f(&mut c);
            ClusterCapacity::moved(&base, &c)
        };
        assert!(!with(&|_| {}));
        assert!(with(&|c| c.nodes = 4), "a node joined");
        // 1 CPU requested: 5 % is 50m, a default request 100m.
        assert!(!with(&|c| c.requested.cpu_millis += 99));
        assert!(with(&|c| c.requested.cpu_millis += 100));
        // 32 CPU allocatable: 5 % is 1.6 CPU.
        assert!(!with(&|c| c.allocatable.cpu_millis -= 1_599));
        assert!(with(&|c| c.allocatable.cpu_millis -= 1_600));
        // 20 GiB free on a node: 5 % is 1 GiB.
        assert!(!with(&|c| c.largest_free.memory_bytes -= gib / 2));
        assert!(with(&|c| c.largest_free.memory_bytes -= gib));
        assert!(with(&|c| c.requested.memory_bytes += 200 << 20));
    }

    #[test]
    fn quantities_ugly_inputs_are_refused() {
        for bad in [
            "", ".", "-1", "-100m", "1.2.3", "abc", "1x", "1KI", "1e", "1e1.5", "m", "1 Gi", "1ki",
        ] {
            assert!(parse_quantity(bad, 0).is_err(), "{bad:?} must be refused");
        }
        assert!(
            parse_quantity("99999999999999999999Ei", 0).is_err(),
            "overflow"
        );
        assert!(parse_quantity("1e40", 0).is_err(), "overflow");
    }

    #[test]
    fn cpu_in_millis_rounds_up() {
        for (q, want) in [
            ("0", 0),
            ("1", 1000),
            ("+2", 2000),
            ("100m", 100),
            ("0.5", 500),
            (".5", 500),
            ("1.", 1000),
            ("250000u", 250),
            ("1u", 1),
            ("1n", 1),
            ("0.0001", 1),
            ("2e3", 2_000_000),
            ("2E-3", 2),
            ("1k", 1_000_000),
            ("007", 7000),
        ] {
            assert_eq!(parse_quantity(q, 3), Ok(want), "{q}");
        }
    }

    #[test]
    fn memory_in_bytes() {
        for (q, want) in [
            ("128974848", 128_974_848),
            ("129e6", 129_000_000),
            ("129M", 129_000_000),
            ("123Mi", 128_974_848),
            ("1Ki", 1024),
            ("1.5Gi", 1_610_612_736),
            ("1Ti", 1 << 40),
            ("1Ei", 1 << 60),
            ("1500m", 2),
            ("1m", 1),
            ("0.000Gi", 0),
        ] {
            assert_eq!(parse_quantity(q, 0), Ok(want), "{q}");
        }
    }

    #[test]
    fn resource_list_names_the_bad_resource() {
        let list: BTreeMap<String, Quantity> = [
            ("cpu".to_owned(), Quantity("250m".into())),
            ("memory".to_owned(), Quantity("lots".into())),
        ]
        .into();
        let e = Resources::from_list(&list).unwrap_err();
        assert_eq!(
            e.to_string(),
            r#"memory: "lots" is not a quantity: expected a number"#
        );
        let list: BTreeMap<String, Quantity> = [
            ("cpu".to_owned(), Quantity("250m".into())),
            ("nvidia.com/gpu".to_owned(), Quantity("1".into())),
        ]
        .into();
        assert_eq!(
            Resources::from_list(&list).unwrap(),
            Resources {
                cpu_millis: 250,
                memory_bytes: 0
            }
        );
    }

    fn capacity(
        free_cpu: i64,
        largest_cpu: i64,
        free_mem: i64,
        largest_mem: i64,
    ) -> ClusterCapacity {
        ClusterCapacity {
            nodes: 3,
            allocatable: Resources {
                cpu_millis: free_cpu + 1000,
                memory_bytes: free_mem + 1000,
            },
            requested: Resources {
                cpu_millis: 1000,
                memory_bytes: 1000,
            },
            largest_free: Resources {
                cpu_millis: largest_cpu,
                memory_bytes: largest_mem,
            },
        }
    }

    #[test]
    fn room_is_the_tighter_resource() {
        let c = capacity(4000, 2000, 1000, 1000);
        let req = |cpu, mem| Resources {
            cpu_millis: cpu,
            memory_bytes: mem,
        };
        assert_eq!(c.room_for(&req(500, 100)), 8);
        assert_eq!(c.room_for(&req(500, 300)), 3);
        assert_eq!(
            c.room_for(&req(0, 300)),
            3,
            "no CPU request: memory alone counts"
        );
        assert_eq!(c.room_for(&req(2001, 1)), 0, "no node has room for one");
        assert_eq!(
            c.room_for(&req(0, 0)),
            i64::MAX,
            "nothing requested: no limit"
        );
        // Overcommitted: requests above allocatable leave no room, not negative room.
        let mut over = c.clone();
        over.requested.cpu_millis = over.allocatable.cpu_millis + 5;
        assert_eq!(over.room_for(&req(1, 1)), 0);
    }
}
