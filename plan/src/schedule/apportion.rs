//! Apportion: dividing a number of replicas among slots in proportion to their weights,
//! within each slot's bounds. Pure maths: it knows no API type.
//!
//! [`divide`] works in exact rationals (u128 numerators over the sum of weights, no
//! floating point): quotas that leave their bounds are clamped (water-filling), the rest
//! is shared in proportion and rounded by largest remainder, leaning towards the
//! previous division. [`hysteresis`] is the disruption policy's band: it keeps the
//! previous division while the new one is close to it.

/// One cluster's input to [`divide`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub weight: u64,
    pub min: u32,
    pub max: u32,
    /// What it had: rounding leans towards it.
    pub prev: u32,
}

impl Slot {
    /// A slot that takes nothing.
    pub const NONE: Slot = Slot {
        weight: 0,
        min: 0,
        max: 0,
        prev: 0,
    };

    /// The most it can take: its minimum with weight 0 (it shares nothing), else its
    /// maximum (never below its minimum).
    fn high(&self) -> u32 {
        if self.weight == 0 {
            self.min
        } else {
            self.max.max(self.min)
        }
    }
}

/// The total lies outside what the slots can take between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Infeasible {
    pub min_sum: u64,
    pub max_sum: u64,
}

/// Divides `total` among `slots` in proportion to their weights within `[min, max]`:
/// each quota is clamped to its bounds and the rest shared in proportion (exact
/// rationals), then rounded by largest remainder so that every share is its quota
/// rounded down or up. Among those roundings it picks the one closest to `prev`, then
/// the one that changes the fewest shares, then larger remainders, then earlier slots.
/// A slot with weight 0 gets its minimum.
pub fn divide(total: u32, slots: &[Slot]) -> Result<Vec<u32>, Infeasible> {
    let min_sum: u64 = slots.iter().map(|s| s.min as u64).sum();
    let max_sum: u64 = slots.iter().map(|s| s.high() as u64).sum();
    if (total as u64) < min_sum || (total as u64) > max_sum {
        return Err(Infeasible { min_sum, max_sum });
    }
    let Fill {
        fixed,
        rest,
        weights,
    } = water_fill(total, slots);
    let mut out: Vec<u32> = fixed.iter().map(|f| f.unwrap_or(0)).collect();
    let free: Vec<usize> = (0..slots.len()).filter(|i| fixed[*i].is_none()).collect();
    if weights == 0 {
        // Only zero weights are left: their minimum, which feasibility made the rest.
        for &i in &free {
            out[i] = slots[i].min;
        }
        return Ok(out);
    }
    round(&mut out, &free, slots, rest, weights);
    Ok(out)
}

/// The slots whose share is fixed at a bound, and what is left for the others: `rest`
/// replicas over `weights`, the sum of their weights.
struct Fill {
    fixed: Vec<Option<u32>>,
    rest: u128,
    weights: u128,
}

/// Water-filling: fix the slots whose proportional quota leaves their bounds, on the
/// side that is violated more, until the rest fit.
fn water_fill(total: u32, slots: &[Slot]) -> Fill {
    let n = slots.len();
    let mut fixed: Vec<Option<u32>> = vec![None; n];
    loop {
        let free: Vec<usize> = (0..n).filter(|i| fixed[*i].is_none()).collect();
        let rest = total as u128 - fixed.iter().flatten().map(|v| *v as u128).sum::<u128>();
        let weights: u128 = free.iter().map(|i| slots[*i].weight as u128).sum();
        if free.is_empty() || weights == 0 {
            return Fill {
                fixed,
                rest,
                weights,
            };
        }
        // Quota of i is rest * w_i / weights; compare numerators over `weights`.
        let num = |i: usize| rest * slots[i].weight as u128;
        let (mut excess, mut deficit) = (0u128, 0u128);
        for &i in &free {
            let (lo, up) = (
                slots[i].min as u128 * weights,
                slots[i].high() as u128 * weights,
            );
            excess += num(i).saturating_sub(up);
            deficit += lo.saturating_sub(num(i));
        }
        if excess == 0 && deficit == 0 {
            return Fill {
                fixed,
                rest,
                weights,
            };
        }
        for &i in &free {
            if excess >= deficit && num(i) > slots[i].high() as u128 * weights {
                fixed[i] = Some(slots[i].high());
            } else if excess < deficit && num(i) < slots[i].min as u128 * weights {
                fixed[i] = Some(slots[i].min);
            }
        }
    }
}

