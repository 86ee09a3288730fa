//! Admission: what is checked of a FederatedMyApp before anything is placed or rendered.
//! An app refused here is planned nowhere: every registered cluster keeps what it runs
//! (a MyApp placed before the refusal is neither updated nor deleted: refusing to place
//! is never a reason to delete), and status says which rule refused it.
//!
//! - Its namespace must not be forbidden ([`NamespacePolicy`]): its MyApps would land
//!   in the member namespace of the same name.
//! - Its template and overrides must stay within [`SizeLimits`]: every hub replica holds
//!   one render per distinct override set, so their size bounds the hub's memory, and a
//!   rendered MyApp must fit an etcd object (1.5 MiB) with room to spare.

use flotilla_crds::FederatedMyApp;
use flotilla_crds::tenancy::{Forbidden, NamespacePolicy};
use serde::Serialize;

/// Bounds on what one FederatedMyApp may ask the hub to hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeLimits {
    /// `spec.template` as JSON, in bytes.
    pub template_bytes: usize,
    /// Operations in `spec.overrides`, over every cluster.
    pub override_ops: usize,
    /// `spec.overrides` as JSON, in bytes.
    pub overrides_bytes: usize,
}

impl Default for SizeLimits {
    /// A template and its overrides together stay under a third of etcd's 1.5 MiB
    /// object limit; 1,000 operations cover one override per cluster of a large fleet.
    fn default() -> Self {
        Self {
            template_bytes: 256 * 1024,
            override_ops: 1000,
            overrides_bytes: 256 * 1024,
        }
    }
}

/// Why an app is refused as a whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("{0}")]
    NamespaceForbidden(Forbidden),
    #[error("{field} is {size} {unit}, over the limit of {limit}")]
    TooLarge {
        field: &'static str,
        size: usize,
        limit: usize,
        unit: &'static str,
    },
}

impl Refusal {
    /// The reason of the status condition and the Event.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::NamespaceForbidden(_) => "NamespaceForbidden",
            Refusal::TooLarge { .. } => "TooLarge",
        }
    }
}

/// What the hub admits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Admission {
    pub namespaces: NamespacePolicy,
    pub limits: SizeLimits,
}

impl Admission {
    /// Checks `app` before it is planned: its namespace first, then its size.
    pub fn admit(&self, app: &FederatedMyApp) -> Result<(), Refusal> {
        let namespace = app.metadata.namespace.as_deref().unwrap_or("default");
        self.namespaces
            .check(namespace)
            .map_err(Refusal::NamespaceForbidden)?;
        let limits = &self.limits;
        let bytes = "bytes as JSON";
        within(
            "spec.template",
            json_len(&app.spec.template),
            limits.template_bytes,
            bytes,
        )?;
        let ops = app
            .spec
            .overrides
            .iter()
            // An image helper is one more operation on the render path.
            .map(|o| o.cluster_overrides.len() + usize::from(o.image.is_some()))
            .sum();
        within("spec.overrides", ops, limits.override_ops, "operations")?;
        within(
            "spec.overrides",
            json_len(&app.spec.overrides),
            limits.overrides_bytes,
            bytes,
        )
    }
}

fn within(
    field: &'static str,
    size: usize,
    limit: usize,
    unit: &'static str,
) -> Result<(), Refusal> {
    match size <= limit {
        true => Ok(()),
        false => Err(Refusal::TooLarge {
            field,
            size,
            limit,
            unit,
        }),
    }
}

