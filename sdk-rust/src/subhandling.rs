//! Sub-handlers (kopf's `@kopf.subhandler` / `kopf.register`): children a changing handler
//! declares while it runs, run after it returns, each with its own persisted progress.
//!
//! The controller keeps one progress record per sub-handler, under `<parent id>/<id>`, and
//! sends their states with every invocation of the parent; this module runs the children
//! that are neither finished nor waiting, and reports their outcomes flattened under ids
//! relative to the top-level parent (`child`, `child/grandchild`): nesting needs nothing of
//! the protocol. A child that declares children of its own succeeds only once they all have;
//! until then it answers a temporary error with the earliest delay among them (kopf's
//! `HandlerChildrenRetry`) and is called again, so it must declare the same children every
//! time — as must the parent. Nesting stops at [`MAX_DEPTH`] levels.
//!
//! Per-sub-handler options (`errors`, `retries`, `backoff`, `timeout`) are applied here,
//! from the state the controller sent, with kopf's rules: a child whose retries or time ran
//! out is not called and fails permanently; a temporary error that would pass either limit
//! becomes a permanent failure; an unclassified error follows the child's errors mode. A child
//! without options reports its errors as they are and the parent's registration decides. The
//! parent's own limits bound its children as well, as in kopf, where every cycle the children
//! are unfinished counts as a retry of the parent.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use futures::future::BoxFuture;

use crate::{
    Context, ErrorsMode, Handler, classify,
    context::{Decoded, Parts},
    control::Control,
    convert,
    outbox::Outbox,
    pb,
    pb::subhandler_outcome::Outcome as Sub,
};

/// How deep sub-handlers may nest (a parent's children are level 1).
pub const MAX_DEPTH: usize = 8;

/// kopf's default backoff, for children with options whose parent registered none.
const DEFAULT_BACKOFF: Duration = Duration::from_secs(60);

/// Options of one sub-handler, as kopf's `register(fn, id=…, errors=…, retries=…, backoff=…,
/// timeout=…)`. Unset options leave the decision to the parent's registration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubhandlerOptions {
    errors: Option<ErrorsMode>,
    retries: Option<u32>,
    backoff: Option<Duration>,
    timeout: Option<Duration>,
}

impl SubhandlerOptions {
    /// No options of its own.
    pub fn new() -> Self {
        Self::default()
    }

    /// How unclassified errors of this sub-handler are treated (default: temporary).
    #[must_use]
    pub fn errors(mut self, mode: ErrorsMode) -> Self {
        self.errors = Some(mode);
        self
    }

    /// At most this many attempts in all (kopf's `retries`).
    #[must_use]
    pub fn retries(mut self, attempts: u32) -> Self {
        self.retries = Some(attempts);
        self
    }

    /// The delay before retrying an unclassified error or a temporary error without a delay.
    #[must_use]
    pub fn backoff(mut self, delay: Duration) -> Self {
        self.backoff = Some(delay);
        self
    }

    /// The time from the first attempt after which no attempt is made (kopf's `timeout`).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    fn is_empty(&self) -> bool {
        self == &Self::default()
    }
}

/// A sub-handler declared by a running parent.
pub(crate) struct Subhandler {
    pub(crate) id: String,
    pub(crate) handler: Arc<dyn Handler>,
    pub(crate) options: SubhandlerOptions,
}

/// What the children of one invocation share.
pub(crate) struct Run<'a> {
    pub(crate) invocation: &'a Arc<pb::Invocation>,
    pub(crate) decoded: &'a Arc<Decoded>,
    pub(crate) control: &'a Control,
    pub(crate) outbox: &'a Outbox,
    /// The parent registration's backoff, the default of children with options.
    pub(crate) backoff: Option<Duration>,
}

/// The children of one level, run.
#[derive(Default)]
pub(crate) struct Level {
    /// Their outcomes, and their descendants', flattened.
    pub(crate) outcomes: Vec<pb::SubhandlerOutcome>,
    /// The patches of those that succeeded, in order.
    pub(crate) patches: Vec<pb::Patch>,
    /// Some child is not finished: when the earliest of them is due (`None`: unknown).
    pub(crate) unfinished: Option<Option<Duration>>,
}

impl Level {
    fn wait(&mut self, delay: Option<Duration>) {
        self.unfinished = Some(match (self.unfinished.flatten(), delay) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        });
    }
}

