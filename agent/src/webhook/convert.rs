//! MyApp version conversion for the apiserver (ConversionReview v1). Every version goes
//! through `v1`, the storage version, using the lossless `From` conversions of the API
//! types; metadata and status are the same in every version and pass through untouched.

use flotilla_crds::myapp::{GROUP, v1, v1alpha1, v1beta1};
use kube::core::Status;
use kube::core::conversion::{ConversionRequest, ConversionResponse, ConversionReview};
use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    V1alpha1,
    V1beta1,
    V1,
}

impl Version {
    /// The version named by an `apiVersion` such as `app.example.com/v1beta1`.
    pub fn from_api_version(api_version: &str) -> Result<Self, ConversionError> {
        match api_version.split_once('/') {
            Some((GROUP, "v1alpha1")) => Ok(Version::V1alpha1),
            Some((GROUP, "v1beta1")) => Ok(Version::V1beta1),
            Some((GROUP, "v1")) => Ok(Version::V1),
            _ => Err(ConversionError::UnknownVersion(api_version.to_string())),
        }
    }

    pub fn api_version(self) -> String {
        let version = match self {
            Version::V1alpha1 => "v1alpha1",
            Version::V1beta1 => "v1beta1",
            Version::V1 => "v1",
        };
        format!("{GROUP}/{version}")
    }
}

#[derive(thiserror::Error, Debug)]
pub enum ConversionError {
    #[error("unknown MyApp apiVersion {0:?}")]
    UnknownVersion(String),
    #[error("not a MyApp object: {0}")]
    NotAMyApp(String),
    #[error("invalid {version} spec: {source}")]
    InvalidSpec {
        version: String,
        #[source]
        source: serde_json::Error,
    },
}

fn to_v1(from: Version, spec: Value) -> Result<v1::MyAppSpec, serde_json::Error> {
    Ok(match from {
        Version::V1alpha1 => serde_json::from_value::<v1alpha1::MyAppSpec>(spec)?.into(),
        Version::V1beta1 => serde_json::from_value::<v1beta1::MyAppSpec>(spec)?.into(),
        Version::V1 => serde_json::from_value(spec)?,
    })
}

fn from_v1(to: Version, spec: v1::MyAppSpec) -> Result<Value, serde_json::Error> {
    match to {
        Version::V1alpha1 => serde_json::to_value(v1alpha1::MyAppSpec::from(spec)),
        Version::V1beta1 => serde_json::to_value(v1beta1::MyAppSpec::from(spec)),
        Version::V1 => serde_json::to_value(spec),
    }
}

/// Converts one MyApp object (as JSON) to `to`.
pub fn convert_object(mut object: Value, to: Version) -> Result<Value, ConversionError> {
    let map = object
        .as_object_mut()
        .ok_or_else(|| ConversionError::NotAMyApp("not a JSON object".into()))?;
    match map.get("kind").and_then(Value::as_str) {
        Some("MyApp") => {}
        other => return Err(ConversionError::NotAMyApp(format!("kind {other:?}"))),
    }
    let api_version = map
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let from = Version::from_api_version(api_version)?;
    if from != to {
        if let Some(spec) = map.remove("spec") {
            let invalid = |source| ConversionError::InvalidSpec {
                version: from.api_version(),
                source,
            };
            let v1 = to_v1(from, spec).map_err(invalid)?;
            let converted = from_v1(to, v1).map_err(invalid)?;
            map.insert("spec".into(), converted);
        }
        map.insert("apiVersion".into(), Value::String(to.api_version()));
    }
    Ok(object)
}