/// The length of `value`'s JSON, counted without building it.
fn json_len(value: &impl Serialize) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    serde_json::to_writer(&mut count, value).expect("a typed value serializes");
    count.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_crds::tenancy::Rule;
    use serde_json::json;

    fn app(namespace: &str, spec: serde_json::Value) -> FederatedMyApp {
        serde_json::from_value(json!({
            "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
            "metadata": {"name": "web", "namespace": namespace}, "spec": spec,
        }))
        .expect("a FederatedMyApp")
    }

    fn config(bytes: usize) -> serde_json::Value {
        json!({"template": {"spec": {"image": "nginx:1.27", "config": {"big": "x".repeat(bytes)}}}})
    }

    #[test]
    fn forbidden_namespaces_are_refused_and_named() {
        let admission = Admission::default();
        for (ns, rule) in [
            ("kube-system", Rule::System),
            ("kube-public", Rule::System),
            ("kube-node-lease", Rule::System),
            ("flotilla-system", Rule::Flotilla),
        ] {
            let refused = admission.admit(&app(ns, json!({}))).unwrap_err();
            assert_eq!(refused.reason(), "NamespaceForbidden");
            assert_eq!(
                refused,
                Refusal::NamespaceForbidden(Forbidden {
                    namespace: ns.into(),
                    rule
                })
            );
            assert!(
                refused
                    .to_string()
                    .starts_with(&format!("namespace {ns} is forbidden: "))
            );
        }
        assert_eq!(admission.admit(&app("default", config(10))), Ok(()));
    }

    #[test]
    fn a_template_over_the_limit_is_refused_naming_field_size_and_limit() {
        let admission = Admission::default();
        let limit = admission.limits.template_bytes;
        let refused = admission.admit(&app("team", config(limit))).unwrap_err();
        let Refusal::TooLarge { field, size, .. } = &refused else {
            panic!("{refused:?}")
        };
        assert_eq!((*field, refused.reason()), ("spec.template", "TooLarge"));
        assert_eq!(
            refused.to_string(),
            format!("spec.template is {size} bytes as JSON, over the limit of {limit}")
        );
        // Just under the limit is fine: the bound counts what is serialized.
        let fits = limit - json_len(&app("team", config(0)).spec.template);
        assert_eq!(admission.admit(&app("team", config(fits))), Ok(()));
        assert!(admission.admit(&app("team", config(fits + 1))).is_err());
    }

    fn overrides(clusters: usize, ops: usize, value: &str) -> serde_json::Value {
        let op = json!({"op": "add", "path": "/spec/config/k", "value": value});
        let each: Vec<_> = (0..clusters)
            .map(|c| json!({"clusterName": format!("c{c}"), "clusterOverrides": vec![op.clone(); ops]}))
            .collect();
        json!({"overrides": each})
    }

    #[test]
    fn too_many_override_operations_or_bytes_are_refused() {
        let admission = Admission::default();
        let ok = admission.admit(&app("team", overrides(100, 10, "v")));
        assert_eq!(ok, Ok(()), "1,000 operations over 100 clusters");
        let refused = admission
            .admit(&app("team", overrides(1001, 1, "v")))
            .unwrap_err();
        assert_eq!(
            refused.to_string(),
            "spec.overrides is 1001 operations, over the limit of 1000"
        );
        let big = "é".repeat(64 * 1024);
        let refused = admission
            .admit(&app("team", overrides(2, 1, &big)))
            .unwrap_err();
        assert!(
            refused.to_string().starts_with("spec.overrides is ")
                && refused
                    .to_string()
                    .ends_with("bytes as JSON, over the limit of 262144"),
            "{refused}"
        );
        // Image helpers count as operations.
        let mut images = overrides(100, 10, "v");
        images["overrides"][0]["image"] = json!({"tag": "2"});
        let refused = admission.admit(&app("team", images)).unwrap_err();
        assert!(refused.to_string().contains("1001 operations"), "{refused}");
    }

    /// Ugly inputs: whatever the shape, admission answers (never panics) and refuses
    /// exactly what is over a limit.
    #[test]
    fn ugly_inputs_are_measured_not_trusted() {
        let admission = Admission {
            limits: SizeLimits {
                template_bytes: 4096,
                override_ops: 8,
                overrides_bytes: 4096,
            },
            ..Admission::default()
        };
        let deep = (0..200).fold(json!("leaf"), |v, _| json!({"k": v}));
        let unicode = "\u{0}\u{1F600}\"\\".repeat(300);
        let cases = [
            (
                json!({"template": {"spec": {"config": {"k": unicode}}}}),
                true,
            ),
            (
                json!({"template": {"metadata": {"labels": {"l": "x".repeat(5000)}}}}),
                true,
            ),
            (
                json!({"template": {"spec": {"config": {"k": "v"}}}, "overrides": [{"clusterName": "c", "clusterOverrides": [{"path": "/spec/x", "value": deep}]}]}),
                false,
            ),
            (overrides(9, 1, "v"), true),
            (overrides(0, 0, "v"), false),
            (
                json!({"overrides": [{"clusterName": "x".repeat(5000)}]}),
                true,
            ),
        ];
        for (i, (spec, refused)) in cases.into_iter().enumerate() {
            let answer = admission.admit(&app("team", spec));
            assert_eq!(answer.is_err(), refused, "case {i}: {answer:?}");
        }
    }

    mod property {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            /// Any strings (control characters, quotes, astral planes), any sizes around
            /// the limits: admission answers, and refuses exactly the app whose template
            /// or overrides serialize to more bytes than their limit.
            #[test]
            fn refuses_exactly_what_serializes_past_a_limit(
                config in prop::collection::btree_map(any::<String>(), any::<String>(), 0..8),
                values in prop::collection::vec(any::<String>(), 0..6),
                cluster in any::<String>(),
            ) {
                let admission = Admission {
                    limits: SizeLimits { template_bytes: 300, override_ops: 4, overrides_bytes: 400 },
                    ..Admission::default()
                };
                let ops: Vec<_> = values
                    .iter()
                    .map(|v| json!({"op": "add", "path": "/spec/config/k", "value": v}))
                    .collect();
                let spec = json!({
                    "template": {"spec": {"config": config}},
                    "overrides": [{"clusterName": cluster, "clusterOverrides": ops}],
                });
                let app = app("team", spec);
                let template = serde_json::to_vec(&app.spec.template).unwrap().len();
                let overrides = serde_json::to_vec(&app.spec.overrides).unwrap().len();
                let over = template > 300 || values.len() > 4 || overrides > 400;
                prop_assert_eq!(admission.admit(&app).is_err(), over);
            }
        }
    }
}
