//! Propagation end to end, on the real host and member clusters with the real hub and
//! agents that `flotilla-e2e up` started. Each test uses its own FederatedMyApp names so
//! that the tests can run at once.

use std::time::Duration;

use anyhow::{Context, Result};
use flotilla_crds::{FederatedMyApp, HASH_ANNOTATION, MemberCluster, MyApp};
use flotilla_lab::federation::Federation;
use flotilla_lab::{Env, await_object};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

const SEED: &str = include_str!("../../examples/federatedmyapp.yaml");
const TIMEOUT: Duration = Duration::from_secs(60);

struct Clusters {
    host: Client,
    c1: Client,
    c2: Client,
}

async fn clusters() -> Result<Clusters> {
    let env = Env::load_ready().await?;
    Ok(Clusters {
        host: env.client("host").await?,
        c1: env.client("cluster1").await?,
        c2: env.client("cluster2").await?,
    })
}

fn fedapps(c: &Client) -> Api<FederatedMyApp> {
    Api::namespaced(c.clone(), "default")
}

fn myapps(c: &Client) -> Api<MyApp> {
    Api::namespaced(c.clone(), "default")
}

async fn apply(host: &Client, app: &Value) -> Result<()> {
    let name = app["metadata"]["name"].as_str().unwrap();
    fedapps(host)
        .patch(name, &PatchParams::apply("e2e").force(), &Patch::Apply(app))
        .await?;
    Ok(())
}

fn app(name: &str, placement: Value, spec: Value, overrides: Value) -> Value {
    json!({
        "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"placement": placement, "template": {"spec": spec}, "overrides": overrides},
    })
}

