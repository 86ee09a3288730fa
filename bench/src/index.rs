//! `flotilla-bench index`: the hub's pair table, `Index` (the old one, kept as the test
//! oracle) against `CompactIndex` (the hub's), at N clusters × M apps with every agent
//! connected and holding what it should (BENCHMARKS.md, "The index's pair table: Index
//! against CompactIndex").
//!
//! Each app is placed on `P` clusters (all of them unless said): app `a` on the `P` that
//! follow cluster `a × 7919 mod N`, wrapping around, and each agent holds exactly what is
//! placed on its cluster.
//!
//! Each measurement runs in a fresh child process (this binary, `index --child
//! index|compact`), the two alternated A B A B: no heap left over from the other one, and
//! the machine's load spread over both. A child does what the hub does, in its order
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
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use bytes::Bytes;
use flotilla_plan::index::compact::CompactIndex;
use flotilla_plan::index::{AppKey, Desired, Held, Index, Push, Scope};
use flotilla_plan::placement::ClusterName;
use flotilla_plan::render::RenderedMyApp;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::{Report, procstat, round, stats};

/// N clusters, M apps, each placed on P of the clusters.
#[derive(clap::Args, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size {
    /// Member clusters N (one connected agent each)
    #[arg(long, default_value_t = 1000)]
    pub clusters: usize,
    /// Apps M
    #[arg(long, default_value_t = 1000)]
    pub apps: usize,
    /// Clusters P each app is placed on [default: every cluster]
    #[arg(long = "per-app")]
    pub per_app: Option<usize>,
}

impl Size {
    fn per_app(&self) -> usize {
        self.per_app.unwrap_or(self.clusters)
    }

    fn pairs(&self) -> usize {
        self.apps * self.per_app()
    }

    fn check(&self) -> Result<()> {
        ensure!(
            self.clusters > 0 && self.apps > 0 && self.per_app() > 0,
            "--clusters, --apps and --per-app must be positive"
        );
        ensure!(
            self.per_app() <= self.clusters,
            "--per-app ({}) cannot exceed --clusters ({})",
            self.per_app(),
            self.clusters
        );
        Ok(())
    }
}

/// The index a child measures.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Index,
    Compact,
}

impl Kind {
    fn as_str(self) -> &'static str {
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

/// One child's figures, sent to the parent as one JSON line.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
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
    fn cold_s(&self) -> f64 {
        self.set_app_s + self.connect_s
    }
}

/// A row of the table: its label, its JSON key, the figure and its decimals.
type Phase = (&'static str, &'static str, fn(&Figures) -> f64, usize);

const PHASES: [Phase; 6] = [
    ("set_app, every app (s)", "set_app_s", |f| f.set_app_s, 3),
    ("connect, every agent (s)", "connect_s", |f| f.connect_s, 3),
    ("cold start: both (s)", "cold_s", Figures::cold_s, 3),
    ("report, every pair (s)", "report_s", |f| f.report_s, 3),
    (
        "resident B/pair after cold start",
        "bytes_per_pair",
        |f| f.bytes_per_pair,
        1,
    ),
    (
        "resident B/pair after reports",
        "bytes_per_pair_after_reports",
        |f| f.bytes_per_pair_after_reports,
        1,
    ),
];

/// This process's resident set (VmRSS), bytes.
fn rss_bytes() -> Result<f64> {
    Ok(procstat::sample(None)?.rss_mib * 1024.0 * 1024.0)
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

fn measure<I: Pairs>(size: Size) -> Result<Figures> {
    let (clusters, apps, per_app) = (size.clusters, size.apps, size.per_app());
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
    let pairs = size.pairs() as f64;
    let before = rss_bytes()?;
    let mut index = I::default();

    let mut set_app_s = 0.0;
    for (a, (key, rendered)) in keys.iter().zip(&rendered).enumerate() {
        let plan: BTreeMap<ClusterName, Desired> = (0..per_app)
            .map(|j| &names[(first_cluster(a, clusters) + j) % clusters])
            .map(|name| (name.clone(), Desired::Apply(rendered.clone())))
            .collect();
        let start = Instant::now();
        let deleting = index.is_deleting(key);
        let pushes = index.set_app(key, Some(1), plan);
        let gauge = index.applied_pairs();
        set_app_s += start.elapsed().as_secs_f64();
        ensure!(
            !deleting && pushes.len() == per_app,
            "{key:?}: one Apply a cluster"
        );
        std::hint::black_box(gauge);
    }
    ensure!(index.applied_pairs() == size.pairs(), "every pair applied");

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
        ensure!(pushes.is_empty(), "every agent holds what it should");
        ensure!(desired.len() == managed.len(), "{name}: every app desired");
    }
    let after_cold = rss_bytes()?;

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
    let after_reports = rss_bytes()?;
    std::hint::black_box(&index);

    Ok(Figures {
        set_app_s,
        connect_s,
        report_s,
        bytes_per_pair: (after_cold - before).max(0.0) / pairs,
        bytes_per_pair_after_reports: (after_reports - before).max(0.0) / pairs,
    })
}

