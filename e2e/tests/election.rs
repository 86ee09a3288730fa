//! Leader election against the host's real kube-apiserver, with the real
//! `flotilla_common::leader::elect` and its default timings (lease duration 15 s, renew
//! deadline 10 s, retry period 2 s), candidates run in this process, each on its own
//! Lease in `default`:
//! - two candidates on a fresh Lease elect one; a killed (dropped) leader is replaced
//!   within lease duration + retry period;
//! - a leader whose calls are held up (its connection blackholed by a TCP proxy) for
//!   less than the renew deadline keeps the lead, and no one takes over; held up for
//!   longer, it stops leading before the standby starts;
//! - a leader whose runtime is held by other work past the renew deadline keeps the lead
//!   (the campaign has a thread of its own);
//! - a Lease changed by someone else is never overwritten (`resourceVersion`), and the
//!   leader stops at once;
//! - the FlowSchemas of `deploy/` put the hub's and the agent's Lease requests, and only
//!   those, in the apiserver's `leader-election` priority level.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use flotilla_common::leader::{self, LeaderArgs};
use flotilla_e2e::proxy::Proxy;
use flotilla_lab::support::workspace_root;
use flotilla_lab::{Env, wait_for};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::flowcontrol::v1::{FlowSchema, PriorityLevelConfiguration};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, ResourceExt};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const LEASE_DURATION: Duration = Duration::from_secs(15);
const RENEW_DEADLINE: Duration = Duration::from_secs(10);
const RETRY_PERIOD: Duration = Duration::from_secs(2);
/// For the calls of an attempt on a loaded machine.
const CALLS: Duration = Duration::from_secs(1);

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    leader: LeaderArgs,
}

/// The host's admin config (`via`: through a proxy listening there).
async fn host_config(env: &Env, via: Option<&Proxy>) -> Result<kube::Config> {
    let path = env.kubeconfig(env.host())?;
    let kubeconfig = Kubeconfig::read_from(path)?;
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    if let Some(proxy) = via {
        config.cluster_url = format!("https://{}", proxy.addr).parse()?;
    }
    Ok(config)
}

/// The apiserver's `host:port`, for a proxy in front of it.
async fn apiserver(env: &Env) -> Result<String> {
    let url = host_config(env, None).await?.cluster_url;
    url.authority()
        .map(|a| a.to_string())
        .context("the host's URL has no authority")
}

/// A Lease name of its own for each test run.
fn lease_name(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos();
    format!("election-{test}-{}-{nanos}", std::process::id())
}

