//! The generated bundles against the sources they come from: the same CRD, the same
//! Deployment but for what OLM changes, examples that the CRD accepts, and names that
//! still exist.

use std::path::{Path, PathBuf};

use flotilla_olm::{PACKAGES, Part, REGISTRY, VERSIONS, descriptors, kustomize};
use serde_json::{Value, json};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn yaml(path: &str) -> Vec<Value> {
    kustomize::read_documents(&repo().join(path)).unwrap()
}

fn csv(package: &str, version: &str) -> Value {
    let path = format!(
        "deploy/olm/bundles/{package}/{version}/manifests/{package}.clusterserviceversion.yaml"
    );
    yaml(&path).remove(0)
}

fn myapp_crd() -> Value {
    yaml("deploy/base/myapp-crd.yaml").remove(0)
}

#[test]
fn every_bundle_that_owns_the_api_carries_deploy_bases_crd() {
    for package in &PACKAGES {
        if package.part == Part::Operator {
            continue;
        }
        for version in VERSIONS {
            let path = format!(
                "deploy/olm/bundles/{}/{version}/manifests/app.example.com_myapps.yaml",
                package.name
            );
            assert_eq!(yaml(&path), [myapp_crd()], "{path}");
        }
    }
}

fn arg_value<'a>(args: &'a [Value], flag: &str) -> Option<&'a str> {
    args.iter()
        .find_map(|a| a.as_str()?.strip_prefix(flag)?.strip_prefix('='))
}

/// The operator is deploy/base's Deployment without the conversion webhook (loopback
/// only, nobody calls it), watching the OperatorGroup's target namespaces.
#[test]
fn the_operators_deployment_is_deploy_bases_without_the_webhook() {
    let base = yaml("deploy/base/deployment.yaml").remove(0);
    for version in VERSIONS {
        let csv = csv("flotilla-myapp-operator", version);
        let deployment = &csv["spec"]["install"]["spec"]["deployments"][0];
        assert_eq!(deployment["name"], base["metadata"]["name"]);
        let mut expected = base["spec"].clone();
        let container = &mut expected["template"]["spec"]["containers"][0];
        container["image"] = json!(format!("{REGISTRY}/flotilla-agent:{version}"));
        let args = container["args"].as_array_mut().unwrap();
        args.retain(|a| {
            let a = a.as_str().unwrap();
            !a.starts_with("--webhook-service=")
                && !a.starts_with("--webhook-ca-secret=")
                && !a.starts_with("--webhook-addr=")
        });
        args.push(json!("--webhook-addr=127.0.0.1:9443"));
        container["env"].as_array_mut().unwrap().push(json!({
            "name": "FLOTILLA_OPERATOR_NAMESPACES",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['olm.targetNamespaces']"}},
        }));
        container["ports"]
            .as_array_mut()
            .unwrap()
            .retain(|p| p["name"] != "webhook");
        assert_eq!(
            deployment["spec"], expected,
            "flotilla-myapp-operator {version}"
        );
        let spec = &csv["spec"];
        assert!(spec.get("webhookdefinitions").is_none());
        assert_eq!(
            spec["customresourcedefinitions"],
            json!({"required": [{
                "name": "myapps.app.example.com", "version": "v1", "kind": "MyApp",
                "displayName": "MyApp",
                "description": spec["customresourcedefinitions"]["required"][0]["description"],
            }]})
        );
        let modes = spec["installModes"].as_array().unwrap();
        assert!(modes.iter().all(|m| m["supported"] == true), "{modes:?}");
    }
}

