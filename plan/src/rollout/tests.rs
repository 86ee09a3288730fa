//! The gate against ugly inputs first, then by property.

use std::time::{Duration, Instant};

use flotilla_crds::FederatedMyApp;
use proptest::prelude::*;

use super::*;
use crate::admission::Admission;
use crate::grants::Grants;
use crate::index::Desired;
use crate::placement::Member;
use crate::plan::plan;
use crate::render::{REVISION_LEN, revisioned_hash};

const SOAK: u64 = 30;
const DEADLINE: u64 = 60;

/// An app on `clusters` with `rollout` (YAML flow mapping) and `image`.
fn app(clusters: &[&str], rollout: &str, image: &str, replicas: u32) -> FederatedMyApp {
    let named: Vec<String> = clusters.iter().map(|c| format!("{{name: {c}}}")).collect();
    serde_yaml::from_str(&format!(
        "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {{name: web, namespace: prod, generation: 1}}\n\
         spec:\n  placement: {{clusters: [{}]}}\n  template: {{spec: {{replicas: {replicas}, image: '{image}'}}}}\n  rollout: {rollout}\n",
        named.join(", ")
    ))
    .expect("valid FederatedMyApp YAML")
}

fn progressive(clusters: &[&str], max: &str, image: &str) -> FederatedMyApp {
    let rollout = format!(
        "{{type: Progressive, maxConcurrency: {max}, minSuccessSeconds: {SOAK}, progressDeadlineSeconds: {DEADLINE}}}"
    );
    app(clusters, &rollout, image, 2)
}

/// Registered clusters with `wave` labels: `(name, wave)`.
fn members(clusters: &[(&str, &str)]) -> Members {
    clusters
        .iter()
        .map(|(n, w)| {
            let labels = [("wave".to_owned(), (*w).to_owned())].into();
            ((*n).into(), Member::with_labels(labels))
        })
        .collect()
}

fn plain(names: &[&str]) -> Members {
    members(&names.iter().map(|n| (*n, "")).collect::<Vec<_>>())
}

/// The hash `app` renders for `cluster`, ungated.
fn hash_for(app: &FederatedMyApp, members: &Members, cluster: &str) -> String {
    let p = plan(app, members, &Admission::default(), &Grants::default());
    p.clusters[cluster]
        .rendered()
        .expect("rendered")
        .hash
        .clone()
}

fn seen(hash: &str, ready: bool, since: Instant) -> Seen {
    Seen {
        hash: hash.into(),
        ready,
        degraded: None,
        apply_error: None,
        since,
    }
}

/// Gates `app` at `now`: the plan, and when to look again.
fn gated(
    app: &FederatedMyApp,
    members: &Members,
    observed: &Observed,
    now: Instant,
) -> (AppPlan, Option<Duration>) {
    let mut p = plan(app, members, &Admission::default(), &Grants::default());
    let recheck = gate(app, &mut p, members, observed, now);
    (p, recheck)
}

fn held(p: &AppPlan) -> Vec<&str> {
    (p.clusters.iter())
        .filter(|(_, c)| matches!(c, ClusterPlan::Keep(KeepReason::Held { .. })))
        .map(|(n, _)| &**n)
        .collect()
}

