//! `flotilla-e2e test`: the project's one test command. Unit tests, then the e2e suite
//! against an environment that it brings up if none is running and tears down again
//! (even when something failed or it was interrupted).

use crate::env::{DIR_VAR, Provider, workspace_root};
use anyhow::{Result, anyhow};
use std::path::Path;
use std::process::ExitStatus;
use tokio::process::Command;

/// Runs everything; returns whether all of it passed.
pub async fn run(dir: &Path, members: usize, provider: Provider) -> Result<bool> {
    let mut results: Vec<(&str, bool)> = Vec::new();
    let mut interrupted = false;

    let unit = cargo(&["test", "--workspace", "--exclude", "flotilla-e2e"], dir).await;
    interrupted |= unit.is_err();
    results.push((
        "unit tests (cargo test --workspace --exclude flotilla-e2e)",
        matches!(unit, Ok(true)),
    ));

    let mut brought_up = false;
    let mut env_ok = false;
    if !interrupted {
        if crate::status::is_up(dir).await {
            eprintln!(
                "flotilla-e2e test: using the running environment in {}",
                dir.display()
            );
            env_ok = true;
        } else {
            brought_up = true;
            let up = tokio::select! {
                r = crate::up(dir, members, provider) => r.map(|_| ()),
                s = signalled() => Err(anyhow!("interrupted by {s}")),
            };
            if let Err(e) = &up {
                eprintln!("flotilla-e2e test: bringing the environment up failed: {e:#}");
            }
            interrupted |= up
                .as_ref()
                .is_err_and(|e| e.to_string().starts_with("interrupted"));
            env_ok = up.is_ok();
            results.push(("environment up", env_ok));
        }
    }
    if !interrupted && env_ok {
        let e2e = cargo(&["test", "-p", "flotilla-e2e"], dir).await;
        interrupted |= e2e.is_err();
        results.push((
            "e2e suite (cargo test -p flotilla-e2e)",
            matches!(e2e, Ok(true)),
        ));
    }
    if brought_up {
        let down = crate::down(dir).await;
        if let Err(e) = &down {
            eprintln!("flotilla-e2e test: tearing the environment down failed: {e:#}");
        }
        results.push(("environment down", down.is_ok()));
    }

    eprintln!("flotilla-e2e test: summary");
    for (what, ok) in &results {
        eprintln!("  {} {what}", if *ok { "ok    " } else { "FAILED" });
    }
    if interrupted {
        eprintln!("  FAILED interrupted");
    }
    Ok(!interrupted && results.iter().all(|(_, ok)| *ok))
}

/// Runs cargo in the workspace root with `FLOTILLA_E2E_DIR` set. `Ok(passed)`, or `Err` if
/// a signal interrupted it (the child is killed then).
async fn cargo(args: &[&str], dir: &Path) -> Result<bool> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    eprintln!("flotilla-e2e test: {cargo} {}", args.join(" "));
    let mut child = Command::new(&cargo)
        .args(args)
        .current_dir(workspace_root())
        .env(DIR_VAR, dir)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| anyhow!("starting {cargo}: {e}"))?;
    let status: std::io::Result<ExitStatus> = tokio::select! {
        s = child.wait() => s,
        s = signalled() => return Err(anyhow!("interrupted by {s}")),
    };
    Ok(status.map(|s| s.success()).unwrap_or(false))
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
