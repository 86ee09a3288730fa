use std::process::ExitCode;

use clap::Parser;
use flotilla_hub::cli::{self, Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Crds => {
            print!("{}", flotilla_crds::crds_yaml());
            Ok(ExitCode::SUCCESS)
        }
        Command::Render(args) => cli::render_command(&args).map(|report| {
            print!("{}", report.stdout);
            report.stderr.iter().for_each(|line| eprintln!("{line}"));
            if report.failed {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }),
        Command::Certs(args) => cli::certs(&args).map(|()| ExitCode::SUCCESS),
        command => {
            flotilla_common::telemetry::init(cli.log_json);
            let runtime = tokio::runtime::Runtime::new().expect("starting the tokio runtime");
            runtime
                .block_on(async move {
                    match command {
                        Command::Run(args) => flotilla_hub::run::run(args).await,
                        Command::Join(args) => cli::join(&args).await,
                        Command::Revoke(args) => cli::revoke(&args).await,
                        Command::Cordon(args) => cli::cordon(&args, true).await,
                        Command::Uncordon(args) => cli::cordon(&args, false).await,
                        _ => unreachable!("handled above"),
                    }
                })
                .map(|()| ExitCode::SUCCESS)
        }
    };
    result.unwrap_or_else(|e| {
        eprintln!("error: {e:#}");
        ExitCode::FAILURE
    })
}
