//! The member side of `flotilla-hub join`: one YAML stream that `kubectl apply -f`
//! installs in the member cluster. It is `deploy/base` (namespace, MyApp CRD with its
//! conversion webhook, the agent's RBAC, the FlowSchema of its Lease, Deployment and
//! Service) with the agent switched to `run` against the hub, plus the credential
//! Secret and the agent's Role on it (it stores a renewed token there). With allowed
//! namespaces, the agent's rights on MyApps and their children move from its ClusterRole
//! to a Role in each of them, as the chart's `agent.allowedNamespaces` does. Pure: no
//! cluster is contacted.

use base64::Engine;
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Value, json};

/// `deploy/base`, and the member overlay's Role on the credentials Secret, embedded so
/// that the printed install and the kustomizations are one.
const BASE: [(&str, &str); 7] = [
    (
        "deploy/base/namespace.yaml",
        include_str!("../../deploy/base/namespace.yaml"),
    ),
    (
        "deploy/base/myapp-crd.yaml",
        include_str!("../../deploy/base/myapp-crd.yaml"),
    ),
    (
        "deploy/base/rbac.yaml",
        include_str!("../../deploy/base/rbac.yaml"),
    ),
    (
        "deploy/overlays/member/credentials-rbac.yaml",
        include_str!("../../deploy/overlays/member/credentials-rbac.yaml"),
    ),
    (
        "deploy/base/deployment.yaml",
        include_str!("../../deploy/base/deployment.yaml"),
    ),
    (
        "deploy/base/service.yaml",
        include_str!("../../deploy/base/service.yaml"),
    ),
    (
        "deploy/base/flowschema.yaml",
        include_str!("../../deploy/base/flowschema.yaml"),
    ),
];

pub const NAMESPACE: &str = "flotilla-system";
/// The Secret the agent reads its token and the hub's CA from.
pub const SECRET: &str = "flotilla-hub-credentials";
const AGENT: &str = "flotilla-agent";
const MOUNT: &str = "/hub";

/// What one member's install needs.
#[derive(Clone, Debug)]
pub struct MemberInstall {
    /// The MemberCluster's name.
    pub cluster: String,
    /// Where the agent dials the hub, `HOST:PORT`.
    pub hub_address: String,
    /// Name to verify the hub's certificate against, when it does not name `hub_address`.
    pub hub_server_name: Option<String>,
    /// PEM of the CA that signed the hub's serving certificate.
    pub hub_ca_pem: String,
    /// The token `join` issued (`<cluster>.<secret>`); `Debug` prints it redacted.
    pub token: SecretString,
    /// The agent's image; `deploy/base`'s when absent.
    pub image: Option<String>,
    /// The only namespaces the agent applies MyApps into, watches and holds rights in
    /// (its `--allowed-namespace` and its operator's `--namespace`); empty for all.
    pub allowed_namespaces: Vec<String>,
}

/// The agent's rights that an install narrowed to some namespaces grants in each of them
/// alone (docs/security.md, scope `MyApp namespaces`): every rule of its ClusterRole
/// whose resources are all among these.
const MYAPP_NAMESPACE_RESOURCES: [&str; 7] = [
    "myapps",
    "myapps/status",
    "configmaps",
    "deployments",
    "horizontalpodautoscalers",
    "scaledobjects",
    "events",
];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InstallError {
    #[error(
        "cluster name {0:?}: must be a DNS-1123 subdomain (lowercase letters, digits, '-' and '.', at most 253 characters, starting and ending alphanumeric)"
    )]
    ClusterName(String),
    #[error("--hub-address {address:?}: {reason}")]
    HubAddress { address: String, reason: String },
    #[error("--hub-server-name {0:?}: must be a DNS name without scheme or port")]
    ServerName(String),
    #[error("hub CA: {0}")]
    HubCa(String),
    #[error("token for cluster {cluster}: {reason}")]
    Token { cluster: String, reason: String },
    #[error("--agent-image {0:?}: expected NAME:TAG or NAME@DIGEST, without spaces")]
    Image(String),
    #[error("--allowed-namespace {0:?}: must be a namespace name (a DNS-1123 label)")]
    AllowedNamespace(String),
    #[error("{file}: {reason}")]
    Base { file: &'static str, reason: String },
}