/// What OLM scopes (`permissions`) is every rule on a namespaced resource of
/// deploy/base's ClusterRole and Roles; `clusterPermissions` keeps the others only.
#[test]
fn the_operators_rights_on_namespaced_resources_are_scoped() {
    let csv = csv("flotilla-myapp-operator", VERSIONS[0]);
    let strategy = &csv["spec"]["install"]["spec"];
    let resources = |permissions: &Value| -> Vec<String> {
        permissions[0]["rules"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r["resources"].as_array().unwrap().clone())
            .map(|r| r.as_str().unwrap().to_string())
            .collect()
    };
    let cluster = resources(&strategy["clusterPermissions"]);
    assert_eq!(cluster, ["namespaces", "clusterproperties", "nodes"]);
    let namespaced = resources(&strategy["permissions"]);
    for r in [
        "myapps",
        "myapps/status",
        "configmaps",
        "deployments",
        "events",
        "pods",
        "leases",
    ] {
        assert!(namespaced.iter().any(|n| n == r), "{r} in {namespaced:?}");
    }
    assert_eq!(
        strategy["permissions"][0]["serviceAccountName"],
        "flotilla-agent"
    );
}

/// The API package: deploy/base's CRD and a Deployment of its own serving the webhook
/// alone on OLM's certificate, with no rights; `AllNamespaces` only, as OLM requires
/// of a CSV with a conversion webhook.
#[test]
fn the_api_package_serves_the_webhook_alone() {
    for version in VERSIONS {
        let csv = csv("flotilla-myapp-api", version);
        let spec = &csv["spec"];
        let deployment = &spec["install"]["spec"]["deployments"][0];
        assert_eq!(deployment["name"], "flotilla-myapp-webhook");
        let pod = &deployment["spec"]["template"]["spec"];
        assert!(pod.get("serviceAccountName").is_none());
        let args = pod["containers"][0]["args"].as_array().unwrap();
        assert_eq!(args[0], "webhook");
        assert_eq!(
            arg_value(args, "--webhook-cert"),
            Some("/tmp/k8s-webhook-server/serving-certs/tls.crt")
        );
        assert!(spec["install"]["spec"].get("permissions").is_none());
        assert!(spec["install"]["spec"].get("clusterPermissions").is_none());
        let webhook = &spec["webhookdefinitions"][0];
        assert_eq!(webhook["type"], "ConversionWebhook");
        assert_eq!(webhook["deploymentName"], "flotilla-myapp-webhook");
        assert_eq!(
            spec["customresourcedefinitions"]["owned"][0]["name"],
            "myapps.app.example.com"
        );
        let supported: Vec<&Value> = spec["installModes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["supported"] == true)
            .map(|m| &m["type"])
            .collect();
        assert_eq!(supported, [&json!("AllNamespaces")]);
    }
}

/// The catalog says what OLM resolves: the operator requires MyApp v1, the API
/// package provides it.
#[test]
fn the_operator_requires_what_the_api_package_provides() {
    let properties = |package: &str| -> Vec<Value> {
        let path = format!("deploy/olm/catalog/{package}/catalog.yaml");
        yaml(&path)[2]["properties"].as_array().unwrap().clone()
    };
    let myapp_v1 = json!({"group": "app.example.com", "kind": "MyApp", "version": "v1"});
    assert!(
        properties("flotilla-myapp-operator")
            .contains(&json!({"type": "olm.gvk.required", "value": myapp_v1}))
    );
    assert!(
        properties("flotilla-myapp-api").contains(&json!({"type": "olm.gvk", "value": myapp_v1}))
    );
    assert!(
        !properties("flotilla-myapp-operator")
            .iter()
            .any(|p| p["type"] == "olm.gvk")
    );
}

#[test]
fn the_agent_runs_against_the_hub_as_the_member_overlay_says() {
    let csv = csv("flotilla-agent", VERSIONS[0]);
    let pod = &csv["spec"]["install"]["spec"]["deployments"][0]["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(container["args"][0], "run");
    assert!(
        container["args"]
            .as_array()
            .unwrap()
            .contains(&json!("--token-secret=flotilla-hub-credentials"))
    );
    assert_eq!(
        container["envFrom"],
        json!([{"configMapRef": {"name": "flotilla-agent-hub"}}])
    );
    assert_eq!(
        pod["volumes"][0]["secret"]["secretName"],
        "flotilla-hub-credentials"
    );
    let description = csv["spec"]["description"].as_str().unwrap();
    assert!(
        description.contains("the ConfigMap `flotilla-agent-hub`"),
        "{description}"
    );
    assert!(
        description.contains("the Secret `flotilla-hub-credentials`"),
        "{description}"
    );
}

#[test]
fn the_examples_are_valid_myapps_one_per_served_version() {
    let crd = myapp_crd();
    let csv = csv("flotilla-agent", VERSIONS[0]);
    let examples: Vec<Value> = serde_json::from_str(
        csv["metadata"]["annotations"]["alm-examples"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let served: Vec<&Value> = crd["spec"]["versions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["served"] == true)
        .collect();
    assert_eq!(examples.len(), served.len());
    for version in served {
        let name = version["name"].as_str().unwrap();
        let example = examples
            .iter()
            .find(|e| e["apiVersion"] == format!("app.example.com/{name}"))
            .unwrap_or_else(|| panic!("no example for {name}"));
        let schema = &version["schema"]["openAPIV3Schema"];
        let validator = jsonschema::validator_for(schema).unwrap();
        let errors: Vec<String> = validator
            .iter_errors(example)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{name}: {errors:?}");
        for field in example["spec"].as_object().unwrap().keys() {
            assert!(
                schema["properties"]["spec"]["properties"]
                    .get(field)
                    .is_some(),
                "{name}: no field {field}"
            );
        }
    }
}

#[test]
fn every_ui_hint_names_a_field_of_the_crd() {
    let crd = myapp_crd();
    for (part, field, urn) in descriptors::X_DESCRIPTORS {
        let found = crd["spec"]["versions"].as_array().unwrap().iter().any(|v| {
            v["schema"]["openAPIV3Schema"]["properties"][part]["properties"]
                .get(field)
                .is_some()
        });
        assert!(
            found,
            "{part}.{field} ({urn}) is in no version of the MyApp CRD"
        );
    }
}

#[test]
fn the_registry_is_the_production_overlays() {
    let overlay = yaml("deploy/overlays/production/kustomization.yaml").remove(0);
    let image = overlay["images"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "flotilla-agent")
        .unwrap();
    assert_eq!(image["newName"], format!("{REGISTRY}/flotilla-agent"));
}

#[test]
fn the_catalog_is_one_upgrade_path_per_package() {
    for package in &PACKAGES {
        let path = format!("deploy/olm/catalog/{}/catalog.yaml", package.name);
        let docs = yaml(&path);
        let schemas: Vec<&str> = docs.iter().map(|d| d["schema"].as_str().unwrap()).collect();
        assert_eq!(
            schemas,
            ["olm.package", "olm.channel", "olm.bundle", "olm.bundle"],
            "{path}"
        );
        let entries = docs[1]["entries"].as_array().unwrap();
        assert_eq!(
            entries[0],
            json!({"name": format!("{}.v0.1.0", package.name)})
        );
        assert_eq!(entries[1]["replaces"], format!("{}.v0.1.0", package.name));
        assert_eq!(entries[1]["skipRange"], ">=0.1.0 <0.2.0");
        for (bundle, version) in docs[2..].iter().zip(VERSIONS) {
            assert_eq!(
                bundle["image"],
                format!("{REGISTRY}/{}-bundle:v{version}", package.name)
            );
        }
    }
}

#[test]
fn another_registry_moves_every_image() {
    let tree = flotilla_olm::generate(&repo(), "127.0.0.1:5000/t").unwrap();
    for (path, text) in &tree {
        assert!(
            !text.contains(REGISTRY),
            "{} still names {REGISTRY}",
            path.display()
        );
    }
    let catalog = &tree[Path::new("catalog/flotilla-agent/catalog.yaml")];
    assert!(catalog.contains("image: 127.0.0.1:5000/t/flotilla-agent-bundle:v0.2.0"));
}

#[test]
fn one_opm_version_everywhere() {
    let tag = flotilla_olm::OPM_IMAGE.rsplit(':').next().unwrap();
    for script in ["deploy/verify.sh", "lab/scripts/olm-prereqs.sh"] {
        let text = std::fs::read_to_string(repo().join(script)).unwrap();
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("OPM_VERSION={tag}"))),
            "{script} pins another opm than {}",
            flotilla_olm::OPM_IMAGE
        );
    }
}