async fn merge(host: &Client, name: &str, patch: &Value) -> Result<()> {
    fedapps(host)
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

async fn replicas_on(c: &Client, name: &str, want: i32) -> Result<MyApp> {
    let app = await_object(
        &myapps(c),
        name,
        TIMEOUT,
        &format!("MyApp {name} with {want} replicas"),
        |a: Option<&MyApp>| a.is_some_and(|a| a.spec.replicas == Some(want)),
    )
    .await?;
    app.context("no MyApp")
}

async fn gone_from(c: &Client, name: &str) -> Result<()> {
    let what = format!("MyApp {name} gone");
    let gone = |a: Option<&MyApp>| a.is_none();
    await_object(&myapps(c), name, TIMEOUT, &what, gone).await?;
    Ok(())
}

async fn status_where(
    host: &Client,
    name: &str,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> Result<Value> {
    let status = |app: &FederatedMyApp| serde_json::to_value(&app.status).unwrap_or_default();
    let cond = |app: Option<&FederatedMyApp>| app.is_some_and(|a| check(&status(a)));
    let app = await_object(&fedapps(host), name, TIMEOUT, what, cond).await?;
    Ok(status(&app.context("no FederatedMyApp")?))
}

fn condition<'a>(status: &'a Value, type_: &str) -> Option<&'a Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

async fn delete_and_wait(host: &Client, name: &str) -> Result<()> {
    let api = fedapps(host);
    let _ = api.delete(name, &DeleteParams::default()).await;
    let what = format!("FederatedMyApp {name} deleted");
    let gone = |a: Option<&FederatedMyApp>| a.is_none();
    await_object(&api, name, TIMEOUT, &what, gone).await?;
    Ok(())
}

/// README's "Overrides by label": `examples/overrides.yaml` (an entry selecting the eu
/// clusters with the image helper, one taking a value from each cluster's region label,
/// one naming cluster1) lands on each member exactly as `flotilla-hub render` previews
/// it against the host's MemberClusters: the same content hash, image, replicas and
/// region label.
#[tokio::test]
async fn overrides_by_label_and_the_image_helper_land_as_render_previews() -> Result<()> {
    let env = Env::load_ready().await?;
    let c = clusters().await?;
    let name = "overrides-by-label";
    let mut app: Value = serde_yaml::from_str(include_str!("../../examples/overrides.yaml"))?;
    app["metadata"]["name"] = json!(name);

    // The apiserver refuses an entry with both targets (or neither), naming it.
    let mut both = app.clone();
    both["spec"]["overrides"][2]["clusterSelector"] = json!({});
    let refused = apply(&c.host, &both)
        .await
        .expect_err("both targets are refused");
    let said = refused.to_string();
    assert!(
        said.contains("spec.overrides[2]")
            && said.contains("set exactly one of clusterName and clusterSelector"),
        "{said}"
    );
    let mut both = app.clone();
    both["spec"]["overrides"][0]["image"]["registryFrom"] = json!({"clusterLabel": "mirror"});
    let refused = apply(&c.host, &both)
        .await
        .expect_err("registry twice is refused");
    let said = refused.to_string();
    assert!(
        said.contains("spec.overrides[0].image")
            && said.contains("set registry or registryFrom, not both"),
        "{said}"
    );

    let registered = Api::<MemberCluster>::all(c.host.clone())
        .list(&Default::default())
        .await?;
    let dir = env.dir.join("overrides-by-label");
    std::fs::create_dir_all(&dir)?;
    let (app_file, members_file) = (dir.join("app.yaml"), dir.join("members.yaml"));
    std::fs::write(&app_file, serde_yaml::to_string(&app)?)?;
    std::fs::write(&members_file, serde_yaml::to_string(&registered.items)?)?;
    let cli = flotilla_e2e::hub_cli(&env)?;
    let preview: Value = serde_json::from_str(&cli.run(&[
        "render",
        "-f",
        &app_file.to_string_lossy(),
        "--clusters",
        &members_file.to_string_lossy(),
        "-o",
        "json",
    ])?)?;

    apply(&c.host, &app).await?;
    let eu = "registry.eu.example.com/library/nginx";
    for member in env.members() {
        let previewed = &preview[member];
        let hash = previewed["metadata"]["annotations"][HASH_ANNOTATION].clone();
        let what = format!("MyApp {name} on {member} as previewed");
        let running = await_object(
            &myapps(&env.client(member).await?),
            name,
            TIMEOUT,
            &what,
            |a: Option<&MyApp>| {
                a.is_some_and(|a| {
                    a.annotations().get(HASH_ANNOTATION).map(|h| json!(h)) == Some(hash.clone())
                })
            },
        )
        .await?
        .context("no MyApp")?;
        let running = serde_json::to_value(&running)?;
        assert_eq!(running["spec"], previewed["spec"], "{member}");
        let region = flotilla_lab::federation::region_of(member);
        assert_eq!(running["metadata"]["labels"]["region"], region, "{member}");
        let (image, replicas) = match member {
            "cluster1" => (format!("{eu}:1.27.3"), 4),
            "cluster2" => ("nginx:1.27".to_owned(), 2),
            _ => (format!("{eu}:1.27"), 3),
        };
        assert_eq!(running["spec"]["image"], image, "{member}");
        assert_eq!(running["spec"]["replicas"], replicas, "{member}");
    }

    // A value from a label cluster2 lacks: cluster2 keeps what it runs and its status
    // names the label; cluster1 takes the change.
    app["spec"]["template"]["metadata"] = json!({"annotations": {"rev": "2"}});
    let overrides = app["spec"]["overrides"].as_array_mut().unwrap();
    overrides.push(json!({"clusterName": "cluster2", "clusterOverrides": [
        {"op": "add", "path": "/metadata/annotations/zone",
         "valueFrom": {"clusterLabel": "flotilla.example/zone"}}]}));
    apply(&c.host, &app).await?;
    let rev2 =
        |a: Option<&MyApp>| a.is_some_and(|a| a.annotations().get("rev").is_some_and(|r| r == "2"));
    await_object(&myapps(&c.c1), name, TIMEOUT, "cluster1 at rev 2", rev2).await?;
    let said = "MemberCluster cluster2 has no label flotilla.example/zone";
    let status = status_where(&c.host, name, "cluster2's missing label reported", |s| {
        s["clusters"].as_array().is_some_and(|a| {
            a.iter().any(|c| {
                c["name"] == "cluster2" && c["message"].as_str().unwrap_or("").contains(said)
            })
        })
    })
    .await?;
    let message = status["clusters"][1]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        message.contains("spec.overrides[3].clusterOverrides[0]"),
        "{message}"
    );
    let kept = myapps(&c.c2).get(name).await?;
    assert!(
        !kept.annotations().contains_key("rev"),
        "cluster2 keeps what it ran"
    );
    assert_eq!(kept.spec.workload.image.as_deref(), Some("nginx:1.27"));
    delete_and_wait(&c.host, name).await
}

