//! deploy/hub's ValidatingAdmissionPolicies on the real host apiserver (docs/security.md,
//! "Admission policies"): applied from the kustomization, then every request made as the
//! identity it concerns (impersonated with kubectl's `--as`, or, for the hub's own Pod,
//! with a token bound to that Pod as its projected token is) and every denial checked by
//! its message, so that a missing policy fails here (RBAC alone allows each of them).
//!
//! - a user with only `patch memberclusters`: changing the token, or writing the
//!   collection confirmation, is denied; cordoning is allowed;
//! - the hub's ServiceAccount: removing the confirmation and replacing the token (as its
//!   renewal does) are allowed, writing a confirmation is denied;
//! - a user bound to flotilla-fleet-admin: both allowed, and `flotilla-hub join`,
//!   `join --rotate`, `cordon`, `uncordon`, `revoke` and `unjoin` run as that user (the
//!   commands the role is documented for); `join --rotate` as the patcher is refused;
//! - the hub's ServiceAccount on Pods: the `flotilla.io/leader` label on its own Pod is
//!   allowed; another label, the image, another hub Pod's label or a non-hub Pod's label
//!   is denied.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use flotilla_lab::Env;
use flotilla_lab::hubcli::HubCli;
use serde_json::json;

const NS: &str = "flotilla-system";
const HUB: &str = "system:serviceaccount:flotilla-system:flotilla-hub";
const MEMBER: &str = "admission-e2e";
const PATCHER: &str = "admission-e2e-patcher";
const ADMIN: &str = "admission-e2e-admin";
const HUB_POD: &str = "admission-e2e-hub";
const OTHER_HUB_POD: &str = "admission-e2e-hub-2";
const OTHER_POD: &str = "admission-e2e-other";
/// The MemberCluster the fleet admin joins and unjoins with `flotilla-hub`.
const JOINED: &str = "admission-e2e-joined";

/// `kubectl ARGS` against `kubeconfig`, fed `stdin`: its stdout, or its stderr as the error.
fn kubectl(kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> Result<String> {
    flotilla_e2e::run_against(
        Path::new("kubectl"),
        args,
        kubeconfig,
        stdin.map(str::as_bytes),
    )
}

/// One request and what must come of it.
struct Case<'a> {
    what: &'a str,
    args: Vec<String>,
    /// None: allowed; Some(text): denied, with `text` in the message.
    denied: Option<&'a str>,
}

impl Case<'_> {
    fn check(&self, kubeconfig: &Path) -> Result<()> {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        match (kubectl(kubeconfig, &args, None), self.denied) {
            (Ok(_), None) => println!("admission: allowed, as it should be: {}", self.what),
            (Err(e), Some(text)) => {
                let e = e.to_string();
                ensure!(
                    e.contains("ValidatingAdmissionPolicy") && e.contains(text),
                    "{}: denied, but not by the policy with {text:?}: {e}",
                    self.what
                );
                println!("admission: denied, as it should be: {}", self.what);
            }
            (Ok(out), Some(text)) => bail!(
                "{}: allowed ({}), but the policy should deny it with {text:?}",
                self.what,
                out.trim()
            ),
            (Err(e), None) => bail!("{}: denied, but should be allowed: {e}", self.what),
        }
        Ok(())
    }
}

fn case<'a>(what: &'a str, args: &[&str], denied: Option<&'a str>) -> Case<'a> {
    Case {
        what,
        args: args.iter().map(|a| (*a).to_owned()).collect(),
        denied,
    }
}

/// deploy/hub's identity and policy objects (not its Deployment: nothing runs here), as
/// the kustomization builds them.
fn apply_hub_policies(host: &Path) -> Result<()> {
    let built = kubectl(host, &["kustomize", "deploy/hub"], None)?;
    let picked = flotilla_e2e::of_kinds(
        &built,
        &[
            "Namespace",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ],
    )?;
    for kind in ["ValidatingAdmissionPolicy", "flotilla-fleet-admin"] {
        ensure!(
            picked.contains(kind),
            "deploy/hub's kustomization has no {kind}"
        );
    }
    kubectl(host, &["apply", "-f", "-"], Some(&picked)).context("applying deploy/hub")?;
    Ok(())
}

