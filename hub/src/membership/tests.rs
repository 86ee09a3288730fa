use super::*;
use flotilla_crds::member::Resources;
use kube::runtime::{reflector, watcher};

fn store(names: &[(&str, Option<bool>)]) -> Store<MemberCluster> {
    let (store, mut writer) = reflector::store::<MemberCluster>();
    writer.apply_watcher_event(&watcher::Event::Init);
    for (name, ready) in names {
        let mut m = MemberCluster::new(name, Default::default());
        if let Some(ready) = ready {
            let now = Time(Timestamp::now());
            m.status = Some(MemberClusterStatus {
                conditions: vec![condition::new("Ready", *ready, "X", "", None, &now)],
                ..Default::default()
            });
        }
        writer.apply_watcher_event(&watcher::Event::InitApply(m));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    store
}

/// A store holding `mc` as written (the status each write left).
fn holding(mc: MemberCluster) -> Store<MemberCluster> {
    let (members, mut writer) = reflector::store::<MemberCluster>();
    writer.apply_watcher_event(&watcher::Event::Apply(mc));
    members
}

/// The statuses due now, as the patches would leave them.
fn due(
    m: &Membership,
    marked: &[&str],
    members: &Store<MemberCluster>,
    since: Instant,
) -> Vec<(String, MemberClusterStatus)> {
    let marked = marked.iter().map(|c| c.to_string()).collect();
    let mut tracker = Tracker::default();
    m.due(&marked, members, since, &mut tracker)
        .into_iter()
        .map(|(write, _)| {
            let mc = members.get(&kube::runtime::reflector::ObjectRef::new(&write.key));
            let mut applied = to_value(mc.as_ref().and_then(|mc| mc.status.as_ref()));
            json_patch::merge(&mut applied, &write.patch["status"]);
            (write.key, serde_json::from_value(applied).unwrap())
        })
        .collect()
}

/// `name` showing `status`.
fn shown(name: &str, status: MemberClusterStatus) -> MemberCluster {
    let mut mc = MemberCluster::new(name, Default::default());
    mc.status = Some(status);
    mc
}

fn hello(version: &str, uid: &str) -> flotilla_proto::v1::Hello {
    flotilla_proto::v1::Hello {
        agent_version: version.into(),
        kubernetes_version: "v1.34.4".into(),
        cluster_uid: uid.into(),
        ..Default::default()
    }
}

#[test]
fn a_hello_makes_a_cluster_ready_and_due() {
    let m = Membership::new(Duration::from_secs(40));
    m.hello("c1", &hello("0.1.0", "uid-1"));
    let due = due(
        &m,
        &["c1"],
        &store(&[("c1", None), ("c2", None)]),
        Instant::now(),
    );
    assert_eq!(
        due.len(),
        1,
        "c2 is not declared gone within the first grace period"
    );
    let (name, status) = &due[0];
    assert_eq!(name, "c1");
    assert_eq!(condition::is_true(&status.conditions, "Ready"), Some(true));
    assert_eq!(status.agent_version.as_deref(), Some("0.1.0"));
    assert_eq!(
        status.cluster_uid.as_deref(),
        Some("uid-1"),
        "the physical cluster is pinned"
    );
    assert_eq!(
        condition::is_true(&status.conditions, "CollectionBlocked"),
        Some(false)
    );
    assert!(status.last_heartbeat_time.is_some());
}

/// The namespaces a narrowed agent watches are shown, kept across a hub restart until
/// the agent says Hello again, and cleared when it watches every namespace again.
#[tokio::test(start_paused = true)]
async fn the_namespaces_an_agent_watches_are_shown_until_it_watches_all() {
    let m = Membership::new(Duration::from_secs(40));
    let narrowed = flotilla_proto::v1::Hello {
        scope: vec!["team".into()],
        ..hello("0.1.0", "uid-1")
    };
    m.hello("c1", &narrowed);
    let (_, status) = due(&m, &["c1"], &store(&[("c1", None)]), Instant::now()).remove(0);
    assert_eq!(status.agent_namespaces, ["team"]);
    let members = holding(shown("c1", status));
    // A restarted hub that never hears the agent marks it NotReady after the grace: that
    // write keeps the namespaces shown.
    let restarted = Membership::new(Duration::from_secs(40));
    let since = Instant::now();
    tokio::time::advance(Duration::from_secs(100)).await;
    let (_, lost) = due(&restarted, &[], &members, since).remove(0);
    assert_eq!(condition::is_true(&lost.conditions, "Ready"), Some(false));
    assert_eq!(lost.agent_namespaces, ["team"]);
    restarted.hello("c1", &hello("0.1.0", "uid-1"));
    let (_, widened) = due(&restarted, &["c1"], &members, Instant::now()).remove(0);
    assert!(widened.agent_namespaces.is_empty());
}

/// A hub that heard c1's agent 0.1.0 in the cluster `uid`, and the host showing what it
/// wrote.
fn pinned(uid: &str) -> (Membership, Store<MemberCluster>) {
    let m = Membership::new(Duration::from_secs(40));
    m.hello("c1", &hello("0.1.0", uid));
    let (_, status) = due(&m, &["c1"], &store(&[("c1", None)]), Instant::now()).remove(0);
    (m, holding(shown("c1", status)))
}

/// A hub failover: every agent says Hello to the new leader. What the MemberCluster
/// shows does not change, so nothing is written; a new agent version is.
#[test]
fn a_hello_that_changes_nothing_writes_nothing() {
    let (_, members) = pinned("uid-1");
    let restarted = Membership::new(Duration::from_secs(40));
    restarted.hello("c1", &hello("0.1.0", "uid-1"));
    assert!(due(&restarted, &["c1"], &members, Instant::now()).is_empty());
    restarted.heartbeat("c1");
    assert!(due(&restarted, &["c1"], &members, Instant::now()).is_empty());
    restarted.hello("c1", &hello("0.2.0", "uid-1"));
    let (_, upgraded) = due(&restarted, &["c1"], &members, Instant::now()).remove(0);
    assert_eq!(upgraded.agent_version.as_deref(), Some("0.2.0"));
}

/// Review M2: an agent that reconnects in a loop, saying another version each time,
/// made one MemberCluster write per reconnect. Now a burst is written, the rest waits for
/// the cluster's budget and is then written once, with the latest version.
#[tokio::test(start_paused = true)]
async fn a_reconnect_loop_writes_a_burst_then_the_latest_once() {
    let (m, mut members) = pinned("uid-1");
    let mut written = 1;
    for i in 0..100 {
        m.hello("c1", &hello(&format!("0.{i}.0"), "uid-1"));
        for (_, status) in due(&m, &["c1"], &members, Instant::now()) {
            members = holding(shown("c1", status));
            written += 1;
        }
    }
    // The first Hello turned c1 Ready, which the budget does not hold back.
    assert_eq!(written, 1 + CLUSTER_WRITE_BURST, "100 reconnects");
    assert_eq!(m.deferred(), ["c1"], "the latest version waits");
    // Readiness turning is not held back by the budget.
    let silent = Membership::new(Duration::from_secs(1));
    silent.hello("c1", &hello("0.1.0", "uid-1"));
    for _ in 0..CLUSTER_WRITE_BURST {
        assert!(silent.budget_allows("c1", Instant::now()));
    }
    tokio::time::advance(Duration::from_secs(2)).await;
    let gone = due(
        &silent,
        &[],
        &members,
        Instant::now() - Duration::from_secs(5),
    );
    assert_eq!(gone.len(), 1, "written though the budget is spent");
    assert_eq!(
        condition::is_true(&gone[0].1.conditions, "Ready"),
        Some(false)
    );
    tokio::time::advance(Duration::from_secs_f64(1.0 / CLUSTER_WRITES_PER_SECOND)).await;
    let (_, latest) = due(
        &m,
        &m.deferred().iter().map(String::as_str).collect::<Vec<_>>(),
        &members,
        Instant::now(),
    )
    .remove(0);
    assert_eq!(latest.agent_version.as_deref(), Some("0.99.0"));
    assert!(m.deferred().is_empty());
}

/// What an agent says of itself is bounded before it reaches the host.
#[test]
fn an_agents_strings_are_bounded() {
    let m = Membership::new(Duration::from_secs(40));
    m.hello("c1", &hello(&"v".repeat(10_000), &"u".repeat(10_000)));
    let (_, status) = due(&m, &["c1"], &store(&[("c1", None)]), Instant::now()).remove(0);
    assert_eq!(status.agent_version.unwrap().len(), AGENT_STRING_MAX);
    assert_eq!(status.cluster_uid, None, "not a UID: not pinned");
}

#[tokio::test(start_paused = true)]
async fn silence_past_the_grace_period_turns_a_cluster_not_ready() {
    let m = Membership::new(Duration::from_secs(1));
    let since = Instant::now();
    let members = store(&[("c1", Some(true)), ("c2", Some(false))]);
    assert!(
        due(&m, &[], &members, since).is_empty(),
        "within the first grace period no cluster is declared gone"
    );
    tokio::time::advance(Duration::from_millis(1100)).await;
    let due = due(&m, &[], &members, since);
    assert_eq!(due.len(), 1, "c2 already shows NotReady: nothing to write");
    assert_eq!(due[0].0, "c1");
    let ready = &due[0].1.conditions[0];
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "AgentSilent")
    );
}