fn state(p: &AppPlan) -> (&str, i32, i32) {
    let r = p.rollout.as_ref().expect("a rollout status");
    (r.state.as_str(), r.wave, r.waves)
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn no_placed_cluster_is_a_complete_rollout_of_no_wave() {
    let now = Instant::now();
    let a = progressive(&[], "1", "nginx:2");
    let (p, recheck) = gated(&a, &plain(&["c1"]), &Observed::new(), now);
    assert_eq!(state(&p), ("Complete", 0, 0));
    assert!(held(&p).is_empty());
    assert_eq!(recheck, None);
}

#[test]
fn max_concurrency_below_one_or_unreadable_is_one_cluster_a_wave_with_a_warning() {
    for bad in ["0", "-3", "'0%'", "'-5%'", "'abc'", "'50'", "'%'"] {
        let a = progressive(&["c1", "c2", "c3"], bad, "nginx:2");
        let (p, _) = gated(
            &a,
            &plain(&["c1", "c2", "c3"]),
            &Observed::new(),
            Instant::now(),
        );
        assert_eq!(state(&p), ("Progressing", 1, 3), "{bad}");
        assert_eq!(held(&p), ["c2", "c3"], "{bad}");
        assert!(
            p.warnings.iter().any(|w| w.contains("maxConcurrency")),
            "{bad}: {:?}",
            p.warnings
        );
    }
}

#[test]
fn max_concurrency_over_the_fleet_is_one_wave_and_percentages_round_up() {
    let cases = [
        ("250", 1),
        ("'250%'", 1),
        ("'100%'", 1),
        ("'34%'", 2),
        ("'1%'", 3),
        ("2", 2),
    ];
    for (max, waves) in cases {
        let a = progressive(&["c1", "c2", "c3"], max, "nginx:2");
        let (p, _) = gated(
            &a,
            &plain(&["c1", "c2", "c3"]),
            &Observed::new(),
            Instant::now(),
        );
        assert_eq!(state(&p).2, waves, "{max}");
        assert!(p.warnings.is_empty(), "{max}: {:?}", p.warnings);
    }
}

/// The seed's meaning: no rollout, or type All, holds nothing and keeps plain hashes.
#[test]
fn type_all_and_no_rollout_gate_nothing_and_keep_plain_hashes() {
    let m = plain(&["c1", "c2"]);
    for rollout in ["null", "{type: All, maxConcurrency: 1}"] {
        let a = app(&["c1", "c2"], rollout, "nginx:2", 2);
        let (p, recheck) = gated(&a, &m, &Observed::new(), Instant::now());
        assert_eq!(
            p,
            plan(&a, &m, &Admission::default(), &Grants::default()),
            "{rollout}"
        );
        assert_eq!((p.rollout, recheck), (None, None));
        assert_eq!(revision_of(&hash_for(&a, &m, "c1")), None);
    }
}

#[test]
fn a_revisioned_hash_is_64_characters_and_ignores_replicas() {
    let m = plain(&["c1"]);
    let h = |image, replicas| {
        hash_for(
            &app(&["c1"], "{type: Progressive}", image, replicas),
            &m,
            "c1",
        )
    };
    let (a, b, c) = (h("nginx:1", 2), h("nginx:1", 3), h("nginx:2", 2));
    assert_eq!(a.len(), 64);
    assert_ne!(a, b, "the content differs");
    assert_eq!(
        revision_of(&a),
        revision_of(&b),
        "replicas are not a revision"
    );
    assert_ne!(revision_of(&a), revision_of(&c));
    assert_eq!(revision_of(&a).map(str::len), Some(REVISION_LEN));
    // What is not a revisioned hash names none.
    for other in ["", "-", "abc", &"f".repeat(64), &format!("{}-x", &a[..16])] {
        assert_eq!(revision_of(other), None, "{other}");
    }
    let v = serde_json::json!({"spec": {"replicas": 1}});
    assert_eq!(revisioned_hash(&v).len(), 64);
}

/// Two waves of one cluster then two: the second starts only once the first ran the
/// revision Ready for the soak, and the gate asks to be looked at then.
#[test]
fn the_next_wave_starts_only_after_the_soak() {
    let t0 = Instant::now();
    let m = plain(&["c1", "c2", "c3"]);
    let a = app(
        &["c1", "c2", "c3"],
        &format!(
            "{{type: ProgressivePerGroup, groups: [{{clusters: [{{name: c1}}]}}], minSuccessSeconds: {SOAK}}}"
        ),
        "nginx:2",
        2,
    );
    let (p, recheck) = gated(&a, &m, &Observed::new(), t0);
    assert_eq!(
        (state(&p), held(&p)),
        (("Progressing", 1, 2), vec!["c2", "c3"])
    );
    assert_eq!(recheck, None, "nothing to wait for but reports");
    // c1 runs it, not Ready: still held.
    let new = hash_for(&a, &m, "c1");
    let mut seen_now: Observed = [(ArcStr::from("c1"), seen(&new, false, t0))].into();
    let (p, recheck) = gated(&a, &m, &seen_now, t0 + secs(5));
    assert_eq!(held(&p), ["c2", "c3"]);
    assert_eq!(recheck, Some(secs(600 - 5)), "the default deadline");
    // Ready at t0+10: the soak ends at t0+40.
    seen_now.insert("c1".into(), seen(&new, true, t0 + secs(10)));
    let (p, recheck) = gated(&a, &m, &seen_now, t0 + secs(39));
    assert_eq!(held(&p), ["c2", "c3"]);
    assert_eq!(recheck, Some(secs(1)));
    assert!(p.rollout.unwrap().message.contains("soaking"));
    let (p, recheck) = gated(&a, &m, &seen_now, t0 + secs(40));
    assert!(held(&p).is_empty());
    assert_eq!(state(&p), ("Progressing", 2, 2));
    assert_eq!(recheck, None);
    // Both of wave 2 run it Ready for the soak: complete.
    for c in ["c2", "c3"] {
        seen_now.insert(c.into(), seen(&new, true, t0 + secs(41)));
    }
    let (p, _) = gated(&a, &m, &seen_now, t0 + secs(71));
    assert_eq!(state(&p), ("Complete", 2, 2));
    assert_eq!(p.rollout.unwrap().updated_clusters, 3);
}

/// Every cluster runs the revision Ready but none soaked (a hub that just restarted
/// sees every report as new): nothing is left to gate, the rollout is complete and asks
/// for no recheck; the soak of the last wave gates nothing either.
#[test]
fn a_soak_gates_only_clusters_still_to_reach() {
    let t0 = Instant::now();
    let m = plain(&["c1", "c2"]);
    let a = progressive(&["c1", "c2"], "1", "nginx:2");
    let fresh = |c: &str| (ArcStr::from(c), seen(&hash_for(&a, &m, c), true, t0));
    let observed: Observed = [fresh("c1"), fresh("c2")].into();
    let (p, recheck) = gated(&a, &m, &observed, t0);
    assert_eq!((state(&p), recheck), (("Complete", 2, 2), None));
    // c2 not reached yet: c1's soak gates it.
    let observed: Observed = [fresh("c1")].into();
    let (p, recheck) = gated(&a, &m, &observed, t0);
    assert_eq!(
        (state(&p), recheck),
        (("Progressing", 1, 2), Some(secs(SOAK)))
    );
}

/// A report of another revision (the old one, or a hash from before the app was
/// progressive) is not the revision: the next wave waits.
#[test]
fn a_report_of_another_revision_does_not_count() {
    let t0 = Instant::now();
    let m = plain(&["c1", "c2"]);
    let old = progressive(&["c1", "c2"], "1", "nginx:1");
    let new = progressive(&["c1", "c2"], "1", "nginx:2");
    let plain_app = app(&["c1", "c2"], "null", "nginx:2", 2);
    for hash in [
        hash_for(&old, &m, "c1"),
        hash_for(&plain_app, &m, "c1"),
        String::new(),
    ] {
        let observed: Observed = [(ArcStr::from("c1"), seen(&hash, true, t0))].into();
        let (p, _) = gated(&new, &m, &observed, t0 + secs(1000));
        assert_eq!(held(&p), ["c2"], "{hash}");
    }
}

#[test]
fn a_cluster_past_its_deadline_degraded_or_failing_to_apply_halts_the_rollout() {
    let t0 = Instant::now();
    let m = plain(&["c1", "c2", "c3"]);
    let a = progressive(&["c1", "c2", "c3"], "1", "nginx:bad");
    let new = hash_for(&a, &m, "c1");
    let cases: [(Seen, &str); 3] = [
        (seen(&new, false, t0), "not Ready"),
        (
            Seen {
                degraded: Some("ImagePullBackOff: no such image".into()),
                ..seen(&new, false, t0 + secs(1000))
            },
            "ImagePullBackOff",
        ),
        (
            Seen {
                apply_error: Some("admission webhook denied".into()),
                ..seen("", false, t0 + secs(1000))
            },
            "denied",
        ),
    ];
    for (c1, why) in cases {
        let observed: Observed = [(ArcStr::from("c1"), c1)].into();
        let (p, recheck) = gated(&a, &m, &observed, t0 + secs(DEADLINE));
        assert_eq!(state(&p), ("Halted", 1, 3), "{why}");
        assert_eq!(held(&p), ["c2", "c3"], "{why}: the rest untouched");
        let message = p.rollout.as_ref().unwrap().message.clone();
        assert!(message.contains("c1") && message.contains(why), "{message}");
        assert_eq!(recheck, None, "{why}");
        // Status: Stalled, not Ready, with the rollout's message.
        let s = crate::status::compute(
            &crate::status::Inputs {
                plan: &p,
                deleting_on: None,
                reports: None,
                reachable: &Default::default(),
            },
            None,
            &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()),
        );
        let cond = |t: &str| s.conditions.iter().find(|c| c.type_ == t).unwrap().clone();
        assert_eq!(cond("Stalled").status, "True");
        assert_eq!(cond("Stalled").reason, "RolloutHalted");
        assert_eq!(cond("Ready").status, "False");
        assert_eq!(s.rollout.as_ref().unwrap().state, "Halted");
    }
    // Before the deadline it is only starting.
    let observed: Observed = [(ArcStr::from("c1"), seen(&new, false, t0))].into();
    let (p, recheck) = gated(&a, &m, &observed, t0 + secs(DEADLINE - 1));
    assert_eq!(state(&p).0, "Progressing");
    assert_eq!(recheck, Some(secs(1)));
}