/// One candidate, as the hub or the agent runs `elect`, with every change of its
/// `leading` logged.
struct Candidate {
    id: &'static str,
    leading: watch::Receiver<bool>,
    log: Arc<Mutex<Vec<(Instant, bool)>>>,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl Candidate {
    fn start(config: kube::Config, lease: &str, id: &'static str) -> Result<Candidate> {
        let args = Cli::try_parse_from([
            "election",
            "--leader-elect",
            "--lease-namespace=default",
            &format!("--lease-name={lease}"),
            &format!("--leader-identity={id}"),
        ])?
        .leader;
        let t = args.timings()?;
        ensure!(
            (t.lease_duration, t.renew_deadline, t.retry_period)
                == (LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD),
            "the defaults are client-go's: {t:?}"
        );
        let shutdown = CancellationToken::new();
        let (leading, campaign) = leader::elect(config, &args, leader::AGENT, shutdown.clone())?;
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut changes = leading.clone();
        let logged = log.clone();
        tokio::spawn(async move {
            while changes.changed().await.is_ok() {
                let now = *changes.borrow_and_update();
                logged.lock().push((Instant::now(), now));
            }
        });
        Ok(Candidate {
            id,
            leading,
            log,
            shutdown,
            task: tokio::spawn(campaign),
        })
    }

    fn leads(&self) -> bool {
        *self.leading.borrow()
    }

    /// The changes of `leading` since `since`.
    fn changes_since(&self, since: Instant) -> Vec<(Instant, bool)> {
        self.log
            .lock()
            .iter()
            .filter(|(at, _)| *at >= since)
            .copied()
            .collect()
    }

    /// When `leading` last became `value`.
    fn last(&self, value: bool) -> Option<Instant> {
        self.log
            .lock()
            .iter()
            .rev()
            .find(|(_, v)| *v == value)
            .map(|(at, _)| *at)
    }

    /// SIGKILL: the campaign is dropped where it stands, nothing is released.
    async fn kill(self) {
        self.task.abort();
        let _ = self.task.await;
    }

    /// SIGTERM: returns how long the campaign took to end.
    async fn stop(self) -> Result<Duration> {
        let start = Instant::now();
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .context("the campaign did not end at shutdown")??;
        Ok(start.elapsed())
    }
}

async fn wait_leads(c: &Candidate, within: Duration) -> Result<Instant> {
    wait_for(within, &format!("{} to lead", c.id), || async {
        Ok(c.leads().then(Instant::now))
    })
    .await
}

fn leases(host: &Client) -> Api<Lease> {
    Api::namespaced(host.clone(), "default")
}

async fn holder(host: &Client, lease: &str) -> Result<(String, String, i32)> {
    let l = leases(host).get(lease).await?;
    let spec = l.spec.clone().unwrap_or_default();
    Ok((
        spec.holder_identity.unwrap_or_default(),
        l.resource_version().unwrap_or_default(),
        spec.lease_transitions.unwrap_or_default(),
    ))
}

/// Waits for the next renewal of `lease` (a new resourceVersion); returns when it
/// started, by the `renewTime` the leader wrote (see [`renewed_at`]).
async fn next_renewal(host: &Client, lease: &str) -> Result<Instant> {
    let (_, version, _) = holder(host, lease).await?;
    wait_for(RETRY_PERIOD * 3, "a renewal", || async {
        let l = leases(host).get(lease).await?;
        if l.resource_version().unwrap_or_default() == version {
            return Ok(None);
        }
        renewed_at(&l).map(Some)
    })
    .await
}

/// When the renewal stored in `lease` started, on this process's monotonic clock: the
/// candidates run here, so the `renewTime` they wrote (the wall clock at the attempt's
/// start) converts exactly. Timing from when the test saw a renewal instead counts the
/// poll's lag too, up to a second on a loaded machine, which the bounds cannot absorb.
fn renewed_at(lease: &Lease) -> Result<Instant> {
    let stamp = lease
        .spec
        .as_ref()
        .and_then(|s| s.renew_time.as_ref())
        .with_context(|| format!("Lease {} has no renewTime", lease.name_any()))?;
    let written = std::time::SystemTime::from(stamp.0);
    let (wall, mono) = (std::time::SystemTime::now(), Instant::now());
    Ok(match wall.duration_since(written) {
        Ok(ago) => mono - ago,
        Err(ahead) => mono + ahead.duration(),
    })
}

/// Cuts `proxy` right after a renewal of `lease` started, well before the next attempt
/// (a retry period later), so that no attempt is in flight; returns the renewal's start.
/// A poll that saw the renewal late waits for the next one.
async fn cut_after_renewal(host: &Client, lease: &str, proxy: &Proxy) -> Result<Instant> {
    for _ in 0..5 {
        let renewed = next_renewal(host, lease).await?;
        if renewed.elapsed() < RETRY_PERIOD / 2 {
            proxy.blackhole();
            return Ok(renewed);
        }
    }
    bail!("five renewals of {lease} were each seen a second or more after they started")
}

/// The renewal stored in `lease` now, when it started (see [`renewed_at`]).
async fn last_renewal(host: &Client, lease: &str) -> Result<Instant> {
    renewed_at(&leases(host).get(lease).await?)
}

/// The environment, a client of the host, and a Lease name of this test's own.
async fn setup(test: &str) -> Result<(Env, Client, String)> {
    let env = Env::load_ready().await?;
    let host = env.client(env.host()).await?;
    Ok((env, host, lease_name(test)))
}

async fn remove(host: &Client, lease: &str) -> Result<()> {
    leases(host).delete(lease, &DeleteParams::default()).await?;
    Ok(())
}

#[tokio::test]
async fn two_candidates_elect_one_and_a_killed_leader_is_replaced_in_time() -> Result<()> {
    let (env, host, lease) = setup("handover").await?;
    let config = host_config(&env, None).await?;
    let a = Candidate::start(config.clone(), &lease, "a")?;
    let b = Candidate::start(config, &lease, "b")?;
    // Both race to create the Lease: one create wins, the other conflicts.
    wait_for(Duration::from_secs(10), "a leader", || async {
        Ok((a.leads() || b.leads()).then_some(()))
    })
    .await?;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(6) {
        ensure!(a.leads() != b.leads(), "exactly one leads");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (leader, standby) = if a.leads() { (a, b) } else { (b, a) };
    ensure!(leader.changes_since(start).is_empty() && standby.last(true).is_none());
    let (id, _, transitions) = holder(&host, &lease).await?;
    ensure!(id == leader.id, "the Lease names the leader: {id}");

    next_renewal(&host, &lease).await?;
    leader.kill().await;
    // A renewal sent just before the kill may still land: read the Lease once it has.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let renewed = last_renewal(&host, &lease).await?;
    // The standby's read that first sees the last renewal comes within a retry period
    // (plus its call); it takes over a lease duration after that read (plus its write).
    let bound = LEASE_DURATION + RETRY_PERIOD + CALLS * 2;
    let took = wait_leads(&standby, bound + Duration::from_secs(5))
        .await?
        .duration_since(renewed);
    println!(
        "election: the standby leads {:.1}s after the killed leader's last renewal (bound {bound:?})",
        took.as_secs_f64(),
    );
    ensure!(took <= bound, "took {took:?}");
    ensure!(took >= LEASE_DURATION, "took over early: {took:?}");
    let (id, _, after) = holder(&host, &lease).await?;
    ensure!(id == standby.id && after == transitions + 1, "{id} {after}");

    // SIGTERM: the campaign ends within 2 s and hands the Lease over at once.
    let stopped = standby.stop().await?;
    ensure!(
        stopped < Duration::from_secs(2),
        "stopping took {stopped:?}"
    );
    let (id, _, _) = holder(&host, &lease).await?;
    ensure!(id.is_empty(), "released at shutdown, held by {id:?}");
    remove(&host, &lease).await
}

#[tokio::test]
async fn held_up_renewals_change_nothing_before_the_renew_deadline() -> Result<()> {
    let (env, host, lease) = setup("held").await?;
    let proxy = Proxy::start(&apiserver(&env).await?).await?;
    let a = Candidate::start(host_config(&env, Some(&proxy)).await?, &lease, "a")?;
    wait_leads(&a, Duration::from_secs(10)).await?;
    let b = Candidate::start(host_config(&env, None).await?, &lease, "b")?;
    tokio::time::sleep(RETRY_PERIOD * 2).await;

    // Held up for 6 s, right after a renewal: less than the renew deadline.
    let (_, _, transitions) = holder(&host, &lease).await?;
    cut_after_renewal(&host, &lease, &proxy).await?;
    let cut = Instant::now();
    tokio::time::sleep(Duration::from_secs(6)).await;
    proxy.heal();
    next_renewal(&host, &lease).await?;
    tokio::time::sleep(RETRY_PERIOD * 3).await;
    ensure!(
        a.changes_since(cut).is_empty(),
        "{:?}",
        a.changes_since(cut)
    );
    ensure!(b.last(true).is_none(), "the standby never led");
    let (id, _, after) = holder(&host, &lease).await?;
    ensure!(id == "a" && after == transitions, "{id} {after}");
    println!("election: 6 s held up: no transition, the leader renews again");

    // Held up for longer: the leader stops at the renew deadline after its last
    // renewal, strictly before the standby starts.
    let renewed = cut_after_renewal(&host, &lease, &proxy).await?;
    let took_over = wait_leads(&b, LEASE_DURATION + RETRY_PERIOD + Duration::from_secs(5)).await?;
    proxy.heal();
    let stepped_down = a.last(false).context("the leader stepped down")?;
    let (down, over) = (stepped_down - renewed, took_over - renewed);
    println!(
        "election: held up for good: the leader stopped {:.1}s after its last renewal, \
         the standby led {:.1}s after it",
        down.as_secs_f64(),
        over.as_secs_f64()
    );
    ensure!(stepped_down < took_over, "two leaders");
    ensure!(
        down <= RENEW_DEADLINE + CALLS,
        "stepped down late: {down:?}"
    );
    // The cut may have caught the renewal's response: the leader then counts from the
    // renewal before it, a retry period (and a call's jitter) earlier.
    ensure!(
        down + RETRY_PERIOD + CALLS >= RENEW_DEADLINE,
        "stepped down early: {down:?}"
    );
    ensure!(over >= LEASE_DURATION, "took over early: {over:?}");
    // The old leader, reconnected, waits as a standby.
    tokio::time::sleep(RETRY_PERIOD * 3).await;
    ensure!(!a.leads() && b.leads());
    for c in [a, b] {
        c.stop().await?;
    }
    remove(&host, &lease).await
}

/// A hub whose runtime is busy (a thousand agents reconnecting at once) keeps the lead:
/// the campaign runs on a thread of its own. Both workers of this test's runtime are held
/// past the renew deadline, as CPU-bound work that never yields holds them; the leader
/// renews meanwhile and never steps down (it did, and closed every session, when the
/// campaign shared the runtime).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_runtime_does_not_cost_the_lead() -> Result<()> {
    let (env, host, lease) = setup("busy").await?;
    let leader = Candidate::start(host_config(&env, None).await?, &lease, "busy")?;
    wait_leads(&leader, Duration::from_secs(10)).await?;
    let (_, version, transitions) = holder(&host, &lease).await?;
    let since = Instant::now();
    let held = RENEW_DEADLINE + RETRY_PERIOD * 2;
    let hogs: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { std::thread::sleep(held) }))
        .collect();
    for hog in hogs {
        hog.await?;
    }
    let (id, renewed, after) = holder(&host, &lease).await?;
    tokio::time::sleep(RETRY_PERIOD * 2).await;
    ensure!(
        leader.changes_since(since).is_empty(),
        "the leader stepped down while the runtime was busy: {:?}",
        leader.changes_since(since)
    );
    ensure!(
        id == "busy" && after == transitions && renewed != version,
        "renewed by the campaign's own thread meanwhile: {id} {after} {renewed}"
    );
    println!(
        "election: runtime held for {:.0}s: no step-down, the Lease renewed meanwhile",
        held.as_secs_f64()
    );
    leader.stop().await?;
    remove(&host, &lease).await
}

