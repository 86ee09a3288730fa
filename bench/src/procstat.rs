//! Peak RSS and CPU time of one process, read from `/proc/<pid>/status` (VmHWM, VmRSS)
//! and `/proc/<pid>/stat` (utime + stime), so that a figure is that process's alone.

use anyhow::{Context, Result};

/// One reading of a process.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Sample {
    /// Peak resident set size so far (VmHWM), MiB.
    pub peak_rss_mib: f64,
    /// Resident set size now (VmRSS), MiB.
    pub rss_mib: f64,
    /// User + system CPU time so far, seconds.
    pub cpu_s: f64,
}

/// Reads `pid` (`None`: this process).
pub fn sample(pid: Option<u32>) -> Result<Sample> {
    let dir = match pid {
        Some(p) => format!("/proc/{p}"),
        None => "/proc/self".into(),
    };
    let status = std::fs::read_to_string(format!("{dir}/status"))
        .with_context(|| format!("reading {dir}/status"))?;
    let stat = std::fs::read_to_string(format!("{dir}/stat"))
        .with_context(|| format!("reading {dir}/stat"))?;
    Ok(Sample {
        peak_rss_mib: status_kib(&status, "VmHWM:").unwrap_or(0.0) / 1024.0,
        rss_mib: status_kib(&status, "VmRSS:").unwrap_or(0.0) / 1024.0,
        cpu_s: cpu_ticks(&stat).context("parsing /proc stat")? as f64 / ticks_per_second(),
    })
}

/// How many file descriptors `pid` holds open.
pub fn open_files(pid: u32) -> Result<usize> {
    let dir = format!("/proc/{pid}/fd");
    Ok(std::fs::read_dir(&dir)
        .with_context(|| format!("reading {dir}"))?
        .count())
}

fn ticks_per_second() -> f64 {
    procfs::ticks_per_second() as f64
}

/// A `kB` field of `/proc/<pid>/status`.
fn status_kib(status: &str, field: &str) -> Option<f64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// utime + stime (fields 14 and 15) of `/proc/<pid>/stat`; the command name, field 2,
/// may hold spaces and parentheses, so fields are counted after its last `)`.
fn cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): field n is at index n - 3.
    let utime: u64 = fields.get(14 - 3)?.parse().ok()?;
    let stime: u64 = fields.get(15 - 3)?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        let stat = "1234 (a (weird) name) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 4 0 100 1000000 500 18446744073709551615";
        assert_eq!(cpu_ticks(stat), Some(300));
        assert_eq!(cpu_ticks("garbage"), None);
    }

    #[test]
    fn status_fields_in_kib() {
        let status = "Name:\thub\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n";
        assert_eq!(status_kib(status, "VmHWM:"), Some(204800.0));
        assert_eq!(status_kib(status, "VmSwap:"), None);
    }

    #[test]
    fn this_process_can_be_read() {
        let s = sample(None).unwrap();
        assert!(s.peak_rss_mib > 0.0 && s.rss_mib > 0.0);
    }

    #[test]
    fn open_files_are_counted() {
        use std::process::{Command, Stdio};
        use std::time::Duration;
        // Both children inherit whatever this process leaves open without close-on-exec;
        // the second opens three files more.
        let spawn = |script: &str| {
            Command::new("sh")
                .args(["-c", script])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        };
        // Read once the count holds still (the loader opens libraries for a moment).
        let settled = |pid: u32| {
            let mut last = open_files(pid).unwrap();
            loop {
                std::thread::sleep(Duration::from_millis(100));
                let now = open_files(pid).unwrap();
                if now == last {
                    return now;
                }
                last = now;
            }
        };
        let mut plain = spawn("exec sleep 30");
        let mut more = spawn("exec 7</dev/null 8</dev/null 9</dev/null; exec sleep 30");
        let counted = (settled(plain.id()), settled(more.id()));
        for child in [&mut plain, &mut more] {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        assert!(counted.0 >= 3, "stdin, stdout, stderr at least");
        assert_eq!(counted.1, counted.0 + 3);
        assert!(open_files(plain.id()).is_err(), "gone");
    }
}
