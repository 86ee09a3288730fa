//! The MyApp status, computed from its Deployment and from what stopped the operator.
//! Pure: the reconciler passes the clock in.

use std::collections::BTreeMap;

use flotilla_crds::{MyApp, MyAppStatus};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use super::children;

pub const AVAILABLE: &str = "Available";
pub const PROGRESSING: &str = "Progressing";
pub const DEGRADED: &str = "Degraded";
/// The summary condition tools such as kstatus and `kubectl wait --for=condition=Ready`
/// read; it agrees with `status.ready`.
pub const READY: &str = "Ready";

/// Longest condition message written; apiserver errors can be long.
const MAX_MESSAGE: usize = 1024;

/// Something that keeps the operator from running the MyApp as specified. Each one is
/// reported as `Degraded=True` with its reason, and as a Warning Event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    /// `spec.image` is absent: no Deployment is created (an existing one is left as is).
    ImageMissing,
    /// The apiserver rejected a child built from the spec (e.g. a name too long for a
    /// label, `maxSurge` and `maxUnavailable` both 0). Counted as a reconcile error and
    /// retried every few seconds until the apiserver accepts it.
    InvalidSpec(String),
    /// A ConfigMap or Deployment of the child's name exists that this MyApp does not
    /// control (no controller owner reference to its UID): it is someone else's, and
    /// is left untouched, never adopted (adopting it would also let the garbage
    /// collector delete it with the MyApp).
    NotOwned { kind: &'static str, name: String },
}

impl Problem {
    pub fn reason(&self) -> &'static str {
        match self {
            Problem::ImageMissing => "ImageMissing",
            Problem::InvalidSpec(_) => "InvalidSpec",
            Problem::NotOwned { .. } => "NotOwned",
        }
    }

    pub fn message(&self) -> String {
        match self {
            Problem::ImageMissing => {
                "spec.image is not set: no Deployment is created until the MyApp names an image"
                    .into()
            }
            Problem::InvalidSpec(why) => format!("the apiserver rejected a child object: {why}"),
            Problem::NotOwned { kind, name } => format!(
                "{kind} {name} exists and is not controlled by this MyApp: it is left untouched; delete or rename it, or rename the MyApp"
            ),
        }
    }
}

/// Ready means the Deployment has observed its latest spec and every desired replica is
/// updated and available, with no old replica left.
pub fn deployment_ready(d: &Deployment) -> bool {
    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let Some(st) = &d.status else { return false };
    deployment_observed(d)
        && st.updated_replicas.unwrap_or(0) == want
        && st.replicas.unwrap_or(0) == want
        && st.available_replicas.unwrap_or(0) == want
}

fn deployment_observed(d: &Deployment) -> bool {
    let observed = d.status.as_ref().and_then(|s| s.observed_generation);
    matches!((observed, d.metadata.generation), (Some(o), Some(g)) if o >= g)
}

/// One condition as computed, before its transition time is settled.
struct Cond {
    type_: &'static str,
    status: String,
    reason: String,
    message: String,
}

fn cond(type_: &'static str, status: &str, reason: &str, message: impl Into<String>) -> Cond {
    Cond {
        type_,
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
    }
}

fn deployment_condition(d: &Deployment, type_: &'static str) -> Option<Cond> {
    let conditions = d.status.as_ref()?.conditions.as_ref()?;
    let c = conditions.iter().find(|c| c.type_ == type_)?;
    let reason = c
        .reason
        .clone()
        .unwrap_or_else(|| format!("Deployment{type_}"));
    Some(cond(
        type_,
        &c.status,
        &reason,
        c.message.clone().unwrap_or_default(),
    ))
}

fn available(deployment: Option<&Deployment>, problem: Option<&Problem>) -> Cond {
    match (deployment, problem) {
        (Some(d), _) => deployment_condition(d, AVAILABLE).unwrap_or_else(|| {
            cond(
                AVAILABLE,
                "Unknown",
                "DeploymentPending",
                "the Deployment reports no availability yet",
            )
        }),
        (None, Some(p)) => cond(AVAILABLE, "False", p.reason(), p.message()),
        (None, None) => cond(
            AVAILABLE,
            "Unknown",
            "DeploymentPending",
            "the Deployment does not exist yet",
        ),
    }
}

