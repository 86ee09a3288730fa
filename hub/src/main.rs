use std::process::ExitCode;

use clap::Parser;
use flotilla_hub::cli::{Cli, Command, render_command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Crds => {
            print!("{}", flotilla_crds::crds_yaml());
            Ok(ExitCode::SUCCESS)
        }
        Command::Render(args) => render_command(&args).map(|report| {
            print!("{}", report.stdout);
            report.stderr.iter().for_each(|line| eprintln!("{line}"));
            if report.failed {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }),
    };
    result.unwrap_or_else(|e| {
        eprintln!("error: {e:#}");
        ExitCode::FAILURE
    })
}
