//! Placement: which member clusters one FederatedMyApp goes to.
//!
//! KubeFed's rule: `clusters`, when present (even empty), wins over `clusterSelector`; an
//! empty selector selects every registered cluster; with neither, nothing is placed. A
//! named cluster that is not registered is reported, never silently dropped. The result
//! is sorted and free of duplicates, so equal inputs give equal outputs.
//!
//! What placement and scheduling read of a registered cluster is a [`Member`], made from
//! its MemberCluster ([`Member::from_cluster`], [`registered_of`]): labels, cordon,
//! readiness and the capacity its agent last reported.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Duration;

use flotilla_crds::MemberCluster;
use flotilla_crds::federated::Placement;
use flotilla_crds::member::ClusterCapacity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::core::{Selector, SelectorExt};

pub type Labels = BTreeMap<String, String>;

/// What placement and scheduling need to know of a registered member cluster.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Member {
    pub labels: Labels,
    /// Cordoned (`spec.unschedulable`): keeps what it runs, gets nothing new.
    pub unschedulable: bool,
    /// How long its `Ready` condition has been False; `None` while Ready or not yet known.
    pub not_ready_for: Option<Duration>,
    /// What its agent last reported.
    pub capacity: Option<ClusterCapacity>,
}

impl Member {
    pub fn with_labels(labels: Labels) -> Self {
        Self {
            labels,
            ..Self::default()
        }
    }

    /// Reads a MemberCluster as of `now` (the only clock input: callers pass it so that
    /// this stays a plain function).
    pub fn from_cluster(mc: &MemberCluster, now: Timestamp) -> Self {
        let status = mc.status.as_ref();
        let ready = status.and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
        let not_ready_for = ready.filter(|c| c.status == "False").map(|c| {
            let since = c.last_transition_time.0;
            // A transition stamped in the future (clock skew) counts as just now.
            Duration::try_from(now.duration_since(since)).unwrap_or_default()
        });
        Self {
            labels: mc.metadata.labels.clone().unwrap_or_default(),
            unschedulable: mc.spec.unschedulable,
            not_ready_for,
            capacity: status.and_then(|s| s.capacity.clone()),
        }
    }
}

/// A registered cluster's name, shared: a big hub holds one per (cluster, app) in its
/// plans, schedules and index, and each of them is a handle to the copy in [`Members`]
/// (one pointer, 8 bytes, not a string of its own).
pub type ClusterName = arcstr::ArcStr;

/// Registered member clusters by name.
pub type Members = BTreeMap<ClusterName, Member>;

/// The registered clusters as planning reads them (labels, cordon, readiness, capacity),
/// leaving out those being deleted; readiness is judged now. The e2e convergence checker
/// reads the host's list through this; the hub, which plans in batches, through
/// [`ClusterNames::registered_of`].
pub fn registered_of<'a>(clusters: impl IntoIterator<Item = &'a MemberCluster>) -> Members {
    ClusterNames::default().registered_of(clusters)
}

/// The clusters' names, kept from one reading of the registered clusters to the next, so
/// that plans made in different batches share one copy of each name. It holds the names
/// of the last reading only: a cluster that left is forgotten at the next one.
#[derive(Debug, Default)]
pub struct ClusterNames(HashSet<ClusterName>);

