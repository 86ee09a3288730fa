//! The generated bundles against the sources they come from: the same CRD, the same
//! Deployment but for what OLM changes, examples that the CRD accepts, and names that
//! still exist.

use std::path::{Path, PathBuf};

use flotilla_olm::{PACKAGES, REGISTRY, VERSIONS, descriptors, kustomize};
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
fn every_bundle_carries_deploy_bases_crd() {
    for package in &PACKAGES {
        for version in VERSIONS {
            let path = format!(
                "deploy/olm/bundles/{}/{version}/manifests/app.example.com_myapps.yaml",
                package.name
            );
            assert_eq!(yaml(&path), [myapp_crd()], "{path}");
        }
    }
}

#[test]
fn the_operators_deployment_is_deploy_bases_but_for_the_webhook_certificate_and_image() {
    let base = yaml("deploy/base/deployment.yaml").remove(0);
    for version in VERSIONS {
        let csv = csv("flotilla-myapp-operator", version);
        let deployment = &csv["spec"]["install"]["spec"]["deployments"][0];
        assert_eq!(deployment["name"], base["metadata"]["name"]);
        let mut expected = base["spec"].clone();
        let container = &mut expected["template"]["spec"]["containers"][0];
        container["image"] = json!(format!("{REGISTRY}/flotilla-agent:{version}"));
        let args = container["args"].as_array_mut().unwrap();
        // OLM's mounted certificate replaces the Service endpoint and the agent's own CA.
        args.retain(|a| {
            a != "--webhook-service=flotilla-system/flotilla-agent"
                && a != "--webhook-ca-secret=flotilla-system/flotilla-agent-webhook-ca"
        });
        args.push(json!(
            "--webhook-cert=/tmp/k8s-webhook-server/serving-certs/tls.crt"
        ));
        args.push(json!(
            "--webhook-key=/tmp/k8s-webhook-server/serving-certs/tls.key"
        ));
        assert_eq!(
            deployment["spec"], expected,
            "flotilla-myapp-operator {version}"
        );
    }
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
