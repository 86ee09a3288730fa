//! The MyApp operator on a real member cluster: readiness, config rollouts, schema,
//! version conversion through the webhook, drift repair and garbage collection.
//!
//! Each test owns a namespace and starts its own `flotilla-agent operator` restricted to
//! it (through `Env::spawn`, so `flotilla-e2e down` stops any left behind), against the
//! first member cluster. Needs a running environment (`cargo run -p flotilla-e2e -- up`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use flotilla_crds::{MyApp, MyAppStatus};
use flotilla_e2e::agent_binary;
use flotilla_lab::federation::{Federation, agent_name};
use flotilla_lab::support::{free_addr, http_get, workspace_root};
use flotilla_lab::{Env, ProcessRecord, await_object, wait_for};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(90);
const CHECKSUM: &str = "checksum/config";
const CRD: &str = "myapps.app.example.com";

/// A test's world: a fresh namespace on a member cluster, where the environment's agent
/// (`flotilla-agent run`, which `up` starts per member) runs the operator under test; or,
/// for a test that needs another identity, an operator the test starts itself.
struct Fixture {
    env: Env,
    member: String,
    client: Client,
    namespace: String,
    /// The operator this test started, if it started one.
    own: Option<ProcessRecord>,
}

impl Fixture {
    /// A fresh namespace on the first member, whose agent is ready.
    async fn start(test: &str) -> Fixture {
        let env = Env::load_ready()
            .await
            .unwrap_or_else(|e| panic!("the e2e environment is not up: {e:#}"));
        let member = env.members().first().expect("a member cluster").to_string();
        let federation = Federation::load(&env).unwrap();
        federation.wait_ready(&agent_name(&member)).await.unwrap();
        Fixture::new(env, member, test).await
    }

