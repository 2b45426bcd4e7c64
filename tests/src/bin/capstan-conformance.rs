//! The conformance kit's runner: `capstan-conformance --all`, or `--sdk PROFILE` for one SDK.
//! See `tests/conformance/README.md`.

use std::path::PathBuf;

use anyhow::{Context as _, Result, bail};
use capstan_tests::conformance::{self, Options, Profile};
use futures::StreamExt as _;

struct Args {
    profiles: Vec<PathBuf>,
    cases: PathBuf,
    options: Options,
    report: Option<PathBuf>,
    /// How many SDKs are run at once.
    jobs: usize,
}

fn parse_args() -> Result<Args> {
    let kit = conformance::kit_dir();
    let mut args = Args {
        profiles: Vec::new(),
        cases: kit.join("cases"),
        options: Options::default(),
        report: None,
        jobs: 1,
    };
    let mut all = false;
    let mut given = std::env::args().skip(1);
    while let Some(arg) = given.next() {
        match arg.as_str() {
            "--all" => all = true,
            "--sdk" => args
                .profiles
                .push(given.next().context("--sdk takes a profile")?.into()),
            "--cases" => args.cases = given.next().context("--cases takes a folder")?.into(),
            "--case" => args
                .options
                .only
                .push(given.next().context("--case takes a name or a prefix")?),
            "--report" => args.report = Some(given.next().context("--report takes a file")?.into()),
            "--jobs" | "-j" => {
                args.jobs = given
                    .next()
                    .and_then(|n| n.parse().ok())
                    .filter(|n| (1..=8).contains(n))
                    .context("--jobs takes a number of SDKs run at once, 1 to 8")?;
            }
            "-v" | "--verbose" => args.options.verbose = true,
            "-h" | "--help" => {
                println!(
                    "capstan-conformance [--all | --sdk PROFILE.yaml ...] [--case NAME-OR-PREFIX ...] [--cases DIR] [--report FILE.json] [--jobs N] [-v]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other} (see --help)"),
        }
    }
    if all {
        let mut found: Vec<PathBuf> = std::fs::read_dir(kit.join("sdks"))?
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .filter(|path| path.extension().is_some_and(|extension| extension == "yaml"))
            .collect();
        found.sort();
        args.profiles.extend(found);
    }
    if args.profiles.is_empty() {
        bail!("name an SDK profile with --sdk, or run --all");
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = parse_args()?;
    let cases = conformance::load_cases(&args.cases)?;
    // Every handler is built first, one at a time, so that no build competes with another
    // SDK's timed cases. Every case has its own handler process and fake controller, so SDKs
    // then run side by side; the reports keep the profiles' order.
    conformance::check_selection(&cases, &args.options)?;
    let mut built = Vec::new();
    for path in &args.profiles {
        let profile = Profile::load(path)?;
        let handler = conformance::build(&profile).await?;
        built.push((profile, handler));
    }
    let reports: Vec<_> = futures::stream::iter(&built)
        .map(|(profile, handler)| conformance::run_cases(profile, handler, &cases, &args.options))
        .buffered(args.jobs)
        .collect::<Vec<Result<_>>>()
        .await
        .into_iter()
        .collect::<Result<_>>()?;
    for report in &reports {
        println!("{}", report.table());
    }
    if let Some(path) = &args.report {
        std::fs::write(path, serde_json::to_vec_pretty(&reports)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if reports.iter().any(|report| report.fails_the_run()) {
        bail!("the conformance kit failed");
    }
    Ok(())
}
