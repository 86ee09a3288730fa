//! The campaign loop itself (`campaign::run`, as `elect` runs it), driven on tokio's
//! paused clock against a simulated Lease store that keeps the apiserver's contract
//! (conditional writes by version, creates that conflict) and injects latencies,
//! failures, hangs, lost responses and writes that land after the caller gave up. What
//! Kubernetes itself does with those calls is proven against a real apiserver by the
//! e2e suite (`e2e/tests/election.rs`).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use parking_lot::Mutex;
use proptest::prelude::*;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::campaign::{self, Sink};
use super::decide::{Candidate, Record, Stored, Timings};
use super::lease::{CallError, LeaseApi};

const T: Timings = Timings {
    lease_duration: Duration::from_secs(15),
    renew_deadline: Duration::from_secs(10),
    retry_period: Duration::from_secs(2),
};

const MS: Duration = Duration::from_millis(1);

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// How calls misbehave.
#[derive(Clone, Copy, Debug, Default)]
struct Faults {
    /// Probability that a call fails before reaching the store, and that its response
    /// is lost after the store applied it.
    fail: f64,
    /// Probability that a call takes up to `slow_for` on each way.
    slow: f64,
    slow_for: Duration,
    /// Every call fails at once (an apiserver answering 429 to everything).
    refuse: bool,
    /// Every call hangs.
    hang: bool,
}

/// The store and the dice.
struct World {
    lease: Option<Stored>,
    versions: u64,
    rng: u64,
    faults: Faults,
    /// When the store last took a write.
    written_at: Option<Instant>,
    /// Each link (candidate) is cut until then: its bytes wait, as on a blackholed
    /// connection, and flow again after.
    cut_until: [Instant; 2],
}

impl World {
    fn new(seed: u64) -> Arc<Mutex<World>> {
        Arc::new(Mutex::new(World {
            lease: None,
            versions: 0,
            rng: seed | 1,
            faults: Faults::default(),
            written_at: None,
            cut_until: [Instant::now(); 2],
        }))
    }

    /// xorshift64*: uniform in [0, 1).
    fn roll(&mut self) -> f64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn latency(&mut self) -> Duration {
        let f = self.faults;
        if f.hang {
            return secs(3600);
        }
        let base = MS * (1 + (self.roll() * 50.0) as u32);
        if self.roll() < f.slow {
            base + f.slow_for.mul_f64(self.roll())
        } else {
            base
        }
    }

    /// How long `link` stays cut from now.
    fn cut(&self, link: usize) -> Duration {
        self.cut_until[link].saturating_duration_since(Instant::now())
    }

    fn store(&mut self, record: Record) -> Stored {
        self.versions += 1;
        self.written_at = Some(Instant::now());
        let stored = Stored {
            record,
            version: self.versions.to_string(),
        };
        self.lease = Some(stored.clone());
        stored
    }
}

/// One candidate's connection to the world: the store, and which link it uses.
struct SimLease(Arc<Mutex<World>>, usize);

impl SimLease {
    /// The request travels, the store applies `op` (even if the caller has given up
    /// meanwhile, as an apiserver does), the response travels back.
    async fn call<R: Send + 'static>(
        &self,
        op: impl FnOnce(&mut World) -> Result<R, CallError> + Send + 'static,
    ) -> Result<R, CallError> {
        let link = self.1;
        let (there, back, lost_before, lost_after, refuse) = {
            let mut w = self.0.lock();
            let fail = w.faults.fail;
            let there = w.latency() + w.cut(link);
            (
                there,
                w.latency(),
                w.roll() < fail,
                w.roll() < fail,
                w.faults.refuse,
            )
        };
        if refuse {
            tokio::time::sleep(MS).await;
            return Err(CallError::Failed("429 Too Many Requests".into()));
        }
        let world = self.0.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            tokio::time::sleep(there).await;
            let r = if lost_before {
                Err(CallError::Failed("connection reset".into()))
            } else {
                op(&mut world.lock())
            };
            let _ = tx.send(r);
        });
        let r = rx.await.unwrap_or(Err(CallError::Failed("dropped".into())));
        let back = back + self.0.lock().cut(link);
        tokio::time::sleep(back).await;
        if lost_after {
            return Err(CallError::Failed("response lost".into()));
        }
        r
    }
}

impl LeaseApi for SimLease {
    async fn get(&self) -> Result<Option<Stored>, CallError> {
        self.call(|w| Ok(w.lease.clone())).await
    }

    async fn create(&self, record: &Record) -> Result<Stored, CallError> {
        let record = record.clone();
        self.call(move |w| match w.lease {
            Some(_) => Err(CallError::Conflict),
            None => Ok(w.store(record)),
        })
        .await
    }

