//! The convergence checker: from the host's FederatedMyApps and MemberClusters, what
//! every member must run (computed with the hub's own planning, `flotilla_plan::plan`),
//! compared with the managed MyApps each member actually has. Every difference is
//! reported in words. A progressive app is gated as the hub gates it
//! (`flotilla_plan::rollout::gate`), from what the members run, each seen Ready only
//! since now: a cluster the hub may still hold is never a difference, a cluster of an
//! open wave or one already on the revision must run exactly its render.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use flotilla_crds::{
    ClusterGrant, FederatedMyApp, HASH_ANNOTATION, MANAGED_BY_LABEL, MANAGED_BY_VALUE,
    MemberCluster,
};
use flotilla_plan::admission::Admission;
use flotilla_plan::grants::Grants;
use flotilla_plan::placement::{self, Members};
use flotilla_plan::rollout::{self, Observed, Seen};
use flotilla_plan::{ClusterPlan, plan};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::{Client, ResourceExt};
use serde_json::Value;

use flotilla_lab::Env;

/// A MyApp's `namespace/name`, the same on the host and every member.
pub type Key = String;

/// What one member must have for one app.
#[derive(Debug, Clone, PartialEq)]
pub enum Want {
    /// Exactly this: the rendered content hash and spec.
    Exactly { hash: String, spec: Value },
    /// Whatever it has, or nothing: placed there but not renderable (the hub keeps it).
    Any,
}

/// What a member has: each managed MyApp's content-hash annotation and spec, and whether
/// an autoscaler there scales it (its `spec.replicas` are then the autoscaler's, not the
/// render's).
#[derive(Debug, Clone, PartialEq)]
pub struct Have {
    pub hash: Option<String>,
    pub spec: Value,
    pub autoscaled: bool,
    /// Its status says Ready at its current generation.
    pub ready: bool,
}

/// cluster → key → want. A key absent for a cluster means: no managed MyApp there.
pub type DesiredState = BTreeMap<String, BTreeMap<Key, Want>>;
/// cluster → key → have.
pub type ActualState = BTreeMap<String, BTreeMap<Key, Have>>;

/// The outcome of one comparison.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// (cluster, app) pairs that run exactly what they must.
    pub converged: usize,
    /// Every difference, in words, sorted.
    pub differences: Vec<String>,
}

impl Report {
    pub fn is_converged(&self) -> bool {
        self.differences.is_empty()
    }
}

/// The registered clusters as the hub sees them: the hub's own reading.
pub fn members_of(clusters: &[MemberCluster]) -> Members {
    placement::registered_of(clusters)
}

/// What each of `clusters` must run, from the host's apps, registered members and
/// ClusterGrants. An app being deleted is wanted nowhere (its copies go, or are released
/// and so no longer managed); a cluster the hub does not know about is wanted to run
/// nothing managed; a cluster not granted keeps whatever it has.
pub fn desired(
    apps: &[FederatedMyApp],
    (members, grants): (&Members, &Grants),
    clusters: &[&str],
    actual: &ActualState,
) -> DesiredState {
    let now = Instant::now();
    let mut out: DesiredState = clusters
        .iter()
        .map(|c| (c.to_string(), BTreeMap::new()))
        .collect();
    for app in apps {
        if app.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let key = format!(
            "{}/{}",
            app.namespace().unwrap_or_else(|| "default".into()),
            app.name_any()
        );
        let mut planned = plan(app, members, &Admission::default(), grants);
        if rollout::progressive(app) {
            let observed = observed(actual, &key, now);
            rollout::gate(app, &mut planned, members, &observed, now);
        }
        for (cluster, planned) in planned.clusters {
            let want = match planned {
                ClusterPlan::Apply(r) => {
                    let mut value = r.to_value();
                    Want::Exactly {
                        hash: r.hash.clone(),
                        spec: value["spec"].take(),
                    }
                }
                ClusterPlan::Keep(_) => Want::Any,
                ClusterPlan::Unknown => continue,
            };
            if let Some(wants) = out.get_mut(&*cluster) {
                wants.insert(key.clone(), want);
            }
        }
    }
    out
}

/// What the members run of one app, as the gate reads it: each seen since `now`.
fn observed(actual: &ActualState, key: &str, now: Instant) -> Observed {
    let have = actual
        .iter()
        .filter_map(|(c, apps)| Some((c, apps.get(key)?)));
    have.map(|(cluster, have)| {
        let seen = Seen {
            hash: have.hash.as_deref().unwrap_or_default().into(),
            ready: have.ready,
            degraded: None,
            apply_error: None,
            since: now,
        };
        (cluster.as_str().into(), seen)
    })
    .collect()
}