    /// A fresh namespace on `cluster`, no operator yet.
    async fn new(env: Env, cluster: String, test: &str) -> Fixture {
        let client = env.client(&cluster).await.unwrap();
        let millis = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis();
        let namespace = format!("op-{test}-{}", millis % 1_000_000_000);
        let ns = Namespace {
            metadata: kube::api::ObjectMeta {
                name: Some(namespace.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
        Fixture {
            env,
            member: cluster,
            client,
            namespace,
            own: None,
        }
    }

    /// Starts `flotilla-agent operator` for this namespace with `kubeconfig`, its CRD
    /// pointed at its own conversion webhook, and waits until it is ready.
    async fn launch(&mut self, kubeconfig: &Path) {
        let http_addr = free_addr().unwrap();
        // Where the apiserver reaches the webhook (for kind, not loopback).
        let webhook_addr = flotilla_lab::provider::host_addr_for_apiservers(&self.env).unwrap();
        let mut cmd = Command::new(agent_binary());
        cmd.env("KUBECONFIG", kubeconfig)
            .args(["operator", "--namespace", &self.namespace])
            .args(["--resync", "5m"])
            .args(["--http-addr", &http_addr])
            .args(["--webhook-addr", &webhook_addr])
            .args(["--webhook-url", &format!("https://{webhook_addr}/convert")])
            // Elected as the Deployment runs it: the Lease's RBAC is part of what is proven.
            .args(["--leader-elect", "--lease-namespace", "flotilla-system"]);
        let name = format!("operator-{}", self.namespace);
        let operator = self.env.spawn(&name, &mut cmd).unwrap();
        self.own = Some(operator.clone());
        wait_for(TIMEOUT, "the operator to be ready", || async {
            if !operator.alive() {
                bail!("the operator exited");
            }
            let (code, _) = http_get(&http_addr, "/readyz").await?;
            Ok((code == 200).then_some(()))
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}; {}", self.log()));
    }

    /// Where the operator's log is, for failure messages.
    fn log(&self) -> String {
        match &self.own {
            Some(p) => format!("operator log: {:?}", p.log),
            None => format!(
                "operator log: {}/logs/{}.log",
                self.env.dir.display(),
                agent_name(&self.member)
            ),
        }
    }

    fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// A MyApp of any version, as raw JSON.
    fn dynamic(&self, version: &str) -> Api<DynamicObject> {
        let gvk = GroupVersionKind::gvk("app.example.com", version, "MyApp");
        let resource = ApiResource::from_gvk_with_plural(&gvk, "myapps");
        Api::namespaced_with(self.client.clone(), &self.namespace, &resource)
    }

    async fn create(&self, name: &str, spec: Value) -> MyApp {
        let app: MyApp = serde_json::from_value(json!({
            "apiVersion": "app.example.com/v1", "kind": "MyApp",
            "metadata": {"name": name}, "spec": spec
        }))
        .unwrap();
        self.api::<MyApp>()
            .create(&PostParams::default(), &app)
            .await
            .unwrap()
    }

    /// Waits until the MyApp is ready at its current generation with `replicas` ready.
    async fn ready(&self, name: &str, replicas: i32) -> MyApp {
        self.try_ready(name, replicas)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    async fn try_ready(&self, name: &str, replicas: i32) -> Result<MyApp> {
        let ready = |app: &MyApp| {
            let status = app.status.clone().unwrap_or_default();
            let current = status.observed_generation == app.metadata.generation;
            current && status.ready && status.ready_replicas == replicas
        };
        let (api, what) = (self.api(), format!("MyApp {name} to be ready"));
        let cond = |a: Option<&MyApp>| a.is_some_and(ready);
        let app = await_object(&api, name, TIMEOUT, &what, cond).await;
        app.and_then(|a| a.context("no MyApp"))
            .with_context(|| self.log())
    }

    /// MyApp `name`'s status, once a condition has `reason`.
    async fn condition_reason(&self, name: &str, reason: &str) -> MyAppStatus {
        let has_reason = |app: &MyApp| {
            let status = app.status.as_ref();
            status.is_some_and(|s| s.conditions.iter().any(|c| c.reason == reason))
        };
        let (api, what) = (self.api(), format!("a condition with reason {reason}"));
        let cond = |a: Option<&MyApp>| a.is_some_and(has_reason);
        let app = await_object(&api, name, TIMEOUT, &what, cond).await;
        app.unwrap().unwrap().status.unwrap_or_default()
    }

    async fn deployment(&self, name: &str) -> Deployment {
        self.api::<Deployment>()
            .get(&format!("{name}-deploy"))
            .await
            .unwrap()
    }

    /// Names of the ReplicaSets of the app's Deployment.
    async fn replica_sets(&self) -> BTreeSet<String> {
        let list = self
            .api::<ReplicaSet>()
            .list(&ListParams::default())
            .await
            .unwrap();
        list.items.iter().map(|rs| rs.name_any()).collect()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(operator) = &self.own {
            let stopped = operator
                .stop(Duration::from_secs(5))
                .and_then(|()| flotilla_lab::process::forget(&self.env.dir, &operator.name));
            if let Err(e) = stopped {
                eprintln!("stopping {}: {e:#}", operator.name);
            }
        }
        // The namespace goes with everything in it; nobody waits for that. A fresh client
        // on a fresh runtime: the test's runtime is blocked in this very drop.
        let (env, member, namespace) = (
            self.env.clone(),
            self.member.clone(),
            self.namespace.clone(),
        );
        let deleted = std::thread::spawn(move || -> Result<()> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                let api: Api<Namespace> = Api::all(env.client(&member).await?);
                api.delete(&namespace, &DeleteParams::default()).await?;
                Ok(())
            })
        })
        .join();
        if let Ok(Err(e)) = deleted {
            eprintln!("deleting namespace {}: {e:#}", self.namespace);
        }
    }
}

fn checksum(d: &Deployment) -> String {
    let template = &d.spec.as_ref().unwrap().template;
    template
        .metadata
        .as_ref()
        .unwrap()
        .annotations
        .as_ref()
        .unwrap()[CHECKSUM]
        .clone()
}

fn condition<'a>(status: &'a MyAppStatus, type_: &str) -> (&'a str, &'a str) {
    let c = status.conditions.iter().find(|c| c.type_ == type_).unwrap();
    (&c.status, &c.reason)
}

#[tokio::test]
async fn myapp_becomes_ready_with_all_replicas() {
    let f = Fixture::start("ready").await;
    f.create(
        "web",
        json!({"replicas": 3, "image": "nginx:1.27", "config": {"app.conf": "level=info"}}),
    )
    .await;
    let app = f.ready("web", 3).await;
    let status = app.status.unwrap();
    assert_eq!(condition(&status, "Ready"), ("True", "Ready"));
    assert_eq!(condition(&status, "Available").0, "True");
    assert_eq!(condition(&status, "Degraded"), ("False", "AsExpected"));

    let d = f.deployment("web").await;
    let ds = d.status.clone().unwrap();
    assert_eq!(
        (ds.ready_replicas, ds.available_replicas),
        (Some(3), Some(3))
    );
    let owner = &d.metadata.owner_references.clone().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str()),
        ("MyApp", app.metadata.uid.as_deref().unwrap())
    );
    let ru = d
        .spec
        .clone()
        .unwrap()
        .strategy
        .unwrap()
        .rolling_update
        .unwrap();
    assert_eq!(
        serde_json::to_value(&ru).unwrap(),
        json!({"maxUnavailable": 1, "maxSurge": "25%"})
    );
    let cm = f.api::<ConfigMap>().get("web-config").await.unwrap();
    assert_eq!(cm.data.unwrap()["app.conf"], "level=info");
    let managers: Vec<String> = d
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter_map(|m| m.manager)
        .collect();
    assert!(
        managers.iter().any(|m| m == "flotilla-operator"),
        "{managers:?}"
    );
}

