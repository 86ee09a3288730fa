//! The hub's administrative commands as an operator runs them: `flotilla-hub certs`,
//! `join` and `revoke`, against the host cluster of the environment.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::support::stdout_of;

/// The `flotilla-hub` binary, pointed at a host kubeconfig.
#[derive(Debug, Clone)]
pub struct HubCli {
    pub program: PathBuf,
    pub kubeconfig: PathBuf,
}

impl HubCli {
    /// Runs `flotilla-hub ARGS`; fails with its stderr unless it succeeds.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        let mut cmd = Command::new(&self.program);
        cmd.args(args).env("KUBECONFIG", &self.kubeconfig);
        let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
        stdout_of(format_args!("`flotilla-hub {}`", args.join(" ")), out)
    }

    /// A private CA and the hub's serving certificate into `dir` (ca.crt, tls.crt, tls.key).
    pub fn certs(&self, dir: &Path) -> Result<()> {
        self.run(&["certs", "--out", &dir.to_string_lossy()])
            .map(drop)
    }

    /// Registers `cluster` (a MemberCluster with `labels`) and writes its token to `token_file`.
    pub fn join(&self, cluster: &str, labels: &[(&str, &str)], token_file: &Path) -> Result<()> {
        let mut args = vec!["join".to_string(), cluster.to_string()];
        for (k, v) in labels {
            args.extend(["--label".into(), format!("{k}={v}")]);
        }
        args.extend(["--token-file".into(), token_file.to_string_lossy().into()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.run(&args).map(drop)
    }

    /// Revokes `cluster`'s credential.
    pub fn revoke(&self, cluster: &str) -> Result<()> {
        self.run(&["revoke", cluster]).map(drop)
    }
}
