//! The Flotilla hub: the effects around the pure planning core (`flotilla-plan`, which
//! places, schedules, renders and keeps the index). Modules follow the data flow:
//! `controller` (FederatedMyApp reconcile into the index through `flotilla_plan::plan`,
//! the finalizer, Events, planning passes), `dispatch` (per-agent queues over the index),
//! `auth` (tokens), `renew` (tokens renewed over the sessions before they expire), `edge` (the bounds on the gRPC port, before and after authentication),
//! `server` (the gRPC service agents dial, which reaches the host only through its `Host` trait), `serving` (its certificate, reloaded when its files change), `convert` (what the hub reads out of agents'
//! messages, bounded), `status` (the board of plans and reports, and the
//! writer of FederatedMyApp status), `membership` (MemberCluster watch, heartbeats and
//! capacity → MemberCluster status), `writes` (what both status writers share: merge
//! patches, the budget, backoff), `detail` (every cluster's status on demand: the HTTP
//! endpoint and `flotilla-hub status`), `inventory` (the cluster inventory API: a
//! ClusterProfile per MemberCluster, a PlacementDecision per app), `install` (what `join`
//! prints), `run` (wiring only, with `flotilla_common::leader` choosing the leading
//! replica), `cli`.
//!
//! Public only what the binary, the fan-out benchmark (`flotilla-bench`) and the
//! `agent_message` fuzz target (`convert`) reach.

pub mod auth;
pub mod cli;
pub mod controller;
pub mod convert;
pub mod detail;
pub mod dispatch;
pub mod edge;
pub(crate) mod install;
pub mod inventory;
pub mod membership;
pub mod planner;
pub mod renew;
pub mod run;
pub mod server;
pub mod serving;
pub mod status;
pub mod writes;
