//! Inventory: the fleet in SIG-Multicluster's cluster inventory API (KEP-4322). One
//! `ClusterProfile` per MemberCluster, in the inventory namespace (Flotilla's own unless
//! `--cluster-inventory-namespace` says otherwise), kept current while this hub leads:
//! `ControlPlaneHealthy` from the MemberCluster's `Ready`, `Joined`, the member's
//! Kubernetes version, its labels, and its capacity as properties. A profile goes with its
//! MemberCluster: the hub deletes it, and an owner reference lets the garbage collector
//! do so when no hub runs.
//!
//! Writes follow changes: each round compares what every profile should be with the
//! cache of what the host has and applies only those that differ, so an idle fleet and
//! a hub restart write nothing. A profile of the same name that another cluster manager
//! wrote is never taken over. Nothing is published where the host does not serve the
//! API (`flotilla-hub crds --cluster-inventory` installs it where no other cluster
//! manager did).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use flotilla_common::listed::Listed;
use flotilla_crds::inventory::{
    CLUSTER_MANAGER, CLUSTER_MANAGER_LABEL, CONTROL_PLANE_HEALTHY, ClusterManager, ClusterProfile,
    ClusterProfileSpec, ClusterProfileStatus, ClusterVersion, JOINED, MEMBER_ID_LABEL,
    PlacementDecision, Property,
};
use flotilla_crds::{FederatedMyApp, MANAGED_BY_LABEL, MANAGED_BY_VALUE, MemberCluster};
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::status::StatusBoard;
use crate::writes::{Failure, Tracker, Write, WriteMetrics, digest, while_leading};

pub mod decisions;

const KIND: &str = "clusterprofile";
const FIELD_MANAGER: &str = "flotilla-hub-inventory";
/// Annotation listing the label keys the hub sets on a profile, so that a label removed
/// from the MemberCluster is removed from the profile too (and labels others add are
/// left alone).
const LABELS_ANNOTATION: &str = "flotilla.io/labels";
/// The ClusterProperty (KEP-2149) that names a cluster within its clusterset.
const CLUSTER_ID_PROPERTY: &str = "cluster.clusterset.k8s.io";
/// How often the profiles are compared with the MemberClusters.
const ROUND: Duration = Duration::from_secs(2);
/// Profiles written per round at most, so that a first publication of a large fleet is
/// spread out (two writes a new profile: the object, then its status).
const WRITES_PER_ROUND: usize = 100;
/// How long a profile this hub created may be missing from its cache before it is taken
/// as deleted since.
const CACHE_LAG: Duration = Duration::from_secs(10);
/// How often a host that does not serve the API is asked again.
const DISCOVERY_RETRY: Duration = Duration::from_secs(60);

#[derive(clap::Args, Debug, Clone)]
pub struct InventoryArgs {
    /// Namespace of the ClusterProfiles (the cluster inventory). Default: Flotilla's own
    /// namespace (`--flotilla-namespace`).
    #[arg(
        long = "cluster-inventory-namespace",
        env = "FLOTILLA_CLUSTER_INVENTORY_NAMESPACE"
    )]
    pub namespace: Option<String>,
    /// Publish no ClusterProfiles, even where the host serves the API.
    #[arg(long = "no-cluster-inventory")]
    pub disabled: bool,
}

