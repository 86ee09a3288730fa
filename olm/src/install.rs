//! A kustomization's objects sorted into what a ClusterServiceVersion holds, with the
//! changes an OLM install needs. Every object is accounted for: a kind the generator does
//! not know, a role nobody binds or a binding to someone else stops it.

use std::path::Path;

use serde_json::{Value, json};

use crate::kustomize::Build;
use crate::{Error, Part};

/// Where OLM (v0 and v1 alike) mounts the webhook's serving certificate, as `tls.crt`
/// and `tls.key`.
pub const OLM_CERT_DIR: &str = "/tmp/k8s-webhook-server/serving-certs";

/// One agent's install, as a CSV and its bundle need it.
#[derive(Debug)]
pub struct Install {
    /// The namespace `deploy/` installs into: OLM's suggested namespace.
    pub namespace: String,
    pub crd: Value,
    pub service_account: String,
    /// Rules of the ClusterRoles bound to the service account.
    pub cluster_rules: Vec<Value>,
    /// Rules of the Roles bound to it in its namespace.
    pub namespace_rules: Vec<Value>,
    pub deployment: Value,
    /// Bundled as they are (OLM puts them in the install namespace).
    pub services: Vec<Value>,
    /// The conversion webhook: the Service port the apiserver calls, and the container
    /// port behind it.
    pub webhook_port: i64,
    pub webhook_target_port: i64,
    /// ConfigMaps the user creates (kustomize generates them from placeholders).
    pub user_config_maps: Vec<String>,
    /// The oldest Kubernetes the install supports: the Helm chart's `kubeVersion`.
    pub min_kube_version: String,
}

/// Sorts `build` (from the kustomization at `from`) into an [`Install`] and adapts it to
/// OLM: see [`adapt_to_olm`]. `min_kube_version` is the chart's.
pub fn sort(build: Build, from: &Path, min_kube_version: String) -> Result<Install, Error> {
    let here = |message: String| Error::at(from, message);
    let mut by_kind = Kinds(build.objects);
    let namespace = name(&by_kind.one("Namespace", from)?);
    let crd = by_kind.one("CustomResourceDefinition", from)?;
    let service_account = name(&by_kind.one("ServiceAccount", from)?);
    let deployment = by_kind.one("Deployment", from)?;
    let services = by_kind.all("Service");
    // A bundle cannot carry a FlowSchema (OLM installs only the kinds it knows): the
    // agent's Lease requests keep their priority only where the admin applies
    // deploy/base/flowschema.yaml beside the operator (deploy/olm/README.md).
    by_kind.all("FlowSchema");
    let subject =
        json!([{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}]);
    let cluster_rules = bound_rules(
        &mut by_kind,
        "ClusterRole",
        "ClusterRoleBinding",
        &subject,
        from,
    )?;
    let namespace_rules = bound_rules(&mut by_kind, "Role", "RoleBinding", &subject, from)?;
    if let Some(left) = by_kind.0.first() {
        return Err(here(format!(
            "{} {}: the OLM generator does not know where this kind goes in a bundle",
            left["kind"].as_str().unwrap_or("?"),
            name(left)
        )));
    }
    let (webhook_port, webhook_target_port) = webhook_ports(&services, &deployment)
        .ok_or_else(|| here("no Service port named `webhook` with a targetPort the Deployment's container declares".into()))?;
    let mut install = Install {
        namespace,
        crd,
        service_account,
        cluster_rules,
        namespace_rules,
        deployment,
        services,
        webhook_port,
        webhook_target_port,
        user_config_maps: build.generated_config_maps,
        min_kube_version,
    };
    adapt_to_olm(&mut install).map_err(here)?;
    Ok(install)
}

