//! Tenancy: the agent's own check of DESIGN.md rule 8. A MyApp is never applied into a
//! forbidden namespace (`flotilla_crds::tenancy`), whatever the hub sends: a compromised
//! or misconfigured hub cannot place workloads where pods would read the cluster's or
//! Flotilla's Secrets. Each refusal is reported back for that MyApp (as an apply error),
//! logged, and counted by rule.
//!
//! Deletes and releases are not refused: they only ever take MyApps Flotilla manages,
//! and one placed before a namespace was forbidden must stay removable with its
//! FederatedMyApp.

use flotilla_crds::tenancy::{Forbidden, NamespacePolicy};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::cache::Key;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleLabels {
    rule: &'static str,
}

/// The namespaces the agent refuses, and how often it refused each rule.
#[derive(Clone, Debug, Default)]
pub struct Guard {
    policy: NamespacePolicy,
    refused: Family<RuleLabels, Counter>,
}

impl Guard {
    pub fn new(policy: NamespacePolicy) -> Self {
        Self {
            policy,
            refused: Family::default(),
        }
    }

    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "flotilla_agent_myapps_refused",
            "MyApps the hub sent that the agent refused to apply, by the tenancy rule that forbids their namespace",
            self.refused.clone(),
        );
    }

    pub fn policy(&self) -> &NamespacePolicy {
        &self.policy
    }

    /// The forbidden namespaces, in name order.
    pub fn forbidden(&self) -> impl Iterator<Item = &str> {
        self.policy.namespaces().map(|(namespace, _)| namespace)
    }

    /// Whether a MyApp may be applied at `key`; a refusal is counted.
    pub fn check(&self, key: &Key) -> Result<(), Forbidden> {
        self.policy.check(&key.namespace).inspect_err(|forbidden| {
            let labels = RuleLabels {
                rule: forbidden.rule.label(),
            };
            self.refused.get_or_create(&labels).inc();
        })
    }

    /// Refusals so far under `rule`.
    #[cfg(test)]
    pub fn refused(&self, rule: flotilla_crds::tenancy::Rule) -> u64 {
        let labels = RuleLabels { rule: rule.label() };
        self.refused.get_or_create(&labels).get()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::time::Duration;

    use flotilla_crds::tenancy::Rule;
    use futures::{StreamExt, stream};
    use tokio::sync::mpsc;

    use super::*;
    use crate::collect::{Breaker, Collector};
    use crate::report::Notice;
    use crate::session::HubCommand;
    use crate::sync::{Applier, SyncError, carry_out};

    fn manifest(namespace: &str) -> bytes::Bytes {
        let app = serde_json::json!({
            "apiVersion": "app.example.com/v1", "kind": "MyApp",
            "metadata": {"name": "x", "namespace": namespace,
                         "labels": {flotilla_crds::MANAGED_BY_LABEL: flotilla_crds::MANAGED_BY_VALUE}},
            "spec": {"image": "nginx:1.27"},
        });
        serde_json::to_vec(&app).unwrap().into()
    }

    fn applier(guard: &Guard) -> Applier {
        let store = crate::store_of(&[]);
        Applier::new(crate::unreachable_client(), store, crate::no_autoscalers())
            .with_guard(guard.clone())
    }

    /// Refused before any request: the apiserver here never answers, so any call would
    /// have failed as an API error instead.
    #[tokio::test]
    async fn a_myapp_in_a_forbidden_namespace_is_refused_without_a_request() {
        let guard = Guard::new(NamespacePolicy::new("flotilla", ["vault"]));
        let applier = applier(&guard);
        for (namespace, rule) in [
            ("kube-system", Rule::System),
            ("kube-node-lease", Rule::System),
            ("flotilla", Rule::Flotilla),
            ("vault", Rule::Configured),
        ] {
            let key = Key::new(namespace, "x");
            let refused = applier.apply(&key, &manifest(namespace)).await;
            let Err(SyncError::Forbidden { forbidden, .. }) = &refused else {
                panic!("{namespace}: {refused:?}")
            };
            assert_eq!(forbidden.rule, rule);
            assert_eq!(
                refused.unwrap_err().to_string(),
                format!(
                    "MyApp {namespace}/x refused: namespace {namespace} is forbidden: {}",
                    rule.describe()
                )
            );
        }
        assert_eq!(guard.refused(Rule::System), 2);
        assert_eq!(guard.refused(Rule::Flotilla), 1);
        assert_eq!(guard.refused(Rule::Configured), 1);
        // An allowed namespace goes on to the apiserver (which fails here).
        let allowed = applier
            .apply(&Key::new("team", "x"), &manifest("team"))
            .await;
        assert!(matches!(allowed, Err(SyncError::Api { .. })), "{allowed:?}");
    }

    /// Through the hub's path: the refusal is reported for that MyApp, once (retrying
    /// cannot help), and a Delete there is still carried out (it only takes Flotilla's
    /// own MyApps, and must stay possible for one placed before the rule).
    #[tokio::test]
    async fn a_refusal_is_reported_once_and_deletes_still_go_through() {
        let guard = Guard::default();
        let applier = applier(&guard);
        let collector = Collector {
            cluster: "c1".into(),
            managed: crate::store_of(&[]),
            breaker: Breaker::new(HashSet::new(), 0.5),
        };
        let key = Key::new("kube-system", "x");
        let commands = vec![
            HubCommand::Apply {
                key: key.clone(),
                manifest: manifest("kube-system"),
            },
            HubCommand::Delete {
                key: Key::new("kube-public", "y"),
                orphan: false,
            },
        ];
        let commands = stream::iter(commands.into_iter().map(Ok::<_, ()>)).chain(stream::pending());
        let (tx, mut rx) = mpsc::unbounded_channel();
        let work = carry_out(commands, &applier, &collector, 4, &tx);
        let mut notices = Vec::new();
        let _ = tokio::time::timeout(Duration::from_millis(2500), async {
            tokio::select! {
                _ = work => {}
                () = async { while let Some(n) = rx.recv().await { notices.push(n) } } => {}
            }
        })
        .await;
        let refusals: Vec<&Notice> = notices
            .iter()
            .filter(|n| matches!(n, Notice::Tried { key: k, .. } if *k == key))
            .collect();
        assert_eq!(refusals.len(), 1, "{notices:?}");
        let Notice::Tried {
            error: Some(e),
            applied: false,
            ..
        } = refusals[0]
        else {
            panic!("{refusals:?}")
        };
        assert!(e.contains("namespace kube-system is forbidden"), "{e}");
        let delete_tried = notices.iter().any(|n| {
            matches!(n, Notice::Tried { key: k, error: Some(e), .. } if k.name == "y" && e.contains("reading MyApp"))
        });
        assert!(delete_tried, "{notices:?}");
    }
}
