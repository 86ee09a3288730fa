//! Leader election on a `coordination.k8s.io` Lease, for the hub and for the agent: a
//! small port of client-go's `leaderelection` (see `decide` for the rules, `campaign`
//! for the loop, `lease` for the calls).
//!
//! Hub: one hub leads: it serves agents and writes to the host. The others stay warm
//! (stores listed, index rendered) and take over when the Lease expires. With
//! `POD_NAME`/`POD_NAMESPACE` set, the hub keeps the label `flotilla.io/leader` on its
//! own Pod equal to `leading`, which the gRPC Service selects, so agents reach the
//! leader only.
//!
//! Agent: one agent per member cluster is active (a Deployment scaled to 2, a copied
//! install): the others wait for the Lease and touch nothing.
//!
//! Use: `let (leading, campaign) = leader::elect(config, &args, leader::HUB, shutdown)?;`
//! — `leading` is a `watch::Receiver<bool>` (true only while this process holds the
//! Lease; always true without `--leader-elect`); `campaign` is a future that ends when
//! `shutdown` fires (after releasing the Lease, within a second) and is a critical task
//! otherwise. Run work only while leading with [`while_leading`].
//!
//! Timings (client-go's, and its defaults): the leader renews every `--lease-retry-period`
//! (2 s), each attempt bounded by half the renew deadline; failed attempts are retried
//! every retry period; it stops leading only when `--lease-renew-deadline` (10 s) has
//! passed since the start of its last successful renewal; a standby takes over once the
//! Lease has not changed for `--lease-duration` (15 s) on its own clock. So `leading`
//! turns false at least lease duration − renew deadline (5 s) before anyone else may
//! lead, and a dead leader is replaced within lease duration + retry period.
//!
//! The election's client has no retry layer (kube's default retries 429/503/504 for
//! minutes) and read, write and connect timeouts of one attempt; every write is
//! conditional on the `resourceVersion` read. Its metrics (`flotilla_leader_*`) are
//! in every registry that `crate::metrics::Metrics` builds.

mod acting;
mod campaign;
mod decide;
mod lease;
mod metrics;
#[cfg(test)]
mod sim;

use std::time::Duration;

use futures::FutureExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::warn;

pub use acting::{NotStopped, while_leading};
pub use decide::Timings;
pub use metrics::register as register_metrics;

/// The label on hub Pods that routes agents: `"true"` on the leader only.
pub const LEADER_LABEL: &str = "flotilla.io/leader";

/// Who campaigns: the default Lease name, and whether the leader labels its Pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Role {
    pub lease: &'static str,
    pub label_pod: bool,
}

pub const HUB: Role = Role {
    lease: "flotilla-hub",
    label_pod: true,
};

pub const AGENT: Role = Role {
    lease: "flotilla-agent",
    label_pod: false,
};

#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
pub struct LeaderArgs {
    /// Elect one active replica through a Lease (one leading hub; one active agent per
    /// member cluster); without it this process is active at once.
    #[arg(long, env = "FLOTILLA_LEADER_ELECT")]
    pub leader_elect: bool,
    /// Namespace of the Lease (and of this process's Pod).
    #[arg(long, env = "POD_NAMESPACE", default_value = "flotilla-system")]
    pub lease_namespace: String,
    /// Default: flotilla-hub for the hub, flotilla-agent for the agent.
    #[arg(long)]
    pub lease_name: Option<String>,
    /// A standby takes the Lease over once it has seen it unchanged for this long (whole
    /// seconds): the bound on failover after a leader dies (plus one retry period).
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
    pub lease_duration: Duration,
    /// The leader stops leading when this long has passed since its last successful
    /// renewal; until then failed renewals are retried. Shorter than --lease-duration, so
    /// that it stops before anyone else may take over.
    #[arg(long = "lease-renew-deadline", default_value = "10s", value_parser = humantime::parse_duration)]
    pub renew_deadline: Duration,
    /// How often the leader renews, a standby looks at the Lease, and a failed attempt
    /// is retried. Shorter than --lease-renew-deadline.
    #[arg(long = "lease-retry-period", default_value = "2s", value_parser = humantime::parse_duration)]
    pub retry_period: Duration,
    /// Deprecated: the renew deadline as --lease-duration minus this margin.
    #[arg(long, hide = true, value_parser = humantime::parse_duration, conflicts_with = "renew_deadline")]
    pub lease_renew_margin: Option<Duration>,
    /// This process's name in the Lease, and the Pod the hub labels (the Pod name in a
    /// cluster). Default: host name and process id.
    #[arg(long = "leader-identity", env = "POD_NAME")]
    pub identity: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LeaderError {
    #[error("--{flag} {value:?}: {reason}")]
    Flag {
        flag: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("starting the leader election's thread: {0}")]
    Thread(String),
}

impl LeaderArgs {
    /// The timings, checked: a whole number of seconds of lease duration (the Lease
    /// carries seconds), and retry period < renew deadline < lease duration.
    pub fn timings(&self) -> Result<Timings, LeaderError> {
        let bad = |flag, d: Duration, reason| LeaderError::Flag {
            flag,
            value: humantime::format_duration(d).to_string(),
            reason,
        };
        let lease_duration = self.lease_duration;
        if lease_duration.subsec_nanos() != 0
            || lease_duration.is_zero()
            || i32::try_from(lease_duration.as_secs()).is_err()
        {
            return Err(bad(
                "lease-duration",
                lease_duration,
                "must be a whole number of seconds, at least 1s",
            ));
        }
        let renew_deadline = match self.lease_renew_margin {
            Some(margin) if margin.is_zero() || margin >= lease_duration => {
                return Err(bad(
                    "lease-renew-margin",
                    margin,
                    "must be longer than 0s and shorter than --lease-duration",
                ));
            }
            Some(margin) => lease_duration - margin,
            None => self.renew_deadline,
        };
        if renew_deadline.is_zero() || renew_deadline >= lease_duration {
            return Err(bad(
                "lease-renew-deadline",
                renew_deadline,
                "must be longer than 0s and shorter than --lease-duration",
            ));
        }
        if self.retry_period.is_zero() || self.retry_period >= renew_deadline {
            return Err(bad(
                "lease-retry-period",
                self.retry_period,
                "must be longer than 0s and shorter than the renew deadline",
            ));
        }
        Ok(Timings {
            lease_duration,
            renew_deadline,
            retry_period: self.retry_period,
        })
    }

