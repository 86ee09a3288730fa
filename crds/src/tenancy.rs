//! Tenancy: the namespaces no FederatedMyApp may be placed from, and no MyApp applied
//! into. Shared by the hub, which refuses to plan an app in one, and the agent, which
//! refuses to apply a MyApp into one whatever the hub sends (DESIGN.md rule 8).
//!
//! A FederatedMyApp's MyApps land in the member namespace of the same name (overrides
//! cannot change it), so one rule covers both sides. Whoever may create a FederatedMyApp
//! in namespace N runs pods in member namespace N, and pods read N's Secrets through
//! `env.valueFrom.secretKeyRef`: N = Flotilla's own namespace would hand out the
//! member's hub credential, N = `kube-system` the cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// The namespaces Kubernetes itself keeps: never a tenant's.
pub const SYSTEM_NAMESPACES: [&str; 3] = ["kube-system", "kube-public", "kube-node-lease"];

/// The namespace Flotilla runs in unless told otherwise (`POD_NAMESPACE`).
pub const DEFAULT_OWN_NAMESPACE: &str = "flotilla-system";

/// Why a namespace is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rule {
    /// One of [`SYSTEM_NAMESPACES`].
    System,
    /// The namespace the hub or the agent runs in: it holds their credentials.
    Flotilla,
    /// Named by `--forbidden-namespace`.
    Configured,
    /// Not named by the agent's `--allowed-namespace`, when it has one.
    NotAllowed,
}

impl Rule {
    /// The rule in words, for status, Events and logs.
    pub fn describe(self) -> &'static str {
        match self {
            Rule::System => "Kubernetes system namespaces are never placed into",
            Rule::Flotilla => {
                "Flotilla's own namespace holds its credentials and is never placed into"
            }
            Rule::Configured => "it is listed in --forbidden-namespace",
            Rule::NotAllowed => "it is not listed in --allowed-namespace",
        }
    }

    /// A short name, for metric labels.
    pub fn label(self) -> &'static str {
        match self {
            Rule::System => "system",
            Rule::Flotilla => "flotilla",
            Rule::Configured => "configured",
            Rule::NotAllowed => "not_allowed",
        }
    }
}

/// A namespace the policy refuses, and by which rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forbidden {
    pub namespace: String,
    pub rule: Rule,
}

impl fmt::Display for Forbidden {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "namespace {} is forbidden: {}",
            self.namespace,
            self.rule.describe()
        )
    }
}

impl std::error::Error for Forbidden {}

/// The forbidden namespaces: the system ones, Flotilla's own, and a configured list;
/// and, when set, the only namespaces allowed (an agent's own list: what its member's
/// admin lets any hub place into, whatever the hub was told).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespacePolicy {
    forbidden: BTreeMap<String, Rule>,
    allowed: Option<BTreeSet<String>>,
}

impl Default for NamespacePolicy {
    fn default() -> Self {
        Self::new(DEFAULT_OWN_NAMESPACE, std::iter::empty::<String>())
    }
}

impl NamespacePolicy {
    /// The policy of a process running in namespace `own`, refusing `configured` too
    /// (empty names, as an empty environment variable gives, are ignored).
    pub fn new<S: AsRef<str>>(own: &str, configured: impl IntoIterator<Item = S>) -> Self {
        let mut forbidden = BTreeMap::new();
        let configured = configured.into_iter();
        for name in configured.filter(|n| !n.as_ref().trim().is_empty()) {
            forbidden.insert(name.as_ref().trim().to_owned(), Rule::Configured);
        }
        // The stronger rule names the namespace when a list repeats a built-in one.
        forbidden.insert(own.to_owned(), Rule::Flotilla);
        for name in SYSTEM_NAMESPACES {
            forbidden.insert(name.to_owned(), Rule::System);
        }
        Self {
            forbidden,
            allowed: None,
        }
    }

