//! Credentials that expire and renew themselves (issue 20 item 3): with a hub issuing
//! tokens for seconds, an agent's session lives through several renewals with its
//! MemberCluster Ready throughout and no MyApp re-applied, re-created or deleted; the
//! agent, restarted, authenticates with the token it stored; a token past its expiry is
//! refused with the error naming `join --rotate`, which recovers the agent.
//! The hub's serving certificate, replaced on disk, is served to new connections without
//! a restart while the open sessions stay; a pair that does not load is not served.
//! They restart the hub and an agent, so they run alone (their own test binary) and one
//! at a time.
//! Needs a running environment (`cargo run -p flotilla-e2e -- up`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use flotilla_crds::{FederatedMyApp, MemberCluster, MyApp};
use flotilla_e2e::converge;
use flotilla_e2e::deletions::DeletionLog;
use flotilla_lab::federation::{self, Federation, HUB, agent_name, member_ready};
use flotilla_lab::support::sample;
use flotilla_lab::{Env, await_object, wait_for};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use sha2::{Digest, Sha256};

const CLUSTER: &str = "cluster1";
const APP: &str = "creds-steady";
/// The hub's token lifetime here: renewed with 3 s left, so every ~6 s.
const LIFETIME: &str = "9s";
const RENEWALS: f64 = 3.0;
const TIMEOUT: Duration = Duration::from_secs(60);
/// Both tests restart the hub.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn sha256(token: &str) -> String {
    hex::encode(Sha256::digest(token.trim().as_bytes()))
}

async fn member(host: &Client) -> Result<MemberCluster> {
    Ok(Api::<MemberCluster>::all(host.clone()).get(CLUSTER).await?)
}

/// The Ready condition's status and when it last changed.
fn ready(mc: &MemberCluster) -> Option<(String, Timestamp)> {
    let c = (mc.status.as_ref()?.conditions.iter()).find(|c| c.type_ == "Ready")?;
    Some((c.status.clone(), c.last_transition_time.0))
}

/// (MyApp uid and generation, Deployment uid) on each member `APP` is placed on: equal
/// before and after means nothing was deleted, re-created or re-applied with a change.
async fn fingerprint(env: &Env) -> Result<BTreeMap<String, (String, i64, String)>> {
    let mut out = BTreeMap::new();
    for m in ["cluster1", "cluster2"] {
        let c = env.client(m).await?;
        let app = Api::<MyApp>::namespaced(c.clone(), "default")
            .get(APP)
            .await?;
        let deploy = Api::<Deployment>::namespaced(c, "default")
            .get(&format!("{APP}-deploy"))
            .await?;
        out.insert(
            m.to_owned(),
            (
                app.uid().unwrap_or_default(),
                app.metadata.generation.unwrap_or_default(),
                deploy.uid().unwrap_or_default(),
            ),
        );
    }
    Ok(out)
}

async fn hub_metric(f: &Federation, series: &str) -> Result<f64> {
    Ok(sample(&f.metrics(HUB).await?, series))
}

fn sent(kind: &str) -> String {
    format!("flotilla_hub_messages_sent_total{{cluster=\"{CLUSTER}\",kind=\"{kind}\"}}")
}

fn renewals(result: &str) -> String {
    format!("flotilla_hub_token_renewals_total{{result=\"{result}\"}}")
}

fn log_of(env: &Env, f: &Federation, name: &str) -> Result<String> {
    let record = f.process(env, name)?;
    let path = record.log.with_context(|| format!("{name} has no log"))?;
    Ok(std::fs::read_to_string(path)?)
}

/// The hash on the MemberCluster is the stored token's, with nothing pending beside it.
async fn stored_token_is_current(host: &Client, token_file: &Path) -> Result<String> {
    let token = std::fs::read_to_string(token_file)?;
    let hash = sha256(&token);
    wait_for(
        TIMEOUT,
        "the stored token to be the MemberCluster's only one",
        || async {
            let spec = member(host).await?.spec;
            Ok((spec.token_sha256.as_deref() == Some(hash.as_str())
                && spec.next_token_sha256.is_none())
            .then_some(()))
        },
    )
    .await?;
    Ok(token.trim().to_owned())
}