/// The install as one multi-document YAML stream, in apply order.
pub fn render(install: &MemberInstall) -> Result<String, InstallError> {
    let docs = objects(install)?;
    let mut out = format!(
        "# Flotilla member install for cluster {}, from `flotilla-hub join`.\n\
         # Apply it in that cluster: kubectl apply -f FILE\n\
         # It carries the agent's credential: keep it like a password.\n",
        install.cluster
    );
    for doc in docs {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&doc).expect("JSON values serialize to YAML"));
    }
    Ok(out)
}

/// The install's objects: `deploy/base` with the agent in `run` mode, and the Secret
/// placed before the Deployment that mounts it.
pub fn objects(install: &MemberInstall) -> Result<Vec<Value>, InstallError> {
    validate(install)?;
    let mut objects = Vec::new();
    for (file, text) in BASE {
        for doc in serde_yaml::Deserializer::from_str(text) {
            let doc: Value =
                serde::Deserialize::deserialize(doc).map_err(|e| InstallError::Base {
                    file,
                    reason: e.to_string(),
                })?;
            if doc.is_null() {
                continue;
            }
            if doc["kind"] == "Deployment" {
                objects.push(secret(install));
                objects.push(agent_deployment(file, doc, install)?);
            } else if doc["kind"] == "ClusterRole" && !install.allowed_namespaces.is_empty() {
                objects.extend(narrowed(doc, &install.allowed_namespaces));
            } else {
                objects.push(doc);
            }
        }
    }
    Ok(objects)
}

fn secret(install: &MemberInstall) -> Value {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": SECRET,
            "namespace": NAMESPACE,
            "labels": {"app.kubernetes.io/name": AGENT, "app.kubernetes.io/part-of": "flotilla"},
        },
        "type": "Opaque",
        "data": {"token": b64(install.token.expose_secret()), "ca.crt": b64(&install.hub_ca_pem)},
    })
}

/// The agent's ClusterRole without its rules on MyApps and their children, and a Role
/// with those rules and its RoleBinding in each of `namespaces`.
fn narrowed(mut cluster_role: Value, namespaces: &[String]) -> Vec<Value> {
    let rules = cluster_role["rules"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let in_namespaces = |rule: &Value| {
        let resources = rule["resources"].as_array();
        resources.is_some_and(|r| {
            r.iter()
                .all(|r| (r.as_str()).is_some_and(|r| MYAPP_NAMESPACE_RESOURCES.contains(&r)))
        })
    };
    let (namespaced, cluster): (Vec<Value>, Vec<Value>) =
        rules.into_iter().partition(in_namespaces);
    cluster_role["rules"] = json!(cluster);
    let name = cluster_role["metadata"]["name"].clone();
    let labels = cluster_role["metadata"]["labels"].clone();
    let mut objects = vec![cluster_role];
    for namespace in namespaces {
        let metadata = json!({"name": name, "namespace": namespace, "labels": labels});
        objects.push(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": metadata, "rules": namespaced,
        }));
        objects.push(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": metadata,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": AGENT, "namespace": NAMESPACE}],
        }));
    }
    objects
}

