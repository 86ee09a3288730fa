//! `flotilla-e2e test`: the project's one test command. Unit tests, then the e2e suite
//! against an environment that it brings up if none is running and tears down again
//! (even when something failed or it was interrupted).

use anyhow::{Result, anyhow};
use flotilla_lab::env::{DIR_VAR, Provider};
use flotilla_lab::support::workspace_root;
use rustix::process::{Pid, Signal, kill_process_group, test_kill_process_group};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// Test counts, summed over every `cargo test` run, from its `test result:` lines.
#[derive(Default, Debug, PartialEq, Eq)]
pub struct Tally {
    pub passed: u64,
    pub failed: u64,
}

impl Tally {
    /// Adds the counts of a libtest summary line (`test result: ok. 4 passed; 0 failed; ...`).
    pub fn add_line(&mut self, line: &str) {
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            return;
        };
        for part in rest.split([';', '.']) {
            let mut words = part.split_whitespace();
            if let (Some(n), Some(what)) = (words.next(), words.next()) {
                match (n.parse::<u64>(), what) {
                    (Ok(n), "passed") => self.passed += n,
                    (Ok(n), "failed") => self.failed += n,
                    _ => {}
                }
            }
        }
    }
}

/// Runs everything; returns whether all of it passed.
/// With `real_nodes`, the environment has real nodes and the hub and agents run as Pods;
/// the e2e step then runs the suites that hold in that mode (`propagation`, `realnodes`).
/// With the kind provider it runs the suites that hold there ([`e2e_args`]).
pub async fn run(dir: &Path, members: usize, provider: Provider, real_nodes: bool) -> Result<bool> {
    let mut steps: Vec<(String, bool)> = Vec::new();
    let mut tally = Tally::default();
    let mut interrupted = false;

    let unit = cargo(
        &[
            "test",
            "--no-fail-fast",
            "--workspace",
            "--exclude",
            "flotilla-e2e",
        ],
        dir,
        &mut tally,
    )
    .await;
    interrupted |= unit.is_err();
    steps.push((
        "unit tests: cargo test --no-fail-fast --workspace --exclude flotilla-e2e".to_string(),
        matches!(unit, Ok(true)),
    ));

    let mut brought_up = false;
    let mut env_ok = false;
    if !interrupted {
        let same_mode = flotilla_lab::Env::load_state(dir)
            .ok()
            .flatten()
            .is_some_and(|e| e.real_nodes == real_nodes);
        if same_mode && flotilla_lab::status::is_up(dir).await {
            eprintln!(
                "flotilla-e2e test: using the running environment in {}",
                dir.display()
            );
            env_ok = true;
        } else {
            brought_up = true;
            let up = tokio::select! {
                r = flotilla_lab::up_with(dir, members, provider, real_nodes) => r.map(|_| ()),
                s = signalled() => { interrupted = true; Err(anyhow!("interrupted by {s}")) }
            };
            if let Err(e) = &up {
                eprintln!("flotilla-e2e test: bringing the environment up failed: {e:#}");
            }
            env_ok = up.is_ok();
            steps.push(("environment up".to_string(), env_ok));
        }
    }
    if !interrupted && env_ok {
        let args = e2e_args(provider, real_nodes, members);
        if provider == Provider::Kind && !real_nodes && members < crate::THREE_MEMBERS.len() {
            eprintln!(
                "flotilla-e2e test: the scheduling suite needs three members; with {members} it is left out (`--members 3` runs it)"
            );
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let e2e = cargo(&args, dir, &mut tally).await;
        interrupted |= e2e.is_err();
        let what = format!("e2e suite: cargo {}", args.join(" "));
        steps.push((what, matches!(e2e, Ok(true))));
    }
    if brought_up {
        let down = flotilla_lab::down(dir).await;
        if let Err(e) = &down {
            eprintln!("flotilla-e2e test: tearing the environment down failed: {e:#}");
        }
        steps.push(("environment down".to_string(), down.is_ok()));
    }

    println!("flotilla-e2e test: summary");
    for (what, ok) in &steps {
        println!("  {} {what}", if *ok { "ok    " } else { "FAILED" });
    }
    if interrupted {
        println!("  FAILED interrupted");
    }
    // The plain closing line: every test that ran, unit and e2e.
    println!("tests: {} passed, {} failed", tally.passed, tally.failed);
    Ok(!interrupted && steps.iter().all(|(_, ok)| *ok))
}

/// The suites that run in each mode (and `--show-output`: the suite's figures, one line
/// per fault, the failover's lowest ready count, the wire's timings, reach the log of a
/// green run too).
/// - Local provider: all of them.
/// - Real-node mode: those that neither start nor kill local hub and agent processes
///   (`propagation`, `realnodes`); on kind (the hub and agents as Pods on the kind nodes)
///   also `helm`, which installs the chart into kind clusters of its own.
/// - kind: those that do not stop or restart the local provider's control-plane
///   processes (kwokctl's, by PID) nor expect its layout: `propagation`, `operator`,
///   `install`, and `scheduling` when there are three members (its suite needs them).
pub fn e2e_args(provider: Provider, real_nodes: bool, members: usize) -> Vec<String> {
    let mut args: Vec<&str> = vec!["test", "--no-fail-fast", "-p", "flotilla-e2e"];
    if real_nodes {
        args.extend(["--test", "propagation", "--test", "realnodes"]);
        if provider == Provider::Kind {
            args.extend(["--test", "helm"]);
        }
    } else if provider == Provider::Kind {
        args.extend([
            "--test",
            "propagation",
            "--test",
            "operator",
            "--test",
            "install",
        ]);
        if members >= crate::THREE_MEMBERS.len() {
            args.extend(["--test", "scheduling"]);
        }
    }
    args.extend(["--", "--show-output"]);
    if real_nodes {
        args.push("--include-ignored");
    }
    args.into_iter().map(String::from).collect()
}

/// How long one `cargo test` may run (`FLOTILLA_TEST_TIMEOUT_SECS`, default 45 minutes):
/// a hung test must not keep the environment from being torn down before CI gives up.
fn time_limit() -> Duration {
    let secs = std::env::var("FLOTILLA_TEST_TIMEOUT_SECS")
        .ok()
        .and_then(|s| s.parse().ok());
    Duration::from_secs(secs.unwrap_or(45 * 60))
}

/// Runs cargo in the workspace root with `FLOTILLA_E2E_DIR` set, echoing its output and
/// counting its tests. `Ok(passed)`; `Err` if a signal interrupted it. On a signal or the
/// time limit, its whole process group (cargo and the test binaries it runs) is stopped.
async fn cargo(args: &[&str], dir: &Path, tally: &mut Tally) -> Result<bool> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    eprintln!("flotilla-e2e test: {cargo} {}", args.join(" "));
    let mut command = Command::new(&cargo);
    for name in flotilla_lab::support::crate_vars() {
        command.env_remove(name);
    }
    let mut child = command
        .args(args)
        .current_dir(workspace_root())
        .env(DIR_VAR, dir)
        .stdout(Stdio::piped())
        // Its own group, so that the test binaries (cargo's children) can be stopped with it.
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| anyhow!("starting {cargo}: {e}"))?;
    let group = child.id();
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow!("no stdout from {cargo}"))?;
    let run = async {
        let mut lines = BufReader::new(stdout).lines();
        while let Some(line) = lines.next_line().await? {
            println!("{line}");
            tally.add_line(&line);
        }
        child.wait().await
    };
    let limit = time_limit();
    tokio::select! {
        status = tokio::time::timeout(limit, run) => match status {
            Ok(status) => Ok(status.is_ok_and(|s| s.success())),
            Err(_) => {
                eprintln!("flotilla-e2e test: `cargo {}` ran over {limit:?}; stopping it", args.join(" "));
                stop_group(group).await;
                Ok(false)
            }
        },
        s = signalled() => {
            stop_group(group).await;
            Err(anyhow!("interrupted by {s}"))
        }
    }
}