/// The profile `member` should have (labels, spec, owner, status). `previous`: the
/// profile as the host has it, whose `Joined` transition time stays while `Joined` does.
pub fn profile(
    member: &MemberCluster,
    namespace: &str,
    previous: Option<&ClusterProfile>,
    now: &Time,
) -> ClusterProfile {
    let name = member.name_any();
    let status = member.status.clone().unwrap_or_default();
    let uid = status.cluster_uid.clone().filter(|u| !u.is_empty());
    // The ID the cluster states (its own ClusterProperty) wins over its UID.
    let cluster_id = status.cluster_id.clone().filter(|i| !i.is_empty());
    let mut labels: BTreeMap<String, String> = member
        .labels()
        .iter()
        .filter(|(k, _)| k.as_str() != CLUSTER_MANAGER_LABEL && k.as_str() != MEMBER_ID_LABEL)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    labels.insert(CLUSTER_MANAGER_LABEL.into(), CLUSTER_MANAGER.into());
    if let Some(uid) = &uid {
        labels.insert(MEMBER_ID_LABEL.into(), uid.clone());
    }
    let keys: Vec<&str> = labels.keys().map(String::as_str).collect();
    let annotations = BTreeMap::from([(LABELS_ANNOTATION.to_owned(), keys.join(","))]);

    let mut profile = ClusterProfile::new(
        &name,
        ClusterProfileSpec {
            display_name: Some(name.clone()),
            cluster_manager: ClusterManager {
                name: CLUSTER_MANAGER.into(),
            },
        },
    );
    let meta = &mut profile.metadata;
    meta.namespace = Some(namespace.to_owned());
    meta.labels = Some(labels);
    meta.annotations = Some(annotations);
    // Not a controller reference and not blocking: the garbage collector removes the
    // profile after its MemberCluster, which nothing about the profile holds up.
    meta.owner_references = member.owner_ref(&()).map(|r| vec![r]);

    let healthy = healthy(member, now);
    let joined = joined(member, uid.is_some() || cluster_id.is_some(), previous, now);
    let observed = status.last_heartbeat_time.clone();
    let mut properties = Vec::new();
    let mut property = |name: &str, value: String| {
        properties.push(Property {
            name: name.to_owned(),
            value,
            last_observed_time: observed.clone(),
        })
    };
    if let Some(id) = cluster_id.as_ref().or(uid.as_ref()) {
        property(CLUSTER_ID_PROPERTY, id.clone());
    }
    if let Some(v) = status.agent_version.as_deref().filter(|v| !v.is_empty()) {
        property("flotilla.io/agent-version", v.to_owned());
    }
    if member.spec.unschedulable {
        property("flotilla.io/unschedulable", "true".into());
    }
    if let Some(c) = &status.capacity {
        property("flotilla.io/nodes", c.nodes.to_string());
        let (all, req) = (&c.allocatable, &c.requested);
        let cpu = |m: i64| format!("{}m", m.max(0));
        let mem = |b: i64| b.max(0).to_string();
        property("resources.flotilla.io/allocatable-cpu", cpu(all.cpu_millis));
        property(
            "resources.flotilla.io/allocatable-memory",
            mem(all.memory_bytes),
        );
        let free_cpu = all.cpu_millis.saturating_sub(req.cpu_millis);
        let free_mem = all.memory_bytes.saturating_sub(req.memory_bytes);
        property("resources.flotilla.io/available-cpu", cpu(free_cpu));
        property("resources.flotilla.io/available-memory", mem(free_mem));
    }
    profile.status = Some(ClusterProfileStatus {
        conditions: vec![healthy, joined],
        version: ClusterVersion {
            kubernetes: status.kubernetes_version.filter(|v| !v.is_empty()),
        },
        properties,
    });
    profile
}

/// `ControlPlaneHealthy`: the MemberCluster's `Ready` (an agent heartbeats and reaches
/// its apiserver), with its reason and transition time.
fn healthy(member: &MemberCluster, now: &Time) -> Condition {
    let ready = member
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(r) => Condition {
            type_: CONTROL_PLANE_HEALTHY.into(),
            status: r.status.clone(),
            reason: r.reason.clone(),
            message: r.message.clone(),
            last_transition_time: r.last_transition_time.clone(),
            observed_generation: None,
        },
        None => Condition {
            type_: CONTROL_PLANE_HEALTHY.into(),
            status: "Unknown".into(),
            reason: "AgentNeverConnected".into(),
            message: "no agent has connected to the hub for this cluster yet".into(),
            last_transition_time: member
                .metadata
                .creation_timestamp
                .clone()
                .unwrap_or_else(|| now.clone()),
            observed_generation: None,
        },
    }
}

