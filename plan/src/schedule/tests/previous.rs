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
