//! Retry requests in a processing cycle: which handlers a request runs again — failed or
//! delayed ones, sub-handlers through their parents, and handlers of a change that is already
//! complete, whose records are gone — and how the request leaves in the cycle's own write
//! with an Event (`persistence::retry` is the request's format; `cycle` runs the handlers).

use super::*;

/// The cause of a re-run of an object whose last change is complete (a Noop): the purpose of
/// a change handler's unfinished re-run record (one in progress), or the kind of the first
/// change handler a retry request names (kopf purges a change's records, a permanent
/// failure's included, once the change is complete; the request brings the handler back).
pub(super) fn rerun(input: &Input<'_>, keys: &crate::persistence::Keys) -> Option<Cause> {
    let changing = || {
        input.handlers.iter().filter(|h| {
            matches!(
                h.kind,
                HandlerKind::Create | HandlerKind::Update | HandlerKind::Resume
            )
        })
    };
    let of_purpose = |purpose: &str| match purpose {
        "create" => Some(Cause::Create),
        "update" => Some(Cause::Update),
        "resume" => Some(Cause::Resume),
        _ => None,
    };
    if let Some(cause) = changing().find_map(|h| {
        let record = input.storage.progress.fetch(&h.id.0, input.body)?;
        (record.rerun && !record.finished()).then(|| of_purpose(record.purpose.as_deref()?))?
    }) {
        return Some(cause);
    }
    let request = crate::persistence::retry::read(keys, input.body)?.ok()?;
    if request.handlers.is_empty() {
        return None;
    }
    changing()
        .find(|h| request.wants(&h.id.0, keys))
        .map(|h| match h.kind {
            HandlerKind::Create => Cause::Create,
            HandlerKind::Update => Cause::Update,
            _ => Cause::Resume,
        })
}

/// A record made ready to run again now: not failed, not delayed, not stopped.
pub(super) fn reset(mut record: ProgressRecord) -> ProgressRecord {
    record.success = false;
    record.failure = false;
    record.stopped = None;
    record.delayed = None;
    record
}

/// Consumes the object's retry request, if any: it leaves in this cycle's write (so a request
/// costs no write of its own), with an Event that names who asked and what ran again — or
/// that there was nothing to retry, or that the request was malformed. A cycle that ran no
/// handler because it only adds the finalizer, or was interrupted, leaves the request for the
/// next one.
pub(super) fn consume_retry(input: &Input<'_>, plan: &mut Plan, retried: &[String]) {
    use crate::persistence::retry;
    let keys = &input.storage.keys;
    let Some(request) = retry::read(keys, input.body) else {
        return;
    };
    if plan.interrupted || plan.finalizer == FinalizerChange::Add || plan.cause == Cause::Gone {
        return;
    }
    let announcement = match request {
        Ok(request) if !retried.is_empty() => (
            Level::Info,
            "RetryRequested",
            format!(
                "Handler(s) {} run again now, as requested by {}.",
                retried
                    .iter()
                    .map(|id| format!("'{id}'"))
                    .collect::<Vec<_>>()
                    .join(", "),
                request.requester()
            ),
        ),
        Ok(request) => {
            let unknown = request.handlers.iter().any(|h| {
                !input.handlers.iter().any(|r| {
                    retry::Request {
                        handlers: vec![h.clone()],
                        ..Default::default()
                    }
                    .wants(&r.id.0, keys)
                })
            });
            let known = if unknown {
                format!(
                    " The handlers of this operator: {}.",
                    input
                        .handlers
                        .iter()
                        .map(|h| h.id.0.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            } else {
                String::new()
            };
            (
                Level::Info,
                "RetryRequested",
                format!(
                    "Nothing to retry (requested by {} for {}): no such handler has failed or waits for a retry.{known}",
                    request.requester(),
                    if request.handlers.is_empty() {
                        "every handler".to_owned()
                    } else {
                        request.handlers.join(", ")
                    }
                ),
            )
        }
        Err(why) => {
            warn!(problem = %why, "malformed retry request ignored");
            (
                Level::Warning,
                "RetryRequestIgnored",
                format!("Ignored a malformed retry request ({}): {why}", retry::key(keys)),
            )
        }
    };
    plan.announcements.push(announcement);
    let mut desired = plan.desired.take().unwrap_or_else(|| plan.base.clone());
    retry::remove(keys, &mut desired);
    plan.desired = Some(desired);
    if let Some(fallback) = plan.fallback.as_mut() {
        retry::remove(keys, fallback);
    }
}