/// `Joined`: registered with a credential that has not expired, and pinned by an agent
/// that connected.
fn joined(
    member: &MemberCluster,
    pinned: bool,
    previous: Option<&ClusterProfile>,
    now: &Time,
) -> Condition {
    let spec = &member.spec;
    let valid = |expires: &Option<Time>| expires.as_ref().is_none_or(|at| at.0 > now.0);
    let current = spec.token_sha256.is_some() && valid(&spec.token_expires_at);
    let next = spec.next_token_sha256.is_some() && valid(&spec.next_token_expires_at);
    let (status, reason, message) = match (spec.token_sha256.is_some(), pinned) {
        (true, _) if !current && !next => (
            "False",
            "CredentialExpired",
            "the agent's token expired before it was renewed: `flotilla-hub join NAME --rotate` issues a new one",
        ),
        (false, _) => (
            "False",
            "CredentialRevoked",
            "the MemberCluster has no credential: `flotilla-hub join NAME --rotate` issues one",
        ),
        (true, false) => (
            "False",
            "AwaitingAgent",
            "registered; no agent has connected with its credential yet",
        ),
        (true, true) => (
            "True",
            "AgentJoined",
            "an agent holds the cluster's credential and is bound to the cluster",
        ),
    };
    let since = previous
        .and_then(|p| p.status.as_ref())
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == JOINED))
        .filter(|c| c.status == status)
        .map_or_else(|| now.clone(), |c| c.last_transition_time.clone());
    Condition {
        type_: JOINED.into(),
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: since,
        observed_generation: None,
    }
}

/// Whether the host's `existing` profile shows what `want` says, in the fields the hub
/// sets (labels it owns, spec, owner, status).
fn current(existing: &ClusterProfile, want: &ClusterProfile) -> bool {
    let ours = |p: &ClusterProfile| p.annotations().get(LABELS_ANNOTATION).cloned();
    let has = existing.labels();
    let labels = want.labels().iter().all(|(k, v)| has.get(k) == Some(v));
    let owners = want
        .owner_references()
        .iter()
        .all(|o| existing.owner_references().contains(o));
    labels
        && owners
        && ours(existing) == ours(want)
        && existing.spec == want.spec
        && existing.status == want.status
}

/// What was decided for a profile whose name another cluster manager holds.
fn foreign(existing: &ClusterProfile) -> bool {
    existing.spec.cluster_manager.name != CLUSTER_MANAGER
}

/// One round's work: profiles to apply, and Flotilla's profiles of clusters that are no
/// longer registered (name, uid).
#[derive(Debug, Default, PartialEq)]
pub struct Round {
    pub apply: Vec<ClusterProfile>,
    pub delete: Vec<(String, String)>,
    /// Names held by another cluster manager's profiles: left alone.
    pub foreign: Vec<String>,
}

/// Compares every MemberCluster's profile with the host's profiles. Pure.
pub fn round(
    members: &[Arc<MemberCluster>],
    existing: &[Arc<ClusterProfile>],
    namespace: &str,
    now: &Time,
) -> Round {
    let by_name: HashMap<String, &ClusterProfile> = existing
        .iter()
        .map(|p| (p.name_any(), p.as_ref()))
        .collect();
    let mut round = Round::default();
    for member in members {
        if member.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let previous = by_name.get(&member.name_any()).copied();
        if previous.is_some_and(foreign) {
            round.foreign.push(member.name_any());
            continue;
        }
        let want = profile(member, namespace, previous, now);
        if !previous.is_some_and(|p| current(p, &want)) {
            round.apply.push(want);
        }
    }
    let registered: std::collections::HashSet<String> =
        members.iter().map(|m| m.name_any()).collect();
    round.delete = existing
        .iter()
        .filter(|p| !foreign(p) && !registered.contains(&p.name_any()))
        .filter_map(|p| Some((p.name_any(), p.uid()?)))
        .collect();
    round
}

/// Now, to the second: what the apiserver keeps of a time, so that a condition written
/// once compares equal to itself when read back.
fn now() -> Time {
    let secs = Timestamp::now().as_second();
    Time(Timestamp::from_second(secs).expect("now is a valid timestamp"))
}

impl InventoryArgs {
    /// The inventory namespace; `None` when publishing is off.
    pub fn namespace(&self, flotilla_namespace: &str) -> Option<String> {
        let namespace = self.namespace.as_deref().unwrap_or(flotilla_namespace);
        (!self.disabled).then(|| namespace.to_owned())
    }
}

/// What publishing reads and where it writes.
pub struct Publisher {
    pub client: kube::Client,
    /// The inventory namespace; `None`: publish nothing.
    pub namespace: Option<String>,
    pub members: Store<MemberCluster>,
    pub members_listed: Listed,
    pub apps: Store<FederatedMyApp>,
    pub apps_listed: Listed,
    /// Where the plans are, and which apps' placements changed.
    pub board: Arc<StatusBoard>,
    pub leading: watch::Receiver<bool>,
    pub metrics: WriteMetrics,
}

