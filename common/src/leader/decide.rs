//! What one candidate decides, as client-go's `leaderelection` does, without I/O: the
//! Lease it read, the writes it made and the local monotonic clock in; what to write and
//! whether it leads out. The driver (`campaign`) does the calls and the waiting.
//!
//! The rules that make leadership exclusive and stable:
//! - A candidate leads from a successful write naming it until `renew_deadline` after
//!   the *start* of its last successful write, unless it renews first.
//! - Another candidate judges the holder's Lease expired `lease_duration` after it
//!   *first saw* the holder's latest version on its own clock (client-go's
//!   `observedTime`), never from the times written in the Lease: clocks of different
//!   machines never meet. It first saw that version after it was written, hence after
//!   the holder's write started; since `renew_deadline < lease_duration`, the holder
//!   has stopped leading before anyone may take over.
//! - Every write is conditional on the `resourceVersion` read (or last written), so of
//!   two candidates that both judged the Lease free, one write fails.

use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;

/// What a Lease says about who leads (client-go's `LeaderElectionRecord`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Empty when released.
    pub holder: String,
    pub lease_duration: Duration,
    pub acquire_time: Option<Timestamp>,
    pub renew_time: Option<Timestamp>,
    pub transitions: i32,
}

/// A Lease as the apiserver stores it: its record and `resourceVersion`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    pub record: Record,
    pub version: String,
}

/// The election's timings, validated (`LeaderArgs::timings`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timings {
    /// How long after a holder's last renewal, as another replica observes it, that
    /// replica may take the Lease. Whole seconds (the Lease carries seconds).
    pub lease_duration: Duration,
    /// How long after the start of its last successful renewal the leader stops leading.
    pub renew_deadline: Duration,
    /// How often the leader renews and a standby looks at the Lease; how soon a failed
    /// attempt is retried.
    pub retry_period: Duration,
}

impl Timings {
    /// The bound on one attempt (a read and a write): half the renew deadline, so that a
    /// call that hangs leaves time for another attempt before the leader steps down.
    pub fn attempt_timeout(&self) -> Duration {
        self.renew_deadline / 2
    }

    /// The bound on the release at shutdown: short, since the process is stopping and a
    /// Lease left held only delays the next leader by its expiry.
    pub fn release_timeout(&self) -> Duration {
        self.retry_period.min(Duration::from_secs(1))
    }
}

/// What to write after reading the Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    /// No Lease yet: create it with this record.
    Create(Record),
    /// Replace the Lease at `version` (a precondition) with this record.
    Update { record: Record, version: String },
}

/// One candidate's view (client-go's `LeaderElector` state).
#[derive(Clone, Debug)]
pub struct Candidate {
    identity: String,
    timings: Timings,
    /// The Lease as last read or written, and when this candidate first saw that
    /// version on its local clock.
    observed: Option<(Stored, Instant)>,
    /// While leading: when the last successful write naming this candidate started.
    renewed: Option<Instant>,
}