    async fn update(&self, record: &Record, version: &str) -> Result<Stored, CallError> {
        let (record, version) = (record.clone(), version.to_owned());
        self.call(move |w| match &w.lease {
            None => Err(CallError::Gone),
            Some(s) if s.version != version => Err(CallError::Conflict),
            Some(_) => Ok(w.store(record)),
        })
        .await
    }
}

/// Every change of every candidate's `leading`, in the order they happened.
type Log = Arc<Mutex<Vec<(Instant, usize, bool)>>>;

struct Recorder {
    log: Log,
    instance: usize,
}

impl Sink for Recorder {
    fn publish(&mut self, leading: bool) {
        self.log
            .lock()
            .push((Instant::now(), self.instance, leading));
    }
}

/// A running candidate: its campaign task and shutdown token.
struct Running {
    task: JoinHandle<()>,
    shutdown: CancellationToken,
}

struct Sim {
    world: Arc<Mutex<World>>,
    log: Log,
    instances: usize,
}

impl Sim {
    fn new(seed: u64) -> Sim {
        Sim {
            world: World::new(seed),
            log: Log::default(),
            instances: 0,
        }
    }

    /// Starts a candidate whose wall clock is `skew` off, on link 0 for "a" and 1 for
    /// the others.
    fn start(&mut self, identity: &str, skew: SignedDuration) -> Running {
        let link = usize::from(identity != "a");
        let instance = self.instances;
        self.instances += 1;
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(campaign::run(
            SimLease(self.world.clone(), link),
            Candidate::new(identity, T),
            move || Timestamp::now().checked_add(skew).unwrap(),
            Recorder {
                log: self.log.clone(),
                instance,
            },
            shutdown.clone(),
        ));
        Running { task, shutdown }
    }

    fn faults(&self, faults: Faults) {
        self.world.lock().faults = faults;
    }

    fn holder(&self) -> Option<String> {
        self.world
            .lock()
            .lease
            .as_ref()
            .map(|s| s.record.holder.clone())
    }

    /// The intervals during which each instance led: `(instance, from, to)`, `to` None
    /// while it still leads. Panics if two instances ever led at once.
    fn leads(&self) -> Vec<(usize, Instant, Option<Instant>)> {
        let mut leads: Vec<(usize, Instant, Option<Instant>)> = Vec::new();
        for &(at, who, leading) in self.log.lock().iter() {
            let open = leads.iter().position(|(_, _, to)| to.is_none());
            match (leading, open) {
                (true, Some(i)) => panic!(
                    "instance {who} leads at {at:?} while instance {} leads since {:?}",
                    leads[i].0, leads[i].1
                ),
                (true, None) => leads.push((who, at, None)),
                (false, Some(i)) if leads[i].0 == who => leads[i].2 = Some(at),
                (false, _) => panic!("instance {who} stopped leading at {at:?} without leading"),
            }
        }
        leads
    }

    fn leader_now(&self) -> Option<usize> {
        self.leads().iter().find(|l| l.2.is_none()).map(|l| l.0)
    }

    async fn wait_leader(&self, within: Duration) -> usize {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if let Some(l) = self.leader_now() {
                return l;
            }
            tokio::time::sleep(10 * MS).await;
        }
        panic!("no leader within {within:?}: {:?}", self.log.lock());
    }
}

impl Running {
    /// Kills the process: the campaign is dropped where it stands.
    async fn kill(self) {
        self.task.abort();
        let _ = self.task.await;
    }

    /// Graceful shutdown; returns how long the campaign took to end.
    async fn stop(self) -> Duration {
        let start = Instant::now();
        self.shutdown.cancel();
        self.task.await.unwrap();
        start.elapsed()
    }
}

fn paused() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn one_failed_and_one_slow_renewal_keep_the_lead_and_the_holder() {
    let mut sim = Sim::new(1);
    let a = sim.start("a", SignedDuration::ZERO);
    sim.wait_leader(secs(1)).await;
    let _b = sim.start("b", SignedDuration::ZERO);
    tokio::time::sleep(secs(4)).await;
    // Every call fails for 3 s, then every call takes up to 2 s each way for 10 s.
    sim.faults(Faults {
        refuse: true,
        ..Faults::default()
    });
    tokio::time::sleep(secs(3)).await;
    sim.faults(Faults {
        slow: 1.0,
        slow_for: secs(2),
        ..Faults::default()
    });
    tokio::time::sleep(secs(10)).await;
    sim.faults(Faults::default());
    tokio::time::sleep(secs(20)).await;
    let leads = sim.leads();
    assert_eq!(leads.len(), 1, "one lead, never interrupted: {leads:?}");
    assert_eq!(leads[0].0, 0);
    assert_eq!(sim.holder().as_deref(), Some("a"));
    a.stop().await;
}