/// The clusters marked for a status write by now.
async fn marked(m: &Membership) -> Vec<String> {
    let stop = CancellationToken::new();
    m.dirty
        .take(Duration::ZERO, Some(Duration::from_millis(1)), &stop)
        .await
        .unwrap()
}

/// A heartbeat alone is no news: a quiet fleet costs the host no write (it was one per
/// cluster per grace period: 25 writes/s at 1,000 clusters).
#[tokio::test(start_paused = true)]
async fn a_heartbeat_is_never_a_write() {
    let m = Membership::new(Duration::from_secs(40));
    let members = store(&[("c1", Some(true))]);
    let since = Instant::now();
    for _ in 0..100 {
        tokio::time::advance(Duration::from_secs(10)).await;
        m.heartbeat("c1");
        assert!(marked(&m).await.is_empty());
        assert!(due(&m, &[], &members, since).is_empty());
    }
}

#[test]
fn an_unchanged_ready_cluster_is_not_rewritten() {
    let m = Membership::new(Duration::from_secs(40));
    m.heartbeat("c1");
    assert!(due(&m, &[], &store(&[("c1", Some(true))]), Instant::now()).is_empty());
}

fn room(nodes: i32, cpu_millis: i64) -> ClusterCapacity {
    ClusterCapacity {
        nodes,
        allocatable: Resources {
            cpu_millis,
            memory_bytes: 12 << 30,
        },
        ..Default::default()
    }
}

