use super::*;
use flotilla_plan::KeepReason;
use flotilla_plan::render::RenderedMyApp;
use flotilla_plan::status::Words;
use kube::runtime::{reflector, watcher};

fn rendered(hash: &str) -> ClusterPlan {
    let hash = hash.into();
    ClusterPlan::Apply(Arc::new(RenderedMyApp {
        hash,
        ..Default::default()
    }))
}

fn plan(entries: &[(&str, ClusterPlan)]) -> Planned {
    let clusters = entries.iter().map(|(c, p)| ((*c).into(), p.clone()));
    let plan = AppPlan {
        clusters: clusters.collect(),
        ..Default::default()
    };
    Planned {
        plan,
        deleting_on: None,
    }
}

fn ready(hash: &str) -> Report {
    Report {
        hash: hash.into(),
        exists: true,
        ready: true,
        ready_replicas: 1,
        observed_generation: 1,
        generation: 1,
        ..Default::default()
    }
}

fn set(names: &[&str]) -> HashSet<String> {
    names.iter().map(|c| c.to_string()).collect()
}

/// The keys marked by now.
async fn marked(board: &StatusBoard) -> Vec<AppKey> {
    let stop = CancellationToken::new();
    let mut keys = board
        .dirty
        .take(Duration::ZERO, Some(Duration::from_millis(1)), &stop)
        .await
        .unwrap();
    keys.sort();
    keys
}

/// A writer over a store holding `apps` (its client reaches nothing: these tests look at
/// what it would send, not at an apiserver).
fn writer(apps: Vec<FederatedMyApp>) -> StatusWriter {
    let (store, mut w) = reflector::store::<FederatedMyApp>();
    w.apply_watcher_event(&watcher::Event::Init);
    for app in apps {
        w.apply_watcher_event(&watcher::Event::InitApply(app));
    }
    w.apply_watcher_event(&watcher::Event::InitDone);
    let client =
        kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
    StatusWriter {
        client: client.clone(),
        apps: store,
        recorder: Recorder::new(client, "flotilla-hub-test".into()),
        metrics: WriteMetrics::default(),
        window: Duration::from_millis(200),
        rate: 50.0,
        burst: 100,
    }
}

fn app(name: &str, version: &str, status: Option<FederatedMyAppStatus>) -> FederatedMyApp {
    let mut app: FederatedMyApp = serde_json::from_value(serde_json::json!({
        "apiVersion": "core.kubefed.io/v1beta1", "kind": "FederatedMyApp",
        "metadata": {"name": name, "namespace": "ns", "resourceVersion": version},
        "spec": {},
    }))
    .unwrap();
    app.status = status;
    app
}

/// What the writer computes for `key` now over what the app shows (`previous`).
fn computed(
    board: &StatusBoard,
    key: &AppKey,
    previous: Option<&FederatedMyAppStatus>,
) -> FederatedMyAppStatus {
    let snapshot = board.snapshot([key.clone()]);
    let (_, planned, reports) = &snapshot.apps[0];
    let inputs = snapshot.inputs(planned, reports.as_deref());
    compute(&inputs, previous, &Time(Timestamp::now()))
}

#[test]
fn plan_error_changes_are_detected_for_events() {
    let board = StatusBoard::default();
    let key = AppKey::new("ns", "a");
    assert!(!board.set_plan(&key, plan(&[("c1", rendered("h1"))])));
    assert!(
        !board.set_plan(&key, plan(&[("c1", rendered("h2"))])),
        "a new hash is not an error"
    );
    assert!(board.set_plan(&key, plan(&[("c1", ClusterPlan::Unknown)])));
    assert!(!board.set_plan(&key, plan(&[("c1", ClusterPlan::Unknown)])));
}

