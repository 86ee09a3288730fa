//! `flotilla-bench <scenario> [--json]`: every figure of `BENCHMARKS.md` from one
//! command. Each scenario measures its baseline in the same run and prints one table;
//! with `--json`, one JSON object on the last line of stdout. Progress goes to stderr.
//! Timings are reported, never asserted. The scenarios on a real environment use the
//! lab's (`flotilla_lab`), in `$FLOTILLA_E2E_DIR` like `flotilla-e2e`.
//!
//! - [`fanout`]: one hub process against K load-generating agents over real TLS, and the
//!   floor (a bare tonic stream of the same messages); also `resync`, the same agents
//!   reconnecting to a restarted hub with everything applied,
//! - [`latency`]: host write → member watch on the real environment, against two watch
//!   round trips,
//! - [`footprint`]: the agent's memory and idle CPU with many MyApps on a real member,
//!   and the hub's memory per 1,000 pairs, against the same processes with no app,
//! - [`join`]: agent start → MemberCluster Ready, against a new client's first write,
//! - [`hostwrites`]: the real hub's writes to a real host apiserver with K simulated
//!   clusters: converging, idle, session flaps, a hub restart; the largest status,
//! - [`index`]: the hub's pair table, `CompactIndex` against the old `Index`, each
//!   measurement in a fresh child process: cold start, reports, resident bytes a pair,
//! - [`stats`]: percentiles, the bootstrap interval and the verdict (pure, tested),
//! - [`chart`]: the samples as an SVG chart (`latency --svg`),
//! - [`procstat`]: peak RSS and CPU time of one process, from `/proc`.

mod chart;
mod fanout;
mod footprint;
mod hostwrites;
mod index;
mod join;
mod latency;
mod members;
mod procstat;
mod stats;

use std::future::Future;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use flotilla_lab::{Env, Provider, env};
use serde_json::Value;

#[derive(Parser)]
#[command(
    name = "flotilla-bench",
    about = "Flotilla's benchmarks, each against a baseline measured in the same run (see BENCHMARKS.md)"
)]
struct Cli {
    // The lab's state directory, for the scenarios on a real environment.
    #[command(flatten)]
    dir: env::DirArg,
    /// Also print the figures as one JSON object on the last line
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    scenario: Scenario,
}

/// `--features mimalloc` measures the hub (`serve hub`) with the allocator the hub's own
/// feature of that name selects (BENCHMARKS.md, "Allocator").
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.scenario, cli.json, &cli.dir.resolve()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flotilla-bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A scenario's result: a table for people, an object for machines.
#[derive(Debug, Clone)]
pub struct Report {
    /// Lines printed above the table (what was measured, how).
    pub preamble: Vec<String>,
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
    /// Lines printed below the table (targets, verdicts).
    pub notes: Vec<String>,
    pub json: Value,
}

