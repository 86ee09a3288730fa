//! Any FederatedMyApp the apiserver could hand the hub (its JSON, as bytes): planning
//! never panics, and each cluster's error stays that cluster's.
#![no_main]

use flotilla_crds::FederatedMyApp;
use flotilla_plan::placement::{Member, Members};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(app) = serde_json::from_slice::<FederatedMyApp>(data) else {
        return;
    };
    // Labels for override selectors and values from labels: a full set, a region
    // alone, none.
    let labels = |pairs: &[(&str, &str)]| {
        let labels = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()));
        Member::with_labels(labels.collect())
    };
    let members: Members = [
        (
            "cluster1",
            labels(&[("region", "eu"), ("floor", "3"), ("mirror", "m.eu.io")]),
        ),
        ("cluster2", labels(&[("region", "us")])),
        ("cluster3", labels(&[])),
    ]
    .into_iter()
    .map(|(c, m)| (c.into(), m))
    .collect();
    let admission = flotilla_plan::admission::Admission::default();
    let grants = flotilla_plan::grants::Grants::default();
    let planned = flotilla_plan::plan(&app, &members, &admission, &grants);
    for r in planned.clusters.values().filter_map(|p| p.rendered()) {
        // The bytes pushed to agents are JSON.
        let _ = r.to_value();
    }
});