impl ClusterNames {
    /// [`registered_of`], with each name the copy an earlier reading made when it has one.
    pub fn registered_of<'a>(
        &mut self,
        clusters: impl IntoIterator<Item = &'a MemberCluster>,
    ) -> Members {
        let now = Timestamp::now();
        let mut read = HashSet::with_capacity(self.0.len());
        let members = clusters
            .into_iter()
            .filter(|m| m.metadata.deletion_timestamp.is_none())
            .map(|m| {
                let name = m.name_any();
                let name = self
                    .0
                    .get(name.as_str())
                    .cloned()
                    .unwrap_or_else(|| name.into());
                read.insert(name.clone());
                (name, Member::from_cluster(m, now))
            })
            .collect();
        self.0 = read;
        members
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decision {
    /// Registered clusters that get the MyApp, sorted.
    pub clusters: Vec<ClusterName>,
    /// Clusters named in `placement.clusters` that are not registered, sorted.
    pub unknown: Vec<ClusterName>,
    /// Registered clusters placement chooses but the app's namespace is not granted
    /// (filled in by [`crate::plan()`] from [`crate::grants`]), sorted.
    pub not_granted: Vec<ClusterName>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct SelectorError {
    /// The offending field, e.g. `spec.placement.clusterSelector.matchExpressions[0]`.
    pub field: String,
    pub reason: String,
}

pub fn place(placement: &Placement, members: &Members) -> Result<Decision, SelectorError> {
    if let Some(named) = &placement.clusters {
        let named: BTreeSet<&str> = named.iter().map(|c| c.name.as_str()).collect();
        let mut decision = Decision::default();
        for name in named {
            match members.get_key_value(name) {
                Some((registered, _)) => decision.clusters.push(registered.clone()),
                None => decision.unknown.push(name.into()),
            }
        }
        return Ok(decision);
    }
    let Some(selector) = &placement.cluster_selector else {
        return Ok(Decision::default());
    };
    let selector = parse_selector(selector, "spec.placement.clusterSelector")?;
    let clusters = members
        .iter()
        .filter(|(_, m)| selector.matches(&m.labels))
        .map(|(name, _)| name.clone())
        .collect();
    Ok(Decision {
        clusters,
        unknown: vec![],
        not_granted: vec![],
    })
}

/// Validates the selector as the apiserver does for Deployments (kube's own conversion
/// accepts `In` with no values) and turns it into a matcher.
pub(crate) fn parse_selector(
    selector: &LabelSelector,
    field: &str,
) -> Result<Selector, SelectorError> {
    for (i, req) in selector.match_expressions.iter().flatten().enumerate() {
        check_requirement(req).map_err(|reason| SelectorError {
            field: format!("{field}.matchExpressions[{i}]"),
            reason,
        })?;
    }
    Selector::try_from(selector.clone()).map_err(|e| SelectorError {
        field: field.into(),
        reason: e.0,
    })
}

fn check_requirement(req: &LabelSelectorRequirement) -> Result<(), String> {
    let values = req.values.as_deref().unwrap_or_default();
    if req.key.is_empty() {
        return Err("key must not be empty".into());
    }
    match req.operator.as_str() {
        "In" | "NotIn" if values.is_empty() => Err(format!(
            "operator {} needs at least one value",
            req.operator
        )),
        "Exists" | "DoesNotExist" if !values.is_empty() => {
            Err(format!("operator {} takes no values", req.operator))
        }
        "In" | "NotIn" | "Exists" | "DoesNotExist" => Ok(()),
        other => Err(format!(
            "unknown operator {other:?}; expected In, NotIn, Exists or DoesNotExist"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_crds::federated::ClusterRef;

    fn members() -> Members {
        let mut m = Members::new();
        for (name, labels) in [
            ("cluster1", vec![("region", "eu"), ("tier", "gold")]),
            ("cluster2", vec![("region", "us")]),
            ("cluster3", vec![("region", "eu")]),
            ("bare", vec![]),
        ] {
            m.insert(
                name.into(),
                Member::with_labels(
                    labels
                        .into_iter()
                        .map(|(k, v)| (k.into(), v.into()))
                        .collect(),
                ),
            );
        }
        m
    }

    fn named(names: &[&str]) -> Placement {
        Placement {
            clusters: Some(
                names
                    .iter()
                    .map(|n| ClusterRef { name: (*n).into() })
                    .collect(),
            ),
            ..Placement::default()
        }
    }

    fn selector(labels: &[(&str, &str)], exprs: &[(&str, &str, &[&str])]) -> Placement {
        Placement {
            clusters: None,
            cluster_selector: Some(LabelSelector {
                match_labels: (!labels.is_empty()).then(|| {
                    labels
                        .iter()
                        .map(|(k, v)| ((*k).into(), (*v).into()))
                        .collect()
                }),
                match_expressions: (!exprs.is_empty()).then(|| {
                    exprs
                        .iter()
                        .map(|(k, op, vs)| LabelSelectorRequirement {
                            key: (*k).into(),
                            operator: (*op).into(),
                            values: (!vs.is_empty())
                                .then(|| vs.iter().map(|v| (*v).into()).collect()),
                        })
                        .collect()
                }),
            }),
            ..Placement::default()
        }
    }

    fn clusters(p: &Placement) -> Vec<String> {
        names(&place(p, &members()).unwrap().clusters)
    }

    fn names(clusters: &[ClusterName]) -> Vec<String> {
        clusters.iter().map(|c| c.to_string()).collect()
    }

    #[test]
    fn explicit_list_is_sorted_and_deduplicated() {
        let d = place(&named(&["cluster2", "cluster1", "cluster2"]), &members()).unwrap();
        assert_eq!(names(&d.clusters), ["cluster1", "cluster2"]);
        assert!(d.unknown.is_empty());
    }

    #[test]
    fn unregistered_named_clusters_are_reported() {
        let d = place(&named(&["cluster1", "ghost", "ghost", "alpha"]), &members()).unwrap();
        assert_eq!(names(&d.clusters), ["cluster1"]);
        assert_eq!(names(&d.unknown), ["alpha", "ghost"]);
    }

    #[test]
    fn explicit_list_wins_over_selector() {
        let mut p = selector(&[("region", "eu")], &[]);
        p.clusters = Some(vec![ClusterRef {
            name: "cluster2".into(),
        }]);
        assert_eq!(clusters(&p), ["cluster2"]);
    }

    #[test]
    fn empty_explicit_list_places_nowhere_even_with_a_selector() {
        let mut p = selector(&[], &[]);
        p.clusters = Some(vec![]);
        assert_eq!(place(&p, &members()).unwrap(), Decision::default());
    }

    #[test]
    fn neither_list_nor_selector_places_nowhere() {
        assert_eq!(
            place(&Placement::default(), &members()).unwrap(),
            Decision::default()
        );
    }

    #[test]
    fn empty_selector_selects_every_cluster() {
        assert_eq!(
            clusters(&selector(&[], &[])),
            ["bare", "cluster1", "cluster2", "cluster3"]
        );
    }

    #[test]
    fn match_labels() {
        assert_eq!(
            clusters(&selector(&[("region", "eu")], &[])),
            ["cluster1", "cluster3"]
        );
        assert_eq!(
            clusters(&selector(&[("region", "eu"), ("tier", "gold")], &[])),
            ["cluster1"]
        );
        assert!(clusters(&selector(&[("region", "mars")], &[])).is_empty());
    }

    #[test]
    fn match_expressions_every_operator() {
        assert_eq!(
            clusters(&selector(&[], &[("region", "In", &["us", "eu"])])),
            ["cluster1", "cluster2", "cluster3"]
        );
        // NotIn also matches clusters without the label, as in Kubernetes.
        assert_eq!(
            clusters(&selector(&[], &[("region", "NotIn", &["eu"])])),
            ["bare", "cluster2"]
        );
        assert_eq!(
            clusters(&selector(&[], &[("tier", "Exists", &[])])),
            ["cluster1"]
        );
        assert_eq!(
            clusters(&selector(&[], &[("tier", "DoesNotExist", &[])])),
            ["bare", "cluster2", "cluster3"]
        );
    }

    #[test]
    fn labels_and_expressions_are_anded() {
        let p = selector(&[("region", "eu")], &[("tier", "DoesNotExist", &[])]);
        assert_eq!(clusters(&p), ["cluster3"]);
    }

    #[test]
    fn selector_matches_no_registered_clusters_when_there_are_none() {
        assert!(
            place(&selector(&[], &[]), &Members::new())
                .unwrap()
                .clusters
                .is_empty()
        );
    }

    fn cluster(yaml: &str) -> MemberCluster {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn member_reads_labels_cordon_readiness_and_capacity() {
        let now: Timestamp = "2025-01-01T00:10:00Z".parse().unwrap();
        let mc = cluster(
            "apiVersion: core.kubefed.io/v1beta1\nkind: MemberCluster\nmetadata: {name: c1, labels: {region: eu}}\n\
             spec: {unschedulable: true}\nstatus:\n  conditions:\n  - {type: Ready, status: 'False', reason: AgentSilent, message: '', lastTransitionTime: '2025-01-01T00:05:00Z'}\n  \
             capacity: {nodes: 2, allocatable: {cpuMillis: 4000, memoryBytes: 8}, requested: {cpuMillis: 1000, memoryBytes: 2}, largestFree: {cpuMillis: 2000, memoryBytes: 4}}\n",
        );
        let m = Member::from_cluster(&mc, now);
        assert_eq!(m.labels["region"], "eu");
        assert!(m.unschedulable);
        assert_eq!(m.not_ready_for, Some(Duration::from_secs(300)));
        assert_eq!(m.capacity.unwrap().nodes, 2);
    }

    #[test]
    fn member_ready_unknown_or_skewed_is_not_counted_as_down_for_long() {
        let now: Timestamp = "2025-01-01T00:00:00Z".parse().unwrap();
        let fresh = cluster(
            "apiVersion: core.kubefed.io/v1beta1\nkind: MemberCluster\nmetadata: {name: c1}\nspec: {}\n",
        );
        assert_eq!(Member::from_cluster(&fresh, now), Member::default());
        for (status, want) in [("'True'", None), ("'False'", Some(Duration::ZERO))] {
            let mc = cluster(&format!(
                "apiVersion: core.kubefed.io/v1beta1\nkind: MemberCluster\nmetadata: {{name: c1}}\nspec: {{}}\nstatus:\n  conditions:\n  - {{type: Ready, status: {status}, reason: r, message: '', lastTransitionTime: '2025-01-01T00:05:00Z'}}\n"
            ));
            assert_eq!(
                Member::from_cluster(&mc, now).not_ready_for,
                want,
                "{status}"
            );
        }
    }

    #[test]
    fn registered_leaves_out_clusters_being_deleted() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let mut gone = MemberCluster::new("gone", Default::default());
        gone.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        let c1 = MemberCluster::new("c1", Default::default());
        assert_eq!(
            names(&registered_of([&gone, &c1]).into_keys().collect::<Vec<_>>()),
            ["c1"]
        );
    }

    /// The hub plans in batches, each with a new reading of the clusters: every plan of a
    /// cluster must hold the one copy of its name, and a cluster that left is forgotten.
    #[test]
    fn readings_share_each_name_and_forget_clusters_that_left() {
        let (c1, c2) = (
            MemberCluster::new("c1", Default::default()),
            MemberCluster::new("c2", Default::default()),
        );
        let mut kept = ClusterNames::default();
        let first = kept.registered_of([&c1, &c2]);
        let second = kept.registered_of([&c1, &c2]);
        for (a, b) in first.keys().zip(second.keys()) {
            assert!(ClusterName::ptr_eq(a, b), "{a} is copied, not shared");
        }
        let without = kept.registered_of([&c1]);
        assert!(ClusterName::ptr_eq(
            first.get_key_value("c1").unwrap().0,
            without.get_key_value("c1").unwrap().0
        ));
        assert_eq!(kept.0.len(), 1, "c2 left: its name is not kept");
        let back = kept.registered_of([&c1, &c2]);
        assert_eq!(names(&back.into_keys().collect::<Vec<_>>()), ["c1", "c2"]);
    }

    #[test]
    fn invalid_requirements_name_the_field() {
        let cases: [(&str, &str, &[&str], &str); 5] = [
            ("region", "In", &[], "operator In needs at least one value"),
            (
                "region",
                "NotIn",
                &[],
                "operator NotIn needs at least one value",
            ),
            (
                "region",
                "Exists",
                &["eu"],
                "operator Exists takes no values",
            ),
            ("region", "Equals", &["eu"], "unknown operator \"Equals\""),
            ("", "Exists", &[], "key must not be empty"),
        ];
        for (key, op, values, want) in cases {
            let p = selector(&[], &[("tier", "Exists", &[]), (key, op, values)]);
            let err = place(&p, &members()).unwrap_err();
            assert_eq!(
                err.field,
                "spec.placement.clusterSelector.matchExpressions[1]"
            );
            assert!(err.reason.contains(want), "{op}: {}", err.reason);
        }
    }
}
