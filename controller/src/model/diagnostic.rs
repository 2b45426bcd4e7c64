//! Diagnostics: short, structured explanations of what went wrong, attached to rejected
//! registrations, failed attempts and refused results.
//!
//! They cross the protocol unchanged (`capstan.v1.Diagnostic`) and end up in progress records,
//! Kubernetes Events and logs, so they carry a one-line summary and a machine reason.

use std::fmt;

/// How severe a diagnostic is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Severity {
    /// Something failed.
    #[default]
    Error,
    /// Something worked, but not as intended.
    Warning,
    /// For information only.
    Info,
}

/// One explanation of a problem.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Diagnostic {
    /// How severe it is.
    pub severity: Severity,
    /// One line for humans.
    pub summary: String,
    /// An optional longer explanation.
    pub detail: String,
    /// An UPPER_SNAKE_CASE machine code.
    pub reason: String,
    /// The offending field, if any.
    pub field: String,
    /// The handler-side error type, if any.
    pub error_type: String,
    /// A handler-side stack trace, logged only.
    pub stack_trace: String,
}

impl Diagnostic {
    /// An error diagnostic with a machine reason and a summary.
    pub fn error(reason: &str, summary: impl Into<String>) -> Self {
        Self {
            severity: Severity::Error,
            reason: reason.to_owned(),
            summary: summary.into(),
            ..Self::default()
        }
    }

    /// A warning diagnostic with a machine reason and a summary.
    pub fn warning(reason: &str, summary: impl Into<String>) -> Self {
        Self {
            severity: Severity::Warning,
            reason: reason.to_owned(),
            summary: summary.into(),
            ..Self::default()
        }
    }

    /// The same diagnostic, pointing at `field`.
    #[must_use]
    pub fn at(mut self, field: impl Into<String>) -> Self {
        self.field = field.into();
        self
    }

    /// Joins the summaries of several diagnostics into one line.
    pub fn summarize(diagnostics: &[Diagnostic]) -> String {
        let parts: Vec<&str> = diagnostics
            .iter()
            .map(|d| d.summary.as_str())
            .filter(|s| !s.is_empty())
            .collect();
        parts.join("; ")
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.reason.is_empty() {
            write!(f, "{}: ", self.reason)?;
        }
        f.write_str(&self.summary)?;
        if !self.field.is_empty() {
            write!(f, " (at {})", self.field)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn displays_reason_summary_and_field() {
        let d = Diagnostic::error("BAD_FILTER", "value needs a field").at("handlers[0].filters");
        assert_eq!(
            d.to_string(),
            "BAD_FILTER: value needs a field (at handlers[0].filters)"
        );
    }

    #[test]
    fn summarizes_non_empty_summaries() {
        let ds = [
            Diagnostic::error("A", "one"),
            Diagnostic::default(),
            Diagnostic::warning("B", "two"),
        ];
        assert_eq!(Diagnostic::summarize(&ds), "one; two");
    }
}
