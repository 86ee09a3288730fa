use super::*;
use flotilla_crds::member::{ClusterCapacity, MemberClusterSpec, MemberClusterStatus, Resources};

fn time(s: &str) -> Time {
    Time(s.parse().unwrap())
}

fn member(name: &str, labels: &[(&str, &str)]) -> MemberCluster {
    let mut m = MemberCluster::new(
        name,
        MemberClusterSpec {
            token_sha256: Some("ab".repeat(32)),
            ..Default::default()
        },
    );
    m.metadata.uid = Some(format!("uid-of-{name}"));
    m.metadata.creation_timestamp = Some(time("2026-01-01T00:00:00Z"));
    m.metadata.labels = Some(
        labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    );
    m
}

fn ready(mut m: MemberCluster, status: &str) -> MemberCluster {
    m.status = Some(MemberClusterStatus {
        conditions: vec![Condition {
            type_: "Ready".into(),
            status: status.into(),
            reason: "AgentHeartbeating".into(),
            message: "heartbeats arrive".into(),
            last_transition_time: time("2026-02-01T00:00:00Z"),
            observed_generation: None,
        }],
        last_heartbeat_time: Some(time("2026-02-02T00:00:00Z")),
        agent_version: Some("0.1.0".into()),
        kubernetes_version: Some("v1.34.1".into()),
        agent_namespaces: Vec::new(),
        cluster_uid: Some("11111111-2222".into()),
        cluster_id: None,
        capacity: Some(ClusterCapacity {
            nodes: 3,
            allocatable: Resources {
                cpu_millis: 12_000,
                memory_bytes: 1 << 34,
            },
            requested: Resources {
                cpu_millis: 13_000,
                memory_bytes: 1 << 30,
            },
            largest_free: Resources::default(),
        }),
    });
    m
}

const NOW: &str = "2026-03-01T12:00:00Z";

fn condition<'a>(p: &'a ClusterProfile, type_: &str) -> &'a Condition {
    let conditions = &p.status.as_ref().unwrap().conditions;
    conditions.iter().find(|c| c.type_ == type_).unwrap()
}

fn property<'a>(p: &'a ClusterProfile, name: &str) -> Option<&'a str> {
    let properties = &p.status.as_ref().unwrap().properties;
    properties
        .iter()
        .find(|x| x.name == name)
        .map(|x| x.value.as_str())
}

/// What the host gives back after an apply: the object with a uid and a version.
fn stored(mut p: ClusterProfile, version: &str) -> Arc<ClusterProfile> {
    p.metadata.uid = Some(format!("profile-uid-{}", p.name_any()));
    p.metadata.resource_version = Some(version.into());
    Arc::new(p)
}

#[test]
fn a_joined_ready_cluster_shows_health_identity_version_labels_and_capacity() {
    let m = ready(member("eu-1", &[("region", "eu")]), "True");
    let p = profile(&m, "flotilla-system", None, &time(NOW));

    assert_eq!(p.metadata.namespace.as_deref(), Some("flotilla-system"));
    assert_eq!(p.spec.cluster_manager.name, "flotilla");
    let labels = p.labels();
    assert_eq!(labels[CLUSTER_MANAGER_LABEL], "flotilla");
    assert_eq!(labels[MEMBER_ID_LABEL], "11111111-2222");
    assert_eq!(labels["region"], "eu");
    assert_eq!(
        p.annotations()[LABELS_ANNOTATION],
        "multicluster.x-k8s.io/inventory-member-id,region,x-k8s.io/cluster-manager"
    );
    let owner = &p.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("MemberCluster", "eu-1")
    );
    assert_eq!(owner.block_owner_deletion, None);

    let healthy = condition(&p, CONTROL_PLANE_HEALTHY);
    assert_eq!(
        (healthy.status.as_str(), healthy.reason.as_str()),
        ("True", "AgentHeartbeating")
    );
    assert_eq!(healthy.last_transition_time, time("2026-02-01T00:00:00Z"));
    let joined = condition(&p, JOINED);
    assert_eq!(
        (joined.status.as_str(), joined.reason.as_str()),
        ("True", "AgentJoined")
    );
    assert_eq!(joined.last_transition_time, time(NOW));

    let status = p.status.as_ref().unwrap();
    assert_eq!(status.version.kubernetes.as_deref(), Some("v1.34.1"));
    assert_eq!(property(&p, CLUSTER_ID_PROPERTY), Some("11111111-2222"));
    assert_eq!(property(&p, "flotilla.io/nodes"), Some("3"));
    assert_eq!(
        property(&p, "resources.flotilla.io/allocatable-cpu"),
        Some("12000m")
    );
    assert_eq!(
        property(&p, "resources.flotilla.io/allocatable-memory"),
        Some("17179869184")
    );
    // Requests above allocatable (pods bound before a node shrank) leave nothing free,
    // never a negative quantity.
    assert_eq!(
        property(&p, "resources.flotilla.io/available-cpu"),
        Some("0m")
    );
    assert_eq!(
        property(&p, "resources.flotilla.io/available-memory"),
        Some("16106127360")
    );
    assert_eq!(property(&p, "flotilla.io/unschedulable"), None);
    let observed = status
        .properties
        .iter()
        .map(|x| x.last_observed_time.clone());
    assert!(
        observed
            .into_iter()
            .all(|t| t == Some(time("2026-02-02T00:00:00Z")))
    );
}

