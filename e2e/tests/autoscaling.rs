//! Nobody fights the autoscaler: the real HPA controller of kube-controller-manager scales
//! a federated MyApp (or its Deployment) in one member, and neither the hub, the agent nor
//! the operator writes those replicas while it does; the hub shows what the member runs;
//! deleting the HPA hands the replicas back to the federation.
//!
//! No metrics server runs here: the HPA controller clamps its target's replicas into
//! [minReplicas, maxReplicas] before it reads any metric, so an HPA whose minReplicas is
//! above the federation's assignment scales the target up all the same.
//!
//! The tests share the members and each ends with the convergence checker green and the
//! deletion log clean, so they run one at a time (a lock).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use flotilla_crds::{FederatedMyApp, HASH_ANNOTATION, MyApp};
use flotilla_e2e::converge;
use flotilla_e2e::deletions::DeletionLog;
use flotilla_lab::{Env, await_object, wait_for};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(90);
/// How long the autoscaled replicas are watched for a fight.
const WATCH: Duration = Duration::from_secs(60);
/// The federation's replicas for every cluster, and the HPA's floor above them.
const ASSIGNED: i32 = 2;
const HPA_MIN: i32 = 4;
const NS: &str = "default";

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What the HPA scales.
#[derive(Clone, Copy, Debug)]
enum Target {
    MyApp,
    Deployment,
}

struct Ctx {
    env: Env,
    host: Client,
    member: Client,
    name: String,
}

impl Ctx {
    async fn start(name: &str) -> Result<Ctx> {
        let env = Env::load_ready().await?;
        let host = env.client(env.host()).await?;
        let member = env.client("cluster1").await?;
        Ok(Ctx {
            env,
            host,
            member,
            name: name.into(),
        })
    }

    fn fedapps(&self) -> Api<FederatedMyApp> {
        Api::namespaced(self.host.clone(), NS)
    }

    fn myapps(&self) -> Api<MyApp> {
        Api::namespaced(self.member.clone(), NS)
    }

    /// The member's MyApps read and written at `version`.
    fn myapp_at(&self, version: &str) -> Api<DynamicObject> {
        let gvk = GroupVersionKind::gvk("app.example.com", version, "MyApp");
        let resource = ApiResource::from_gvk_with_plural(&gvk, "myapps");
        Api::namespaced_with(self.member.clone(), NS, &resource)
    }

    fn deployments(&self) -> Api<Deployment> {
        Api::namespaced(self.member.clone(), NS)
    }

    fn hpas(&self) -> Api<HorizontalPodAutoscaler> {
        Api::namespaced(self.member.clone(), NS)
    }

    fn deployment_name(&self) -> String {
        format!("{}-deploy", self.name)
    }

    /// Applies the FederatedMyApp as a GitOps tool would: the whole object, each time,
    /// with `replicas` in its template.
    async fn apply(&self, config: &str) -> Result<()> {
        let app = json!({
            "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
            "metadata": {"name": self.name, "namespace": NS},
            "spec": {
                "placement": {"clusters": [{"name": "cluster1"}, {"name": "cluster2"}]},
                "template": {"spec": {
                    "replicas": ASSIGNED, "image": "nginx:1.27", "config": {"app.conf": config}
                }},
            },
        });
        self.fedapps()
            .patch(
                &self.name,
                &PatchParams::apply("gitops").force(),
                &Patch::Apply(&app),
            )
            .await
            .with_context(|| format!("applying FederatedMyApp {}", self.name))?;
        Ok(())
    }

    /// The member's MyApp and Deployment replicas (`spec.replicas` of each).
    async fn replicas(&self) -> Result<(Option<i32>, Option<i32>)> {
        let app = self.myapps().get_opt(&self.name).await?;
        let deployment = self.deployments().get_opt(&self.deployment_name()).await?;
        Ok((
            app.and_then(|a| a.spec.replicas),
            deployment.and_then(|d| d.spec?.replicas),
        ))
    }

    async fn wait_replicas(&self, want: (i32, i32), what: &str) -> Result<()> {
        wait_for(TIMEOUT, what, || async {
            let now = self.replicas().await?;
            Ok((now == (Some(want.0), Some(want.1))).then_some(()))
        })
        .await
    }

