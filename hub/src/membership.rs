//! Membership: agents' heartbeats → `MemberCluster.status` (`Ready`, last heartbeat,
//! versions). A cluster is Ready while heartbeats arrive within the grace period; a
//! disconnect alone does not flip it, since a restarting hub or agent reconnects within
//! seconds.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use flotilla_crds::MemberCluster;
use flotilla_crds::member::MemberClusterStatus;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

#[derive(Debug, Clone, Default)]
struct Member {
    last_heartbeat: Option<(Instant, Timestamp)>,
    agent_version: Option<String>,
    kubernetes_version: Option<String>,
    /// Something changed that the MemberCluster status does not show yet.
    dirty: bool,
}

pub struct Membership {
    members: Mutex<HashMap<String, Member>>,
    wake: Notify,
    grace: Duration,
    started: Instant,
}

impl Membership {
    pub fn new(grace: Duration) -> Self {
        Self {
            members: Mutex::default(),
            wake: Notify::new(),
            grace,
            started: Instant::now(),
        }
    }

    /// A session started: written at once, so that a new agent shows Ready in well under
    /// a second.
    pub fn hello(&self, cluster: &str, agent_version: &str, kubernetes_version: &str) {
        let mut members = self.lock();
        let m = members.entry(cluster.to_owned()).or_default();
        m.agent_version = Some(agent_version.to_owned());
        m.kubernetes_version = Some(kubernetes_version.to_owned());
        m.last_heartbeat = Some((Instant::now(), Timestamp::now()));
        m.dirty = true;
        drop(members);
        self.wake.notify_one();
    }

    pub fn heartbeat(&self, cluster: &str) {
        let mut members = self.lock();
        let m = members.entry(cluster.to_owned()).or_default();
        m.last_heartbeat = Some((Instant::now(), Timestamp::now()));
        m.dirty = true;
        drop(members);
        self.wake.notify_one();
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Member>> {
        self.members.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a heartbeat arrived within the grace period.
    fn alive(&self, m: Option<&Member>, now: Instant) -> bool {
        m.and_then(|m| m.last_heartbeat)
            .is_some_and(|(at, _)| now.duration_since(at) <= self.grace)
    }

    /// Keeps every MemberCluster's status current until `shutdown`.
    pub async fn write_loop(
        &self,
        client: kube::Client,
        store: Store<MemberCluster>,
        shutdown: CancellationToken,
    ) {
        let api: Api<MemberCluster> = Api::all(client);
        let tick = (self.grace / 4).max(Duration::from_millis(250));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(tick) => {}
            }
            let now = Instant::now();
            let mut writes = Vec::new();
            {
                let mut members = self.lock();
                for mc in store.state() {
                    let Some(name) = mc.metadata.name.clone() else {
                        continue;
                    };
                    let m = members.get(&name);
                    let alive = self.alive(m, now);
                    let shown = mc
                        .status
                        .as_ref()
                        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
                        .map(|c| c.status == "True");
                    let dirty = m.is_some_and(|m| m.dirty);
                    // Before the first grace period has passed since start, an agent
                    // may still be reconnecting: do not declare it gone yet.
                    let settled = now.duration_since(self.started) > self.grace;
                    if dirty || (shown != Some(alive) && (alive || settled)) {
                        writes.push((name.clone(), self.status(m, alive, mc.status.as_ref())));
                        if let Some(m) = members.get_mut(&name) {
                            m.dirty = false;
                        }
                    }
                }
            }
            for (name, status) in writes {
                let patch = Patch::Merge(serde_json::json!({ "status": status }));
                match api
                    .patch_status(&name, &PatchParams::default(), &patch)
                    .await
                {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => {
                        warn!(cluster = %name, error = %e, "writing MemberCluster status failed; retrying");
                        if let Some(m) = self.lock().get_mut(&name) {
                            m.dirty = true;
                        }
                    }
                }
            }
        }
    }

    fn status(
        &self,
        m: Option<&Member>,
        alive: bool,
        previous: Option<&MemberClusterStatus>,
    ) -> MemberClusterStatus {
        let before = previous.and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
        let status = if alive { "True" } else { "False" };
        let transition = match before {
            Some(b) if b.status == status => b.last_transition_time.clone(),
            _ => {
                info!(ready = alive, "MemberCluster readiness changed");
                Time(Timestamp::now())
            }
        };
        let (reason, message) = if alive {
            (
                "AgentHeartbeating",
                "the cluster's agent is connected and heartbeating".to_owned(),
            )
        } else {
            (
                "AgentSilent",
                format!(
                    "no heartbeat from the cluster's agent for over {}s",
                    self.grace.as_secs()
                ),
            )
        };
        MemberClusterStatus {
            conditions: vec![Condition {
                type_: "Ready".into(),
                status: status.into(),
                reason: reason.into(),
                message,
                last_transition_time: transition,
                observed_generation: None,
            }],
            last_heartbeat_time: m
                .and_then(|m| m.last_heartbeat)
                .map(|(_, t)| Time(t))
                .or_else(|| previous.and_then(|p| p.last_heartbeat_time.clone())),
            agent_version: m
                .and_then(|m| m.agent_version.clone())
                .or_else(|| previous.and_then(|p| p.agent_version.clone())),
            kubernetes_version: m
                .and_then(|m| m.kubernetes_version.clone())
                .or_else(|| previous.and_then(|p| p.kubernetes_version.clone())),
            capacity: previous.and_then(|p| p.capacity.clone()),
        }
    }
}

/// Looks a MemberCluster up by name.
pub fn member(store: &Store<MemberCluster>, name: &str) -> Option<std::sync::Arc<MemberCluster>> {
    store.get(&ObjectRef::new(name))
}
