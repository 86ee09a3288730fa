//! The conversion webhook's CA, shared by the agent's replicas through a Secret (review
//! M9), on the lab's real apiserver: a second agent of cluster1 behind the same endpoint
//! (as two Pods behind one Service) serves with a certificate of the same CA, so the
//! CRD's `caBundle` holds whichever agent the apiserver reaches; neither its start, its
//! restart nor the first agent's restart rewrites the CRD; and `v1beta1` reads (each a
//! conversion) succeed throughout; with the Secret deleted, both agents started at once
//! agree on one new CA. Before the shared CA, the second agent published a CA
//! of its own and every conversion failed x509. Restarts an agent, so it runs alone (its
//! own test binary, one test). Needs a running environment (`cargo run -p flotilla-e2e -- up`).

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use flotilla_crds::FederatedMyApp;
use flotilla_lab::federation::{Federation, agent_name};
use flotilla_lab::support::{free_addr, http_get};
use flotilla_lab::{Env, HOST, await_object, wait_for};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams,
};
use kube::{Client, ResourceExt};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(60);
const MEMBER: &str = "cluster1";
const STANDBY: &str = "cluster1-agent-standby";
/// Reads per step, as the review's test: each lists MyApps at v1beta1 (stored as v1).
const READS: usize = 50;

/// The CA the MyApp CRD publishes, and the CRD's resourceVersion.
async fn published(member: &Client) -> Result<(Vec<u8>, String)> {
    let crd = Api::<CustomResourceDefinition>::all(member.clone())
        .get("myapps.app.example.com")
        .await?;
    let bundle = (crd.spec.conversion.as_ref())
        .and_then(|c| c.webhook.as_ref())
        .and_then(|w| w.client_config.as_ref())
        .and_then(|c| c.ca_bundle.as_ref())
        .context("the CRD has no caBundle")?
        .0
        .clone();
    Ok((bundle, crd.resource_version().unwrap_or_default()))
}

fn ca_of(secret: &Secret) -> Result<Vec<u8>> {
    Ok(secret
        .data
        .as_ref()
        .and_then(|d| d.get("ca.crt"))
        .context("the CA Secret has ca.crt")?
        .0
        .clone())
}

