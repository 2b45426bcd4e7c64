//! What a run came to: a table per SDK for a person, JSON for machines.

use std::{fmt::Write as _, time::Duration};

use serde::Serialize;

/// The result of one case for one SDK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// Every expectation held.
    Passed,
    /// It failed, and the profile lists it.
    KnownFailing,
    /// It failed, and the profile does not list it.
    Failed,
    /// It passed, but the profile lists it as failing.
    UnexpectedPass,
    /// The SDK does not claim a feature the case requires.
    NotClaimed,
}

impl Outcome {
    /// Whether this outcome fails the run.
    pub fn fails_the_run(self) -> bool {
        matches!(self, Self::Failed | Self::UnexpectedPass)
    }

    fn label(self) -> &'static str {
        match self {
            Self::Passed => "passed",
            Self::KnownFailing => "known-failing",
            Self::Failed => "FAILED",
            Self::UnexpectedPass => "UNEXPECTED-PASS",
            Self::NotClaimed => "not-claimed",
        }
    }
}

/// One case's line in the report.
#[derive(Debug, Clone, Serialize)]
pub struct CaseReport {
    /// The case's name.
    pub case: String,
    /// What it came to.
    pub outcome: Outcome,
    /// Why it failed, or why it is known to fail, or what is not claimed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// How long it took, in milliseconds.
    pub millis: u128,
}

/// One SDK's part of the report.
#[derive(Debug, Clone, Serialize)]
pub struct SdkReport {
    /// The SDK's name.
    pub sdk: String,
    /// Every case of the kit.
    pub cases: Vec<CaseReport>,
    /// Problems of the profile itself (a listed case the kit does not have).
    pub problems: Vec<String>,
}

impl SdkReport {
    /// How many cases came to `outcome`.
    pub fn count(&self, outcome: Outcome) -> usize {
        self.cases.iter().filter(|case| case.outcome == outcome).count()
    }

    /// Whether this SDK's part fails the run.
    pub fn fails_the_run(&self) -> bool {
        !self.problems.is_empty() || self.cases.iter().any(|case| case.outcome.fails_the_run())
    }

    /// Adds a case's line.
    pub fn push(&mut self, case: &str, outcome: Outcome, detail: Option<String>, took: Duration) {
        self.cases.push(CaseReport {
            case: case.to_owned(),
            outcome,
            detail,
            millis: took.as_millis(),
        });
    }

    /// The table a person reads.
    pub fn table(&self) -> String {
        let width = self
            .cases
            .iter()
            .map(|case| case.case.len())
            .max()
            .unwrap_or(4)
            .max(4);
        let mut out = format!(
            "## {}\n\n| {:width$} | result | ms |\n|{}|--------|----|\n",
            self.sdk,
            "case",
            "-".repeat(width + 2)
        );
        for case in &self.cases {
            let _ = writeln!(
                out,
                "| {:width$} | {} | {} |",
                case.case,
                case.outcome.label(),
                case.millis
            );
        }
        let _ = writeln!(
            out,
            "\n{}: {} passed, {} known-failing, {} not claimed, {} failed, {} unexpected passes",
            self.sdk,
            self.count(Outcome::Passed),
            self.count(Outcome::KnownFailing),
            self.count(Outcome::NotClaimed),
            self.count(Outcome::Failed),
            self.count(Outcome::UnexpectedPass),
        );
        for problem in &self.problems {
            let _ = writeln!(out, "{}: {problem}", self.sdk);
        }
        for case in self.cases.iter().filter(|case| case.outcome.fails_the_run()) {
            let _ = writeln!(
                out,
                "{} {}: {}",
                case.outcome.label(),
                case.case,
                case.detail.as_deref().unwrap_or_default()
            );
        }
        out
    }
}
