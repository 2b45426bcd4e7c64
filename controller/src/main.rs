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
            println!("capstan {} (protocol {})", env!("CARGO_PKG_VERSION"), capstan_proto::PROTOCOL_VERSION);
            ExitCode::SUCCESS
        }
        Command::Freeze(_) | Command::Resume(_) => {
            eprintln!("capstan: freeze and resume are not yet implemented in this version");
            ExitCode::from(2)
        }
        Command::Run(args) => {
            if let Err(e) = logging::init(args.log_format, &args.log) {
                eprintln!("capstan: {}", report(&e));
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
                    tracing::error!(error = %report(&e), "capstan failed");
                    eprintln!("capstan: {}", report(&e));
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// Formats an error with its chain of causes on one line.
fn report(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}