#[tokio::test]
async fn config_change_rolls_and_no_change_rolls_nothing() {
    let f = Fixture::start("rollout").await;
    let spec = json!({"replicas": 2, "image": "nginx:1.27", "config": {"app.conf": "v1"}});
    f.create("web", spec.clone()).await;
    f.ready("web", 2).await;
    let before = f.deployment("web").await;
    let replica_sets = f.replica_sets().await;
    assert_eq!(replica_sets.len(), 1);

    // The same spec again, and a metadata-only change: no new generation, no new pods.
    let api = f.api::<MyApp>();
    let same = json!({"apiVersion": "app.example.com/v1", "kind": "MyApp", "spec": spec});
    api.patch(
        "web",
        &PatchParams::apply("e2e-test").force(),
        &Patch::Apply(&same),
    )
    .await
    .unwrap();
    api.patch(
        "web",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = f.deployment("web").await;
    assert_eq!(
        after.metadata.generation, before.metadata.generation,
        "nothing changed, nothing rolls"
    );
    assert_eq!(checksum(&after), checksum(&before));
    assert_eq!(f.replica_sets().await, replica_sets);

    api.patch(
        "web",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"config": {"app.conf": "v2"}}})),
    )
    .await
    .unwrap();
    f.ready("web", 2).await;
    let rolled = f.deployment("web").await;
    assert_ne!(
        checksum(&rolled),
        checksum(&before),
        "a config change changes the checksum"
    );
    let cm = f.api::<ConfigMap>().get("web-config").await.unwrap();
    assert_eq!(cm.data.unwrap()["app.conf"], "v2");
    let now = f.replica_sets().await;
    assert_eq!(now.len(), 2, "a new ReplicaSet beside the old one: {now:?}");
    let old = f
        .api::<ReplicaSet>()
        .get(replica_sets.first().unwrap())
        .await
        .unwrap();
    assert_eq!(
        old.spec.unwrap().replicas,
        Some(0),
        "the old ReplicaSet is scaled down"
    );
}