impl Candidate {
    pub fn new(identity: impl Into<String>, timings: Timings) -> Self {
        Self {
            identity: identity.into(),
            timings,
            observed: None,
            renewed: None,
        }
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    pub fn timings(&self) -> Timings {
        self.timings
    }

    /// Whether this candidate leads at `now`; past the renew deadline it stops for good
    /// (until it writes the Lease again).
    pub fn leading(&mut self, now: Instant) -> bool {
        if self.lead_ends().is_some_and(|end| now >= end) {
            self.renewed = None;
        }
        self.renewed.is_some()
    }

    /// When the lead ends unless renewed first.
    pub fn lead_ends(&self) -> Option<Instant> {
        self.renewed.map(|r| r + self.timings.renew_deadline)
    }

    /// The deadline of an attempt that starts at `now`: the attempt timeout, and for a
    /// leader never past the end of its lead, so a hung call steps it down on time.
    pub fn attempt_deadline(&self, now: Instant) -> Instant {
        let own = now + self.timings.attempt_timeout();
        self.lead_ends().map_or(own, |end| own.min(end))
    }

    /// When to attempt next, after an attempt that started at `started`: one retry period
    /// later, or for a standby as soon as the holder's Lease expires if that is sooner
    /// (but never at once again: a Lease that had expired already and could not be
    /// taken is tried again a period later).
    pub fn next_attempt(&self, started: Instant) -> Instant {
        let period = started + self.timings.retry_period;
        match self.expiry() {
            Some(expiry) if self.renewed.is_none() && expiry > started => period.min(expiry),
            _ => period,
        }
    }

    /// When another holder's Lease expires as this candidate judges it: the moment it
    /// first saw the current version plus the duration that version carries.
    pub fn expiry(&self) -> Option<Instant> {
        let (stored, since) = self.observed.as_ref()?;
        let holder = &stored.record.holder;
        (!holder.is_empty() && *holder != self.identity)
            .then(|| *since + stored.record.lease_duration.max(Duration::from_secs(1)))
    }

    /// The leader's renewal without reading first (client-go's fast path): its own
    /// Lease as it last wrote it, renewed. None when not leading.
    pub fn renewal(&mut self, now: Instant, wall: Timestamp) -> Option<Write> {
        if !self.leading(now) {
            return None;
        }
        let (stored, _) = self.observed.as_ref()?;
        (stored.record.holder == self.identity).then(|| Write::Update {
            record: self.claim(Some(&stored.record), wall),
            version: stored.version.clone(),
        })
    }

    /// The Lease as read at `now` (`None`: there is none): remembers it ([`Self::seen`])
    /// and decides whether to write. `None`: another holder's Lease has not expired.
    pub fn observe(
        &mut self,
        read: Option<Stored>,
        now: Instant,
        wall: Timestamp,
    ) -> Option<Write> {
        self.seen(read, now);
        let Some((stored, _)) = self.observed.as_ref() else {
            return Some(Write::Create(self.claim(None, wall)));
        };
        if stored.record.holder != self.identity && self.expiry().is_some_and(|e| now < e) {
            return None;
        }
        Some(Write::Update {
            record: self.claim(Some(&stored.record), wall),
            version: stored.version.clone(),
        })
    }

    /// The Lease as read at `now`: a version not seen before starts its expiry now. A
    /// Lease that names another holder, or none, ends this candidate's lead at once,
    /// whatever it believed.
    pub fn seen(&mut self, read: Option<Stored>, now: Instant) {
        let Some(read) = read else {
            // Deleted under a leader: someone else may create it at once.
            self.renewed = None;
            self.observed = None;
            return;
        };
        if read.record.holder != self.identity {
            self.renewed = None;
        }
        let seen_before = self
            .observed
            .as_ref()
            .is_some_and(|(s, _)| s.version == read.version);
        if !seen_before {
            self.observed = Some((read, now));
        }
    }

    /// A write that started at `started` was stored as `stored`, seen at `now`.
    pub fn wrote(&mut self, stored: Stored, started: Instant, now: Instant) {
        self.renewed = (stored.record.holder == self.identity).then_some(started);
        self.observed = Some((stored, now));
    }

    /// The release at shutdown: the Lease as this candidate last wrote it, without a
    /// holder and expiring in a second, so another candidate takes over at once. None
    /// when the last version seen does not name this candidate.
    pub fn release(&self, wall: Timestamp) -> Option<Write> {
        let (stored, _) = self.observed.as_ref()?;
        (stored.record.holder == self.identity).then(|| Write::Update {
            record: Record {
                holder: String::new(),
                lease_duration: Duration::from_secs(1),
                acquire_time: Some(wall),
                renew_time: Some(wall),
                transitions: stored.record.transitions,
            },
            version: stored.version.clone(),
        })
    }

    /// The record that makes this candidate the holder, continuing `previous`.
    fn claim(&self, previous: Option<&Record>, wall: Timestamp) -> Record {
        let kept = previous.filter(|p| p.holder == self.identity);
        Record {
            holder: self.identity.clone(),
            lease_duration: self.timings.lease_duration,
            acquire_time: kept.map_or(Some(wall), |p| p.acquire_time.or(Some(wall))),
            renew_time: Some(wall),
            transitions: match (previous, kept) {
                (_, Some(p)) => p.transitions,
                (Some(p), None) => p.transitions.saturating_add(1),
                (None, None) => 0,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Timings = Timings {
        lease_duration: Duration::from_secs(15),
        renew_deadline: Duration::from_secs(10),
        retry_period: Duration::from_secs(2),
    };

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn wall(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap()
    }

    fn held(holder: &str, version: &str, renewed_at: i64) -> Stored {
        Stored {
            record: Record {
                holder: holder.into(),
                lease_duration: T.lease_duration,
                acquire_time: Some(wall(0)),
                renew_time: Some(wall(renewed_at)),
                transitions: 3,
            },
            version: version.into(),
        }
    }

    /// What the apiserver stores for `write`, at version `version`.
    fn stored(write: Write, version: &str) -> Stored {
        let record = match write {
            Write::Create(r) | Write::Update { record: r, .. } => r,
        };
        Stored {
            record,
            version: version.into(),
        }
    }

    /// A candidate that acquired an absent Lease with a write that started at `t0`.
    fn leader(t0: Instant) -> Candidate {
        let mut c = Candidate::new("a", T);
        let write = c.observe(None, t0, wall(0)).unwrap();
        assert!(matches!(write, Write::Create(_)));
        c.wrote(stored(write, "1"), t0, t0 + secs(1));
        c
    }

    #[test]
    fn an_absent_lease_is_created_naming_the_candidate() {
        let t0 = Instant::now();
        let mut c = Candidate::new("a", T);
        let Some(Write::Create(r)) = c.observe(None, t0, wall(5)) else {
            panic!("creates");
        };
        assert_eq!(r.holder, "a");
        assert_eq!(r.lease_duration, secs(15));
        assert_eq!(
            (r.acquire_time, r.renew_time),
            (Some(wall(5)), Some(wall(5)))
        );
        assert_eq!(r.transitions, 0);
        assert!(!c.leading(t0), "not before the write succeeded");
    }

    #[test]
    fn the_lead_lasts_the_renew_deadline_from_the_start_of_the_write() {
        let t0 = Instant::now();
        let mut c = leader(t0);
        assert!(c.leading(t0 + secs(1)));
        assert!(c.leading(t0 + secs(10) - Duration::from_millis(1)));
        assert!(!c.leading(t0 + secs(10)));
        // Stepped down for good: an earlier instant does not bring it back.
        assert!(!c.leading(t0 + secs(5)));
        assert_eq!(c.renewal(t0 + secs(11), wall(11)), None);
    }

    #[test]
    fn failed_renewals_within_the_deadline_keep_the_lead() {
        let t0 = Instant::now();
        let mut c = leader(t0);
        // Attempts at 2, 4, 6 and 8 s fail (nothing is written); the lead holds.
        for s in [2, 4, 6, 8] {
            assert!(c.renewal(t0 + secs(s), wall(s as i64)).is_some());
            assert!(c.leading(t0 + secs(s) + Duration::from_millis(900)));
        }
        // The renewal at 9 s succeeds: the lead runs to 19 s.
        let write = c.renewal(t0 + secs(9), wall(9)).unwrap();
        c.wrote(
            stored(write, "2"),
            t0 + secs(9),
            t0 + secs(9) + Duration::from_millis(300),
        );
        assert!(c.leading(t0 + secs(18)));
        assert!(!c.leading(t0 + secs(19)));
    }

    #[test]
    fn a_call_that_hangs_past_the_deadline_steps_down_at_the_deadline() {
        let t0 = Instant::now();
        let mut c = leader(t0);
        // An attempt started at 8 s may last only until the lead ends at 10 s.
        assert_eq!(c.attempt_deadline(t0 + secs(8)), t0 + secs(10));
        assert_eq!(c.attempt_deadline(t0 + secs(2)), t0 + secs(7));
        assert!(!c.leading(t0 + secs(10)));
        // A standby's attempt has the attempt timeout only.
        let s = Candidate::new("b", T);
        assert_eq!(s.attempt_deadline(t0), t0 + secs(5));
    }

    #[test]
    fn the_fast_path_renews_the_version_last_written_and_keeps_acquire_time() {
        let t0 = Instant::now();
        let mut c = leader(t0);
        let Some(Write::Update { record, version }) = c.renewal(t0 + secs(2), wall(2)) else {
            panic!("renews");
        };
        assert_eq!(version, "1");
        assert_eq!(record.holder, "a");
        assert_eq!(record.acquire_time, Some(wall(0)));
        assert_eq!(record.renew_time, Some(wall(2)));
        assert_eq!(record.transitions, 0);
    }

    #[test]
    fn a_held_lease_is_left_alone_until_it_has_not_changed_for_its_duration() {
        let t0 = Instant::now();
        let mut b = Candidate::new("b", T);
        assert_eq!(b.observe(Some(held("a", "7", 0)), t0, wall(0)), None);
        assert_eq!(b.expiry(), Some(t0 + secs(15)));
        // Read again unchanged: expiry still counts from the first sight.
        assert_eq!(
            b.observe(Some(held("a", "7", 0)), t0 + secs(14), wall(14)),
            None
        );
        let Some(Write::Update { record, version }) =
            b.observe(Some(held("a", "7", 0)), t0 + secs(15), wall(15))
        else {
            panic!("takes the expired Lease");
        };
        assert_eq!(version, "7", "conditional on the version read");
        assert_eq!(record.holder, "b");
        assert_eq!(record.transitions, 4);
        assert_eq!(record.acquire_time, Some(wall(15)));
    }

    #[test]
    fn a_renewal_seen_restarts_the_expiry() {
        let t0 = Instant::now();
        let mut b = Candidate::new("b", T);
        assert_eq!(b.observe(Some(held("a", "7", 0)), t0, wall(0)), None);
        assert_eq!(
            b.observe(Some(held("a", "8", 2)), t0 + secs(10), wall(10)),
            None
        );
        assert_eq!(b.expiry(), Some(t0 + secs(25)));
        assert_eq!(
            b.observe(Some(held("a", "8", 2)), t0 + secs(24), wall(24)),
            None
        );
        assert!(
            b.observe(Some(held("a", "8", 2)), t0 + secs(25), wall(25))
                .is_some()
        );
    }

    #[test]
    fn the_times_in_the_lease_never_decide_expiry() {
        // The holder's clock is an hour behind, or ten seconds ahead: the Lease is still
        // held for its duration from when the standby saw it change.
        let t0 = Instant::now();
        for renewed_at in [-3600, 10, 3600] {
            let mut b = Candidate::new("b", T);
            assert_eq!(
                b.observe(Some(held("a", "7", renewed_at)), t0, wall(0)),
                None
            );
            assert_eq!(b.expiry(), Some(t0 + secs(15)), "{renewed_at}");
        }
    }

    #[test]
    fn the_duration_in_the_lease_is_the_holders() {
        let t0 = Instant::now();
        let mut b = Candidate::new("b", T);
        let mut long = held("a", "7", 0);
        long.record.lease_duration = secs(40);
        assert_eq!(b.observe(Some(long), t0, wall(0)), None);
        assert_eq!(b.expiry(), Some(t0 + secs(40)));
    }

    #[test]
    fn a_released_lease_is_taken_at_once() {
        let t0 = Instant::now();
        let mut b = Candidate::new("b", T);
        let mut released = held("", "9", 0);
        released.record.lease_duration = secs(1);
        let Some(Write::Update { record, version }) = b.observe(Some(released), t0, wall(0)) else {
            panic!("takes it");
        };
        assert_eq!((record.holder.as_str(), version.as_str()), ("b", "9"));
        assert_eq!(record.transitions, 4);
    }

    #[test]
    fn its_own_lease_is_taken_back_at_once() {
        // A candidate that stepped down (its renewals timed out but one was stored)
        // reads its own name: no one else can hold the Lease, it leads again.
        let t0 = Instant::now();
        let mut a = Candidate::new("a", T);
        let Some(Write::Update { record, .. }) = a.observe(Some(held("a", "7", 0)), t0, wall(0))
        else {
            panic!("renews its own");
        };
        assert_eq!(record.transitions, 3, "not a transition");
        assert_eq!(record.acquire_time, Some(wall(0)));
    }

    #[test]
    fn another_holder_read_ends_the_lead_at_once() {
        let t0 = Instant::now();
        let mut a = leader(t0);
        assert_eq!(
            a.observe(Some(held("x", "5", 0)), t0 + secs(2), wall(2)),
            None
        );
        assert!(!a.leading(t0 + secs(2)));
        let mut a = leader(t0);
        assert!(matches!(
            a.observe(None, t0 + secs(2), wall(2)),
            Some(Write::Create(_))
        ));
        assert!(
            !a.leading(t0 + secs(2)),
            "a deleted Lease ends the lead too"
        );
    }

    #[test]
    fn a_standby_attempts_again_when_the_lease_expires_if_sooner_than_a_period() {
        let t0 = Instant::now();
        let mut b = Candidate::new("b", T);
        b.observe(Some(held("a", "7", 0)), t0, wall(0));
        assert_eq!(b.next_attempt(t0 + secs(1)), t0 + secs(3));
        assert_eq!(b.next_attempt(t0 + secs(14)), t0 + secs(15));
        // Expired when the attempt started, and not taken (the write failed): a period
        // later, not in a loop.
        assert_eq!(b.next_attempt(t0 + secs(16)), t0 + secs(18));
        let mut a = leader(t0);
        assert!(a.leading(t0));
        assert_eq!(a.next_attempt(t0), t0 + secs(2));
    }

    #[test]
    fn release_empties_the_holder_of_its_own_lease_only() {
        let t0 = Instant::now();
        let a = leader(t0);
        let Some(Write::Update { record, version }) = a.release(wall(3)) else {
            panic!("releases");
        };
        assert_eq!(version, "1");
        assert_eq!(record.holder, "");
        assert_eq!(record.lease_duration, secs(1));
        let mut b = Candidate::new("b", T);
        b.observe(Some(held("a", "7", 0)), t0, wall(0));
        assert_eq!(b.release(wall(3)), None);
    }

    #[test]
    fn a_write_that_names_nobody_does_not_lead() {
        let t0 = Instant::now();
        let mut a = leader(t0);
        let write = a.release(wall(1)).unwrap();
        a.wrote(stored(write, "2"), t0 + secs(1), t0 + secs(1));
        assert!(!a.leading(t0 + secs(1)));
    }
}