/// Answers a ConversionReview: all objects converted, or a failure naming the first
/// object that could not be.
pub fn review(review: ConversionReview) -> ConversionReview {
    let request = match ConversionRequest::from_review(review) {
        Ok(request) => request,
        Err(e) => {
            return ConversionResponse::invalid(Status::failure(&e.to_string(), "InvalidRequest"))
                .into_review();
        }
    };
    let to = Version::from_api_version(&request.desired_api_version);
    let objects = request.objects.clone();
    let response = ConversionResponse::for_request(request);
    let converted = to.and_then(|to| {
        objects
            .into_iter()
            .map(|o| convert_object(o, to))
            .collect::<Result<Vec<_>, _>>()
    });
    match converted {
        Ok(objects) => response.success(objects),
        Err(e) => response.failure(Status::failure(&e.to_string(), "ConversionFailed")),
    }
    .into_review()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const ALL: [Version; 3] = [Version::V1alpha1, Version::V1beta1, Version::V1];

    /// The same MyApp in each version, with every spec field set.
    fn sample(version: Version) -> Value {
        let (replicas_key, config_key) = match version {
            Version::V1alpha1 => ("size", "configData"),
            Version::V1beta1 => ("replicas", "configData"),
            Version::V1 => ("replicas", "config"),
        };
        json!({
            "apiVersion": version.api_version(),
            "kind": "MyApp",
            "metadata": {"name": "web", "namespace": "shop", "uid": "u-1", "resourceVersion": "42",
                         "labels": {"team": "a"}, "annotations": {"note": "kept"}},
            "spec": {
                replicas_key: 4,
                "image": "nginx:1.27",
                "env": [{"name": "MODE", "value": "prod"},
                        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "port": 8080,
                "resources": {"limits": {"cpu": "500m", "memory": "128Mi"}, "requests": {"cpu": "100m"}},
                "strategy": {"maxUnavailable": "50%", "maxSurge": 2},
                config_key: {"app.conf": "level=info", "empty": ""}
            },
            "status": {"ready": true, "readyReplicas": 4, "observedGeneration": 3,
                       "conditions": [{"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable",
                                       "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
        })
    }

    #[test]
    fn every_version_converts_to_every_other_exactly() {
        for from in ALL {
            for to in ALL {
                assert_eq!(
                    convert_object(sample(from), to).unwrap(),
                    sample(to),
                    "{from:?} -> {to:?}"
                );
            }
        }
    }

    #[test]
    fn round_trips_lose_nothing() {
        for from in ALL {
            for via in ALL {
                let there = convert_object(sample(from), via).unwrap();
                assert_eq!(
                    convert_object(there, from).unwrap(),
                    sample(from),
                    "{from:?} via {via:?}"
                );
            }
        }
    }

    #[test]
    fn absent_fields_stay_absent() {
        let minimal = |v: Version| json!({"apiVersion": v.api_version(), "kind": "MyApp", "metadata": {"name": "m"}, "spec": {}});
        for from in ALL {
            for to in ALL {
                assert_eq!(convert_object(minimal(from), to).unwrap(), minimal(to));
            }
        }
        let no_spec = json!({"apiVersion": "app.example.com/v1alpha1", "kind": "MyApp", "metadata": {"name": "m"}});
        let converted = convert_object(no_spec, Version::V1).unwrap();
        assert_eq!(
            converted,
            json!({"apiVersion": "app.example.com/v1", "kind": "MyApp", "metadata": {"name": "m"}})
        );
    }

    #[test]
    fn renamed_fields_are_renamed() {
        let v1 = convert_object(sample(Version::V1alpha1), Version::V1).unwrap();
        assert_eq!(v1["spec"]["replicas"], 4);
        assert!(v1["spec"].get("size").is_none() && v1["spec"].get("configData").is_none());
        let alpha = convert_object(sample(Version::V1), Version::V1alpha1).unwrap();
        assert_eq!(alpha["spec"]["size"], 4);
        assert_eq!(alpha["spec"]["configData"]["app.conf"], "level=info");
    }

    #[test]
    fn foreign_objects_and_versions_are_refused() {
        let mut pod = sample(Version::V1);
        pod["kind"] = json!("Pod");
        assert!(matches!(
            convert_object(pod, Version::V1beta1),
            Err(ConversionError::NotAMyApp(_))
        ));
        let mut other = sample(Version::V1);
        other["apiVersion"] = json!("app.example.com/v2");
        assert!(matches!(
            convert_object(other, Version::V1beta1),
            Err(ConversionError::UnknownVersion(_))
        ));
        assert!(matches!(
            convert_object(json!([1]), Version::V1),
            Err(ConversionError::NotAMyApp(_))
        ));
        assert!(Version::from_api_version("apps/v1").is_err());
        let mut bad = sample(Version::V1alpha1);
        bad["spec"]["size"] = json!("three");
        assert!(matches!(
            convert_object(bad, Version::V1),
            Err(ConversionError::InvalidSpec { .. })
        ));
    }

    fn request(desired: &str, objects: Vec<Value>) -> ConversionReview {
        serde_json::from_value(json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "ConversionReview",
            "request": {"uid": "req-1", "desiredAPIVersion": desired, "objects": objects}
        }))
        .unwrap()
    }

    #[test]
    fn a_review_converts_all_objects_in_order() {
        let answer = review(request(
            "app.example.com/v1",
            vec![sample(Version::V1alpha1), sample(Version::V1beta1)],
        ));
        let answer = serde_json::to_value(answer).unwrap();
        assert_eq!(answer["apiVersion"], "apiextensions.k8s.io/v1");
        assert_eq!(answer["kind"], "ConversionReview");
        assert_eq!(answer["response"]["uid"], "req-1");
        assert_eq!(answer["response"]["result"]["status"], "Success");
        assert_eq!(
            answer["response"]["convertedObjects"],
            json!([sample(Version::V1), sample(Version::V1)])
        );
    }

    #[test]
    fn a_bad_review_fails_without_objects() {
        let answer = serde_json::to_value(review(request(
            "app.example.com/v9",
            vec![sample(Version::V1)],
        )))
        .unwrap();
        assert_eq!(answer["response"]["uid"], "req-1");
        assert_eq!(answer["response"]["result"]["status"], "Failure");
        assert!(
            answer["response"]["result"]["message"]
                .as_str()
                .unwrap()
                .contains("v9")
        );
        assert_eq!(answer["response"]["convertedObjects"], json!([]));

        let empty: ConversionReview = serde_json::from_value(
            json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview"}),
        )
        .unwrap();
        let answer = serde_json::to_value(review(empty)).unwrap();
        assert_eq!(answer["response"]["result"]["status"], "Failure");
    }
}
