//! `metav1.Condition` as every Flotilla status writes it: a condition keeps its
//! `lastTransitionTime` while its status holds, so that recomputing an unchanged state
//! yields an equal status and nothing is written.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// A condition as computed at `now`.
pub fn new(
    type_: &str,
    ok: bool,
    reason: &str,
    message: impl Into<String>,
    observed_generation: Option<i64>,
    now: &Time,
) -> Condition {
    Condition {
        type_: type_.into(),
        status: if ok { "True" } else { "False" }.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: now.clone(),
        observed_generation,
    }
}

/// `c` with the transition time of the previous condition of its type, if that one had
/// the same status.
pub fn settle(mut c: Condition, previous: &[Condition]) -> Condition {
    if let Some(p) = previous
        .iter()
        .find(|p| p.type_ == c.type_ && p.status == c.status)
    {
        c.last_transition_time = p.last_transition_time.clone();
    }
    c
}

/// Whether the condition of `type_` is there and True.
pub fn is_true(conditions: &[Condition], type_: &str) -> Option<bool> {
    conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn at(s: i64) -> Time {
        Time(Timestamp::from_second(s).unwrap())
    }

    #[test]
    fn transition_time_moves_only_with_the_status() {
        let first = new("Ready", true, "Ok", "fine", Some(1), &at(10));
        let same = settle(
            new("Ready", true, "Ok", "still fine", Some(2), &at(20)),
            std::slice::from_ref(&first),
        );
        assert_eq!(same.last_transition_time, at(10));
        assert_eq!(
            (same.message.as_str(), same.observed_generation),
            ("still fine", Some(2))
        );
        let flipped = settle(new("Ready", false, "Down", "", None, &at(30)), &[same]);
        assert_eq!(flipped.last_transition_time, at(30));
        let other = settle(
            new("Propagated", false, "X", "", None, &at(40)),
            std::slice::from_ref(&flipped),
        );
        assert_eq!(other.last_transition_time, at(40));
        assert_eq!(is_true(&[flipped], "Ready"), Some(false));
        assert_eq!(is_true(&[], "Ready"), None);
    }
}
