//! `flotilla-e2e demo`: the seed's FederatedMyApp, unchanged, applied on the host of a
//! running environment, and what each cluster then runs.

use std::time::Duration;

use anyhow::{Context, Result};
use flotilla_crds::{FederatedMyApp, MyApp};
use kube::api::{Api, Patch, PatchParams};

use crate::{Env, await_object};

const SEED: &str = include_str!("../../examples/federatedmyapp.yaml");

pub async fn demo(env: &Env) -> Result<()> {
    let host = env.client(env.host()).await?;
    let app: FederatedMyApp = serde_yaml::from_str(SEED)?;
    let name = app.metadata.name.clone().unwrap_or_default();
    let fedapps: Api<FederatedMyApp> = Api::namespaced(host, "default");
    fedapps
        .patch(
            &name,
            &PatchParams::apply("flotilla-e2e-demo").force(),
            &Patch::Apply(&app),
        )
        .await?;
    println!("applied FederatedMyApp default/{name} (the seed's example) on the host");
    let reported = |a: Option<&FederatedMyApp>| {
        a.and_then(|a| a.status.as_ref()).is_some_and(|s| {
            s.clusters.len() >= 2
                && s.clusters
                    .iter()
                    .all(|c| c.observed_generation.is_some() || !c.message.is_empty())
        })
    };
    let what = "the status of every placed cluster";
    let app = await_object(&fedapps, &name, Duration::from_secs(60), what, reported).await?;
    let status = app.and_then(|a| a.status).context("no status")?;
    for c in &status.clusters {
        let member: Api<MyApp> = Api::namespaced(env.client(&c.name).await?, "default");
        let replicas = member.get_opt(&name).await?.and_then(|a| a.spec.replicas);
        println!(
            "{}: MyApp replicas={} ready={} readyReplicas={} {}",
            c.name,
            replicas.map_or("-".into(), |r| r.to_string()),
            c.ready,
            c.ready_replicas,
            c.message
        );
    }
    for cond in &status.conditions {
        println!(
            "{} {}: {} ({})",
            cond.type_, cond.status, cond.reason, cond.message
        );
    }
    println!(
        "the seed names no image, so no pods run; give it one with:\n  kubectl --kubeconfig {} patch fma {name} --type merge -p '{{\"spec\":{{\"template\":{{\"spec\":{{\"image\":\"nginx:1.27\"}}}}}}}}'",
        env.kubeconfig(env.host())?.display()
    );
    Ok(())
}