#[tokio::test]
async fn apiserver_rejects_invalid_myapps() {
    let f = Fixture::start("schema").await;
    let post = |name: &'static str, version: &'static str, spec: Value| {
        let api = f.dynamic(version);
        async move {
            let object: DynamicObject = serde_json::from_value(json!({
                "apiVersion": format!("app.example.com/{version}"), "kind": "MyApp",
                "metadata": {"name": name}, "spec": spec
            }))
            .unwrap();
            api.create(&PostParams::default(), &object).await
        }
    };
    // What a user sees: 422 Invalid, naming the field and the rule.
    for (name, version, spec, says) in [
        (
            "eleven",
            "v1",
            json!({"replicas": 11, "image": "nginx:1.27"}),
            "spec.replicas in body should be less than or equal to 10",
        ),
        (
            "zero",
            "v1",
            json!({"replicas": 0, "image": "nginx:1.27"}),
            "spec.replicas in body should be greater than or equal to 1",
        ),
        (
            "untagged",
            "v1",
            json!({"replicas": 1, "image": "nginx"}),
            "spec.image in body should match '^.+:.+$'",
        ),
        (
            "alpha-eleven",
            "v1alpha1",
            json!({"size": 11, "image": "nginx:1.27"}),
            "spec.size in body should be less than or equal to 10",
        ),
    ] {
        match post(name, version, spec).await {
            Err(kube::Error::Api(s)) => {
                assert_eq!(
                    (s.code, s.reason.as_str()),
                    (422, "Invalid"),
                    "{name}: {s:?}"
                );
                assert!(s.message.contains(says), "{name}: {}", s.message);
            }
            other => panic!("{name} was not rejected: {other:?}"),
        }
    }
    // The control: the same object with valid values passes.
    post("ten", "v1", json!({"replicas": 10, "image": "nginx:1.27"}))
        .await
        .unwrap();
}

/// The CRD's `spec.conversion` as a merge patch that puts it back exactly: `url` and
/// `service` exclude each other, so the absent one is nulled.
async fn conversion_patch(crds: &Api<CustomResourceDefinition>) -> Value {
    let crd = crds.get(CRD).await.unwrap();
    let mut conversion = serde_json::to_value(crd.spec.conversion).unwrap();
    if conversion.is_null() {
        conversion = json!({"strategy": "None"});
    }
    conversion
        .as_object_mut()
        .unwrap()
        .entry("webhook")
        .or_insert(Value::Null);
    if let Some(config) = conversion
        .pointer_mut("/webhook/clientConfig")
        .and_then(Value::as_object_mut)
    {
        for key in ["url", "service", "caBundle"] {
            config.entry(key).or_insert(Value::Null);
        }
    }
    json!({"spec": {"conversion": conversion}})
}

/// Through the webhook of the environment's agent, which published it at start.
#[tokio::test]
async fn versions_convert_through_the_webhook() {
    let f = Fixture::start("convert").await;
    convert_both_ways(&f).await.unwrap();
}

async fn convert_both_ways(f: &Fixture) -> Result<()> {
    // Written as v1alpha1 (`size`, `configData`), read as v1.
    let old: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "app.example.com/v1alpha1", "kind": "MyApp", "metadata": {"name": "old"},
        "spec": {"size": 2, "image": "nginx:1.27", "configData": {"k": "v"}}
    }))?;
    f.dynamic("v1alpha1")
        .create(&PostParams::default(), &old)
        .await
        .context("creating v1alpha1")?;
    let as_v1 = f.api::<MyApp>().get("old").await.context("reading v1")?;
    assert_eq!(as_v1.spec.replicas, Some(2));
    assert_eq!(
        as_v1.spec.config,
        BTreeMap::from([("k".to_string(), "v".to_string())])
    );
    // The operator works from v1 whatever version the user wrote.
    f.try_ready("old", 2).await?;

    // Written as v1, read as v1alpha1 and v1beta1.
    f.create(
        "new",
        json!({"replicas": 3, "image": "nginx:1.27", "config": {"a": "b"}}),
    )
    .await;
    let alpha = f
        .dynamic("v1alpha1")
        .get("new")
        .await
        .context("reading v1alpha1")?;
    assert_eq!(
        alpha.types.as_ref().map(|t| t.api_version.as_str()),
        Some("app.example.com/v1alpha1")
    );
    assert_eq!(alpha.data["spec"]["size"], 3);
    assert_eq!(alpha.data["spec"]["configData"], json!({"a": "b"}));
    assert!(
        alpha.data["spec"].get("replicas").is_none() && alpha.data["spec"].get("config").is_none()
    );
    let beta = f
        .dynamic("v1beta1")
        .get("new")
        .await
        .context("reading v1beta1")?;
    assert_eq!(beta.data["spec"]["replicas"], 3);
    assert_eq!(beta.data["spec"]["configData"], json!({"a": "b"}));

    // An update through an old version keeps the fields it cannot name.
    f.dynamic("v1alpha1")
        .patch(
            "new",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 4}})),
        )
        .await
        .context("patching v1alpha1")?;
    let back = f.api::<MyApp>().get("new").await?;
    if back.spec.replicas != Some(4) || back.spec.config.get("a").map(String::as_str) != Some("b") {
        bail!("v1alpha1 patch lost data: {:?}", back.spec);
    }
    Ok(())
}