#[tokio::test]
async fn seed_example_propagates_updates_and_reports_ready() -> Result<()> {
    let c = clusters().await?;
    let seed: Value = serde_yaml::from_str(SEED)?;
    apply(&c.host, &seed).await?;
    replicas_on(&c.c1, "my-app-sample", 3).await?;
    replicas_on(&c.c2, "my-app-sample", 5).await?;
    // Both MyApps applied: Propagated, with both clusters listed (not Ready: no image).
    let status = status_where(
        &c.host,
        "my-app-sample",
        "Propagated with both clusters",
        |s| {
            s["clusters"].as_array().is_some_and(|a| a.len() == 2)
                && condition(s, "Propagated").is_some_and(|c| c["status"] == "True")
        },
    )
    .await?;
    assert_eq!(status["clusters"][0]["name"], "cluster1");
    assert_eq!(status["clusters"][1]["name"], "cluster2");

    // The seed names no image: give it one, and it becomes Ready everywhere.
    let patch = json!({"spec": {"template": {"spec": {"image": "nginx:1.27"}}}});
    merge(&c.host, "my-app-sample", &patch).await?;
    let status = status_where(&c.host, "my-app-sample", "Ready", |s| {
        condition(s, "Ready").is_some_and(|c| c["status"] == "True")
    })
    .await?;
    assert_eq!(status["readyClusters"], 2);
    assert_eq!(status["clusters"][0]["readyReplicas"], 3);
    assert_eq!(status["clusters"][1]["readyReplicas"], 5);

    // The template's replicas reach cluster1; cluster2 keeps its override.
    let patch = json!({"spec": {"template": {"spec": {"replicas": 4}}}});
    merge(&c.host, "my-app-sample", &patch).await?;
    let one = replicas_on(&c.c1, "my-app-sample", 4).await?;
    assert_eq!(
        myapps(&c.c2).get("my-app-sample").await?.spec.replicas,
        Some(5)
    );

    // Changing the override changes cluster2 only.
    let mut changed = seed.clone();
    changed["spec"]["template"]["spec"] = json!({"replicas": 4, "image": "nginx:1.27"});
    changed["spec"]["overrides"][0]["clusterOverrides"][0]["value"] = json!(6);
    apply(&c.host, &changed).await?;
    replicas_on(&c.c2, "my-app-sample", 6).await?;
    let after = myapps(&c.c1).get("my-app-sample").await?;
    assert_eq!(
        after.metadata.generation, one.metadata.generation,
        "cluster1's MyApp was not touched"
    );

    delete_and_wait(&c.host, "my-app-sample").await?;
    // The finalizer held the FederatedMyApp until both members had deleted their copy.
    assert!(myapps(&c.c1).get_opt("my-app-sample").await?.is_none());
    assert!(myapps(&c.c2).get_opt("my-app-sample").await?.is_none());
    Ok(())
}

#[tokio::test]
async fn label_selector_places_and_removes() -> Result<()> {
    let c = clusters().await?;
    let members: Api<MemberCluster> = Api::all(c.host.clone());
    let label = |v: Value| json!({"metadata": {"labels": {"e2e-tier": v}}});
    members
        .patch(
            "cluster1",
            &PatchParams::default(),
            &Patch::Merge(&label(Value::Null)),
        )
        .await?;
    apply(
        &c.host,
        &app(
            "by-selector",
            json!({"clusterSelector": {"matchLabels": {"e2e-tier": "gold"}}}),
            json!({"replicas": 2, "image": "nginx:1.27"}),
            json!([]),
        ),
    )
    .await?;
    status_where(&c.host, "by-selector", "NoClusters", |s| {
        condition(s, "Ready").is_some_and(|c| c["reason"] == "NoClusters")
    })
    .await?;

    members
        .patch(
            "cluster1",
            &PatchParams::default(),
            &Patch::Merge(&label(json!("gold"))),
        )
        .await?;
    replicas_on(&c.c1, "by-selector", 2).await?;
    assert!(
        myapps(&c.c2).get_opt("by-selector").await?.is_none(),
        "cluster2 is not labelled"
    );

    members
        .patch(
            "cluster1",
            &PatchParams::default(),
            &Patch::Merge(&label(Value::Null)),
        )
        .await?;
    gone_from(&c.c1, "by-selector").await?;
    delete_and_wait(&c.host, "by-selector").await
}

