//! Grants: which registered clusters the FederatedMyApps of a namespace may be placed on
//! (DESIGN.md rule 8), from the namespace's ClusterGrants, after OCM's
//! `ManagedClusterSetBinding`.
//!
//! - A namespace may place on the union of its grants: the registered clusters each
//!   names (a name not registered grants nothing until it is) and those its selector
//!   matches. `clusterSelector: {}` matches every registered cluster, as an empty
//!   selector does in placement (and as OCM's global ClusterSet does); a grant with
//!   neither names nor a selector, or with an invalid selector, grants nothing by it.
//! - A namespace without any grant places on every cluster (the default, so that an
//!   install without grants behaves as before), or on none when grants are `required`
//!   (`--require-namespace-grant`, the mode for a shared hub).
//! - A cluster placement chooses but the namespace is not granted gets nothing new and
//!   keeps what it runs ([`crate::plan::KeepReason::NotGranted`]): withdrawing a grant
//!   is not a deletion. Only deleting the FederatedMyApp takes its MyApps away.

use std::collections::{BTreeMap, BTreeSet};

use flotilla_crds::ClusterGrant;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use kube::core::{Selector, SelectorExt};

use crate::placement::{ClusterName, Labels, Members, SelectorError, parse_selector};

/// One ClusterGrant as planning reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct Grant {
    pub name: String,
    pub clusters: BTreeSet<String>,
    pub selector: Option<LabelSelector>,
}

/// Every namespace's grants, and whether a namespace needs one to place anywhere.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Grants {
    /// A namespace without a grant places nowhere (`--require-namespace-grant`).
    pub required: bool,
    /// namespace → its grants, by name.
    by_namespace: BTreeMap<String, Vec<Parsed>>,
}

/// One grant with its selector parsed once, when the grants are read.
#[derive(Debug, Clone, PartialEq)]
struct Parsed {
    grant: Grant,
    /// `None` without a selector; an invalid one (`Some(Err)`) selects nothing, and the
    /// error names its field as [`Grants::invalid`] reports it.
    selector: Option<Result<Selector, SelectorError>>,
}

impl Parsed {
    fn new(namespace: &str, grant: Grant) -> Self {
        let field = format!(
            "ClusterGrant {namespace}/{}: spec.clusterSelector",
            grant.name
        );
        let selector = grant.selector.as_ref().map(|s| parse_selector(s, &field));
        Self { grant, selector }
    }

    /// Whether this grant takes the cluster `name`: it names it, or its (valid)
    /// selector matches one of `labels`.
    fn takes<'a>(&self, name: &str, labels: impl IntoIterator<Item = &'a Labels>) -> bool {
        self.grant.clusters.contains(name)
            || matches!(&self.selector, Some(Ok(s)) if labels.into_iter().any(|l| s.matches(l)))
    }
}

/// What a namespace may place on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Granted {
    /// No grant, and none required: every registered cluster.
    Every,
    /// These registered clusters (possibly none).
    Only(BTreeSet<ClusterName>),
}

impl Granted {
    pub fn allows(&self, cluster: &str) -> bool {
        match self {
            Granted::Every => true,
            Granted::Only(clusters) => clusters.contains(cluster),
        }
    }
}

/// Why a namespace may place on no cluster at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NothingGranted {
    #[error(
        "namespace {0} has no ClusterGrant and this hub requires one (--require-namespace-grant): it may place on no cluster"
    )]
    NoGrant(String),
    #[error("the ClusterGrants of namespace {0} ({1}) grant no registered cluster")]
    NoneMatch(String, String),
}