/// What the test creates (besides the fleet admin's binding): a user with `patch
/// memberclusters` alone, a MemberCluster no agent holds, and three
/// Pods in the hub's namespace (two of the hub's, one not).
fn fixtures() -> String {
    let pod = |name: &str, labels: serde_json::Value, account: &str| {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"serviceAccountName": account,
                     "containers": [{"name": "main", "image": "flotilla-hub:0.1.0"}]},
        })
    };
    let hub_labels = json!({"app.kubernetes.io/name": "flotilla-hub"});
    let objects = [
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": PATCHER},
            "rules": [{"apiGroups": ["core.kubefed.io"], "resources": ["memberclusters"],
                       "verbs": ["get", "patch"]}],
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": PATCHER},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": PATCHER},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": PATCHER}],
        }),
        json!({
            "apiVersion": "core.kubefed.io/v1beta1", "kind": "MemberCluster",
            "metadata": {"name": MEMBER},
            "spec": {"tokenSha256": "0".repeat(64)},
        }),
        pod(HUB_POD, hub_labels.clone(), "flotilla-hub"),
        pod(OTHER_HUB_POD, hub_labels, "flotilla-hub"),
        pod(OTHER_POD, json!({"app": "admission-e2e"}), "default"),
    ];
    objects
        .iter()
        .map(|o| format!("---\n{}", serde_yaml::to_string(o).expect("YAML")))
        .collect()
}

/// A kubeconfig for the host that impersonates `user` (kubeconfig's `as`), for programs
/// without kubectl's `--as`.
fn impersonating(host: &Path, user: &str, out: &Path) -> Result<()> {
    let mut kubeconfig: serde_json::Value = serde_yaml::from_str(&std::fs::read_to_string(host)?)?;
    for entry in kubeconfig["users"].as_array_mut().context("users")? {
        entry["user"]["as"] = json!(user);
    }
    std::fs::write(out, serde_yaml::to_string(&kubeconfig)?)?;
    Ok(())
}

/// A kubeconfig for the host whose user is `token` alone.
fn token_kubeconfig(host: &Path, token: &str, out: &Path) -> Result<()> {
    let mut kubeconfig: serde_json::Value = serde_yaml::from_str(&std::fs::read_to_string(host)?)?;
    for user in kubeconfig["users"].as_array_mut().context("users")? {
        user["user"] = json!({"token": token.trim()});
    }
    std::fs::write(out, serde_yaml::to_string(&kubeconfig)?)?;
    Ok(())
}

#[tokio::test]
async fn admission_policies_confine_credentials_confirmations_and_the_hubs_pod_patches()
-> Result<()> {
    let env = Env::load_ready().await?;
    let host = env.kubeconfig(env.host())?.to_path_buf();
    apply_hub_policies(&host)?;
    let fixtures = fixtures();
    kubectl(&host, &["apply", "-f", "-"], Some(&fixtures))?;
    let dir = env.dir.join("admission-e2e");
    std::fs::create_dir_all(&dir)?;
    let result = async {
        // As docs/security.md tells an administrator to bind it.
        kubectl(
            &host,
            &[
                "create",
                "clusterrolebinding",
                ADMIN,
                "--clusterrole=flotilla-fleet-admin",
                &format!("--user={ADMIN}"),
            ],
            None,
        )?;
        checks(&host, &dir).await?;
        fleet_admin_runs_the_cli(&host, &dir)
    }
    .await;
    let removed = kubectl(
        &host,
        &["delete", "--ignore-not-found", "--wait=false", "-f", "-"],
        Some(&fixtures),
    )
    .and_then(|_| {
        kubectl(
            &host,
            &["delete", "clusterrolebinding", ADMIN, "--ignore-not-found"],
            None,
        )
    })
    .and_then(|_| {
        kubectl(
            &host,
            &["delete", "membercluster", JOINED, "--ignore-not-found"],
            None,
        )
    });
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    removed.context("removing what the test created")?;
    Ok(())
}

