//! Host writes under load and across a hub failover, counted by the host apiserver itself
//! (`apiserver_request_total`), never by Flotilla.
//!
//! - `six_hundred_apps_under_host_load`: 600 FederatedMyApps placed on every member,
//!   applied at once while eight writers add 200 ConfigMaps each to the host. Every pair
//!   converges; no Lease of the hub or of an agent changes hands; no agent exits; the hub
//!   sends at most 1.05 Applies per pair; FederatedMyApp status writes stay a small
//!   multiple of the apps.
//! - `a_hub_failover_writes_no_status`: the leading hub is SIGKILLed and its standby
//!   takes over while every agent comes back within the heartbeat grace: the status
//!   writes that causes are at most the apps whose state really changed (none).
//!
//! Both take the whole environment (one at a time) and put it back as `up` left it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use flotilla_crds::FederatedMyApp;
use flotilla_e2e::converge;
use flotilla_e2e::deletions::DeletionLog;
use flotilla_e2e::faults;
use flotilla_lab::apiserver::{LeaseRef, Leases, Requests};
use flotilla_lab::federation::{self, Federation, HUB, HUB_NAMESPACE, agent_name};
use flotilla_lab::support::sample;
use flotilla_lab::{Env, process, wait_for};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How many apps the load test applies at once, and the host load beside them.
const LOAD_APPS: usize = 600;
const WRITERS: usize = 8;
const CONFIGMAPS_EACH: usize = 200;
/// What the host load writes: ConfigMaps of this many bytes, in this namespace.
const CONFIGMAP_BYTES: usize = 4096;
const LOAD_NAMESPACE: &str = "e2e-load";
/// FederatedMyApp status writes allowed per app while the apps converge: one per state
/// an app really passes through (planned, then for each member the Apply acknowledged and
/// the operator's first status), so `1 + 2 × members`. Coalescing usually writes fewer
/// (measured 3.11 per app on two members, 2026-12-04); a flapping hub wrote 16.
fn status_writes_allowed(members: usize) -> f64 {
    1.0 + 2.0 * members as f64
}
/// The Lease the agents elect on, in each member (`--lease-namespace=default`).
const AGENT_LEASE_NAMESPACE: &str = "default";

fn fedapps(host: &Client) -> Api<FederatedMyApp> {
    Api::namespaced(host.clone(), "default")
}

/// App `name` on every member, with no image: the operator reports it not Ready
/// (`ImageMissing`) and runs no pod, so the members' load is the MyApps themselves.
fn app(name: &str, members: &[String]) -> Value {
    let clusters: Vec<Value> = members.iter().map(|m| json!({"name": m})).collect();
    json!({
        "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"placement": {"clusters": clusters}, "template": {"spec": {"replicas": 1}}},
    })
}

