//! The index's pair table, `Index` against `CompactIndex`, at N clusters × M apps with
//! every agent connected and holding what it should (BENCHMARKS.md, "The index's pair
//! table: Index against CompactIndex"):
//!
//!     cargo run --release -p flotilla-plan --example index_pairs -- [--clusters N] [--apps M] [--per-app P] [--rounds R]
//!
//! Each app is placed on `P` clusters (all of them unless said): app `a` on the `P` that
//! follow cluster `a × 7919 mod N`, wrapping around, and each agent holds exactly what is
//! placed on its cluster.
//!
//! Each measurement runs in a fresh child process (this program, `--child index|compact`),
//! the two alternated A B A B: no heap left over from the other one, and the machine's
//! load spread over both. A child does what the hub does, in its order
//! (`hub/src/dispatch.rs`):
//!
//! - cold start: every app's `set_app` with a plan over its clusters (after
//!   `is_deleting`, then `applied_pairs` for the gauge), then every agent's `connect`,
//!   its Hello listing every app placed there with the hash it should have (nothing to
//!   send);
//! - steady state: one report per pair (`is_placed`, `is_assigned`, `report(Present)`);
//! - resident bytes: the process's RSS after the cold start (and after the report round)
//!   less its RSS before, when the inputs were already built, over the pairs. The
//!   workspace forbids `unsafe` code, which a counting `GlobalAlloc` would need, so this
//!   is the kernel's count: it includes what the allocator keeps of freed blocks.
//!
//! The inputs are built as the planner builds them: one `ClusterName` per cluster shared
//! by every plan, one `Arc<RenderedMyApp>` per app shared by its clusters (the planner's
//! renders of equal content are one). Time spent building a plan or dropping what a call
//! returns is not counted.

use std::collections::{BTreeMap, HashMap};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use flotilla_plan::index::compact::CompactIndex;
use flotilla_plan::index::{AppKey, Desired, Held, Index, Push, Scope};
use flotilla_plan::placement::ClusterName;
use flotilla_plan::render::RenderedMyApp;

/// The calls the hub makes, on either index.
trait Pairs: Default {
    fn is_deleting(&self, key: &AppKey) -> bool;
    fn set_app(
        &mut self,
        key: &AppKey,
        generation: Option<i64>,
        plan: BTreeMap<ClusterName, Desired>,
    ) -> Vec<Push>;
    fn applied_pairs(&self) -> usize;
    fn connect(
        &mut self,
        cluster: &str,
        managed: &HashMap<AppKey, String>,
        scope: Scope,
    ) -> (Vec<Push>, Vec<Arc<AppKey>>);
    fn is_placed(&self, cluster: &str, key: &AppKey) -> bool;
    fn is_assigned(&self, cluster: &str, key: &AppKey) -> bool;
    fn report(&mut self, cluster: &str, key: &AppKey, held: Held) -> Vec<Push>;
}

macro_rules! pairs {
    ($t:ty) => {
        impl Pairs for $t {
            fn is_deleting(&self, key: &AppKey) -> bool {
                <$t>::is_deleting(self, key)
            }
            fn set_app(
                &mut self,
                key: &AppKey,
                generation: Option<i64>,
                plan: BTreeMap<ClusterName, Desired>,
            ) -> Vec<Push> {
                <$t>::set_app(self, key, generation, plan)
            }
            fn applied_pairs(&self) -> usize {
                <$t>::applied_pairs(self)
            }
            fn connect(
                &mut self,
                cluster: &str,
                managed: &HashMap<AppKey, String>,
                scope: Scope,
            ) -> (Vec<Push>, Vec<Arc<AppKey>>) {
                <$t>::connect(self, cluster, managed, scope)
            }
            fn is_placed(&self, cluster: &str, key: &AppKey) -> bool {
                <$t>::is_placed(self, cluster, key)
            }
            fn is_assigned(&self, cluster: &str, key: &AppKey) -> bool {
                <$t>::is_assigned(self, cluster, key)
            }
            fn report(&mut self, cluster: &str, key: &AppKey, held: Held) -> Vec<Push> {
                <$t>::report(self, cluster, key, held)
            }
        }
    };
}

pairs!(Index);
pairs!(CompactIndex);

/// One child's figures.
#[derive(Debug, Clone, Copy, Default)]
struct Figures {
    set_app_s: f64,
    connect_s: f64,
    report_s: f64,
    /// Resident bytes per pair after the cold start.
    bytes_per_pair: f64,
    /// ... and after the report round.
    bytes_per_pair_after_reports: f64,
}

impl Figures {
    const FIELDS: usize = 5;

    fn cold_s(&self) -> f64 {
        self.set_app_s + self.connect_s
    }