/// A cluster the rollout has not reached that fails to apply its old revision does not
/// halt the rollout (the new revision may be its fix); once reached, it does.
#[test]
fn a_cluster_not_reached_yet_halts_nothing() {
    let t0 = Instant::now();
    let m = plain(&["c1", "c2"]);
    let a = progressive(&["c1", "c2"], "1", "nginx:2");
    let refused = Seen {
        apply_error: Some("denied by a webhook".into()),
        ..seen("", false, t0)
    };
    let observed: Observed = [(ArcStr::from("c2"), refused)].into();
    let (p, _) = gated(&a, &m, &observed, t0);
    assert_eq!(state(&p), ("Progressing", 1, 2));
    assert_eq!(held(&p), ["c2"]);
    let mut observed = observed;
    observed.insert("c1".into(), seen(&hash_for(&a, &m, "c1"), true, t0));
    let (p, _) = gated(&a, &m, &observed, t0 + secs(SOAK));
    assert_eq!(state(&p), ("Halted", 2, 2));
    assert!(held(&p).is_empty(), "c2 is sent the revision all the same");
}

/// Groups in order, a cluster in two goes with the first, clusters in no group last; a
/// selector that does not parse selects nothing, with a warning.
#[test]
fn groups_overlap_and_the_rest_go_last() {
    let m = members(&[("a", "2"), ("b", "1"), ("c", "1"), ("d", "")]);
    let a = app(
        &["a", "b", "c", "d"],
        "{type: ProgressivePerGroup, groups: [\
           {name: canary, clusters: [{name: c}]}, \
           {name: ones, clusterSelector: {matchLabels: {wave: '1'}}}, \
           {name: bad, clusterSelector: {matchExpressions: [{key: wave, operator: In}]}}, \
           {name: empty, clusters: [{name: nowhere}]}]}",
        "nginx:2",
        2,
    );
    let mut p = plan(&a, &m, &Admission::default(), &Grants::default());
    let mut warnings = Vec::new();
    let placed: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
    let w = waves(a.spec.rollout.as_ref().unwrap(), &placed, &m, &mut warnings);
    let names: Vec<(&str, Vec<&str>)> = (w.iter())
        .map(|(n, c)| (n.as_str(), c.iter().map(String::as_str).collect()))
        .collect();
    assert_eq!(
        names,
        [
            ("canary", vec!["c"]),
            ("ones", vec!["b"]),
            ("rest", vec!["a", "d"])
        ]
    );
    assert!(
        warnings.iter().any(|w| w.contains("groups[2]")),
        "{warnings:?}"
    );
    gate(&a, &mut p, &m, &Observed::new(), Instant::now());
    assert_eq!(held(&p), ["a", "b", "d"]);
}