async fn apply_apps(host: &Client, names: &[String], members: &[String]) -> Result<()> {
    let api = fedapps(host);
    let applied: Vec<Result<()>> = futures::stream::iter(names)
        .map(|name| {
            let (api, body) = (api.clone(), app(name, members));
            async move {
                let params = PatchParams::apply("e2e-load").force();
                api.patch(name, &params, &Patch::Apply(&body))
                    .await
                    .map(drop)
                    .with_context(|| format!("applying FederatedMyApp default/{name}"))
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    applied.into_iter().collect()
}

/// `writers` × `each` ConfigMaps created on the host, each writer one after another.
async fn host_load(host: Client, writers: usize, each: usize) -> Result<Duration> {
    let start = Instant::now();
    let namespaces: Api<Namespace> = Api::all(host.clone());
    let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": LOAD_NAMESPACE}});
    namespaces
        .patch(
            LOAD_NAMESPACE,
            &PatchParams::apply("e2e-load"),
            &Patch::Apply(&ns),
        )
        .await?;
    let api: Api<ConfigMap> = Api::namespaced(host, LOAD_NAMESPACE);
    let data = "x".repeat(CONFIGMAP_BYTES);
    let writers = (0..writers).map(|w| {
        let (api, data) = (api.clone(), data.clone());
        async move {
            for i in 0..each {
                let cm: ConfigMap = serde_json::from_value(json!({
                    "metadata": {"name": format!("load-{w}-{i}")},
                    "data": {"blob": data},
                }))?;
                api.create(&PostParams::default(), &cm).await?;
            }
            anyhow::Ok(())
        }
    });
    futures::future::try_join_all(writers).await?;
    Ok(start.elapsed())
}

/// The Applies the hub sent, over every cluster.
async fn applies_sent(f: &Federation, hub: &str, members: &[String]) -> Result<f64> {
    let metrics = f.metrics(hub).await?;
    Ok(members
        .iter()
        .map(|m| {
            sample(
                &metrics,
                &format!("flotilla_hub_messages_sent_total{{cluster=\"{m}\",kind=\"apply\"}}"),
            )
        })
        .sum())
}

/// The hub's Lease on the host and each agent's in its member.
async fn leases(env: &Env, host: &Client) -> Result<Vec<LeaseRef>> {
    let mut out = vec![LeaseRef {
        what: HUB.into(),
        client: host.clone(),
        namespace: HUB_NAMESPACE.into(),
        name: "flotilla-hub".into(),
    }];
    for m in env.members() {
        out.push(LeaseRef {
            what: agent_name(m),
            client: env.client(m).await?,
            namespace: AGENT_LEASE_NAMESPACE.into(),
            name: "flotilla-agent".into(),
        });
    }
    Ok(out)
}

/// Waits until the host has written no FederatedMyApp status for `quiet`; returns the
/// counts then.
async fn status_writes_settled(
    host: &Client,
    quiet: Duration,
    timeout: Duration,
) -> Result<Requests> {
    let start = Instant::now();
    let mut last = Requests::read(host).await?;
    let mut quiet_since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = Requests::read(host).await?;
        if now.since(&last).writes("federatedmyapps", "status") > 0 {
            quiet_since = Instant::now();
        }
        last = now;
        if quiet_since.elapsed() >= quiet {
            return Ok(last);
        }
        ensure!(
            start.elapsed() < timeout,
            "FederatedMyApp status writes did not stop for {quiet:?} within {timeout:?}"
        );
    }
}

/// Every app of `names` shows every member applied, for its current generation.
async fn statuses_applied(host: &Client, names: &BTreeSet<String>, members: usize) -> Result<()> {
    wait_for(
        Duration::from_secs(300),
        "every app's status shows every member applied",
        || async {
            let apps = fedapps(host).list(&ListParams::default()).await?;
            let done = apps
                .items
                .iter()
                .filter(|a| names.contains(&a.name_any()))
                .filter(|a| {
                    a.status.as_ref().is_some_and(|s| {
                        s.applied_clusters == members as i32
                            && s.observed_generation == a.metadata.generation
                    })
                })
                .count();
            Ok((done == names.len()).then_some(()))
        },
    )
    .await
}

async fn delete_apps(host: &Client, names: &BTreeSet<String>) -> Result<()> {
    let api = fedapps(host);
    for name in names {
        let _ = api.delete(name, &DeleteParams::default()).await;
    }
    wait_for(
        Duration::from_secs(300),
        "the test's FederatedMyApps deleted",
        || async {
            let left = api.list(&ListParams::default()).await?;
            Ok((!left.items.iter().any(|a| names.contains(&a.name_any()))).then_some(()))
        },
    )
    .await
}

#[tokio::test]
async fn six_hundred_apps_under_host_load() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let f = federation::up(&env).await?;
    let host = env.client(env.host()).await?;
    let members: Vec<String> = env.members().iter().map(|m| m.to_string()).collect();
    let names: Vec<String> = (0..LOAD_APPS).map(|i| format!("load-{i:04}")).collect();
    let pairs = (names.len() * members.len()) as f64;
    let agents: BTreeMap<String, process::ProcessRecord> = members
        .iter()
        .map(|m| Ok((m.clone(), f.process(&env, &agent_name(m))?)))
        .collect::<Result<_>>()?;
    let leases = Leases::watch(leases(&env, &host).await?).await?;
    let log = DeletionLog::start(&env).await?;
    let (applies_before, requests_before) = (
        applies_sent(&f, HUB, &members).await?,
        Requests::read(&host).await?,
    );

    let start = Instant::now();
    let load = tokio::spawn(host_load(host.clone(), WRITERS, CONFIGMAPS_EACH));
    apply_apps(&host, &names, &members).await?;
    let applied_in = start.elapsed();
    let outcome = async {
        let (_, converged_in) = converge::wait_converged(&env, Duration::from_secs(600)).await?;
        let load_took = load.await??;
        let set: BTreeSet<String> = names.iter().cloned().collect();
        statuses_applied(&host, &set, members.len()).await?;
        let settled = status_writes_settled(&host, Duration::from_secs(10), Duration::from_secs(180)).await?;
        let writes = settled.since(&requests_before);
        let applies = applies_sent(&f, HUB, &members).await? - applies_before;
        let status_writes = writes.writes("federatedmyapps", "status");
        let transitions = leases.transitions().await?;
        println!(
            "load: {} apps × {} members = {pairs} pairs, applied in {:.1}s, host load of {WRITERS} × {CONFIGMAPS_EACH} ConfigMaps took {:.1}s, converged in {:.1}s",
            names.len(),
            members.len(),
            applied_in.as_secs_f64(),
            load_took.as_secs_f64(),
            converged_in.as_secs_f64() + applied_in.as_secs_f64()
        );
        println!(
            "load: Applies {applies} for {pairs} pairs ({:.3} per pair); FederatedMyApp status writes {status_writes} ({:.2} per app); MemberCluster status writes {}",
            applies / pairs,
            status_writes as f64 / names.len() as f64,
            writes.writes("memberclusters", "status")
        );
        println!("load: Lease transitions {transitions:?}");
        println!("load: host writes by resource {:?}", writes.writes_by_resource());
        ensure!(applies <= 1.05 * pairs, "{applies} Applies for {pairs} pairs (bound 1.05 per pair)");
        let allowed = status_writes_allowed(members.len());
        ensure!(
            status_writes as f64 <= allowed * names.len() as f64,
            "{status_writes} FederatedMyApp status writes for {} apps (bound {allowed} per app)",
            names.len()
        );
        ensure!(
            transitions.values().all(|t| *t == 0),
            "Leases changed hands under load: {transitions:?}"
        );
        for (m, p) in &agents {
            let now = f.process(&env, &agent_name(m));
            ensure!(
                p.alive() && now.is_ok_and(|n| n.pid == p.pid),
                "the agent of {m} (PID {}) exited under load",
                p.pid
            );
        }
        log.assert_clean(&BTreeSet::new())
    }
    .await;
    let set: BTreeSet<String> = names.iter().cloned().collect();
    let cleaned = delete_apps(&host, &set).await;
    let _ = Api::<Namespace>::all(host.clone())
        .delete(LOAD_NAMESPACE, &DeleteParams::default())
        .await;
    outcome.and(cleaned)
}

/// What an app's status says, transition times aside: a write that changes this is a
/// real change of state.
fn state_of(app: &FederatedMyApp) -> Value {
    let mut status = serde_json::to_value(&app.status).unwrap_or_default();
    if let Some(conditions) = status.get_mut("conditions").and_then(Value::as_array_mut) {
        for c in conditions {
            c.as_object_mut().map(|c| c.remove("lastTransitionTime"));
        }
    }
    status
}

async fn states(host: &Client, names: &BTreeSet<String>) -> Result<BTreeMap<String, Value>> {
    let apps = fedapps(host).list(&ListParams::default()).await?;
    Ok(apps
        .items
        .iter()
        .filter(|a| names.contains(&a.name_any()))
        .map(|a| (a.name_any(), state_of(a)))
        .collect())
}

/// The standby hub's name, and the grace both hubs run with here: long enough for every
/// agent to come back (the environment's 6 s is shorter than an agent's reconnect backoff
/// after seconds of refused dials during the election).
const GRACE: &str = "40s";

#[tokio::test]
async fn a_hub_failover_writes_no_status() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let f = federation::up(&env).await?;
    let host = env.client(env.host()).await?;
    let members: Vec<String> = env.members().iter().map(|m| m.to_string()).collect();
    let names: BTreeSet<String> = (0..30).map(|i| format!("failover-writes-{i:02}")).collect();
    let mut standby = None;
    let outcome = async {
        f.stop(&env, HUB)?;
        f.start_variant(&env, HUB, HUB, |l| l.set_arg("heartbeat-grace", Some(GRACE)))?;
        f.wait_ready(HUB).await?;
        let (grpc, http) = (flotilla_lab::support::free_addr()?, flotilla_lab::support::free_addr()?);
        let (b, launch) = f.start_variant(&env, HUB, faults::STANDBY_HUB, |l| {
            l.http = http.clone();
            l.set_arg("grpc-addr", Some(&grpc));
            l.set_arg("http-addr", Some(&http));
            l.set_arg("leader-identity", Some(faults::STANDBY_HUB));
            l.set_arg("heartbeat-grace", Some(GRACE));
        })?;
        standby = Some(b);
        federation::wait_http_ok(faults::STANDBY_HUB, &launch.http, "/healthz").await?;
        let first = f.launch(HUB)?.arg("grpc-addr").context("--grpc-addr")?.to_owned();
        let service = faults::LeaderService::start(
            &env,
            vec![(HUB.into(), first), (faults::STANDBY_HUB.into(), grpc.clone())],
        )
        .await?;
        for m in &members {
            faults::agent_via(&env, &f, m, &service.proxy.addr.to_string()).await?;
        }
        let list: Vec<String> = names.iter().cloned().collect();
        apply_apps(&host, &list, &members).await?;
        converge::wait_converged(&env, Duration::from_secs(120)).await?;
        statuses_applied(&host, &names, members.len()).await?;
        let before = status_writes_settled(&host, Duration::from_secs(5), Duration::from_secs(60)).await?;
        let states_before = states(&host, &names).await?;
        let log = DeletionLog::start(&env).await?;

        let start = Instant::now();
        faults::sigkill(&env, &f, HUB)?;
        wait_for(Duration::from_secs(60), "the standby hub to lead", || async {
            let leader = faults::hub_leader(&host).await?;
            Ok((leader.as_deref() == Some(faults::STANDBY_HUB)).then_some(()))
        })
        .await?;
        let led_in = start.elapsed();
        wait_for(Duration::from_secs(90), "every agent synced with the new leader", || async {
            let metrics = flotilla_lab::support::http_get(&launch.http, "/metrics").await?.1;
            let synced = |m: &String| {
                sample(&metrics, &format!("flotilla_hub_messages_sent_total{{cluster=\"{m}\",kind=\"sync_complete\"}}")) >= 1.0
            };
            Ok(members.iter().all(synced).then_some(()))
        })
        .await?;
        let back_in = start.elapsed();
        // Long enough for the new leader to hear every agent and write what it would.
        let after = status_writes_settled(&host, Duration::from_secs(10), Duration::from_secs(120)).await?;
        let writes = after.since(&before);
        let states_after = states(&host, &names).await?;
        let changed = names
            .iter()
            .filter(|n| states_before.get(*n) != states_after.get(*n))
            .count() as u64;
        let (status_writes, member_writes) = (
            writes.writes("federatedmyapps", "status"),
            writes.writes("memberclusters", "status"),
        );
        println!(
            "failover: {} apps on {} members; the standby led {:.1}s after the SIGKILL, every agent back {:.1}s after it",
            names.len(),
            members.len(),
            led_in.as_secs_f64(),
            back_in.as_secs_f64()
        );
        println!(
            "failover: FederatedMyApp status writes {status_writes}, apps whose state changed {changed}, MemberCluster status writes {member_writes}; host writes {:?}",
            writes.writes_by_resource()
        );
        ensure!(
            status_writes <= changed,
            "the failover wrote {status_writes} FederatedMyApp statuses; only {changed} apps changed state"
        );
        converge::wait_converged(&env, Duration::from_secs(60)).await?;
        log.assert_clean(&BTreeSet::new())
    }
    .await;
    // Back to the environment as `up` left it: one hub with its own flags, agents direct.
    let back = async {
        if let Some(p) = standby {
            p.stop(Duration::from_secs(15))?;
            process::forget(&env.dir, faults::STANDBY_HUB)?;
        }
        f.stop(&env, HUB)?;
        faults::start(&env, &f, HUB).await?;
        for m in &members {
            faults::agent_direct(&env, &f, m).await?;
        }
        delete_apps(&host, &names).await
    }
    .await;
    outcome.and(back)
}
