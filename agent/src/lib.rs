//! The Flotilla agent, one per member cluster. Modules follow the data flow: `session`
//! talks to the hub and `sync` writes the MyApps it receives; `operator` turns each MyApp
//! into a running Deployment; `report` sends their status back; `webhook` converts
//! between MyApp versions for the apiserver. `metrics`, `telemetry`, `http` and
//! `shutdown` serve them all; `cli` wires them together.

pub mod cli;
pub mod http;
pub mod metrics;
pub mod operator;
pub mod report;
pub mod session;
pub mod shutdown;
pub mod sync;
pub mod telemetry;
pub mod webhook;