    /// The field managers that own the member MyApp's `spec.replicas`.
    async fn replicas_owners(&self) -> Result<Vec<String>> {
        let app = self.myapps().get(&self.name).await?;
        Ok(app
            .managed_fields()
            .iter()
            .filter(|entry| {
                entry
                    .fields_v1
                    .as_ref()
                    .is_some_and(|f| f.0["f:spec"].get("f:replicas").is_some())
            })
            .filter_map(|entry| entry.manager.clone())
            .collect())
    }

    async fn create_hpa(&self, target: Target, min: i32) -> Result<()> {
        let target = match target {
            Target::MyApp => {
                json!({"apiVersion": "app.example.com/v1", "kind": "MyApp", "name": self.name})
            }
            Target::Deployment => {
                json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": self.deployment_name()})
            }
        };
        let hpa: HorizontalPodAutoscaler = serde_json::from_value(json!({
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": self.name, "namespace": NS},
            "spec": {"scaleTargetRef": target, "minReplicas": min, "maxReplicas": 6},
        }))?;
        self.hpas().create(&PostParams::default(), &hpa).await?;
        Ok(())
    }

    /// Samples the member every second for [`WATCH`] while `during` re-applies the
    /// FederatedMyApp; every sample must be `want`.
    async fn hold(&self, want: (i32, i32), during: impl Future<Output = Result<()>>) -> Result<()> {
        let sampling = async {
            let start = Instant::now();
            let mut samples = 0;
            while start.elapsed() < WATCH {
                let now = self.replicas().await?;
                if now != (Some(want.0), Some(want.1)) {
                    bail!(
                        "after {:.0?}: MyApp and Deployment replicas {now:?}, want {want:?}: something fought the autoscaler",
                        start.elapsed()
                    );
                }
                samples += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            println!("{}: {samples} samples, all {want:?}", self.name);
            Ok(())
        };
        tokio::try_join!(sampling, during)?;
        Ok(())
    }

    /// Re-applies the FederatedMyApp unchanged, then with its config changed, and waits
    /// until the member runs that change: the hub and the agent did reconcile.
    async fn reapply(&self) -> Result<()> {
        tokio::time::sleep(Duration::from_secs(5)).await;
        self.apply("v1").await?;
        tokio::time::sleep(Duration::from_secs(10)).await;
        let before = self.myapps().get(&self.name).await?;
        self.apply("v2").await?;
        let what = "the changed FederatedMyApp on cluster1";
        let changed = |a: Option<&MyApp>| {
            a.is_some_and(|a| {
                a.spec.config.get("app.conf").map(String::as_str) == Some("v2")
                    && a.annotations().get(HASH_ANNOTATION)
                        != before.annotations().get(HASH_ANNOTATION)
            })
        };
        await_object(&self.myapps(), &self.name, TIMEOUT, what, changed).await?;
        Ok(())
    }

    /// The hub's status for cluster1 shows what it runs and the autoscaler; cluster2
    /// runs the assignment.
    async fn hub_shows(&self, current: i32, autoscaled: bool) -> Result<Value> {
        let what = format!("status.clusters[cluster1].currentReplicas {current}");
        let app = await_object(
            &self.fedapps(),
            &self.name,
            TIMEOUT,
            &what,
            |a: Option<&FederatedMyApp>| {
                let Some(status) = a.and_then(|a| a.status.as_ref()) else {
                    return false;
                };
                let c1 = status.clusters.iter().find(|c| c.name == "cluster1");
                let c2 = status.clusters.iter().find(|c| c.name == "cluster2");
                c1.is_some_and(|c| {
                    c.current_replicas == Some(current) && c.autoscaler.is_some() == autoscaled
                }) && c2.is_some_and(|c| c.current_replicas == Some(ASSIGNED))
                    && status.current_replicas == Some(current + ASSIGNED)
            },
        )
        .await?;
        Ok(serde_json::to_value(
            app.context("no FederatedMyApp")?.status,
        )?)
    }

    async fn delete(&self) -> Result<()> {
        let _ = self
            .hpas()
            .delete(&self.name, &DeleteParams::default())
            .await;
        let _ = self
            .fedapps()
            .delete(&self.name, &DeleteParams::default())
            .await;
        let gone = |a: Option<&MyApp>| a.is_none();
        await_object(
            &self.myapps(),
            &self.name,
            TIMEOUT,
            "the MyApp collected",
            gone,
        )
        .await?;
        Ok(())
    }
}

/// The FederatedMyApp on both members at [`ASSIGNED`] replicas; an HPA on cluster1 with
/// `min` replicas at least, targeting `target`; what cluster1 must then run, held for
/// [`WATCH`] through two re-applies; the hub's view; the HPA deleted and the federation's
/// replicas back; everything converged and nothing deleted.
async fn autoscaled_then_handed_back(name: &str, target: Target, min: i32) -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let ctx = Ctx::start(name).await?;
    // Left by an earlier run that failed half-way.
    let _ = ctx.hpas().delete(name, &DeleteParams::default()).await;
    ctx.apply("v1").await?;
    ctx.wait_replicas(
        (ASSIGNED, ASSIGNED),
        "the federation's replicas on cluster1",
    )
    .await?;
    let log = DeletionLog::start(&ctx.env).await?;