/// `deploy/base`'s agent, switched from the standalone operator to `run` against the hub.
fn agent_deployment(
    file: &'static str,
    mut deployment: Value,
    install: &MemberInstall,
) -> Result<Value, InstallError> {
    let broken = |reason: &str| InstallError::Base {
        file,
        reason: reason.to_string(),
    };
    let spec = &mut deployment["spec"]["template"]["spec"];
    spec["volumes"] = json!([{"name": "hub", "secret": {"secretName": SECRET}}]);
    let container = spec["containers"]
        .get_mut(0)
        .ok_or_else(|| broken("the Deployment has no container"))?;
    if let Some(image) = &install.image {
        container["image"] = json!(image);
    }
    container["volumeMounts"] = json!([{"name": "hub", "mountPath": MOUNT, "readOnly": true}]);
    let args = container["args"]
        .as_array_mut()
        .ok_or_else(|| broken("the agent container has no args"))?;
    match args.first() {
        Some(first) if first == "operator" => args[0] = json!("run"),
        _ => return Err(broken("the agent's first argument is not `operator`")),
    }
    args.extend([
        json!(format!("--hub=https://{}", install.hub_address)),
        json!(format!("--cluster={}", install.cluster)),
        // Read, and a renewed token stored, through the API: a mounted copy lags.
        json!(format!("--token-secret={SECRET}")),
        json!(format!("--hub-ca-file={MOUNT}/ca.crt")),
    ]);
    if let Some(name) = &install.hub_server_name {
        args.push(json!(format!("--hub-server-name={name}")));
    }
    if !install.allowed_namespaces.is_empty() {
        let namespaces = install.allowed_namespaces.join(",");
        args.push(json!(format!("--allowed-namespace={namespaces}")));
        // The operator watches the same namespaces: its rights are granted there alone.
        args.push(json!(format!("--namespace={namespaces}")));
    }
    Ok(deployment)
}

fn validate(install: &MemberInstall) -> Result<(), InstallError> {
    if !is_dns_subdomain(&install.cluster) {
        return Err(InstallError::ClusterName(install.cluster.clone()));
    }
    validate_hub_address(&install.hub_address)?;
    if let Some(name) = &install.hub_server_name
        && !is_dns_subdomain(name)
    {
        return Err(InstallError::ServerName(name.clone()));
    }
    let ca = install.hub_ca_pem.trim();
    if !ca.starts_with("-----BEGIN CERTIFICATE-----") || !ca.ends_with("-----END CERTIFICATE-----")
    {
        return Err(InstallError::HubCa(
            "not a PEM certificate (expected -----BEGIN CERTIFICATE-----): pass the hub's ca.crt"
                .into(),
        ));
    }
    let token_error = |reason: &str| InstallError::Token {
        cluster: install.cluster.clone(),
        reason: reason.into(),
    };
    // As the hub reads it: the secret is after the last dot, cluster names may have dots.
    let token = install.token.expose_secret();
    match token.rsplit_once('.') {
        Some((cluster, secret)) if cluster == install.cluster && !secret.is_empty() => {}
        _ => return Err(token_error("expected <cluster>.<secret> for this cluster")),
    }
    if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(token_error("contains whitespace"));
    }
    if let Some(image) = &install.image
        && (image.is_empty()
            || image.chars().any(char::is_whitespace)
            || !(image.contains(':') || image.contains('@')))
    {
        return Err(InstallError::Image(image.clone()));
    }
    if let Some(bad) = (install.allowed_namespaces.iter()).find(|n| !is_dns_label(n)) {
        return Err(InstallError::AllowedNamespace(bad.clone()));
    }
    Ok(())
}

/// `HOST:PORT` with a DNS name, an IPv4 address or a bracketed IPv6 address, no scheme:
/// the agent always dials TLS.
pub fn validate_hub_address(address: &str) -> Result<(), InstallError> {
    let fail = |reason: &str| InstallError::HubAddress {
        address: address.to_string(),
        reason: reason.to_string(),
    };
    if address.contains("://") {
        return Err(fail(
            "give HOST:PORT without a scheme (the agent always uses TLS)",
        ));
    }
    let (host, port) = address
        .rsplit_once(':')
        .ok_or_else(|| fail("expected HOST:PORT, e.g. hub.example.com:7443"))?;
    match port.parse::<u16>() {
        Ok(p) if p > 0 && !port.starts_with('+') => {}
        _ => return Err(fail("the port must be a number from 1 to 65535")),
    }
    let valid_host = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => host.parse::<std::net::Ipv4Addr>().is_ok() || is_dns_subdomain(host),
    };
    if !valid_host {
        return Err(fail(
            "the host must be a DNS name, an IPv4 address or a [bracketed] IPv6 address",
        ));
    }
    Ok(())
}