/// A cluster that joins an earlier wave mid-rollout makes it wait again: clusters of
/// later waves that do not run the revision yet are held again, those that do are not.
/// A cluster that leaves the placement never stalls its wave; one NotReady does not
/// either, once another of its wave ran the revision Ready.
#[test]
fn clusters_joining_and_leaving_mid_rollout() {
    let t0 = Instant::now();
    let all = ["c1", "c3", "c4"];
    let m = plain(&all);
    let a = progressive(&all, "1", "nginx:2");
    let new = hash_for(&a, &m, "c1");
    let observed: Observed = [
        (ArcStr::from("c1"), seen(&new, true, t0)),
        (ArcStr::from("c3"), seen(&new, true, t0)),
    ]
    .into();
    let (p, _) = gated(&a, &m, &observed, t0 + secs(SOAK));
    assert_eq!(state(&p), ("Progressing", 3, 3));
    assert!(held(&p).is_empty());
    // c2 joins: its wave (2nd by name) waits for it; c4 is held again, c3 is not.
    let joined = ["c1", "c2", "c3", "c4"];
    let (m2, a2) = (plain(&joined), progressive(&joined, "1", "nginx:2"));
    let (p, _) = gated(&a2, &m2, &observed, t0 + secs(SOAK));
    assert_eq!(state(&p), ("Progressing", 2, 4));
    assert_eq!(held(&p), ["c4"]);
    // c2 goes NotReady: alone in its wave, it holds it (no evidence yet), and still
    // gets the revision.
    let mut m3 = m2.clone();
    m3.get_mut("c2").unwrap().not_ready_for = Some(secs(1));
    let (p, _) = gated(&a2, &m3, &observed, t0 + secs(SOAK));
    assert_eq!(held(&p), ["c4"]);
    assert!(
        p.rollout
            .unwrap()
            .message
            .contains("every cluster of it is NotReady")
    );
    assert!(p.clusters["c2"].rendered().is_some());
    // In a wave of two, the other one's evidence is enough: c2 no longer holds it back.
    let two = progressive(&joined, "2", "nginx:2");
    let (p, _) = gated(&two, &m3, &observed, t0 + secs(SOAK));
    assert!(held(&p).is_empty(), "{:?}", p.rollout);
    // c3 leaves the placement: c4's wave is next.
    let left = ["c1", "c4"];
    let (p, _) = gated(
        &progressive(&left, "1", "nginx:2"),
        &plain(&left),
        &observed,
        t0 + secs(SOAK),
    );
    assert_eq!(state(&p), ("Progressing", 2, 2));
    assert!(held(&p).is_empty());
}

