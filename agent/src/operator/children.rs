//! What a MyApp becomes: the ConfigMap `<name>-config` and the Deployment `<name>-deploy`.
//! Pure functions of the MyApp, so that every rule here is unit-tested without a cluster.

use std::collections::BTreeMap;

use flotilla_crds::{MANAGED_BY_LABEL, MyApp};
use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, PodSpec, PodTemplateSpec, Probe,
    TCPSocketAction, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Resource;
use sha2::{Digest, Sha256};

/// Pod template annotation carrying the config digest: a new digest rolls the pods.
pub const CHECKSUM_ANNOTATION: &str = "checksum/config";
/// The value of the managed-by label ([`MANAGED_BY_LABEL`]) on every object the operator
/// creates; the owned-object watches select on it. Not Flotilla's value on MyApps
/// (`flotilla_crds::MANAGED_BY_VALUE`): the agent's MyApp watches never see children.
pub const CHILD_MANAGED_BY: &str = "flotilla-operator";
const NAME_LABEL: &str = "app.kubernetes.io/name";
const INSTANCE_LABEL: &str = "app.kubernetes.io/instance";
/// Where the config files are mounted in the container.
pub const CONFIG_MOUNT_PATH: &str = "/etc/myapp";
pub const CONTAINER_NAME: &str = "app";
pub const DEFAULT_REPLICAS: i32 = 1;
const DEFAULT_MAX_UNAVAILABLE: IntOrString = IntOrString::Int(1);

/// Why a MyApp cannot be turned into children.
#[derive(thiserror::Error, Debug, PartialEq, Eq)]
pub enum BuildError {
    #[error("the MyApp has no metadata.name or metadata.namespace")]
    Unnamed,
    #[error("the MyApp has no metadata.uid yet, so its children cannot be owned")]
    NoUid,
}

pub fn config_map_name(app: &str) -> String {
    format!("{app}-config")
}

pub fn deployment_name(app: &str) -> String {
    format!("{app}-deploy")
}

/// The MyApp whose Deployment is named `deployment`, by [`deployment_name`]'s rule.
pub fn app_of_deployment(deployment: &str) -> Option<&str> {
    deployment
        .strip_suffix("-deploy")
        .filter(|app| !app.is_empty())
}

/// Hex SHA-256 of the config. A `BTreeMap` serializes with sorted keys, so the digest
/// depends on the content only, never on insertion order.
pub fn config_checksum(config: &BTreeMap<String, String>) -> String {
    let bytes = serde_json::to_vec(config).expect("a map of strings serializes");
    hex::encode(Sha256::digest(bytes))
}

/// The selector labels of an app's pods. They are immutable on a Deployment, so they
/// depend on the name only.
pub fn selector_labels(app: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (NAME_LABEL.to_string(), "myapp".to_string()),
        (INSTANCE_LABEL.to_string(), app.to_string()),
    ])
}

fn labels(app: &str) -> BTreeMap<String, String> {
    let mut labels = selector_labels(app);
    labels.insert(MANAGED_BY_LABEL.to_string(), CHILD_MANAGED_BY.to_string());
    labels
}

/// Metadata of a child: same namespace, our labels, and a controller owner reference so
/// that deleting the MyApp garbage-collects the child.
fn child_meta(app: &MyApp, name: String) -> Result<ObjectMeta, BuildError> {
    let (app_name, namespace) = names(app)?;
    if app.metadata.uid.is_none() {
        return Err(BuildError::NoUid);
    }
    let owner = app.controller_owner_ref(&()).ok_or(BuildError::NoUid)?;
    Ok(ObjectMeta {
        name: Some(name),
        namespace: Some(namespace.to_string()),
        labels: Some(labels(app_name)),
        owner_references: Some(vec![owner]),
        ..ObjectMeta::default()
    })
}

/// Whether `child` is this MyApp's: its controller owner reference names the MyApp's
/// UID. The operator writes only such children (and creates new ones); anything else of
/// the same name is someone else's.
pub fn controlled_by<K: Resource>(child: &K, app: &MyApp) -> bool {
    let uid = app.metadata.uid.as_deref();
    let owners = child.meta().owner_references.as_deref().unwrap_or_default();
    owners
        .iter()
        .any(|o| o.controller == Some(true) && Some(o.uid.as_str()) == uid)
}

fn names(app: &MyApp) -> Result<(&str, &str), BuildError> {
    match (
        app.metadata.name.as_deref(),
        app.metadata.namespace.as_deref(),
    ) {
        (Some(name), Some(namespace)) => Ok((name, namespace)),
        _ => Err(BuildError::Unnamed),
    }
}

