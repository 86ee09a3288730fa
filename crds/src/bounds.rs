//! One member cluster's share of a FederatedMyApp's `spec.autoscaling`, as the hub writes
//! it on the MyApp it renders for that cluster and the agent reads it back: the bounds
//! the member's autoscaler gets, and the cluster's share of a federation-wide metric.
//!
//! Annotations rather than MyApp fields: the MyApp schema stays the seed's, and an agent
//! that does not know them applies the MyApp as before.

use std::collections::BTreeMap;
use std::fmt;

/// `minReplicas` of the member's autoscaler.
pub const MIN_ANNOTATION: &str = "flotilla.io/autoscaling-min-replicas";
/// `maxReplicas` of the member's autoscaler.
pub const MAX_ANNOTATION: &str = "flotilla.io/autoscaling-max-replicas";
/// The cluster's share of a federation-wide metric, `parts/whole` (this cluster's maximum
/// over the sum of the maxima): a scaler whose metric is global hands its autoscaler
/// that fraction of it, so that the clusters together scale once.
pub const SHARE_ANNOTATION: &str = "flotilla.io/autoscaling-metric-share";

/// The three annotations, in the order [`Bounds::annotations`] gives them.
pub const ANNOTATIONS: [&str; 3] = [MIN_ANNOTATION, MAX_ANNOTATION, SHARE_ANNOTATION];

/// One cluster's bounds and share. `1 <= min <= max`, `0 < parts <= whole`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bounds {
    pub min: u32,
    pub max: u32,
    pub parts: u32,
    pub whole: u32,
}

impl Bounds {
    /// The fraction of a federation-wide reading that is this cluster's.
    pub fn share_of(&self, value: f64) -> f64 {
        value * f64::from(self.parts) / f64::from(self.whole)
    }

    /// The three annotations.
    pub fn annotations(&self) -> [(&'static str, String); 3] {
        let [min, max, share] = ANNOTATIONS;
        [
            (min, self.min.to_string()),
            (max, self.max.to_string()),
            (share, format!("{}/{}", self.parts, self.whole)),
        ]
    }

    /// The bounds a MyApp's annotations carry: `Ok(None)` when it carries none, an error
    /// naming the annotation when one is missing or malformed.
    pub fn of(annotations: &BTreeMap<String, String>) -> Result<Option<Bounds>, BoundsError> {
        let get = |name: &'static str| annotations.get(name).map(|v| (name, v.trim()));
        let (min, max, share) = match (
            get(MIN_ANNOTATION),
            get(MAX_ANNOTATION),
            get(SHARE_ANNOTATION),
        ) {
            (None, None, None) => return Ok(None),
            (Some(min), Some(max), Some(share)) => (min, max, share),
            _ => {
                return Err(BoundsError {
                    annotation: MIN_ANNOTATION,
                    reason: format!("needs {MAX_ANNOTATION} and {SHARE_ANNOTATION} beside it"),
                });
            }
        };
        let number = |(name, v): (&'static str, &str)| {
            v.parse::<u32>().map_err(|_| BoundsError {
                annotation: name,
                reason: format!("{v:?} is not a whole number"),
            })
        };
        let (parts, whole) = share.1.split_once('/').ok_or_else(|| BoundsError {
            annotation: SHARE_ANNOTATION,
            reason: format!("{:?} is not parts/whole", share.1),
        })?;
        let bounds = Bounds {
            min: number(min)?,
            max: number(max)?,
            parts: number((SHARE_ANNOTATION, parts))?,
            whole: number((SHARE_ANNOTATION, whole))?,
        };
        if bounds.min == 0 || bounds.min > bounds.max {
            return Err(BoundsError {
                annotation: MIN_ANNOTATION,
                reason: format!("needs 1 <= min <= max, got {}..{}", bounds.min, bounds.max),
            });
        }
        if bounds.parts == 0 || bounds.parts > bounds.whole {
            return Err(BoundsError {
                annotation: SHARE_ANNOTATION,
                reason: format!("needs 0 < parts <= whole, got {}", share.1),
            });
        }
        Ok(Some(bounds))
    }
}

impl fmt::Display for Bounds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "replicas {}..{}, metric share {}/{}",
            self.min, self.max, self.parts, self.whole
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("annotation {annotation}: {reason}")]
pub struct BoundsError {
    pub annotation: &'static str,
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn annotated(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn bounds_go_out_as_annotations_and_come_back() {
        let b = Bounds {
            min: 2,
            max: 5,
            parts: 5,
            whole: 16,
        };
        let written: BTreeMap<String, String> = b
            .annotations()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
        assert_eq!(Bounds::of(&written), Ok(Some(b)));
        assert_eq!(b.share_of(160.0), 50.0);
        assert_eq!(Bounds::of(&annotated(&[("other", "1")])), Ok(None));
    }

    #[test]
    fn broken_bounds_name_the_annotation() {
        let ok = [
            (MIN_ANNOTATION, "1"),
            (MAX_ANNOTATION, "3"),
            (SHARE_ANNOTATION, "1/3"),
        ];
        let with = |k: &str, v: &str| {
            let mut a = annotated(&ok);
            a.insert(k.to_owned(), v.to_owned());
            Bounds::of(&a).unwrap_err()
        };
        assert_eq!(with(MIN_ANNOTATION, "-1").annotation, MIN_ANNOTATION);
        assert_eq!(with(MIN_ANNOTATION, "0").annotation, MIN_ANNOTATION);
        assert_eq!(with(MIN_ANNOTATION, "4").annotation, MIN_ANNOTATION);
        assert_eq!(with(MAX_ANNOTATION, "x").annotation, MAX_ANNOTATION);
        assert_eq!(with(SHARE_ANNOTATION, "1").annotation, SHARE_ANNOTATION);
        assert_eq!(with(SHARE_ANNOTATION, "0/3").annotation, SHARE_ANNOTATION);
        assert_eq!(with(SHARE_ANNOTATION, "4/3").annotation, SHARE_ANNOTATION);
        assert_eq!(with(SHARE_ANNOTATION, "1/x").annotation, SHARE_ANNOTATION);
        let mut partial = annotated(&ok);
        partial.remove(SHARE_ANNOTATION);
        assert!(Bounds::of(&partial).is_err(), "one missing is an error");
    }
}
