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
