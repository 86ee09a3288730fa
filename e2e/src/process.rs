//! Processes recorded by PID and stopped by PID.
//!
//! A record carries the process's start time (from `/proc/<pid>/stat`) next to its PID,
//! so that a PID reused by an unrelated process after a reboot or a crash is never
//! signalled.

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ProcessRecord {
    pub name: String,
    pub pid: u32,
    /// Start time in clock ticks since boot (field 22 of `/proc/<pid>/stat`); `None` if
    /// it could not be read, and then only [`ProcessRecord::alive`]'s PID check applies.
    pub start_time: Option<u64>,
    /// Where its output goes, if known.
    pub log: Option<PathBuf>,
}

impl ProcessRecord {
    /// A record for a running process that someone else started (e.g. kwokctl).
    pub fn observe(name: &str, pid: u32, log: Option<PathBuf>) -> ProcessRecord {
        ProcessRecord {
            name: name.to_string(),
            pid,
            start_time: start_time(pid),
            log,
        }
    }

    /// Whether this very process still runs (a zombie counts as gone).
    pub fn alive(&self) -> bool {
        match stat(self.pid) {
            Some((state, started)) => {
                state != 'Z' && (self.start_time.is_none() || self.start_time == Some(started))
            }
            None => false,
        }
    }

    /// Resident set size in bytes, if the process runs.
    pub fn rss_bytes(&self) -> Option<u64> {
        if !self.alive() {
            return None;
        }
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }

    /// SIGTERM, then SIGKILL after `grace`; returns once the process is gone.
    pub fn stop(&self, grace: Duration) -> Result<()> {
        stop_many(std::slice::from_ref(self), grace)
    }
}

/// Stops several processes at once: SIGTERM to all, SIGKILL to those still running after
/// `grace`; fails naming any that survive.
pub fn stop_many(procs: &[ProcessRecord], grace: Duration) -> Result<()> {
    let signal_all = |sig: Signal| {
        for p in procs.iter().filter(|p| p.alive()) {
            if let Ok(pid) = i32::try_from(p.pid) {
                // It may exit between the check and the signal: ESRCH is fine.
                let _ = kill(Pid::from_raw(pid), sig);
            }
        }
    };
    signal_all(Signal::SIGTERM);
    if wait_gone(procs, grace) {
        return Ok(());
    }
    signal_all(Signal::SIGKILL);
    if wait_gone(procs, Duration::from_secs(10)) {
        return Ok(());
    }
    let left: Vec<String> = procs
        .iter()
        .filter(|p| p.alive())
        .map(|p| format!("{} (PID {})", p.name, p.pid))
        .collect();
    bail!("still running after SIGKILL: {}", left.join(", "))
}

fn wait_gone(procs: &[ProcessRecord], within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if procs.iter().all(|p| !p.alive()) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// (state, start time) of a PID, from `/proc/<pid>/stat`.
fn stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: parse after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Fields after ')' start at field 3 (state); start time is field 22.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

fn start_time(pid: u32) -> Option<u64> {
    stat(pid).map(|(_, t)| t)
}

fn procs_dir(dir: &Path) -> PathBuf {
    dir.join("procs")
}

/// Starts `cmd` detached (own process group, so a Ctrl-C in the terminal does not reach
/// it), output appended to `<dir>/logs/<name>.log`, and records it in `<dir>/procs/<name>.json`.
pub fn spawn(dir: &Path, name: &str, cmd: &mut Command) -> Result<ProcessRecord> {
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    std::fs::create_dir_all(procs_dir(dir))?;
    if let Some(old) = load(dir, name)?
        && old.alive()
    {
        bail!("process {name} is already running (PID {})", old.pid);
    }
    let log_path = logs.join(format!("{name}.log"));
    let log = File::options()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {name}: {cmd:?}"))?;
    let record = ProcessRecord::observe(name, child.id(), Some(log_path));
    let path = procs_dir(dir).join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(&record)?)
        .with_context(|| format!("writing {}", path.display()))?;
    // Dropping a std Child neither waits for nor kills it: the process outlives this one.
    drop(child);
    Ok(record)
}

fn load(dir: &Path, name: &str) -> Result<Option<ProcessRecord>> {
    let path = procs_dir(dir).join(format!("{name}.json"));
    match std::fs::read(&path) {
        Ok(b) => Ok(Some(
            serde_json::from_slice(&b).with_context(|| format!("parsing {}", path.display()))?,
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Every process recorded under `<dir>/procs/`.
pub fn records(dir: &Path) -> Result<Vec<ProcessRecord>> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(procs_dir(dir)) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e).context("listing recorded processes"),
    };
    for entry in entries {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "json") {
            let name = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_default()
                .to_string();
            if let Some(r) = load(dir, &name)? {
                out.push(r);
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Stops (by PID) and forgets every process recorded under `<dir>/procs/`.
pub fn stop_all(dir: &Path) -> Result<()> {
    let all = records(dir)?;
    stop_many(&all, Duration::from_secs(10))?;
    for r in all {
        std::fs::remove_file(procs_dir(dir).join(format!("{}.json", r.name)))?;
    }
    Ok(())
}

/// Running processes whose command line mentions `marker` (a path only this environment
/// uses): how `down` proves that nothing it started is left.
pub fn mentioning(marker: &Path) -> Vec<ProcessRecord> {
    let needle = marker.to_string_lossy().into_owned();
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter_map(|pid| {
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
            let name = cmdline.split_whitespace().next()?.to_string();
            let p = ProcessRecord::observe(&name, pid, None);
            (cmdline.contains(&needle) && p.alive()).then_some(p)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spawn_records_and_stop_ends_the_process() {
        let dir = std::env::temp_dir().join(format!("flotilla-e2e-proc-{}", std::process::id()));
        let r = spawn(&dir, "sleeper", Command::new("sleep").arg("300")).unwrap();
        assert!(r.alive());
        assert!(r.rss_bytes().is_some());
        assert_eq!(records(&dir).unwrap(), vec![r.clone()]);
        assert!(
            spawn(&dir, "sleeper", Command::new("sleep").arg("300")).is_err(),
            "no second copy"
        );
        stop_all(&dir).unwrap();
        assert!(!r.alive());
        assert!(records(&dir).unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_reused_pid_is_not_ours() {
        let me = ProcessRecord::observe("me", std::process::id(), None);
        assert!(me.alive());
        let other = ProcessRecord {
            start_time: me.start_time.map(|t| t + 1),
            ..me
        };
        assert!(!other.alive());
    }
}