#[test]
fn a_capacity_report_is_written_once_and_kept_across_hub_restarts() {
    let m = Membership::new(Duration::from_secs(40));
    m.heartbeat("c1");
    m.capacity("c1", room(3, 6000));
    let due_now = due(&m, &["c1"], &store(&[("c1", Some(true))]), Instant::now());
    assert_eq!(due_now[0].1.capacity.as_ref(), Some(&room(3, 6000)));
    // A hub that restarted has heard nothing yet: it keeps what the status shows.
    let restarted = Membership::new(Duration::from_secs(40));
    restarted.heartbeat("c1");
    let members = holding(shown(
        "c1",
        MemberClusterStatus {
            capacity: Some(room(3, 6000)),
            ..Default::default()
        },
    ));
    let due_now = due(&restarted, &["c1"], &members, Instant::now());
    assert_eq!(due_now[0].1.capacity.as_ref(), Some(&room(3, 6000)));
}

/// Capacity is written when it moved by a quantum, and one cluster's at most once per
/// capacity interval; a move held back is written when the interval is over.
#[tokio::test(start_paused = true)]
async fn capacity_is_written_on_a_quantum_at_most_once_per_interval() {
    let m =
        Membership::new(Duration::from_secs(40)).with_capacity_interval(Duration::from_secs(60));
    let since = Instant::now();
    m.hello("c1", &hello("0.1.0", "uid-1"));
    m.capacity("c1", room(3, 24_000));
    let (_, first) = due(&m, &["c1"], &store(&[("c1", None)]), since).remove(0);
    m.written("c1", 100, true);
    let members = holding(shown("c1", first.clone()));
    m.capacity("c1", room(3, 24_050));
    assert!(
        due(&m, &["c1"], &members, since).is_empty(),
        "50m is no news"
    );
    m.capacity("c1", room(4, 32_000));
    assert!(
        due(&m, &["c1"], &members, since).is_empty(),
        "a node joined, but the last capacity write is too recent"
    );
    tokio::time::advance(Duration::from_secs(60)).await;
    m.heartbeat("c1");
    let (_, second) = due(&m, &[], &members, since).remove(0);
    assert_eq!(
        second.capacity,
        Some(room(4, 32_000)),
        "written once the interval is over"
    );
    m.written("c1", 100, true);
    let members = holding(shown("c1", second));
    m.capacity("c1", room(3, 24_000));
    assert!(
        due(&m, &["c1"], &members, since).is_empty(),
        "held for the interval"
    );
    tokio::time::advance(Duration::from_secs(60)).await;
    m.heartbeat("c1");
    let due_now = due(&m, &[], &members, since);
    assert_eq!(due_now[0].1.capacity.as_ref(), Some(&room(3, 24_000)));
}