/// A cluster that states its ID (About API) is published under it; the member-id label
/// stays the UID (a label value, whatever the ID looks like).
#[test]
fn a_stated_cluster_id_wins_over_the_uid() {
    let mut m = ready(member("eu-1", &[]), "True");
    m.status.as_mut().unwrap().cluster_id = Some("eu-west/1".into());
    let p = profile(&m, "flotilla-system", None, &time(NOW));
    assert_eq!(property(&p, CLUSTER_ID_PROPERTY), Some("eu-west/1"));
    assert_eq!(p.labels()[MEMBER_ID_LABEL], "11111111-2222");
    m.status.as_mut().unwrap().cluster_uid = None;
    let p = profile(&m, "flotilla-system", None, &time(NOW));
    assert_eq!(property(&p, CLUSTER_ID_PROPERTY), Some("eu-west/1"));
    assert_eq!(
        condition(&p, JOINED).reason,
        "AgentJoined",
        "pinned by its ID"
    );
}

#[test]
fn a_cluster_no_agent_joined_yet_is_unknown_and_not_joined() {
    let m = member("fresh", &[]);
    let p = profile(&m, "ns", None, &time(NOW));
    let healthy = condition(&p, CONTROL_PLANE_HEALTHY);
    assert_eq!(
        (healthy.status.as_str(), healthy.reason.as_str()),
        ("Unknown", "AgentNeverConnected")
    );
    assert_eq!(healthy.last_transition_time, time("2026-01-01T00:00:00Z"));
    let joined = condition(&p, JOINED);
    assert_eq!(
        (joined.status.as_str(), joined.reason.as_str()),
        ("False", "AwaitingAgent")
    );
    assert!(!p.labels().contains_key(MEMBER_ID_LABEL));
    let status = p.status.as_ref().unwrap();
    assert!(status.properties.is_empty());
    assert_eq!(status.version.kubernetes, None);
}

#[test]
fn a_revoked_cordoned_not_ready_cluster_says_so() {
    let mut m = ready(member("old", &[]), "False");
    m.spec.token_sha256 = None;
    m.spec.unschedulable = true;
    let p = profile(&m, "ns", None, &time(NOW));
    assert_eq!(condition(&p, CONTROL_PLANE_HEALTHY).status, "False");
    assert_eq!(condition(&p, JOINED).reason, "CredentialRevoked");
    assert_eq!(property(&p, "flotilla.io/unschedulable"), Some("true"));
}

#[test]
fn member_labels_cannot_claim_another_cluster_manager_or_identity() {
    let labels = [
        (CLUSTER_MANAGER_LABEL, "karmada"),
        (MEMBER_ID_LABEL, "someone-else"),
    ];
    let m = member("sneaky", &labels);
    let p = profile(&m, "ns", None, &time(NOW));
    assert_eq!(p.labels()[CLUSTER_MANAGER_LABEL], "flotilla");
    assert!(!p.labels().contains_key(MEMBER_ID_LABEL));
}

#[test]
fn joined_keeps_its_transition_time_while_it_holds_and_takes_now_when_it_changes() {
    let m = ready(member("a", &[]), "True");
    let first = profile(&m, "ns", None, &time("2026-03-01T00:00:00Z"));
    let later = profile(&m, "ns", Some(&first), &time("2026-03-02T00:00:00Z"));
    assert_eq!(
        condition(&later, JOINED).last_transition_time,
        time("2026-03-01T00:00:00Z")
    );
    let mut revoked = m.clone();
    revoked.spec.token_sha256 = None;
    let changed = profile(&revoked, "ns", Some(&later), &time("2026-03-03T00:00:00Z"));
    assert_eq!(
        condition(&changed, JOINED).last_transition_time,
        time("2026-03-03T00:00:00Z")
    );
}

#[test]
fn a_round_writes_only_what_changed() {
    let now = time(NOW);
    let members: Vec<_> = ["a", "b"]
        .iter()
        .map(|n| Arc::new(ready(member(n, &[("tier", "1")]), "True")))
        .collect();
    // Nothing published yet: both.
    let first = round(&members, &[], "ns", &now);
    assert_eq!(first.apply.len(), 2);
    assert!(first.delete.is_empty() && first.foreign.is_empty());
    // As the host stores them (a later clock too): nothing to do.
    let host: Vec<_> = first.apply.into_iter().map(|p| stored(p, "7")).collect();
    let idle = round(&members, &host, "ns", &time("2026-03-09T00:00:00Z"));
    assert_eq!(idle, Round::default());
    // Someone else's label on a profile is left alone and is no reason to write.
    let mut tagged = (*host[0]).clone();
    tagged.labels_mut().insert("team".into(), "x".into());
    let host = vec![Arc::new(tagged), host[1].clone()];
    assert_eq!(round(&members, &host, "ns", &now), Round::default());
    // A label gone from the MemberCluster is written away.
    let mut unlabelled = (*members[1]).clone();
    unlabelled.labels_mut().remove("tier");
    let members = vec![members[0].clone(), Arc::new(unlabelled)];
    let r = round(&members, &host, "ns", &now);
    assert_eq!(r.apply.len(), 1);
    assert_eq!(r.apply[0].name_any(), "b");
    assert!(!r.apply[0].labels().contains_key("tier"));
    // The cluster turning NotReady is written.
    let sick = vec![
        Arc::new(ready(member("a", &[("tier", "1")]), "False")),
        members[1].clone(),
    ];
    let r = round(&sick, &host, "ns", &now);
    assert!(r.apply.iter().any(|p| p.name_any() == "a"));
}

