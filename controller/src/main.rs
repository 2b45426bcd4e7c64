//! The `capstan` binary: parses the command line and runs the chosen command.

use std::process::ExitCode;

use capstan::{
    cli::{Cli, Command},
    observability::logging,
    peering::commands,
};
use clap::{CommandFactory, FromArgMatches};
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    match cli.command {
        Command::Version => {
            println!(
                "capstan {} (protocol {})",
                env!("CARGO_PKG_VERSION"),
                capstan_proto::PROTOCOL_VERSION
            );
            ExitCode::SUCCESS
        }
        Command::Check(args) => terminal(async move {
            capstan::check::run(&args.admin, args.timeout)
                .await
                .map_err(Into::into)
        }),
        Command::Status(args) => terminal(async move {
            let query = args.query();
            let reports = capstan::inspection::report(client().await?, &query).await?;
            let colour = std::io::IsTerminal::is_terminal(&std::io::stdout())
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
            let text = capstan::inspection::render::render(
                &reports,
                args.output,
                query.namespaces == capstan::inspection::Namespaces::All,
                colour,
            )
            .map_err(capstan::inspection::Error::Render)?;
            Ok(vec![text])
        }),
        Command::Retry(args) => terminal(async move {
            capstan::steering::retry(client().await?, &args.ask())
                .await
                .map_err(Into::into)
        }),
        Command::Crds => {
            print!("{}", capstan::peering::commands::CRDS);
            ExitCode::SUCCESS
        }
        Command::PrepareStorage(args) => {
            match capstan::persistence::node_store::prepare(&args.dir, args.owner, args.claim.as_deref()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("capstan: {}", capstan::diagnostic::chain(&e));
                    ExitCode::FAILURE
                }
            }
        }
        Command::Freeze(args) => terminal(async move {
            let freeze = commands::Freeze {
                targets: args.scope.targets(),
                id: args.scope.id.clone().unwrap_or_else(commands::user_identity),
                priority: args.priority,
                lifetime: args.lifetime,
                message: args.message.clone(),
            };
            commands::freeze(client().await?, &freeze)
                .await
                .map_err(Into::into)
        }),
        Command::Resume(args) => terminal(async move {
            let id = args.scope.id.clone().unwrap_or_else(commands::user_identity);
            commands::resume(client().await?, &args.scope.targets(), &id)
                .await
                .map_err(Into::into)
        }),
        Command::Run(args) => {
            if let Err(problem) = args.check() {
                eprintln!("capstan: {problem}");
                return ExitCode::from(64);
            }
            if let Err(e) = logging::init(args.log_format, &args.log) {
                eprintln!("capstan: {}", capstan::diagnostic::chain(&e));
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
                let given = matches
                    .subcommand_matches("run")
                    .map(capstan::cli::RunArgs::given_operator_flags)
                    .unwrap_or_default();
                capstan::app::run(args.settings_following_processes(given), shutdown).await
            });
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!(error = %capstan::diagnostic::chain(&e), "capstan failed");
                    eprintln!("capstan: {}", capstan::diagnostic::chain(&e));
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// The API client of a terminal command (kubeconfig first).
async fn client() -> Result<kube::Client, Box<dyn std::error::Error + Send + Sync>> {
    Ok(capstan::k8s::client::connect().await?)
}

/// Runs a terminal command (`freeze`, `resume`): prints its report, or the error chain.
fn terminal(
    command: impl Future<Output = Result<Vec<String>, Box<dyn std::error::Error + Send + Sync>>>,
) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("capstan: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(command) {
        Ok(lines) => {
            for line in lines {
                println!("{line}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("capstan: {}", capstan::diagnostic::chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}