    ctx.create_hpa(target, min).await?;
    let running = min.max(ASSIGNED);
    // The MyApp keeps the federation's replicas when the HPA scales its Deployment.
    let scaled = match target {
        Target::MyApp => (running, running),
        Target::Deployment => (ASSIGNED, running),
    };
    ctx.wait_replicas(scaled, "the HPA's replicas on cluster1")
        .await?;
    // The agent has seen the HPA once the hub shows it.
    ctx.hub_shows(running, true).await?;
    ctx.hold(scaled, ctx.reapply()).await?;
    let status = ctx.hub_shows(running, true).await?;
    println!("{name}: hub status {status}");
    let owners = ctx.replicas_owners().await?;
    println!("{name}: spec.replicas owned by {owners:?}");
    if let Target::MyApp = target {
        ensure!(
            !owners.is_empty() && !owners.iter().any(|o| o == "flotilla-agent"),
            "the MyApp's spec.replicas are owned by {owners:?}: want the HPA's or the agent's keeper only"
        );
    }

    ctx.hpas()
        .delete(&ctx.name, &DeleteParams::default())
        .await?;
    ctx.wait_replicas(
        (ASSIGNED, ASSIGNED),
        "the federation's replicas back on cluster1",
    )
    .await?;
    ctx.hub_shows(ASSIGNED, false).await?;

    let (report, took) = converge::wait_converged(&ctx.env, TIMEOUT).await?;
    println!(
        "{name}: converged pairs {}, in {took:.1?}",
        report.converged
    );
    log.assert_clean(&BTreeSet::new())?;
    ctx.delete().await
}

/// The HPA's floor is above the assignment: the HPA controller scales the MyApp through
/// `/scale` and owns `spec.replicas` from then on.
#[tokio::test]
async fn an_hpa_on_a_myapp_owns_its_replicas_until_it_goes() -> Result<()> {
    autoscaled_then_handed_back("autoscale-myapp", Target::MyApp, HPA_MIN).await
}

/// The HPA has not written anything (the assignment is within its bounds and no metrics
/// come): the agent's apply without `spec.replicas` must not reset them to 1, its keeper
/// holds them.
#[tokio::test]
async fn an_hpa_that_has_not_scaled_yet_gets_the_replicas_without_a_reset() -> Result<()> {
    autoscaled_then_handed_back("autoscale-quiet", Target::MyApp, 1).await
}

#[tokio::test]
async fn an_hpa_on_the_deployment_owns_its_replicas_until_it_goes() -> Result<()> {
    autoscaled_then_handed_back("autoscale-deploy", Target::Deployment, HPA_MIN).await
}