/// A leader under `faults`: `(when its last write was stored, when its lead ended)`.
async fn lead_under(faults: Faults) -> (Instant, Instant) {
    let mut sim = Sim::new(2);
    let _a = sim.start("a", SignedDuration::ZERO);
    sim.wait_leader(secs(1)).await;
    tokio::time::sleep(secs(5)).await;
    sim.faults(faults);
    tokio::time::sleep(secs(30)).await;
    let leads = sim.leads();
    assert_eq!(leads.len(), 1, "{leads:?}");
    let written = sim.world.lock().written_at.unwrap();
    (written, leads[0].2.expect("stepped down"))
}

/// The lead ends at the renew deadline after the start of the last renewal, which
/// reached the store at most one request latency (≤ 51 ms here) later.
fn ends_at_the_deadline(written: Instant, ended: Instant) {
    assert!(ended <= written + T.renew_deadline, "{:?}", ended - written);
    assert!(
        ended + 60 * MS >= written + T.renew_deadline,
        "{:?}",
        ended - written
    );
    assert!(
        ended < written + T.lease_duration,
        "strictly before anyone may take over"
    );
}

#[tokio::test(start_paused = true)]
async fn under_429s_or_hung_calls_the_leader_steps_down_at_the_renew_deadline() {
    for faults in [
        Faults {
            refuse: true,
            ..Faults::default()
        },
        Faults {
            hang: true,
            ..Faults::default()
        },
    ] {
        let (written, ended) = lead_under(faults).await;
        ends_at_the_deadline(written, ended);
    }
}