/// Every cluster runs revision R: a change of replicas alone (here the template's
/// count) holds nobody, whatever the waves.
#[test]
fn a_change_of_replicas_alone_is_never_held() {
    let t0 = Instant::now();
    let all = ["c1", "c2", "c3"];
    let m = plain(&all);
    let before = app(
        &all,
        "{type: Progressive, maxConcurrency: 1, minSuccessSeconds: 600}",
        "nginx:2",
        2,
    );
    let after = app(
        &all,
        "{type: Progressive, maxConcurrency: 1, minSuccessSeconds: 600}",
        "nginx:2",
        5,
    );
    let observed: Observed = (all.iter())
        .map(|c| (ArcStr::from(*c), seen(&hash_for(&before, &m, c), true, t0)))
        .collect();
    let (p, _) = gated(&after, &m, &observed, t0);
    assert!(held(&p).is_empty());
    for c in all {
        assert_eq!(
            p.clusters[c].rendered().unwrap().hash,
            hash_for(&after, &m, c)
        );
    }
}

#[test]
fn paused_sends_the_revision_nowhere_new_and_stalls() {
    let t0 = Instant::now();
    let m = plain(&["c1", "c2"]);
    let a = app(
        &["c1", "c2"],
        "{type: Progressive, maxConcurrency: 1, paused: true}",
        "nginx:2",
        2,
    );
    let (p, _) = gated(&a, &m, &Observed::new(), t0);
    assert_eq!(state(&p), ("Paused", 1, 2));
    assert_eq!(held(&p), ["c1", "c2"]);
    // A cluster that already runs the revision keeps getting it (its replicas move).
    let observed: Observed =
        [(ArcStr::from("c1"), seen(&hash_for(&a, &m, "c1"), false, t0))].into();
    let (p, _) = gated(&a, &m, &observed, t0);
    assert_eq!(held(&p), ["c2"]);
}

/// Deletion, an unplannable app and clusters that are not sent anything are left alone.
#[test]
fn only_applies_are_ever_held() {
    let m = plain(&["c1", "c2"]);
    let mut a = progressive(&["c1", "c2", "ghost"], "1", "nginx:2");
    a.spec.overrides = serde_yaml::from_str(
        "[{clusterName: c1, clusterOverrides: [{path: /spec/replicas, value: 99}]}]",
    )
    .unwrap();
    let (p, _) = gated(&a, &m, &Observed::new(), Instant::now());
    assert_eq!(p.clusters["ghost"], ClusterPlan::Unknown);
    assert!(matches!(
        p.clusters["c1"],
        ClusterPlan::Keep(KeepReason::RenderFailed(_))
    ));
    assert_eq!(
        held(&p),
        Vec::<&str>::new(),
        "c2 is the first wave of the clusters sent anything"
    );
}

/// `app` as the hub's cache shows it once `plan`'s status is written.
fn with_status_of(app: &FederatedMyApp, plan: &AppPlan) -> FederatedMyApp {
    let mut app = app.clone();
    let status = app.status.get_or_insert_with(Default::default);
    status.rollout = with_newest_completion(plan.rollout.as_ref(), None);
    app
}