/// Only the exact count held back confirms; with nothing held back the annotation waits;
/// anything else is refused (and removed, so it cannot approve a later collection).
#[test]
fn a_confirmation_is_of_the_exact_count_held_back() {
    assert_eq!(confirmation("7", Some((7, 10))), Confirmation::Confirm(7));
    assert_eq!(confirmation(" 7 ", Some((7, 10))), Confirmation::Confirm(7));
    assert_eq!(confirmation("7", None), Confirmation::Wait);
    for (value, why) in [
        ("10", "it confirms 10, but the agent holds back 7"),
        (
            "4294967295",
            "it confirms 4294967295, but the agent holds back 7",
        ),
        ("6", "it confirms 6"),
        ("-1", "not the number"),
        ("all", "not the number"),
        ("", "not the number"),
    ] {
        let Confirmation::Refuse(e) = confirmation(value, Some((7, 10))) else {
            panic!("{value:?} confirmed something");
        };
        assert!(e.contains(why), "{value:?}: {e}");
    }
    assert!(matches!(confirmation("x", None), Confirmation::Refuse(_)));
}

#[test]
fn a_held_back_collection_shows_how_to_confirm_it() {
    let m = Membership::new(Duration::from_secs(40));
    m.heartbeat("c1");
    m.collection_blocked("c1", (7, 10), Instant::now());
    let due_now = due(&m, &["c1"], &store(&[("c1", Some(true))]), Instant::now());
    let blocked = due_now[0]
        .1
        .conditions
        .iter()
        .find(|c| c.type_ == "CollectionBlocked")
        .unwrap();
    assert_eq!(blocked.status, "True");
    assert!(
        blocked
            .message
            .contains("kubectl annotate membercluster c1 flotilla.io/confirm-collection=7"),
        "{}",
        blocked.message
    );
    // Confirmed and passed on to the agent: the condition clears.
    m.collection_confirmed("c1");
    let due_now = due(&m, &["c1"], &store(&[("c1", Some(true))]), Instant::now());
    let blocked = due_now[0]
        .1
        .conditions
        .iter()
        .find(|c| c.type_ == "CollectionBlocked");
    assert_eq!(blocked.unwrap().status, "False");
}

/// Review M2: an agent repeating CollectionBlocked gets one Event a minute, whatever
/// its sessions; each cluster its own.
#[test]
fn a_held_back_collection_is_an_event_at_most_once_a_minute_per_cluster() {
    let m = Membership::new(Duration::from_secs(40));
    let t0 = Instant::now();
    let events = (0..1000u32)
        .filter(|i| {
            m.collection_blocked("c1", (*i, 1000), t0 + Duration::from_millis(u64::from(*i)))
        })
        .count();
    assert_eq!(events, 1, "1,000 messages in 1 s");
    m.hello("c1", &hello("v1", ""));
    assert!(
        !m.collection_blocked("c1", (7, 10), t0 + Duration::from_secs(59)),
        "a new session"
    );
    assert!(
        m.collection_blocked("c2", (7, 10), t0 + Duration::from_secs(59)),
        "another cluster"
    );
    assert!(m.collection_blocked("c1", (7, 10), t0 + COLLECTION_BLOCKED_EVENT_EVERY));
}