fn progressing(deployment: Option<&Deployment>, problem: Option<&Problem>) -> Cond {
    match (deployment, problem) {
        (Some(d), _) if !deployment_observed(d) => cond(
            PROGRESSING,
            "True",
            "RolloutPending",
            format!(
                "the Deployment has not yet observed generation {}",
                d.metadata.generation.unwrap_or(0)
            ),
        ),
        (Some(d), _) => deployment_condition(d, PROGRESSING).unwrap_or_else(|| {
            cond(
                PROGRESSING,
                "Unknown",
                "DeploymentPending",
                "the Deployment reports no progress yet",
            )
        }),
        (None, Some(p)) => cond(PROGRESSING, "False", p.reason(), p.message()),
        (None, None) => cond(
            PROGRESSING,
            "Unknown",
            "DeploymentPending",
            "the Deployment does not exist yet",
        ),
    }
}

fn degraded(deployment: Option<&Deployment>, problem: Option<&Problem>) -> Cond {
    if let Some(p) = problem {
        return cond(DEGRADED, "True", p.reason(), p.message());
    }
    if let Some(d) = deployment {
        if let Some(failure) =
            deployment_condition(d, "ReplicaFailure").filter(|c| c.status == "True")
        {
            return cond(DEGRADED, "True", &failure.reason, failure.message);
        }
        if let Some(stuck) = deployment_condition(d, PROGRESSING)
            .filter(|c| c.status == "False" && c.reason == "ProgressDeadlineExceeded")
        {
            return cond(DEGRADED, "True", &stuck.reason, stuck.message);
        }
    }
    cond(DEGRADED, "False", "AsExpected", "")
}

fn ready(deployment: Option<&Deployment>, problem: Option<&Problem>) -> Cond {
    match (deployment, problem) {
        (_, Some(p)) => cond(READY, "False", p.reason(), p.message()),
        (None, None) => cond(
            READY,
            "False",
            "DeploymentPending",
            "the Deployment does not exist yet",
        ),
        (Some(d), None) if deployment_ready(d) => cond(
            READY,
            "True",
            "Ready",
            "every replica is updated and available",
        ),
        (Some(_), None) => cond(
            READY,
            "False",
            "RolloutInProgress",
            "the Deployment's replicas are not all updated and available yet",
        ),
    }
}

fn truncate(mut message: String) -> String {
    if message.len() > MAX_MESSAGE {
        let mut end = MAX_MESSAGE;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
    }
    message
}

/// The status the MyApp should have. A condition keeps its `lastTransitionTime` while its
/// status does not change, so recomputing an unchanged state yields an equal status and
/// the reconciler writes nothing.
pub fn compute(
    app: &MyApp,
    deployment: Option<&Deployment>,
    problem: Option<&Problem>,
    now: Timestamp,
) -> MyAppStatus {
    let previous = app
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    let generation = app.metadata.generation;
    let conditions = [
        ready(deployment, problem),
        available(deployment, problem),
        progressing(deployment, problem),
        degraded(deployment, problem),
    ]
    .into_iter()
    .map(|c| {
        let computed = Condition {
            type_: c.type_.into(),
            status: c.status,
            reason: c.reason,
            message: truncate(c.message),
            observed_generation: generation,
            last_transition_time: Time(now),
        };
        flotilla_crds::condition::settle(computed, previous)
    })
    .collect();
    MyAppStatus {
        ready: problem.is_none() && deployment.is_some_and(deployment_ready),
        ready_replicas: deployment
            .and_then(|d| d.status.as_ref()?.ready_replicas)
            .unwrap_or(0),
        replicas: Some(
            deployment
                .and_then(|d| d.status.as_ref()?.replicas)
                .unwrap_or(0),
        ),
        selector: Some(label_query(&children::selector_labels(&app.name_any()))),
        observed_generation: generation,
        conditions,
    }
}