/// `/scale` answers at every served version (through the conversion webhook at v1beta1
/// and v1alpha1, whose replicas are `spec.size`), with the pods and their selector; a
/// hand-made scale of a MyApp no autoscaler owns is undone: the replicas are the
/// federation's.
#[tokio::test]
async fn scale_answers_at_every_version_and_a_hand_made_scale_is_undone() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let ctx = Ctx::start("autoscale-scale").await?;
    ctx.apply("v1").await?;
    ctx.wait_replicas(
        (ASSIGNED, ASSIGNED),
        "the federation's replicas on cluster1",
    )
    .await?;
    let selector = format!(
        "app.kubernetes.io/instance={},app.kubernetes.io/name=myapp",
        ctx.name
    );
    for version in ["v1", "v1beta1", "v1alpha1"] {
        let api = ctx.myapp_at(version);
        let what = format!("/scale at {version} with {ASSIGNED} pods");
        let scale = wait_for(TIMEOUT, &what, || async {
            let scale = api.get_scale(&ctx.name).await?;
            let pods = scale.status.as_ref().map(|s| s.replicas);
            Ok((pods == Some(ASSIGNED)).then_some(scale))
        })
        .await?;
        ensure!(
            scale.spec.as_ref().and_then(|s| s.replicas) == Some(ASSIGNED),
            "{version}: {scale:?}"
        );
        ensure!(
            scale.status.as_ref().and_then(|s| s.selector.as_deref()) == Some(selector.as_str()),
            "{version}: {scale:?}"
        );
    }
    let log = DeletionLog::start(&ctx.env).await?;
    let by_hand = json!({"spec": {"replicas": 3}});
    let scaled = ctx
        .myapp_at("v1alpha1")
        .patch_scale(&ctx.name, &PatchParams::default(), &Patch::Merge(&by_hand))
        .await
        .context("scaling through /scale at v1alpha1")?;
    ensure!(
        scaled.spec.as_ref().and_then(|s| s.replicas) == Some(3),
        "{scaled:?}"
    );
    ctx.wait_replicas((ASSIGNED, ASSIGNED), "the hand-made scale undone")
        .await?;
    converge::wait_converged(&ctx.env, TIMEOUT).await?;
    log.assert_clean(&BTreeSet::new())?;
    ctx.delete().await
}

