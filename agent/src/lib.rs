//! The Flotilla agent, one per member cluster. Modules follow the data flow: `session`
//! talks to the hub and `sync` writes the MyApps it receives; `capacity` measures the
//! cluster's room for pods for the hub's scheduling; `operator` turns each MyApp
//! into a running Deployment; `report` sends their status back; `webhook` converts
//! between MyApp versions for the apiserver. Health, metrics, logs and shutdown come from
//! `flotilla-common`, shared with the hub; `cli` wires them together.

pub mod capacity;
pub mod cli;
pub mod operator;
pub mod report;
pub mod session;
pub mod sync;
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