async fn checks(host: &Path, dir: &Path) -> Result<()> {
    let patch_member = |who: &str, kind: &str, patch: serde_json::Value| -> Vec<String> {
        [
            "patch",
            "membercluster",
            MEMBER,
            &format!("--as={who}"),
            &format!("--type={kind}"),
            "-p",
            &patch.to_string(),
        ]
        .iter()
        .map(|a| (*a).to_owned())
        .collect()
    };
    let confirm = json!({"metadata": {"annotations": {"flotilla.io/confirm-collection": "3"}}});
    let token = |hash: char| json!({"spec": {"tokenSha256": hash.to_string().repeat(64)}});
    let token_denied =
        Some("MemberCluster admission-e2e: changing spec.tokenSha256 needs the verb rotate-token");
    let confirm_denied = Some(
        "MemberCluster admission-e2e: writing the annotation flotilla.io/confirm-collection needs the verb confirm-collection",
    );

    // A new policy takes effect once the apiserver's informer has it: wait for the first
    // denial before counting on any.
    let first = Case {
        what: "patch memberclusters alone: changing spec.tokenSha256",
        args: patch_member(PATCHER, "merge", token('1')),
        denied: token_denied,
    };
    flotilla_lab::wait_for(Duration::from_secs(30), "the policies in force", || async {
        Ok(first.check(host).is_ok().then_some(()))
    })
    .await?;

    // (a) `patch memberclusters` and nothing more.
    let annotation = "/metadata/annotations/flotilla.io~1confirm-collection";
    for c in [
        Case {
            what: "patch memberclusters alone: creating spec.nextTokenSha256",
            args: patch_member(
                PATCHER,
                "merge",
                json!({"spec": {"nextTokenSha256": "2".repeat(64)}}),
            ),
            denied: Some("changing spec.nextTokenSha256 needs the verb rotate-token"),
        },
        Case {
            what: "patch memberclusters alone: clearing spec.tokenSha256",
            args: patch_member(PATCHER, "merge", json!({"spec": {"tokenSha256": null}})),
            denied: token_denied,
        },
        Case {
            what: "patch memberclusters alone: writing flotilla.io/confirm-collection",
            args: patch_member(PATCHER, "merge", confirm.clone()),
            denied: confirm_denied,
        },
        Case {
            what: "patch memberclusters alone: cordoning (spec.unschedulable)",
            args: patch_member(PATCHER, "merge", json!({"spec": {"unschedulable": true}})),
            denied: None,
        },
        Case {
            what: "patch memberclusters alone: a label",
            args: patch_member(
                PATCHER,
                "merge",
                json!({"metadata": {"labels": {"region": "eu"}}}),
            ),
            denied: None,
        },
    ] {
        c.check(host)?;
    }

    // (b) The hub's ServiceAccount: it consumes confirmations (a JSON patch that tests the
    // value, as membership.rs does) and renews tokens (renew.rs: test, then replace).
    kubectl(
        host,
        &[
            "annotate",
            "membercluster",
            MEMBER,
            "flotilla.io/confirm-collection=3",
        ],
        None,
    )?;
    for c in [
        Case {
            what: "the hub: removing flotilla.io/confirm-collection",
            args: patch_member(
                HUB,
                "json",
                json!([{"op": "test", "path": annotation, "value": "3"},
                       {"op": "remove", "path": annotation}]),
            ),
            denied: None,
        },
        Case {
            what: "the hub: writing flotilla.io/confirm-collection",
            args: patch_member(HUB, "merge", confirm.clone()),
            denied: Some(
                "confirm-collection on memberclusters.core.kubefed.io, which system:serviceaccount:flotilla-system:flotilla-hub lacks",
            ),
        },
        Case {
            what: "the hub: replacing spec.tokenSha256 and adding spec.tokenExpiresAt",
            args: patch_member(
                HUB,
                "json",
                json!([{"op": "test", "path": "/spec/tokenSha256", "value": "0".repeat(64)},
                       {"op": "replace", "path": "/spec/tokenSha256", "value": "3".repeat(64)},
                       {"op": "add", "path": "/spec/tokenExpiresAt", "value": "2030-01-01T00:00:00Z"}]),
            ),
            denied: None,
        },
        // (c) flotilla-fleet-admin: both.
        Case {
            what: "flotilla-fleet-admin: changing spec.tokenSha256",
            args: patch_member(ADMIN, "merge", token('4')),
            denied: None,
        },
        Case {
            what: "flotilla-fleet-admin: writing flotilla.io/confirm-collection",
            args: patch_member(ADMIN, "merge", confirm.clone()),
            denied: None,
        },
    ] {
        c.check(host)?;
    }
    let now = kubectl(host, &["get", "membercluster", MEMBER, "-o", "json"], None)?;
    let now: serde_json::Value = serde_json::from_str(&now)?;
    ensure!(
        now["spec"]["tokenSha256"] == json!("4".repeat(64))
            && now["metadata"]["annotations"]["flotilla.io/confirm-collection"] == json!("3"),
        "MemberCluster {MEMBER} does not hold what the allowed writes wrote: {now}"
    );

    // (d) The hub's ServiceAccount on Pods, with a token bound to its Pod (what a hub Pod's
    // projected token is).
    let token = kubectl(
        host,
        &[
            "create",
            "token",
            "flotilla-hub",
            "-n",
            NS,
            "--bound-object-kind=Pod",
            &format!("--bound-object-name={HUB_POD}"),
            "--duration=10m",
        ],
        None,
    )?;
    let pod_kubeconfig: PathBuf = dir.join("hub-pod.kubeconfig");
    token_kubeconfig(host, &token, &pod_kubeconfig)?;
    let only_leader = Some("may change only the label flotilla.io/leader");
    let own_pod = Some("may only label its own Pod");
    let as_pod = |args: &[&str]| -> Vec<String> {
        [
            &[
                "-n",
                NS,
                &format!("--kubeconfig={}", pod_kubeconfig.display()),
            ],
            args,
        ]
        .concat()
        .iter()
        .map(|a| (*a).to_owned())
        .collect()
    };
    for c in [
        Case {
            what: "the hub's Pod: flotilla.io/leader=true on itself",
            args: as_pod(&["label", "pod", HUB_POD, "flotilla.io/leader=true"]),
            denied: None,
        },
        Case {
            what: "the hub's Pod: flotilla.io/leader removed from itself",
            args: as_pod(&["label", "pod", HUB_POD, "flotilla.io/leader-"]),
            denied: None,
        },
        Case {
            what: "the hub's Pod: another label on itself",
            args: as_pod(&["label", "pod", HUB_POD, "extra=1"]),
            denied: only_leader,
        },
        Case {
            what: "the hub's Pod: flotilla.io/leader=false on itself",
            args: as_pod(&["label", "pod", HUB_POD, "flotilla.io/leader=false"]),
            denied: only_leader,
        },
        Case {
            what: "the hub's Pod: an annotation on itself",
            args: as_pod(&["annotate", "pod", HUB_POD, "extra=1"]),
            denied: only_leader,
        },
        Case {
            what: "the hub's Pod: its own image",
            args: as_pod(&[
                "patch",
                "pod",
                HUB_POD,
                "--type=json",
                "-p",
                r#"[{"op":"replace","path":"/spec/containers/0/image","value":"elsewhere:1"}]"#,
            ]),
            denied: only_leader,
        },
        Case {
            what: "the hub's Pod: flotilla.io/leader on another hub Pod",
            args: as_pod(&["label", "pod", OTHER_HUB_POD, "flotilla.io/leader=true"]),
            denied: own_pod,
        },
        Case {
            what: "the hub's Pod: flotilla.io/leader on a Pod that is not the hub's",
            args: as_pod(&["label", "pod", OTHER_POD, "flotilla.io/leader=true"]),
            denied: own_pod,
        },
    ] {
        c.check(host)?;
    }
    // Not from a Pod (no pod-name in the token): nothing to label.
    case(
        "the hub's ServiceAccount without its Pod's token: flotilla.io/leader",
        &[
            "-n",
            NS,
            &format!("--as={HUB}"),
            "label",
            "pod",
            HUB_POD,
            "flotilla.io/leader=true",
        ],
        own_pod,
    )
    .check(host)?;
    // Anyone else's Pod writes are RBAC's business: the policy matches the hub only.
    case(
        "the host's admin: a label on a hub Pod",
        &["-n", NS, "label", "pod", HUB_POD, "extra=1"],
        None,
    )
    .check(host)?;
    Ok(())
}