    fn line(&self) -> String {
        format!(
            "{} {} {} {} {}",
            self.set_app_s,
            self.connect_s,
            self.report_s,
            self.bytes_per_pair,
            self.bytes_per_pair_after_reports
        )
    }

    fn parse(line: &str) -> Option<Self> {
        let v: Vec<f64> = line
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        (v.len() == Self::FIELDS).then(|| Self {
            set_app_s: v[0],
            connect_s: v[1],
            report_s: v[2],
            bytes_per_pair: v[3],
            bytes_per_pair_after_reports: v[4],
        })
    }
}

/// The process's resident set, in bytes (`VmRSS` of /proc/self/status).
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = (status.lines())
        .find(|l| l.starts_with("VmRSS:"))
        .expect("a VmRSS line");
    let kib: u64 = (line.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .expect("VmRSS in kB");
    kib * 1024
}

/// The first of the app's clusters.
fn first_cluster(app: usize, clusters: usize) -> usize {
    app * 7919 % clusters
}

/// Each cluster's apps, in order.
fn apps_by_cluster(clusters: usize, apps: usize, per_app: usize) -> Vec<Vec<u32>> {
    let mut by_cluster = vec![Vec::new(); clusters];
    for app in 0..apps {
        for j in 0..per_app {
            let cluster = (first_cluster(app, clusters) + j) % clusters;
            by_cluster[cluster].push(u32::try_from(app).expect("fewer than 2^32 apps"));
        }
    }
    by_cluster
}

fn measure<I: Pairs>(clusters: usize, apps: usize, per_app: usize) -> Figures {
    let names: Vec<ClusterName> = (0..clusters)
        .map(|c| ClusterName::from(format!("cluster-{c:05}")))
        .collect();
    let keys: Vec<AppKey> = (0..apps)
        .map(|a| AppKey::new(format!("team-{:03}", a % 100), format!("app-{a:05}")))
        .collect();
    let rendered: Vec<Arc<RenderedMyApp>> = (0..apps)
        .map(|a| {
            Arc::new(RenderedMyApp {
                hash: format!("{a:064x}"),
                json: Bytes::from(format!("{{\"kind\":\"MyApp\",\"n\":{a}}}")),
            })
        })
        .collect();
    let by_cluster = apps_by_cluster(clusters, apps, per_app);
    // Every agent holds what is placed on it at the hash it should have: one Hello serves
    // them all when every app is everywhere.
    let hello = |cluster: usize| -> HashMap<AppKey, String> {
        (by_cluster[cluster].iter())
            .map(|&a| (keys[a as usize].clone(), rendered[a as usize].hash.clone()))
            .collect()
    };
    let everywhere = (per_app == clusters).then(|| hello(0));
    let pairs = (per_app * apps) as f64;
    let before = rss_bytes();
    let mut index = I::default();

    let mut set_app_s = 0.0;
    for (a, (key, rendered)) in keys.iter().zip(&rendered).enumerate() {
        let plan: BTreeMap<ClusterName, Desired> = (0..per_app)
            .map(|j| &names[(first_cluster(a, clusters) + j) % clusters])
            .map(|name| (name.clone(), Desired::Apply(rendered.clone())))
            .collect();
        let start = Instant::now();
        assert!(!index.is_deleting(key));
        let pushes = index.set_app(key, Some(1), plan);
        let gauge = index.applied_pairs();
        set_app_s += start.elapsed().as_secs_f64();
        assert_eq!(pushes.len(), per_app);
        std::hint::black_box(gauge);
    }
    assert_eq!(index.applied_pairs(), per_app * apps);

    let mut connect_s = 0.0;
    for (c, name) in names.iter().enumerate() {
        let own;
        let managed = match &everywhere {
            Some(managed) => managed,
            None => {
                own = hello(c);
                &own
            }
        };
        let start = Instant::now();
        let (pushes, desired) = index.connect(name, managed, Scope::All);
        connect_s += start.elapsed().as_secs_f64();
        assert!(pushes.is_empty(), "every agent holds what it should");
        assert_eq!(desired.len(), managed.len());
    }
    let after_cold = rss_bytes();

    let start = Instant::now();
    for (name, apps) in names.iter().zip(&by_cluster) {
        for key in apps.iter().map(|&a| &keys[a as usize]) {
            let placed = index.is_placed(name, key);
            let assigned = index.is_assigned(name, key);
            let pushes = index.report(name, key, Held::Present);
            std::hint::black_box((placed, assigned, pushes));
        }
    }
    let report_s = start.elapsed().as_secs_f64();
    let after_reports = rss_bytes();
    std::hint::black_box(&index);

    Figures {
        set_app_s,
        connect_s,
        report_s,
        bytes_per_pair: after_cold.saturating_sub(before) as f64 / pairs,
        bytes_per_pair_after_reports: after_reports.saturating_sub(before) as f64 / pairs,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Index,
    Compact,
}

impl Kind {
    fn arg(self) -> &'static str {
        match self {
            Kind::Index => "index",
            Kind::Compact => "compact",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Kind::Index => "Index",
            Kind::Compact => "CompactIndex",
        }
    }
}