/// An app refused as a whole is announced (for its Event) with the refusal's own reason,
/// not as an invalid placement.
#[test]
fn a_refused_app_is_announced_with_its_reason() {
    use flotilla_crds::tenancy::{Forbidden, Rule};
    use flotilla_plan::admission::Refusal;
    use flotilla_plan::plan::AppError;

    let mut refused = plan(&[("c1", ClusterPlan::Keep(KeepReason::Unplanned))]);
    let forbidden = Forbidden {
        namespace: "kube-system".into(),
        rule: Rule::System,
    };
    refused.plan.placement_error = Some(AppError::Refused(Refusal::NamespaceForbidden(forbidden)));
    let message =
        "namespace kube-system is forbidden: Kubernetes system namespaces are never placed into";
    assert_eq!(
        refused.errors(),
        (Some(("NamespaceForbidden", message.to_owned())), vec![])
    );
    let board = StatusBoard::default();
    assert!(board.set_plan(&AppKey::new("kube-system", "a"), refused));
}

/// A cluster kept only because the app could not be planned is not one its status
/// reports on, so changes of that cluster do not touch the app.
#[test]
fn the_board_knows_the_apps_on_each_cluster_as_its_plans_name_them() {
    let board = StatusBoard::default();
    let (a, b) = (AppKey::new("ns", "a"), AppKey::new("ns", "b"));
    let failed = || ClusterPlan::Unknown;
    let check = || {
        let b = board.board.lock();
        for cluster in ["c1", "c2", "c3", "c4"] {
            let scanned: HashSet<&AppKey> = b
                .plans
                .iter()
                .filter(|(_, p)| p.clusters().any(|c| **c == *cluster))
                .map(|(k, _)| k)
                .collect();
            let indexed: HashSet<&AppKey> = b
                .apps_on
                .get(cluster)
                .map(|apps| apps.iter().map(|k| &**k).collect())
                .unwrap_or_default();
            assert_eq!(indexed, scanned, "apps on {cluster}");
        }
        assert!(b.apps_on.values().all(|apps| !apps.is_empty()));
    };
    board.set_plan(&a, plan(&[("c1", rendered("h")), ("c2", failed())]));
    board.set_plan(
        &b,
        plan(&[
            ("c2", rendered("h")),
            ("c3", ClusterPlan::Keep(KeepReason::FailedOver)),
            ("c4", ClusterPlan::Keep(KeepReason::Unplanned)),
        ]),
    );
    check();
    assert!(!board.board.lock().apps_on.contains_key("c4"));
    board.set_plan(&a, plan(&[("c2", rendered("h")), ("c4", rendered("h"))]));
    check();
    board.set_plan(&b, plan(&[]));
    check();
    board.forget(&a);
    board.forget(&a);
    check();
    assert!(board.board.lock().apps_on.is_empty());
}

/// Only a MemberCluster's readiness changes what "connected" means to a status: the apps
/// on a cluster that turns NotReady (or Ready) are looked at again, the others are not.
#[tokio::test]
async fn readiness_marks_the_apps_on_the_clusters_that_changed_only() {
    let board = StatusBoard::default();
    let (a, b) = (AppKey::new("ns", "a"), AppKey::new("ns", "b"));
    board.set_plan(&a, plan(&[("c1", rendered("h"))]));
    board.set_plan(&b, plan(&[("c2", rendered("h"))]));
    marked(&board).await;
    board.set_reachable(set(&["c1", "c2"]));
    assert_eq!(marked(&board).await, [a.clone(), b.clone()]);
    board.set_reachable(set(&["c1", "c2"]));
    assert!(marked(&board).await.is_empty(), "no change, no mark");
    board.set_reachable(set(&["c2"]));
    assert_eq!(marked(&board).await, [a]);
}

