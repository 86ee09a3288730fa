//! Leader election on a `coordination.k8s.io` Lease (kube-lease-manager), for the hub
//! and for the agent.
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
//! `shutdown` fires (after releasing the Lease) and is a critical task otherwise.

use std::time::Duration;

use futures::FutureExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

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
    /// A leader that stops renewing loses the Lease after this long (whole seconds): the
    /// bound on failover after a leader dies.
    #[arg(long, default_value = "6s", value_parser = humantime::parse_duration)]
    pub lease_duration: Duration,
    /// The leader renews this long before the Lease expires (whole seconds); each call
    /// to the apiserver of the election times out within half of it, so a leader that
    /// cannot renew steps down before the Lease expires.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub lease_renew_margin: Duration,
    /// This process's name in the Lease, and the Pod the hub labels (the Pod name in a
    /// cluster).
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
}

/// Lease timings in the whole seconds a Lease carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timings {
    pub duration_secs: u64,
    pub margin_secs: u64,
    /// Timeout of each apiserver call of the election.
    pub call_timeout: Duration,
}

impl LeaderArgs {
    pub fn timings(&self) -> Result<Timings, LeaderError> {
        let whole = |flag, d: Duration| {
            if d.subsec_nanos() != 0 || d.is_zero() {
                return Err(LeaderError::Flag {
                    flag,
                    value: humantime::format_duration(d).to_string(),
                    reason: "must be a whole number of seconds, at least 1s",
                });
            }
            Ok(d.as_secs())
        };
        let duration_secs = whole("lease-duration", self.lease_duration)?;
        let margin_secs = whole("lease-renew-margin", self.lease_renew_margin)?;
        if margin_secs >= duration_secs {
            return Err(LeaderError::Flag {
                flag: "lease-renew-margin",
                value: humantime::format_duration(self.lease_renew_margin).to_string(),
                reason: "must be shorter than --lease-duration",
            });
        }
        Ok(Timings {
            duration_secs,
            margin_secs,
            call_timeout: self.lease_renew_margin / 2,
        })
    }

    /// The Lease's name (set from the role by [`elect`]).
    fn lease(&self) -> &str {
        self.lease_name.as_deref().unwrap_or_default()
    }

    /// The identity in the Lease: the Pod name, or host name and process id outside a
    /// cluster; `attempt` makes each campaign a new holder (see [`campaign`]).
    fn holder(&self, attempt: u64) -> String {
        let base = self.identity.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| "flotilla".into());
            format!("{host}-{}", std::process::id())
        });
        format!("{base}/{attempt}")
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
    let mut args = args.clone();
    args.lease_name.get_or_insert_with(|| role.lease.to_owned());
    let task = async move {
        let mut config = config;
        config.connect_timeout = Some(timings.call_timeout);
        config.read_timeout = Some(timings.call_timeout);
        config.write_timeout = Some(timings.call_timeout);
        let client = match kube::Client::try_from(config) {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "building the leader election client; not leading");
                shutdown.cancelled().await;
                return;
            }
        };
        let leading = tx.subscribe();
        let label = async {
            if role.label_pod {
                pod_label_loop(client.clone(), &args, role, leading, shutdown.clone()).await
            }
        };
        let campaign = campaign(
            client.clone(),
            args.clone(),
            role,
            timings,
            tx,
            shutdown.clone(),
        );
        tokio::join!(label, campaign);
    };
    Ok((rx, task.boxed()))
}

/// Holds or waits for the Lease until shutdown. A manager that fails (the apiserver
/// unreachable or slow) steps down at once and the campaign starts again as a new holder:
/// it never claims a Lease it could not renew, and never returns to leading without
/// acquiring it anew.
async fn campaign(
    client: kube::Client,
    args: LeaderArgs,
    role: Role,
    timings: Timings,
    tx: watch::Sender<bool>,
    shutdown: CancellationToken,
) {
    let mut attempt = 0u64;
    let mut backoff = Duration::from_millis(500);
    loop {
        let identity = args.holder(attempt);
        attempt += 1;
        let build = LeaseManagerBuilder::new(client.clone(), args.lease())
            .with_namespace(&args.lease_namespace)
            .with_identity(&identity)
            .with_field_manager(field_manager(role))
            .with_duration(timings.duration_secs)
            .with_grace(timings.margin_secs)
            .build();
        let manager = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            built = build => built,
        };
        match manager {
            Ok(manager) => match hold(&manager, &identity, &args, &tx, &shutdown).await {
                Held::Shutdown => return,
                Held::Failed => backoff = Duration::from_millis(500),
            },
            Err(e) => warn!(
                lease = %format!("{}/{}", args.lease_namespace, args.lease()),
                error = %e,
                "reading the leader Lease"
            ),
        }
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(timings.duration_secs));
    }
}