pub fn config_map(app: &MyApp) -> Result<ConfigMap, BuildError> {
    let (name, _) = names(app)?;
    Ok(ConfigMap {
        metadata: child_meta(app, config_map_name(name))?,
        data: Some(app.spec.config.clone()),
        ..ConfigMap::default()
    })
}

/// The Deployment of a MyApp with an image; `None` when the image is missing (the rule:
/// no image, no Deployment; the reconciler reports `Degraded/ImageMissing` instead).
pub fn deployment(app: &MyApp) -> Result<Option<Deployment>, BuildError> {
    let (name, _) = names(app)?;
    let metadata = child_meta(app, deployment_name(name))?;
    let Some(image) = app.spec.workload.image.clone() else {
        return Ok(None);
    };
    let workload = &app.spec.workload;
    let strategy = workload.strategy.clone().unwrap_or_default();
    let port = workload.port.map(|port| ContainerPort {
        name: Some("http".into()),
        container_port: port,
        protocol: Some("TCP".into()),
        ..ContainerPort::default()
    });
    // Ready means accepting connections on the declared port; without a port the
    // container's start is all the operator can know.
    let readiness_probe = workload.port.map(|_| Probe {
        tcp_socket: Some(TCPSocketAction {
            port: IntOrString::String("http".into()),
            host: None,
        }),
        period_seconds: Some(10),
        ..Probe::default()
    });
    let container = Container {
        name: CONTAINER_NAME.into(),
        image: Some(image),
        env: (!workload.env.is_empty()).then(|| workload.env.clone()),
        ports: port.map(|p| vec![p]),
        resources: workload.resources.clone(),
        readiness_probe,
        volume_mounts: Some(vec![VolumeMount {
            name: "config".into(),
            mount_path: CONFIG_MOUNT_PATH.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        }]),
        ..Container::default()
    };
    let template = PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels(name)),
            annotations: Some(BTreeMap::from([(
                CHECKSUM_ANNOTATION.to_string(),
                config_checksum(&app.spec.config),
            )])),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            containers: vec![container],
            volumes: Some(vec![Volume {
                name: "config".into(),
                config_map: Some(ConfigMapVolumeSource {
                    name: config_map_name(name),
                    ..ConfigMapVolumeSource::default()
                }),
                ..Volume::default()
            }]),
            ..PodSpec::default()
        }),
    };
    Ok(Some(Deployment {
        metadata,
        spec: Some(DeploymentSpec {
            replicas: Some(app.spec.replicas.unwrap_or(DEFAULT_REPLICAS)),
            selector: LabelSelector {
                match_labels: Some(selector_labels(name)),
                match_expressions: None,
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_unavailable: Some(
                        strategy.max_unavailable.unwrap_or(DEFAULT_MAX_UNAVAILABLE),
                    ),
                    max_surge: Some(
                        strategy
                            .max_surge
                            .unwrap_or_else(|| IntOrString::String("25%".into())),
                    ),
                }),
            }),
            template,
            ..DeploymentSpec::default()
        }),
        status: None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_crds::MyAppSpec;
    use flotilla_crds::myapp::{RolloutStrategy, Workload};
    use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn app(spec: MyAppSpec) -> MyApp {
        let mut app = MyApp::new("web", spec);
        app.metadata.namespace = Some("shop".into());
        app.metadata.uid = Some("0b5e-uid".into());
        app
    }

    fn spec(image: Option<&str>) -> MyAppSpec {
        MyAppSpec {
            replicas: Some(3),
            workload: Workload {
                image: image.map(str::to_string),
                ..Workload::default()
            },
            config: BTreeMap::from([("app.conf".to_string(), "level=info".to_string())]),
        }
    }

    fn deploy(app: &MyApp) -> Deployment {
        deployment(app)
            .unwrap()
            .expect("an app with an image has a Deployment")
    }

    fn checksum_of(d: &Deployment) -> String {
        let template = &d.spec.as_ref().unwrap().template;
        template
            .metadata
            .as_ref()
            .unwrap()
            .annotations
            .as_ref()
            .unwrap()[CHECKSUM_ANNOTATION]
            .clone()
    }

    fn container(d: &Deployment) -> &Container {
        &d.spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
            .containers[0]
    }

    #[test]
    fn names_follow_the_app() {
        let a = app(spec(Some("nginx:1.27")));
        assert_eq!(
            config_map(&a).unwrap().metadata.name.as_deref(),
            Some("web-config")
        );
        assert_eq!(deploy(&a).metadata.name.as_deref(), Some("web-deploy"));
        assert_eq!(deploy(&a).metadata.namespace.as_deref(), Some("shop"));
    }

    #[test]
    fn children_are_owned_by_the_app_as_controller() {
        let a = app(spec(Some("nginx:1.27")));
        for meta in [config_map(&a).unwrap().metadata, deploy(&a).metadata] {
            let owners = meta.owner_references.unwrap();
            assert_eq!(owners.len(), 1);
            let owner = &owners[0];
            assert_eq!(owner.api_version, "app.example.com/v1");
            assert_eq!(owner.kind, "MyApp");
            assert_eq!(owner.name, "web");
            assert_eq!(owner.uid, "0b5e-uid");
            assert_eq!(owner.controller, Some(true));
            assert_eq!(meta.labels.unwrap()[MANAGED_BY_LABEL], CHILD_MANAGED_BY);
        }
    }

    /// Only a controller reference to this very MyApp (by UID) makes a child ours: a
    /// same-named object with no owner, another owner, a non-controller reference, or a
    /// reference to an earlier MyApp of the same name is someone else's.
    #[test]
    fn a_child_is_ours_only_through_a_controller_reference_to_the_apps_uid() {
        let app = app(spec(Some("nginx:1.27")));
        let ours = config_map(&app).unwrap();
        assert!(controlled_by(&ours, &app));
        let with_owner = |uid: &str, controller: Option<bool>| {
            let mut cm = ours.clone();
            let owner = &mut cm.metadata.owner_references.as_mut().unwrap()[0];
            (owner.uid, owner.controller) = (uid.into(), controller);
            cm
        };
        assert!(!controlled_by(&with_owner("another-uid", Some(true)), &app));
        assert!(!controlled_by(&with_owner("0b5e-uid", Some(false)), &app));
        assert!(!controlled_by(&with_owner("0b5e-uid", None), &app));
        let mut foreign = ours.clone();
        foreign.metadata.owner_references = None;
        assert!(!controlled_by(&foreign, &app));
        let mut no_uid = app.clone();
        no_uid.metadata.uid = None;
        assert!(!controlled_by(&with_owner("", Some(true)), &no_uid));
    }

    #[test]
    fn an_app_without_name_or_uid_builds_nothing() {
        let mut a = app(spec(Some("nginx:1.27")));
        a.metadata.uid = None;
        assert_eq!(deployment(&a), Err(BuildError::NoUid));
        assert_eq!(config_map(&a), Err(BuildError::NoUid));
        a.metadata.namespace = None;
        assert_eq!(config_map(&a), Err(BuildError::Unnamed));
    }

    #[test]
    fn config_map_carries_the_config() {
        let a = app(spec(Some("nginx:1.27")));
        assert_eq!(config_map(&a).unwrap().data, Some(a.spec.config.clone()));
        let empty = app(MyAppSpec::default());
        assert_eq!(config_map(&empty).unwrap().data, Some(BTreeMap::new()));
    }

    #[test]
    fn no_image_means_no_deployment() {
        assert_eq!(deployment(&app(spec(None))), Ok(None));
    }

    #[test]
    fn deployment_runs_the_image_with_the_config_mounted() {
        let a = app(spec(Some("nginx:1.27")));
        let d = deploy(&a);
        let s = d.spec.as_ref().unwrap();
        assert_eq!(s.replicas, Some(3));
        assert_eq!(s.selector.match_labels, Some(selector_labels("web")));
        let pod_labels = s
            .template
            .metadata
            .as_ref()
            .unwrap()
            .labels
            .clone()
            .unwrap();
        assert!(
            selector_labels("web")
                .iter()
                .all(|(k, v)| pod_labels.get(k) == Some(v))
        );
        let c = container(&d);
        assert_eq!(c.image.as_deref(), Some("nginx:1.27"));
        assert_eq!(
            c.volume_mounts.as_ref().unwrap()[0].mount_path,
            CONFIG_MOUNT_PATH
        );
        let volume = &s.template.spec.as_ref().unwrap().volumes.as_ref().unwrap()[0];
        assert_eq!(volume.config_map.as_ref().unwrap().name, "web-config");
        assert!(c.ports.is_none() && c.readiness_probe.is_none());
    }

    #[test]
    fn replicas_default_to_one() {
        let mut s = spec(Some("nginx:1.27"));
        s.replicas = None;
        assert_eq!(deploy(&app(s)).spec.unwrap().replicas, Some(1));
    }

    #[test]
    fn env_port_and_resources_reach_the_container() {
        let mut s = spec(Some("nginx:1.27"));
        s.workload.env = vec![EnvVar {
            name: "MODE".into(),
            value: Some("prod".into()),
            value_from: None,
        }];
        s.workload.port = Some(8080);
        let resources = ResourceRequirements {
            limits: Some(BTreeMap::from([(
                "memory".to_string(),
                Quantity("64Mi".into()),
            )])),
            ..ResourceRequirements::default()
        };
        s.workload.resources = Some(resources.clone());
        let d = deploy(&app(s));
        let c = container(&d);
        assert_eq!(c.env.as_ref().unwrap()[0].name, "MODE");
        let port = &c.ports.as_ref().unwrap()[0];
        assert_eq!(
            (port.name.as_deref(), port.container_port),
            (Some("http"), 8080)
        );
        assert!(c.readiness_probe.as_ref().unwrap().tcp_socket.is_some());
        assert_eq!(c.resources, Some(resources));
    }

    #[test]
    fn rolling_update_defaults_to_one_unavailable_and_quarter_surge() {
        let d = deploy(&app(spec(Some("nginx:1.27"))));
        let strategy = d.spec.unwrap().strategy.unwrap();
        assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
        let ru = strategy.rolling_update.unwrap();
        assert_eq!(ru.max_unavailable, Some(IntOrString::Int(1)));
        assert_eq!(ru.max_surge, Some(IntOrString::String("25%".into())));
    }

    #[test]
    fn rolling_update_is_overridable_field_by_field() {
        let mut s = spec(Some("nginx:1.27"));
        s.workload.strategy = Some(RolloutStrategy {
            max_unavailable: Some(IntOrString::String("50%".into())),
            max_surge: None,
        });
        let ru = deploy(&app(s.clone()))
            .spec
            .unwrap()
            .strategy
            .unwrap()
            .rolling_update
            .unwrap();
        assert_eq!(ru.max_unavailable, Some(IntOrString::String("50%".into())));
        assert_eq!(ru.max_surge, Some(IntOrString::String("25%".into())));
        s.workload.strategy = Some(RolloutStrategy {
            max_unavailable: None,
            max_surge: Some(IntOrString::Int(2)),
        });
        let ru = deploy(&app(s))
            .spec
            .unwrap()
            .strategy
            .unwrap()
            .rolling_update
            .unwrap();
        assert_eq!(ru.max_unavailable, Some(IntOrString::Int(1)));
        assert_eq!(ru.max_surge, Some(IntOrString::Int(2)));
    }

    #[test]
    fn checksum_is_the_sha256_of_the_config() {
        let d = deploy(&app(spec(Some("nginx:1.27"))));
        let expected = hex::encode(Sha256::digest(br#"{"app.conf":"level=info"}"#));
        assert_eq!(checksum_of(&d), expected);
        assert_eq!(checksum_of(&d).len(), 64);
    }

    #[test]
    fn checksum_is_stable_and_ignores_order() {
        let forward: BTreeMap<String, String> = [("a", "1"), ("b", "2")]
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        let backward: BTreeMap<String, String> = [("b", "2"), ("a", "1")]
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        assert_eq!(config_checksum(&forward), config_checksum(&forward));
        assert_eq!(config_checksum(&forward), config_checksum(&backward));
    }

    #[test]
    fn checksum_changes_with_the_config_only() {
        let base = spec(Some("nginx:1.27"));
        let sum = checksum_of(&deploy(&app(base.clone())));

        let mut other = base.clone();
        other.replicas = Some(7);
        other.workload.image = Some("nginx:1.28".into());
        other.workload.port = Some(80);
        assert_eq!(
            checksum_of(&deploy(&app(other))),
            sum,
            "non-config fields must not roll pods"
        );

        for change in [
            ("app.conf", "level=debug"), // value
            ("extra.conf", "x"),         // new key
        ] {
            let mut changed = base.clone();
            changed.config.insert(change.0.into(), change.1.into());
            assert_ne!(checksum_of(&deploy(&app(changed))), sum, "{change:?}");
        }
        let mut emptied = base;
        emptied.config.clear();
        assert_ne!(checksum_of(&deploy(&app(emptied))), sum);
    }

    #[test]
    fn checksum_separates_keys_from_values() {
        // A naive concatenation would make these equal.
        let a = BTreeMap::from([("ab".to_string(), "c".to_string())]);
        let b = BTreeMap::from([("a".to_string(), "bc".to_string())]);
        assert_ne!(config_checksum(&a), config_checksum(&b));
    }

    #[test]
    fn same_app_builds_the_same_deployment() {
        let a = app(spec(Some("nginx:1.27")));
        assert_eq!(deploy(&a), deploy(&a.clone()));
    }
}