/// An agent in another physical cluster is refused; so, once the UID is pinned, is one
/// that sends none (a copied token would otherwise pass by leaving it out). Before any
/// pin, neither is a reason to refuse.
#[test]
fn once_pinned_another_uid_or_none_is_refused() {
    let mut mc = MemberCluster::new("c1", Default::default());
    assert_eq!(
        foreign_cluster(&mc, "uid-2", ""),
        None,
        "nothing pinned yet"
    );
    assert_eq!(foreign_cluster(&mc, "", ""), None, "nothing pinned yet");
    mc.status = Some(MemberClusterStatus {
        cluster_uid: Some("uid-1".into()),
        ..Default::default()
    });
    assert_eq!(foreign_cluster(&mc, "uid-1", ""), None);
    let bound = "the credential of cluster \"c1\" is bound to the cluster whose kube-system namespace has UID uid-1";
    let other = foreign_cluster(&mc, "uid-2", "").expect("another cluster is refused");
    assert!(
        other.starts_with(bound) && other.ends_with("runs in uid-2"),
        "{other}"
    );
    let none = foreign_cluster(&mc, "", "").expect("no UID once pinned is refused");
    assert!(
        none.starts_with(bound) && none.contains("sent no cluster UID"),
        "{none}"
    );
    // A ClusterProperty alone does not get another cluster in under a UID pin.
    let stated = foreign_cluster(&mc, "uid-2", "eu-1").expect("no pin matches");
    assert!(
        stated.ends_with("runs in uid-2, whose ID is \"eu-1\""),
        "{stated}"
    );
    let stated = foreign_cluster(&mc, "", "eu-1").expect("no pin matches");
    assert!(
        stated.ends_with("the cluster whose ID is \"eu-1\""),
        "{stated}"
    );
}

/// The About API ID and the UID are pinned together; a match on either lets the agent
/// in, a match on neither never does.
#[test]
fn a_match_on_either_pin_is_accepted_and_on_neither_refused() {
    let mc = shown(
        "c1",
        MemberClusterStatus {
            cluster_uid: Some("uid-1".into()),
            cluster_id: Some("eu-1".into()),
            ..Default::default()
        },
    );
    assert_eq!(foreign_cluster(&mc, "uid-1", "eu-1"), None);
    assert_eq!(
        foreign_cluster(&mc, "uid-1", ""),
        None,
        "the property was removed"
    );
    assert_eq!(
        foreign_cluster(&mc, "uid-1", "eu-2"),
        None,
        "same cluster, new ID"
    );
    assert_eq!(
        foreign_cluster(&mc, "uid-9", "eu-1"),
        None,
        "rebuilt, same ID"
    );
    assert_eq!(
        foreign_cluster(&mc, "", "eu-1"),
        None,
        "no kube-system read"
    );
    let both = "is bound to the cluster whose kube-system namespace has UID uid-1 or whose ClusterProperty cluster.clusterset.k8s.io is \"eu-1\"";
    for (uid, id) in [("uid-9", "eu-2"), ("uid-9", ""), ("", "eu-2"), ("", "")] {
        let why = foreign_cluster(&mc, uid, id).expect("matches neither");
        assert!(why.contains(both), "{why}");
    }
    let only_id = shown(
        "c1",
        MemberClusterStatus {
            cluster_id: Some("eu-1".into()),
            ..Default::default()
        },
    );
    assert_eq!(foreign_cluster(&only_id, "uid-1", "eu-1"), None);
    let why = foreign_cluster(&only_id, "uid-1", "").expect("no pin matches");
    assert!(
        why.contains("bound to the cluster whose ClusterProperty cluster.clusterset.k8s.io is \"eu-1\"; this agent runs in uid-1"),
        "{why}"
    );
}

proptest::proptest! {
    /// Over any pins and any Hello, empty strings included: refused exactly when
    /// something is pinned and no non-empty value sent equals its pin.
    #[test]
    fn never_a_cluster_that_matches_neither_pin(
        pin_uid in proptest::option::of("|u1|u2"),
        pin_id in proptest::option::of("|i1|i2"),
        uid in "|u1|u2",
        id in "|i1|i2",
    ) {
        let mc = shown("c1", MemberClusterStatus {
            cluster_uid: pin_uid.clone(),
            cluster_id: pin_id.clone(),
            ..Default::default()
        });
        let pin_uid = pin_uid.filter(|p| !p.is_empty());
        let pin_id = pin_id.filter(|p| !p.is_empty());
        let nothing_pinned = pin_uid.is_none() && pin_id.is_none();
        let matches = (!uid.is_empty() && pin_uid == Some(uid.clone()))
            || (!id.is_empty() && pin_id == Some(id.clone()));
        let refused = foreign_cluster(&mc, &uid, &id);
        proptest::prop_assert_eq!(refused.is_none(), nothing_pinned || matches, "{:?}", refused);
    }
}