/// Publishes the ClusterProfiles and the PlacementDecisions while this hub leads, once
/// the stores have listed; returns at `shutdown`. Each kind is left out (after saying
/// so) when the host does not serve it, and both when publishing is off.
pub async fn publish(publisher: Publisher, shutdown: CancellationToken) -> anyhow::Result<()> {
    let Some(namespace) = publisher.namespace.clone() else {
        info!("cluster inventory: not publishing (--no-cluster-inventory)");
        return Ok(());
    };
    let p = &publisher;
    let profiles = async {
        let api: Api<ClusterProfile> = Api::namespaced(p.client.clone(), &namespace);
        if !served(&api, "clusterprofiles", &shutdown).await {
            return Ok(());
        }
        info!(%namespace, "cluster inventory: publishing a ClusterProfile per MemberCluster");
        let (profiles, listed, drain) = cache(api.clone(), watcher::Config::default());
        let work = async {
            let listed = p.members_listed.wait().await.is_ok() && listed.wait().await.is_ok();
            if !listed {
                return Ok(());
            }
            while_leading(
                p.leading.clone(),
                &shutdown,
                || {
                    let writer = Writer {
                        api: api.clone(),
                        namespace: namespace.clone(),
                        metrics: p.metrics.clone(),
                        gate: Gate::default(),
                    };
                    writer.run(&p.members, &profiles, &shutdown)
                },
                || {},
            )
            .await
        };
        tokio::select! {
            () = drain => Ok(()),
            r = work => r,
        }
    };
    let decisions = async {
        let api: Api<PlacementDecision> = Api::all(p.client.clone());
        if !served(&api, "placementdecisions", &shutdown).await {
            return Ok(());
        }
        info!("cluster inventory: publishing a PlacementDecision per FederatedMyApp");
        let ours = format!("{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}");
        let (decisions, listed, drain) = cache(api, watcher::Config::default().labels(&ours));
        let work = async {
            let listed = p.apps_listed.wait().await.is_ok() && listed.wait().await.is_ok();
            if !listed {
                return Ok(());
            }
            while_leading(
                p.leading.clone(),
                &shutdown,
                || async {
                    decisions::write_while_leading(
                        &p.client, &p.board, &p.apps, &decisions, &namespace, &p.metrics, &shutdown,
                    )
                    .await;
                    Ok(())
                },
                || {},
            )
            .await
        };
        tokio::select! {
            () = drain => Ok(()),
            r = work => r,
        }
    };
    let (profiles, decisions): (anyhow::Result<()>, anyhow::Result<()>) =
        tokio::join!(profiles, decisions);
    profiles.and(decisions)
}

/// Waits until the host serves `api`'s resource; false at `shutdown`. A host without
/// the CRD is said so once and asked again every minute.
async fn served<K>(api: &Api<K>, plural: &str, shutdown: &CancellationToken) -> bool
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    let mut said = false;
    loop {
        match api.list_metadata(&ListParams::default().limit(1)).await {
            Ok(_) => return true,
            Err(kube::Error::Api(e)) if e.code == 404 => {
                if !said {
                    info!(
                        "cluster inventory: the host does not serve {plural}.multicluster.x-k8s.io; \
                         none are published (`flotilla-hub crds --cluster-inventory` installs the CRDs)"
                    );
                    said = true;
                }
            }
            Err(e) => warn!(error = %e, "cluster inventory: asking the host for {plural}"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return false,
            _ = tokio::time::sleep(DISCOVERY_RETRY) => {}
        }
    }
}

/// A cache of `api`'s objects (trimmed as every cache of the hub): the store, when it
/// has listed, and the watch to drive.
fn cache<K>(
    api: Api<K>,
    config: watcher::Config,
) -> (Store<K>, Listed, impl std::future::Future<Output = ()>)
where
    K: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let (events, listed) = crate::run::watch(api, config, writer);
    (store, listed, events.for_each(|_| async {}))
}

struct Writer {
    api: Api<ClusterProfile>,
    namespace: String,
    metrics: WriteMetrics,
    gate: Gate,
}

/// Which profiles may be written now.
#[derive(Default)]
struct Gate {
    /// Backoff, and the versions around this hub's updates (see `crate::writes`).
    tracker: Tracker<String>,
    /// When this hub last created each profile.
    created: HashMap<String, Instant>,
}