impl Grants {
    /// The grants of `objects` (those being deleted are withdrawn already).
    pub fn new<'a>(required: bool, objects: impl IntoIterator<Item = &'a ClusterGrant>) -> Self {
        let mut by_namespace: BTreeMap<String, Vec<Parsed>> = BTreeMap::new();
        for g in objects {
            if g.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let namespace = g.namespace().unwrap_or_else(|| "default".into());
            let grant = Grant {
                name: g.name_any(),
                clusters: g.spec.clusters.iter().cloned().collect(),
                selector: g.spec.cluster_selector.clone(),
            };
            let parsed = Parsed::new(&namespace, grant);
            by_namespace.entry(namespace).or_default().push(parsed);
        }
        for grants in by_namespace.values_mut() {
            grants.sort_by(|a, b| a.grant.name.cmp(&b.grant.name));
        }
        Self {
            required,
            by_namespace,
        }
    }

    /// What `namespace` may place on among `members`; an error when that is nothing.
    pub fn granted(&self, namespace: &str, members: &Members) -> Result<Granted, NothingGranted> {
        let Some(grants) = self.by_namespace.get(namespace) else {
            return match self.required {
                true => Err(NothingGranted::NoGrant(namespace.to_owned())),
                false => Ok(Granted::Every),
            };
        };
        let mut clusters = BTreeSet::new();
        for grant in grants {
            let taken = members
                .iter()
                .filter(|(name, m)| grant.takes(name, [&m.labels]));
            clusters.extend(taken.map(|(name, _)| name.clone()));
        }
        if clusters.is_empty() {
            let names: Vec<&str> = grants.iter().map(|g| g.grant.name.as_str()).collect();
            return Err(NothingGranted::NoneMatch(
                namespace.to_owned(),
                names.join(", "),
            ));
        }
        Ok(Granted::Only(clusters))
    }

    /// The namespaces a grant of which names the cluster `name` or selects it by one of
    /// `labels`, in name order. Only a cluster that a grant may take changes what the
    /// namespace may place on when it joins, leaves or is relabelled, down to nothing at
    /// all, which fails the plan of each of its apps as a whole.
    pub fn taking<'a>(
        &self,
        name: &str,
        labels: impl IntoIterator<Item = &'a Labels> + Clone,
    ) -> impl Iterator<Item = &str> {
        (self.by_namespace.iter())
            .filter(move |(_, grants)| grants.iter().any(|g| g.takes(name, labels.clone())))
            .map(|(namespace, _)| namespace.as_str())
    }

    /// The namespaces whose grants differ between `self` and `other`.
    pub fn changed(&self, other: &Grants) -> BTreeSet<String> {
        let keys = self.by_namespace.keys().chain(other.by_namespace.keys());
        keys.filter(|ns| self.by_namespace.get(*ns) != other.by_namespace.get(*ns))
            .cloned()
            .collect()
    }

    /// The namespaces that had grants in `before` and have none now: in the default mode
    /// they may place on every cluster again, which the hub says out loud.
    pub fn widened(&self, before: &Grants) -> Vec<String> {
        match self.required {
            true => Vec::new(),
            false => (before.by_namespace.keys())
                .filter(|ns| !self.by_namespace.contains_key(*ns))
                .cloned()
                .collect(),
        }
    }

    /// The grants whose selector is invalid (they grant nothing by it): `(field, why)`.
    pub fn invalid(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for grant in self.by_namespace.values().flatten() {
            if let Some(Err(e)) = &grant.selector {
                out.push((e.field.clone(), e.reason.clone()));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::Member;
    use serde_json::json;

    fn grant(namespace: &str, name: &str, spec: serde_json::Value) -> ClusterGrant {
        serde_json::from_value(json!({
            "apiVersion": "flotilla.io/v1alpha1", "kind": "ClusterGrant",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec,
        }))
        .expect("a ClusterGrant")
    }

    fn members() -> Members {
        [
            ("c1", json!({"region": "eu"})),
            ("c2", json!({"region": "us"})),
            ("c3", json!({})),
        ]
        .into_iter()
        .map(|(n, l)| {
            let labels = serde_json::from_value(l).unwrap();
            (n.into(), Member::with_labels(labels))
        })
        .collect()
    }

    fn only(names: &[&str]) -> Result<Granted, NothingGranted> {
        Ok(Granted::Only(names.iter().map(|n| (*n).into()).collect()))
    }

    /// Ugly inputs first: grants that grant nothing, names nobody registered, invalid
    /// selectors, a grant being deleted.
    #[test]
    fn grants_that_match_nothing_grant_nothing_and_say_so() {
        let objects = [
            grant("t", "empty", json!({})),
            grant("t", "ghost", json!({"clusters": ["ghost", ""]})),
            grant(
                "t",
                "mars",
                json!({"clusterSelector": {"matchLabels": {"region": "mars"}}}),
            ),
            grant(
                "t",
                "bad",
                json!({"clusterSelector": {"matchExpressions": [{"key": "region", "operator": "In"}]}}),
            ),
        ];
        let grants = Grants::new(false, &objects);
        let refused = grants.granted("t", &members()).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "the ClusterGrants of namespace t (bad, empty, ghost, mars) grant no registered cluster"
        );
        assert_eq!(
            grants.invalid(),
            [(
                "ClusterGrant t/bad: spec.clusterSelector.matchExpressions[0]".to_owned(),
                "operator In needs at least one value".to_owned()
            )]
        );
        // A name granted before its cluster registers grants it once it does.
        let mut later = members();
        later.insert("ghost".into(), Member::default());
        assert_eq!(grants.granted("t", &later), only(&["ghost"]));
        // A grant being deleted is withdrawn already.
        let mut going = grant("t", "all", json!({"clusterSelector": {}}));
        going.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            ));
        let grants = Grants::new(false, [&going]);
        assert_eq!(grants.granted("t", &members()), Ok(Granted::Every));
    }

    #[test]
    fn a_namespace_places_on_the_union_of_its_grants_and_an_empty_selector_is_every_cluster() {
        let objects = [
            grant("t", "by-name", json!({"clusters": ["c2"]})),
            grant(
                "t",
                "eu",
                json!({"clusterSelector": {"matchLabels": {"region": "eu"}}}),
            ),
            grant("all", "all", json!({"clusterSelector": {}})),
            grant(
                "both",
                "both",
                json!({"clusters": ["c3"], "clusterSelector": {"matchLabels": {"region": "us"}}}),
            ),
        ];
        let grants = Grants::new(true, &objects);
        assert_eq!(grants.granted("t", &members()), only(&["c1", "c2"]));
        assert_eq!(grants.granted("all", &members()), only(&["c1", "c2", "c3"]));
        assert_eq!(grants.granted("both", &members()), only(&["c2", "c3"]));
        assert!(grants.granted("t", &members()).unwrap().allows("c1"));
        assert!(!grants.granted("t", &members()).unwrap().allows("c3"));
    }

    #[test]
    fn without_a_grant_a_namespace_places_everywhere_unless_grants_are_required() {
        let objects = [grant("t", "g", json!({"clusters": ["c1"]}))];
        assert_eq!(
            Grants::new(false, &objects).granted("other", &members()),
            Ok(Granted::Every)
        );
        assert!(Granted::Every.allows("anything"));
        let refused = Grants::new(true, &objects)
            .granted("other", &members())
            .unwrap_err();
        assert_eq!(
            refused.to_string(),
            "namespace other has no ClusterGrant and this hub requires one (--require-namespace-grant): it may place on no cluster"
        );
        assert_eq!(
            Grants::default().granted("default", &Members::new()),
            Ok(Granted::Every)
        );
    }

    #[test]
    fn changes_are_found_by_namespace_and_a_last_grant_withdrawn_widens_by_default() {
        let a = grant("t", "g", json!({"clusters": ["c1"]}));
        let b = grant("t", "g", json!({"clusters": ["c2"]}));
        let u = grant("u", "g", json!({"clusters": ["c1"]}));
        let before = Grants::new(false, [&a, &u]);
        let after = Grants::new(false, [&b]);
        assert_eq!(
            after.changed(&before),
            ["t".to_owned(), "u".to_owned()].into()
        );
        assert!(before.changed(&before.clone()).is_empty());
        assert_eq!(after.widened(&before), ["u"]);
        let strict = Grants::new(true, [&b]);
        assert!(strict.widened(&Grants::new(true, [&a, &u])).is_empty());
    }

    /// The example the README and docs/security.md show grants what they say.
    #[test]
    fn the_example_grants_cluster1_and_the_eu_clusters() {
        let example: ClusterGrant =
            serde_yaml::from_str(include_str!("../../examples/clustergrant.yaml")).unwrap();
        let mut m = members();
        m.insert("cluster1".into(), Member::default());
        let grants = Grants::new(true, [&example]);
        assert_eq!(grants.granted("shop", &m), only(&["c1", "cluster1"]));
        assert!(grants.granted("default", &m).is_err());
    }

    mod property {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Whatever the grants (any names, any labels), a namespace is granted only
            /// registered clusters, exactly those some grant names or selects by its
            /// labels; and adding a grant never takes a cluster away.
            #[test]
            fn granted_is_exactly_the_union_over_registered_clusters(
                names in prop::collection::vec(prop::sample::select(vec!["c1", "c2", "c3", "x", ""]), 0..4),
                labels in prop::collection::vec(prop::sample::select(vec!["eu", "us", "mars"]), 0..3),
                extra in prop::sample::select(vec!["c1", "c2", "x"]),
            ) {
                let m = members();
                let mut objects: Vec<ClusterGrant> = vec![grant("t", "named", json!({"clusters": names}))];
                for (i, l) in labels.iter().enumerate() {
                    objects.push(grant("t", &format!("l{i}"), json!({"clusterSelector": {"matchLabels": {"region": l}}})));
                }
                let want: BTreeSet<ClusterName> = m.iter()
                    .filter(|(n, mm)| names.contains(&&***n) || labels.iter().any(|l| mm.labels.get("region") == Some(&l.to_string())))
                    .map(|(n, _)| n.clone())
                    .collect();
                let got = Grants::new(true, &objects).granted("t", &m);
                match want.is_empty() {
                    true => prop_assert!(got.is_err()),
                    false => prop_assert_eq!(got.clone(), Ok(Granted::Only(want.clone()))),
                }
                objects.push(grant("t", "zz", json!({"clusters": [extra]})));
                let wider = Grants::new(true, &objects).granted("t", &m);
                if let Ok(Granted::Only(before)) = got {
                    let Ok(Granted::Only(after)) = wider else { panic!("narrowed to nothing") };
                    prop_assert!(before.is_subset(&after));
                }
            }
        }
    }
}