#[tokio::test]
async fn deletion_with_and_without_orphan() -> Result<()> {
    let c = clusters().await?;
    let both = json!({"clusters": [{"name": "cluster1"}, {"name": "cluster2"}]});
    for name in ["del-plain", "del-orphan"] {
        apply(
            &c.host,
            &app(
                name,
                both.clone(),
                json!({"replicas": 1, "image": "nginx:1.27"}),
                json!([]),
            ),
        )
        .await?;
        replicas_on(&c.c1, name, 1).await?;
        replicas_on(&c.c2, name, 1).await?;
    }
    let orphan = json!({"metadata": {"annotations": {"kubefed.io/orphan": "true"}}});
    merge(&c.host, "del-orphan", &orphan).await?;

    delete_and_wait(&c.host, "del-plain").await?;
    for member in [&c.c1, &c.c2] {
        assert!(
            myapps(member).get_opt("del-plain").await?.is_none(),
            "deleted before the finalizer went"
        );
    }

    delete_and_wait(&c.host, "del-orphan").await?;
    for member in [&c.c1, &c.c2] {
        let kept = myapps(member).get("del-orphan").await?;
        assert!(
            !kept.labels().contains_key("app.kubernetes.io/managed-by"),
            "released, no longer managed"
        );
        assert_eq!(kept.spec.replicas, Some(1));
        myapps(member)
            .delete("del-orphan", &DeleteParams::default())
            .await?;
    }
    Ok(())
}

/// A MyApp changed by hand in a member, its content-hash annotation kept (so the hash
/// the agent reports says nothing changed), is noticed from its field managers and put
/// back by the hub's Apply, counted per cluster; a field the hub's MyApp does not set
/// cannot be taken back, and stays reported as drift on the FederatedMyApp.
#[tokio::test]
async fn a_myapp_changed_by_hand_in_a_member_is_put_back() -> Result<()> {
    let c = clusters().await?;
    let env = Env::load_ready().await?;
    // The hub's counter where the lab runs the hub as a process (its metrics address
    // is in the launch record); in real-node mode the hub is a Pod and the repair is
    // proven by the member's MyApp and the status alone.
    let f = (!env.real_nodes)
        .then(|| Federation::load(&env))
        .transpose()?;
    let repairs = || async {
        let Some(f) = &f else { return anyhow::Ok(None) };
        let metrics = f.metrics(flotilla_lab::federation::HUB).await?;
        let series = "flotilla_hub_drift_repairs_total{cluster=\"cluster1\"}";
        anyhow::Ok(Some(flotilla_lab::support::sample(&metrics, series)))
    };
    // A run that failed half-way leaves its app drifted: start from none.
    delete_and_wait(&c.host, "drift").await?;
    gone_from(&c.c1, "drift").await?;
    let before = repairs().await?;
    let both = json!({"clusters": [{"name": "cluster1"}, {"name": "cluster2"}]});
    let spec = json!({"replicas": 1, "image": "nginx:1.27"});
    apply(&c.host, &app("drift", both, spec, json!([]))).await?;
    replicas_on(&c.c1, "drift", 1).await?;
    status_where(&c.host, "drift", "propagated", |s| {
        condition(s, "Propagated").is_some_and(|c| c["status"] == "True")
    })
    .await?;

    let edit = PatchParams {
        field_manager: Some("kubectl-edit".into()),
        ..Default::default()
    };
    let image = |a: &MyApp| serde_json::to_value(&a.spec).unwrap_or_default()["image"].clone();
    let changed = json!({"spec": {"image": "nginx:edited-by-hand"}});
    myapps(&c.c1)
        .patch("drift", &edit, &Patch::Merge(&changed))
        .await?;
    await_object(
        &myapps(&c.c1),
        "drift",
        TIMEOUT,
        "the hand-edited image put back",
        |a: Option<&MyApp>| a.is_some_and(|a| image(a) == "nginx:1.27"),
    )
    .await?;
    let repaired = repairs().await?;
    anyhow::ensure!(repaired >= before, "the hub's metrics went away");
    anyhow::ensure!(
        f.is_none() || repaired > before,
        "no drift repair counted for cluster1"
    );

    let added = json!({"spec": {"config": {"added-by-hand": "x"}}});
    myapps(&c.c1)
        .patch("drift", &edit, &Patch::Merge(&added))
        .await?;
    // The image edit's report may still be the one status shows: wait for this one.
    let status = status_where(&c.host, "drift", "cluster1 reported drifted", |s| {
        condition(s, "Propagated").is_some_and(|c| {
            let message = c["message"].as_str().unwrap_or_default();
            c["reason"] == "Drifted" && message.contains("spec.config")
        })
    })
    .await?;
    let message = condition(&status, "Propagated").unwrap()["message"]
        .as_str()
        .unwrap_or_default();
    anyhow::ensure!(
        message.contains("cluster1: ")
            && message.contains("spec.config by kubectl-edit")
            && !message.contains("cluster2"),
        "{message}"
    );
    delete_and_wait(&c.host, "drift").await?;
    gone_from(&c.c1, "drift").await
}