/// One cluster's readiness (a MemberCluster event) does to the board what the whole set
/// with that one change does: the same Ready clusters, the same apps marked, and a
/// cluster that turned NotReady waits to be heard again once it is back.
#[tokio::test]
async fn one_clusters_readiness_is_the_whole_set_with_that_change() {
    let (one, whole) = (StatusBoard::default(), StatusBoard::default());
    let apps: [(&str, &[&str]); 4] = [
        ("a", &["c1"]),
        ("b", &["c2"]),
        ("c", &["c1", "c3"]),
        ("d", &["c4"]),
    ];
    for board in [&one, &whole] {
        for (name, clusters) in apps {
            let placed: Vec<_> = clusters.iter().map(|c| (*c, rendered("h"))).collect();
            board.set_plan(&AppKey::new("ns", name), plan(&placed));
        }
        marked(board).await;
    }
    let unheard = |board: &StatusBoard| {
        let mut unheard = board.snapshot([]).unheard;
        unheard.sort();
        unheard
    };
    let mut ready = HashSet::new();
    let steps = [
        ("c1", true),
        ("c2", true),
        ("c1", true),
        ("c1", false),
        ("c3", true),
        ("c2", false),
        ("c1", true),
        ("c9", true),
        ("c3", false),
    ];
    for (at, (cluster, is_ready)) in steps.into_iter().enumerate() {
        match is_ready {
            true => ready.insert(cluster.to_owned()),
            false => ready.remove(cluster),
        };
        one.set_ready(cluster, is_ready);
        whole.set_reachable(ready.clone());
        assert_eq!(one.reachable(), whole.reachable(), "step {at}");
        assert_eq!(marked(&one).await, marked(&whole).await, "step {at}");
        assert_eq!(unheard(&one), unheard(&whole), "step {at}");
        if at == 6 {
            assert_eq!(
                unheard(&one),
                ["c1"],
                "back after its NotReady: heard again"
            );
        }
        // Every other step, the Ready clusters' agents heartbeat.
        if at % 2 == 1 {
            for board in [&one, &whole] {
                ready.iter().for_each(|c| board.heard(c));
                marked(board).await;
            }
        }
    }
}

/// DESIGN rule 7: a session that ends and returns within the grace writes nothing. The
/// server tells the board nothing of sessions; the reports stay, the cluster stays
/// reachable, and the status computed before and after is the same.
#[tokio::test]
async fn a_session_that_returns_within_the_grace_changes_no_status() {
    let board = StatusBoard::default();
    let key = AppKey::new("ns", "a");
    board.set_plan(&key, plan(&[("c1", rendered("h")), ("c2", rendered("h"))]));
    board.set_reachable(set(&["c1", "c2"]));
    for c in ["c1", "c2"] {
        board.heard(c);
        board.report(c, &key, ready("h"));
    }
    let before = computed(&board, &key, None);
    marked(&board).await;
    // The agent of c1 reconnects (to this hub or a new leader's board, which hears it
    // again) and sends the same reports.
    board.report("c1", &key, ready("h"));
    board.heard("c1");
    assert!(marked(&board).await.is_empty(), "nothing changed");
    assert_eq!(computed(&board, &key, Some(&before)), before);
    // Past the grace, the MemberCluster turns NotReady: now the status changes.
    board.set_reachable(set(&["c2"]));
    assert_eq!(marked(&board).await, std::slice::from_ref(&key));
    let after = computed(&board, &key, Some(&before));
    assert_eq!(after.disconnected_clusters, 1);
}

/// A hub that takes the lead has heard no agent: an app on a reachable cluster waits for
/// that agent's reports instead of writing "Pending"; clusters NotReady do not hold it.
#[tokio::test]
async fn a_new_leader_writes_an_app_only_once_its_agents_reported() {
    let board = StatusBoard::default();
    let (a, b) = (AppKey::new("ns", "a"), AppKey::new("ns", "b"));
    board.set_plan(&a, plan(&[("c1", rendered("h")), ("c2", rendered("h"))]));
    board.set_plan(&b, plan(&[("c3", rendered("h"))]));
    board.set_reachable(set(&["c1", "c2"]));
    let waits = |key: &AppKey| {
        let s = board.snapshot([key.clone()]);
        s.waits(key, &s.apps[0].1)
    };
    assert!(waits(&a));
    assert!(!waits(&b), "c3 is NotReady: its apps show it at once");
    board.heard("c1");
    assert!(waits(&a), "c2 not heard yet");
    marked(&board).await;
    board.heard("c2");
    assert!(!waits(&a));
    assert_eq!(
        marked(&board).await,
        std::slice::from_ref(&a),
        "hearing a cluster marks its apps"
    );
    // A cluster that turns NotReady must be heard again when it is back.
    board.set_reachable(set(&["c1"]));
    board.set_reachable(set(&["c1", "c2"]));
    assert!(waits(&a));
    // Losing the lead forgets what was heard.
    board.heard("c2");
    board.forget_sessions();
    assert!(waits(&a));
}

