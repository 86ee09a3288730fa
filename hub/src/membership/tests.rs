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

#[test]
fn a_held_back_collection_shows_how_to_confirm_it() {
    let m = Membership::new(Duration::from_secs(40));
    m.heartbeat("c1");
    m.collection_blocked("c1", 7, 10);
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

/// An agent in another physical cluster is refused; so, once the UID is pinned, is one
/// that sends none (a copied token would otherwise pass by leaving it out). Before any
/// pin, neither is a reason to refuse.
#[test]
fn once_pinned_another_uid_or_none_is_refused() {
    let mut mc = MemberCluster::new("c1", Default::default());
    assert_eq!(foreign_cluster(&mc, "uid-2"), None, "nothing pinned yet");
    assert_eq!(foreign_cluster(&mc, ""), None, "nothing pinned yet");
    mc.status = Some(MemberClusterStatus {
        cluster_uid: Some("uid-1".into()),
        ..Default::default()
    });
    assert_eq!(foreign_cluster(&mc, "uid-1"), None);
    let bound = "the credential of cluster \"c1\" is bound to the cluster whose kube-system namespace has UID uid-1";
    let other = foreign_cluster(&mc, "uid-2").expect("another cluster is refused");
    assert!(
        other.starts_with(bound) && other.ends_with("runs in uid-2"),
        "{other}"
    );
    let none = foreign_cluster(&mc, "").expect("no UID once pinned is refused");
    assert!(
        none.starts_with(bound) && none.contains("sent no cluster UID"),
        "{none}"
    );
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
    assert_eq!(
        ready_clusters(&store(&[
            ("c1", Some(true)),
            ("c2", Some(false)),
            ("c3", None)
        ])),
        HashSet::from(["c1".to_owned()])
    );
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
