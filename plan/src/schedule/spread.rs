//! Spread: which clusters may run replicas, and which must run one. Clusters already
//! running the app come first, then higher score, then name; one per group first until
//! `minGroups` groups are covered; at most `maxClusters`.

use std::collections::BTreeSet;

use super::validate::Spread;
use super::{SPREAD, ScheduleError, err};
use crate::placement::ClusterName;

/// A cluster spread may choose.
pub(super) struct Candidate<'a> {
    pub name: &'a ClusterName,
    /// Frozen with replicas: always kept, first.
    pub fixed: bool,
    pub had: bool,
    pub score: u64,
    pub group: Option<&'a str>,
}

pub(super) struct Chosen {
    /// Indexes into the candidates, in the order they were chosen.
    pub order: Vec<usize>,
    /// Those that must run at least one replica.
    pub required: Vec<usize>,
}

pub(super) fn select(
    candidates: &[Candidate<'_>],
    spread: &Spread,
) -> Result<Chosen, ScheduleError> {
    let ranked = rank(candidates);
    let representatives = cover_groups(candidates, &ranked, spread)?;
    let fixed = candidates.iter().filter(|c| c.fixed).count();
    let limit = spread.max_clusters.map_or(usize::MAX, |m| m.max(fixed));
    if representatives.len() > limit {
        return Err(err(
            format!("{SPREAD}.maxClusters"),
            format!(
                "{} clusters cannot cover minGroups {}",
                limit, spread.min_groups
            ),
        ));
    }
    let mut order = representatives.clone();
    for &i in &ranked {
        if !order.contains(&i) && (order.len() < limit || candidates[i].fixed) {
            order.push(i);
        }
    }
    if order.len() < spread.min_clusters {
        return Err(err(
            format!("{SPREAD}.minClusters"),
            format!(
                "{} clusters needed, {} can take replicas",
                spread.min_clusters,
                order.len()
            ),
        ));
    }
    let mut required = representatives;
    for &i in &order {
        if required.len() >= spread.min_clusters {
            break;
        }
        if !required.contains(&i) {
            required.push(i);
        }
    }
    Ok(Chosen { order, required })
}

/// Candidates in order of preference: fixed, then already running, then score, then name.
fn rank(candidates: &[Candidate<'_>]) -> Vec<usize> {
    let mut ranked: Vec<usize> = (0..candidates.len()).collect();
    ranked.sort_by(|a, b| {
        let (a, b) = (&candidates[*a], &candidates[*b]);
        (b.fixed, b.had, b.score)
            .cmp(&(a.fixed, a.had, a.score))
            .then_with(|| a.name.cmp(b.name))
    });
    ranked
}

/// The best-ranked cluster of each group, until `minGroups` groups are covered.
fn cover_groups(
    candidates: &[Candidate<'_>],
    ranked: &[usize],
    spread: &Spread,
) -> Result<Vec<usize>, ScheduleError> {
    let mut order: Vec<usize> = Vec::new();
    if spread.min_groups == 0 {
        return Ok(order);
    }
    let mut groups: BTreeSet<&str> = BTreeSet::new();
    for &i in ranked {
        if groups.len() >= spread.min_groups {
            break;
        }
        if let Some(g) = candidates[i].group.filter(|g| !groups.contains(g)) {
            groups.insert(g);
            order.push(i);
        }
    }
    if groups.len() < spread.min_groups {
        return Err(err(
            format!("{SPREAD}.minGroups"),
            format!(
                "{} groups needed, the schedulable clusters form {} by label {}",
                spread.min_groups,
                groups.len(),
                spread.by_label.as_deref().unwrap_or_default()
            ),
        ));
    }
    Ok(order)
}