impl Gate {
    /// Whether the profile `name`, at `version` in the cache ("": not there), may be
    /// written now. One the cache does not hold was created by this hub a moment ago
    /// (the cache lags) or deleted by someone else since (the garbage collector, after
    /// an unjoin): it is created again once the cache had time to show it.
    fn may_write(&mut self, name: &str, version: &str, now: Instant) -> bool {
        self.created.retain(|_, at| now - *at <= CACHE_LAG);
        if !version.is_empty() {
            return self.tracker.may_write(&name.to_owned(), version, now);
        }
        if self.created.contains_key(name) {
            return false;
        }
        self.created.insert(name.to_owned(), now);
        true
    }
}

impl Writer {
    async fn run(
        mut self,
        members: &Store<MemberCluster>,
        profiles: &Store<ClusterProfile>,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        let mut said_foreign = std::collections::HashSet::new();
        loop {
            let round = round(&members.state(), &profiles.state(), &self.namespace, &now());
            for name in round.foreign {
                if said_foreign.insert(name.clone()) {
                    warn!(cluster = %name, namespace = %self.namespace, "cluster inventory: a ClusterProfile of this name belongs to another cluster manager; left alone");
                }
            }
            let versions: HashMap<String, String> = profiles
                .state()
                .iter()
                .map(|p| (p.name_any(), p.resource_version().unwrap_or_default()))
                .collect();
            let cached = |name: &str| versions.get(name).cloned().unwrap_or_default();
            let mut written = 0;
            for want in round.apply {
                if written >= WRITES_PER_ROUND {
                    break;
                }
                let name = want.name_any();
                let version = cached(&name);
                if !self.gate.may_write(&name, &version, Instant::now()) {
                    continue;
                }
                written += 1;
                self.apply(want, version).await;
            }
            for (name, uid) in round.delete {
                self.delete(&name, uid).await;
            }
            self.metrics.backlog(KIND, written);
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(ROUND) => {}
            }
        }
    }

    /// Applies the object, then its status (a subresource), each with server-side apply.
    async fn apply(&mut self, want: ClusterProfile, version: String) {
        let name = want.name_any();
        let pp = PatchParams::apply(FIELD_MANAGER).force();
        let status = json!({
            "apiVersion": ClusterProfile::api_version(&()),
            "kind": ClusterProfile::kind(&()),
            "status": want.status,
        });
        let mut object = serde_json::to_value(&want).expect("a ClusterProfile serializes");
        if let Value::Object(map) = &mut object {
            map.remove("status");
        }
        let bytes = object.to_string().len() + status.to_string().len();
        let answer = async {
            self.api.patch(&name, &pp, &Patch::Apply(&object)).await?;
            let written = self
                .api
                .patch_status(&name, &pp, &Patch::Apply(&status))
                .await?;
            Ok((written.resource_version().unwrap_or_default(), bytes))
        }
        .await;
        let write = Write {
            key: name.clone(),
            digest: digest(&status),
            patch: status,
            version,
        };
        match self.gate.tracker.settle(write, answer, Instant::now()) {
            Ok(bytes) => {
                debug!(cluster = %name, bytes, "ClusterProfile written");
                self.metrics.written(KIND, bytes);
            }
            Err((failure, mut retry_in)) => {
                self.metrics.result(KIND, failure.label());
                if failure == Failure::Gone {
                    // Apply creates: a 404 is the namespace missing, worth a retry later.
                    retry_in = Some(self.gate.tracker.back_off(&name, Instant::now()));
                }
                let error = match &failure {
                    Failure::Rejected(e) | Failure::Transient(e) => e.to_string(),
                    other => other.label().to_owned(),
                };
                warn!(cluster = %name, namespace = %self.namespace, %error, ?retry_in, "cluster inventory: writing the ClusterProfile failed");
            }
        }
    }

    /// Deletes Flotilla's profile of a cluster no longer registered, this object only.
    async fn delete(&mut self, name: &str, uid: String) {
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..Default::default()
        };
        match self.api.delete(name, &dp).await {
            Ok(_) => {
                info!(cluster = %name, "cluster inventory: ClusterProfile deleted (the MemberCluster is gone)");
                self.gate.tracker.forget(&name.to_owned());
            }
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
            Err(e) => {
                warn!(cluster = %name, error = %e, "cluster inventory: deleting the ClusterProfile failed")
            }
        }
    }
}

#[cfg(test)]
mod tests;
