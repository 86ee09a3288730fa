//! `flotilla-hub render` previews the replica division offline, from a FederatedMyApp and
//! MemberClusters carrying labels, cordons, readiness and capacity.

use std::process::{Command, Output};

fn dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("flotilla-schedule-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Renders `app` against `clusters` (both YAML) as JSON, at a fixed time.
fn render(name: &str, app: &str, clusters: &str) -> Output {
    let (a, c) = (
        dir().join(format!("{name}-app.yaml")),
        dir().join(format!("{name}-clusters.yaml")),
    );
    std::fs::write(&a, app).unwrap();
    std::fs::write(&c, clusters).unwrap();
    Command::new(env!("CARGO_BIN_EXE_flotilla-hub"))
        .args([
            "render",
            "-o",
            "json",
            "--now",
            "2025-01-01T01:00:00Z",
            "-f",
        ])
        .arg(&a)
        .arg("--clusters")
        .arg(&c)
        .output()
        .expect("flotilla-hub runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Each rendered cluster's `spec.replicas`.
fn replicas(out: &Output) -> Vec<(String, i64)> {
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    v.as_object()
        .unwrap()
        .iter()
        .map(|(c, m)| (c.clone(), m["spec"]["replicas"].as_i64().unwrap()))
        .collect()
}

fn app(placement: &str) -> String {
    format!(
        "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {{name: web, namespace: shop}}\n\
         spec:\n  placement:\n{placement}\n  template:\n    spec:\n      image: 'nginx:1.27'\n      \
         resources: {{requests: {{cpu: 500m, memory: 256Mi}}}}\n"
    )
}

fn cluster(name: &str, region: &str, extra: &str) -> String {
    format!(
        "- apiVersion: core.kubefed.io/v1beta1\n  kind: MemberCluster\n  metadata: {{name: {name}, labels: {{region: {region}}}}}\n{extra}"
    )
}

fn sized(name: &str, region: &str, cpu_millis: i64) -> String {
    cluster(
        name,
        region,
        &format!(
            "  status:\n    capacity: {{nodes: 1, allocatable: {{cpuMillis: {cpu_millis}, memoryBytes: 68719476736}}, \
             requested: {{cpuMillis: 0, memoryBytes: 0}}, largestFree: {{cpuMillis: {cpu_millis}, memoryBytes: 68719476736}}}}\n"
        ),
    )
}

fn three() -> String {
    [
        cluster("c1", "eu", ""),
        cluster("c2", "eu", ""),
        cluster("c3", "us", ""),
    ]
    .concat()
}

fn pairs(v: &[(&str, i64)]) -> Vec<(String, i64)> {
    v.iter().map(|(c, n)| ((*c).to_owned(), *n)).collect()
}

#[test]
fn weighted_two_one_one_divides_twelve_as_six_three_three() {
    let out = render(
        "weighted",
        &app(
            "    clusterSelector: {}\n    replicaScheduling:\n      mode: Weighted\n      totalReplicas: 12\n      \
              preferences: [{clusterNames: [c1], weight: 2}]",
        ),
        &three(),
    );
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(replicas(&out), pairs(&[("c1", 6), ("c2", 3), ("c3", 3)]));
    assert_eq!(
        stderr.trim(),
        "schedule: FederatedMyApp shop/web: 12 replicas: c1 6 (Weight), c2 3 (Weight), c3 3 (Weight)"
    );
}

#[test]
fn capacity_follows_the_clusters_sizes() {
    // Room for 16, 8 and 2 replicas of 500m.
    let clusters = [
        sized("big", "eu", 8000),
        sized("mid", "eu", 4000),
        sized("small", "us", 1000),
    ]
    .concat();
    let out = render(
        "capacity",
        &app("    clusterSelector: {}\n    replicaScheduling: {mode: Capacity, totalReplicas: 13}"),
        &clusters,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        replicas(&out),
        pairs(&[("big", 8), ("mid", 4), ("small", 1)])
    );
}

#[test]
fn spread_over_regions_and_cordon() {
    let clusters = [
        cluster("c1", "eu", ""),
        cluster("c2", "eu", ""),
        cluster("c3", "us", "  spec: {unschedulable: true}\n"),
        cluster("c4", "ap", ""),
    ]
    .concat();
    let out = render(
        "spread",
        &app(
            "    clusterSelector: {}\n    replicaScheduling:\n      mode: Weighted\n      totalReplicas: 4\n      \
              preferences: [{clusterSelector: {matchLabels: {region: eu}}, weight: 10}, {weight: 0}]\n    \
              spread: {spreadByLabel: region, minGroups: 2}",
        ),
        &clusters,
    );
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // Cordoned c3 gets nothing; ap's c4 is the second region, with one replica.
    assert_eq!(replicas(&out), pairs(&[("c1", 2), ("c2", 1), ("c4", 1)]));
    assert!(stderr.contains("c3 0 (Cordoned)"), "{stderr}");
}

#[test]
fn failover_preview_moves_the_share_and_leaves_the_copy() {
    let clusters = [
        cluster(
            "c1",
            "eu",
            "  status:\n    conditions: [{type: Ready, status: 'False', reason: AgentSilent, message: '', lastTransitionTime: '2025-01-01T00:50:00Z'}]\n",
        ),
        cluster("c2", "eu", ""),
        cluster("c3", "us", ""),
    ]
    .concat();
    let placement = "    clusterSelector: {}\n    replicaScheduling:\n      mode: Weighted\n      totalReplicas: 12\n      \
                     preferences: [{clusterNames: [c1], weight: 2}]\n    failover: {gracePeriodSeconds: 300}";
    let out = render("failover", &app(placement), &clusters);
    let stderr = text(&out.stderr);
    assert!(
        out.status.success(),
        "a failed-over cluster is no error: {stderr}"
    );
    assert_eq!(replicas(&out), pairs(&[("c2", 6), ("c3", 6)]));
    assert!(
        stderr.contains(
            "note: FederatedMyApp shop/web, cluster c1: NotReady past the failover grace period"
        ),
        "{stderr}"
    );
    // Ten minutes down is within a 15 minute grace: nothing moves yet. The previous
    // division comes from the FederatedMyApp's status.
    let with_status = app(&placement.replace("300", "900"))
        + "status:\n  clusters:\n  - {name: c1, replicas: 6, readyReplicas: 6}\n  \
           - {name: c2, replicas: 3, readyReplicas: 3}\n  - {name: c3, replicas: 3, readyReplicas: 3}\n";
    let out = render("grace", &with_status, &clusters);
    assert_eq!(replicas(&out), pairs(&[("c1", 6), ("c2", 3), ("c3", 3)]));
    assert!(
        text(&out.stderr).contains("c1 6 (NotReady)"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn an_infeasible_total_names_the_app_and_the_field() {
    let out = render(
        "infeasible",
        &app("    clusterSelector: {}\n    replicaScheduling: {mode: Weighted, totalReplicas: 31}"),
        &three(),
    );
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("FederatedMyApp shop/web"), "{stderr}");
    assert!(
        stderr.contains(
            "spec.placement.replicaScheduling.totalReplicas: 31 replicas cannot be divided: 3 schedulable cluster(s) take 0 to 30 between them"
        ),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn the_seed_example_is_duplicated_as_before() {
    let seed = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/federatedmyapp.yaml"
    ))
    .unwrap();
    let out = render(
        "seed",
        &seed,
        &[cluster("cluster1", "eu", ""), cluster("cluster2", "us", "")].concat(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(replicas(&out), pairs(&[("cluster1", 3), ("cluster2", 5)]));
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
}