#[tokio::test]
async fn a_lease_changed_by_someone_else_is_never_overwritten() -> Result<()> {
    let (env, host, lease) = setup("intruder").await?;
    let a = Candidate::start(host_config(&env, None).await?, &lease, "a")?;
    wait_leads(&a, Duration::from_secs(10)).await?;
    // Someone else writes the Lease, as a replica of another version might.
    let mut taken = leases(&host).get(&lease).await?;
    let spec = taken.spec.as_mut().context("spec")?;
    spec.holder_identity = Some("intruder".into());
    leases(&host)
        .replace(&lease, &PostParams::default(), &taken)
        .await?;
    let intruded = Instant::now();
    wait_for(RETRY_PERIOD + CALLS * 2, "the leader to stop", || async {
        Ok((!a.leads()).then_some(()))
    })
    .await?;
    // Its renewal was conditional on the version it wrote: the intruder's record stays
    // until it has not changed for the lease duration.
    tokio::time::sleep(LEASE_DURATION - RETRY_PERIOD * 3).await;
    let (id, _, _) = holder(&host, &lease).await?;
    ensure!(id == "intruder", "overwritten by {id}");
    let back = wait_leads(&a, RETRY_PERIOD * 4)
        .await?
        .duration_since(intruded);
    println!(
        "election: the intruder's Lease was left alone, taken back {:.1}s later",
        back.as_secs_f64()
    );
    ensure!(back >= LEASE_DURATION, "taken back early: {back:?}");
    a.stop().await?;
    remove(&host, &lease).await
}

