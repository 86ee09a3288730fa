//! Processes recorded by PID and stopped by PID.
//!
//! A record carries the process's start time (from `/proc/<pid>/stat`) next to its PID,
//! so that a PID reused by an unrelated process after a reboot or a crash is never
//! signalled.

use anyhow::{Context, Result, bail};
use procfs::process::Process;
/// The signals [`ProcessRecord::signal`] sends (`Signal::TERM`, `Signal::KILL`, ...).
pub use rustix::process::Signal;
use rustix::process::{Pid, kill_process};
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
            Some(stat) => {
                (stat.state != 'Z' || threads_exiting(self.pid))
                    && (self.start_time.is_none() || self.start_time == Some(stat.starttime))
            }
            None => false,
        }
    }

    /// Resident set size in bytes, if the process runs.
    pub fn rss_bytes(&self) -> Option<u64> {
        if !self.alive() {
            return None;
        }
        let kb = proc(self.pid)?.status().ok()?.vmrss?;
        Some(kb * 1024)
    }

    /// Sends `signal` and returns at once; a process already gone is no error.
    pub fn signal(&self, signal: Signal) -> Result<()> {
        if !self.alive() {
            return Ok(());
        }
        let pid = i32::try_from(self.pid)
            .ok()
            .and_then(Pid::from_raw)
            .with_context(|| format!("PID {}", self.pid))?;
        match kill_process(pid, signal) {
            Ok(()) | Err(rustix::io::Errno::SRCH) => Ok(()),
            Err(e) => Err(e)
                .with_context(|| format!("sending {signal:?} to {} (PID {})", self.name, self.pid)),
        }
    }

    /// Waits up to `within` for the process to be gone; whether it is.
    pub fn wait_gone(&self, within: Duration) -> bool {
        wait_gone(std::slice::from_ref(self), within)
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
        for p in procs {
            // A failure shows below as a process still running.
            let _ = p.signal(sig);
        }
    };
    signal_all(Signal::TERM);
    if wait_gone(procs, grace) {
        return Ok(());
    }
    signal_all(Signal::KILL);
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

fn proc(pid: u32) -> Option<Process> {
    Process::new(i32::try_from(pid).ok()?).ok()
}

/// `/proc/<pid>/stat`: the state and the start time (clock ticks since boot).
fn stat(pid: u32) -> Option<procfs::process::Stat> {
    proc(pid)?.stat().ok()
}

/// A killed multi-threaded process shows its first thread as a zombie while the others
/// are still exiting, and it holds its sockets until the last one has: a hub SIGKILLed
/// with 1,000 sessions still held its ports when the lab started the next one.
fn threads_exiting(pid: u32) -> bool {
    proc(pid).and_then(|p| p.tasks().ok()).is_some_and(|tasks| {
        tasks
            .flatten()
            .any(|t| t.stat().is_ok_and(|s| !matches!(s.state, 'Z' | 'X')))
    })
}

fn start_time(pid: u32) -> Option<u64> {
    stat(pid).map(|s| s.starttime)
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
    let record = spawn_detached(name, cmd, &logs.join(format!("{name}.log")))?;
    save(dir, &record)?;
    Ok(record)
}

/// Starts `cmd` in its own process group, output appended to `log`, and lets it run on
/// after this process; records nothing.
pub fn spawn_detached(name: &str, cmd: &mut Command, log_path: &Path) -> Result<ProcessRecord> {
    let log = File::options()
        .create(true)
        .append(true)
        .open(log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {name}: {cmd:?}"))?;
    // Dropping a std Child neither waits for nor kills it: the process outlives this one.
    Ok(ProcessRecord::observe(
        name,
        child.id(),
        Some(log_path.to_path_buf()),
    ))
}

fn save(dir: &Path, record: &ProcessRecord) -> Result<()> {
    let path = procs_dir(dir).join(format!("{}.json", record.name));
    std::fs::write(&path, serde_json::to_vec_pretty(record)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// Forgets the record of process `name` (one that is gone: `down` will not look for it).
pub fn forget(dir: &Path, name: &str) -> Result<()> {
    match std::fs::remove_file(procs_dir(dir).join(format!("{name}.json"))) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("forgetting process {name}"))
        }
        _ => Ok(()),
    }
}

/// Records process `name` as `new_name` instead (its log stays where it is), so that a
/// new process can be started as `name` while the old one still runs; `down` stops both.
pub fn rename(dir: &Path, name: &str, new_name: &str) -> Result<ProcessRecord> {
    let mut record = load(dir, name)?.with_context(|| format!("no process {name} recorded"))?;
    record.name = new_name.to_string();
    save(dir, &record)?;
    std::fs::remove_file(procs_dir(dir).join(format!("{name}.json")))?;
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
    let Ok(all) = procfs::process::all_processes() else {
        return Vec::new();
    };
    all.filter_map(Result::ok)
        .filter_map(|p| {
            let pid = u32::try_from(p.pid).ok().filter(|&pid| pid != me)?;
            let cmdline = p.cmdline().ok()?;
            let name = cmdline.first()?.clone();
            let record = ProcessRecord::observe(&name, pid, None);
            (cmdline.iter().any(|arg| arg.contains(&needle)) && record.alive()).then_some(record)
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
    fn mentioning_finds_by_argument_and_sigkill_ends_at_once() {
        let dir = std::env::temp_dir().join(format!("flotilla-e2e-kill-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // `sleep` started through a link named after the marker, as kwokctl starts our
        // binaries from its work dir.
        let marker = dir.join("marker-sleep");
        let sleep = ["/usr/bin/sleep", "/bin/sleep"]
            .into_iter()
            .find(|p| Path::new(p).is_file())
            .expect("a sleep binary");
        std::os::unix::fs::symlink(sleep, &marker).unwrap();
        let r = spawn(&dir, "marked", Command::new(&marker).arg("300")).unwrap();
        // Between fork and exec the child still shows this test's command line.
        let deadline = Instant::now() + Duration::from_secs(5);
        let found = loop {
            let found = mentioning(&marker);
            if !found.is_empty() || Instant::now() > deadline {
                break found;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(found.iter().map(|p| p.pid).collect::<Vec<_>>(), [r.pid]);
        assert!(mentioning(&dir.join("other")).is_empty());
        r.signal(Signal::KILL).unwrap();
        assert!(
            r.wait_gone(Duration::from_secs(5)),
            "SIGKILL did not end it"
        );
        r.signal(Signal::KILL).unwrap();
        assert!(mentioning(&marker).is_empty());
        stop_all(&dir).unwrap();
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