/// RFC 1123 subdomain as Kubernetes checks object names.
pub fn is_dns_subdomain(s: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.starts_with(alnum)
                && label.ends_with(alnum)
                && label.chars().all(|c| alnum(c) || c == '-')
        })
}

/// A DNS-1123 label, as namespace names are.
fn is_dns_label(s: &str) -> bool {
    !s.contains('.') && is_dns_subdomain(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    const CA: &str =
        "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIUZ\n-----END CERTIFICATE-----\n";

    fn install() -> MemberInstall {
        MemberInstall {
            cluster: "paris".into(),
            hub_address: "hub.example.com:7443".into(),
            hub_server_name: None,
            hub_ca_pem: CA.into(),
            token: "paris.c2VjcmV0".into(),
            image: None,
            allowed_namespaces: Vec::new(),
        }
    }

    #[test]
    fn debug_output_never_shows_the_token() {
        let shown = format!("{:?}", install());
        assert!(!shown.contains("c2VjcmV0"), "{shown}");
        assert!(
            shown.contains("hub.example.com:7443"),
            "the rest still shows: {shown}"
        );
    }

    /// What `kubectl apply -f` reads: every document of the printed stream.
    fn parse(yaml: &str) -> Vec<Value> {
        serde_yaml::Deserializer::from_str(yaml)
            .map(|d| <Value as serde::Deserialize>::deserialize(d).unwrap())
            .filter(|d| !d.is_null())
            .collect()
    }

    /// Objects of the install by `Kind/name`.
    fn by_kind_and_name(objects: &[Value]) -> BTreeMap<String, &Value> {
        objects
            .iter()
            .map(|o| {
                (
                    format!(
                        "{}/{}",
                        o["kind"].as_str().unwrap_or_default(),
                        o["metadata"]["name"].as_str().unwrap_or_default()
                    ),
                    o,
                )
            })
            .collect()
    }

    fn base_deployment() -> Value {
        serde_yaml::from_str(BASE[4].1).unwrap()
    }

    fn b64d(v: &Value) -> String {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap())
            .unwrap();
        String::from_utf8(bytes).unwrap()
    }

    /// Narrowed to two namespaces, the install moves exactly the rules on MyApps and
    /// their children from the ClusterRole to a Role in each, bound to the agent, and
    /// the agent and its operator are told the same namespaces; nothing else changes.
    #[test]
    fn an_install_narrowed_to_namespaces_grants_the_myapp_rights_there_alone() {
        let narrow = MemberInstall {
            allowed_namespaces: vec!["shop".into(), "team".into()],
            ..install()
        };
        let (wide, narrowed) = (objects(&install()).unwrap(), objects(&narrow).unwrap());
        let rules = |docs: &[Value], kind: &str, namespace: Option<&str>| -> Vec<Value> {
            (docs.iter())
                .filter(|d| d["kind"] == kind && d["metadata"]["name"] == AGENT)
                .filter(|d| d["metadata"]["namespace"].as_str() == namespace)
                .flat_map(|d| d["rules"].as_array().cloned().unwrap_or_default())
                .collect()
        };
        let all = rules(&wide, "ClusterRole", None);
        let cluster = rules(&narrowed, "ClusterRole", None);
        for namespace in ["shop", "team"] {
            let moved = rules(&narrowed, "Role", Some(namespace));
            let mut together: Vec<String> = (cluster.iter().chain(&moved))
                .map(Value::to_string)
                .collect();
            let mut before: Vec<String> = all.iter().map(Value::to_string).collect();
            together.sort();
            before.sort();
            assert_eq!(together, before, "{namespace}: every rule, once");
            let resources: BTreeSet<&str> = (moved.iter())
                .flat_map(|r| r["resources"].as_array().unwrap())
                .map(|r| r.as_str().unwrap())
                .collect();
            assert_eq!(resources, BTreeSet::from(MYAPP_NAMESPACE_RESOURCES));
            let binding = (narrowed.iter())
                .find(|d| d["kind"] == "RoleBinding" && d["metadata"]["namespace"] == namespace)
                .expect("a RoleBinding");
            assert_eq!(binding["roleRef"]["name"], AGENT);
            assert_eq!(binding["subjects"][0]["namespace"], NAMESPACE);
        }
        for rule in &cluster {
            let resources = rule["resources"].as_array().unwrap();
            assert!(
                (resources.iter())
                    .all(|r| !MYAPP_NAMESPACE_RESOURCES.contains(&r.as_str().unwrap())),
                "left cluster-wide: {rule}"
            );
        }
        let args = |docs: &[Value]| -> Vec<Value> {
            let d = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
            d["spec"]["template"]["spec"]["containers"][0]["args"]
                .as_array()
                .unwrap()
                .clone()
        };
        let mut want = args(&wide);
        want.extend([
            json!("--allowed-namespace=shop,team"),
            json!("--namespace=shop,team"),
        ]);
        assert_eq!(args(&narrowed), want);
        let others = |docs: &[Value]| -> Vec<Value> {
            let rbac = ["ClusterRole", "Role", "RoleBinding", "Deployment"];
            let agent_rbac = |d: &&Value| {
                rbac.contains(&d["kind"].as_str().unwrap()) && d["metadata"]["name"] == AGENT
            };
            docs.iter().filter(|d| !agent_rbac(d)).cloned().collect()
        };
        assert_eq!(others(&narrowed), others(&wide));
        let bad = MemberInstall {
            allowed_namespaces: vec!["team".into(), "Team.x".into()],
            ..install()
        };
        assert_eq!(
            objects(&bad).unwrap_err().to_string(),
            "--allowed-namespace \"Team.x\": must be a namespace name (a DNS-1123 label)"
        );
    }

    #[test]
    fn installs_everything_in_apply_order() {
        let docs = parse(&render(&install()).unwrap());
        let kinds: Vec<_> = docs
            .iter()
            .map(|d| {
                format!(
                    "{}/{}",
                    d["kind"].as_str().unwrap(),
                    d["metadata"]["name"].as_str().unwrap()
                )
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "Namespace/flotilla-system",
                "CustomResourceDefinition/myapps.app.example.com",
                "ServiceAccount/flotilla-agent",
                "ClusterRole/flotilla-agent",
                "ClusterRoleBinding/flotilla-agent",
                "Role/flotilla-agent-leader",
                "RoleBinding/flotilla-agent-leader",
                "Role/flotilla-agent-webhook-ca",
                "RoleBinding/flotilla-agent-webhook-ca",
                "Role/flotilla-agent-credentials",
                "RoleBinding/flotilla-agent-credentials",
                "Secret/flotilla-hub-credentials",
                "Deployment/flotilla-agent",
                "Service/flotilla-agent",
                "FlowSchema/flotilla-agent-leader-election",
            ]
        );
        for d in &docs {
            let namespaced = !matches!(
                d["kind"].as_str().unwrap(),
                "Namespace"
                    | "CustomResourceDefinition"
                    | "ClusterRole"
                    | "ClusterRoleBinding"
                    | "FlowSchema"
            );
            assert_eq!(
                d["metadata"]["namespace"].as_str() == Some(NAMESPACE),
                namespaced,
                "{}",
                d["kind"]
            );
        }
    }

    #[test]
    fn the_secret_carries_token_and_ca_and_the_agent_mounts_it() {
        let docs = parse(&render(&install()).unwrap());
        let objects = by_kind_and_name(&docs);
        let secret = objects["Secret/flotilla-hub-credentials"];
        assert_eq!(b64d(&secret["data"]["token"]), "paris.c2VjcmV0");
        assert_eq!(b64d(&secret["data"]["ca.crt"]), CA);
        let pod = &objects["Deployment/flotilla-agent"]["spec"]["template"]["spec"];
        assert_eq!(pod["volumes"][0]["secret"]["secretName"], SECRET);
        let container = &pod["containers"][0];
        assert_eq!(container["volumeMounts"][0]["mountPath"], MOUNT);
        assert_eq!(container["volumeMounts"][0]["readOnly"], true);
        let args: Vec<&str> = container["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(args[0], "run");
        for expected in [
            "--hub=https://hub.example.com:7443",
            "--cluster=paris",
            "--token-secret=flotilla-hub-credentials",
            "--hub-ca-file=/hub/ca.crt",
            "--webhook-service=flotilla-system/flotilla-agent",
        ] {
            assert!(args.contains(&expected), "{expected} in {args:?}");
        }
        assert!(!args.iter().any(|a| a.starts_with("--hub-server-name")));
    }

    /// The agent runs exactly as `deploy/base` says: image, pull policy, probes,
    /// resources and both security contexts.
    #[test]
    fn the_agent_matches_deploy_base() {
        let docs = parse(&render(&install()).unwrap());
        let ours =
            &by_kind_and_name(&docs)["Deployment/flotilla-agent"]["spec"]["template"]["spec"];
        let base = base_deployment();
        let base = &base["spec"]["template"]["spec"];
        assert_eq!(ours["securityContext"], base["securityContext"]);
        assert_eq!(ours["securityContext"]["runAsUser"], 65532);
        assert_eq!(ours["securityContext"]["runAsNonRoot"], true);
        assert_eq!(ours["serviceAccountName"], "flotilla-agent");
        for field in [
            "image",
            "imagePullPolicy",
            "securityContext",
            "resources",
            "livenessProbe",
            "readinessProbe",
            "ports",
        ] {
            assert_eq!(
                ours["containers"][0][field], base["containers"][0][field],
                "{field}"
            );
        }
        let sc = &ours["containers"][0]["securityContext"];
        assert_eq!(sc["readOnlyRootFilesystem"], true);
        assert_eq!(sc["allowPrivilegeEscalation"], false);
        assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
        assert_eq!(ours["containers"][0]["imagePullPolicy"], "IfNotPresent");
    }

    #[test]
    fn image_and_server_name_are_settable() {
        let mut i = install();
        i.image = Some("registry.example.com/flotilla-agent:0.2.0".into());
        i.hub_server_name = Some("flotilla-hub.flotilla-system.svc".into());
        i.hub_address = "[::1]:30743".into();
        let docs = objects(&i).unwrap();
        let c = &by_kind_and_name(&docs)["Deployment/flotilla-agent"]["spec"]["template"]["spec"]["containers"]
            [0];
        assert_eq!(c["image"], "registry.example.com/flotilla-agent:0.2.0");
        let args = c["args"].as_array().unwrap();
        assert!(args.contains(&json!("--hub-server-name=flotilla-hub.flotilla-system.svc")));
        assert!(args.contains(&json!("--hub=https://[::1]:30743")));
    }

    #[test]
    fn bad_inputs_are_refused_naming_the_field() {
        type Break = fn(&mut MemberInstall);
        let cases: Vec<(Break, &str)> = vec![
            (|i| i.cluster = String::new(), "cluster name \"\""),
            (|i| i.cluster = "Paris".into(), "cluster name \"Paris\""),
            (|i| i.cluster = "a/b".into(), "DNS-1123"),
            (|i| i.cluster = "-a".into(), "DNS-1123"),
            (|i| i.cluster = "a".repeat(254), "DNS-1123"),
            (|i| i.cluster = "a..b".into(), "DNS-1123"),
            (
                |i| i.hub_address = "hub.example.com".into(),
                "--hub-address",
            ),
            (
                |i| i.hub_address = "http://hub:7443".into(),
                "without a scheme",
            ),
            (
                |i| i.hub_address = "https://hub:7443".into(),
                "without a scheme",
            ),
            (|i| i.hub_address = "hub:0".into(), "port"),
            (|i| i.hub_address = "hub:65536".into(), "port"),
            (|i| i.hub_address = "hub:+80".into(), "port"),
            (|i| i.hub_address = "hub:".into(), "port"),
            (|i| i.hub_address = ":7443".into(), "host"),
            (|i| i.hub_address = "::1:7443".into(), "host"),
            (|i| i.hub_address = "[::1:7443".into(), "host"),
            (|i| i.hub_address = "hub example:7443".into(), "host"),
            (|i| i.hub_address = "hub\n:7443".into(), "host"),
            (
                |i| i.hub_server_name = Some("https://x".into()),
                "--hub-server-name",
            ),
            (|i| i.hub_ca_pem = String::new(), "hub CA"),
            (|i| i.hub_ca_pem = "not a cert".into(), "hub CA"),
            (
                |i| {
                    i.hub_ca_pem =
                        "-----BEGIN PRIVATE KEY-----\nx\n-----END PRIVATE KEY-----".into()
                },
                "hub CA",
            ),
            (|i| i.token = "london.abc".into(), "token for cluster paris"),
            (|i| i.token = "paris.".into(), "token for cluster paris"),
            (|i| i.token = "paris".into(), "token for cluster paris"),
            (|i| i.token = "paris.ab c".into(), "whitespace"),
            (|i| i.token = "paris.abc\n".into(), "whitespace"),
            (|i| i.image = Some(String::new()), "--agent-image"),
            (|i| i.image = Some("flotilla-agent".into()), "--agent-image"),
            (|i| i.image = Some("a b:1".into()), "--agent-image"),
        ];
        for (break_it, expected) in cases {
            let mut i = install();
            break_it(&mut i);
            let e = render(&i).expect_err(&format!("{i:?} must be refused"));
            assert!(e.to_string().contains(expected), "{i:?}: {e}");
        }
    }

    #[test]
    fn valid_addresses() {
        for ok in [
            "hub.example.com:7443",
            "10.0.0.1:30743",
            "[fd00::1]:443",
            "localhost:1",
            "h:65535",
        ] {
            assert_eq!(validate_hub_address(ok), Ok(()), "{ok}");
        }
    }

    fn dns_label() -> impl Strategy<Value = String> {
        "[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?"
    }

    proptest! {
        /// Any valid input gives a stream that parses back to the same credential and
        /// names; YAML-special tokens and names survive quoting.
        #[test]
        fn every_valid_install_round_trips(
            labels in prop::collection::vec(dns_label(), 1..4),
            secret in "[A-Za-z0-9_\\-:#&*!|>'\"%@`{}\\[\\],?]{1,64}",
            port in 1u16..,
            ipv4 in any::<[u8; 4]>(),
            use_ip in any::<bool>(),
        ) {
            let cluster = labels.join(".");
            let host = if use_ip {
                std::net::Ipv4Addr::from(ipv4).to_string()
            } else {
                cluster.clone()
            };
            let i = MemberInstall {
                cluster: cluster.clone(),
                hub_address: format!("{host}:{port}"),
                token: format!("{cluster}.{secret}").into(),
                ..install()
            };
            let docs = parse(&render(&i).unwrap());
            prop_assert_eq!(docs.len(), 15);
            let objects = by_kind_and_name(&docs);
            let secret_doc = objects["Secret/flotilla-hub-credentials"];
            prop_assert_eq!(b64d(&secret_doc["data"]["token"]), i.token.expose_secret());
            let args = objects["Deployment/flotilla-agent"]["spec"]["template"]["spec"]
                ["containers"][0]["args"].clone();
            let expected_cluster = json!(format!("--cluster={cluster}"));
            let expected_hub = json!(format!("--hub=https://{host}:{port}"));
            prop_assert!(args.as_array().unwrap().contains(&expected_cluster));
            prop_assert!(args.as_array().unwrap().contains(&expected_hub));
        }

        /// Arbitrary strings never panic the validation; what passes is a name
        /// Kubernetes accepts.
        #[test]
        fn validation_never_panics(cluster in "\\PC{0,300}", address in "\\PC{0,40}") {
            let i = MemberInstall { cluster: cluster.clone(), hub_address: address, token: format!("{cluster}.x").into(), ..install() };
            if render(&i).is_ok() {
                prop_assert!(is_dns_subdomain(&cluster));
            }
        }
    }
}