impl Run<'_> {
    /// Runs the children `parent` declared that are not finished or waiting. `prefix` is the
    /// parent's id relative to the top-level handler (empty for the top level).
    pub(crate) fn level<'s>(
        &'s self,
        parent: &'s Context,
        prefix: &'s str,
        depth: usize,
    ) -> BoxFuture<'s, Level> {
        Box::pin(async move {
            let mut level = Level::default();
            for sub in parent.take_subhandlers() {
                if self.control.token().is_cancelled() {
                    level.wait(None);
                    break;
                }
                let id = if prefix.is_empty() {
                    sub.id.clone()
                } else {
                    format!("{prefix}/{}", sub.id)
                };
                let state = self.invocation.subhandlers.iter().find(|s| s.subhandler_id == id);
                if state.is_some_and(|s| s.success || s.failure) {
                    continue;
                }
                let waiting = state
                    .and_then(|s| s.delayed_until.as_ref())
                    .map(convert::until)
                    .filter(|d| !d.is_zero());
                if let Some(remaining) = waiting {
                    level.wait(Some(remaining));
                    continue;
                }
                let outcome = self.child(parent, &sub, &id, state, depth, &mut level).await;
                match &outcome {
                    Sub::Success(_) => {}
                    Sub::TemporaryError(e) => {
                        level.wait(e.retry_after.as_ref().map(convert::duration_from_pb))
                    }
                    Sub::UnclassifiedError(_) => level.wait(None),
                    Sub::PermanentError(_) | Sub::Deferred(_) => {}
                }
                level.outcomes.push(pb::SubhandlerOutcome {
                    subhandler_id: id,
                    outcome: Some(outcome),
                });
            }
            level
        })
    }

    async fn child(
        &self,
        parent: &Context,
        sub: &Subhandler,
        id: &str,
        state: Option<&pb::SubhandlerState>,
        depth: usize,
        level: &mut Level,
    ) -> Sub {
        let retries = state.map_or(0, |s| s.retries);
        let started = state
            .and_then(|s| s.started_time.as_ref())
            .and_then(convert::timestamp_from_pb)
            .unwrap_or_else(SystemTime::now);
        let limits = Limits {
            options: &sub.options,
            backoff: self.backoff.unwrap_or(DEFAULT_BACKOFF),
            retries,
            runtime: SystemTime::now().duration_since(started).unwrap_or_default(),
        };
        if let Some(message) = limits.exhausted() {
            return permanent(message);
        }
        let child = Context::from_parts(Parts {
            invocation: self.invocation.clone(),
            decoded: self.decoded.clone(),
            handler_id: format!("{}/{}", parent.handler_id(), sub.id),
            retry: retries,
            started,
            control: self.control.clone(),
            outbox: self.outbox.clone(),
            allow_subhandlers: depth < MAX_DEPTH,
            indexes: parent.indexes(),
            memo: parent.lazy_memo(),
            operator_memo: parent.operator_memo().clone(),
        });
        let outcome = match classify::call_guarded(sub.handler.call(child.clone())).await {
            Ok(output) => {
                let grandchildren = self.level(&child, id, depth + 1).await;
                level.outcomes.extend(grandchildren.outcomes);
                level.patches.extend(grandchildren.patches);
                match grandchildren.unfinished {
                    None => {
                        level.patches.extend(child.patch().to_pb());
                        return Sub::Success(classify::success(&output, None));
                    }
                    Some(delay) => classify::Failure::Temporary(pb::TemporaryError {
                        retry_after: delay.map(convert::duration_to_pb),
                        diagnostics: vec![classify::diagnostic(
                            "sub-handlers are not finished yet".into(),
                            "SUBHANDLERS_UNFINISHED",
                            "",
                        )],
                    }),
                }
            }
            Err(error) => classify::failure(error),
        };
        limits.settle(outcome)
    }
}

/// A child's options against its state.
struct Limits<'a> {
    options: &'a SubhandlerOptions,
    backoff: Duration,
    retries: u32,
    runtime: Duration,
}

impl Limits<'_> {
    /// Why no attempt may be made, if so.
    fn exhausted(&self) -> Option<String> {
        if let Some(timeout) = self.options.timeout
            && self.runtime >= timeout
        {
            return Some(format!("timed out after {timeout:?}"));
        }
        if let Some(retries) = self.options.retries
            && self.retries >= retries
        {
            return Some(format!("exceeded {retries} retries"));
        }
        None
    }

    /// A failure as the child's options classify it.
    fn settle(&self, failure: classify::Failure) -> Sub {
        use classify::Failure;
        if self.options.is_empty() {
            return failure.into();
        }
        let backoff = self.options.backoff.unwrap_or(self.backoff);
        let (delay, diagnostics) = match failure {
            Failure::Permanent(e) => return Sub::PermanentError(e),
            Failure::Temporary(e) => (
                e.retry_after.as_ref().map_or(backoff, convert::duration_from_pb),
                e.diagnostics,
            ),
            Failure::Unclassified(e) => match self.options.errors.unwrap_or(ErrorsMode::Temporary) {
                ErrorsMode::Ignored => return Sub::Success(pb::Success::default()),
                ErrorsMode::Permanent => {
                    return Sub::PermanentError(pb::PermanentError {
                        diagnostics: e.diagnostics,
                    });
                }
                ErrorsMode::Temporary => (backoff, e.diagnostics),
            },
        };
        let summary = diagnostics.first().map(|d| d.summary.clone()).unwrap_or_default();
        if let Some(retries) = self.options.retries
            && self.retries.saturating_add(1) >= retries
        {
            return permanent(format!("{summary} (no retries left of {retries})"));
        }
        if let Some(timeout) = self.options.timeout
            && self.runtime.saturating_add(delay) >= timeout
        {
            return permanent(format!("{summary} (timed out after {timeout:?})"));
        }
        Sub::TemporaryError(pb::TemporaryError {
            retry_after: Some(convert::duration_to_pb(delay)),
            diagnostics,
        })
    }
}

