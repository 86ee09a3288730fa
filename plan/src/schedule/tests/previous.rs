//! The previous division read from status, and the division written back into it.

use super::*;

#[test]
fn previous_reads_status_and_older_status_without_replicas() {
    let status: FederatedMyAppStatus = serde_yaml::from_str(
        "clusters:\n- {name: a, replicas: 4, readyReplicas: 2, schedulingReason: Weight}\n- {name: b, readyReplicas: 0}\n- {name: c, replicas: 40, readyReplicas: -3}\n",
    )
    .unwrap();
    let p = previous(Some(&status));
    assert_eq!(
        p["a"],
        Previous {
            replicas: 4,
            ready_replicas: 2,
            reason: Some(Weight)
        }
    );
    assert_eq!(
        p["b"],
        Previous {
            replicas: 1,
            ready_replicas: 0,
            reason: None
        }
    );
    assert_eq!(
        p["c"],
        Previous {
            replicas: 10,
            ready_replicas: 0,
            reason: None
        }
    );
    assert!(previous(None).is_empty());
}

/// A member that reports more ready replicas than it was assigned counts only its
/// assignment: it cannot end the make-before-break wait of the clusters that keep
/// replicas for it.
#[test]
fn ready_replicas_count_at_most_the_assignment() {
    let status: FederatedMyAppStatus = serde_yaml::from_str(&format!(
        "clusters:\n- {{name: liar, replicas: 3, readyReplicas: {}}}\n- {{name: b, replicas: 0, readyReplicas: 5}}\n",
        i32::MAX
    ))
    .unwrap();
    let p = previous(Some(&status));
    assert_eq!((p["liar"].replicas, p["liar"].ready_replicas), (3, 3));
    assert_eq!((p["b"].replicas, p["b"].ready_replicas), (0, 0));
    let partial: FederatedMyAppStatus = serde_yaml::from_str(
        "omittedClusters: 1\ndivision:\n- {replicas: 2, readyReplicas: 900, reason: Weight, clusters: x}\n",
    )
    .unwrap();
    assert_eq!(previous(Some(&partial))["x"].ready_replicas, 2);

    // Weights move 3 more replicas to c3, which claims 1,000 ready before it was even
    // assigned them: c1 keeps its replicas until the status shows c3 assigned 6 and
    // ready.
    let mut c = Case::new(WEIGHTED_2_1_1);
    let s = c.ok();
    c.settle(&s);
    c.placement = placement(
        "replicaScheduling: {mode: Weighted, totalReplicas: 12, preferences: [{clusterNames: [c3], weight: 2}]}",
    );
    let mut status: FederatedMyAppStatus = serde_yaml::from_str(
        "clusters:\n- {name: c1, replicas: 6, readyReplicas: 6}\n- {name: c2, replicas: 3, readyReplicas: 3}\n- {name: c3, replicas: 3, readyReplicas: 1000}\n",
    )
    .unwrap();
    c.previous = previous(Some(&status));
    assert_eq!(shares(&c.ok()), [(6, Surplus), (3, Weight), (6, Weight)]);
    status.clusters[2].replicas = Some(6);
    c.previous = previous(Some(&status));
    assert_eq!(shares(&c.ok()), [(3, Weight), (3, Weight), (6, Weight)]);
}

#[test]
fn annotate_fills_each_cluster_and_the_totals() {
    let s = Case::new(WEIGHTED_2_1_1).ok();
    let mut status: FederatedMyAppStatus = serde_yaml::from_str(
        "clusters:\n- {name: c1, readyReplicas: 6}\n- {name: c2, readyReplicas: 1}\n",
    )
    .unwrap();
    annotate(&mut status, &s);
    assert_eq!(status.replicas, Some(12));
    assert_eq!(status.ready_replicas, 7);
    assert_eq!(status.clusters[0].replicas, Some(6));
    assert_eq!(status.clusters[1].scheduling_reason, Some(Weight));
}

/// Agents report the ready counts: each is read within the cluster's share (an agent
/// saying `i32::MAX` or a negative count neither inflates the total nor overflows it),
/// and within the MyApp's limit of 10 where an autoscaler in the member owns the count.
#[test]
fn annotate_reads_each_ready_count_within_the_share() {
    let s = Case::new(WEIGHTED_2_1_1).ok();
    let mut status: FederatedMyAppStatus = serde_yaml::from_str(&format!(
        "clusters:\n- {{name: c1, readyReplicas: {}}}\n- {{name: c2, readyReplicas: {}}}\n- {{name: c3, readyReplicas: {}}}\n- {{name: c4, readyReplicas: {}}}\n",
        i32::MAX,
        i32::MIN,
        i32::MAX,
        i32::MAX
    ))
    .unwrap();
    status.clusters[2].autoscaler = Some("hpa".into());
    annotate(&mut status, &s);
    let ready: Vec<i32> = status.clusters.iter().map(|c| c.ready_replicas).collect();
    // c1's share is 6, c3 is autoscaled (the MyApp's limit, 10), c4 has no share.
    assert_eq!(ready, [6, 0, 10, 10]);
    assert_eq!(status.ready_replicas, 26);
}

/// A status that lists only some clusters carries the whole division: it is what the
/// next plan reads (an old hub's full list is read as before).
#[test]
fn previous_reads_the_division_when_the_list_is_partial() {
    let status: FederatedMyAppStatus = serde_yaml::from_str(
        "omittedClusters: 60\nclusters:\n- {name: c9, replicas: 9, readyReplicas: 9}\n\
         division:\n- {replicas: 2, readyReplicas: 1, reason: Weight, clusters: 'c01,2:2'}\n\
         - {replicas: 3, readyReplicas: 0, reason: FailedOver, clusters: x}\n\
         - {replicas: 5, clusters: 'y,7:z'}\n",
    )
    .unwrap();
    let p = previous(Some(&status));
    let weight = Previous {
        replicas: 2,
        ready_replicas: 1,
        reason: Some(Weight),
    };
    assert_eq!(p["c01"], weight);
    assert_eq!(p["c02"], weight);
    assert_eq!(p["x"].reason, Some(FailedOver));
    assert!(
        !p.contains_key("c9"),
        "the listed clusters are in the division or hold nothing"
    );
    assert!(
        !p.contains_key("y"),
        "a group that does not decode is left out"
    );
    assert_eq!(p.len(), 3);
}

#[test]
fn the_division_groups_clusters_by_assignment_and_leaves_out_empty_ones() {
    let status: FederatedMyAppStatus = serde_yaml::from_str(
        "clusters:\n- {name: b, replicas: 2, readyReplicas: 2, schedulingReason: Weight}\n\
         - {name: a, replicas: 2, readyReplicas: 2, schedulingReason: Weight}\n\
         - {name: c, replicas: 0, schedulingReason: Spread}\n\
         - {name: d, replicas: 0, schedulingReason: Recovered}\n\
         - {name: unknown, readyReplicas: 0}\n",
    )
    .unwrap();
    let groups = division(&status.clusters);
    let shown: Vec<(i32, Option<SchedulingReason>, &str)> = groups
        .iter()
        .map(|g| (g.replicas, g.reason, g.clusters.as_str()))
        .collect();
    assert_eq!(shown, [(0, Some(Recovered), "d"), (2, Some(Weight), "a,b")]);
}
