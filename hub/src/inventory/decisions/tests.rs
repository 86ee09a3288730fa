use super::*;
use flotilla_crds::federated::SchedulingReason;
use flotilla_plan::render::{RenderError, RenderedMyApp};
use flotilla_plan::schedule::{Assignment, Schedule};

fn apply() -> ClusterPlan {
    ClusterPlan::Apply(Arc::new(RenderedMyApp::default()))
}

fn app(name: &str, uid: Option<&str>) -> FederatedMyApp {
    let mut app = FederatedMyApp::new(name, Default::default());
    app.metadata.namespace = Some("shop".into());
    app.metadata.uid = uid.map(str::to_owned);
    app
}

fn clusters(n: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| (format!("c{i:03}"), "placed".into()))
        .collect()
}

fn names(slices: &[PlacementDecision]) -> Vec<String> {
    slices.iter().map(|s| s.name_any()).collect()
}

#[test]
fn chosen_are_the_placed_clusters_with_their_share_and_the_unrenderable_ones() {
    let failed = RenderError::ReplicasOverridden {
        assigned: 2,
        culprit: "overrides[0]".into(),
    };
    let plan = AppPlan {
        clusters: BTreeMap::from([
            ("a".into(), apply()),
            (
                "b".into(),
                ClusterPlan::Keep(KeepReason::RenderFailed(Box::new(failed))),
            ),
            ("c".into(), ClusterPlan::Keep(KeepReason::FailedOver)),
            ("d".into(), ClusterPlan::Keep(KeepReason::Unplanned)),
            ("e".into(), ClusterPlan::Unknown),
            ("f".into(), flotilla_plan::plan::HELD),
        ]),
        schedule: Some(Schedule {
            clusters: BTreeMap::from([(
                "a".into(),
                Assignment {
                    replicas: 3,
                    reason: SchedulingReason::Weight,
                },
            )]),
            ..Default::default()
        }),
        ..Default::default()
    };
    assert_eq!(
        chosen(&plan),
        vec![
            ("a".into(), "Weight: 3 replica(s)".into()),
            ("b".into(), "placed; its MyApp cannot be rendered".into()),
            (
                "f".into(),
                "placed; the rollout has not reached it yet".into()
            ),
        ]
    );
}

#[test]
fn a_decision_is_sliced_by_a_hundred_clusters_and_labelled_to_be_found() {
    let app = app("web", Some("0f6a-uid"));
    let slices = slices(&app, &clusters(250), "flotilla-system").unwrap();
    assert_eq!(slices.len(), 3);
    let sizes: Vec<usize> = slices.iter().map(|s| s.decisions.len()).collect();
    assert_eq!(sizes, [100, 100, 50]);
    for (i, s) in slices.iter().enumerate() {
        let labels = s.labels();
        assert_eq!(labels[DECISION_KEY_LABEL], "0f6a-uid");
        assert_eq!(labels[DECISION_INDEX_LABEL], i.to_string());
        assert_eq!(labels[PLACEMENT_KEY_LABEL], "web");
        assert_eq!(labels[MANAGED_BY_LABEL], "flotilla");
        assert_eq!(s.namespace().as_deref(), Some("shop"));
        assert_eq!(s.annotations()[SOURCE_ANNOTATION], "shop/web");
        assert_eq!(s.scheduler_name.as_deref(), Some("flotilla"));
        assert_eq!(s.owner_references()[0].uid, "0f6a-uid");
        assert!(s.name_any().starts_with("web-") && s.name_any().ends_with(&format!("-{i}")));
    }
    let first = &slices[0].decisions[0].cluster_profile_ref;
    assert_eq!(first.name.as_deref(), Some("c000"));
    assert_eq!(first.namespace.as_deref(), Some("flotilla-system"));
    assert_eq!(first.kind.as_deref(), Some("ClusterProfile"));
    assert_eq!(
        first.api_version.as_deref(),
        Some("multicluster.x-k8s.io/v1alpha1")
    );
    // Exactly 100: one slice; none: one empty slice, saying "no cluster".
    assert_eq!(slices_of(&app, 100).len(), 1);
    let empty = slices_of(&app, 0);
    assert_eq!((empty.len(), empty[0].decisions.len()), (1, 0));
}

fn slices_of(app: &FederatedMyApp, n: usize) -> Vec<PlacementDecision> {
    slices(app, &clusters(n), "ns").unwrap()
}

#[test]
fn names_stay_within_the_limit_and_never_meet_another_apps() {
    let long = "a".repeat(253);
    let s = slices_of(&app(&long, Some("u1")), 1);
    assert!(s[0].name_any().len() <= 253);
    assert!(
        !s[0].labels().contains_key(PLACEMENT_KEY_LABEL),
        "a label value is at most 63"
    );
    // "web" slice 1 and an app named like it do not collide.
    let web = names(&slices_of(&app("web", Some("u1")), 150));
    let other = names(&slices_of(&app(&web[1], Some("u2")), 1));
    assert!(!web.contains(&other[0]));
    // No uid yet: nothing to write.
    assert_eq!(slices(&app("new", None), &clusters(1), "ns"), None);
}

fn stored(mut s: PlacementDecision, uid: &str) -> Arc<PlacementDecision> {
    s.metadata.uid = Some(uid.into());
    s.metadata.resource_version = Some("9".into());
    Arc::new(s)
}

#[test]
fn work_writes_what_differs_and_deletes_slices_no_longer_wanted() {
    let app = app("web", Some("u"));
    let host: Vec<_> = slices_of(&app, 150)
        .into_iter()
        .enumerate()
        .map(|(i, s)| stored(s, &format!("s{i}")))
        .collect();
    assert_eq!(work(slices_of(&app, 150), &host), Work::default());
    // Someone else's label is no reason to write.
    let mut tagged = (*host[0]).clone();
    tagged.labels_mut().insert("team".into(), "x".into());
    let tagged = vec![Arc::new(tagged), host[1].clone()];
    assert_eq!(work(slices_of(&app, 150), &tagged), Work::default());
    // Down to 40 clusters: the first slice changes, the second goes.
    let w = work(slices_of(&app, 40), &host);
    assert_eq!(names(&w.apply), vec![host[0].name_any()]);
    assert_eq!(w.delete, vec![(host[1].name_any(), "s1".to_owned())]);
    // Nothing on the host yet: every slice.
    assert_eq!(work(slices_of(&app, 150), &[]).apply.len(), 2);
}

#[test]
fn only_the_resync_deadline_compares_every_app() {
    let start = Instant::now();
    let mut resync = Resync::after(start);
    assert_eq!(resync.wait(start, None), RESYNC);
    let retry = Duration::from_secs(2);
    assert_eq!(
        resync.wait(start, Some(retry)),
        retry,
        "a retry comes first"
    );
    for waited in [Duration::ZERO, WINDOW, RESYNC - WINDOW] {
        assert!(!resync.due(start + waited), "due after {waited:?}");
    }
    let late = start + RESYNC + WINDOW;
    assert!(resync.due(late));
    assert!(!resync.due(late), "twice in one period");
    assert_eq!(resync.wait(late, Some(RESYNC * 2)), RESYNC);
    assert_eq!(resync.wait(late + RESYNC * 2, None), Duration::ZERO);
    assert!(resync.due(late + RESYNC));
}