/// What is asked, as a ServiceAccount.
#[derive(Clone, Copy)]
enum Ask<'a> {
    /// GET of the Lease of that name in `flotilla-system`.
    Lease(&'a str),
    /// LIST of MemberClusters.
    MemberClusters,
}

/// The UIDs of the FlowSchema and the priority level that classified `ask`, made as the
/// ServiceAccount `account` of `flotilla-system` (by impersonation). Flow control
/// classifies before authorization, so a refused request tells as well.
async fn classified(env: &Env, account: &str, ask: Ask<'_>) -> Result<(String, String)> {
    let mut config = host_config(env, None).await?;
    config.auth_info.impersonate = Some(format!("system:serviceaccount:flotilla-system:{account}"));
    let client = Client::try_from(config)?;
    let request = match ask {
        Ask::Lease(name) => kube::core::Request::new(
            "/apis/coordination.k8s.io/v1/namespaces/flotilla-system/leases",
        )
        .get(name, &Default::default()),
        Ask::MemberClusters => {
            kube::core::Request::new("/apis/core.kubefed.io/v1beta1/memberclusters")
                .list(&ListParams::default())
        }
    }?;
    let response = client.send(request.map(kube::client::Body::from)).await?;
    let header = |h: &str| {
        response
            .headers()
            .get(h)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .with_context(|| format!("no {h} in the response"))
    };
    Ok((
        header("x-kubernetes-pf-flowschema-uid")?,
        header("x-kubernetes-pf-prioritylevel-uid")?,
    ))
}