/// What changes under OLM: OLM issues the webhook's certificate, mounts it in the Pod and
/// writes the CRD's `spec.conversion` itself, so the agent serves the mounted certificate
/// and leaves the CRD alone (no `--webhook-service`), and loses its right to patch the
/// CRD. Namespaces go: OLM installs into the namespace the user picks.
fn adapt_to_olm(install: &mut Install) -> Result<(), String> {
    let args = install.deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array_mut()
        .ok_or("the Deployment's first container has no args")?;
    let before = args.len();
    args.retain(|a| {
        !a.as_str()
            .is_some_and(|a| a.starts_with("--webhook-service="))
    });
    if args.len() + 1 != before {
        return Err("expected exactly one --webhook-service argument to replace".into());
    }
    // A mounted certificate needs no CA of the agent's: its Secret, and the rights on it
    // (the only Secret the agent creates), go too.
    let ca_secret = args
        .iter()
        .find_map(|a| a.as_str()?.strip_prefix("--webhook-ca-secret="))
        .map(|r| r.rsplit('/').next().unwrap_or(r).to_owned());
    args.retain(|a| {
        !a.as_str()
            .is_some_and(|a| a.starts_with("--webhook-ca-secret="))
    });
    args.push(json!(format!("--webhook-cert={OLM_CERT_DIR}/tls.crt")));
    args.push(json!(format!("--webhook-key={OLM_CERT_DIR}/tls.key")));
    if let Some(secret) = ca_secret {
        let before = install.namespace_rules.len();
        install.namespace_rules.retain(|rule| {
            let secrets = rule["resources"] == json!(["secrets"]);
            let names = rule.get("resourceNames");
            !(secrets
                && (names == Some(&json!([secret]))
                    || (names.is_none() && rule["verbs"] == json!(["create"]))))
        });
        if install.namespace_rules.len() + 2 != before {
            return Err(format!(
                "expected a create rule on Secrets and a get rule on the Secret {secret} to drop"
            ));
        }
    }
    let crd_name = install.crd["metadata"]["name"].clone();
    let before = install.cluster_rules.len();
    install.cluster_rules.retain(|rule| {
        !(rule["resources"] == json!(["customresourcedefinitions"])
            && rule["resourceNames"] == json!([crd_name]))
    });
    if install.cluster_rules.len() + 1 != before {
        return Err(format!(
            "expected exactly one rule on the CRD {crd_name} to drop"
        ));
    }
    for object in std::iter::once(&mut install.deployment).chain(&mut install.services) {
        if let Some(metadata) = object["metadata"].as_object_mut() {
            metadata.remove("namespace");
        }
    }
    Ok(())
}

/// The name of the Deployment (and so of OLM's webhook Service, `<name>-service`) of
/// the MyApp API package: not the operator's, which may share its namespace.
pub const API_DEPLOYMENT: &str = "flotilla-myapp-webhook";
/// The environment variable `flotilla-agent operator --namespace` reads.
pub const NAMESPACES_ENV: &str = "FLOTILLA_OPERATOR_NAMESPACES";
/// The pod annotation OLM writes the OperatorGroup's target namespaces into
/// (comma-separated; empty for AllNamespaces).
pub const TARGETS_ANNOTATION: &str = "olm.targetNamespaces";

/// Resources a rule may name that are not namespaced: what stays in
/// `clusterPermissions` when the operator is scoped.
const CLUSTER_SCOPED: [&str; 5] = [
    "namespaces",
    "nodes",
    "clusterproperties",
    "customresourcedefinitions",
    "persistentvolumes",
];

/// Keeps what `part` runs of an install made by [`sort`].
pub fn take(install: &mut Install, part: Part) -> Result<(), String> {
    match part {
        Part::Whole => Ok(()),
        Part::Api => api_only(install),
        Part::Operator => operator_only(install),
    }
}

fn first_container(deployment: &mut Value) -> Result<&mut Value, String> {
    deployment["spec"]["template"]["spec"]["containers"]
        .get_mut(0)
        .ok_or_else(|| "the Deployment has no container".to_string())
}

