//! The status stays bounded whatever the number of clusters, and the division it keeps
//! reads back as the whole one.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use bytes::Bytes;
use flotilla_crds::federated::{FULL_LIST_MAX, FederatedMyAppStatus, SchedulingReason, URGENT_MAX};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use super::*;
use crate::render::RenderedMyApp;
use crate::schedule::{self, Assignment, Schedule};

/// 16 KiB: the largest status the design allows at 1,000 clusters.
const LIMIT: usize = 16 * 1024;

fn name(i: usize) -> String {
    format!("member{i:04}")
}

/// An app on `k` clusters, every one told `replicas` for `reason` (cluster 1 of every 3
/// failed over when `failed_over`).
fn wide(k: usize, replicas: u32, reason: SchedulingReason, failed_over: bool) -> AppPlan {
    let rendered = ClusterPlan::Apply(Arc::new(RenderedMyApp {
        hash: "h".into(),
        json: Bytes::new(),
    }));
    let mut plan = AppPlan {
        generation: Some(7),
        ..Default::default()
    };
    let mut schedule = Schedule {
        divided: reason != SchedulingReason::Duplicated,
        ..Default::default()
    };
    for i in 0..k {
        let over = failed_over && i % 3 == 1;
        let (p, reason) = if over {
            (
                ClusterPlan::Keep(KeepReason::FailedOver),
                SchedulingReason::FailedOver,
            )
        } else {
            (rendered.clone(), reason)
        };
        plan.clusters.insert(name(i).into(), p);
        let replicas = replicas + (i % 2) as u32;
        schedule
            .clusters
            .insert(name(i).into(), Assignment { replicas, reason });
    }
    plan.schedule = Some(schedule);
    plan
}

fn ready(ready: i32) -> Report {
    Report {
        hash: "h".into(),
        exists: true,
        ready: ready > 0,
        ready_replicas: ready,
        observed_generation: 1,
        generation: 1,
        ..Default::default()
    }
}

struct Case {
    reports: Reports,
    reachable: HashSet<String>,
}

impl Case {
    fn new(k: usize, report: impl Fn(usize) -> Option<Report>, reachable: bool) -> Case {
        Case {
            reports: (0..k)
                .filter_map(|i| Some((name(i).into(), report(i)?)))
                .collect(),
            reachable: if reachable {
                (0..k).map(name).collect()
            } else {
                HashSet::new()
            },
        }
    }

    fn inputs<'a>(&'a self, plan: &'a AppPlan) -> Inputs<'a> {
        Inputs {
            plan,
            deleting_on: None,
            reports: Some(&self.reports),
            reachable: &self.reachable,
        }
    }
}

fn now() -> Time {
    Time(Timestamp::from_second(1_700_000_000).unwrap())
}

fn bytes(s: &FederatedMyAppStatus) -> usize {
    serde_json::to_vec(s).unwrap().len()
}

#[test]
fn a_thousand_clusters_fit_in_16_kib_in_every_state() {
    let k = 1000;
    let error = "x".repeat(4096);
    let failing = |_| {
        Some(Report::default().with_words(Words {
            apply_error: Some(error.clone()),
            ..Words::default()
        }))
    };
    let half_ready = |i: usize| Some(ready((i % 2) as i32));
    let cases = [
        ("healthy", Case::new(k, |_| Some(ready(2)), true)),
        ("disconnected", Case::new(k, |_| Some(ready(2)), false)),
        ("4 KiB apply errors", Case::new(k, failing, true)),
        ("half not ready", Case::new(k, half_ready, true)),
        ("nothing reported", Case::new(k, |_| None, true)),
    ];
    let plans = [
        (
            "duplicated",
            wide(k, 2, SchedulingReason::Duplicated, false),
        ),
        (
            "weighted, failed over",
            wide(k, 1, SchedulingReason::Weight, true),
        ),
    ];
    for (what, case) in &cases {
        for (shape, plan) in &plans {
            let s = compute(&case.inputs(plan), None, &now());
            let size = bytes(&s);
            println!("{k} clusters, {shape}, {what}: {size} bytes");
            assert!(size <= LIMIT, "{shape}, {what}: {size} bytes");
            assert!(s.clusters.len() <= URGENT_MAX, "{shape}, {what}");
            assert_eq!(s.omitted_clusters as usize, k - s.clusters.len());
            assert!(
                s.conditions
                    .iter()
                    .all(|c| c.message.len() <= CONDITION_MESSAGE_MAX)
            );
            assert!(
                s.clusters
                    .iter()
                    .all(|c| c.message.len() <= CLUSTER_MESSAGE_MAX)
            );
            let counted = s.applied_clusters
                + s.pending_clusters
                + s.disconnected_clusters
                + s.failed_clusters;
            assert_eq!(
                counted, s.placed_clusters,
                "{shape}, {what}: every placed cluster counted once"
            );
        }
    }
}