/// A complete rollout keeps the revisions its clusters ran and the spec that rendered
/// them; one not complete carries the last one over, and a copy too large is left out
/// with a warning (the revisions are still kept).
#[test]
fn a_complete_rollout_keeps_its_revisions_and_spec() {
    let t0 = Instant::now();
    let all = ["c1", "c2"];
    let m = plain(&all);
    let mut v1 = progressive(&all, "1", "nginx:1");
    v1.spec.overrides = serde_yaml::from_str(
        "[{clusterName: c2, clusterOverrides: [{path: /spec/image, value: 'nginx:1-c2'}]}]",
    )
    .unwrap();
    let done: Observed = (all.iter())
        .map(|c| (ArcStr::from(*c), seen(&hash_for(&v1, &m, c), true, t0)))
        .collect();
    let (p, _) = gated(&v1, &m, &done, t0 + secs(SOAK));
    assert_eq!(state(&p).0, "Complete");
    let last = p
        .rollout
        .as_ref()
        .unwrap()
        .last_complete
        .clone()
        .expect("kept");
    assert_eq!(last.generation, 1);
    let mut revisions: Vec<String> = (all.iter())
        .map(|c| revision_of(&hash_for(&v1, &m, c)).unwrap().to_owned())
        .collect();
    revisions.sort();
    assert_eq!(last.revisions, revisions, "one per class of clusters");
    assert_eq!(last.template.as_ref(), Some(&v1.spec.template));
    assert_eq!(last.overrides, v1.spec.overrides);
    // The next rollout, not complete: the last one is carried over.
    let mut v2 = with_status_of(&progressive(&all, "1", "nginx:2"), &p);
    v2.metadata.generation = Some(2);
    let (p2, _) = gated(&v2, &m, &done, t0 + secs(SOAK));
    assert_eq!(state(&p2).0, "Progressing");
    assert_eq!(p2.rollout.unwrap().last_complete, Some(last));
    // Too large to copy: the revisions only, and a warning.
    let mut big = progressive(&all, "1", "nginx:1");
    big.spec.template.metadata = Some(
        serde_yaml::from_str(&format!("{{labels: {{big: '{}'}}}}", "x".repeat(COPY_MAX))).unwrap(),
    );
    let done: Observed = (all.iter())
        .map(|c| (ArcStr::from(*c), seen(&hash_for(&big, &m, c), true, t0)))
        .collect();
    let (p, _) = gated(&big, &m, &done, t0 + secs(SOAK));
    let last = p.rollout.unwrap().last_complete.expect("kept");
    assert_eq!(
        (last.template, last.overrides.len(), last.revisions.len()),
        (None, 0, 1)
    );
    assert!(
        p.warnings
            .iter()
            .any(|w| w.contains("rollout abort cannot")),
        "{:?}",
        p.warnings
    );
}

/// Halted in its second wave, the template set back to the last complete revision: every
/// cluster that left it goes back at once, the wave-2 one too (without the kept
/// revisions it would wait for wave 1's soak). A revision never completed is gated as
/// before.
#[test]
fn going_back_to_the_last_complete_revision_is_never_held() {
    let t0 = Instant::now();
    let all = ["c1", "c2", "c3"];
    let m = plain(&all);
    let v1 = progressive(&all, "1", "nginx:1");
    let v2 = progressive(&all, "1", "nginx:bad");
    let on = |a: &FederatedMyApp, c: &str, ready: bool| {
        (ArcStr::from(c), seen(&hash_for(a, &m, c), ready, t0))
    };
    let (complete, _) = gated(
        &v1,
        &m,
        &[
            on(&v1, "c1", true),
            on(&v1, "c2", true),
            on(&v1, "c3", true),
        ]
        .into(),
        t0 + secs(SOAK),
    );
    // c1 soaked v2, c2 runs it not Ready past the deadline: halted at wave 2.
    let halted: Observed = [
        on(&v2, "c1", true),
        on(&v2, "c2", false),
        on(&v1, "c3", true),
    ]
    .into();
    let (p, _) = gated(
        &with_status_of(&v2, &complete),
        &m,
        &halted,
        t0 + secs(DEADLINE),
    );
    assert_eq!(state(&p), ("Halted", 2, 3));
    assert_eq!(held(&p), ["c3"]);
    // Set back (what rollout abort writes): nobody held, each sent v1.
    let back = with_status_of(&v1, &complete);
    let (p, _) = gated(&back, &m, &halted, t0 + secs(DEADLINE));
    assert!(held(&p).is_empty(), "{:?}", p.rollout);
    for c in all {
        assert_eq!(p.clusters[c].rendered().unwrap().hash, hash_for(&v1, &m, c));
    }
    // Without the kept revisions, c2 would wait for c1's soak.
    let (p, _) = gated(&v1, &m, &halted, t0 + secs(DEADLINE));
    assert_eq!(held(&p), ["c2"]);
    // A third revision, never complete: gated in waves as any.
    let v3 = with_status_of(&progressive(&all, "1", "nginx:3"), &complete);
    let (p, _) = gated(&v3, &m, &halted, t0 + secs(DEADLINE));
    assert_eq!(held(&p), ["c2", "c3"]);
}