/// Largest remainder: each free slot gets its quota rounded down, and the replicas left
/// go one each to the slots whose previous share is above that; then, once something
/// runs, to the slots whose share grows anyway (a cluster that joins with a quota of one
/// or more), so that as few shares change as can; then to the larger remainders, then
/// to the earlier slots. Without the second rule a cluster joining could hand a
/// replica to another that only came first in a tie ([5, 5, 0, 0] of weights
/// [9, 9, 1, 1] became [3, 3, 1, 0, 3] when a cluster of weight 10 joined) or had a
/// larger remainder ([3, 3, 0, 0] of weights [5, 5, 1, 1] became [2, 2, 1, 0, 1] when
/// a cluster of weight 3 joined).
fn round(out: &mut [u32], free: &[usize], slots: &[Slot], rest: u128, weights: u128) {
    let mut remainders = Vec::new();
    let mut handed = 0u128;
    for &i in free {
        let num = rest * slots[i].weight as u128;
        out[i] = (num / weights) as u32;
        handed += num / weights;
        if !num.is_multiple_of(weights) {
            remainders.push((i, num % weights));
        }
    }
    let ups = (rest - handed) as usize;
    // Nothing runs yet: every share grows, and the remainders alone decide.
    let runs = slots.iter().any(|s| s.prev > 0);
    remainders.sort_by(|(a, ra), (b, rb)| {
        let toward = |i: usize| slots[i].prev > out[i];
        let growing = |i: usize| runs && out[i] > slots[i].prev;
        toward(*b)
            .cmp(&toward(*a))
            .then(growing(*b).cmp(&growing(*a)))
            .then(rb.cmp(ra))
            .then(a.cmp(b))
    });
    for (i, _) in remainders.into_iter().take(ups) {
        out[i] += 1;
    }
}

/// How far (in replicas) a share may be from its new quota and its new rounding before
/// [`hysteresis`] lets a division of `total` move: one replica and a tenth of the total.
pub fn hysteresis_band(total: u32) -> f64 {
    1.0 + f64::from(total) / 10.0
}

/// Keeps the previous division (each slot's `prev`) while it is still valid (it sums to
/// `total` within every slot's bounds) and no share is off its new quota, nor off
/// `target`, by more than the [`hysteresis_band`]; else `target`.
pub fn hysteresis(total: u32, slots: &[Slot], target: Vec<u32>) -> Vec<u32> {
    let prev_sum: u64 = slots.iter().map(|s| s.prev as u64).sum();
    let valid = prev_sum == total as u64
        && slots
            .iter()
            .all(|s| s.prev >= s.min && s.prev <= s.max && (s.weight > 0 || s.prev == s.min));
    if !valid {
        return target;
    }
    let band = hysteresis_band(total);
    let weights: f64 = slots.iter().map(|s| s.weight as f64).sum();
    let close = slots.iter().zip(&target).all(|(s, t)| {
        // Both the new rounding and the raw quota must be near what runs.
        let quota = if weights > 0.0 {
            f64::from(total) * s.weight as f64 / weights
        } else {
            0.0
        };
        (f64::from(s.prev) - f64::from(*t)).abs() <= band
            && (f64::from(s.prev) - quota).abs() <= band
    });
    if close {
        slots.iter().map(|s| s.prev).collect()
    } else {
        target
    }
}