    /// How long work may take to stop once `leading` turned false before another replica
    /// may lead: lease duration − renew deadline. The `grace` for [`while_leading`].
    pub fn stop_grace(&self) -> Result<Duration, LeaderError> {
        let t = self.timings()?;
        Ok(t.lease_duration - t.renew_deadline)
    }

    /// The identity in the Lease, the same for every attempt of this process: the Pod
    /// name, or host name and process id outside a cluster. A container restarted in
    /// the same Pod takes its own Lease back at once.
    fn holder(&self) -> String {
        self.identity.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| "flotilla".into());
            format!("{host}-{}", std::process::id())
        })
    }
}

/// Starts campaigning (or, without `--leader-elect`, leads at once).
pub fn elect(
    config: kube::Config,
    args: &LeaderArgs,
    role: Role,
    shutdown: CancellationToken,
) -> Result<
    (
        watch::Receiver<bool>,
        futures::future::BoxFuture<'static, ()>,
    ),
    LeaderError,
> {
    if !args.leader_elect {
        let (tx, rx) = watch::channel(true);
        let idle = async move {
            shutdown.cancelled().await;
            drop(tx);
        };
        return Ok((rx, idle.boxed()));
    }
    let timings = args.timings()?;
    let (tx, rx) = watch::channel(false);
    let namespace = args.lease_namespace.clone();
    let name = args
        .lease_name
        .clone()
        .unwrap_or_else(|| role.lease.to_owned());
    let holder = args.holder();
    let pod = args.identity.clone().filter(|_| role.label_pod);
    let task = async move {
        let client = match kube::Client::try_from(election_config(config, &timings)) {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "building the leader election client; not leading");
                shutdown.cancelled().await;
                return;
            }
        };
        let label = pod_label_loop(
            client.clone(),
            pod,
            &namespace,
            tx.subscribe(),
            shutdown.clone(),
        );
        let lease = format!("{namespace}/{name}");
        let sink = Published {
            tx,
            metrics: metrics::LeaseMetrics::new(&lease),
        };
        let candidate = decide::Candidate::new(holder, timings);
        let api = lease::KubeLease::new(client, &namespace, &name);
        let campaign = campaign::run(
            api,
            candidate,
            k8s_openapi::jiff::Timestamp::now,
            sink,
            shutdown,
        );
        let span = tracing::info_span!("leader election", %lease);
        tokio::join!(label, tracing::Instrument::instrument(campaign, span));
    };
    Ok((rx, on_own_thread(task)?))
}

