//! The `capstan.v1` conformance kit's runner: it plays the controller's side of the protocol
//! against an SDK's conformance handler, case by case, and reports per SDK what passed.
//!
//! The kit itself (the handler set, the cases, the profiles) is data in `tests/conformance/`,
//! documented in its README; this module only runs it. Every case gets a fresh fake controller
//! and a fresh handler process, so that no case depends on what another left behind.

mod case;
mod execute;
mod features;
mod pattern;
mod process;
mod profile;
mod report;
mod server;
mod wire;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};

pub use case::{Case, load_cases};
pub use profile::Profile;
pub use report::{Outcome, SdkReport};

/// The kit's folder in the repository.
pub fn kit_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("conformance")
}

/// What to run.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Only cases whose name starts with one of these (all when empty).
    pub only: Vec<String>,
    /// Print every case's transcript, not only failures'.
    pub verbose: bool,
}

/// An SDK's conformance handler, built: the folder its build wrote to (removed on drop) and
/// the variables its command line expands.
pub struct Built {
    _out: tempfile::TempDir,
    vars: BTreeMap<String, String>,
}

/// Builds an SDK's conformance handler and runs every case against it.
pub async fn run_profile(profile: &Profile, cases: &[Case], options: &Options) -> Result<SdkReport> {
    let built = build(profile).await?;
    run_cases(profile, &built, cases, options).await
}

/// Builds an SDK's conformance handler (the profile's `build` commands).
pub async fn build(profile: &Profile) -> Result<Built> {
    let out = tempfile::Builder::new()
        .prefix("capstan-conformance-build-")
        .tempdir()?;
    let vars = BTreeMap::from([("CONFORMANCE_OUT".to_owned(), out.path().display().to_string())]);
    for command in &profile.build {
        let command: Vec<String> = command.iter().map(|part| profile::expand(part, &vars)).collect();
        let Some((program, args)) = command.split_first() else {
            continue;
        };
        let mut process = tokio::process::Command::new(program);
        process.args(args).current_dir(profile.workdir());
        for (key, value) in &profile.env {
            process.env(key, profile::expand(value, &vars));
        }
        let status = process
            .status()
            .await
            .with_context(|| format!("building {}: {command:?}", profile.name))?;
        if !status.success() {
            bail!("building {}: {command:?} failed: {status}", profile.name);
        }
    }
    Ok(Built { _out: out, vars })
}

/// Refuses a `--case` that names no case (before anything is built).
///
/// # Errors
/// When cases are selected and none of them exists.
pub fn check_selection(cases: &[Case], options: &Options) -> Result<()> {
    if !options.only.is_empty()
        && !cases.iter().any(|case| {
            options
                .only
                .iter()
                .any(|prefix| case.name.starts_with(prefix.as_str()))
        })
    {
        bail!("no case is named {:?} or starts so", options.only);
    }
    Ok(())
}

/// Runs every case against an SDK's built conformance handler.
pub async fn run_cases(
    profile: &Profile,
    built: &Built,
    cases: &[Case],
    options: &Options,
) -> Result<SdkReport> {
    let vars = &built.vars;
    check_selection(cases, options)?;
    let mut report = SdkReport {
        sdk: profile.name.clone(),
        cases: Vec::new(),
        problems: Vec::new(),
    };
    for known in &profile.known_failing {
        if !cases.iter().any(|case| case.name == known.case) {
            report.problems.push(format!(
                "known_failing lists {}, which is no case of the kit",
                known.case
            ));
        }
    }
    for case in cases {
        if !options.only.is_empty()
            && !options
                .only
                .iter()
                .any(|prefix| case.name.starts_with(prefix.as_str()))
        {
            continue;
        }
        let missing: Vec<&str> = case
            .requires
            .iter()
            .filter(|feature| !profile.claims(feature))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            report.push(
                &case.name,
                Outcome::NotClaimed,
                Some(format!("not claimed: {}", missing.join(", "))),
                Default::default(),
            );
            continue;
        }
        let verdict = execute::run_case(case, profile, vars).await;
        let known = profile.known_failing(&case.name);
        let outcome = match (verdict.passed, known) {
            (true, None) => Outcome::Passed,
            (true, Some(_)) => Outcome::UnexpectedPass,
            (false, Some(_)) => Outcome::KnownFailing,
            (false, None) => Outcome::Failed,
        };
        let detail = match outcome {
            Outcome::KnownFailing => known.map(str::to_owned),
            Outcome::UnexpectedPass => Some("passes: take it off known_failing".to_owned()),
            _ => verdict.failure.clone(),
        };
        let mut block = format!(
            "{} {}: {outcome:?} ({} ms)\n",
            profile.name,
            case.name,
            verdict.took.as_millis()
        );
        if options.verbose || outcome == Outcome::Failed {
            block.push_str(&format!("  about: {}\n", case.about));
            if let Some(failure) = &verdict.failure {
                block.push_str(&format!("  failure: {failure}\n"));
            }
            for line in &verdict.transcript {
                block.push_str(&format!("  | {line}\n"));
            }
            if !verdict.stderr_tail.is_empty() {
                block.push_str("  handler stderr (end):\n");
                for line in verdict.stderr_tail.lines() {
                    block.push_str(&format!("  ! {line}\n"));
                }
            }
        }
        // One write per case: a case's lines stay together whatever else writes meanwhile.
        eprint!("{block}");
        report.push(&case.name, outcome, detail, verdict.took);
    }
    Ok(report)
}
