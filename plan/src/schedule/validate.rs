//! Validate: the scheduling fields of one FederatedMyApp, checked before anything is
//! divided. Each error names the field to change and says why.

use std::time::Duration;

use flotilla_crds::FederatedMyApp;
use flotilla_crds::federated::{ClusterPreference, Placement, RecoveryPolicy, SpreadConstraints};
use flotilla_crds::member::Resources;
use kube::core::{Selector, SelectorExt};

use super::{
    DEFAULT_GRACE, DEFAULT_REQUEST, MAX_PER_CLUSTER, RS, SPREAD, ScheduleError, Strategy, err,
};
use crate::placement::{self, Member};

/// The scheduling fields, checked.
pub(super) struct Rules<'p> {
    pub prefs: Vec<Pref<'p>>,
    pub spread: Spread,
    /// `None`: Duplicated.
    pub strategy: Option<Strategy>,
    /// Only under a divided mode: Duplicated renders for every cluster as it always did.
    pub failover: Option<Failover>,
    /// `replicaScheduling.totalReplicas`, not negative.
    pub total_replicas: Option<i32>,
}

impl Rules<'_> {
    /// The replicas a divided mode shares out: the total, else the template's, else 1.
    pub fn total(&self, template_replicas: Option<i32>) -> u32 {
        self.total_replicas
            .or(template_replicas)
            .unwrap_or(1)
            .max(0) as u32
    }
}

/// What failover does with a NotReady cluster.
#[derive(Debug, Clone, Copy)]
pub(super) struct Failover {
    /// How long a cluster may be NotReady before its share moves.
    pub grace: Duration,
    /// `onRecovery: Stay`: replicas stay where they moved until the spec changes.
    pub stay: bool,
}

/// One preference, checked and with its matcher.
pub(super) struct Pref<'p> {
    pub raw: &'p ClusterPreference,
    selector: Option<Selector>,
}

impl Pref<'_> {
    pub fn matches(&self, name: &str, member: &Member) -> bool {
        let named = self.raw.cluster_names.iter().any(|n| n == name);
        let selected = self
            .selector
            .as_ref()
            .is_some_and(|s| s.matches(&member.labels));
        named || selected || (self.raw.cluster_names.is_empty() && self.selector.is_none())
    }
}

#[derive(Debug, Default)]
pub(super) struct Spread {
    pub min_clusters: usize,
    pub max_clusters: Option<usize>,
    pub by_label: Option<String>,
    pub min_groups: usize,
}

/// Checks the preferences, the spread and the total, in that order.
pub(super) fn rules(placement: &Placement) -> Result<Rules<'_>, ScheduleError> {
    let scheduling = placement.replica_scheduling.as_ref();
    let prefs = checked_prefs(scheduling.map_or(&[], |r| r.preferences.as_slice()))?;
    let spread = checked_spread(placement.spread.as_ref())?;
    let strategy = scheduling.and_then(|r| Strategy::of(r.mode));
    let failover = placement
        .failover
        .as_ref()
        .filter(|_| strategy.is_some())
        .map(|f| Failover {
            grace: f
                .grace_period_seconds
                .map_or(DEFAULT_GRACE, |s| Duration::from_secs(s.max(0) as u64)),
            stay: f.on_recovery == RecoveryPolicy::Stay,
        });
    let total_replicas = scheduling.and_then(|r| r.total_replicas);
    if let Some(t) = total_replicas.filter(|t| *t < 0) {
        return Err(err(
            format!("{RS}.totalReplicas"),
            format!("{t} is negative"),
        ));
    }
    Ok(Rules {
        prefs,
        spread,
        strategy,
        failover,
        total_replicas,
    })
}

fn checked_prefs(prefs: &[ClusterPreference]) -> Result<Vec<Pref<'_>>, ScheduleError> {
    prefs
        .iter()
        .enumerate()
        .map(|(k, raw)| {
            let field = format!("{RS}.preferences[{k}]");
            let selector = raw
                .cluster_selector
                .as_ref()
                .map(|s| placement::parse_selector(s, &format!("{field}.clusterSelector")))
                .transpose()
                .map_err(|e| err(e.field, e.reason))?;
            checked_bounds(raw, &field)?;
            Ok(Pref { raw, selector })
        })
        .collect()
}

/// A preference's weight and bounds: not negative, within the MyApp's limit, in order.
fn checked_bounds(raw: &ClusterPreference, field: &str) -> Result<(), ScheduleError> {
    for (name, v) in [
        ("weight", raw.weight),
        ("minReplicas", raw.min_replicas),
        ("maxReplicas", raw.max_replicas),
    ] {
        if v.is_some_and(|v| v < 0) {
            return Err(err(format!("{field}.{name}"), "must not be negative"));
        }
    }
    let (min, max) = (raw.min_replicas.unwrap_or(0), raw.max_replicas);
    if min > MAX_PER_CLUSTER as i32 {
        return Err(err(
            format!("{field}.minReplicas"),
            format!("{min} is above the MyApp's limit of {MAX_PER_CLUSTER} per cluster"),
        ));
    }
    if let Some(max) = max.filter(|max| *max < min) {
        return Err(err(
            format!("{field}.maxReplicas"),
            format!("{max} is below minReplicas {min}"),
        ));
    }
    Ok(())
}

fn checked_spread(spread: Option<&SpreadConstraints>) -> Result<Spread, ScheduleError> {
    let Some(s) = spread else {
        return Ok(Spread::default());
    };
    let count = |name: &str, v: Option<i32>| match v {
        Some(n) if n < 0 => Err(err(format!("{SPREAD}.{name}"), "must not be negative")),
        v => Ok(v.map(|n| n as usize)),
    };
    let out = Spread {
        min_clusters: count("minClusters", s.min_clusters)?.unwrap_or(0),
        max_clusters: count("maxClusters", s.max_clusters)?,
        by_label: s.spread_by_label.clone().filter(|l| !l.is_empty()),
        min_groups: count("minGroups", s.min_groups)?.unwrap_or(0),
    };
    if out.max_clusters == Some(0) {
        return Err(err(format!("{SPREAD}.maxClusters"), "must be at least 1"));
    }
    if let Some(max) = out.max_clusters.filter(|max| *max < out.min_clusters) {
        return Err(err(
            format!("{SPREAD}.maxClusters"),
            format!("{max} is below minClusters {}", out.min_clusters),
        ));
    }
    if out.min_groups > 0 && out.by_label.is_none() {
        return Err(err(
            format!("{SPREAD}.spreadByLabel"),
            "minGroups needs a label to group by",
        ));
    }
    Ok(out)
}

/// One replica's requests (Capacity reads them), each missing resource at the
/// kube-scheduler's default.
pub(super) fn request_of(app: &FederatedMyApp) -> Result<Resources, ScheduleError> {
    let requests = app.spec.template.spec.workload.resources.as_ref();
    let Some(list) = requests.and_then(|r| r.requests.as_ref()) else {
        return Ok(DEFAULT_REQUEST);
    };
    let r = Resources::from_list(list).map_err(|e| ScheduleError {
        field: "spec.template.spec.resources.requests".into(),
        reason: e.to_string(),
    })?;
    Ok(Resources {
        cpu_millis: if r.cpu_millis > 0 {
            r.cpu_millis
        } else {
            DEFAULT_REQUEST.cpu_millis
        },
        memory_bytes: if r.memory_bytes > 0 {
            r.memory_bytes
        } else {
            DEFAULT_REQUEST.memory_bytes
        },
    })
}