#[tokio::test]
async fn a_deployment_deleted_or_edited_by_hand_is_put_back() {
    let f = Fixture::start("drift").await;
    f.create("web", json!({"replicas": 2, "image": "nginx:1.27"}))
        .await;
    f.ready("web", 2).await;
    let deployments = f.api::<Deployment>();
    let first = f.deployment("web").await;

    deployments
        .delete("web-deploy", &DeleteParams::default())
        .await
        .unwrap();
    let new = |d: Option<&Deployment>| d.is_some_and(|d| d.metadata.uid != first.metadata.uid);
    let what = "the Deployment to come back";
    let back = await_object(&deployments, "web-deploy", TIMEOUT, what, new)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(back.spec.unwrap().replicas, Some(2));
    f.ready("web", 2).await;

    let scale = json!({"spec": {"replicas": 5}});
    deployments
        .patch("web-deploy", &PatchParams::default(), &Patch::Merge(scale))
        .await
        .unwrap();
    let undone = |d: Option<&Deployment>| d.and_then(|d| d.spec.as_ref()?.replicas) == Some(2);
    let what = "the hand-made scale to be undone";
    await_object(&deployments, "web-deploy", TIMEOUT, what, undone)
        .await
        .unwrap();
    f.ready("web", 2).await;
}

#[tokio::test]
async fn deleting_the_myapp_collects_its_children() {
    let f = Fixture::start("gc").await;
    f.create(
        "web",
        json!({"replicas": 1, "image": "nginx:1.27", "config": {"a": "b"}}),
    )
    .await;
    f.ready("web", 1).await;
    f.api::<MyApp>()
        .delete("web", &DeleteParams::default())
        .await
        .unwrap();
    let (deployments, config_maps) = (f.api::<Deployment>(), f.api::<ConfigMap>());
    wait_for(
        TIMEOUT,
        "the garbage collector to remove Deployment and ConfigMap",
        || async {
            let gone = deployments.get_opt("web-deploy").await?.is_none()
                && config_maps.get_opt("web-config").await?.is_none();
            Ok(gone.then_some(()))
        },
    )
    .await
    .unwrap();
}