/// Labels as the label query an autoscaler reads from `/scale` (`a=b,c=d`, sorted).
fn label_query(labels: &BTreeMap<String, String>) -> String {
    let pairs: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    pairs.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_crds::MyAppSpec;
    use k8s_openapi::api::apps::v1::{DeploymentCondition, DeploymentSpec, DeploymentStatus};

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(seconds).unwrap()
    }

    fn app(generation: i64) -> MyApp {
        let mut app = MyApp::new("web", MyAppSpec::default());
        app.metadata.generation = Some(generation);
        app
    }

    fn dcond(type_: &str, status: &str, reason: &str) -> DeploymentCondition {
        DeploymentCondition {
            type_: type_.into(),
            status: status.into(),
            reason: Some(reason.into()),
            message: Some(format!("{type_} is {status}")),
            ..DeploymentCondition::default()
        }
    }

    /// A Deployment wanting `want` replicas at generation 2, whose controller observed
    /// generation `observed` and counts `updated`/`total`/`available`/`ready` replicas.
    fn deployment(
        want: i32,
        observed: i64,
        [updated, total, available, ready]: [i32; 4],
    ) -> Deployment {
        Deployment {
            metadata: kube::api::ObjectMeta {
                generation: Some(2),
                ..Default::default()
            },
            spec: Some(DeploymentSpec {
                replicas: Some(want),
                ..DeploymentSpec::default()
            }),
            status: Some(DeploymentStatus {
                observed_generation: Some(observed),
                updated_replicas: Some(updated),
                replicas: Some(total),
                available_replicas: Some(available),
                ready_replicas: Some(ready),
                conditions: Some(vec![
                    dcond("Available", "True", "MinimumReplicasAvailable"),
                    dcond("Progressing", "True", "NewReplicaSetAvailable"),
                ]),
                ..DeploymentStatus::default()
            }),
        }
    }

    fn get<'a>(s: &'a MyAppStatus, type_: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == type_).unwrap()
    }

    #[test]
    fn ready_when_every_replica_is_updated_and_available() {
        let d = deployment(3, 2, [3, 3, 3, 3]);
        let s = compute(&app(5), Some(&d), None, at(10));
        assert!(s.ready);
        assert_eq!(s.ready_replicas, 3);
        assert_eq!(s.observed_generation, Some(5));
        assert_eq!(get(&s, AVAILABLE).status, "True");
        assert_eq!(get(&s, AVAILABLE).reason, "MinimumReplicasAvailable");
        assert_eq!(get(&s, PROGRESSING).reason, "NewReplicaSetAvailable");
        assert_eq!(get(&s, DEGRADED).status, "False");
        assert!(
            s.conditions
                .iter()
                .all(|c| c.observed_generation == Some(5))
        );
    }

    /// What `/scale` reads: the Deployment's pods, and their selector as a label query
    /// (present before any Deployment, since it depends on the name only).
    #[test]
    fn status_carries_the_pods_and_their_selector_for_scale() {
        let d = deployment(3, 2, [3, 4, 3, 3]);
        let s = compute(&app(2), Some(&d), None, at(10));
        assert_eq!(s.replicas, Some(4));
        assert_eq!(
            s.selector.as_deref(),
            Some("app.kubernetes.io/instance=web,app.kubernetes.io/name=myapp")
        );
        let none = compute(&app(2), None, Some(&Problem::ImageMissing), at(10));
        assert_eq!((none.replicas, none.selector), (Some(0), s.selector));
    }

    #[test]
    fn not_ready_until_the_latest_generation_is_observed() {
        let d = deployment(3, 1, [3, 3, 3, 3]);
        let s = compute(&app(1), Some(&d), None, at(10));
        assert!(!s.ready);
        assert_eq!(get(&s, PROGRESSING).reason, "RolloutPending");
        assert_eq!(get(&s, PROGRESSING).status, "True");
    }

    #[test]
    fn not_ready_while_replicas_are_short_old_or_unavailable() {
        for counts in [
            [2, 3, 3, 3], // one replica not updated yet
            [3, 4, 3, 3], // an old replica still around
            [3, 3, 2, 2], // one replica not available
            [0, 0, 0, 0], // nothing yet
        ] {
            let d = deployment(3, 2, counts);
            let s = compute(&app(1), Some(&d), None, at(10));
            assert!(!s.ready, "{counts:?}");
            assert_eq!(s.ready_replicas, counts[3]);
        }
        let no_status = Deployment {
            status: None,
            ..deployment(3, 2, [3, 3, 3, 3])
        };
        let s = compute(&app(1), Some(&no_status), None, at(10));
        assert!(!s.ready);
        assert_eq!(s.ready_replicas, 0);
        assert_eq!(get(&s, AVAILABLE).status, "Unknown");
        assert_eq!(get(&s, PROGRESSING).reason, "RolloutPending");
    }

    #[test]
    fn image_missing_without_deployment() {
        let s = compute(&app(1), None, Some(&Problem::ImageMissing), at(10));
        assert!(!s.ready);
        assert_eq!(s.ready_replicas, 0);
        for type_ in [AVAILABLE, PROGRESSING] {
            assert_eq!(get(&s, type_).status, "False");
            assert_eq!(get(&s, type_).reason, "ImageMissing");
        }
        assert_eq!(get(&s, DEGRADED).status, "True");
        assert_eq!(get(&s, DEGRADED).reason, "ImageMissing");
        assert!(get(&s, DEGRADED).message.contains("spec.image"));
    }

    #[test]
    fn a_problem_is_never_ready_even_with_a_healthy_old_deployment() {
        let d = deployment(3, 2, [3, 3, 3, 3]);
        let s = compute(&app(3), Some(&d), Some(&Problem::ImageMissing), at(10));
        assert!(!s.ready);
        assert_eq!(s.ready_replicas, 3, "readyReplicas still tells the truth");
        assert_eq!(get(&s, AVAILABLE).status, "True");
        assert_eq!(get(&s, DEGRADED).reason, "ImageMissing");
    }

    #[test]
    fn invalid_spec_is_degraded_with_the_apiserver_message() {
        let p = Problem::InvalidSpec("spec.strategy: may not be 0 when maxSurge is 0".into());
        let s = compute(&app(1), None, Some(&p), at(10));
        assert_eq!(get(&s, DEGRADED).reason, "InvalidSpec");
        assert!(get(&s, DEGRADED).message.contains("may not be 0"));
    }

    #[test]
    fn replica_failure_and_deadline_make_degraded() {
        let mut d = deployment(3, 2, [1, 1, 1, 1]);
        d.status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()
            .push(dcond("ReplicaFailure", "True", "FailedCreate"));
        let s = compute(&app(1), Some(&d), None, at(10));
        assert_eq!(
            (
                get(&s, DEGRADED).status.as_str(),
                get(&s, DEGRADED).reason.as_str()
            ),
            ("True", "FailedCreate")
        );

        let mut d = deployment(3, 2, [1, 1, 1, 1]);
        d.status.as_mut().unwrap().conditions = Some(vec![
            dcond("Available", "False", "MinimumReplicasUnavailable"),
            dcond("Progressing", "False", "ProgressDeadlineExceeded"),
        ]);
        let s = compute(&app(1), Some(&d), None, at(10));
        assert_eq!(get(&s, DEGRADED).reason, "ProgressDeadlineExceeded");
        assert_eq!(get(&s, AVAILABLE).reason, "MinimumReplicasUnavailable");
        assert_eq!(get(&s, PROGRESSING).status, "False");
    }

    #[test]
    fn recomputing_an_unchanged_state_changes_nothing() {
        let d = deployment(3, 2, [3, 3, 3, 3]);
        let mut a = app(1);
        a.status = Some(compute(&a, Some(&d), None, at(10)));
        let again = compute(&a, Some(&d), None, at(99));
        assert_eq!(Some(&again), a.status.as_ref());
    }

    #[test]
    fn transition_time_moves_only_with_the_status() {
        let mut a = app(1);
        a.status = Some(compute(
            &a,
            Some(&deployment(3, 2, [3, 3, 3, 3])),
            None,
            at(10),
        ));
        let mut d = deployment(3, 2, [3, 3, 2, 2]);
        d.status.as_mut().unwrap().conditions = Some(vec![
            dcond("Available", "False", "MinimumReplicasUnavailable"),
            dcond("Progressing", "True", "ReplicaSetUpdated"),
        ]);
        let s = compute(&a, Some(&d), None, at(20));
        assert_eq!(get(&s, AVAILABLE).last_transition_time, Time(at(20)));
        assert_eq!(
            get(&s, PROGRESSING).last_transition_time,
            Time(at(10)),
            "still True"
        );
        assert_eq!(
            get(&s, DEGRADED).last_transition_time,
            Time(at(10)),
            "still False"
        );
    }

    #[test]
    fn the_ready_condition_agrees_with_status_ready_in_every_case() {
        let problems = [
            None,
            Some(Problem::ImageMissing),
            Some(Problem::InvalidSpec("no".into())),
        ];
        let mut deployments = vec![None];
        for observed in [1, 2] {
            for counts in [
                [3, 3, 3, 3],
                [2, 3, 3, 3],
                [3, 4, 3, 3],
                [3, 3, 2, 2],
                [0; 4],
            ] {
                deployments.push(Some(deployment(3, observed, counts)));
            }
        }
        let (mut ready, mut not_ready) = (0, 0);
        for p in &problems {
            for d in &deployments {
                let s = compute(&app(2), d.as_ref(), p.as_ref(), at(10));
                let c = get(&s, READY);
                assert_eq!(c.status == "True", s.ready, "{p:?} {d:?}");
                assert_eq!(c.observed_generation, Some(2));
                if let Some(p) = p {
                    assert_eq!(c.reason, p.reason());
                }
                if s.ready { ready += 1 } else { not_ready += 1 }
            }
        }
        assert_eq!(
            (ready, not_ready),
            (1, 32),
            "only a clean, finished rollout is ready"
        );
    }

    #[test]
    fn long_messages_are_truncated_on_a_char_boundary() {
        let p = Problem::InvalidSpec("é".repeat(2000));
        let s = compute(&app(1), None, Some(&p), at(10));
        let m = &get(&s, DEGRADED).message;
        assert!(m.len() <= MAX_MESSAGE && m.len() > MAX_MESSAGE - 4);
    }
}