    /// The only namespaces allowed, when the policy names them.
    pub fn allowed(&self) -> Option<&BTreeSet<String>> {
        self.allowed.as_ref()
    }

    /// Allows only `namespaces` (the forbidden ones stay forbidden); none named: every
    /// namespace that is not forbidden.
    pub fn allowing_only<S: AsRef<str>>(self, namespaces: impl IntoIterator<Item = S>) -> Self {
        let named: BTreeSet<String> = namespaces
            .into_iter()
            .map(|n| n.as_ref().trim().to_owned())
            .filter(|n| !n.is_empty())
            .collect();
        Self {
            allowed: (!named.is_empty()).then_some(named),
            ..self
        }
    }

    /// Why `namespace` is refused, if it is.
    pub fn check(&self, namespace: &str) -> Result<(), Forbidden> {
        let not_allowed = |allowed: &BTreeSet<String>| !allowed.contains(namespace);
        let rule = match self.forbidden.get(namespace) {
            Some(rule) => *rule,
            None if self.allowed.as_ref().is_some_and(not_allowed) => Rule::NotAllowed,
            None => return Ok(()),
        };
        Err(Forbidden {
            namespace: namespace.to_owned(),
            rule,
        })
    }

    /// Every forbidden namespace, in name order.
    pub fn namespaces(&self) -> impl Iterator<Item = (&str, Rule)> {
        self.forbidden.iter().map(|(n, r)| (n.as_str(), *r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_own_and_configured_namespaces_are_refused_by_their_rule() {
        let policy = NamespacePolicy::new("flotilla", ["vault", " argocd ", ""]);
        let rule = |ns| policy.check(ns).err().map(|f| f.rule);
        assert_eq!(rule("kube-system"), Some(Rule::System));
        assert_eq!(rule("kube-public"), Some(Rule::System));
        assert_eq!(rule("kube-node-lease"), Some(Rule::System));
        assert_eq!(rule("flotilla"), Some(Rule::Flotilla));
        assert_eq!(rule("vault"), Some(Rule::Configured));
        assert_eq!(rule("argocd"), Some(Rule::Configured));
        for allowed in [
            "default",
            "flotilla-system",
            "",
            "kube-systemx",
            "Kube-System",
        ] {
            assert_eq!(rule(allowed), None, "{allowed:?}");
        }
    }

    #[test]
    fn the_default_refuses_flotilla_system_and_allows_the_seeds_namespace() {
        let policy = NamespacePolicy::default();
        assert!(policy.check("default").is_ok());
        let refused = policy.check("flotilla-system").unwrap_err();
        assert_eq!(
            refused.to_string(),
            "namespace flotilla-system is forbidden: Flotilla's own namespace holds its credentials and is never placed into"
        );
    }

    #[test]
    fn an_allow_list_refuses_the_rest_and_never_allows_a_forbidden_namespace() {
        let policy = NamespacePolicy::default().allowing_only(["shop", " kube-system", ""]);
        assert!(policy.check("shop").is_ok());
        assert_eq!(policy.check("default").unwrap_err().rule, Rule::NotAllowed);
        assert_eq!(policy.check("kube-system").unwrap_err().rule, Rule::System);
        assert_eq!(
            policy.check("team").unwrap_err().to_string(),
            "namespace team is forbidden: it is not listed in --allowed-namespace"
        );
        let open = NamespacePolicy::default().allowing_only(["", " "]);
        assert_eq!(open, NamespacePolicy::default(), "an empty list allows all");
    }

    #[test]
    fn a_configured_built_in_keeps_its_built_in_rule() {
        let policy = NamespacePolicy::new("ops", ["kube-system", "ops"]);
        assert_eq!(policy.check("kube-system").unwrap_err().rule, Rule::System);
        assert_eq!(policy.check("ops").unwrap_err().rule, Rule::Flotilla);
        assert_eq!(policy.namespaces().count(), 4);
    }
}