enum Held {
    Shutdown,
    Failed,
}

async fn hold(
    manager: &LeaseManager,
    identity: &str,
    args: &LeaderArgs,
    tx: &watch::Sender<bool>,
    shutdown: &CancellationToken,
) -> Held {
    let lease = format!("{}/{}", args.lease_namespace, args.lease());
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => {
                tx.send_replace(false);
                if let Err(e) = manager.release().await {
                    warn!(%lease, error = %e, "releasing the leader Lease at shutdown");
                }
                return Held::Shutdown;
            }
            changed = manager.changed() => match changed {
                Ok(leading) => {
                    info!(%lease, %identity, leading, "leadership changed");
                    tx.send_replace(leading);
                }
                Err(e) => {
                    let was = tx.send_replace(false);
                    warn!(%lease, %identity, error = %e, stepped_down = was, "leader election failed; campaigning again");
                    // Hand the Lease over at once if the apiserver takes the release.
                    let _ = manager.release().await;
                    return Held::Failed;
                }
            }
        }
    }
}

/// Keeps `flotilla.io/leader` on this hub's Pod equal to the election's outcome,
/// retrying until the apiserver takes it. Outside a Pod (no `POD_NAME`) there is nothing
/// to label.
async fn pod_label_loop(
    client: kube::Client,
    args: &LeaderArgs,
    role: Role,
    mut leading: watch::Receiver<bool>,
    shutdown: CancellationToken,
) {
    let Some(pod) = args.identity.clone() else {
        return;
    };
    let api: Api<Pod> = Api::namespaced(client, &args.lease_namespace);
    loop {
        let want = *leading.borrow_and_update();
        let done = match api
            .patch(
                &pod,
                &PatchParams {
                    field_manager: Some(field_manager(role)),
                    ..Default::default()
                },
                &Patch::Merge(label_patch(want)),
            )
            .await
        {
            Ok(_) => true,
            Err(e) => {
                warn!(pod = %format!("{}/{pod}", args.lease_namespace), error = %e, "labelling the Pod {LEADER_LABEL}={want}");
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

fn field_manager(role: Role) -> String {
    format!("{}-leader", role.lease)
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

    #[test]
    fn defaults_fail_over_within_ten_seconds() {
        let args = parse(&["--leader-identity", "hub-0"]).unwrap();
        assert!(!args.leader_elect);
        assert_eq!(args.lease_name, None);
        let t = args.timings().unwrap();
        // A dead leader's Lease expires after `duration`; the standby's forced release
        // waits at most one more second before it acquires.
        assert!(t.duration_secs + 1 < 10, "{t:?}");
        assert_eq!(t.margin_secs, 2);
        assert!(t.call_timeout * 2 <= Duration::from_secs(t.margin_secs));
    }

    #[test]
    fn bad_timings_name_the_flag() {
        for (args, flag) in [
            (
                &["--lease-duration", "2s", "--lease-renew-margin", "2s"][..],
                "--lease-renew-margin",
            ),
            (&["--lease-duration", "1s"][..], "--lease-renew-margin"),
            (&["--lease-duration", "1500ms"][..], "--lease-duration"),
            (&["--lease-renew-margin", "0s"][..], "--lease-renew-margin"),
            (
                &["--lease-renew-margin", "500ms"][..],
                "--lease-renew-margin",
            ),
        ] {
            let e = parse(args).unwrap().timings().unwrap_err().to_string();
            assert!(e.starts_with(flag), "{args:?}: {e}");
        }
        assert!(parse(&["--lease-duration", "soon"]).is_err());
    }

    #[test]
    fn every_campaign_is_a_new_holder() {
        let args = parse(&["--leader-identity", "flotilla-hub-abc"]).unwrap();
        assert_eq!(args.holder(0), "flotilla-hub-abc/0");
        assert_ne!(args.holder(0), args.holder(1));
        let anonymous = parse(&[]).unwrap();
        assert!(
            anonymous
                .holder(3)
                .ends_with(&format!("-{}/3", std::process::id()))
        );
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
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("ends at shutdown")
            .unwrap();
    }
}
