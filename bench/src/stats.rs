//! The arithmetic of the benchmarks, pure and tested: percentiles, a bootstrap confidence
//! interval of a percentile difference, and the verdict it supports.

/// The `p`-quantile (0 ≤ p ≤ 1) of `sorted` (ascending), by linear interpolation between
/// the closest ranks (numpy's default, "type 7"). NaN for an empty slice.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        1 => sorted[0],
        n => {
            let rank = p.clamp(0.0, 1.0) * (n - 1) as f64;
            let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

/// A sorted copy.
pub fn sorted(values: &[f64]) -> Vec<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

/// A two-sided confidence interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    pub low: f64,
    pub high: f64,
}

/// Percentile bootstrap of `percentile(ours, p) − percentile(floor, p)`: both samples
/// resampled independently with replacement `rounds` times; the interval holds the
/// central `confidence` share of the resampled differences.
pub fn bootstrap_diff(
    ours: &[f64],
    floor: &[f64],
    p: f64,
    rounds: usize,
    confidence: f64,
    seed: u64,
) -> Interval {
    if ours.is_empty() || floor.is_empty() || rounds == 0 {
        return Interval {
            low: f64::NAN,
            high: f64::NAN,
        };
    }
    // Seeded, so that a bootstrap over the same samples gives the same interval every time.
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut resample = |from: &[f64]| {
        let mut v: Vec<f64> = (0..from.len())
            .map(|_| from[rng.usize(..from.len())])
            .collect();
        v.sort_by(f64::total_cmp);
        percentile(&v, p)
    };
    let mut diffs: Vec<f64> = (0..rounds)
        .map(|_| resample(ours) - resample(floor))
        .collect();
    diffs.sort_by(f64::total_cmp);
    let tail = (1.0 - confidence) / 2.0;
    Interval {
        low: percentile(&diffs, tail),
        high: percentile(&diffs, 1.0 - tail),
    }
}

/// What an interval of "ours − floor" says about "at most `bound` above the floor".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The whole interval is at or below the bound.
    Within,
    /// The whole interval is above the bound.
    NotWithin,
    /// The interval straddles the bound: the noise is wider than the question.
    TooNoisy,
}

impl Verdict {
    pub fn of(interval: Interval, bound: f64) -> Verdict {
        if interval.high <= bound {
            Verdict::Within
        } else if interval.low > bound {
            Verdict::NotWithin
        } else {
            Verdict::TooNoisy
        }
    }

    pub fn describe(self, bound_ms: f64) -> String {
        match self {
            Verdict::Within => format!("within {bound_ms} ms"),
            Verdict::NotWithin => format!("not within {bound_ms} ms"),
            Verdict::TooNoisy => "too noisy to tell".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v: Vec<f64> = (1..=5).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 0.5), 3.0);
        assert_eq!(percentile(&v, 1.0), 5.0);
        assert_eq!(percentile(&v, 0.9), 4.6);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        assert!(percentile(&[], 0.5).is_nan());
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert!((percentile(&hundred, 0.99) - 99.01).abs() < 1e-9);
    }

    #[test]
    fn sorted_orders_ascending() {
        assert_eq!(sorted(&[3.0, 1.0, 2.0]), [1.0, 2.0, 3.0]);
    }

    #[test]
    fn the_generator_is_deterministic_and_stays_in_range() {
        // What the bootstrap relies on: one seed, one sequence.
        let (mut a, mut b) = (fastrand::Rng::with_seed(7), fastrand::Rng::with_seed(7));
        for _ in 0..1000 {
            let x = a.usize(..10);
            assert_eq!(x, b.usize(..10));
            assert!(x < 10);
        }
    }

    #[test]
    fn the_bootstrap_of_identical_constant_samples_is_a_point() {
        let v = vec![5.0; 50];
        let ci = bootstrap_diff(&v, &v, 0.99, 200, 0.95, 1);
        assert_eq!(
            ci,
            Interval {
                low: 0.0,
                high: 0.0
            }
        );
    }

    #[test]
    fn the_bootstrap_brackets_a_shift_and_is_reproducible() {
        // floor: 0..200 ms; ours: the same shifted by 30 ms.
        let floor: Vec<f64> = (0..200).map(f64::from).collect();
        let ours: Vec<f64> = floor.iter().map(|x| x + 30.0).collect();
        let ci = bootstrap_diff(&ours, &floor, 0.99, 2000, 0.95, 42);
        assert!(ci.low <= 30.0 && 30.0 <= ci.high, "{ci:?}");
        assert!(ci.low < ci.high);
        assert_eq!(ci, bootstrap_diff(&ours, &floor, 0.99, 2000, 0.95, 42));
    }

    #[test]
    fn the_bootstrap_of_nothing_is_nan() {
        let ci = bootstrap_diff(&[], &[1.0], 0.99, 10, 0.95, 1);
        assert!(ci.low.is_nan() && ci.high.is_nan());
    }

    #[test]
    fn verdicts() {
        let iv = |low, high| Interval { low, high };
        assert_eq!(Verdict::of(iv(-20.0, 9.0), 10.0), Verdict::Within);
        assert_eq!(Verdict::of(iv(-20.0, 10.0), 10.0), Verdict::Within);
        assert_eq!(Verdict::of(iv(11.0, 40.0), 10.0), Verdict::NotWithin);
        assert_eq!(Verdict::of(iv(-5.0, 25.0), 10.0), Verdict::TooNoisy);
        assert_eq!(Verdict::of(iv(f64::NAN, f64::NAN), 10.0), Verdict::TooNoisy);
        assert_eq!(Verdict::Within.describe(10.0), "within 10 ms");
        assert_eq!(Verdict::NotWithin.describe(10.0), "not within 10 ms");
        assert_eq!(Verdict::TooNoisy.describe(10.0), "too noisy to tell");
    }
}