/// Runs the campaign on a thread and runtime of its own, done when it is. A hub busy
/// with a thousand reconnecting agents holds every worker of the main runtime; an
/// election that waits for one misses its renew deadline (the 1,000-cluster bench lost
/// the Lease 19 s after taking it, and every agent session with it, again and again).
/// The OS schedules this thread whatever the main runtime is doing. Dropping the
/// returned future drops the campaign where it stands, as before: nothing is released.
fn on_own_thread(
    task: impl Future<Output = ()> + Send + 'static,
) -> Result<futures::future::BoxFuture<'static, ()>, LeaderError> {
    let (done, finished) = tokio::sync::oneshot::channel::<()>();
    let dropped = CancellationToken::new();
    let on_drop = dropped.clone().drop_guard();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| LeaderError::Thread(e.to_string()))?;
    std::thread::Builder::new()
        .name("leader-election".into())
        .spawn(move || {
            runtime.block_on(async {
                tokio::select! {
                    () = task => {}
                    () = dropped.cancelled() => {}
                }
            });
            let _ = done.send(());
        })
        .map_err(|e| LeaderError::Thread(e.to_string()))?;
    Ok(async move {
        let _on_drop = on_drop;
        let _ = finished.await;
    }
    .boxed())
}

/// The election's own client config: no retry layer (each call is one request, which
/// the campaign bounds), and every connect, write and read bounded by one attempt's
/// timeout, counted from the request (`reset_reader_on_write`), not from when a pooled
/// connection went idle.
fn election_config(mut config: kube::Config, timings: &Timings) -> kube::Config {
    let call = timings.attempt_timeout();
    config.default_retry = false;
    config.connect_timeout = Some(call);
    config.read_timeout = Some(call);
    config.write_timeout = Some(call);
    config.reset_reader_on_write = true;
    config
}

/// The campaign's outcome: the `leading` watch and the metrics.
struct Published {
    tx: watch::Sender<bool>,
    metrics: metrics::LeaseMetrics,
}

impl campaign::Sink for Published {
    fn publish(&mut self, leading: bool) {
        self.tx.send_replace(leading);
        self.metrics.leading(leading);
    }

    fn attempt_failed(&mut self) {
        self.metrics.failed();
    }
}

/// Keeps `flotilla.io/leader` on this hub's Pod equal to the election's outcome,
/// retrying until the apiserver takes it. Outside a Pod (no `POD_NAME`), or for a role
/// that labels nothing, there is nothing to do.
async fn pod_label_loop(
    client: kube::Client,
    pod: Option<String>,
    namespace: &str,
    mut leading: watch::Receiver<bool>,
    shutdown: CancellationToken,
) {
    let Some(pod) = pod else {
        return;
    };
    let api: Api<Pod> = Api::namespaced(client, namespace);
    let params = PatchParams {
        field_manager: Some(format!("{}-leader", HUB.lease)),
        ..Default::default()
    };
    loop {
        let want = *leading.borrow_and_update();
        let done = match api
            .patch(&pod, &params, &Patch::Merge(label_patch(want)))
            .await
        {
            Ok(_) => true,
            Err(kube::Error::Api(e)) if e.code == 404 => {
                // No such Pod (a process outside a cluster that names itself): retrying
                // every 2 s would not make one appear, only fill the log.
                warn!(pod = %format!("{namespace}/{pod}"), "no such Pod: the {LEADER_LABEL} label is not kept");
                return;
            }
            Err(e) => {
                warn!(pod = %format!("{namespace}/{pod}"), error = %e, "labelling the Pod {LEADER_LABEL}={want}");
                false
            }
        };
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            changed = leading.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(Duration::from_secs(2)), if !done => {}
        }
    }
}