/// Compares desired and actual state cluster by cluster. Pure.
pub fn compare(desired: &DesiredState, actual: &ActualState) -> Report {
    let mut report = Report::default();
    let none = BTreeMap::new();
    for (cluster, wants) in desired {
        let has = actual.get(cluster).unwrap_or(&none);
        for (key, want) in wants {
            match (want, has.get(key)) {
                (Want::Any, _) => {}
                (Want::Exactly { hash, .. }, None) => report.differences.push(format!(
                    "{cluster}: MyApp {key} is missing (want content hash {})",
                    short(hash)
                )),
                (Want::Exactly { hash, spec }, Some(have)) => {
                    let mut wrong = Vec::new();
                    if have.hash.as_deref() != Some(hash.as_str()) {
                        wrong.push(format!(
                            "content hash {} (want {})",
                            have.hash.as_deref().map_or("absent", short),
                            short(hash)
                        ));
                    }
                    if !same_spec(have, spec) {
                        wrong.push(format!("spec {} (want {spec})", have.spec));
                    }
                    if wrong.is_empty() {
                        report.converged += 1;
                    } else {
                        report.differences.push(format!(
                            "{cluster}: MyApp {key} has {}",
                            wrong.join(" and ")
                        ));
                    }
                }
            }
        }
        for (key, have) in has {
            if !wants.contains_key(key) {
                report.differences.push(format!(
                    "{cluster}: MyApp {key} is managed by Flotilla but not desired there (content hash {})",
                    have.hash.as_deref().map_or("absent", short)
                ));
            }
        }
    }
    for cluster in actual.keys().filter(|c| !desired.contains_key(*c)) {
        report.differences.push(format!(
            "{cluster}: not a cluster the checker was asked about"
        ));
    }
    report.differences.sort();
    report
}

/// The spec a member has is the rendered one, but for the replicas of an autoscaled
/// MyApp: those are the autoscaler's.
fn same_spec(have: &Have, want: &Value) -> bool {
    let without_replicas = |spec: &Value| {
        let mut spec = spec.clone();
        if let Some(fields) = spec.as_object_mut() {
            fields.remove("replicas");
        }
        spec
    };
    if have.autoscaled {
        without_replicas(&have.spec) == without_replicas(want)
    } else {
        &have.spec == want
    }
}

fn short(hash: &str) -> &str {
    hash.get(..12).unwrap_or(hash)
}

/// The MyApp v1 resource, read raw so that the spec is compared as the apiserver stores it.
pub fn myapp_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("app.example.com", "v1", "MyApp"),
        "myapps",
    )
}

/// The label selector of the MyApps Flotilla manages.
pub fn managed_selector() -> String {
    format!("{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}")
}

/// Every managed MyApp of one member.
pub async fn managed_myapps(client: &Client) -> Result<BTreeMap<Key, Have>> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &myapp_resource());
    let list = api
        .list(&ListParams::default().labels(&managed_selector()))
        .await?;
    Ok(list
        .items
        .into_iter()
        .map(|o| {
            let key = format!("{}/{}", o.namespace().unwrap_or_default(), o.name_any());
            let status = o.data.get("status");
            let observed = status.and_then(|s| s["observedGeneration"].as_i64());
            let current = observed.is_some_and(|g| Some(g) >= o.metadata.generation);
            let have = Have {
                hash: o.annotations().get(HASH_ANNOTATION).cloned(),
                spec: o.data.get("spec").cloned().unwrap_or(Value::Null),
                autoscaled: false,
                ready: current && status.is_some_and(|s| s["ready"] == Value::Bool(true)),
            };
            (key, have)
        })
        .collect())
}

/// The MyApps (`namespace/name`) a HorizontalPodAutoscaler of the member scales.
pub async fn autoscaled_myapps(client: &Client) -> Result<BTreeSet<Key>> {
    let api: Api<HorizontalPodAutoscaler> = Api::all(client.clone());
    let list = api.list(&ListParams::default()).await?;
    Ok(list
        .items
        .iter()
        .filter_map(|hpa| {
            let target = &hpa.spec.as_ref()?.scale_target_ref;
            let myapp = target.kind == "MyApp"
                && target
                    .api_version
                    .as_deref()
                    .is_some_and(|v| v.starts_with("app.example.com/"));
            myapp.then(|| format!("{}/{}", hpa.namespace().unwrap_or_default(), target.name))
        })
        .collect())
}