/// The seed's KEDA external scaler (issue 22 item 3), asked as KEDA asks it: the lab's
/// agent of cluster1 serves `externalscaler.ExternalScaler` (`--scaler-addr`), and reads
/// the MyApp's Ready pods, found through the member's apiserver by the Deployment's
/// selector labels, at their pod IPs. The pods here are objects held unscheduled (a
/// scheduling gate) whose status says Ready at 127.0.0.x, where this test serves each
/// one's Prometheus text; no federation state is touched.
#[tokio::test]
async fn the_seed_s_external_scaler_reads_the_myapp_s_pods() -> Result<()> {
    use flotilla_proto::externalscaler::external_scaler_client::ExternalScalerClient;
    use flotilla_proto::externalscaler::{GetMetricsRequest, ScaledObjectRef};
    use k8s_openapi::api::core::v1::Pod;

    const APP: &str = "scaler-e2e";
    const METRIC: &str = "custom_metric_queue_length";
    let env = Env::load_ready().await?;
    let member = env.members()[0].to_string();
    let f = flotilla_lab::federation::Federation::load(&env)?;
    let addr = (f.launch(&flotilla_lab::federation::agent_name(&member))?)
        .arg("scaler-addr")
        .context("the lab's agent serves no external scaler")?
        .to_owned();
    let mut scaler = ExternalScalerClient::connect(format!("http://{addr}")).await?;

    // Two pods serving their queue lengths, and a third whose address answers nothing.
    let port = flotilla_lab::support::free_port()?;
    let (first, second) = (
        Exporter::start("127.0.0.1", port, 120).await?,
        Exporter::start("127.0.0.2", port, 90).await?,
    );
    let pods: Api<Pod> = Api::namespaced(env.client(&member).await?, NS);
    let names = ["scaler-e2e-0", "scaler-e2e-1", "scaler-e2e-2"];
    for (name, ip) in names.iter().zip(["127.0.0.1", "127.0.0.2", "127.0.0.3"]) {
        let _ = pods
            .delete(name, &DeleteParams::default().grace_period(0))
            .await;
        wait_for(TIMEOUT, "an old pod gone", || async {
            Ok(pods.get_opt(name).await?.is_none().then_some(()))
        })
        .await?;
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "myapp", "app.kubernetes.io/instance": APP}},
            "spec": {"schedulingGates": [{"name": "flotilla.io/e2e-held"}],
                     "containers": [{"name": "app", "image": "registry.example/app:1"}]},
        }))?;
        pods.create(&PostParams::default(), &pod).await?;
        let status = json!({"status": {"podIP": ip, "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": "True"}]}});
        pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await?;
    }
    let seed = |extra: &[(&str, &str)]| {
        let mut meta: std::collections::HashMap<String, String> = [
            ("scalerAddress", addr.as_str()),
            ("metricName", METRIC),
            ("threshold", "100"),
            ("myApp", APP),
        ]
        .iter()
        .chain(extra)
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        meta.insert("metricsPort".into(), port.to_string());
        ScaledObjectRef {
            name: "my-app-scaler".into(),
            namespace: NS.into(),
            scaler_metadata: meta,
        }
    };
    let outcome = async {
        let spec = scaler.get_metric_spec(seed(&[])).await?.into_inner().metric_specs;
        ensure!(spec.len() == 1 && spec[0].metric_name == METRIC && spec[0].target_size_float == 100.0, "{spec:?}");
        let metrics = |so: ScaledObjectRef| GetMetricsRequest { scaled_object_ref: Some(so), metric_name: format!("s0-{METRIC}") };
        let value = scaler.get_metrics(metrics(seed(&[]))).await?.into_inner().metric_values;
        ensure!(value.len() == 1 && value[0].metric_value_float == 210.0 && value[0].metric_name == format!("s0-{METRIC}"), "sum: {value:?}");
        let value = scaler.get_metrics(metrics(seed(&[("aggregation", "max")]))).await?.into_inner().metric_values;
        ensure!(value[0].metric_value_float == 120.0, "max: {value:?}");
        ensure!(scaler.is_active(seed(&[])).await?.into_inner().result, "active at 210");
        let mut stream = scaler.stream_is_active(seed(&[])).await?.into_inner();
        ensure!(stream.message().await?.is_some_and(|m| m.result), "the stream starts active");
        println!("external scaler: 2 of 3 Ready pods answered: sum 210, max 120, active");

        // The queues drain: inactive, and the stream says so once.
        first.set(0);
        second.set(0);
        let inactive = tokio::time::timeout(Duration::from_secs(30), stream.message()).await??;
        ensure!(inactive.is_some_and(|m| !m.result), "the stream turns inactive: {inactive:?}");
        ensure!(!scaler.is_active(seed(&[])).await?.into_inner().result, "inactive at 0");
        // A pod that stops being Ready is left out.
        second.set(50);
        let unready = json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}});
        pods.patch_status(names[1], &PatchParams::default(), &Patch::Merge(&unready)).await?;
        let value = scaler.get_metrics(metrics(seed(&[]))).await?.into_inner().metric_values;
        ensure!(value[0].metric_value_float == 0.0, "only the Ready pod counts: {value:?}");
        // Nothing to read is an error, not a zero; bad metadata names its key.
        let none = scaler.get_metrics(metrics(seed(&[("myApp", "no-such-app")]))).await.unwrap_err();
        ensure!(none.code() == tonic::Code::Unavailable && none.message().contains("no-such-app"), "{none:?}");
        let bad = scaler.get_metric_spec(seed(&[("threshold", "0")])).await.unwrap_err();
        ensure!(bad.code() == tonic::Code::InvalidArgument && bad.message().contains("threshold"), "{bad:?}");
        println!("external scaler: drained -> inactive (streamed); an unready pod left out; no pods -> Unavailable");
        Ok(())
    }
    .await;
    for name in names {
        let _ = pods
            .delete(name, &DeleteParams::default().grace_period(0))
            .await;
    }
    outcome
}