/// The label is present only on the leader: a standby's Pod has none.
fn label_patch(leading: bool) -> serde_json::Value {
    let value = if leading {
        serde_json::json!("true")
    } else {
        serde_json::Value::Null
    };
    serde_json::json!({"metadata": {"labels": {LEADER_LABEL: value}}})
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        leader: LeaderArgs,
    }

    fn parse(args: &[&str]) -> Result<LeaderArgs, clap::Error> {
        Cli::try_parse_from([&["hub"], args].concat()).map(|c| c.leader)
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn defaults_are_client_gos() {
        let args = parse(&["--leader-identity", "hub-0"]).unwrap();
        assert!(!args.leader_elect);
        assert_eq!(args.lease_name, None);
        assert_eq!(
            args.timings().unwrap(),
            Timings {
                lease_duration: secs(15),
                renew_deadline: secs(10),
                retry_period: secs(2),
            }
        );
        assert_eq!(args.stop_grace(), Ok(secs(5)));
        let t = args.timings().unwrap();
        // Two attempts fit before the renew deadline, even if the first one hangs.
        assert_eq!(t.attempt_timeout(), secs(5));
        assert!(t.release_timeout() <= secs(1));
    }

    #[test]
    fn timings_are_set_by_their_flags() {
        let args = parse(&[
            "--lease-duration=20s",
            "--lease-renew-deadline=12s",
            "--lease-retry-period=500ms",
        ])
        .unwrap();
        let t = args.timings().unwrap();
        assert_eq!(
            (t.lease_duration, t.renew_deadline, t.retry_period),
            (secs(20), secs(12), Duration::from_millis(500))
        );
    }

    #[test]
    fn the_old_renew_margin_still_works_and_sets_the_deadline() {
        // As BENCHMARKS.md's runs passed it.
        let args = parse(&["--lease-duration=20s", "--lease-renew-margin=8s"]).unwrap();
        assert_eq!(args.timings().unwrap().renew_deadline, secs(12));
        assert!(
            parse(&["--lease-renew-margin=2s", "--lease-renew-deadline=9s"]).is_err(),
            "one or the other"
        );
        use clap::CommandFactory;
        let help = Cli::command().render_help().to_string();
        assert!(!help.contains("renew-margin"), "hidden: {help}");
        assert!(help.contains("--lease-renew-deadline"), "{help}");
    }

    #[test]
    fn bad_timings_name_the_flag() {
        for (args, flag) in [
            (&["--lease-duration", "1500ms"][..], "--lease-duration"),
            (&["--lease-duration", "0s"][..], "--lease-duration"),
            (&["--lease-duration", "10s"][..], "--lease-renew-deadline"),
            (
                &["--lease-renew-deadline", "0s"][..],
                "--lease-renew-deadline",
            ),
            (&["--lease-retry-period", "10s"][..], "--lease-retry-period"),
            (&["--lease-retry-period", "0s"][..], "--lease-retry-period"),
            (
                &["--lease-duration", "2s", "--lease-renew-margin", "2s"][..],
                "--lease-renew-margin",
            ),
            (&["--lease-renew-margin", "0s"][..], "--lease-renew-margin"),
            (&["--lease-renew-margin", "13s"][..], "--lease-retry-period"),
        ] {
            let e = parse(args).unwrap().timings().unwrap_err().to_string();
            assert!(e.starts_with(flag), "{args:?}: {e}");
        }
        assert!(parse(&["--lease-duration", "soon"]).is_err());
    }

    #[test]
    fn the_identity_is_the_same_for_every_attempt() {
        let args = parse(&["--leader-identity", "flotilla-hub-abc"]).unwrap();
        assert_eq!(args.holder(), "flotilla-hub-abc");
        let anonymous = parse(&[]).unwrap();
        assert!(
            anonymous
                .holder()
                .ends_with(&format!("-{}", std::process::id()))
        );
        assert_eq!(anonymous.holder(), anonymous.holder());
    }

    #[test]
    fn only_the_leader_carries_the_label() {
        assert_eq!(
            label_patch(true),
            serde_json::json!({"metadata": {"labels": {"flotilla.io/leader": "true"}}})
        );
        // JSON merge patch: null removes the key.
        assert_eq!(
            label_patch(false),
            serde_json::json!({"metadata": {"labels": {"flotilla.io/leader": null}}})
        );
    }

    #[test]
    fn the_election_client_has_no_retry_layer_and_bounded_calls() {
        let t = parse(&[]).unwrap().timings().unwrap();
        let config = kube::Config::new("https://127.0.0.1:1".parse().unwrap());
        assert!(
            config.default_retry,
            "kube's default, which the election must not keep"
        );
        let config = election_config(config, &t);
        assert!(!config.default_retry);
        assert!(config.reset_reader_on_write);
        for timeout in [
            config.connect_timeout,
            config.read_timeout,
            config.write_timeout,
        ] {
            assert_eq!(timeout, Some(t.attempt_timeout()));
        }
    }

    #[tokio::test]
    async fn without_election_this_hub_leads_until_shutdown() {
        let shutdown = CancellationToken::new();
        let config = kube::Config::new("https://127.0.0.1:1".parse().unwrap());
        let args = parse(&[]).unwrap();
        let (leading, task) = elect(config, &args, HUB, shutdown.clone()).unwrap();
        assert!(*leading.borrow());
        let task = tokio::spawn(task);
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("ends at shutdown")
            .unwrap();
    }

    #[tokio::test]
    async fn an_unreachable_apiserver_never_makes_a_leader() {
        let shutdown = CancellationToken::new();
        // Nothing listens on port 1: every call of the election fails.
        let config = kube::Config::new("https://127.0.0.1:1".parse().unwrap());
        let args = parse(&["--leader-elect", "--leader-identity", "hub-0"]).unwrap();
        let (mut leading, task) = elect(config, &args, HUB, shutdown.clone()).unwrap();
        let task = tokio::spawn(task);
        let changed = tokio::time::timeout(Duration::from_secs(3), leading.changed()).await;
        assert!(changed.is_err() || !*leading.borrow(), "never leading");
        assert!(!*leading.borrow());
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .expect("ends within 2 s of shutdown")
            .unwrap();
    }
}