impl Report {
    /// The table with columns padded to their widest cell; the first column left-aligned,
    /// the others right-aligned.
    pub fn table(&self) -> String {
        let columns = self.header.len();
        let mut widths = vec![0; columns];
        for row in std::iter::once(&self.header).chain(&self.rows) {
            for (i, cell) in row.iter().enumerate().take(columns) {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let line = |row: &Vec<String>| {
            let cells: Vec<String> = row
                .iter()
                .enumerate()
                .take(columns)
                .map(|(i, c)| {
                    if i == 0 {
                        format!("{c:<w$}", w = widths[i])
                    } else {
                        format!("{c:>w$}", w = widths[i])
                    }
                })
                .collect();
            cells.join("  ").trim_end().to_owned()
        };
        let mut out = String::new();
        for l in &self.preamble {
            out.push_str(l);
            out.push('\n');
        }
        out.push_str(&line(&self.header));
        out.push('\n');
        for row in &self.rows {
            out.push_str(&line(row));
            out.push('\n');
        }
        for l in &self.notes {
            out.push_str(l);
            out.push('\n');
        }
        out
    }

    /// Prints the table, then (with `json`) the object on one last line.
    pub fn print(&self, json: bool) {
        print!("{}", self.table());
        if json {
            println!("{}", self.json);
        }
    }
}

/// The member cluster a scenario measures on.
fn first_member(env: &Env) -> Result<String> {
    let first = env.members().first().copied();
    Ok(first.context("no member cluster")?.to_owned())
}

/// `x` with `digits` decimals, as a table cell.
pub fn cell(x: f64, digits: usize) -> String {
    format!("{x:.digits$}")
}

/// Rounded for JSON: figures carry no more precision than was measured.
pub fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_aligns_columns_and_json_is_the_last_line() {
        let r = Report {
            preamble: vec!["title".into()],
            header: vec!["case".into(), "s".into()],
            rows: vec![
                vec!["floor".into(), "1.5".into()],
                vec!["hub, long name".into(), "12.25".into()],
            ],
            notes: vec!["note".into()],
            json: serde_json::json!({"seconds": 1.5}),
        };
        assert_eq!(
            r.table(),
            "title\ncase                s\nfloor             1.5\nhub, long name  12.25\nnote\n"
        );
    }

    #[test]
    fn rounding() {
        assert_eq!(round(1.23456, 2), 1.23);
        assert_eq!(cell(2.0, 1), "2.0");
    }
}

/// The scenarios.
#[derive(clap::Subcommand, Debug)]
enum Scenario {
    /// One hub process against K load-generating agents over TLS, against a bare stream
    Fanout {
        #[command(flatten)]
        size: fanout::Size,
        /// Run once per number of apps listed (instead of --apps), then print the
        /// figures per pair against the number of pairs, hub beside floor
        #[arg(long, value_delimiter = ',')]
        sweep_apps: Vec<usize>,
        /// With --sweep-apps: also chart them here, as SVG
        #[arg(long, requires = "sweep_apps")]
        svg: Option<std::path::PathBuf>,
        /// Agents hold their sessions once synced, as in production, until every one has;
        /// the servers are read then (RSS, open files, memory per stream)
        #[arg(long)]
        hold: bool,
    },
    /// Propagation latency on the real environment (host + 2 members) against the watch
    /// floor; brings the environment up and down if none is running
    Latency {
        #[arg(long, default_value_t = 200)]
        samples: usize,
        /// Also write the CDF of both sets of samples here, as SVG.
        #[arg(long)]
        svg: Option<std::path::PathBuf>,
    },
    /// Agents holding everything reconnect to a restarted hub: Applies and bytes sent
    Resync {
        #[command(flatten)]
        size: fanout::Size,
        /// Agents hold their sessions once synced, until every one has; each hub is read
        /// then (RSS, open files, memory per stream)
        #[arg(long)]
        hold: bool,
    },
    /// Agent memory and idle CPU with many MyApps on a real member, hub memory per 1,000
    /// pairs (use release builds: FLOTILLA_BIN_DIR); brings the environment up and down
    /// if none is running
    Footprint {
        #[arg(long, default_value_t = 1000)]
        apps: usize,
    },
    /// Agent start → MemberCluster Ready on the host; brings the environment up and down
    /// if none is running
    Join {
        #[arg(long, default_value_t = 5)]
        samples: usize,
    },
    /// The hub's writes to a real host apiserver with K simulated clusters (converge, idle,
    /// flaps, hub restart); brings the environment up and down if none is running
    Hostwrites(hostwrites::Size),
    /// The hub's MemberCluster watch when every cluster turns NotReady and Ready again,
    /// every agent connected, against the store alone (in this process)
    Members {
        #[arg(long, default_value_t = 10_000)]
        clusters: usize,
    },
    /// The hub's pair table, CompactIndex against Index, at N clusters × M apps with every
    /// agent connected: cold start, reports, resident bytes a pair; each measurement in a
    /// fresh child process, the two alternated (use a release build)
    Index {
        #[command(flatten)]
        size: index::Size,
        /// Measurements of each index
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Measure this one index and print its figures (the scenario's child processes)
        #[arg(long, hide = true)]
        child: Option<index::Kind>,
    },
    /// A server for the fan-out scenarios, run by them in a child process
    #[command(hide = true)]
    Serve {
        role: fanout::Role,
        #[command(flatten)]
        size: fanout::Size,
    },
}

/// Runs `measure` against the environment in `dir`; brings one up (host + 2 members)
/// first if none is running there, and takes it down again afterwards, also after a
/// failure or Ctrl-C.
async fn on_environment<F, Fut>(dir: &Path, scenario: &str, measure: F) -> Result<Report>
where
    F: FnOnce(Env) -> Fut,
    Fut: Future<Output = Result<Report>>,
{
    if flotilla_lab::status::is_up(dir).await {
        eprintln!(
            "bench {scenario}: using the running environment in {}",
            dir.display()
        );
        return measure(Env::load_from(dir)?).await;
    }
    eprintln!(
        "bench {scenario}: no environment running in {}: bringing one up (and down afterwards)",
        dir.display()
    );
    let result = tokio::select! {
        r = async { measure(flotilla_lab::up(dir, 2, Provider::Local).await?).await } => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    if let Err(e) = flotilla_lab::down(dir).await {
        eprintln!("bench {scenario}: taking the environment down failed: {e:#}");
    }
    result
}

/// Runs a scenario and prints its report; `dir` is the lab's state directory (the
/// scenarios on the real environment).
async fn run(scenario: Scenario, json: bool, dir: &Path) -> Result<()> {
    let report = match scenario {
        Scenario::Fanout {
            size,
            sweep_apps,
            svg,
            hold,
        } => match sweep_apps.is_empty() {
            true => fanout::fanout(size, hold).await?,
            false => fanout::sweep(size, &sweep_apps, svg.as_deref(), hold).await?,
        },
        Scenario::Resync { size, hold } => fanout::resync(size, hold).await?,
        Scenario::Members { clusters } => members::members(clusters).await?,
        Scenario::Index {
            size,
            rounds,
            child,
        } => match child {
            Some(kind) => return index::child(kind, size),
            None => index::index(size, rounds)?,
        },
        Scenario::Latency { samples, svg } => {
            on_environment(dir, "latency", |env| async move {
                latency::latency(&env, samples, svg.as_deref()).await
            })
            .await?
        }
        Scenario::Footprint { apps } => {
            on_environment(dir, "footprint", |env| async move {
                footprint::footprint(&env, apps).await
            })
            .await?
        }
        Scenario::Join { samples } => {
            on_environment(
                dir,
                "join",
                |env| async move { join::join(&env, samples).await },
            )
            .await?
        }
        Scenario::Hostwrites(size) => {
            on_environment(dir, "hostwrites", |env| async move {
                hostwrites::hostwrites(&env, size).await
            })
            .await?
        }
        Scenario::Serve { role, size } => return fanout::serve(role, size).await,
    };
    report.print(json);
    Ok(())
}