#[tokio::test]
async fn an_invalid_override_is_reported_for_its_cluster_only() -> Result<()> {
    let c = clusters().await?;
    let both = json!({"clusters": [{"name": "cluster1"}, {"name": "cluster2"}]});
    let overrides = json!([{"clusterName": "cluster2", "clusterOverrides": [{"path": "/spec/replicas", "value": 11}]}]);
    apply(
        &c.host,
        &app(
            "bad-override",
            both,
            json!({"replicas": 2, "image": "nginx:1.27"}),
            overrides,
        ),
    )
    .await?;
    replicas_on(&c.c1, "bad-override", 2).await?;
    let status = status_where(&c.host, "bad-override", "cluster2 reported", |s| {
        s["clusters"].as_array().is_some_and(|a| {
            a.iter()
                .any(|c| c["name"] == "cluster2" && !c["message"].as_str().unwrap_or("").is_empty())
        })
    })
    .await?;
    let message = status["clusters"][1]["message"].as_str().unwrap();
    assert!(
        message.contains("/spec/replicas")
            && message.contains("spec.overrides[0].clusterOverrides[0]"),
        "{message}"
    );
    assert_eq!(
        condition(&status, "Propagated").unwrap()["reason"],
        "RenderFailed"
    );
    assert!(myapps(&c.c2).get_opt("bad-override").await?.is_none());

    let event =
        flotilla_lab::wait_event(&c.host, "default", "bad-override", "RenderFailed", TIMEOUT)
            .await?;
    assert!(
        event
            .message
            .unwrap_or_default()
            .starts_with("cluster cluster2: ")
    );
    delete_and_wait(&c.host, "bad-override").await
}