#[tokio::test]
async fn the_flowschemas_put_only_lease_requests_in_the_leader_election_level() -> Result<()> {
    let env = Env::load_ready().await?;
    let host = env.client(env.host()).await?;
    let schemas: Api<FlowSchema> = Api::all(host.clone());
    let levels: Api<PriorityLevelConfiguration> = Api::all(host.clone());
    let leader_election = levels.get("leader-election").await?.uid().context("uid")?;
    for (file, account) in [
        ("deploy/hub/flowschema.yaml", "flotilla-hub"),
        ("deploy/base/flowschema.yaml", "flotilla-agent"),
    ] {
        let path = workspace_root().join(file);
        let schema: FlowSchema = serde_yaml::from_str(&std::fs::read_to_string(&path)?)
            .with_context(|| format!("parsing {file}"))?;
        let name = schema.name_any();
        let applied = schemas
            .patch(
                &name,
                &PatchParams::apply("flotilla-e2e").force(),
                &Patch::Apply(&schema),
            )
            .await
            .with_context(|| format!("applying {file}"))?;
        let uid = applied.uid().context("uid")?;
        // The apiserver's flow control picks a new FlowSchema up within moments.
        let lease = Ask::Lease(account);
        wait_for(
            Duration::from_secs(30),
            &format!("{file} in effect"),
            || async {
                let got = classified(&env, account, lease).await?;
                Ok((got == (uid.clone(), leader_election.clone())).then_some(()))
            },
        )
        .await?;
        // Its other requests stay where they were.
        let (schema_uid, level) = classified(&env, account, Ask::MemberClusters).await?;
        ensure!(
            schema_uid != uid && level != leader_election,
            "{file}: a list of MemberClusters is in leader-election"
        );
        // And another account's Lease requests too.
        let (schema_uid, _) = classified(&env, "default", lease).await?;
        ensure!(
            schema_uid != uid,
            "{file}: matches the default ServiceAccount"
        );
        println!(
            "election: {file}: {account}'s Lease requests in leader-election, \
             its other requests and other accounts' not"
        );
    }
    // `up` applies the hub's (deploy/hub) on the host; the agent's belongs to members.
    schemas
        .delete("flotilla-agent-leader-election", &DeleteParams::default())
        .await?;
    Ok(())
}