/// One comparison of the whole environment, now.
pub async fn check(env: &Env) -> Result<Report> {
    let host = env.client(env.host()).await?;
    let apps = Api::<FederatedMyApp>::all(host.clone())
        .list(&ListParams::default())
        .await
        .context("listing FederatedMyApps on the host")?
        .items;
    let clusters = Api::<MemberCluster>::all(host.clone())
        .list(&ListParams::default())
        .await
        .context("listing MemberClusters on the host")?
        .items;
    // The environment's hub runs in the default mode (a namespace without a grant
    // places everywhere).
    let grants = Api::<ClusterGrant>::all(host)
        .list(&ListParams::default())
        .await
        .context("listing ClusterGrants on the host")?
        .items;
    let grants = Grants::new(false, &grants);
    let members = env.members();
    let mut have = ActualState::new();
    for m in &members {
        let client = env.client(m).await?;
        let mut managed = managed_myapps(&client)
            .await
            .with_context(|| format!("listing managed MyApps on {m}"))?;
        let autoscaled = autoscaled_myapps(&client)
            .await
            .with_context(|| format!("listing HorizontalPodAutoscalers on {m}"))?;
        for (key, have) in &mut managed {
            have.autoscaled = autoscaled.contains(key);
        }
        have.insert(m.to_string(), managed);
    }
    let want = desired(&apps, (&members_of(&clusters), &grants), &members, &have);
    Ok(compare(&want, &have))
}