/// An object of a child's name that the operator did not create is never adopted: the
/// MyApp says `Degraded/NotOwned` naming it, the object keeps its content, and it
/// survives the MyApp's deletion (an adopted one would be garbage-collected with it).
#[tokio::test]
async fn a_same_named_object_the_operator_did_not_create_is_left_alone() {
    let f = Fixture::start("notowned").await;
    let (config_maps, deployments) = (f.api::<ConfigMap>(), f.api::<Deployment>());
    let theirs: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "web-config"}, "data": {"owner": "someone else"}
    }))
    .unwrap();
    config_maps
        .create(&PostParams::default(), &theirs)
        .await
        .unwrap();
    let foreign_deploy: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "api-deploy"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"run": "theirs"}},
                 "template": {"metadata": {"labels": {"run": "theirs"}},
                              "spec": {"containers": [{"name": "c", "image": "busybox:1"}]}}}
    }))
    .unwrap();
    deployments
        .create(&PostParams::default(), &foreign_deploy)
        .await
        .unwrap();
    f.create(
        "web",
        json!({"replicas": 1, "image": "nginx:1.27", "config": {"a": "b"}}),
    )
    .await;
    f.create("api", json!({"replicas": 1, "image": "nginx:1.27"}))
        .await;

    for (app, kind, child) in [
        ("web", "ConfigMap", "web-config"),
        ("api", "Deployment", "api-deploy"),
    ] {
        let status = f.condition_reason(app, "NotOwned").await;
        assert_eq!(condition(&status, "Degraded"), ("True", "NotOwned"));
        assert_eq!(condition(&status, "Ready"), ("False", "NotOwned"));
        assert!(!status.ready, "{app}");
        let degraded = status
            .conditions
            .iter()
            .find(|c| c.type_ == "Degraded")
            .unwrap();
        assert!(
            degraded.message.starts_with(&format!(
                "{kind} {child} exists and is not controlled by this MyApp"
            )),
            "{}",
            degraded.message
        );
    }
    let cm = config_maps.get("web-config").await.unwrap();
    let untouched = BTreeMap::from([("owner".to_owned(), "someone else".to_owned())]);
    assert_eq!(cm.data.unwrap(), untouched);
    assert!(cm.metadata.owner_references.is_none(), "adopted");
    assert!(
        deployments.get_opt("web-deploy").await.unwrap().is_none(),
        "no Deployment is started on a config it does not own"
    );
    let d = deployments.get("api-deploy").await.unwrap();
    let image = d.spec.unwrap().template.spec.unwrap().containers[0]
        .image
        .clone();
    assert_eq!(image.as_deref(), Some("busybox:1"));
    assert!(d.metadata.owner_references.is_none(), "adopted");
    // api's own ConfigMap is made as usual: only the taken name is refused.
    let own = config_maps.get("api-config").await.unwrap();
    assert!(
        own.metadata
            .owner_references
            .is_some_and(|o| o[0].name == "api")
    );

    let apps = f.api::<MyApp>();
    for app in ["web", "api"] {
        apps.delete(app, &DeleteParams::default()).await.unwrap();
    }
    wait_for(TIMEOUT, "api's own ConfigMap to be collected", || async {
        Ok(config_maps
            .get_opt("api-config")
            .await?
            .is_none()
            .then_some(()))
    })
    .await
    .unwrap();
    let apps_gone = |a: Option<&MyApp>| a.is_none();
    for app in ["web", "api"] {
        await_object(&apps, app, TIMEOUT, "the MyApp gone", apps_gone)
            .await
            .unwrap();
    }
    assert!(
        config_maps.get_opt("web-config").await.unwrap().is_some(),
        "collected with the MyApp"
    );
    assert!(
        deployments.get_opt("api-deploy").await.unwrap().is_some(),
        "collected with the MyApp"
    );
}

#[tokio::test]
async fn a_myapp_without_image_is_degraded_not_deployed() {
    let f = Fixture::start("noimage").await;
    // The seed's FederatedMyApp template renders exactly this.
    f.create("seed", json!({"replicas": 3})).await;
    let api = f.api::<MyApp>();
    let status = f.condition_reason("seed", "ImageMissing").await;
    assert!(!status.ready);
    assert_eq!(condition(&status, "Degraded"), ("True", "ImageMissing"));
    assert_eq!(condition(&status, "Ready"), ("False", "ImageMissing"));
    assert!(
        f.api::<Deployment>()
            .get_opt("seed-deploy")
            .await
            .unwrap()
            .is_none()
    );
    let events: Api<k8s_openapi::api::events::v1::Event> = f.api();
    wait_for(TIMEOUT, "a Warning Event ImageMissing", || async {
        let list = events.list(&ListParams::default()).await?;
        Ok(list
            .items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("ImageMissing") && e.type_.as_deref() == Some("Warning")
            })
            .then_some(()))
    })
    .await
    .unwrap();

    // Naming an image later is all it takes.
    api.patch(
        "seed",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"image": "nginx:1.27"}})),
    )
    .await
    .unwrap();
    f.ready("seed", 3).await;
}