/// An app dividing 6 replicas, on `clusters`, with `image`, in waves of one.
fn weighted(clusters: &[&str], image: &str) -> FederatedMyApp {
    let mut a = progressive(clusters, "1", image);
    a.spec.placement.replica_scheduling =
        Some(serde_yaml::from_str("{mode: Weighted, totalReplicas: 6}").unwrap());
    a
}

/// nginx:1 completed on c1, c2 and c3; then nginx:bad, with c3 out of the placement,
/// halted at wave 1 (c1 not Ready past the deadline), c2 still on nginx:1: the app, the
/// members and the reports.
fn halted_after_c3_left() -> (FederatedMyApp, Members, Observed) {
    let t0 = Instant::now();
    let all = ["c1", "c2", "c3"];
    let m = plain(&all);
    let v1 = weighted(&all, "nginx:1");
    let on = |a: &FederatedMyApp, c: &str| (ArcStr::from(c), seen(&hash_for(a, &m, c), true, t0));
    let done = [on(&v1, "c1"), on(&v1, "c2"), on(&v1, "c3")].into();
    let (complete, _) = gated(&v1, &m, &done, t0 + secs(SOAK));
    let v2 = with_status_of(&weighted(&["c1", "c2"], "nginx:bad"), &complete);
    let mut halted: Observed = [on(&v1, "c2")].into();
    halted.insert("c1".into(), seen(&hash_for(&v2, &m, "c1"), false, t0));
    (v2, m, halted)
}

/// `app` gated past the deadline, then its held clusters resized.
fn gated_and_resized(app: &FederatedMyApp, m: &Members, observed: &Observed) -> AppPlan {
    let now = observed.values().map(|s| s.since).max().unwrap() + secs(DEADLINE);
    let (mut p, _) = gated(app, m, observed, now);
    resize_held(app, &mut p, observed, |s| {
        plan(s, m, &Admission::default(), &Grants::default())
    });
    p
}

/// The total of 6 is divided 3/3 once c3 left, and held c2, which runs the last complete
/// revision, is sent it again with 3 replicas (same revision, new count).
#[test]
fn a_held_cluster_on_the_last_complete_revision_takes_its_new_share() {
    let (v2, m, halted) = halted_after_c3_left();
    let p = gated_and_resized(&v2, &m, &halted);
    assert_eq!(state(&p).0, "Halted");
    assert_eq!(held(&p), ["c2"], "still held: status says so");
    let ClusterPlan::Keep(KeepReason::Held { resized: Some(c2) }) = &p.clusters["c2"] else {
        panic!("c2 not resized: {:?}", p.clusters["c2"]);
    };
    let sent = c2.to_value();
    assert_eq!(sent["spec"]["replicas"], 3);
    assert_eq!(sent["spec"]["image"], "nginx:1");
    assert_eq!(
        revision_of(&c2.hash),
        revision_of(&halted["c2"].hash),
        "the revision it runs"
    );
    assert!(
        matches!(p.desired()["c2"], Desired::Apply(_)),
        "sent as an Apply"
    );
}

/// A held cluster on a revision no rollout completed, or with no copy of the spec kept,
/// keeps what it runs, count included.
#[test]
fn any_other_held_cluster_keeps_its_count() {
    let (v2, m, halted) = halted_after_c3_left();
    let other = weighted(&["c1", "c2", "c3"], "nginx:0");
    let mut elsewhere = halted.clone();
    elsewhere.get_mut("c2").unwrap().hash = hash_for(&other, &m, "c2").into();
    assert_eq!(gated_and_resized(&v2, &m, &elsewhere).clusters["c2"], HELD);
    let mut no_copy = v2.clone();
    let rollout = no_copy.status.as_mut().and_then(|s| s.rollout.as_mut());
    rollout
        .and_then(|r| r.last_complete.as_mut())
        .unwrap()
        .template = None;
    assert_eq!(
        gated_and_resized(&no_copy, &m, &halted).clusters["c2"],
        HELD
    );
}

