//! Any FederatedMyApp the apiserver could hand the hub (its JSON, as bytes): planning
//! never panics, and each cluster's error stays that cluster's.
#![no_main]

use flotilla_crds::FederatedMyApp;
use flotilla_plan::placement::Members;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(app) = serde_json::from_slice::<FederatedMyApp>(data) else {
        return;
    };
    let members: Members = ["cluster1", "cluster2", "cluster3"]
        .into_iter()
        .map(|c| (c.to_owned(), Default::default()))
        .collect();
    let admission = flotilla_plan::admission::Admission::default();
    let planned = flotilla_plan::plan(&app, &members, &admission);
    for r in planned.clusters.values().filter_map(|p| p.rendered()) {
        // The bytes pushed to agents are JSON.
        let _ = r.to_value();
    }
});
