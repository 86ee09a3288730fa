use std::process::ExitCode;

use clap::Parser;
use flotilla_hub::cli::{self, Cli, Command};

/// The libc's allocator unless built with `--features mimalloc`: mimalloc spends less CPU
/// at a million pairs and more memory everywhere (BENCHMARKS.md, "Allocator").
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let Cli {
        log_json,
        kube,
        command,
    } = Cli::parse();
    let result = match command {
        Command::Crds { cluster_inventory } => {
            match cluster_inventory {
                false => print!("{}", flotilla_crds::crds_yaml()),
                true => print!("{}", flotilla_crds::inventory_crds_yaml()),
            }
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
        Command::Version => {
            println!("flotilla-hub {}", env!("CARGO_PKG_VERSION"));
            Ok(ExitCode::SUCCESS)
        }
        Command::Completion { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "flotilla-hub",
                &mut std::io::stdout(),
            );
            Ok(ExitCode::SUCCESS)
        }
        command => {
            flotilla_common::telemetry::init(log_json);
            let runtime = tokio::runtime::Runtime::new().expect("starting the tokio runtime");
            runtime
                .block_on(async move {
                    match command {
                        Command::Run(args) => flotilla_hub::run::run(&kube, args).await,
                        Command::Join(args) => cli::join(&kube, &args).await,
                        Command::Revoke(args) => cli::revoke(&kube, &args).await,
                        Command::Unjoin(args) => cli::unjoin(&kube, &args).await,
                        Command::Cordon(args) => cli::cordon(&kube, &args, true).await,
                        Command::Uncordon(args) => cli::cordon(&kube, &args, false).await,
                        Command::Status(args) => flotilla_hub::detail::status(&kube, &args).await,
                        Command::Rollout(args) => cli::rollout(&kube, &args).await,
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