#[test]
fn up_to_fifty_clusters_every_one_is_listed_as_before() {
    for k in [1, FULL_LIST_MAX] {
        let plan = wide(k, 2, SchedulingReason::Weight, false);
        let case = Case::new(k, |_| Some(ready(2)), true);
        let s = compute(&case.inputs(&plan), None, &now());
        assert_eq!(s.clusters.len(), k);
        assert_eq!((s.omitted_clusters, s.division.len()), (0, 0));
        assert_eq!(
            s,
            detail(&case.inputs(&plan), None, &now()),
            "nothing to leave out"
        );
    }
    let k = FULL_LIST_MAX + 1;
    let plan = wide(k, 2, SchedulingReason::Weight, false);
    let case = Case::new(k, |_| Some(ready(2)), true);
    let s = compute(&case.inputs(&plan), None, &now());
    assert!(s.clusters.is_empty(), "every cluster fine: none is urgent");
    assert_eq!(s.omitted_clusters as usize, k);
    assert_eq!((s.placed_clusters, s.ready_clusters), (k as i32, k as i32));
}

/// Make before break reads the previous division: the bounded status must give exactly
/// what the whole list gives, in every mix of replicas, readiness and failover.
#[test]
fn the_bounded_status_reads_back_the_whole_previous_division() {
    let k = 300;
    for (plan, case) in [
        (
            wide(k, 3, SchedulingReason::Weight, true),
            Case::new(k, |i| Some(ready((i % 4) as i32)), true),
        ),
        (
            wide(k, 1, SchedulingReason::Duplicated, false),
            Case::new(k, |i| (i % 5 != 0).then(|| ready(1)), false),
        ),
    ] {
        let bounded = compute(&case.inputs(&plan), None, &now());
        let whole = detail(&case.inputs(&plan), None, &now());
        assert!(bounded.omitted_clusters > 0);
        assert_eq!(whole.clusters.len(), k);
        let (from_bounded, from_whole) = (
            schedule::previous(Some(&bounded)),
            schedule::previous(Some(&whole)),
        );
        let nonzero: BTreeMap<_, _> = from_whole
            .into_iter()
            .filter(|(_, p)| *p != schedule::Previous::default())
            .collect();
        assert_eq!(from_bounded, nonzero);
        assert_eq!(bounded.replicas, whole.replicas);
        assert_eq!(bounded.ready_replicas, whole.ready_replicas);
        // Round trip through JSON, as the apiserver stores it.
        let stored: FederatedMyAppStatus =
            serde_json::from_slice(&serde_json::to_vec(&bounded).unwrap()).unwrap();
        assert_eq!(schedule::previous(Some(&stored)), from_bounded);
    }
}

#[test]
fn the_most_urgent_clusters_are_listed_first() {
    let k = 100;
    let plan = wide(k, 2, SchedulingReason::Duplicated, false);
    // member0090.. failed to apply, member0050..0089 not reported, the rest ready.
    let case = Case::new(
        k,
        |i| match i {
            90.. => Some(Report::default().with_words(Words {
                apply_error: Some("denied".into()),
                ..Words::default()
            })),
            50..=89 => None,
            _ => Some(ready(2)),
        },
        true,
    );
    let s = compute(&case.inputs(&plan), None, &now());
    let listed: Vec<&str> = s.clusters.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(listed.len(), URGENT_MAX);
    assert_eq!(listed[0], "member0090");
    assert_eq!(listed[10], "member0050", "apply errors, then pending");
    assert_eq!(
        (s.failed_clusters, s.pending_clusters, s.applied_clusters),
        (10, 40, 50)
    );
    let propagated = s
        .conditions
        .iter()
        .find(|c| c.type_ == "Propagated")
        .unwrap();
    assert_eq!(propagated.reason, "ApplyFailed");
    assert!(
        propagated
            .message
            .starts_with("member0090: applying the MyApp failed")
    );
    assert!(
        propagated.message.ends_with(" more"),
        "{}",
        propagated.message
    );
    assert!(propagated.message.len() <= CONDITION_MESSAGE_MAX);
}

#[test]
fn messages_are_joined_within_the_limit() {
    let items = |n: usize| (0..n).map(|i| format!("c{i}: down")).collect::<Vec<_>>();
    assert_eq!(join_capped(items(2), "; ", 100), "c0: down; c1: down");
    assert_eq!(join_capped(items(5), "; ", 30), "c0: down; … and 4 more");
    assert_eq!(
        join_capped(items(5), "; ", 40),
        "c0: down; c1: down; … and 3 more"
    );
    assert_eq!(join_capped(vec![], "; ", 40), "");
    // A first item too long for the limit is cut to leave room for the count of the rest.
    let long = vec!["y".repeat(100), "z".repeat(30)];
    let joined = join_capped(long, "; ", 40);
    assert!(
        joined.len() <= 40 && joined.ends_with("y…; … and 1 more"),
        "{joined}"
    );
    assert_eq!(cut("ééé".into(), 4), "…", "never splits a character");
    assert_eq!(cut("abc".into(), 3), "abc");
}
