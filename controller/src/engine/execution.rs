//! What an outcome means for a handler's progress record: kopf's rules for temporary,
//! permanent and unclassified errors, retry limits, timeouts and backoff.
//!
//! `retries = N` allows N attempts in total; `timeout` counts from the first attempt, so time
//! the controller was down counts too; a temporary error that would land past the timeout or
//! beyond the last allowed attempt is final at once (kopf's look-ahead).
//!
//! An attempt during which the handler process disconnected is a retry at once, recorded with
//! the loss (`lost` in the record, `HANDLER_PROCESS_LOST` to the next attempt); after
//! `max_losses` consecutive losses the handler fails for good (the poison-pill guard). The
//! count lives in the progress record, so it survives the absence of every handler process
//! and restarts of the controller.

use std::time::{Duration, SystemTime};

use serde_json::Value;

use crate::{
    model::{Diagnostic, ErrorsMode, Outcome, Patch, Registration},
    persistence::{ProgressRecord, time},
};

/// What to do with an outcome.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Finished successfully: apply the patches and store the result.
    Success {
        /// The result for `status.<id>`.
        result: Option<Value>,
        /// Patches to apply.
        patches: Vec<Patch>,
    },
    /// Not finished: try again at the record's `delayed` time.
    Retry,
    /// Finished with a failure.
    Failure,
    /// Nothing to record (skipped by an SDK filter, or cancelled by shutdown).
    Unrecorded,
}

/// Checks the limits before an attempt; returns the failure message when none is allowed.
pub fn exhausted(reg: &Registration, record: &ProgressRecord, now: SystemTime) -> Option<String> {
    if let (Some(timeout), Some(started)) = (reg.timeout, record.started_at())
        && now.duration_since(started).unwrap_or_default() >= timeout
    {
        return Some(format!("{} has timed out after {timeout:?}", reg.id));
    }
    if let Some(retries) = reg.retries
        && record.retries >= retries
    {
        return Some(format!("{} has exceeded {retries} retries", reg.id));
    }
    None
}

/// The reason given to the next attempt after a lost one.
pub const LOST_REASON: &str = "HANDLER_PROCESS_LOST";

/// The reason given to the next attempt after a failed one.
pub const FAILED_REASON: &str = "PREVIOUS_ATTEMPT_FAILED";

/// What the next attempt is told about the previous one, from the record.
pub fn last_error(record: &ProgressRecord) -> Option<Diagnostic> {
    let reason = if record.lost > 0 {
        LOST_REASON
    } else {
        FAILED_REASON
    };
    record
        .message
        .as_ref()
        .map(|m| Diagnostic::error(reason, m.clone()))
}

/// Applies `outcome` to `record` (in place) and says what to do with it; a lost attempt counts
/// against `max_losses` consecutive losses.
pub fn judge_with_guard(
    reg: &Registration,
    record: &mut ProgressRecord,
    outcome: Outcome,
    now: SystemTime,
    max_losses: u32,
) -> Verdict {
    if outcome != Outcome::Lost {
        return judge(reg, record, outcome, now);
    }
    record.lost += 1;
    if record.lost >= max_losses.max(1) {
        record.retries += 1;
        let message = format!(
            "{LOST_REASON}: the handler process disconnected {} times in a row while processing",
            record.lost
        );
        finish(record, now, false, Some(message));
        return Verdict::Failure;
    }
    retry(
        reg,
        record,
        now,
        Duration::ZERO,
        "the handler process disconnected during the previous attempt",
    )
}

/// Applies `outcome` to `record` (in place) and says what to do with it.
pub fn judge(reg: &Registration, record: &mut ProgressRecord, outcome: Outcome, now: SystemTime) -> Verdict {
    if !matches!(
        outcome,
        Outcome::Lost | Outcome::Skipped | Outcome::Cancelled | Outcome::Abandoned
    ) {
        record.lost = 0;
    }
    match outcome {
        Outcome::Success { result, patches, .. } => {
            finish(record, now, true, None);
            Verdict::Success { result, patches }
        }
        Outcome::Temporary {
            delay, diagnostics, ..
        } => retry(
            reg,
            record,
            now,
            delay.unwrap_or(reg.backoff),
            &summary(&diagnostics, "temporary error"),
        ),
        Outcome::Permanent { diagnostics, .. } => {
            finish(record, now, false, Some(summary(&diagnostics, "permanent error")));
            Verdict::Failure
        }
        Outcome::Unclassified { diagnostics, .. } => {
            let message = summary(&diagnostics, "error");
            match reg.errors {
                ErrorsMode::Temporary => retry(reg, record, now, reg.backoff, &message),
                ErrorsMode::Permanent => {
                    finish(record, now, false, Some(message));
                    Verdict::Failure
                }
                ErrorsMode::Ignored => {
                    finish(record, now, true, None);
                    Verdict::Success {
                        result: None,
                        patches: Vec::new(),
                    }
                }
            }
        }
        Outcome::TimedOut => retry(reg, record, now, reg.backoff, "the attempt exceeded its deadline"),
        Outcome::Lost => retry(
            reg,
            record,
            now,
            Duration::ZERO,
            "the handler process disconnected during the previous attempt",
        ),
        Outcome::Skipped | Outcome::Cancelled | Outcome::Abandoned => Verdict::Unrecorded,
    }
}

