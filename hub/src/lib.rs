//! The Flotilla hub. Modules follow the data flow: `placement` (which clusters),
//! `overrides` (per-cluster changes), `render` (template + overrides + schema + hash).

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