/// The writer sends a merge patch of what changed, guarded by the cached version; then
/// nothing while nothing changes; nothing against a cache that has not seen its write;
/// and a rejected status not again.
#[tokio::test]
async fn the_writer_patches_changes_only_against_a_current_cache() {
    let key = AppKey::new("ns", "a");
    let board = StatusBoard::default();
    board.set_plan(&key, plan(&[("c1", rendered("h"))]));
    let w = writer(vec![app("a", "10", None)]);
    let mut round = Round::new(&w);
    let keys = || HashSet::from([key.clone()]);
    let mut first = board.prepare(keys(), &w, &mut round);
    assert_eq!(first.len(), 1);
    let patch = &first[0].patch;
    assert_eq!(patch["metadata"]["resourceVersion"], "10");
    assert_eq!(patch["status"]["disconnectedClusters"], 1);
    // Written (10 → 11), but the cache still shows 10: nothing is computed against it.
    let now = Instant::now();
    let written = round
        .tracker
        .settle(first.remove(0), Ok(("11".into(), 1)), now);
    assert_eq!(written, Ok(1));
    assert!(board.prepare(keys(), &w, &mut round).is_empty());
    assert!(round.tracker.next(now).is_some(), "looked at again soon");
    // The cache shows the write: nothing changed, nothing to send.
    let shown = computed(&board, &key, None);
    let w = writer(vec![app("a", "11", Some(shown))]);
    let mut round = Round::new(&w);
    assert!(board.prepare(keys(), &w, &mut round).is_empty());
    // A report changes one cluster: only what changed is sent.
    board.set_reachable(set(&["c1"]));
    board.heard("c1");
    board.report("c1", &key, ready("h"));
    let mut due = board.prepare(keys(), &w, &mut round);
    let status = due[0].patch["status"].as_object().unwrap();
    assert!(status.contains_key("readyClusters") && status.contains_key("clusters"));
    assert_eq!(
        status["disconnectedClusters"],
        Value::Null,
        "a count back to 0 is removed"
    );
    assert!(
        !status.contains_key("observedGeneration"),
        "unchanged fields are not sent"
    );
    // Rejected: not sent again until it changes.
    let invalid = kube::Error::Api(
        kube::core::Status::failure("too long", "Invalid")
            .with_code(422)
            .boxed(),
    );
    let answer = round
        .tracker
        .settle(due.remove(0), Err(invalid), Instant::now());
    assert!(matches!(answer, Err((Failure::Rejected(_), None))));
    assert!(board.prepare(keys(), &w, &mut round).is_empty());
}

#[tokio::test]
async fn a_failing_app_waits_for_its_backoff() {
    let key = AppKey::new("ns", "a");
    let board = StatusBoard::default();
    board.set_plan(&key, plan(&[("c1", rendered("h"))]));
    let w = writer(vec![app("a", "10", None)]);
    let mut round = Round::new(&w);
    let keys = || HashSet::from([key.clone()]);
    let mut due = board.prepare(keys(), &w, &mut round);
    let busy = kube::Error::Api(
        kube::core::Status::failure("busy", "")
            .with_code(503)
            .boxed(),
    );
    let now = Instant::now();
    let answer = round.tracker.settle(due.remove(0), Err(busy), now);
    assert!(matches!(answer, Err((Failure::Transient(_), Some(_)))));
    assert!(
        board.prepare(keys(), &w, &mut round).is_empty(),
        "backing off"
    );
    assert_eq!(round.tracker.due(now + writes::RETRY_FIRST), [key]);
}