#[tokio::test(start_paused = true)]
async fn shutdown_ends_the_campaign_within_two_seconds_whatever_the_apiserver_does() {
    for faults in [
        Faults {
            hang: true,
            ..Faults::default()
        },
        Faults {
            refuse: true,
            ..Faults::default()
        },
        Faults::default(),
    ] {
        let mut sim = Sim::new(4);
        let a = sim.start("a", SignedDuration::ZERO);
        sim.wait_leader(secs(1)).await;
        sim.faults(faults);
        // A renewal fails or hangs, then the process is told to stop.
        tokio::time::sleep(secs(3)).await;
        let took = a.stop().await;
        assert!(took < secs(2), "{faults:?}: {took:?}");
        assert_eq!(sim.leader_now(), None);
        let released = sim.holder().as_deref() == Some("");
        assert_eq!(released, !faults.hang && !faults.refuse, "{faults:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_released_lease_is_taken_within_a_retry_period() {
    let mut sim = Sim::new(5);
    let a = sim.start("a", SignedDuration::ZERO);
    sim.wait_leader(secs(1)).await;
    let _b = sim.start("b", SignedDuration::ZERO);
    tokio::time::sleep(secs(5)).await;
    let stopped = Instant::now();
    a.stop().await;
    assert_eq!(sim.wait_leader(T.retry_period + 200 * MS).await, 1);
    println!("released: b leads {:?} after a stopped", stopped.elapsed());
}

#[tokio::test(start_paused = true)]
async fn a_killed_leader_is_replaced_within_lease_duration_and_a_retry_period() {
    for wait in [0, 700, 1300, 1999] {
        let mut sim = Sim::new(6 + wait);
        let a = sim.start("a", SignedDuration::ZERO);
        sim.wait_leader(secs(1)).await;
        let _b = sim.start("b", SignedDuration::ZERO);
        tokio::time::sleep(secs(6) + MS * u32::try_from(wait).unwrap()).await;
        let killed = Instant::now();
        a.kill().await;
        assert_eq!(sim.leader_now(), None, "a dropped campaign does not lead");
        assert_eq!(
            sim.wait_leader(T.lease_duration + T.retry_period + 200 * MS)
                .await,
            1
        );
        let took = killed.elapsed();
        assert!(
            took + 200 * MS >= T.lease_duration - T.retry_period,
            "{took:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_standby_ten_seconds_ahead_never_takes_over_from_a_healthy_leader() {
    let mut sim = Sim::new(7);
    let a = sim.start("a", SignedDuration::ZERO);
    sim.wait_leader(secs(1)).await;
    let b = sim.start("b", SignedDuration::from_secs(10));
    // And one an hour behind.
    let c = sim.start("c", SignedDuration::from_secs(-3600));
    tokio::time::sleep(secs(60)).await;
    let leads = sim.leads();
    assert_eq!(leads.len(), 1, "{leads:?}");
    assert_eq!(leads[0].0, 0);
    for r in [a, b, c] {
        r.stop().await;
    }
}

#[tokio::test(start_paused = true)]
async fn candidates_that_start_together_elect_one() {
    for seed in 0..50 {
        let mut sim = Sim::new(seed);
        let running: Vec<Running> = ["a", "b", "c"]
            .iter()
            .map(|id| sim.start(id, SignedDuration::ZERO))
            .collect();
        let leader = sim.wait_leader(secs(5)).await;
        tokio::time::sleep(secs(20)).await;
        assert_eq!(sim.leads().len(), 1, "seed {seed}");
        assert_eq!(sim.leader_now(), Some(leader));
        for r in running {
            r.stop().await;
        }
    }
}

/// What a property case does to the candidates.
#[derive(Clone, Debug)]
enum Event {
    /// Starts the candidate if it is not running.
    Start(usize),
    /// SIGKILL, and a restart under the same name a moment later.
    Kill(usize),
    /// SIGTERM, and a restart under the same name a moment later.
    Stop(usize),
    /// Cuts the candidate's link for this many milliseconds.
    Cut(usize, u64),
}

prop_compose! {
    fn faults()(fail in 0.0..0.5f64, slow in 0.0..0.4f64, slow_ms in 0u64..14_000) -> Faults {
        Faults { fail, slow, slow_for: Duration::from_millis(slow_ms), ..Faults::default() }
    }
}

fn events() -> impl Strategy<Value = Vec<(u64, Event)>> {
    let event = prop_oneof![
        (0usize..2).prop_map(Event::Kill),
        (0usize..2).prop_map(Event::Stop),
        (0usize..2, 0u64..30_000).prop_map(|(i, ms)| Event::Cut(i, ms)),
    ];
    prop::collection::vec((0u64..60_000, event), 0..6)
}

/// Two candidates with skewed clocks, random latencies (some far past the deadlines),
/// failures, lost responses and late writes, links cut for up to 30 s, killed, stopped
/// and restarted at random for 60 s; then 60 s of a healthy apiserver.
async fn chaos(
    seed: u64,
    faults: Faults,
    skews: [i64; 2],
    b_starts: u64,
    events: Vec<(u64, Event)>,
) {
    let mut sim = Sim::new(seed);
    let names = ["a", "b"];
    let skew = |i: usize| SignedDuration::from_secs(skews[i]);
    sim.faults(faults);
    let start = Instant::now();
    let mut running: [Option<Running>; 2] = [Some(sim.start("a", skew(0))), None];
    let mut events = events;
    events.push((b_starts, Event::Start(1)));
    events.sort_by_key(|(at, _)| *at);
    for (at, event) in events {
        tokio::time::sleep_until(start + Duration::from_millis(at)).await;
        let i = match event {
            Event::Start(i) if running[i].is_some() => continue,
            Event::Start(i) => i,
            Event::Cut(i, ms) => {
                sim.world.lock().cut_until[i] = Instant::now() + Duration::from_millis(ms);
                continue;
            }
            Event::Kill(i) | Event::Stop(i) => {
                match running[i].take() {
                    Some(r) if matches!(event, Event::Kill(_)) => r.kill().await,
                    Some(r) => drop(r.stop().await),
                    None => {}
                }
                tokio::time::sleep(Duration::from_millis(at % 3000)).await;
                i
            }
        };
        running[i] = Some(sim.start(names[i], skew(i)));
    }
    tokio::time::sleep_until(start + secs(60)).await;
    sim.faults(Faults::default());
    sim.world.lock().cut_until = [Instant::now(); 2];
    for (i, r) in running.iter_mut().enumerate() {
        if r.is_none() {
            *r = Some(sim.start(names[i], skew(i)));
        }
    }
    // Calls already delayed by a cut or a slow link still land within 30 s.
    tokio::time::sleep(secs(60)).await;
    assert!(
        sim.leader_now().is_some(),
        "a healthy apiserver elects a leader: {:?}",
        sim.log.lock()
    );
    for r in running.into_iter().flatten() {
        r.stop().await;
    }
    sim.leads();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn two_candidates_never_lead_at_once(
        seed in any::<u64>(),
        faults in faults(),
        skews in [-30i64..30, -30i64..30],
        b_starts in 0u64..20_000,
        events in events(),
    ) {
        paused().block_on(chaos(seed, faults, skews, b_starts, events));
    }
}