/// A pod's metrics endpoint: `custom_metric_queue_length` at a value the test sets.
struct Exporter {
    value: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Exporter {
    async fn start(ip: &str, port: u16, value: u64) -> Result<Exporter> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind((ip, port)).await?;
        let shared = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(value));
        let served = shared.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let value = served.load(std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut request = [0u8; 4096];
                    let _ = socket.read(&mut request).await;
                    let body = format!(
                        "# TYPE custom_metric_queue_length gauge\ncustom_metric_queue_length{{queue=\"jobs\"}} {value}\nother_metric 1\n"
                    );
                    let response = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = socket.write_all(response.as_bytes()).await;
                });
            }
        });
        Ok(Exporter {
            value: shared,
            task,
        })
    }

    fn set(&self, value: u64) {
        self.value.store(value, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Federated bounds (issue 22 item 4) over the three members: `spec.autoscaling` min 8,
/// max 16 at weights 2:1:1 gives each member's HPA 4..8, 2..4, 2..4, written by its
/// agent; each member's scaler, asked for one queue that all three drain
/// (`metricScope: federation`), hands its HPA its share of the reading, so the clusters
/// scale once together, not once each; cluster3 fails over and its bounds move to the
/// others (5..10, 3..6), where the real HPA controller scales cluster2 up to its new
/// floor; back, the bounds are as before. Nothing deleted, converged.
#[tokio::test]
async fn federated_bounds_follow_the_weights_and_move_on_failover() -> Result<()> {
    use flotilla_crds::bounds::SHARE_ANNOTATION;
    use flotilla_e2e::{THREE_MEMBERS, faults};
    use flotilla_lab::federation::{self, HEARTBEAT_GRACE, agent_name, wait_member_ready};

    const APP: &str = "fed-bounds";
    let _one = ONE_AT_A_TIME.lock().await;
    let (env, host, members) = flotilla_e2e::three_members("autoscaling").await?;
    let f = federation::up(&env).await?;
    let hpas = |m: &str| Api::<HorizontalPodAutoscaler>::namespaced(members[m].clone(), NS);
    let fedapps = Api::<FederatedMyApp>::namespaced(host.clone(), NS);
    // Each member brings its HPA on the MyApp, with bounds the agent replaces.
    for m in THREE_MEMBERS {
        let _ = hpas(m).delete(APP, &DeleteParams::default()).await;
        wait_for(TIMEOUT, "an old HPA gone", || async {
            Ok(hpas(m).get_opt(APP).await?.is_none().then_some(()))
        })
        .await?;
        let hpa: HorizontalPodAutoscaler = serde_json::from_value(json!({
            "metadata": {"name": APP, "namespace": NS},
            "spec": {"scaleTargetRef": {"apiVersion": "app.example.com/v1", "kind": "MyApp", "name": APP},
                     "minReplicas": 1, "maxReplicas": 1},
        }))?;
        hpas(m).create(&PostParams::default(), &hpa).await?;
    }
    let app = json!({
        "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
        "metadata": {"name": APP, "namespace": NS},
        "spec": {
            "placement": {
                "clusters": THREE_MEMBERS.iter().map(|m| json!({"name": m})).collect::<Vec<_>>(),
                "replicaScheduling": {"mode": "Weighted", "preferences": [{"clusterNames": ["cluster1"], "weight": 2}]},
                "failover": {"gracePeriodSeconds": 5, "onRecovery": "Rebalance"},
            },
            "autoscaling": {"minReplicas": 8, "maxReplicas": 16},
            "template": {"spec": {"image": "nginx:1.27"}},
        },
    });
    fedapps
        .patch(APP, &PatchParams::apply("e2e").force(), &Patch::Apply(&app))
        .await?;
    let bounds_are = |want: [Option<(i32, i32)>; 3]| {
        let hpas = &hpas;
        async move {
            wait_for(TIMEOUT, &format!("HPA bounds {want:?}"), || async {
                let mut have = Vec::new();
                for m in THREE_MEMBERS {
                    let spec = hpas(m)
                        .get(APP)
                        .await?
                        .spec
                        .context("an HPA without spec")?;
                    have.push((spec.min_replicas.unwrap_or(1), spec.max_replicas));
                }
                let matches = have
                    .iter()
                    .zip(want)
                    .all(|(h, w)| w.is_none_or(|w| *h == w));
                Ok(matches.then_some(()))
            })
            .await
        }
    };
    let log = DeletionLog::start(&env).await?;
    let outcome = async {
        bounds_are([Some((4, 8)), Some((2, 4)), Some((2, 4))]).await?;
        let mut shares = Vec::new();
        for m in THREE_MEMBERS {
            let member = Api::<MyApp>::namespaced(members[m].clone(), NS).get(APP).await?;
            shares.push(member.annotations().get(SHARE_ANNOTATION).cloned().unwrap_or_default());
        }
        ensure!(shares == ["8/16", "4/16", "4/16"], "metric shares {shares:?}");
        // The hub coalesces status writes (over a window that widens with its backlog), so
        // the status may follow the members by a moment.
        let shown = wait_for(TIMEOUT, "the bounds in the FederatedMyApp's status", || async {
            let status = fedapps.get(APP).await?.status.unwrap_or_default();
            let shown: Vec<_> = status.clusters.iter().map(|c| (c.min_replicas, c.replicas)).collect();
            let written = shown.len() == 3 && shown.iter().all(|(min, _)| min.is_some());
            Ok(written.then_some(shown))
        })
        .await?;
        ensure!(shown == [(Some(4), Some(8)), (Some(2), Some(4)), (Some(2), Some(4))], "status {shown:?}");
        println!("federated bounds: HPAs 4..8, 2..4, 2..4; metric shares {shares:?}");

        // The HPA controller clamps each MyApp into its bounds; then nothing moves while
        // the FederatedMyApp is applied again (GitOps) and every writer reconciles.
        let members_run = || async {
            let mut runs = Vec::new();
            for m in THREE_MEMBERS {
                let member = Api::<MyApp>::namespaced(members[m].clone(), NS).get(APP).await?;
                let hpa = hpas(m).get(APP).await?.spec.context("an HPA without spec")?;
                runs.push((member.spec.replicas, hpa.min_replicas, hpa.max_replicas));
            }
            anyhow::Ok(runs)
        };
        let settled = wait_for(TIMEOUT, "each member at its floor", || async {
            let runs = members_run().await?;
            let floors = runs.iter().map(|r| r.0).collect::<Vec<_>>();
            Ok((floors == [Some(4), Some(2), Some(2)]).then_some(runs))
        })
        .await?;
        let start = Instant::now();
        let mut samples = 0;
        while start.elapsed() < Duration::from_secs(20) {
            if samples % 8 == 4 {
                fedapps
                    .patch(APP, &PatchParams::apply("e2e").force(), &Patch::Apply(&app))
                    .await?;
            }
            let now = members_run().await?;
            ensure!(now == settled, "after {:.0?}: {now:?}, was {settled:?}", start.elapsed());
            samples += 1;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        println!("federated bounds: {samples} samples over 20 s with re-applies, all {settled:?}");

        global_metric_is_shared(&f, &members).await?;

        // cluster3 fails over: its bounds move, its HPA is left as it was.
        let agent = agent_name("cluster3");
        faults::sigkill(&env, &f, &agent)?;
        wait_member_ready(&host, "cluster3", false, HEARTBEAT_GRACE + Duration::from_secs(15)).await?;
        bounds_are([Some((5, 10)), Some((3, 6)), Some((2, 4))]).await?;
        let c2 = Api::<MyApp>::namespaced(members["cluster2"].clone(), NS);
        wait_for(TIMEOUT, "cluster2's HPA at its new floor of 3", || async {
            Ok((c2.get(APP).await?.spec.replicas == Some(3)).then_some(()))
        })
        .await?;
        println!("federated bounds: cluster3 failed over -> 5..10, 3..6; the HPA controller scaled cluster2 to 3");
        faults::start(&env, &f, &agent).await?;
        wait_member_ready(&host, "cluster3", true, TIMEOUT).await?;
        bounds_are([Some((4, 8)), Some((2, 4)), Some((2, 4))]).await?;
        let (report, took) = converge::wait_converged(&env, TIMEOUT).await?;
        println!("federated bounds: back; converged pairs {}, in {took:.1?}", report.converged);
        anyhow::Ok(())
    }
    .await;
    let restored = federation::up(&env).await;
    let cleaned = async {
        log.assert_clean(&BTreeSet::new())?;
        let _ = fedapps.delete(APP, &DeleteParams::default()).await;
        await_object(
            &fedapps,
            APP,
            TIMEOUT,
            "the FederatedMyApp gone",
            |a: Option<&FederatedMyApp>| a.is_none(),
        )
        .await?;
        for m in THREE_MEMBERS {
            let _ = hpas(m).delete(APP, &DeleteParams::default()).await;
        }
        anyhow::Ok(())
    }
    .await;
    outcome?;
    restored?;
    cleaned
}

/// One queue that every cluster's replicas drain: a held pod of the MyApp in each member
/// at one address, where one exporter serves the queue's length, 1,000. Each member's
/// scaler with `metricScope: federation` hands its HPA its share (8/16, 4/16, 4/16): at
/// a threshold of 100 the HPAs want 5 + 3 + 3 replicas together, not 10 each.
async fn global_metric_is_shared(
    f: &flotilla_lab::federation::Federation,
    members: &std::collections::BTreeMap<&'static str, Client>,
) -> Result<()> {
    use flotilla_proto::externalscaler::external_scaler_client::ExternalScalerClient;
    use flotilla_proto::externalscaler::{GetMetricsRequest, ScaledObjectRef};
    use k8s_openapi::api::core::v1::Pod;

    const APP: &str = "fed-bounds";
    const METRIC: &str = "custom_metric_queue_length";
    const QUEUE: &str = "127.0.0.9";
    let port = flotilla_lab::support::free_port()?;
    let _queue = Exporter::start(QUEUE, port, 1000).await?;
    let pod_name = "fed-bounds-queue-reader";
    let mut wanted = 0.0;
    let mut asked = Vec::new();
    for (m, client) in members {
        let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
        let _ = pods
            .delete(pod_name, &DeleteParams::default().grace_period(0))
            .await;
        wait_for(TIMEOUT, "an old pod gone", || async {
            Ok(pods.get_opt(pod_name).await?.is_none().then_some(()))
        })
        .await?;
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": pod_name, "labels": {"app.kubernetes.io/name": "myapp", "app.kubernetes.io/instance": APP}},
            "spec": {"schedulingGates": [{"name": "flotilla.io/e2e-held"}],
                     "containers": [{"name": "app", "image": "registry.example/app:1"}]},
        }))?;
        pods.create(&PostParams::default(), &pod).await?;
        let status = json!({"status": {"podIP": QUEUE, "podIPs": [{"ip": QUEUE}],
            "conditions": [{"type": "Ready", "status": "True"}]}});
        pods.patch_status(pod_name, &PatchParams::default(), &Patch::Merge(&status))
            .await?;
        let addr = (f.launch(&flotilla_lab::federation::agent_name(m))?)
            .arg("scaler-addr")
            .context("the lab's agent serves no external scaler")?
            .to_owned();
        let mut scaler = ExternalScalerClient::connect(format!("http://{addr}")).await?;
        let meta = [
            ("scalerAddress", addr.as_str()),
            ("metricName", METRIC),
            ("threshold", "100"),
            ("myApp", APP),
            ("aggregation", "max"),
            ("metricScope", "federation"),
        ];
        let mut meta: std::collections::HashMap<String, String> = meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        meta.insert("metricsPort".into(), port.to_string());
        let request = GetMetricsRequest {
            scaled_object_ref: Some(ScaledObjectRef {
                name: "queue".into(),
                namespace: NS.into(),
                scaler_metadata: meta,
            }),
            metric_name: format!("s0-{METRIC}"),
        };
        let value = scaler
            .get_metrics(request)
            .await?
            .into_inner()
            .metric_values;
        let value = value.first().context("no metric value")?.metric_value_float;
        wanted += (value / 100.0).ceil();
        asked.push(value);
        let _ = pods
            .delete(pod_name, &DeleteParams::default().grace_period(0))
            .await;
    }
    ensure!(
        asked == [500.0, 250.0, 250.0],
        "each scaler's share of 1000: {asked:?}"
    );
    println!(
        "federated bounds: one queue of 1000 read as {asked:?}: the HPAs want {wanted} replicas together, not 30"
    );
    Ok(())
}