/// The seed's `HighReconciliationErrorRate` fires above 0.1 errors/s over 5 minutes: one
/// MyApp whose children the apiserver rejects must count more than that on its own,
/// and say why on the MyApp.
#[tokio::test]
async fn one_myapp_the_apiserver_rejects_counts_errors_above_the_alert_rate() {
    let f = Fixture::start("stuck").await;
    let federation = Federation::load(&f.env).unwrap();
    let agent = agent_name(&f.member);
    let errors = || async {
        let metrics = federation.metrics(&agent).await.unwrap();
        flotilla_lab::support::sample(
            &metrics,
            r#"controller_runtime_reconcile_errors_total{controller="myapp",error="invalid_spec"}"#,
        )
    };
    // Both 0 is valid for the CRD's schema, but not for a Deployment.
    f.create(
        "stuck",
        json!({"replicas": 2, "image": "nginx:1.27",
               "strategy": {"maxSurge": 0, "maxUnavailable": 0}}),
    )
    .await;
    let api = f.api::<MyApp>();
    let status = f.condition_reason("stuck", "InvalidSpec").await;
    assert_eq!(condition(&status, "Ready"), ("False", "InvalidSpec"));
    assert_eq!(condition(&status, "Degraded"), ("True", "InvalidSpec"));

    let window = Duration::from_secs(30);
    let before = errors().await;
    tokio::time::sleep(window).await;
    let rate = (errors().await - before) / window.as_secs_f64();
    println!("one stuck MyApp: {rate:.3} reconcile errors/s");
    assert!(
        rate > 0.1,
        "{rate:.3} errors/s: the seed's alert would not fire"
    );

    // Fixed, it stops counting.
    api.patch(
        "stuck",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"strategy": {"maxSurge": 1}}})),
    )
    .await
    .unwrap();
    f.ready("stuck", 2).await;
    let settled = errors().await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(errors().await, settled, "a fixed MyApp still counts errors");
}

/// The agent's identity from `deploy/base/rbac.yaml`.
const AGENT_SA: &str = "system:serviceaccount:flotilla-system:flotilla-agent";

/// Applies the ServiceAccount, ClusterRole and ClusterRoleBinding of `deploy/base/rbac.yaml`.
async fn apply_deploy_rbac(client: &Client) -> Result<()> {
    let path = workspace_root().join("deploy/base/rbac.yaml");
    let text = std::fs::read_to_string(&path)?;
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "flotilla-system"}}))?;
    let pp = PatchParams::apply("e2e-operator-rbac").force();
    Api::<Namespace>::all(client.clone())
        .patch("flotilla-system", &pp, &Patch::Apply(&ns))
        .await?;
    for doc in text.split("\n---\n") {
        let value: Value = serde_yaml::from_str(doc)?;
        let name = value["metadata"]["name"]
            .as_str()
            .context("a name")?
            .to_string();
        match value["kind"].as_str() {
            Some("ServiceAccount") => {
                let api: Api<ServiceAccount> = Api::namespaced(client.clone(), "flotilla-system");
                api.patch(&name, &pp, &Patch::Apply(&value)).await?;
            }
            Some("ClusterRole") => {
                let api: Api<ClusterRole> = Api::all(client.clone());
                api.patch(&name, &pp, &Patch::Apply(&value)).await?;
            }
            Some("ClusterRoleBinding") => {
                let api: Api<ClusterRoleBinding> = Api::all(client.clone());
                api.patch(&name, &pp, &Patch::Apply(&value)).await?;
            }
            Some("Role") => {
                let api: Api<Role> = Api::namespaced(client.clone(), "flotilla-system");
                api.patch(&name, &pp, &Patch::Apply(&value)).await?;
            }
            Some("RoleBinding") => {
                let api: Api<RoleBinding> = Api::namespaced(client.clone(), "flotilla-system");
                api.patch(&name, &pp, &Patch::Apply(&value)).await?;
            }
            other => bail!("unexpected {other:?} in {}", path.display()),
        }
    }
    Ok(())
}

