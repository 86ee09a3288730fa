//! MyApp serves `/scale` at every version, so that an HPA or a KEDA ScaledObject can
//! target it whichever version its `scaleTargetRef` names.

use flotilla_crds::crds;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

fn myapp() -> CustomResourceDefinition {
    crds()
        .into_iter()
        .find(|c| c.spec.names.kind == "MyApp")
        .expect("MyApp is installed")
}

#[test]
fn every_served_version_scales_at_its_own_replicas_path() {
    let crd = myapp();
    let mut seen = Vec::new();
    for version in crd.spec.versions.iter().filter(|v| v.served) {
        let sub = version.subresources.as_ref().expect("subresources");
        assert!(sub.status.is_some(), "{}: /status", version.name);
        let scale = sub.scale.as_ref().expect("/scale");
        let paths = (
            scale.spec_replicas_path.as_str(),
            scale.status_replicas_path.as_str(),
            scale.label_selector_path.as_deref(),
        );
        seen.push((version.name.clone(), paths.0.to_owned()));
        assert_eq!(
            (paths.1, paths.2),
            (".status.replicas", Some(".status.selector")),
            "{}",
            version.name
        );
    }
    seen.sort();
    let want = [
        ("v1", ".spec.replicas"),
        ("v1alpha1", ".spec.size"),
        ("v1beta1", ".spec.replicas"),
    ];
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(v, p)| (v.to_string(), p.to_string()))
        .collect();
    assert_eq!(seen, want);
}

/// Each path `/scale` names exists in that version's schema with the type the apiserver
/// needs (an integer, a string), and the seed's bounds on replicas stay.
#[test]
fn the_scale_paths_exist_in_each_schema() {
    let crd = myapp();
    for version in &crd.spec.versions {
        let schema = serde_json::to_value(
            version
                .schema
                .as_ref()
                .and_then(|s| s.open_api_v3_schema.as_ref())
                .expect("a schema"),
        )
        .unwrap();
        let scale = version
            .subresources
            .as_ref()
            .and_then(|s| s.scale.as_ref())
            .unwrap();
        let field = |path: &str| {
            let mut node = &schema;
            for part in path.trim_start_matches('.').split('.') {
                node = &node["properties"][part];
            }
            node.clone()
        };
        let spec = field(&scale.spec_replicas_path);
        assert_eq!(spec["type"], "integer", "{}", version.name);
        assert_eq!(
            (spec["minimum"].as_f64(), spec["maximum"].as_f64()),
            (Some(1.0), Some(10.0)),
            "{}: the seed's 1-10",
            version.name
        );
        assert_eq!(field(&scale.status_replicas_path)["type"], "integer");
        let selector = scale.label_selector_path.as_deref().unwrap();
        assert_eq!(field(selector)["type"], "string");
    }
}
