//! `flotilla-hub render` and `flotilla-hub crds` as a user runs them.

use std::io::Write;
use std::process::{Command, Output, Stdio};

const SEED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/federatedmyapp.yaml"
);

const OVERRIDES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/overrides.yaml");
const MEMBERS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/memberclusters.yaml"
);

fn hub(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_flotilla-hub"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("flotilla-hub starts");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.unwrap_or_default().as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn temp_file(name: &str, contents: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("flotilla-render-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn seed_renders_as_json_per_cluster() {
    let out = hub(&["render", "-f", SEED, "-o", "json"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["cluster1"]["spec"]["replicas"], 3);
    assert_eq!(v["cluster2"]["spec"]["replicas"], 5);
    assert_eq!(v.as_object().unwrap().len(), 2);
}

#[test]
fn seed_renders_as_yaml_documents_from_stdin() {
    let seed = std::fs::read_to_string(SEED).unwrap();
    let out = hub(&["render", "-f", "-"], Some(&seed));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("# cluster: cluster1\n---\n"), "{stdout}");
    assert!(stdout.contains("# cluster: cluster2\n---\n"));
    assert_eq!(stdout.matches("kind: MyApp").count(), 2);
}

#[test]
fn cluster_list_feeds_the_selector() {
    let app = temp_file(
        "selector.yaml",
        "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: web, namespace: shop}\n\
         spec:\n  placement: {clusterSelector: {matchLabels: {region: eu}}}\n  template: {spec: {replicas: 2, image: 'nginx:1.27'}}\n",
    );
    let clusters = temp_file(
        "clusters.yaml",
        "apiVersion: core.kubefed.io/v1beta1\nkind: MemberCluster\nmetadata: {name: paris, labels: {region: eu}}\n---\n\
         apiVersion: v1\nkind: List\nitems:\n- {kind: MemberCluster, metadata: {name: ohio, labels: {region: us}}}\n\
         - {kind: MemberCluster, metadata: {name: berlin, labels: {region: eu}}}\n",
    );
    let out = hub(
        &[
            "render",
            "-f",
            app.to_str().unwrap(),
            "--clusters",
            clusters.to_str().unwrap(),
            "-o",
            "json",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(names, ["berlin", "paris"]);
    assert_eq!(v["paris"]["metadata"]["namespace"], "shop");
}

#[test]
fn a_bad_override_fails_naming_object_cluster_field_and_path_but_prints_the_rest() {
    let app = temp_file(
        "bad.yaml",
        "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {name: web, namespace: shop}\n\
         spec:\n  placement: {clusters: [{name: a}, {name: b}]}\n  template: {spec: {replicas: 2}}\n  overrides:\n\
         \x20 - clusterName: b\n    clusterOverrides:\n    - {path: /spec/replicas, value: 11}\n\
         \x20 - clusterName: zz\n    clusterOverrides:\n    - {path: /spec/replicas, value: 1}\n",
    );
    let out = hub(&["render", "-f", app.to_str().unwrap(), "-o", "json"], None);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(
            "error: FederatedMyApp shop/web, cluster b: the rendered MyApp is invalid at /spec/replicas: \
             11 is greater than the maximum of 10 (set by spec.overrides[0].clusterOverrides[0])"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("warning: FederatedMyApp shop/web: overrides for cluster zz are ignored"),
        "{stderr}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["a"]["spec"]["replicas"], 2,
        "the good cluster is still printed"
    );
    assert!(v.get("b").is_none());
}

/// README's "Overrides by label": what `render` prints is what the e2e `propagation`
/// suite finds on the lab's members.
#[test]
fn overrides_by_label_the_image_helper_and_label_values_preview_per_cluster() {
    let args = [
        "render",
        "-f",
        OVERRIDES,
        "--clusters",
        MEMBERS,
        "-o",
        "json",
    ];
    let out = hub(&args, None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stderr), "");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let got = |c: &str| {
        let m = &v[c];
        (
            m["spec"]["image"].as_str().unwrap().to_owned(),
            m["spec"]["replicas"].as_i64().unwrap(),
            m["metadata"]["labels"]["region"]
                .as_str()
                .unwrap()
                .to_owned(),
        )
    };
    let eu = "registry.eu.example.com/library/nginx";
    let want =
        |image: &str, replicas: i64, region: &str| (image.to_owned(), replicas, region.to_owned());
    assert_eq!(got("cluster1"), want(&format!("{eu}:1.27.3"), 4, "eu"));
    assert_eq!(got("cluster2"), want("nginx:1.27", 2, "us"));
    assert_eq!(got("cluster3"), want(&format!("{eu}:1.27"), 3, "eu"));
    // The command as README and docs/overrides.md show it: YAML, one document each.
    let out = hub(&args[..5], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert_eq!(stdout.matches("kind: MyApp").count(), 3, "{stdout}");
    assert!(
        stdout.contains("image: registry.eu.example.com/library/nginx:1.27.3"),
        "{stdout}"
    );
}

#[test]
fn a_missing_label_fails_that_cluster_naming_object_cluster_field_and_label() {
    let members = std::fs::read_to_string(MEMBERS).unwrap()
        + "---\napiVersion: core.kubefed.io/v1beta1\nkind: MemberCluster\nmetadata: {name: bare}\n";
    let members = temp_file("members-bare.yaml", &members);
    let args = [
        "render",
        "-f",
        OVERRIDES,
        "--clusters",
        members.to_str().unwrap(),
        "-o",
        "json",
    ];
    let out = hub(&args, None);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert_eq!(
        stderr.trim(),
        "error: FederatedMyApp default/web, cluster bare: spec.overrides[1].clusterOverrides[0] \
         (add /metadata/labels/region): valueFrom.clusterLabel: MemberCluster bare has no label \
         topology.kubernetes.io/region"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(
        names,
        ["cluster1", "cluster2", "cluster3"],
        "the others still render"
    );
}

#[test]
fn unreadable_input_is_a_clear_error() {
    let out = hub(&["render", "-f", "/nonexistent/app.yaml"], None);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("reading /nonexistent/app.yaml"),
        "{}",
        text(&out.stderr)
    );
    let out = hub(&["render", "-f", "-"], Some("kind: [unclosed"));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("- is not a FederatedMyApp"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn crds_prints_the_checked_in_yaml() {
    let out = hub(&["crds"], None);
    assert!(out.status.success());
    let checked_in = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crds/flotilla-crds.yaml"
    ))
    .unwrap();
    assert_eq!(text(&out.stdout), checked_in);
    let out = hub(&["crds", "--cluster-inventory"], None);
    assert!(out.status.success());
    let checked_in = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crds/cluster-inventory-crds.yaml"
    ))
    .unwrap();
    assert_eq!(text(&out.stdout), checked_in);
}

// The bad-input catalog, as `flotilla-hub render` shows it: one case per test, each
// asserting the exact error a user reads, and that the other cluster still renders.

/// Renders web (placed on a and b) with one override for b; returns (stderr, stdout JSON).
fn render_with_override(case: &str, override_yaml: &str) -> (String, serde_json::Value) {
    let app = temp_file(
        &format!("catalog-{case}.yaml"),
        &format!(
            "apiVersion: core.kubefed.io/v1beta1\nkind: FederatedMyApp\nmetadata: {{name: web, namespace: shop}}\n\
             spec:\n  placement: {{clusters: [{{name: a}}, {{name: b}}]}}\n  template: {{spec: {{replicas: 2, image: 'nginx:1.27'}}}}\n\
             \x20 overrides:\n  - clusterName: b\n    clusterOverrides:\n    - {override_yaml}\n"
        ),
    );
    let out = hub(&["render", "-f", app.to_str().unwrap(), "-o", "json"], None);
    assert!(!out.status.success(), "{case}: a bad override must fail");
    let stdout = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (text(&out.stderr), stdout)
}

/// The error line is exactly `want`, and cluster a still got its MyApp.
fn assert_catalog(case: &str, override_yaml: &str, want: &str) {
    let (stderr, stdout) = render_with_override(case, override_yaml);
    assert_eq!(stderr.trim_end(), want, "{case}");
    assert_eq!(stdout["a"]["spec"]["replicas"], 2, "{case}: cluster a");
    assert!(stdout.get("b").is_none(), "{case}: cluster b rendered");
}

#[test]
fn catalog_pointer_without_leading_slash() {
    assert_catalog(
        "no-slash",
        "{path: spec/replicas, value: 2}",
        "error: FederatedMyApp shop/web, cluster b: spec.overrides[0].clusterOverrides[0] \
         (replace spec/replicas): path must be a JSON pointer starting with '/', e.g. /spec/replicas",
    );
}

#[test]
fn catalog_pointer_with_a_bad_escape() {
    assert_catalog(
        "bad-escape",
        "{path: \"/spec/replicas~2\", value: 1}",
        "error: FederatedMyApp shop/web, cluster b: spec.overrides[0].clusterOverrides[0] \
         (replace /spec/replicas~2): invalid JSON pointer: '~' must be followed by 0 or 1",
    );
}

#[test]
fn catalog_replace_of_a_missing_path() {
    assert_catalog(
        "replace-missing",
        "{path: /spec/nothing/deep, value: 2}",
        "error: FederatedMyApp shop/web, cluster b: spec.overrides[0].clusterOverrides[0] \
         (replace /spec/nothing/deep): nothing at this path in the template; replace needs an \
         existing value (use add to create one)",
    );
}

#[test]
fn catalog_remove_of_a_missing_path() {
    let (stderr, stdout) =
        render_with_override("remove-missing", "{path: /spec/config/missing, op: remove}");
    assert!(
        stderr.starts_with(
            "error: FederatedMyApp shop/web, cluster b: spec.overrides[0].clusterOverrides[0] \
             (remove /spec/config/missing): nothing at this path in the template; remove needs an \
             existing value"
        ),
        "{stderr}"
    );
    assert_eq!(stdout["a"]["spec"]["replicas"], 2);
}

#[test]
fn catalog_add_without_value() {
    assert_catalog(
        "add-no-value",
        "{path: /spec/replicas, op: add}",
        "error: FederatedMyApp shop/web, cluster b: spec.overrides[0].clusterOverrides[0] \
         (add /spec/replicas): add needs a value",
    );
}

#[test]
fn catalog_value_of_the_wrong_type() {
    assert_catalog(
        "wrong-type",
        "{path: /spec/replicas, value: three}",
        "error: FederatedMyApp shop/web, cluster b: the rendered MyApp is invalid at /spec/replicas: \
         \"three\" is not of type \"integer\" (set by spec.overrides[0].clusterOverrides[0])",
    );
}

#[test]
fn catalog_path_outside_what_overrides_may_write() {
    assert_catalog(
        "status",
        "{path: /status/ready, value: true}",
        "error: FederatedMyApp shop/web, cluster b: spec.overrides[0].clusterOverrides[0] \
         (replace /status/ready): path must be within /spec, /metadata/labels, /metadata/annotations",
    );
}

#[test]
fn catalog_unknown_op_is_refused_before_rendering() {
    let (stderr, stdout) =
        render_with_override("unknown-op", "{path: /spec/replicas, op: move, value: 1}");
    assert!(
        stderr.starts_with("error: ")
            && stderr.contains(
                "is not a FederatedMyApp: spec.overrides[0].clusterOverrides[0].op: unknown variant \
                 `move`, expected one of `add`, `remove`, `replace`"
            ),
        "{stderr}"
    );
    assert_eq!(stdout, serde_json::Value::Null, "nothing rendered");
}

/// The preview refuses what the hub refuses (README, "Tenancy"): a FederatedMyApp in a
/// system namespace, in Flotilla's own, or in one given with `--forbidden-namespace`.
#[test]
fn forbidden_namespaces_are_refused_as_the_hub_refuses_them() {
    let out = hub(
        &["render", "-f", SEED, "--forbidden-namespace", "default"],
        None,
    );
    assert!(!out.status.success());
    assert_eq!(
        text(&out.stderr),
        "error: FederatedMyApp default/my-app-sample: namespace default is forbidden: it is listed in --forbidden-namespace\n"
    );
    assert!(out.stdout.is_empty());
    let seed = std::fs::read_to_string(SEED).unwrap();
    for (namespace, rule) in [
        (
            "kube-system",
            "Kubernetes system namespaces are never placed into",
        ),
        (
            "flotilla-system",
            "Flotilla's own namespace holds its credentials and is never placed into",
        ),
    ] {
        let app = seed.replace("namespace: default", &format!("namespace: {namespace}"));
        assert_ne!(app, seed);
        let out = hub(&["render", "-f", "-"], Some(&app));
        assert!(!out.status.success());
        let want = format!(
            "error: FederatedMyApp {namespace}/my-app-sample: namespace {namespace} is forbidden: {rule}\n"
        );
        assert_eq!(text(&out.stderr), want);
    }
    // Flotilla's own namespace is whatever it runs in.
    let app = seed.replace("namespace: default", "namespace: flotilla-system");
    let out = hub(
        &["render", "-f", "-", "--flotilla-namespace", "ops"],
        Some(&app),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
}
