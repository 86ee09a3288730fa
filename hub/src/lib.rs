//! The Flotilla hub. Modules follow the data flow:
//! `placement` (which clusters), `overrides` (per-cluster changes), `render` (template +
//! overrides + schema check + hash; pure), `index` (desired state per cluster; pure),
//! `dispatch` (per-agent queues over the index), `auth` (tokens), `server` (the gRPC
//! service agents dial), `status` (reports → FederatedMyApp status), `membership`
//! (MemberCluster watch and heartbeats → MemberCluster status), `controller`
//! (FederatedMyApp reconcile, finalizer, planning passes), `run` (wiring only), `cli`.

pub mod auth;
pub mod cli;
pub mod controller;
pub mod dispatch;
pub mod index;
pub mod install;
pub mod leader;
pub mod membership;
pub mod overrides;
pub mod placement;
pub mod render;
pub mod run;
pub mod server;
pub mod status;
