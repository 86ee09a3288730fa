//! Flotilla's end-to-end suite: the tests in `tests/` run against an environment of the
//! lab (`flotilla_lab`: real control planes, the hub and the agents), and use what this
//! crate adds for them:
//!
//! - [`converge`]: what every member must run (computed with the hub's own planning)
//!   against what it runs,
//! - [`deletions`]: every deletion of a managed MyApp during a test,
//! - [`faults`]: kill, replace, stop and start components; an agent behind a [`proxy`]
//!   (a link that can be cut),
//! - [`testcmd`]: `flotilla-e2e test`, the unit tests and this suite in one command,
//! - [`agent_binary`]: the agent for tests that run one of their own.

pub mod converge;
pub mod deletions;
pub mod faults;
pub mod proxy;
pub mod testcmd;

/// The `flotilla-agent` binary, built once per test run so that a test never runs a
/// stale one.
pub fn agent_binary() -> &'static std::path::Path {
    static BIN: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        flotilla_lab::support::cargo_binaries(&[("flotilla-agent", "flotilla-agent")])
            .expect("building flotilla-agent")
            .remove("flotilla-agent")
            .expect("cargo names the flotilla-agent executable")
    })
}