fn permanent(message: String) -> Sub {
    Sub::PermanentError(pb::PermanentError {
        diagnostics: vec![classify::diagnostic(message, "SUBHANDLER_LIMITS", "")],
    })
}

impl From<classify::Failure> for Sub {
    fn from(failure: classify::Failure) -> Self {
        match failure {
            classify::Failure::Temporary(e) => Sub::TemporaryError(e),
            classify::Failure::Permanent(e) => Sub::PermanentError(e),
            classify::Failure::Unclassified(e) => Sub::UnclassifiedError(e),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn temporary(delay: Option<u64>) -> classify::Failure {
        classify::Failure::Temporary(pb::TemporaryError {
            retry_after: delay.map(|s| convert::duration_to_pb(Duration::from_secs(s))),
            diagnostics: vec![classify::diagnostic("busy".into(), "TEMPORARY_ERROR", "")],
        })
    }

    fn unclassified() -> classify::Failure {
        classify::Failure::Unclassified(pb::UnclassifiedError {
            diagnostics: vec![classify::diagnostic("oops".into(), "HANDLER_ERROR", "")],
        })
    }

    fn limits(options: &SubhandlerOptions, retries: u32, runtime: u64) -> Limits<'_> {
        Limits {
            options,
            backoff: Duration::from_secs(7),
            retries,
            runtime: Duration::from_secs(runtime),
        }
    }

    fn delay_of(outcome: &Sub) -> Option<Duration> {
        match outcome {
            Sub::TemporaryError(e) => e.retry_after.as_ref().map(convert::duration_from_pb),
            _ => None,
        }
    }

    #[test]
    fn without_options_errors_pass_through_to_the_parents_registration() {
        let none = SubhandlerOptions::new();
        assert!(matches!(
            limits(&none, 99, 999).settle(unclassified()),
            Sub::UnclassifiedError(_)
        ));
        assert_eq!(limits(&none, 0, 0).exhausted(), None);
    }

    #[test]
    fn retries_count_every_attempt_with_kopfs_look_ahead() {
        let three = SubhandlerOptions::new().retries(3);
        let second = limits(&three, 1, 0).settle(temporary(Some(2)));
        assert_eq!(delay_of(&second), Some(Duration::from_secs(2)));
        assert!(matches!(
            limits(&three, 2, 0).settle(temporary(Some(2))),
            Sub::PermanentError(_)
        ));
        assert!(limits(&three, 3, 0).exhausted().unwrap().contains("3 retries"));
    }

    #[test]
    fn the_timeout_counts_from_the_first_attempt() {
        let ten = SubhandlerOptions::new().timeout(Duration::from_secs(10));
        assert_eq!(
            delay_of(&limits(&ten, 0, 5).settle(temporary(Some(4)))),
            Some(Duration::from_secs(4))
        );
        assert!(matches!(
            limits(&ten, 0, 5).settle(temporary(Some(5))),
            Sub::PermanentError(_)
        ));
        assert!(limits(&ten, 0, 10).exhausted().unwrap().contains("timed out"));
    }

    #[test]
    fn unclassified_errors_follow_the_childs_errors_mode_and_backoff() {
        let temporary_mode = SubhandlerOptions::new().backoff(Duration::from_secs(3));
        assert_eq!(
            delay_of(&limits(&temporary_mode, 0, 0).settle(unclassified())),
            Some(Duration::from_secs(3))
        );
        let parent_backoff = SubhandlerOptions::new().retries(5);
        assert_eq!(
            delay_of(&limits(&parent_backoff, 0, 0).settle(unclassified())),
            Some(Duration::from_secs(7)),
            "the parent's backoff when the child has none"
        );
        let ignored = SubhandlerOptions::new().errors(ErrorsMode::Ignored);
        assert!(matches!(
            limits(&ignored, 0, 0).settle(unclassified()),
            Sub::Success(_)
        ));
        let permanent_mode = SubhandlerOptions::new().errors(ErrorsMode::Permanent);
        assert!(matches!(
            limits(&permanent_mode, 0, 0).settle(unclassified()),
            Sub::PermanentError(_)
        ));
    }
}