/// `flotilla-bench index --child <kind>`: measures one index in this process and prints
/// its figures.
pub fn child(kind: Kind, size: Size) -> Result<()> {
    size.check()?;
    let figures = match kind {
        Kind::Index => measure::<Index>(size)?,
        Kind::Compact => measure::<CompactIndex>(size)?,
    };
    println!("{}", serde_json::to_string(&figures)?);
    Ok(())
}

/// One measurement of `kind`, in a fresh child process.
fn run_child(kind: Kind, size: Size) -> Result<Figures> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let out = Command::new(exe)
        .args(["index", "--child", kind.as_str()])
        .args(["--clusters", &size.clusters.to_string()])
        .args(["--apps", &size.apps.to_string()])
        .args(["--per-app", &size.per_app().to_string()])
        .stderr(Stdio::inherit())
        .output()
        .context("starting the child")?;
    ensure!(
        out.status.success(),
        "the {} child failed: {}",
        kind.label(),
        out.status
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.trim())
        .with_context(|| format!("unreadable child output: {stdout}"))
}

/// The load average over 1, 5 and 15 minutes: the machine is shared.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn median(v: &[f64]) -> f64 {
    stats::percentile(&stats::sorted(v), 0.5)
}

/// "median (min–max)".
fn spread(v: &[f64], digits: usize) -> String {
    let s = stats::sorted(v);
    let (lo, hi) = (s[0], s[s.len() - 1]);
    let m = stats::percentile(&s, 0.5);
    format!("{m:.digits$} ({lo:.digits$}–{hi:.digits$})")
}

pub fn index(size: Size, rounds: usize) -> Result<Report> {
    size.check()?;
    ensure!(rounds > 0, "--rounds must be positive");
    let preamble = format!(
        "index: {} clusters × {} apps on {} clusters each = {} pairs, {rounds} rounds A B, load average at start {}",
        size.clusters,
        size.apps,
        size.per_app(),
        size.pairs(),
        load()
    );
    let mut runs: Vec<(Kind, Figures)> = Vec::new();
    for round in 1..=rounds {
        for kind in [Kind::Index, Kind::Compact] {
            let f = run_child(kind, size)?;
            eprintln!(
                "bench index round {round} {:>12}: set_app {:.3} s, connect {:.3} s, cold {:.3} s, reports {:.3} s, {:.1} B/pair ({:.1} after reports), load {}",
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
    }
    let of = |kind: Kind, phase: fn(&Figures) -> f64| -> Vec<f64> {
        (runs.iter())
            .filter(|(k, _)| *k == kind)
            .map(|(_, f)| phase(f))
            .collect()
    };
    let mut rows = Vec::new();
    let (mut index_json, mut compact_json) = (Map::new(), Map::new());
    for (label, key, phase, digits) in PHASES {
        let (old, new) = (of(Kind::Index, phase), of(Kind::Compact, phase));
        let (old_median, new_median) = (median(&old), median(&new));
        rows.push(vec![
            label.to_owned(),
            spread(&old, digits),
            spread(&new, digits),
            format!("{:.2}", new_median / old_median),
        ]);
        index_json.insert(key.into(), json!(round(old_median, digits as i32)));
        compact_json.insert(key.into(), json!(round(new_median, digits as i32)));
    }
    Ok(Report {
        preamble: vec![preamble],
        header: [
            "median (min–max)",
            "Index",
            "CompactIndex",
            "CompactIndex / Index",
        ]
        .map(String::from)
        .to_vec(),
        rows,
        notes: vec![format!("load average at end {}", load())],
        json: json!({
            "scenario": "index",
            "clusters": size.clusters,
            "apps": size.apps,
            "per_app": size.per_app(),
            "pairs": size.pairs(),
            "rounds": rounds,
            "index": Value::Object(index_json),
            "compact": Value::Object(compact_json),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_app_is_on_its_per_app_clusters_from_its_first() {
        let by_cluster = apps_by_cluster(5, 3, 2);
        // App 1 starts at 7919 mod 5 = 4 and wraps to 0; app 2 at 15838 mod 5 = 3.
        assert_eq!(
            by_cluster,
            [vec![0, 1], vec![0], vec![], vec![2], vec![1, 2]]
        );
    }

    #[test]
    fn both_indexes_measure_every_pair() {
        let size = Size {
            clusters: 7,
            apps: 20,
            per_app: Some(3),
        };
        for figures in [measure::<Index>(size), measure::<CompactIndex>(size)] {
            let f = figures.unwrap();
            assert!(f.cold_s() > 0.0 && f.report_s > 0.0, "{f:?}");
        }
    }

    #[test]
    fn the_spread_is_the_median_between_the_extremes() {
        assert_eq!(spread(&[3.0, 1.0, 2.0, 10.0], 1), "2.5 (1.0–10.0)");
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    }
}
