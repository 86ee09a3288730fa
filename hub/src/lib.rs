//! The Flotilla hub. Modules follow the data flow:
//! `placement` (which clusters), `schedule` (how many replicas each), `overrides`
//! (per-cluster changes), `render` (template + schedule + overrides + schema check +
//! hash; pure), `index` (desired state per cluster; pure), `dispatch` (per-agent queues
//! over the index), `auth` (tokens), `server` (the gRPC service agents dial), `status`
//! (reports → FederatedMyApp status), `membership` (MemberCluster watch, heartbeats and
//! capacity → MemberCluster status), `controller` (FederatedMyApp reconcile, finalizer,
//! planning passes), `install` (what `join` prints), `run` (wiring only, with
//! `flotilla_common::leader` choosing the leading replica), `cli`.

pub mod auth;
pub mod cli;
pub mod controller;
pub mod dispatch;
pub mod index;
pub mod install;
pub mod membership;
pub mod overrides;
pub mod placement;
pub mod render;
pub mod run;
pub mod schedule;
pub mod server;
pub mod status;
