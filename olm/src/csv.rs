//! The ClusterServiceVersion of one bundle: the install of `deploy/` as OLM runs it.

use serde_json::{Map, Value, json};

use crate::install::Install;
use crate::{Bundle, Part, descriptors};

/// What the operator creates for each MyApp (shown by consoles beside the CRD).
const CREATES: [(&str, &str); 2] = [("ConfigMap", "v1"), ("Deployment", "v1")];

/// A sample MyApp per served version, shown by consoles as the starting point of a new
/// one (`v1alpha1` called `replicas` `size`).
pub fn examples() -> Vec<Value> {
    let sample = |version: &str, spec: Value| {
        json!({
            "apiVersion": format!("app.example.com/{version}"),
            "kind": "MyApp",
            "metadata": {"name": "my-app-sample"},
            "spec": spec,
        })
    };
    vec![
        sample("v1", json!({"replicas": 3, "image": "nginx:1.27"})),
        sample("v1beta1", json!({"replicas": 3, "image": "nginx:1.27"})),
        sample("v1alpha1", json!({"size": 3, "image": "nginx:1.27"})),
    ]
}

pub fn csv(bundle: &Bundle, install: &Install) -> Value {
    let part = bundle.package.part;
    let mut annotations = Map::new();
    // The operator provides no API, so no examples: an empty list (operator-framework's
    // validators want the annotation, and examples of provided APIs only).
    let mut shown = examples();
    if part == Part::Operator {
        shown.clear();
    }
    annotations.insert("alm-examples".into(), json!(Value::from(shown).to_string()));
    annotations.insert("capabilities".into(), json!("Basic Install"));
    annotations.insert("categories".into(), json!("Application Runtime"));
    annotations.insert("containerImage".into(), json!(bundle.operator_image()));
    annotations.insert("description".into(), json!(bundle.package.summary));
    annotations.insert(
        "operatorframework.io/suggested-namespace".into(),
        json!(install.namespace),
    );
    if let Some(range) = bundle.skip_range() {
        annotations.insert("olm.skipRange".into(), json!(range));
    }
    let mut spec = json!({
        "displayName": bundle.package.display_name,
        "description": description(bundle, install),
        "version": bundle.version,
        "maturity": "alpha",
        "minKubeVersion": install.min_kube_version,
        "provider": {"name": "Flotilla"},
        "keywords": ["federation", "multi-cluster", "myapp", "operator"],
        "installModes": install_modes(part),
        "install": {"strategy": "deployment", "spec": strategy(bundle, install)},
        "relatedImages": [{"name": "flotilla-agent", "image": bundle.operator_image()}],
    });
    if part == Part::Operator {
        spec["customresourcedefinitions"] = json!({"required": [required(&install.crd)]});
    } else {
        spec["customresourcedefinitions"] =
            json!({"owned": descriptors::owned(&install.crd, &CREATES)});
        spec["webhookdefinitions"] = json!([conversion_webhook(install)]);
    }
    if let Some(previous) = bundle.replaces() {
        spec["replaces"] = json!(previous);
    }
    json!({
        "apiVersion": "operators.coreos.com/v1alpha1",
        "kind": "ClusterServiceVersion",
        "metadata": {
            "name": bundle.csv_name(),
            "annotations": annotations,
            "labels": {
                "operatorframework.io/arch.amd64": "supported",
                "operatorframework.io/os.linux": "supported",
            },
        },
        "spec": spec,
    })
}

/// A bundle with a conversion webhook: `AllNamespaces` only. OLM v0 refuses to write
/// a conversion webhook for a CSV supporting any other mode (`isSingletonOperator` in
/// `pkg/controller/install/webhook.go`), v1 too: the CRD, and so its webhook, serve
/// the whole cluster. The operator alone supports every mode.
fn install_modes(part: Part) -> Value {
    let scoped = part == Part::Operator;
    json!([
        {"type": "OwnNamespace", "supported": scoped},
        {"type": "SingleNamespace", "supported": scoped},
        {"type": "MultiNamespace", "supported": scoped},
        {"type": "AllNamespaces", "supported": true},
    ])
}

/// The MyApp API the operator requires, at the CRD's stored version: OLM resolves it
/// (`olm.gvk.required`) to the package that owns it, and the CSV waits until the CRD
/// serves it.
fn required(crd: &Value) -> Value {
    let spec = &crd["spec"];
    let stored = spec["versions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["storage"] == true);
    let kind = &spec["names"]["kind"];
    let mut out = json!({
        "name": crd["metadata"]["name"],
        "version": stored.map(|v| v["name"].clone()).unwrap_or_default(),
        "kind": kind,
        "displayName": kind,
    });
    if let Some(text) = stored.and_then(|v| v["schema"]["openAPIV3Schema"]["description"].as_str())
    {
        out["description"] = json!(text);
    }
    out
}

fn strategy(bundle: &Bundle, install: &Install) -> Value {
    let mut deployment = install.deployment.clone();
    deployment["spec"]["template"]["spec"]["containers"][0]["image"] =
        json!(bundle.operator_image());
    let account = &install.service_account;
    let mut spec = json!({
        "deployments": [{
            "name": deployment["metadata"]["name"],
            "label": deployment["metadata"]["labels"],
            "spec": deployment["spec"],
        }],
    });
    if !install.cluster_rules.is_empty() {
        spec["clusterPermissions"] =
            json!([{"serviceAccountName": account, "rules": install.cluster_rules}]);
    }
    if !install.namespace_rules.is_empty() {
        spec["permissions"] =
            json!([{"serviceAccountName": account, "rules": install.namespace_rules}]);
    }
    spec
}

/// OLM serves the webhook through a Service of its own, `<deployment>-service`, on
/// `containerPort`, and writes the CRD's `spec.conversion` to point there.
fn conversion_webhook(install: &Install) -> Value {
    let crd = &install.crd;
    let webhook = &crd["spec"]["conversion"]["webhook"];
    json!({
        "type": "ConversionWebhook",
        "generateName": format!("convert.{}", crd["metadata"]["name"].as_str().unwrap_or_default()),
        "deploymentName": install.deployment["metadata"]["name"],
        "containerPort": install.webhook_port,
        "targetPort": install.webhook_target_port,
        "webhookPath": webhook["clientConfig"]["service"]["path"],
        "conversionCRDs": [crd["metadata"]["name"]],
        "admissionReviewVersions": webhook["conversionReviewVersions"],
        "sideEffects": "None",
    })
}

fn description(bundle: &Bundle, install: &Install) -> String {
    let mut text = bundle.package.description.to_string();
    if !install.user_config_maps.is_empty() || !secrets(install).is_empty() {
        text.push_str("\n\n## Before installing\n\nCreate in the install namespace (the pod waits for them):\n");
        for name in &install.user_config_maps {
            text.push_str(&format!("\n- the ConfigMap `{name}`"));
        }
        for name in secrets(install) {
            text.push_str(&format!("\n- the Secret `{name}`"));
        }
        text.push('\n');
        text.push_str(bundle.package.setup);
    }
    text
}

/// The Secrets the Deployment mounts.
fn secrets(install: &Install) -> Vec<String> {
    install.deployment["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["secret"]["secretName"].as_str().map(str::to_string))
        .collect()
}