#[test]
fn profiles_of_unregistered_clusters_go_and_other_managers_profiles_stay() {
    let now = time(NOW);
    let members = vec![Arc::new(ready(member("a", &[]), "True"))];
    let ours_gone = stored(profile(&member("gone", &[]), "ns", None, &now), "3");
    let mut theirs = ClusterProfile::new(
        "a",
        ClusterProfileSpec {
            display_name: None,
            cluster_manager: ClusterManager {
                name: "open-cluster-management".into(),
            },
        },
    );
    theirs.metadata.uid = Some("ocm".into());
    let mut theirs_elsewhere = theirs.clone();
    theirs_elsewhere.metadata.name = Some("not-ours".into());
    let host = vec![ours_gone, Arc::new(theirs), Arc::new(theirs_elsewhere)];
    let r = round(&members, &host, "ns", &now);
    assert_eq!(r.foreign, vec!["a".to_owned()]);
    assert!(r.apply.is_empty());
    assert_eq!(
        r.delete,
        vec![("gone".to_owned(), "profile-uid-gone".to_owned())]
    );
}

#[test]
fn a_member_being_deleted_is_neither_rewritten_nor_its_profile_deleted_early() {
    let now = time(NOW);
    let mut going = ready(member("going", &[]), "True");
    let host = vec![stored(profile(&going, "ns", None, &now), "1")];
    going.metadata.deletion_timestamp = Some(now.clone());
    going.spec.token_sha256 = None;
    let r = round(&[Arc::new(going)], &host, "ns", &now);
    assert_eq!(r, Round::default());
}

#[test]
fn now_is_whole_seconds() {
    let t = now();
    assert_eq!(t.0.subsec_nanosecond(), 0);
}

#[test]
fn the_inventory_namespace_is_flotillas_own_unless_named_or_off() {
    let args = |namespace: Option<&str>, disabled| InventoryArgs {
        namespace: namespace.map(str::to_owned),
        disabled,
    };
    let ns = |a: InventoryArgs| a.namespace("flotilla-system");
    assert_eq!(ns(args(None, false)).as_deref(), Some("flotilla-system"));
    assert_eq!(ns(args(Some("fleet"), false)).as_deref(), Some("fleet"));
    assert_eq!(ns(args(Some("fleet"), true)), None);
}

#[test]
fn a_profile_deleted_behind_the_hubs_back_is_created_again_after_the_cache_lag() {
    let mut gate = Gate::default();
    let t0 = Instant::now();
    assert!(gate.may_write("p", "", t0));
    // Created: the apiserver answered with version 1.
    let write = Write {
        key: "p".to_owned(),
        patch: Value::Null,
        version: String::new(),
        digest: 0,
    };
    assert!(gate.tracker.settle(write, Ok(("1".into(), 10)), t0).is_ok());
    // The cache has not shown it yet: not again.
    assert!(!gate.may_write("p", "", t0 + Duration::from_secs(1)));
    // It never shows it (the garbage collector deleted it first): created again.
    assert!(gate.may_write("p", "", t0 + CACHE_LAG + Duration::from_secs(1)));
    // An update against the version the cache shows goes through.
    assert!(gate.may_write("p", "1", t0 + CACHE_LAG + Duration::from_secs(2)));
}

#[test]
fn a_cluster_whose_token_expired_unrenewed_is_not_joined() {
    let mut m = ready(member("late", &[]), "False");
    m.spec.token_expires_at = Some(time("2026-02-28T00:00:00Z"));
    let p = profile(&m, "ns", None, &time(NOW));
    assert_eq!(condition(&p, JOINED).reason, "CredentialExpired");
    // A next token still valid: the agent may yet prove it holds it.
    m.spec.next_token_sha256 = Some("cd".repeat(32));
    m.spec.next_token_expires_at = Some(time("2026-04-01T00:00:00Z"));
    let p = profile(&m, "ns", None, &time(NOW));
    assert_eq!(condition(&p, JOINED).reason, "AgentJoined");
    // Not yet expired.
    m.spec.token_expires_at = Some(time("2026-03-02T00:00:00Z"));
    m.spec.next_token_sha256 = None;
    assert_eq!(
        condition(&profile(&m, "ns", None, &time(NOW)), JOINED).reason,
        "AgentJoined"
    );
}