#[tokio::test]
async fn tokens_renew_without_an_outage_and_expired_ones_are_refused() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let f = Federation::load(&env)?;
    let host = env.client(env.host()).await?;
    let cli = f.hub_cli(&env)?;
    let token_file = f
        .tokens
        .get(CLUSTER)
        .context("cluster1's token file")?
        .clone();
    let token_path = token_file.to_string_lossy().into_owned();
    let agent = agent_name(CLUSTER);
    let fedapps: Api<FederatedMyApp> = Api::namespaced(host.clone(), "default");
    fedapps
        .patch(
            APP,
            &PatchParams::apply("e2e-credentials"),
            &Patch::Apply(json!({
                "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
                "metadata": {"name": APP, "namespace": "default"},
                "spec": {"placement": {"clusters": [{"name": "cluster1"}, {"name": "cluster2"}]},
                         "template": {"spec": {"replicas": 1, "image": "nginx:1.27"}}}})),
        )
        .await?;

    let outcome = async {
        // A hub issuing 9 s tokens, and cluster1 rotated onto one.
        f.stop(&env, HUB)?;
        f.start_variant(&env, HUB, HUB, |l| {
            l.set_arg("token-lifetime", Some(LIFETIME))
        })?;
        f.wait_ready(HUB).await?;
        wait_for(
            TIMEOUT,
            "cluster1's agent connected to the new hub",
            || async { Ok((hub_metric(&f, &sent("sync_complete")).await? >= 1.0).then_some(())) },
        )
        .await?;
        let connected = hub_metric(&f, &sent("sync_complete")).await?;
        cli.run(&[
            "join",
            CLUSTER,
            "--rotate",
            "--token-lifetime",
            LIFETIME,
            "--token-file",
            &token_path,
        ])?;
        wait_for(
            TIMEOUT,
            "cluster1's agent back with the rotated token",
            || async {
                Ok((hub_metric(&f, &sent("sync_complete")).await? > connected).then_some(()))
            },
        )
        .await?;
        federation::wait_member_ready(&host, CLUSTER, true, TIMEOUT).await?;
        converge::wait_converged(&env, TIMEOUT).await?;
        let log = DeletionLog::start(&env).await?;
        let before = fingerprint(&env).await?;
        let ready_before =
            ready(&member(&host).await?).context("cluster1 has no Ready condition")?;
        ensure!(
            ready_before.0 == "True",
            "cluster1 is not Ready: {ready_before:?}"
        );
        let (syncs, applies) = (
            hub_metric(&f, &sent("sync_complete")).await?,
            hub_metric(&f, &sent("apply")).await?,
        );
        let renewed_before = hub_metric(&f, &renewals("renewed")).await?;
        let first_token = std::fs::read_to_string(&token_file)?;

        // Several renewals, watched: Ready never leaves True.
        let start = Instant::now();
        let mut tokens_seen = BTreeSet::from([sha256(&first_token)]);
        loop {
            let mc = member(&host).await?;
            ensure!(
                ready(&mc) == Some(ready_before.clone()),
                "cluster1's Ready changed during renewals: {:?} (was {ready_before:?})",
                ready(&mc)
            );
            tokens_seen.extend(mc.spec.token_sha256.clone());
            let renewed = hub_metric(&f, &renewals("renewed")).await? - renewed_before;
            if renewed >= RENEWALS {
                println!(
                    "{renewed} renewals in {:?}; {} distinct tokens seen",
                    start.elapsed(),
                    tokens_seen.len()
                );
                break;
            }
            ensure!(
                start.elapsed() < TIMEOUT,
                "only {renewed} renewals in {TIMEOUT:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Polled, so a renewal may fall between two looks; the counter above is exact.
        ensure!(
            tokens_seen.len() >= 2,
            "the token did not change: {tokens_seen:?}"
        );
        ensure!(
            hub_metric(&f, &sent("sync_complete")).await? == syncs,
            "the session was re-established during renewals (a new SyncComplete)"
        );
        ensure!(
            hub_metric(&f, &sent("apply")).await? == applies,
            "a MyApp was re-sent during renewals"
        );
        ensure!(
            hub_metric(&f, &renewals("failed")).await? == 0.0,
            "a renewal failed"
        );
        let token = stored_token_is_current(&host, &token_file).await?;
        ensure!(
            sha256(&token) != sha256(&first_token),
            "the token file was not renewed"
        );
        ensure!(
            fingerprint(&env).await? == before,
            "a MyApp or Deployment changed"
        );
        for name in [HUB, agent.as_str()] {
            let text = log_of(&env, &f, name)?;
            ensure!(!text.contains(&token), "{name}'s log shows the token");
            ensure!(
                !text.contains(first_token.trim()),
                "{name}'s log shows an old token"
            );
        }

        // Restarted, the agent authenticates with the token it stored.
        f.restart(&env, &agent).await?;
        wait_for(
            TIMEOUT,
            "cluster1's agent back with its stored token",
            || async { Ok((hub_metric(&f, &sent("sync_complete")).await? > syncs).then_some(())) },
        )
        .await?;
        federation::wait_member_ready(&host, CLUSTER, true, TIMEOUT).await?;
        ensure!(
            hub_metric(&f, &sent("apply")).await? == applies,
            "the restarted agent was re-sent a MyApp"
        );

        // Stopped until its token expired, the agent is refused, and says why.
        f.stop(&env, &agent)?;
        // A renewal in flight when it stopped may still settle: the later expiry counts.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let spec = member(&host).await?.spec;
        let expires = [spec.token_expires_at, spec.next_token_expires_at]
            .into_iter()
            .flatten()
            .map(|t| t.0)
            .max()
            .context("no tokenExpiresAt")?;
        let expired_refusals = "flotilla_hub_agent_refused_total{reason=\"token_expired\"}";
        let refused_before = hub_metric(&f, expired_refusals).await?;
        let wait = expires
            .duration_since(Timestamp::now())
            .as_secs_f64()
            .max(0.0)
            + 1.0;
        tokio::time::sleep(Duration::from_secs_f64(wait)).await;
        f.start(&env, &agent)?;
        wait_for(TIMEOUT, "the expired token refused", || async {
            Ok((hub_metric(&f, expired_refusals).await? > refused_before).then_some(()))
        })
        .await?;
        let text = log_of(&env, &f, &agent)?;
        ensure!(
            text.contains("expired")
                && text.contains(&format!("flotilla-hub join {CLUSTER} --rotate")),
            "the agent's log does not say its token expired and how to recover"
        );
        // Recovery: a new token, picked up by the running agent at its next dial.
        cli.run(&["join", CLUSTER, "--rotate", "--token-file", &token_path])?;
        federation::wait_member_ready(&host, CLUSTER, true, Duration::from_secs(90)).await?;
        converge::wait_converged(&env, TIMEOUT).await?;
        ensure!(
            fingerprint(&env).await? == before,
            "a MyApp or Deployment changed"
        );
        log.assert_clean(&BTreeSet::new())?;
        Ok(())
    }
    .await;

    // The environment as it was: the hub with its default lifetime, cluster1 connected.
    let restored = async {
        f.stop(&env, HUB)?;
        f.start(&env, HUB)?;
        f.wait_ready(HUB).await?;
        if f.process(&env, &agent).is_err() {
            f.start(&env, &agent)?;
        }
        if outcome.is_err() {
            cli.run(&["join", CLUSTER, "--rotate", "--token-file", &token_path])?;
        }
        federation::wait_member_ready(&host, CLUSTER, true, Duration::from_secs(90)).await?;
        fedapps.delete(APP, &DeleteParams::default()).await?;
        // Gone everywhere and every member back before the next suite starts: one that
        // begins while agents reconnect and a deletion is in flight sees both.
        let gone = |a: Option<&FederatedMyApp>| a.is_none();
        await_object(
            &fedapps,
            APP,
            TIMEOUT,
            "the credentials test's app deleted",
            gone,
        )
        .await?;
        for member in env.members() {
            federation::wait_member_ready(&host, member, true, TIMEOUT).await?;
        }
        anyhow::Ok(())
    }
    .await;
    outcome?;
    restored
}

/// The serial of the certificate in PEM `cert`, as openssl prints it (`serial=...`).
fn serial_of_file(cert: &Path) -> Result<String> {
    let out = std::process::Command::new("openssl")
        .args(["x509", "-noout", "-serial", "-in"])
        .arg(cert)
        .output()?;
    ensure!(out.status.success(), "openssl x509 -in {}", cert.display());
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The serial of the certificate the hub presents to a new connection at `addr`.
fn served_serial(addr: &str) -> Result<String> {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl s_client -connect {addr} -servername localhost -alpn h2 </dev/null 2>/dev/null | openssl x509 -noout -serial"
        ))
        .output()?;
    ensure!(out.status.success(), "no certificate from {addr}");
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Replaces `path` by `contents` in one step, as a Secret volume update does.
fn replace(path: &Path, contents: &[u8]) -> Result<()> {
    let temp = path.with_extension("new");
    std::fs::write(&temp, contents)?;
    std::fs::rename(&temp, path)?;
    Ok(())
}

async fn wait_served(addr: &str, serial: &str, what: &str) -> Result<()> {
    wait_for(TIMEOUT, what, || async {
        Ok((served_serial(addr).ok().as_deref() == Some(serial)).then_some(()))
    })
    .await
}

#[tokio::test]
async fn a_replaced_serving_certificate_is_served_without_a_restart() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let env = Env::load_ready().await?;
    let f = Federation::load(&env)?;
    let host = env.client(env.host()).await?;
    let launch = f.launch(HUB)?.clone();
    let addr = launch.arg("grpc-addr").context("--grpc-addr")?.to_owned();
    let cert = PathBuf::from(launch.arg("tls-cert").context("--tls-cert")?);
    let key = PathBuf::from(launch.arg("tls-key").context("--tls-key")?);
    let (old_cert, old_key) = (std::fs::read(&cert)?, std::fs::read(&key)?);
    let members: Vec<String> = env.members().iter().map(|m| m.to_string()).collect();
    let syncs = |m: &str| {
        format!("flotilla_hub_messages_sent_total{{cluster=\"{m}\",kind=\"sync_complete\"}}")
    };

    let outcome = async {
        f.stop(&env, HUB)?;
        f.start_variant(&env, HUB, HUB, |l| {
            l.set_arg("tls-reload-interval", Some("1s"))
        })?;
        f.wait_ready(HUB).await?;
        for m in &members {
            wait_for(TIMEOUT, &format!("{m}'s agent connected"), || async {
                Ok((hub_metric(&f, &syncs(m)).await? >= 1.0).then_some(()))
            })
            .await?;
            federation::wait_member_ready(&host, m, true, TIMEOUT).await?;
        }
        let old_serial = serial_of_file(&cert)?;
        ensure!(
            served_serial(&addr)? == old_serial,
            "the hub does not serve its certificate"
        );
        let mut before = BTreeMap::new();
        for m in &members {
            before.insert(m.clone(), hub_metric(&f, &syncs(m)).await?);
        }

        // Renewed from the lab's own CA, as an operator renews it (`certs --renew`).
        let fresh = env.dir.join("serving-renewed");
        std::fs::create_dir_all(&fresh)?;
        let lab_tls = cert.parent().context("the certificate's directory")?;
        for file in ["ca.crt", "ca.key"] {
            std::fs::copy(lab_tls.join(file), fresh.join(file))
                .with_context(|| format!("copying the lab's {file}"))?;
        }
        f.hub_cli(&env)?
            .run(&["certs", "--renew", "--out", &fresh.to_string_lossy()])?;
        ensure!(std::fs::read(fresh.join("ca.crt"))? == std::fs::read(lab_tls.join("ca.crt"))?);
        let new_serial = serial_of_file(&fresh.join("tls.crt"))?;
        ensure!(new_serial != old_serial);
        // Half a rotation: the new certificate beside the old key does not load.
        replace(&cert, &std::fs::read(fresh.join("tls.crt"))?)?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        ensure!(
            served_serial(&addr)? == old_serial,
            "a certificate without its key was served"
        );
        let log = log_of(&env, &f, HUB)?;
        ensure!(log.contains("do not load"), "the bad pair was not logged");
        // The whole pair: new connections get it, within the reload interval.
        replace(&key, &std::fs::read(fresh.join("tls.key"))?)?;
        let start = Instant::now();
        wait_served(&addr, &new_serial, "the new certificate served").await?;
        println!(
            "new certificate served {:?} after its key was written",
            start.elapsed()
        );
        // The open sessions stayed: no agent reconnected, every member Ready.
        for m in &members {
            ensure!(
                hub_metric(&f, &syncs(m)).await? == before[m],
                "{m}'s session was re-established by the certificate change"
            );
            ensure!(
                member_ready(&Api::<MemberCluster>::all(host.clone()).get(m).await?),
                "{m} is not Ready"
            );
        }
        // An agent dialling anew trusts the renewed certificate with the CA it has.
        let agent = flotilla_lab::federation::agent_name(&members[0]);
        f.restart(&env, &agent).await?;
        federation::wait_member_ready(&host, &members[0], true, TIMEOUT).await?;
        wait_for(TIMEOUT, "the restarted agent in session", || async {
            Ok((hub_metric(&f, &syncs(&members[0])).await? > before[&members[0]]).then_some(()))
        })
        .await?;
        // And back, the same way.
        replace(&cert, &old_cert)?;
        replace(&key, &old_key)?;
        wait_served(&addr, &old_serial, "the original certificate served again").await?;
        anyhow::Ok(())
    }
    .await;

    let restored = async {
        replace(&cert, &old_cert)?;
        replace(&key, &old_key)?;
        f.stop(&env, HUB)?;
        f.start(&env, HUB)?;
        f.wait_ready(HUB).await?;
        for m in &members {
            federation::wait_member_ready(&host, m, true, Duration::from_secs(90)).await?;
        }
        anyhow::Ok(())
    }
    .await;
    outcome?;
    restored
}
