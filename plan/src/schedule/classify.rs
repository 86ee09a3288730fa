//! Classify: how each placed cluster takes part in this division, from its readiness,
//! its cordon and what the previous division left there; and the weight and bounds its
//! first matching preference gives it.

use flotilla_crds::federated::SchedulingReason;

use super::validate::{Rules, Spread};
use super::{Inputs, MAX_PER_CLUSTER, Previous, Recheck};
use crate::placement::{ClusterName, Member};

/// How a placed cluster takes part in this division.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    Eligible,
    /// Keeps what it runs, gets nothing new.
    Frozen(SchedulingReason),
    /// NotReady past the failover grace period: its share moves, its copy is left alone.
    FailedOver,
    /// Back from a failover under `onRecovery: Stay`: gets nothing until the spec
    /// changes.
    Recovered,
}

/// One placed cluster as the division sees it.
pub(super) struct Cluster<'a> {
    pub name: &'a ClusterName,
    pub member: &'a Member,
    pub prev: Previous,
    pub state: State,
    pub weight: u64,
    pub min: u32,
    pub max: u32,
}

impl Cluster<'_> {
    /// Its group for `spreadByLabel`, if it has the label.
    pub fn group(&self, spread: &Spread) -> Option<&str> {
        spread
            .by_label
            .as_ref()
            .and_then(|l| self.member.labels.get(l))
            .map(String::as_str)
    }
}

/// Every placed cluster, in name order. A cluster NotReady within the failover grace
/// period asks to be looked at again when the period ends.
pub(super) fn classify<'a>(
    inp: &Inputs<'a>,
    rules: &Rules<'_>,
    recheck: &mut Recheck,
) -> Vec<Cluster<'a>> {
    static ABSENT: Member = Member {
        labels: std::collections::BTreeMap::new(),
        unschedulable: false,
        not_ready_for: None,
        capacity: None,
    };
    inp.placed
        .iter()
        .map(|name| {
            let member = inp.members.get(name).unwrap_or(&ABSENT);
            let prev = inp.previous.get(&**name).cloned().unwrap_or_default();
            let state = state(member, &prev, inp.spec_changed, rules, recheck);
            let pref = rules
                .prefs
                .iter()
                .find(|p| p.matches(name, member))
                .map(|p| p.raw);
            Cluster {
                name,
                member,
                prev,
                state,
                weight: pref.and_then(|p| p.weight).unwrap_or(1) as u64,
                min: pref.and_then(|p| p.min_replicas).unwrap_or(0) as u32,
                max: pref
                    .and_then(|p| p.max_replicas)
                    .map_or(MAX_PER_CLUSTER, |m| (m as u32).min(MAX_PER_CLUSTER)),
            }
        })
        .collect()
}

fn state(
    member: &Member,
    prev: &Previous,
    spec_changed: bool,
    rules: &Rules<'_>,
    recheck: &mut Recheck,
) -> State {
    let was_failed = matches!(
        prev.reason,
        Some(SchedulingReason::FailedOver | SchedulingReason::Recovered)
    );
    let failover = rules.failover;
    let stay = failover.is_some_and(|f| f.stay);
    match member.not_ready_for {
        Some(down) if failover.is_some_and(|f| down >= f.grace) => State::FailedOver,
        _ if was_failed && stay && !spec_changed => State::Recovered,
        _ if member.unschedulable => State::Frozen(SchedulingReason::Cordoned),
        // Duplicated stays as it always was: a NotReady cluster is rendered for.
        Some(_) if rules.strategy.is_none() => State::Eligible,
        Some(down) => {
            if let Some(f) = failover {
                recheck.within(f.grace - down);
            }
            State::Frozen(SchedulingReason::NotReady)
        }
        None => State::Eligible,
    }
}