/// The CRD and its conversion webhook: a Deployment of its own running `flotilla-agent
/// webhook` on OLM's certificate, with no rights (the default service account) and no
/// Service but the one OLM makes for the webhook.
fn api_only(install: &mut Install) -> Result<(), String> {
    let deployment = &mut install.deployment;
    deployment["metadata"]["name"] = json!(API_DEPLOYMENT);
    for path in [
        "/metadata/labels",
        "/spec/selector/matchLabels",
        "/spec/template/metadata/labels",
    ] {
        let labels = deployment
            .pointer_mut(path)
            .ok_or_else(|| format!("the Deployment has no {path}"))?;
        labels["app.kubernetes.io/name"] = json!(API_DEPLOYMENT);
    }
    if let Some(pod) = deployment["spec"]["template"]["spec"].as_object_mut() {
        pod.remove("serviceAccountName");
    }
    let container = first_container(deployment)?;
    container["args"] = json!([
        "webhook",
        "--http-addr=0.0.0.0:8080",
        format!("--webhook-addr=0.0.0.0:{}", install.webhook_target_port),
        format!("--webhook-cert={OLM_CERT_DIR}/tls.crt"),
        format!("--webhook-key={OLM_CERT_DIR}/tls.key"),
    ]);
    if let Some(container) = container.as_object_mut() {
        container.remove("env");
    }
    if let Some(ports) = container["ports"].as_array_mut() {
        ports.retain(|p| p["name"] == "metrics" || p["name"] == "webhook");
    }
    install.cluster_rules.clear();
    install.namespace_rules.clear();
    install.services.clear();
    Ok(())
}

/// The operator without the CRD and its webhook: it watches the namespaces in the pod's
/// annotation `olm.targetNamespaces` (through the downward API), and its rules on
/// namespaced resources become `permissions`, which OLM grants in each target namespace
/// (cluster-wide for AllNamespaces). `flotilla-agent operator` still serves a
/// conversion webhook (self-signed, nobody calls it): on loopback only.
fn operator_only(install: &mut Install) -> Result<(), String> {
    let mut cluster = Vec::new();
    let mut namespaced = Vec::new();
    for rule in std::mem::take(&mut install.cluster_rules) {
        let resources: Vec<&str> = rule["resources"]
            .as_array()
            .ok_or("a rule without resources")?
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let (global, local): (Vec<&str>, Vec<&str>) = resources
            .iter()
            .partition(|r| CLUSTER_SCOPED.contains(&r.split('/').next().unwrap_or(r)));
        for (part, into) in [(global, &mut cluster), (local, &mut namespaced)] {
            if !part.is_empty() {
                let mut rule = rule.clone();
                rule["resources"] = json!(part);
                into.push(rule);
            }
        }
    }
    namespaced.append(&mut install.namespace_rules);
    install.cluster_rules = cluster;
    install.namespace_rules = namespaced;
    let webhook_port = install.webhook_target_port;
    let container = first_container(&mut install.deployment)?;
    let args = container["args"]
        .as_array_mut()
        .ok_or("the Deployment's first container has no args")?;
    args.retain(|a| {
        !a.as_str().is_some_and(|a| {
            a.starts_with("--webhook-cert=")
                || a.starts_with("--webhook-key=")
                || a.starts_with("--webhook-addr=")
        })
    });
    args.push(json!(format!("--webhook-addr=127.0.0.1:{webhook_port}")));
    container["env"]
        .as_array_mut()
        .ok_or("the Deployment's first container has no env")?
        .push(json!({
            "name": NAMESPACES_ENV,
            "valueFrom": {"fieldRef": {"fieldPath": format!("metadata.annotations['{TARGETS_ANNOTATION}']")}},
        }));
    if let Some(ports) = container["ports"].as_array_mut() {
        ports.retain(|p| p["name"] != "webhook");
    }
    for service in &mut install.services {
        if let Some(ports) = service["spec"]["ports"].as_array_mut() {
            ports.retain(|p| p["name"] != "webhook");
        }
    }
    Ok(())
}