/// A plan made before the object showed the last completion never writes an older one
/// over it; a newer one replaces it.
#[test]
fn status_keeps_the_newest_completion() {
    let completion = |generation| RolloutStatus {
        last_complete: Some(CompletedRevision {
            generation,
            ..Default::default()
        }),
        ..Default::default()
    };
    let kept = |planned: &RolloutStatus, shown: &RolloutStatus| {
        with_newest_completion(Some(planned), Some(shown))
            .and_then(|r| r.last_complete)
            .map(|c| c.generation)
    };
    assert_eq!(kept(&completion(3), &completion(5)), Some(5));
    assert_eq!(kept(&completion(5), &completion(3)), Some(5));
    assert_eq!(kept(&RolloutStatus::default(), &completion(3)), Some(3));
    assert_eq!(
        with_newest_completion(None, Some(&completion(3))),
        None,
        "no rollout any more"
    );
}

/// A report: of the current revision, the old one or none; Ready; fine, Degraded or
/// failing to apply; seen since (seconds after the start).
fn arb_seen() -> impl Strategy<Value = Option<(u8, bool, u8, u16)>> {
    proptest::option::of((0u8..3, any::<bool>(), 0u8..4, 0u16..200))
}

proptest! {
    /// Whatever the reports, the time and the settings: only Applies turn into
    /// Keep(Held), never a cluster that runs its revision, never the first wave unless
    /// paused, the count matches, and time only opens more clusters.
    #[test]
    fn the_gate_only_holds_what_it_may_and_time_only_opens(
        n in 0usize..7,
        max in prop_oneof![Just("1".to_owned()), Just("2".to_owned()), Just("'50%'".to_owned()), Just("0".to_owned())],
        paused in any::<bool>(),
        reports in proptest::collection::vec(arb_seen(), 7),
        away in proptest::collection::vec(any::<bool>(), 7),
        t in 0u64..400,
        dt in 0u64..400,
        completed_before in any::<bool>(),
    ) {
        let t0 = Instant::now();
        let names: Vec<String> = (0..n).map(|i| format!("c{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut m = plain(&refs);
        for (c, a) in names.iter().zip(&away) {
            if *a { m.get_mut(c.as_str()).unwrap().not_ready_for = Some(secs(1)); }
        }
        let rollout = format!("{{type: Progressive, maxConcurrency: {max}, minSuccessSeconds: {SOAK}, progressDeadlineSeconds: {DEADLINE}, paused: {paused}}}");
        let mut a = app(&refs, &rollout, "nginx:2", 2);
        let old = app(&refs, &rollout, "nginx:1", 2);
        if completed_before {
            // nginx:2 completed once already (this is a way back to it).
            let revisions = names.iter().filter_map(|c| revision_of(&hash_for(&a, &m, c)).map(str::to_owned));
            let last_complete = CompletedRevision { revisions: revisions.collect::<BTreeSet<_>>().into_iter().collect(), ..Default::default() };
            let rollout = RolloutStatus { last_complete: Some(last_complete), ..Default::default() };
            a.status = Some(flotilla_crds::FederatedMyAppStatus { rollout: Some(rollout), ..Default::default() });
        }
        let observed: Observed = names.iter().zip(&reports).filter_map(|(c, r)| {
            let (which, ready, bad, since) = (*r)?;
            let hash = match which { 0 => hash_for(&a, &m, c), 1 => hash_for(&old, &m, c), _ => String::new() };
            let mut s = seen(&hash, ready, t0 + secs(since as u64));
            if bad == 1 { s.degraded = Some("broken".into()); }
            if bad == 2 { s.apply_error = Some("refused".into()); }
            Some((c.as_str().into(), s))
        }).collect();
        let ungated = plan(&a, &m, &Admission::default(), &Grants::default());
        let now = t0 + secs(t);
        let (p, _) = gated(&a, &m, &observed, now);
        let (later, _) = gated(&a, &m, &observed, now + secs(dt));
        let r = p.rollout.as_ref().unwrap();
        prop_assert_eq!(r.held_clusters as usize, held(&p).len());
        for (c, planned) in &p.clusters {
            if planned != &ungated.clusters[c] {
                prop_assert_eq!(planned, &HELD);
                prop_assert!(ungated.clusters[c].rendered().is_some());
                let target = revision_of(&ungated.clusters[c].rendered().unwrap().hash);
                let runs = observed.get(&**c).and_then(|s| revision_of(&s.hash));
                prop_assert!(runs != target, "{} runs its revision but is held", c);
            }
            if later.clusters[c] == HELD {
                prop_assert_eq!(planned, &HELD, "{} closed again with time", c);
            }
        }
        if !paused && let Some(first) = names.first() {
            prop_assert!(p.clusters[first.as_str()].rendered().is_some(), "the first wave is open");
        }
        prop_assert!(r.wave <= r.waves);
        if completed_before {
            prop_assert!(held(&p).is_empty(), "a way back to a complete revision is held");
        }
    }
}