/// Polls [`check`] until the environment has converged; `Ok((report, time taken))`, or an
/// error listing what still differs after `timeout`.
pub async fn wait_converged(env: &Env, timeout: Duration) -> Result<(Report, Duration)> {
    let start = Instant::now();
    let mut last: Option<Result<Report>> = None;
    while start.elapsed() < timeout {
        let report = check(env).await;
        if let Ok(r) = &report
            && r.is_converged()
        {
            return Ok((r.clone(), start.elapsed()));
        }
        last = Some(report);
        tokio::time::sleep(flotilla_lab::wait::POLL).await;
    }
    match last {
        Some(Ok(r)) => anyhow::bail!(
            "not converged after {timeout:?}; {} pairs converged, {} differences:\n  {}",
            r.converged,
            r.differences.len(),
            r.differences.join("\n  ")
        ),
        Some(Err(e)) => Err(e.context(format!("not converged after {timeout:?}"))),
        None => anyhow::bail!("not converged: no check ran within {timeout:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn app(name: &str, value: Value) -> FederatedMyApp {
        let mut v = json!({
            "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
            "metadata": {"name": name, "namespace": "default"},
        });
        v["spec"] = value;
        serde_json::from_value(v).unwrap()
    }

    fn members(names: &[(&str, &[(&str, &str)])]) -> Members {
        names
            .iter()
            .map(|(n, labels)| {
                let labels = labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
                ((*n).into(), placement::Member::with_labels(labels))
            })
            .collect()
    }

    fn exactly(d: &DesiredState, cluster: &str, key: &str) -> (String, Value) {
        match &d[cluster][key] {
            Want::Exactly { hash, spec } => (hash.clone(), spec.clone()),
            other => panic!("{cluster} {key}: {other:?}"),
        }
    }

    fn have(hash: &str, spec: Value) -> Have {
        Have {
            hash: Some(hash.into()),
            spec,
            autoscaled: false,
            ready: false,
        }
    }

    /// A progressive app: the cluster the hub may still hold is no difference whatever
    /// it runs; once it runs the revision it must run exactly its render.
    #[test]
    fn a_cluster_the_rollout_may_hold_is_no_difference() {
        let rolled = app(
            "web",
            json!({"placement": {"clusters": [{"name": "a"}, {"name": "b"}]},
                   "template": {"spec": {"replicas": 2, "image": "nginx:2"}},
                   "rollout": {"type": "Progressive", "maxConcurrency": 1, "minSuccessSeconds": 30}}),
        );
        let m = members(&[("a", &[]), ("b", &[])]);
        let nothing = desired(
            std::slice::from_ref(&rolled),
            (&m, &Grants::default()),
            &["a", "b"],
            &ActualState::new(),
        );
        let (hash, spec) = exactly(&nothing, "a", "default/web");
        assert_eq!(nothing["b"]["default/web"], Want::Any, "held until a soaks");
        let old = have(
            "0123456789abcdef-old",
            json!({"replicas": 2, "image": "nginx:1"}),
        );
        let new = Have {
            ready: true,
            ..have(&hash, spec.clone())
        };
        let actual: ActualState = BTreeMap::from([
            (
                "a".into(),
                BTreeMap::from([("default/web".into(), new.clone())]),
            ),
            ("b".into(), BTreeMap::from([("default/web".into(), old)])),
        ]);
        let d = desired(
            std::slice::from_ref(&rolled),
            (&m, &Grants::default()),
            &["a", "b"],
            &actual,
        );
        assert!(
            compare(&d, &actual).is_converged(),
            "{:?}",
            compare(&d, &actual)
        );
        // b runs the revision with the wrong replicas: now a difference.
        let wrong = have(&hash, json!({"replicas": 7, "image": "nginx:2"}));
        let actual: ActualState = BTreeMap::from([
            ("a".into(), BTreeMap::from([("default/web".into(), new)])),
            ("b".into(), BTreeMap::from([("default/web".into(), wrong)])),
        ]);
        let d = desired(
            std::slice::from_ref(&rolled),
            (&m, &Grants::default()),
            &["a", "b"],
            &actual,
        );
        assert_eq!(compare(&d, &actual).differences.len(), 1);
    }

    #[test]
    fn desired_follows_placement_overrides_and_the_hubs_hash() {
        let seed: FederatedMyApp =
            serde_yaml::from_str(include_str!("../../examples/federatedmyapp.yaml")).unwrap();
        let m = members(&[("cluster1", &[]), ("cluster2", &[]), ("cluster3", &[])]);
        let d = desired(
            std::slice::from_ref(&seed),
            (&m, &Grants::default()),
            &["cluster1", "cluster2", "cluster3"],
            &ActualState::new(),
        );
        let (h1, s1) = exactly(&d, "cluster1", "default/my-app-sample");
        let (h2, s2) = exactly(&d, "cluster2", "default/my-app-sample");
        assert_eq!(s1, json!({"replicas": 3}));
        assert_eq!(s2, json!({"replicas": 5}));
        assert_ne!(h1, h2);
        assert!(d["cluster3"].is_empty(), "not placed there");
        // The hash is the hub's: the same as `render` gives for that cluster.
        let planned = plan(&seed, &m, &Admission::default(), &Grants::default());
        assert_eq!(planned.clusters["cluster1"].rendered().unwrap().hash, h1);
    }

    #[test]
    fn unrenderable_is_any_deleting_is_nowhere_unregistered_is_nothing() {
        let bad = app(
            "bad",
            json!({"placement": {"clusters": [{"name": "a"}, {"name": "b"}, {"name": "ghost"}]},
                   "template": {"spec": {"replicas": 2, "image": "x:1"}},
                   "overrides": [{"clusterName": "b", "clusterOverrides": [{"path": "/spec/replicas", "value": 11}]}]}),
        );
        let mut going = app(
            "going",
            json!({"placement": {"clusters": [{"name": "a"}]}, "template": {"spec": {"replicas": 1}}}),
        );
        going.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        let m = members(&[("a", &[]), ("b", &[])]);
        let d = desired(
            &[bad, going],
            (&m, &Grants::default()),
            &["a", "b", "unregistered"],
            &ActualState::new(),
        );
        assert!(matches!(d["a"]["default/bad"], Want::Exactly { .. }));
        assert_eq!(d["b"]["default/bad"], Want::Any);
        assert!(!d["a"].contains_key("default/going"));
        assert!(d["unregistered"].is_empty());
        assert!(!d.contains_key("ghost"), "only the clusters asked about");
    }

    #[test]
    fn a_selector_follows_member_labels() {
        let sel = app(
            "sel",
            json!({"placement": {"clusterSelector": {"matchLabels": {"region": "eu"}}},
                   "template": {"spec": {"replicas": 1}}}),
        );
        let m = members(&[("a", &[("region", "eu")]), ("b", &[("region", "us")])]);
        let d = desired(
            &[sel],
            (&m, &Grants::default()),
            &["a", "b"],
            &ActualState::new(),
        );
        assert!(d["a"].contains_key("default/sel"));
        assert!(d["b"].is_empty());
    }

    #[test]
    fn being_deleted_members_are_not_registered() {
        let mut gone: MemberCluster =
            serde_json::from_value(json!({"metadata": {"name": "gone"}, "spec": {}})).unwrap();
        gone.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        let kept: MemberCluster = serde_json::from_value(
            json!({"metadata": {"name": "kept", "labels": {"x": "y"}}, "spec": {}}),
        )
        .unwrap();
        let m = members_of(&[gone, kept]);
        assert_eq!(m.keys().map(|c| &**c).collect::<Vec<_>>(), ["kept"]);
        assert_eq!(m["kept"].labels["x"], "y");
    }

    #[test]
    fn compare_counts_matches_and_words_every_difference() {
        let spec = json!({"replicas": 2});
        let want = |h: &str| Want::Exactly {
            hash: h.into(),
            spec: spec.clone(),
        };
        let desired: DesiredState = BTreeMap::from([
            (
                "c1".into(),
                BTreeMap::from([
                    ("ns/ok".into(), want("aaaaaaaaaaaaaaaa")),
                    ("ns/missing".into(), want("bbbbbbbbbbbbbbbb")),
                    ("ns/stale".into(), want("cccccccccccccccc")),
                    ("ns/drifted".into(), want("dddddddddddddddd")),
                    ("ns/any".into(), Want::Any),
                ]),
            ),
            ("c2".into(), BTreeMap::new()),
        ]);
        let actual: ActualState = BTreeMap::from([
            (
                "c1".into(),
                BTreeMap::from([
                    ("ns/ok".into(), have("aaaaaaaaaaaaaaaa", spec.clone())),
                    ("ns/stale".into(), have("0000000000000000", spec.clone())),
                    (
                        "ns/drifted".into(),
                        have("dddddddddddddddd", json!({"replicas": 5})),
                    ),
                ]),
            ),
            (
                "c2".into(),
                BTreeMap::from([(
                    "ns/extra".into(),
                    Have {
                        hash: None,
                        spec: Value::Null,
                        autoscaled: false,
                        ready: false,
                    },
                )]),
            ),
            ("c3".into(), BTreeMap::new()),
        ]);
        let r = compare(&desired, &actual);
        assert_eq!(r.converged, 1);
        assert_eq!(
            r.differences,
            [
                "c1: MyApp ns/drifted has spec {\"replicas\":5} (want {\"replicas\":2})",
                "c1: MyApp ns/missing is missing (want content hash bbbbbbbbbbbb)",
                "c1: MyApp ns/stale has content hash 000000000000 (want cccccccccccc)",
                "c2: MyApp ns/extra is managed by Flotilla but not desired there (content hash absent)",
                "c3: not a cluster the checker was asked about",
            ]
        );
        assert!(!r.is_converged());
    }

    /// An autoscaler's replicas are no difference; any other field still is.
    #[test]
    fn an_autoscaled_myapps_replicas_are_the_autoscalers() {
        let want = |spec: Value| Want::Exactly {
            hash: "aaaaaaaaaaaaaaaa".into(),
            spec,
        };
        let desired: DesiredState = BTreeMap::from([(
            "c1".into(),
            BTreeMap::from([
                (
                    "ns/scaled".into(),
                    want(json!({"replicas": 2, "image": "a:1"})),
                ),
                (
                    "ns/changed".into(),
                    want(json!({"replicas": 2, "image": "a:1"})),
                ),
            ]),
        )]);
        let scaled = |spec| Have {
            autoscaled: true,
            ..have("aaaaaaaaaaaaaaaa", spec)
        };
        let actual: ActualState = BTreeMap::from([(
            "c1".into(),
            BTreeMap::from([
                (
                    "ns/scaled".into(),
                    scaled(json!({"replicas": 4, "image": "a:1"})),
                ),
                (
                    "ns/changed".into(),
                    scaled(json!({"replicas": 4, "image": "a:2"})),
                ),
            ]),
        )]);
        let r = compare(&desired, &actual);
        assert_eq!(r.converged, 1);
        assert_eq!(r.differences.len(), 1, "{:?}", r.differences);
        assert!(r.differences[0].starts_with("c1: MyApp ns/changed has spec"));
    }

    #[test]
    fn nothing_wanted_and_nothing_had_is_converged() {
        let desired: DesiredState = BTreeMap::from([("c1".into(), BTreeMap::new())]);
        assert_eq!(compare(&desired, &ActualState::new()), Report::default());
        assert!(compare(&DesiredState::new(), &ActualState::new()).is_converged());
        // A cluster that answered nothing (absent from actual) misses what it must run.
        let desired: DesiredState = BTreeMap::from([(
            "c1".into(),
            BTreeMap::from([(
                "ns/a".into(),
                Want::Exactly {
                    hash: "h".into(),
                    spec: json!({}),
                },
            )]),
        )]);
        let r = compare(&desired, &ActualState::new());
        assert_eq!(
            r.differences,
            ["c1: MyApp ns/a is missing (want content hash h)"]
        );
    }
}