/// The rules of every `role_kind` bound by a `binding_kind` to exactly `subject`; the
/// roles and bindings are taken out of `kinds`.
fn bound_rules(
    kinds: &mut Kinds,
    role_kind: &str,
    binding_kind: &str,
    subject: &Value,
    from: &Path,
) -> Result<Vec<Value>, Error> {
    let mut roles = kinds.all(role_kind);
    let mut rules = Vec::new();
    for binding in kinds.all(binding_kind) {
        let what = format!("{binding_kind} {}", name(&binding));
        let mut subjects = binding["subjects"].clone();
        for s in subjects.as_array_mut().into_iter().flatten() {
            if let Some(s) = s.as_object_mut() {
                s.remove("apiGroup");
            }
        }
        if subjects != *subject {
            return Err(Error::at(
                from,
                format!("{what}: binds someone other than the agent's service account"),
            ));
        }
        let wanted = &binding["roleRef"];
        let found = roles
            .iter()
            .position(|r| wanted["kind"] == role_kind && r["metadata"]["name"] == wanted["name"])
            .ok_or_else(|| {
                Error::at(
                    from,
                    format!("{what}: no {role_kind} {} in the install", wanted["name"]),
                )
            })?;
        let role = roles.remove(found);
        rules.extend(role["rules"].as_array().cloned().unwrap_or_default());
    }
    if let Some(role) = roles.first() {
        return Err(Error::at(
            from,
            format!("{role_kind} {}: bound by no {binding_kind}", name(role)),
        ));
    }
    Ok(rules)
}

/// The webhook's Service port and the number of the container port it targets.
fn webhook_ports(services: &[Value], deployment: &Value) -> Option<(i64, i64)> {
    let port = services
        .iter()
        .flat_map(|s| s["spec"]["ports"].as_array().into_iter().flatten())
        .find(|p| p["name"] == "webhook")?;
    let target = &port["targetPort"];
    let container_port = deployment["spec"]["template"]["spec"]["containers"]
        .as_array()?
        .iter()
        .flat_map(|c| c["ports"].as_array().into_iter().flatten())
        .find(|p| p["name"] == *target || p["containerPort"] == *target)?;
    Some((
        port["port"].as_i64()?,
        container_port["containerPort"].as_i64()?,
    ))
}

fn name(object: &Value) -> String {
    object["metadata"]["name"]
        .as_str()
        .unwrap_or("?")
        .to_string()
}

/// Objects not yet sorted.
struct Kinds(Vec<Value>);

impl Kinds {
    fn all(&mut self, kind: &str) -> Vec<Value> {
        let (taken, rest) = std::mem::take(&mut self.0)
            .into_iter()
            .partition(|o| o["kind"] == kind);
        self.0 = rest;
        taken
    }