/// Records a failed attempt that will be retried after `delay`, unless the limits say this
/// was the last one.
pub fn retry(
    reg: &Registration,
    record: &mut ProgressRecord,
    now: SystemTime,
    delay: Duration,
    message: &str,
) -> Verdict {
    let runtime = record
        .started_at()
        .and_then(|s| now.duration_since(s).ok())
        .unwrap_or_default();
    if let Some(timeout) = reg.timeout
        && runtime.saturating_add(delay) >= timeout
    {
        record.retries += 1;
        finish(
            record,
            now,
            false,
            Some(format!("{message} (timed out after {timeout:?})")),
        );
        return Verdict::Failure;
    }
    if let Some(retries) = reg.retries
        && record.retries + 1 >= retries
    {
        record.retries += 1;
        finish(
            record,
            now,
            false,
            Some(format!("{message} (no retries left of {retries})")),
        );
        return Verdict::Failure;
    }
    record.retries += 1;
    // The delay is bounded where it comes off the wire; a clock overflow still never panics.
    record.delayed = Some(time::format(now.checked_add(delay).unwrap_or(now)));
    record.message = Some(message.to_owned());
    Verdict::Retry
}

fn finish(record: &mut ProgressRecord, now: SystemTime, success: bool, message: Option<String>) {
    if success {
        record.retries += 1;
    }
    record.stopped = Some(time::format(now));
    record.success = success;
    record.failure = !success;
    record.delayed = None;
    if message.is_some() {
        record.message = message;
    }
}

fn summary(diagnostics: &[Diagnostic], fallback: &str) -> String {
    let s = Diagnostic::summarize(diagnostics);
    if s.is_empty() { fallback.to_owned() } else { s }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::HandlerKind;

    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1000)
    }

    fn temporary(secs: u64) -> Outcome {
        Outcome::Temporary {
            delay: Some(Duration::from_secs(secs)),
            diagnostics: vec![Diagnostic::error("X", "boom")],
            subhandlers: vec![],
        }
    }

    #[test]
    fn temporary_errors_are_delayed_until_retries_run_out() {
        let mut reg = Registration::new("h", HandlerKind::Create, None);
        reg.retries = Some(2);
        let mut record = ProgressRecord::started(now(), "create");
        assert_eq!(judge(&reg, &mut record, temporary(5), now()), Verdict::Retry);
        assert_eq!(record.retries, 1);
        assert_eq!(record.delayed_until(), Some(now() + Duration::from_secs(5)));
        assert_eq!(judge(&reg, &mut record, temporary(5), now()), Verdict::Failure);
        assert!(record.failure && record.message.unwrap().contains("no retries left"));
    }

    #[test]
    fn timeouts_look_ahead() {
        let mut reg = Registration::new("h", HandlerKind::Create, None);
        reg.timeout = Some(Duration::from_secs(10));
        let mut record = ProgressRecord::started(now(), "create");
        assert_eq!(judge(&reg, &mut record, temporary(30), now()), Verdict::Failure);
        let late = ProgressRecord::started(now() - Duration::from_secs(11), "create");
        assert!(exhausted(&reg, &late, now()).is_some());
    }

    #[test]
    fn unclassified_errors_follow_the_errors_mode() {
        let mut reg = Registration::new("h", HandlerKind::Create, None);
        let err = || Outcome::Unclassified {
            diagnostics: vec![],
            subhandlers: vec![],
        };
        let mut record = ProgressRecord::default();
        assert_eq!(judge(&reg, &mut record, err(), now()), Verdict::Retry);
        assert_eq!(record.delayed_until(), Some(now() + reg.backoff));
        reg.errors = ErrorsMode::Ignored;
        assert!(matches!(
            judge(&reg, &mut record, err(), now()),
            Verdict::Success { .. }
        ));
        reg.errors = ErrorsMode::Permanent;
        let mut record = ProgressRecord::default();
        assert_eq!(judge(&reg, &mut record, err(), now()), Verdict::Failure);
    }

    #[test]
    fn lost_attempts_are_retried_at_once_until_the_guard_trips() {
        let reg = Registration::new("h", HandlerKind::Create, None);
        let mut record = ProgressRecord::started(now(), "create");
        for n in 1..3 {
            assert_eq!(
                judge_with_guard(&reg, &mut record, Outcome::Lost, now(), 3),
                Verdict::Retry
            );
            assert_eq!((record.retries, record.lost), (n, n));
            assert_eq!(record.delayed_until(), Some(now()));
            assert_eq!(
                last_error(&record).map(|d| d.reason),
                Some(LOST_REASON.to_owned())
            );
        }
        assert_eq!(
            judge_with_guard(&reg, &mut record, Outcome::Lost, now(), 3),
            Verdict::Failure
        );
        assert!(record.failure && record.message.as_deref().is_some_and(|m| m.contains(LOST_REASON)));
        // Another outcome in between starts the count again.
        let mut record = ProgressRecord::started(now(), "create");
        judge_with_guard(&reg, &mut record, Outcome::Lost, now(), 2);
        judge_with_guard(&reg, &mut record, temporary(0), now(), 2);
        assert_eq!(record.lost, 0);
        assert_eq!(
            last_error(&record).map(|d| d.reason),
            Some(FAILED_REASON.to_owned())
        );
        assert_eq!(
            judge_with_guard(&reg, &mut record, Outcome::Lost, now(), 2),
            Verdict::Retry
        );
    }

    #[test]
    fn success_finishes_and_counts_the_attempt() {
        let reg = Registration::new("h", HandlerKind::Create, None);
        let mut record = ProgressRecord::started(now(), "create");
        assert!(matches!(
            judge(&reg, &mut record, Outcome::success(None), now()),
            Verdict::Success { .. }
        ));
        assert!(record.success && record.stopped.is_some() && record.retries == 1);
        assert_eq!(
            judge(&reg, &mut record, Outcome::Skipped, now()),
            Verdict::Unrecorded
        );
    }
}