/// The commands flotilla-fleet-admin is documented for, run as a user bound to it alone;
/// the one that writes a token, run as the patcher, refused by the policy.
fn fleet_admin_runs_the_cli(host: &Path, dir: &Path) -> Result<()> {
    // The CLI the host admin would run: in either mode of the lab (Pod mode has no
    // launch record of the hub).
    let program = flotilla_e2e::hub_binary().to_path_buf();
    let as_user = |user: &str| -> Result<HubCli> {
        let kubeconfig = dir.join(format!("{user}.kubeconfig"));
        impersonating(host, user, &kubeconfig)?;
        Ok(HubCli {
            program: program.clone(),
            kubeconfig,
        })
    };
    let (admin, patcher) = (as_user(ADMIN)?, as_user(PATCHER)?);
    let token_file = dir.join("joined.token");
    let token = token_file.to_string_lossy();
    admin.run(&["join", JOINED, "--token-file", &token])?;
    let refused = patcher
        .run(&["join", JOINED, "--rotate", "--token-file", &token])
        .err()
        .context("`join --rotate` as a user with patch memberclusters alone was allowed")?
        .to_string();
    ensure!(
        refused.contains("changing spec.tokenSha256")
            && refused.contains("needs the verb rotate-token"),
        "`join --rotate` as the patcher: refused, but not by the policy: {refused}"
    );
    for args in [
        &["join", JOINED, "--rotate", "--token-file", &token][..],
        &["cordon", JOINED],
        &["uncordon", JOINED],
        &["revoke", JOINED],
        &["unjoin", JOINED],
    ] {
        admin.run(args).with_context(|| {
            format!("as a flotilla-fleet-admin: flotilla-hub {}", args.join(" "))
        })?;
        println!(
            "admission: flotilla-hub {} as a flotilla-fleet-admin",
            args.join(" ")
        );
    }
    let gone = kubectl(
        host,
        &[
            "get",
            "membercluster",
            JOINED,
            "--ignore-not-found",
            "-o",
            "name",
        ],
        None,
    )?;
    ensure!(gone.trim().is_empty(), "unjoin left {gone}");
    Ok(())
}
