//! The `capstan` binary: parses the command line and runs the chosen command.

use std::process::ExitCode;

use capstan::{
    cli::{Cli, Command},
    observability::logging,
};
use clap::Parser;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Version => {
            println!(
                "capstan {} (protocol {})",
                env!("CARGO_PKG_VERSION"),
                capstan_proto::PROTOCOL_VERSION
            );
            ExitCode::SUCCESS
        }
        Command::Freeze(_) | Command::Resume(_) => {
            eprintln!("capstan: freeze and resume are not yet implemented in this version");
            ExitCode::from(2)
        }
        Command::Run(args) => {
            if let Err(e) = logging::init(args.log_format, &args.log) {
                eprintln!("capstan: {}", capstan::error::chain(&e));
                return ExitCode::from(64);
            }
            let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("capstan: cannot start the async runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let result = runtime.block_on(async {
                let shutdown = CancellationToken::new();
                capstan::signal::install(shutdown.clone()).map_err(capstan::Error::Signal)?;
                capstan::app::run(args.settings(), shutdown).await
            });
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!(error = %capstan::error::chain(&e), "capstan failed");
                    eprintln!("capstan: {}", capstan::error::chain(&e));
                    ExitCode::FAILURE
                }
            }
        }
    }
}
