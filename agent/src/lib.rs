//! The Flotilla agent, one per member cluster. Modules follow the data flow: `session`
//! talks to the hub and hands its commands to `sync`, which keeps them in a `queue` (the
//! latest wish per MyApp, retried with backoff) and writes the MyApps, never into a
//! namespace `tenancy` forbids; after the initial sync `collect` says which orphans go;
//! `report` sends their status back; `cache` holds the MyApps the agent reads.
//! `autoscale` knows which MyApps an autoscaler scales (or their Deployments),
//! `replicas` hands such replicas over to it without a reset, and `handback` gives them
//! back to the federation when it goes; `bounds` gives the autoscaler the minimum and
//! maximum the hub assigns the cluster. Beside them, `capacity` measures the cluster's
//! room for pods for the hub's scheduling, `operator` turns each MyApp into a running
//! Deployment, and `webhook` converts between MyApp versions for the apiserver. Health,
//! metrics, logs, shutdown, supervision and leader election come from `flotilla-common`,
//! shared with the hub; `run` wires them together and `cli` reads the command line.

pub mod autoscale;
pub mod bounds;
pub mod cache;
pub mod capacity;
pub mod cli;
pub mod collect;
pub mod drift;
pub mod handback;
pub mod identity;
pub mod operator;
pub mod queue;
pub mod replicas;
pub mod report;
pub mod run;
pub mod scaler;
pub mod session;
pub mod sync;
pub mod tenancy;
pub mod token;
pub mod webhook;

/// A client of an apiserver that never answers: nothing listens on a port just
/// released, so every request fails at once, as with an apiserver that is down.
#[cfg(test)]
fn unreachable_client() -> kube::Client {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = kube::Config::new(format!("https://127.0.0.1:{port}").parse().unwrap());
    kube::Client::try_from(config).unwrap()
}

/// An index of autoscalers that never lists (its watch is not run): it knows of none.
#[cfg(test)]
fn no_autoscalers() -> autoscale::Autoscalers {
    autoscale::watch(unreachable_client(), None).0
}

/// A listed cache holding managed MyApps `ns/<name>` for each of `names`.
#[cfg(test)]
fn store_of(names: &[&str]) -> cache::Stores {
    use flotilla_crds::{MANAGED_BY_LABEL, MANAGED_BY_VALUE};
    use kube::runtime::watcher::Event;
    let (store, mut writer) = kube::runtime::reflector::store();
    writer.apply_watcher_event(&Event::Init);
    for name in names {
        let app = serde_json::from_value(serde_json::json!({
            "apiVersion": "app.example.com/v1", "kind": "MyApp",
            "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                         "labels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE}},
            "spec": {"replicas": 1, "image": "nginx:1.27"},
        }))
        .unwrap();
        writer.apply_watcher_event(&Event::InitApply(app));
    }
    writer.apply_watcher_event(&Event::InitDone);
    cache::Stores::all(store)
}