#[tokio::test]
async fn placements_are_marked_only_when_the_chosen_clusters_change() {
    let board = StatusBoard::default();
    let key = AppKey::new("ns", "a");
    let taken = || async {
        let stop = CancellationToken::new();
        let wait = Some(Duration::from_millis(1));
        board
            .placements
            .take(Duration::ZERO, wait, &stop)
            .await
            .unwrap()
    };
    board.set_plan(&key, plan(&[("c1", rendered("h1"))]));
    assert_eq!(taken().await, vec![key.clone()]);
    // A new version on the same clusters moves no placement.
    board.set_plan(&key, plan(&[("c1", rendered("h2"))]));
    assert_eq!(taken().await, vec![]);
    board.set_plan(
        &key,
        plan(&[("c1", rendered("h2")), ("c2", rendered("h2"))]),
    );
    assert_eq!(taken().await, vec![key.clone()]);
    board.set_plan(
        &key,
        plan(&[
            ("c1", rendered("h2")),
            ("c2", ClusterPlan::Keep(KeepReason::FailedOver)),
        ]),
    );
    assert_eq!(taken().await, vec![key]);
}

/// A progressive app's planner hears of each report that changes a cluster's hash or
/// readiness (not of one that changes neither); the gate reads since when this hub sees
/// each, and a halted rollout is an error worth an Event.
#[test]
fn reports_that_move_a_rollout_tell_the_planner_and_date_what_they_show() {
    use flotilla_crds::federated::RolloutStatus;
    let board = StatusBoard::default();
    let (tx, mut rx) = mpsc::unbounded_channel();
    board.notify_planner(tx);
    let (plain, gated) = (AppKey::new("ns", "plain"), AppKey::new("ns", "gated"));
    board.set_plan(&plain, plan(&[("c1", rendered("h1"))]));
    let mut progressive = plan(&[("c1", rendered("h1"))]);
    progressive.plan.rollout = Some(RolloutStatus::default());
    board.set_plan(&gated, progressive.clone());
    board.report("c1", &plain, ready("h0"));
    assert!(rx.try_recv().is_err(), "an app rolled out all at once");
    let before = std::time::Instant::now();
    board.report(
        "c1",
        &gated,
        Report {
            ready: false,
            ..ready("h1")
        },
    );
    assert_eq!(rx.try_recv().ok(), Some(Trigger::Observed(gated.clone())));
    let first = board.observed(&gated)["c1"].clone();
    assert!(!first.ready && first.since >= before);
    // Replicas moving, same hash and readiness: nothing to tell.
    board.report(
        "c1",
        &gated,
        Report {
            ready: false,
            ready_replicas: 0,
            ..ready("h1")
        },
    );
    assert!(rx.try_recv().is_err());
    assert_eq!(board.observed(&gated)["c1"].since, first.since);
    board.report("c1", &gated, ready("h1"));
    assert_eq!(rx.try_recv().ok(), Some(Trigger::Observed(gated.clone())));
    let now = board.observed(&gated)["c1"].clone();
    assert!(now.ready && now.since >= first.since);
    // A Degraded report moves it too (a halt), and is read with its reason.
    let degraded = ready("h1").with_words(Words {
        degraded: Some(("ImagePull".into(), "no such image".into())),
        ..Words::default()
    });
    board.report("c1", &gated, degraded);
    assert_eq!(rx.try_recv().ok(), Some(Trigger::Observed(gated.clone())));
    let seen = board.observed(&gated)["c1"].clone();
    assert_eq!(seen.degraded.as_deref(), Some("ImagePull: no such image"));
    assert_eq!(seen.since, now.since, "readiness and hash did not change");
    // Halted: an app-level error, for its Event.
    progressive.plan.rollout = Some(RolloutStatus {
        state: "Halted".into(),
        message: "halted at wave 1 of 2".into(),
        ..Default::default()
    });
    assert_eq!(
        progressive.errors(),
        (
            Some(("RolloutHalted", "halted at wave 1 of 2".to_owned())),
            vec![]
        )
    );
    assert!(board.set_plan(&gated, progressive));
    board.forget(&gated);
    assert!(board.observed(&gated).is_empty());
}