/// Whether a TLS client that trusts only `ca` accepts the webhook at `addr` (curl, which
/// exits 60 on a certificate it cannot verify; the empty review's answer is irrelevant).
fn trusted(env: &Env, ca: &[u8], addr: &str) -> Result<()> {
    let file = env.dir.join("webhook-ca-test.crt");
    std::fs::write(&file, ca)?;
    let out = std::process::Command::new("curl")
        .args(["-sS", "-o", "/dev/null", "-X", "POST", "--max-time", "10"])
        .args(["-H", "content-type: application/json", "-d", "{}"])
        .arg("--cacert")
        .arg(&file)
        .arg(format!("https://{addr}/convert"))
        .output()
        .context("running curl")?;
    ensure!(
        out.status.success(),
        "the webhook at {addr} under the Secret's CA: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

async fn reads_convert(member: &Client, step: &str) -> Result<()> {
    let gvk = GroupVersionKind::gvk("app.example.com", "v1beta1", "MyApp");
    let api: Api<DynamicObject> = Api::namespaced_with(
        member.clone(),
        "default",
        &ApiResource::from_gvk_with_plural(&gvk, "myapps"),
    );
    for i in 0..READS {
        let list = api
            .list(&Default::default())
            .await
            .with_context(|| format!("{step}: v1beta1 read {i} of {READS}"))?;
        ensure!(
            list.items.iter().any(|a| a.name_any() == "webhook-ca"),
            "{step}: the test's MyApp is not listed"
        );
    }
    Ok(())
}

/// Waits until the agent serving `/readyz` at `http` has its webhook up (published, or
/// found published): a standby is never ready, so the gate is read from the body.
async fn webhook_up(http: &str) -> Result<()> {
    wait_for(TIMEOUT, "the standby's webhook up", || async {
        let Ok((code, body)) = http_get(http, "/readyz").await else {
            return Ok(None);
        };
        Ok(
            (code == 200 || (body.contains("waiting for") && !body.contains("webhook")))
                .then_some(()),
        )
    })
    .await
}

#[tokio::test]
async fn the_agents_of_a_member_convert_with_one_ca() -> Result<()> {
    let env = Env::load_ready().await?;
    let f = Federation::load(&env)?;
    let host = env.client(HOST).await?;
    let member = env.client(MEMBER).await?;
    let agent = agent_name(MEMBER);
    let secret_ref = f
        .launch(&agent)?
        .arg("webhook-ca-secret")
        .context("the lab's agent names its CA Secret")?
        .to_owned();
    let (namespace, name) = secret_ref.split_once('/').context("NAMESPACE/NAME")?;
    let secrets = Api::<Secret>::namespaced(member.clone(), namespace);
    let ca = ca_of(&secrets.get(name).await?)?;

    let fedapps: Api<FederatedMyApp> = Api::namespaced(host.clone(), "default");
    let app = json!({"apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
        "metadata": {"name": "webhook-ca", "namespace": "default"},
        "spec": {"placement": {"clusters": [{"name": MEMBER}]},
                 "template": {"spec": {"replicas": 1, "image": "nginx:1.27"}}}});
    fedapps
        .patch("webhook-ca", &PatchParams::apply("e2e"), &Patch::Apply(app))
        .await?;
    await_object(
        &fedapps,
        "webhook-ca",
        TIMEOUT,
        "webhook-ca Ready",
        |a: Option<&FederatedMyApp>| {
            a.and_then(|a| a.status.as_ref())
                .is_some_and(|s| s.ready_clusters == 1)
        },
    )
    .await?;
    let before = published(&member).await?;
    ensure!(
        before.0 == ca,
        "the CRD publishes another CA than the Secret's"
    );
    reads_convert(&member, "one agent").await?;

    let result = async {
        // A second agent behind the same endpoint: its own listener, the first one's URL.
        let (http, webhook, scaler) = (free_addr()?, free_addr()?, free_addr()?);
        let start = || {
            f.start_variant(&env, &agent, STANDBY, |l| {
                l.set_arg("http-addr", Some(&http));
                l.set_arg("webhook-addr", Some(&webhook));
                l.set_arg("scaler-addr", Some(&scaler));
            })
        };
        let (standby, _) = start()?;
        webhook_up(&http).await?;
        ensure!(standby.alive(), "the standby exited");
        trusted(&env, &ca, &webhook)?;
        reads_convert(&member, "with a standby").await?;
        ensure!(
            published(&member).await? == before,
            "the standby rewrote the CRD"
        );

        // The standby restarts (its Pod deleted and re-created).
        f.stop(&env, STANDBY)?;
        start()?;
        webhook_up(&http).await?;
        trusted(&env, &ca, &webhook)?;
        reads_convert(&member, "after the standby's restart").await?;
        ensure!(
            published(&member).await? == before,
            "the standby's restart rewrote the CRD"
        );

        // The first agent restarts.
        f.restart(&env, &agent).await?;
        reads_convert(&member, "after the agent's restart").await?;
        ensure!(
            published(&member).await? == before,
            "the agent's restart rewrote the CRD"
        );

        // The Secret deleted (a new CA wanted) and both agents started at once: one
        // creates it, the other reads it (or meets the create's conflict and reads the
        // winner's); both serve from that one new CA, and the CRD publishes it.
        f.stop(&env, STANDBY)?;
        f.stop(&env, &agent)?;
        secrets.delete(name, &DeleteParams::default()).await?;
        let (standby, _) = start()?;
        f.start(&env, &agent)?;
        webhook_up(&http).await?;
        webhook_up(&f.launch(&agent)?.http).await?;
        ensure!(standby.alive(), "the standby exited");
        let new_ca = ca_of(&secrets.get(name).await?)?;
        ensure!(new_ca != ca, "the deleted Secret's CA came back");
        trusted(&env, &new_ca, &webhook)?;
        let first = f
            .launch(&agent)?
            .arg("webhook-addr")
            .context("--webhook-addr")?;
        trusted(&env, &new_ca, first)?;
        ensure!(
            trusted(&env, &ca, &webhook).is_err(),
            "the check cannot fail: the old CA vouches for the new certificate"
        );
        reads_convert(&member, "both started at once").await?;
        ensure!(
            published(&member).await?.0 == new_ca,
            "the CRD publishes another CA than the new Secret's"
        );
        Ok(())
    }
    .await;

    f.stop(&env, STANDBY)?;
    // The first agent leads again (the standby may have taken the Lease meanwhile).
    f.wait_ready(&agent).await?;
    fedapps
        .delete("webhook-ca", &DeleteParams::default())
        .await?;
    wait_for(TIMEOUT, "webhook-ca deleted", || async {
        Ok(fedapps.get_opt("webhook-ca").await?.is_none().then_some(()))
    })
    .await?;
    if let Err(e) = result {
        bail!("{e:#}");
    }
    Ok(())
}
