//! The seed article's own YAML must keep working unchanged.

use flotilla_crds::FederatedMyApp;
use flotilla_crds::federated::OverrideOp;
use serde_json::Value;

const SEED_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/fixtures/seed");

fn seed(name: &str) -> String {
    std::fs::read_to_string(format!("{SEED_DIR}/{name}")).unwrap()
}

#[test]
fn seed_federatedmyapp_deserializes_unchanged() {
    let app: FederatedMyApp = serde_yaml::from_str(&seed("federatedmyapp.yaml")).unwrap();
    assert_eq!(app.metadata.name.as_deref(), Some("my-app-sample"));
    let names: Vec<_> = app
        .spec
        .placement
        .clusters
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(names, ["cluster1", "cluster2"]);
    assert_eq!(app.spec.template.spec.replicas, Some(3));
    let o = &app.spec.overrides[0];
    assert_eq!(o.cluster_name.as_deref(), Some("cluster2"));
    assert_eq!(o.cluster_selector, None);
    assert_eq!(
        o.cluster_overrides[0].op,
        OverrideOp::Replace,
        "op defaults to replace"
    );
    assert_eq!(o.cluster_overrides[0].path, "/spec/replicas");
    assert_eq!(o.cluster_overrides[0].value, Some(5.into()));
}

/// Every constraint of the seed's MyApp CRD stands in ours, for every served version.
#[test]
fn seed_myapp_schema_constraints_are_in_the_generated_crd() {
    let seed: Value = serde_yaml::from_str(&seed("myapp-crd.yaml")).unwrap();
    let seed_spec = &seed["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        ["properties"];
    let ours = flotilla_crds::crds()
        .into_iter()
        .find(|c| c.metadata.name.as_deref() == Some("myapps.app.example.com"))
        .unwrap();
    let ours = serde_json::to_value(&ours).unwrap();
    assert_eq!(ours["spec"]["group"], seed["spec"]["group"]);
    let versions = ours["spec"]["versions"].as_array().unwrap();
    let names: Vec<_> = versions
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["v1", "v1beta1", "v1alpha1"]);
    for v in versions {
        let props = &v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
        let replicas = if v["name"] == "v1alpha1" {
            &props["size"]
        } else {
            &props["replicas"]
        };
        assert_eq!(replicas["type"], seed_spec["replicas"]["type"]);
        assert_eq!(
            replicas["minimum"].as_f64(),
            seed_spec["replicas"]["minimum"].as_f64()
        );
        assert_eq!(
            replicas["maximum"].as_f64(),
            seed_spec["replicas"]["maximum"].as_f64()
        );
        assert_eq!(props["image"]["type"], seed_spec["image"]["type"]);
        assert_eq!(props["image"]["pattern"], seed_spec["image"]["pattern"]);
        assert_eq!(v["served"], true);
        assert_eq!(v["storage"], v["name"] == "v1", "v1 alone is stored");
    }
}

/// `examples/federatedmyapp.yaml`, which `flotilla-e2e demo` applies and users copy, is
/// the seed's example, byte for byte.
#[test]
fn the_shipped_example_is_the_seed_verbatim() {
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/federatedmyapp.yaml"
    ))
    .unwrap();
    assert_eq!(shipped, seed("federatedmyapp.yaml"));
}