/// A progressive app's status waits while its plan was gated on fewer reports than the
/// board holds (after a hub restart that plan holds clusters the reports release), and
/// is computed again once a plan read them.
#[test]
fn a_plan_gated_on_older_reports_makes_the_status_wait() {
    use flotilla_crds::federated::RolloutStatus;
    let board = StatusBoard::default();
    let key = AppKey::new("ns", "gated");
    let mut progressive = plan(&[("c1", rendered("h1"))]);
    progressive.plan.rollout = Some(RolloutStatus::default());
    board.set_plan(&key, progressive.clone());
    let waits = |board: &StatusBoard| {
        let snapshot = board.snapshot([key.clone()]);
        let (k, planned, _) = &snapshot.apps[0];
        snapshot.waits(k, planned)
    };
    assert!(!waits(&board));
    board.report("c1", &key, ready("h1"));
    assert!(waits(&board), "the plan predates the report");
    // The planner reads the reports, then publishes: current again.
    board.observed(&key);
    board.set_plan(&key, progressive.clone());
    assert!(!waits(&board));
    // A report that changes neither hash nor readiness does not make it wait.
    board.report(
        "c1",
        &key,
        Report {
            ready_replicas: 2,
            ..ready("h1")
        },
    );
    assert!(!waits(&board));
    // An app that rolls out all at once never waits for it.
    board.report(
        "c1",
        &key,
        Report {
            ready: false,
            ..ready("h1")
        },
    );
    board.set_plan(&key, plan(&[("c1", rendered("h1"))]));
    assert!(!waits(&board));
}

/// A million reports on a big hub repeat a few cluster names and hashes: each is held
/// once, whichever report brought it.
#[test]
fn reports_share_one_copy_of_each_cluster_name_and_hash() {
    let board = StatusBoard::default();
    let (a, b) = (AppKey::new("ns", "a"), AppKey::new("ns", "b"));
    for key in [&a, &b] {
        for cluster in ["c1", "c2"] {
            board.report(cluster, key, ready("h1"));
        }
    }
    let board = board.board.lock();
    let held: Vec<(&ArcStr, &Report)> = (board.reports.values())
        .flat_map(|reports| reports.iter())
        .collect();
    assert_eq!(held.len(), 4);
    let (c1, hash) = (held[0].0, &held[0].1.hash);
    assert!(held.iter().all(|(_, r)| ArcStr::ptr_eq(&r.hash, hash)));
    let c1s = held.iter().filter(|(c, _)| ArcStr::ptr_eq(c, c1)).count();
    assert_eq!(c1s, 2, "both apps' reports of c1 hold one name");
}

/// A member that sends a new hash with every report leaves behind only strings that
/// nothing holds: the interner drops them, so it stays within twice what is held.
#[test]
fn the_interner_drops_strings_nothing_holds() {
    let mut strings = Interner::default();
    let kept: Vec<ArcStr> = (0..100)
        .map(|i| strings.get(&format!("kept-{i}")))
        .collect();
    let mut latest = strings.get("hash-0");
    for i in 1..100_000 {
        latest = strings.get(&format!("hash-{i}"));
        assert!(
            strings.set.len() <= 2 * Interner::FLOOR,
            "{}",
            strings.set.len()
        );
    }
    assert!(
        kept.iter().all(|k| strings.set.contains(k)),
        "held strings stay"
    );
    assert!(ArcStr::ptr_eq(&strings.get("hash-99999"), &latest));
}
