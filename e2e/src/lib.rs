//! Flotilla's end-to-end suite: the tests in `tests/` run against an environment of the
//! lab (`flotilla_lab`: real control planes, the hub and the agents), and use what this
//! crate adds for them:
//!
//! - [`converge`]: what every member must run (computed with the hub's own planning)
//!   against what it runs,
//! - [`deletions`]: every deletion of a managed MyApp during a test,
//! - [`faults`]: kill, replace, stop and start components; an agent behind a [`proxy`]
//!   (a link that can be cut),
//! - [`testcmd`]: `flotilla-e2e test`, the unit tests and this suite in one command.

pub mod converge;
pub mod deletions;
pub mod faults;
pub mod proxy;
pub mod testcmd;