/// SIGTERM to a process group, SIGKILL five seconds later if it still has members.
async fn stop_group(group: Option<u32>) {
    let Some(pgid) = group
        .and_then(|g| i32::try_from(g).ok())
        .and_then(Pid::from_raw)
    else {
        return;
    };
    if kill_process_group(pgid, Signal::TERM).is_err() {
        return;
    }
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Signal 0 only asks whether the group still has a member.
        if test_kill_process_group(pgid).is_err() {
            return;
        }
    }
    let _ = kill_process_group(pgid, Signal::KILL);
}

/// Resolves on SIGINT or SIGTERM (CI stops a run with the latter).
async fn signalled() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tally_reads_libtest_summaries() {
        let mut t = Tally::default();
        t.add_line("test result: ok. 4 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.47s");
        t.add_line(
            "test result: FAILED. 5 passed; 2 failed; 1 ignored; 0 measured; 0 filtered out",
        );
        t.add_line("running 4 tests");
        t.add_line("test foo ... ok");
        assert_eq!(
            t,
            Tally {
                passed: 9,
                failed: 2
            }
        );
    }

    #[test]
    fn each_mode_runs_its_suites() {
        let all = [
            "test",
            "--no-fail-fast",
            "-p",
            "flotilla-e2e",
            "--",
            "--show-output",
        ];
        assert_eq!(e2e_args(Provider::Local, false, 3), all);
        assert_eq!(e2e_args(Provider::Local, false, 2), all);
        assert_eq!(
            e2e_args(Provider::Local, true, 2),
            [
                "test",
                "--no-fail-fast",
                "-p",
                "flotilla-e2e",
                "--test",
                "propagation",
                "--test",
                "realnodes",
                "--",
                "--show-output",
                "--include-ignored"
            ]
        );
        let kind = [
            "test",
            "--no-fail-fast",
            "-p",
            "flotilla-e2e",
            "--test",
            "propagation",
            "--test",
            "operator",
            "--test",
            "install",
        ];
        let with = |extra: &[&str]| {
            let mut v: Vec<String> = kind.iter().map(|s| s.to_string()).collect();
            v.extend(extra.iter().map(|s| s.to_string()));
            v
        };
        assert_eq!(
            e2e_args(Provider::Kind, false, 3),
            with(&["--test", "scheduling", "--", "--show-output"])
        );
        assert_eq!(
            e2e_args(Provider::Kind, false, 2),
            with(&["--", "--show-output"])
        );
        // kind with the hub and agents as Pods: real-node mode's suites and the chart's.
        assert_eq!(
            e2e_args(Provider::Kind, true, 2),
            [
                "test",
                "--no-fail-fast",
                "-p",
                "flotilla-e2e",
                "--test",
                "propagation",
                "--test",
                "realnodes",
                "--test",
                "helm",
                "--",
                "--show-output",
                "--include-ignored"
            ]
        );
    }
}
