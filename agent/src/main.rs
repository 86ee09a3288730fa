use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use flotilla_agent::cli::{Cli, run};

fn main() -> ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(run(Cli::parse()));
    // A blocking call still running (a DNS lookup, a file read) must not hold the exit:
    // SIGTERM ends the agent within a bound (see `run::SHUTDOWN_GRACE`).
    runtime.shutdown_timeout(Duration::from_millis(500));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