struct Args {
    clusters: usize,
    apps: usize,
    per_app: Option<usize>,
    rounds: usize,
    child: Option<Kind>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        clusters: 1000,
        apps: 1000,
        per_app: None,
        rounds: 3,
        child: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--clusters" => args.clusters = number(&value()?)?,
            "--apps" => args.apps = number(&value()?)?,
            "--per-app" => args.per_app = Some(number(&value()?)?),
            "--rounds" => args.rounds = number(&value()?)?,
            "--child" => {
                args.child = Some(match value()?.as_str() {
                    "index" => Kind::Index,
                    "compact" => Kind::Compact,
                    other => return Err(format!("--child index|compact, not {other}")),
                })
            }
            "-h" | "--help" => {
                return Err(
                    "usage: index_pairs [--clusters N] [--apps M] [--per-app P] [--rounds R]"
                        .to_owned(),
                );
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

fn number(s: &str) -> Result<usize, String> {
    s.parse().map_err(|_| format!("not a number: {s}"))
}

fn child(kind: Kind, clusters: usize, apps: usize, per_app: usize) -> Result<Figures, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = Command::new(exe)
        .args(["--child", kind.arg()])
        .args(["--clusters", &clusters.to_string()])
        .args(["--apps", &apps.to_string()])
        .args(["--per-app", &per_app.to_string()])
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "the {} child failed: {}",
            kind.label(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    Figures::parse(stdout.trim()).ok_or(format!("unreadable child output: {stdout}"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n % 2 {
        1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// "median (min–max)".
fn cell(v: &[f64], digits: usize) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let m = median(v.to_vec());
    format!("{m:.digits$} ({lo:.digits$}–{hi:.digits$})")
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

type Phase = (&'static str, fn(&Figures) -> f64, usize);

const PHASES: [Phase; 6] = [
    ("set_app, every app (s)", |f| f.set_app_s, 3),
    ("connect, every agent (s)", |f| f.connect_s, 3),
    ("cold start: both (s)", Figures::cold_s, 3),
    ("report, every pair (s)", |f| f.report_s, 3),
    ("resident B/pair after cold start", |f| f.bytes_per_pair, 1),
    (
        "resident B/pair after reports",
        |f| f.bytes_per_pair_after_reports,
        1,
    ),
];

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let (clusters, apps) = (args.clusters, args.apps);
    let per_app = args.per_app.unwrap_or(clusters);
    if per_app > clusters {
        eprintln!("--per-app {per_app} is more than the {clusters} clusters");
        return ExitCode::FAILURE;
    }
    if let Some(kind) = args.child {
        let figures = match kind {
            Kind::Index => measure::<Index>(clusters, apps, per_app),
            Kind::Compact => measure::<CompactIndex>(clusters, apps, per_app),
        };
        println!("{}", figures.line());
        return ExitCode::SUCCESS;
    }
    println!(
        "{clusters} clusters × {apps} apps on {per_app} clusters each = {} pairs, {} rounds A B, load average at start {}",
        per_app * apps,
        args.rounds,
        load()
    );
    let mut runs: Vec<(Kind, Figures)> = Vec::new();
    for round in 1..=args.rounds {
        for kind in [Kind::Index, Kind::Compact] {
            match child(kind, clusters, apps, per_app) {
                Ok(f) => {
                    eprintln!(
                        "round {round} {:>12}: set_app {:.3} s, connect {:.3} s, cold {:.3} s, reports {:.3} s, {:.1} B/pair ({:.1} after reports), load {}",
                        kind.label(),
                        f.set_app_s,
                        f.connect_s,
                        f.cold_s(),
                        f.report_s,
                        f.bytes_per_pair,
                        f.bytes_per_pair_after_reports,
                        load()
                    );
                    runs.push((kind, f));
                }
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    let of = |kind: Kind, phase: fn(&Figures) -> f64| -> Vec<f64> {
        (runs.iter())
            .filter(|(k, _)| *k == kind)
            .map(|(_, f)| phase(f))
            .collect()
    };
    println!();
    println!("| median (min–max) | Index | CompactIndex | CompactIndex / Index |");
    println!("| --- | ---: | ---: | ---: |");
    for (label, phase, digits) in PHASES {
        let (old, new) = (of(Kind::Index, phase), of(Kind::Compact, phase));
        let ratio = median(new.clone()) / median(old.clone());
        println!(
            "| {label} | {} | {} | {ratio:.2} |",
            cell(&old, digits),
            cell(&new, digits)
        );
    }
    println!();
    println!("load average at end {}", load());
    ExitCode::SUCCESS
}