/// Whether the agent's ServiceAccount may `verb` `resource` (`group/resource`).
async fn agent_may(client: &Client, verb: &str, group: &str, resource: &str) -> bool {
    let review: SubjectAccessReview = serde_json::from_value(json!({
        "spec": {"user": AGENT_SA, "groups": ["system:serviceaccounts", "system:authenticated"],
                 "resourceAttributes": {"verb": verb, "group": group, "resource": resource, "namespace": "default"}}
    }))
    .unwrap();
    let api: Api<SubjectAccessReview> = Api::all(client.clone());
    let answer = api.create(&PostParams::default(), &review).await.unwrap();
    answer.status.is_some_and(|s| s.allowed)
}

/// The operator runs as the agent's ServiceAccount with exactly the deploy RBAC, on the
/// host cluster (no agent runs there, so what happens is this operator's doing).
#[tokio::test]
async fn the_deploy_rbac_is_all_the_operator_needs() {
    let env = Env::load_ready().await.unwrap();
    let host = env.host().to_string();
    let admin = env.client(&host).await.unwrap();
    apply_deploy_rbac(&admin).await.unwrap();

    // The host's kubeconfig, impersonating the ServiceAccount.
    let mut kubeconfig: Value =
        serde_yaml::from_str(&std::fs::read_to_string(env.kubeconfig(&host).unwrap()).unwrap())
            .unwrap();
    for user in kubeconfig["users"].as_array_mut().unwrap() {
        user["user"]["as"] = json!(AGENT_SA);
    }
    let path = std::env::temp_dir().join(format!("flotilla-agent-sa-{}.yaml", std::process::id()));
    std::fs::write(&path, serde_yaml::to_string(&kubeconfig).unwrap()).unwrap();

    let crds = Api::<CustomResourceDefinition>::all(admin.clone());
    let previous = conversion_patch(&crds).await;
    let mut f = Fixture::new(env, host, "rbac").await;
    f.launch(&path).await;
    let result = async {
        // Written as v1alpha1: the CRD patch and the webhook work under this identity.
        let old: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "app.example.com/v1alpha1", "kind": "MyApp", "metadata": {"name": "web"},
            "spec": {"size": 2, "image": "nginx:1.27", "configData": {"k": "v"}}
        }))?;
        f.dynamic("v1alpha1")
            .create(&PostParams::default(), &old)
            .await?;
        f.try_ready("web", 2).await?;
        let deployments = f.api::<Deployment>();
        deployments
            .delete("web-deploy", &DeleteParams::default())
            .await?;
        f.try_ready("web", 2).await?;
        let events: Api<k8s_openapi::api::events::v1::Event> = f.api();
        let list = events.list(&ListParams::default()).await?;
        if !list
            .items
            .iter()
            .any(|e| e.reason.as_deref() == Some("DeploymentCreated"))
        {
            bail!("no DeploymentCreated Event");
        }
        Ok(())
    }
    .await;
    crds.patch(CRD, &PatchParams::default(), &Patch::Merge(previous))
        .await
        .unwrap();
    let _ = std::fs::remove_file(&path);
    result.unwrap();

    // ... and nothing it does not need.
    for (verb, group, resource) in [
        ("delete", "apps", "deployments"),
        ("update", "apps", "deployments"),
        ("get", "", "secrets"),
        ("create", "", "pods"),
        ("update", "app.example.com", "myapps"),
        ("patch", "apiextensions.k8s.io", "customresourcedefinitions"),
    ] {
        assert!(
            !agent_may(&f.client, verb, group, resource).await,
            "may {verb} {group}/{resource}"
        );
    }
    assert!(agent_may(&f.client, "patch", "app.example.com", "myapps").await);
}