/// A MyApp that Flotilla does not manage is never taken over: the hub's Apply is refused
/// by the agent and shown for that cluster, the object stays as its owner wrote it, and
/// deleting the FederatedMyApp leaves it alone and does not hang.
#[tokio::test]
async fn a_myapp_someone_else_owns_is_left_alone() -> Result<()> {
    let c = clusters().await?;
    let name = "owned-elsewhere";
    let theirs: MyApp = serde_json::from_value(json!({
        "apiVersion": "app.example.com/v1", "kind": "MyApp",
        "metadata": {"name": name, "namespace": "default", "labels": {"owner": "someone-else"}},
        "spec": {"replicas": 1, "image": "nginx:1.25"},
    }))?;
    myapps(&c.c1)
        .patch(
            name,
            &PatchParams::apply("someone-else"),
            &Patch::Apply(&theirs),
        )
        .await?;
    apply(
        &c.host,
        &app(
            name,
            json!({"clusters": [{"name": "cluster1"}]}),
            json!({"replicas": 4, "image": "nginx:1.27"}),
            json!([]),
        ),
    )
    .await?;
    let status = status_where(&c.host, name, "ApplyFailed naming the owner", |s| {
        condition(s, "Propagated").is_some_and(|c| {
            c["reason"] == "ApplyFailed"
                && c["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("does not manage"))
        })
    })
    .await?;
    assert!(
        status["clusters"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("left alone")),
        "{status}"
    );
    let kept = myapps(&c.c1).get(name).await?;
    assert_eq!(kept.spec.replicas, Some(1));
    assert_eq!(kept.spec.workload.image.as_deref(), Some("nginx:1.25"));
    assert!(!kept.labels().contains_key("app.kubernetes.io/managed-by"));

    delete_and_wait(&c.host, name).await?;
    let after = myapps(&c.c1).get(name).await?;
    assert_eq!(
        after.metadata.uid, kept.metadata.uid,
        "the owner's MyApp was deleted"
    );
    myapps(&c.c1).delete(name, &DeleteParams::default()).await?;
    Ok(())
}

/// `kubectl wait --for=condition=Ready` on the host, the way GitOps tools and scripts
/// tell a rollout is done.
fn kubectl_wait(env: &Env, name: &str, condition: &str) -> Result<()> {
    let kubeconfig = env.kubeconfig(env.host())?;
    let out = std::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["-n", "default", "wait", "--timeout=60s"])
        .arg(format!("--for=condition={condition}"))
        .arg(format!("fma/{name}"))
        .output()
        .context("running kubectl wait")?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl wait --for=condition={condition} fma/{name}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// kstatus's reading: `Ready` only once every placed cluster runs the current version
/// Ready (so `kubectl wait` right after a change waits for the change), `Stalled` when a
/// cluster's override cannot be rendered, and `Reconciling` in between.
#[tokio::test]
async fn kubectl_wait_ready_waits_for_every_cluster_to_run_the_new_version() -> Result<()> {
    let env = Env::load_ready().await?;
    let c = clusters().await?;
    let name = "gitops-health";
    let both = json!({"clusters": [{"name": "cluster1"}, {"name": "cluster2"}]});
    let spec = |image: &str| json!({"replicas": 2, "image": image});
    apply(
        &c.host,
        &app(name, both.clone(), spec("nginx:1.27"), json!([])),
    )
    .await?;
    kubectl_wait(&env, name, "Ready")?;

    // Right after the change the old Ready is still there, at the old generation:
    // `kubectl wait` must not take it.
    apply(
        &c.host,
        &app(name, both.clone(), spec("nginx:1.28"), json!([])),
    )
    .await?;
    kubectl_wait(&env, name, "Ready")?;
    for member in [&c.c1, &c.c2] {
        let running = myapps(member).get(name).await?;
        assert_eq!(running.spec.workload.image.as_deref(), Some("nginx:1.28"));
        let status = running.status.context("no MyApp status")?;
        assert!(status.ready, "Ready on the host, so Ready on every member");
        assert_eq!(status.observed_generation, running.metadata.generation);
    }
    let status = status_where(&c.host, name, "settled", |_| true).await?;
    assert_eq!(
        condition(&status, "Reconciling").unwrap()["status"],
        "False"
    );
    assert_eq!(condition(&status, "Stalled").unwrap()["status"], "False");

    // An override that cannot apply to cluster2: it keeps 1.28, the app is Stalled and
    // not Ready.
    let bad = json!([{"clusterName": "cluster2", "clusterOverrides": [{"path": "/spec/replicas", "value": 11}]}]);
    apply(&c.host, &app(name, both, spec("nginx:1.29"), bad)).await?;
    kubectl_wait(&env, name, "Stalled")?;
    let status = status_where(&c.host, name, "stalled", |_| true).await?;
    assert_eq!(
        condition(&status, "Ready").unwrap()["reason"],
        "RenderFailed"
    );
    assert_eq!(
        condition(&status, "Stalled").unwrap()["reason"],
        "RenderFailed"
    );
    let kept = myapps(&c.c2).get(name).await?;
    assert_eq!(kept.spec.workload.image.as_deref(), Some("nginx:1.28"));
    delete_and_wait(&c.host, name).await
}