    fn one(&mut self, kind: &str, from: &Path) -> Result<Value, Error> {
        let mut all = self.all(kind);
        match all.len() {
            1 => Ok(all.remove(0)),
            n => Err(Error::at(from, format!("expected one {kind}, found {n}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small install of the shape of `deploy/base`.
    fn objects() -> Vec<Value> {
        let account = json!([{"kind": "ServiceAccount", "name": "a", "namespace": "ns"}]);
        vec![
            json!({"kind": "Namespace", "metadata": {"name": "ns"}}),
            json!({"kind": "CustomResourceDefinition", "metadata": {"name": "things.example.com"}}),
            json!({"kind": "ServiceAccount", "metadata": {"name": "a", "namespace": "ns"}}),
            json!({"kind": "ClusterRole", "metadata": {"name": "c"}, "rules": [
                {"apiGroups": ["example.com"], "resources": ["things"], "verbs": ["get"]},
                {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
                 "resourceNames": ["things.example.com"], "verbs": ["patch"]}]}),
            json!({"kind": "ClusterRoleBinding", "metadata": {"name": "c"},
                   "roleRef": {"kind": "ClusterRole", "name": "c"}, "subjects": account}),
            json!({"kind": "Role", "metadata": {"name": "r", "namespace": "ns"}, "rules": [
                {"verbs": ["create"]},
                {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
                {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["ca"], "verbs": ["get"]},
                {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["token"], "verbs": ["get"]}]}),
            json!({"kind": "RoleBinding", "metadata": {"name": "r", "namespace": "ns"},
                   "roleRef": {"kind": "Role", "name": "r"}, "subjects": account}),
            json!({"kind": "Deployment", "metadata": {"name": "a", "namespace": "ns"}, "spec": {"template": {"spec": {
                "containers": [{"args": ["operator", "--webhook-service=ns/a", "--webhook-ca-secret=ns/ca"],
                                "ports": [{"name": "webhook", "containerPort": 9443}]}]}}}}),
            json!({"kind": "Service", "metadata": {"name": "a", "namespace": "ns"},
                   "spec": {"ports": [{"name": "webhook", "port": 443, "targetPort": "webhook"}]}}),
        ]
    }

    fn sorted(objects: Vec<Value>) -> Result<Install, Error> {
        let build = Build {
            objects,
            generated_config_maps: vec![],
        };
        sort(build, Path::new("deploy/x"), "1.29.0".into())
    }

    #[test]
    fn sorts_and_adapts_an_install() {
        let install = sorted(objects()).unwrap();
        assert_eq!(install.namespace, "ns");
        assert_eq!(install.service_account, "a");
        assert_eq!(
            install.cluster_rules.len(),
            1,
            "the rule on the CRD is OLM's now"
        );
        assert_eq!(
            install.namespace_rules,
            [
                json!({"verbs": ["create"]}),
                json!({"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["token"], "verbs": ["get"]})
            ],
            "the webhook CA's Secret rules go with the CA"
        );
        assert_eq!(
            (install.webhook_port, install.webhook_target_port),
            (443, 9443)
        );
        let container = &install.deployment["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(
            container["args"],
            json!([
                "operator",
                format!("--webhook-cert={OLM_CERT_DIR}/tls.crt"),
                format!("--webhook-key={OLM_CERT_DIR}/tls.key")
            ])
        );
        assert!(install.deployment["metadata"].get("namespace").is_none());
        assert!(install.services[0]["metadata"].get("namespace").is_none());
    }

    /// A change to [`objects`] that the generator must refuse.
    type Change = fn(&mut Vec<Value>);

    #[test]
    fn refuses_what_it_cannot_place() {
        let cases: [(Change, &str); 6] = [
            (
                |o| o.push(json!({"kind": "PodDisruptionBudget", "metadata": {"name": "p"}})),
                "PodDisruptionBudget p: the OLM generator does not know",
            ),
            (
                |o| o[4]["subjects"][0]["name"] = json!("other"),
                "ClusterRoleBinding c: binds someone other than the agent's service account",
            ),
            (
                |o| o[6]["roleRef"]["name"] = json!("nope"),
                "RoleBinding r: no Role \"nope\"",
            ),
            (
                |o| {
                    o.remove(6);
                },
                "Role r: bound by no RoleBinding",
            ),
            (
                |o| o[7]["spec"]["template"]["spec"]["containers"][0]["args"] = json!(["operator"]),
                "exactly one --webhook-service",
            ),
            (
                |o| o[8]["spec"]["ports"][0]["targetPort"] = json!("other"),
                "no Service port named `webhook`",
            ),
        ];
        for (change, expected) in cases {
            let mut objects = objects();
            change(&mut objects);
            let err = sorted(objects).unwrap_err().to_string();
            assert!(
                err.starts_with("deploy/x: "),
                "names the kustomization: {err}"
            );
            assert!(err.contains(expected), "{err}");
        }
    }
}