/// A cluster pinned by its UID that gains a ClusterProperty is accepted by the UID and
/// pins the ID beside it; rebuilt under the same ClusterProperty (a new UID) it is
/// accepted by the ID and the new UID is pinned; the old UID alone is then refused.
#[test]
fn the_pin_moves_to_the_stated_id_and_follows_a_rebuild() {
    let (_, members) = pinned("uid-1");
    let with_id = |uid: &str, id: &str| flotilla_proto::v1::Hello {
        cluster_id: id.into(),
        ..hello("0.1.0", uid)
    };
    let mc = members.get(&reflector::ObjectRef::new("c1")).unwrap();
    assert_eq!(foreign_cluster(&mc, "uid-1", "eu-1"), None);
    let m = Membership::new(Duration::from_secs(40));
    m.hello("c1", &with_id("uid-1", "eu-1"));
    let (_, status) = due(&m, &["c1"], &members, Instant::now()).remove(0);
    assert_eq!(status.cluster_uid.as_deref(), Some("uid-1"));
    assert_eq!(status.cluster_id.as_deref(), Some("eu-1"));
    let members = holding(shown("c1", status));
    let mc = members.get(&reflector::ObjectRef::new("c1")).unwrap();
    assert_eq!(foreign_cluster(&mc, "uid-2", "eu-1"), None, "rebuilt");
    m.hello("c1", &with_id("uid-2", "eu-1"));
    let (_, status) = due(&m, &["c1"], &members, Instant::now()).remove(0);
    assert_eq!(status.cluster_uid.as_deref(), Some("uid-2"));
    assert_eq!(status.cluster_id.as_deref(), Some("eu-1"));
    let members = holding(shown("c1", status));
    let mc = members.get(&reflector::ObjectRef::new("c1")).unwrap();
    assert!(
        foreign_cluster(&mc, "uid-1", "").is_some(),
        "the old cluster"
    );
    // A Hello without an ID (an older agent, a removed property) keeps the ID pinned.
    m.hello("c1", &hello("0.1.0", "uid-2"));
    assert!(due(&m, &["c1"], &members, Instant::now()).is_empty());
}

/// A Hello without a UID never unpins: the status keeps the UID first pinned.
#[test]
fn a_hello_without_a_uid_keeps_the_pin() {
    let (m, members) = pinned("uid-1");
    let restarted = Membership::new(Duration::from_secs(40));
    restarted.hello("c1", &hello("0.2.0", ""));
    let (_, status) = due(&restarted, &["c1"], &members, Instant::now()).remove(0);
    assert_eq!(status.cluster_uid.as_deref(), Some("uid-1"));
    m.hello("c1", &hello("0.2.0", ""));
    let (_, status) = due(&m, &["c1"], &members, Instant::now()).remove(0);
    assert_eq!(status.cluster_uid.as_deref(), Some("uid-1"));
}

#[tokio::test(start_paused = true)]
async fn a_capacity_replan_goes_at_once_then_at_most_once_per_period() {
    let mut d = Debounce::new(Duration::from_secs(10));
    let t = Instant::now();
    assert!(d.hit(t), "the first goes at once");
    assert_eq!(d.due(), None);
    assert!(!d.hit(t + Duration::from_secs(1)));
    assert!(!d.hit(t + Duration::from_secs(2)));
    assert_eq!(
        d.due(),
        Some(t + Duration::from_secs(10)),
        "held ones go together"
    );
    d.fired(t + Duration::from_secs(10));
    assert_eq!(d.due(), None);
    assert!(d.hit(t + Duration::from_secs(25)));
}

/// Heartbeats tell the status board which agents it heard; the watch tells it which
/// clusters are Ready.
#[test]
fn the_board_hears_heartbeats_and_readiness() {
    let board = Arc::new(StatusBoard::default());
    let m = Membership::new(Duration::from_secs(40)).with_status(board.clone());
    m.heartbeat("c1");
    let fleet = fleet::Fleet::of(&store(&[
        ("c1", Some(true)),
        ("c2", Some(false)),
        ("c3", None),
    ]));
    assert_eq!(fleet.ready(), &HashSet::from(["c1".to_owned()]));
}

fn member(name: &str, ready: bool) -> MemberCluster {
    let now = Time(Timestamp::now());
    let mut m = MemberCluster::new(name, Default::default());
    m.status = Some(MemberClusterStatus {
        conditions: vec![condition::new("Ready", ready, "X", "", None, &now)],
        ..Default::default()
    });
    m
}

