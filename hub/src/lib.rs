//! The Flotilla hub. Modules follow the data flow: `placement` (which clusters),
//! `schedule` (how many replicas each), `overrides` (per-cluster changes), `render`
//! (template + schedule + overrides + schema + hash).

pub mod cli;
pub mod controller;
pub mod dispatch;
pub mod index;
pub mod membership;
pub mod overrides;
pub mod placement;
pub mod render;
pub mod run;
pub mod schedule;
pub mod server;
pub mod status;