/// The board's Ready clusters after a MemberCluster watch that delivers `lists` (each a
/// complete list, as at a start or a re-list), and whether the planner heard of them.
async fn ready_after(lists: Vec<Vec<MemberCluster>>) -> (HashSet<String>, bool) {
    use watcher::Event::{Init, InitApply, InitDone};
    let board = Arc::new(StatusBoard::default());
    let membership = Arc::new(Membership::new(Duration::from_secs(40)).with_status(board.clone()));
    let (members, writer) = reflector::store::<MemberCluster>();
    let (changed, changes) = watch::channel(MemberChanges::default());
    // Never called: no MemberCluster here asks for a collection to be confirmed.
    let client =
        kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap();
    let events = lists.into_iter().flat_map(|list| {
        std::iter::once(Init)
            .chain(list.into_iter().map(InitApply))
            .chain(std::iter::once(InitDone))
    });
    let events = reflector(writer, futures::stream::iter(events.map(Ok)));
    let dispatcher = Arc::new(Dispatcher::default());
    let ended = watch_members(events, members, dispatcher, membership, changed, client).await;
    assert!(ended.is_err(), "a watch that ends is an error");
    let heard = changes.borrow().clusters > 0;
    (board.reachable(), heard)
}

/// The store shows a list only at its InitDone: the board must learn the Ready clusters
/// then, at the hub's start and at every re-list, with no later event to help (a quiet
/// fleet writes none). Reading the store at each InitApply left the board with no Ready
/// cluster after a hub start, so every app read AgentDisconnected.
#[tokio::test]
async fn the_board_learns_the_ready_clusters_when_a_list_completes() {
    let first = vec![member("c1", true), member("c2", false)];
    assert_eq!(
        ready_after(vec![first.clone()]).await,
        (HashSet::from(["c1".to_owned()]), true)
    );
    let relisted = vec![member("c1", false), member("c2", true)];
    assert_eq!(
        ready_after(vec![first, relisted]).await.0,
        HashSet::from(["c2".to_owned()])
    );
}

/// A credential revoked or rotated is its own MemberCluster's event: that event closes
/// the cluster's session (a list closes every such session); an expired one is the
/// renewer's (`renew.rs`).
#[tokio::test]
async fn a_rotated_credential_closes_its_clusters_session_on_its_event() {
    use crate::auth::Identity;
    use flotilla_plan::index::Scope;
    use watcher::Event::{Apply, Init, InitApply, InitDone};
    let holding = |name: &str, hash: &str| {
        let mut m = member(name, true);
        m.spec.token_sha256 = Some(hash.to_owned());
        m
    };
    let dispatcher = Arc::new(Dispatcher::default());
    let connect = |cluster: &str, hash: &str| {
        let identity = Identity {
            cluster: cluster.into(),
            token_hash: hash.into(),
        };
        (dispatcher.connect(&identity, &HashMap::new(), Scope::All)).unwrap()
    };
    let (c1, c2, c3) = (
        connect("c1", "h1"),
        connect("c2", "h2"),
        connect("c3", "h3"),
    );
    let events = [
        Init,
        InitApply(holding("c1", "h1")),
        InitApply(holding("c2", "h2")),
        // c3's was rotated before the list: the list closes it.
        InitApply(holding("c3", "h3-new")),
        InitDone,
        Apply(holding("c2", "h2")),
        Apply(holding("c1", "h1-rotated")),
    ];
    let (members, writer) = reflector::store::<MemberCluster>();
    let events = reflector(writer, futures::stream::iter(events.map(Ok)));
    let (changed, _changes) = watch::channel(MemberChanges::default());
    let client =
        kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap();
    let membership = Arc::new(Membership::new(Duration::from_secs(40)));
    let ended = watch_members(
        events,
        members,
        dispatcher.clone(),
        membership,
        changed,
        client,
    );
    assert!(ended.await.is_err(), "a watch that ends is an error");
    assert!(c1.closed.is_cancelled(), "rotated: closed on its own event");
    assert!(!c2.closed.is_cancelled(), "its token is current");
    assert!(
        c3.closed.is_cancelled(),
        "rotated before the list: closed by it"
    );
    let open: Vec<String> = (dispatcher.sessions().iter())
        .map(|q| q.cluster().to_owned())
        .collect();
    assert_eq!(open, ["c2"]);
}
