//! One admission review, answered by the handler processes: which validating or mutating
//! handlers apply, their invocations over the stream, and the one verdict they make together.
//!
//! Handlers apply when their resource and subresource are the review's (`*`: any
//! subresource, not the resource itself), the operation is one of theirs (mutating handlers with no operations given
//! are not called for DELETE, as kopf), and their declarative filters (labels, annotations,
//! field value) hold for the object — the new one, or the old one of a DELETE. A callable `when` filter runs in the SDK, which may
//! answer `skipped`. They run in registration order:
//!
//! - validating handlers all at once; the verdict is the first denial in registration order,
//!   and as soon as it is known the handlers still running are cancelled;
//! - mutating handlers one after another, each seeing the object as the earlier ones patched
//!   it; their changes become one JSON Patch. A patch that does not apply is a denial that
//!   names the handler and the error, never a silent admission.
//!
//! Warnings of every handler are returned. A handler that fails, times out, or whose process
//! is not connected makes the request fail unless the handler ignores failures (kopf's
//! `ignore_failures`), in which case it is left out. Everything ends before the review's
//! deadline: the invocations still running then are cancelled and count as timed out.
//!
//! Admission is served while dispatch is paused (frozen by a peer, standby replica): the API
//! server calls every replica behind the Service, and kopf keeps webhooks working while
//! handling is paused.

use std::{sync::Arc, time::Duration};

use futures::{StreamExt as _, stream::FuturesOrdered};
use serde_json::Value;
use tokio::{sync::watch, time::Instant};
use tracing::{Instrument as _, debug, info, info_span, warn};

use super::review::{Review, Verdict};
use crate::{
    engine::matching::{Subject, prematch},
    grpc::{Control, Hub},
    model::{
        AdmissionVerdict, HandlerKind, KindOptions, KindResult, Outcome, Patch, PatchType, Payload,
        Registration, ResourceRef, Work,
    },
    observability::metrics,
};

/// Which configuration a review comes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// `ValidatingWebhookConfiguration`: validate handlers.
    Validating,
    /// `MutatingWebhookConfiguration`: mutate handlers.
    Mutating,
}

impl Phase {
    /// The handler kind served in this phase.
    pub fn kind(self) -> HandlerKind {
        match self {
            Self::Validating => HandlerKind::Validate,
            Self::Mutating => HandlerKind::Mutate,
        }
    }

    /// A lower-case name for logs, metrics and URL paths.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Validating => "validate",
            Self::Mutating => "mutate",
        }
    }
}

/// What became of a review.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// The handlers' verdict.
    Verdict(Verdict),
    /// No handler of this phase is registered for the review's resource (or the handler named
    /// in the path does not exist): the API server applies the webhook's failure policy.
    Unknown(String),
}

/// Answers reviews with the known admission handlers. Cheap to clone.
#[derive(Clone)]
pub struct Admission {
    hub: Hub,
    handlers: watch::Receiver<Arc<Vec<Registration>>>,
}

/// The result of one handler's invocation.
enum Called {
    /// The handler answered (admitted or denied), with its patches.
    Answered(AdmissionVerdict, Vec<Patch>),
    /// An SDK-side filter said no.
    Skipped,
    /// It failed, timed out, or could not be reached.
    Failed { reason: String, timed_out: bool },
}

impl Admission {
    /// Answers with the handlers published on `handlers` (see [`super::known`]), invoked
    /// through `hub`.
    pub fn new(hub: Hub, handlers: watch::Receiver<Arc<Vec<Registration>>>) -> Self {
        Self { hub, handlers }
    }

    /// Answers `review` for `phase` before `deadline`; `only` restricts it to one handler id
    /// (a webhook path that names a handler, as kopf's).
    pub async fn review(
        &self,
        phase: Phase,
        only: Option<&str>,
        review: &Review,
        deadline: Instant,
    ) -> Answer {
        let handlers = self.handlers.borrow().clone();
        let for_resource: Vec<&Registration> = handlers
            .iter()
            .filter(|r| r.kind == phase.kind())
            .filter(|r| only.is_none_or(|id| r.id.0 == id))
            .filter(|r| {
                r.resource
                    .as_ref()
                    .is_some_and(|res| res.group == review.group && res.plural == review.resource)
            })
            .collect();
        if for_resource.is_empty() {
            return Answer::Unknown(match only {
                Some(id) => format!(
                    "no {} handler {id:?} for {}",
                    phase.as_str(),
                    review.resource_name()
                ),
                None => format!("no {} handler for {}", phase.as_str(), review.resource_name()),
            });
        }
        let subject = review.body().cloned().unwrap_or(Value::Null);
        let matching: Vec<&Registration> = for_resource
            .into_iter()
            .filter(|r| applies(r, review, &subject))
            .collect();
        let span = info_span!("admission", phase = phase.as_str(), object = %review.object_name(), resource = %review.resource_name(), operation = %review.operation, uid = %review.uid);
        async {
            let verdict = match phase {
                Phase::Validating => self.validate(&matching, review, &subject, deadline).await,
                Phase::Mutating => self.mutate(&matching, review, subject, deadline).await,
            };
            if !verdict.allowed {
                info!(code = verdict.code, message = %verdict.message, "admission request denied");
            }
            Answer::Verdict(verdict)
        }
        .instrument(span)
        .await
    }

    async fn validate(
        &self,
        handlers: &[&Registration],
        review: &Review,
        body: &Value,
        deadline: Instant,
    ) -> Verdict {
        let mut calls: FuturesOrdered<_> = handlers
            .iter()
            .map(|reg| async move { (*reg, self.call(reg, review, body, deadline).await) })
            .collect();
        let mut verdict = Verdict::allow();
        // In registration order: the first denial wins, and dropping the rest cancels them.
        while let Some((reg, called)) = calls.next().await {
            match called {
                Called::Answered(answer, _) => {
                    for w in &answer.warnings {
                        verdict.warn(w.clone());
                    }
                    if !answer.allowed {
                        return denied(reg, answer, verdict.warnings);
                    }
                }
                Called::Skipped => {}
                Called::Failed { reason, timed_out } => {
                    if let Some(denial) = failure(reg, &reason, timed_out, &mut verdict) {
                        return denial;
                    }
                }
            }
        }
        verdict
    }

    async fn mutate(
        &self,
        handlers: &[&Registration],
        review: &Review,
        original: Value,
        deadline: Instant,
    ) -> Verdict {
        let mut verdict = Verdict::allow();
        let mut current = original.clone();
        for reg in handlers {
            match self.call(reg, review, &current, deadline).await {
                Called::Answered(answer, patches) => {
                    for w in answer.warnings.iter() {
                        verdict.warn(w.clone());
                    }
                    if !answer.allowed {
                        return denied(reg, answer, verdict.warnings);
                    }
                    if review.object.is_none() && !patches.is_empty() {
                        verdict.warn(format!(
                            "the changes of handler {} were dropped: there is no object to change in a {}",
                            reg.id, review.operation
                        ));
                        continue;
                    }
                    match apply(&current, &patches) {
                        Ok(next) => current = next,
                        Err(e) => {
                            let message = format!(
                                "the patch of admission handler {} does not apply to the object: {e}",
                                reg.id
                            );
                            warn!(handler = %reg.id, error = %e, "admission request denied: a mutating handler's patch does not apply");
                            metrics::global().admission_denial(&reg.id.0);
                            let mut denial = Verdict::deny(500, message);
                            denial.warnings = verdict.warnings;
                            return denial;
                        }
                    }
                }
                Called::Skipped => {}
                Called::Failed { reason, timed_out } => {
                    if let Some(denial) = failure(reg, &reason, timed_out, &mut verdict) {
                        return denial;
                    }
                }
            }
        }
        let ops = json_patch::diff(&original, &current);
        if !ops.0.is_empty() {
            verdict.patch = serde_json::to_value(ops).ok();
        }
        verdict
    }

    /// Invokes one handler with `body` and waits for it until `deadline`.
    async fn call(&self, reg: &Registration, review: &Review, body: &Value, deadline: Instant) -> Called {
        if !self.hub.owned(std::slice::from_ref(&reg.id)).contains(&reg.id) {
            return Called::Failed {
                reason: format!("no handler process that holds handler {} is connected", reg.id),
                timed_out: false,
            };
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        let mut work = Work::new(
            reg.id.0.clone(),
            format!("admission/{}/{}", review.uid, reg.id),
            Payload::Admission {
                uid: review.uid.clone(),
                operation: review.operation.clone(),
                subresource: review.subresource.clone(),
                dry_run: review.dry_run,
                old_object: review.old_object.clone(),
                user_info: review.user_info.clone(),
                headers: review.headers.clone(),
            },
        );
        work.attempt_timeout = Some(remaining);
        work.cancel_grace = Some(Duration::ZERO);
        work.report_losses = true;
        work.param = reg.param.clone();
        work.object = reg.resource.clone().map(|resource| ResourceRef {
            resource,
            namespace: review.namespace.clone(),
            name: body
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or(&review.name)
                .to_owned(),
            uid: text(body, "/metadata/uid"),
            resource_version: text(body, "/metadata/resourceVersion"),
            generation: body
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(0),
        });
        work.body = Some(body.clone());
        let started = Instant::now();
        let outcome = tokio::time::timeout_at(deadline, self.hub.dispatch(work, Control::default())).await;
        debug!(handler = %reg.id, elapsed = ?started.elapsed(), "admission handler answered");
        match outcome {
            Err(_) | Ok(Outcome::TimedOut | Outcome::Abandoned) => Called::Failed {
                reason: format!("admission handler {} did not answer in time", reg.id),
                timed_out: true,
            },
            Ok(Outcome::Success {
                kind_result, patches, ..
            }) => match kind_result {
                Some(KindResult::Admission(verdict)) => Called::Answered(verdict, patches),
                _ => Called::Answered(
                    AdmissionVerdict {
                        allowed: true,
                        ..AdmissionVerdict::default()
                    },
                    patches,
                ),
            },
            Ok(Outcome::Skipped) => Called::Skipped,
            Ok(
                Outcome::Permanent { diagnostics, .. }
                | Outcome::Temporary { diagnostics, .. }
                | Outcome::Unclassified { diagnostics, .. },
            ) => Called::Failed {
                reason: format!(
                    "admission handler {} failed: {}",
                    reg.id,
                    diagnostics
                        .first()
                        .map_or("no reason given", |d| d.summary.as_str())
                ),
                timed_out: false,
            },
            Ok(Outcome::Cancelled) => Called::Failed {
                reason: format!("admission handler {} was cancelled", reg.id),
                timed_out: false,
            },
            Ok(Outcome::Lost) => Called::Failed {
                reason: format!("the handler process of admission handler {} disconnected", reg.id),
                timed_out: false,
            },
        }
    }
}

/// Whether `reg` applies to `review` (operation, subresource, declarative filters).
fn applies(reg: &Registration, review: &Review, body: &Value) -> bool {
    let (operations, subresource) = match &reg.options {
        KindOptions::Admission(o) => (o.operations.as_slice(), o.subresource.as_str()),
        _ => (&[][..], ""),
    };
    // kopf's `*` is every subresource (its webhook, `<plural>/*`, is called for no write of
    // the resource itself).
    let every = subresource == "*" && !review.subresource.is_empty();
    if !every && subresource != review.subresource {
        return false;
    }
    let operation_ok = if operations.is_empty() {
        !(reg.kind == HandlerKind::Mutate && review.operation == "DELETE")
    } else {
        operations.contains(&review.operation)
    };
    operation_ok
        && prematch(
            reg,
            Subject {
                body,
                old: None,
                new: None,
            },
        )
}

/// Whether `reg` fails open.
pub fn ignores_failures(reg: &Registration) -> bool {
    matches!(&reg.options, KindOptions::Admission(o) if o.ignore_failures)
}

/// A failed handler: left out when it ignores failures, else the request's denial.
fn failure(reg: &Registration, reason: &str, timed_out: bool, verdict: &mut Verdict) -> Option<Verdict> {
    if timed_out {
        metrics::global().admission_timeout(&reg.id.0);
    }
    if ignores_failures(reg) {
        warn!(handler = %reg.id, %reason, "admission handler failed; admitted without it (it ignores failures)");
        return None;
    }
    warn!(handler = %reg.id, %reason, "admission request denied: a handler failed");
    metrics::global().admission_denial(&reg.id.0);
    // 500 for a timeout too: clients retry 503 and 504 answers, and a retry would only time out again.
    let mut denial = Verdict::deny(500, reason);
    denial.warnings = std::mem::take(&mut verdict.warnings);
    Some(denial)
}

fn denied(reg: &Registration, answer: AdmissionVerdict, warnings: Vec<String>) -> Verdict {
    metrics::global().admission_denial(&reg.id.0);
    info!(handler = %reg.id, message = %answer.message, "denied by admission handler");
    let code = u16::try_from(answer.code)
        .ok()
        .filter(|c| (400..600).contains(c))
        .unwrap_or(400);
    let mut verdict = Verdict::deny(code, answer.message);
    verdict.warnings = warnings;
    verdict
}

/// Applies a handler's patches to `object`, in order.
fn apply(object: &Value, patches: &[Patch]) -> Result<Value, String> {
    let mut next = object.clone();
    for p in patches {
        match p.patch_type {
            PatchType::Merge => json_patch::merge(&mut next, &p.body),
            PatchType::Json => {
                let ops: json_patch::Patch =
                    serde_json::from_value(p.body.clone()).map_err(|e| format!("not a JSON Patch: {e}"))?;
                json_patch::patch(&mut next, &ops).map_err(|e| e.to_string())?;
            }
        }
    }
    if !next.is_object() {
        return Err("the patched object is not a JSON object".into());
    }
    Ok(next)
}

fn text(body: &Value, pointer: &str) -> String {
    body.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::model::{AdmissionOptions, PatchTarget};

    fn review(operation: &str) -> Review {
        Review {
            api_version: "admission.k8s.io/v1".into(),
            uid: "u".into(),
            group: "demo.capstan.dev".into(),
            version: "v1".into(),
            resource: "examples".into(),
            subresource: String::new(),
            operation: operation.into(),
            namespace: "default".into(),
            name: "one".into(),
            object: Some(json!({"metadata": {"name": "one", "labels": {"team": "a"}}})),
            old_object: None,
            dry_run: false,
            user_info: None,
            headers: vec![("User-Agent".into(), "kube-apiserver-admission".into())],
        }
    }

    #[test]
    fn operations_subresources_and_filters_decide() {
        let body = json!({"metadata": {"labels": {"team": "a"}}});
        let mut reg = Registration::new("m", HandlerKind::Mutate, None);
        reg.options = KindOptions::Admission(AdmissionOptions::default());
        assert!(applies(&reg, &review("CREATE"), &body));
        assert!(
            !applies(&reg, &review("DELETE"), &body),
            "mutating handlers skip DELETE by default"
        );
        reg.options = KindOptions::Admission(AdmissionOptions {
            operations: vec!["DELETE".into()],
            ..AdmissionOptions::default()
        });
        assert!(applies(&reg, &review("DELETE"), &body));
        assert!(!applies(&reg, &review("CREATE"), &body));
        let mut v = Registration::new("v", HandlerKind::Validate, None);
        v.options = KindOptions::Admission(AdmissionOptions {
            subresource: "status".into(),
            ..AdmissionOptions::default()
        });
        assert!(!applies(&v, &review("UPDATE"), &body));
        v.options = KindOptions::Admission(AdmissionOptions {
            subresource: "*".into(),
            ..AdmissionOptions::default()
        });
        assert!(
            !applies(&v, &review("UPDATE"), &body),
            "`*` is every subresource, not the resource"
        );
        let mut status = review("UPDATE");
        status.subresource = "status".into();
        assert!(applies(&v, &status, &body), "`*` is every subresource");
        v.options = KindOptions::Admission(AdmissionOptions::default());
        v.filters
            .labels
            .insert("team".into(), crate::model::MetaMatch::Equals("b".into()));
        assert!(!applies(&v, &review("UPDATE"), &body));
    }

    #[test]
    fn patches_apply_in_order_and_bad_ones_say_why() {
        let object = json!({"spec": {"a": 1}});
        let merge = Patch {
            patch_type: PatchType::Merge,
            target: PatchTarget::Object,
            body: json!({"spec": {"b": 2}}),
        };
        let json = Patch {
            patch_type: PatchType::Json,
            target: PatchTarget::Object,
            body: json!([{"op": "replace", "path": "/spec/b", "value": 3}]),
        };
        assert_eq!(
            apply(&object, &[merge, json]).expect("applies"),
            json!({"spec": {"a": 1, "b": 3}})
        );
        let bad = Patch {
            patch_type: PatchType::Json,
            target: PatchTarget::Object,
            body: json!([{"op": "remove", "path": "/spec/missing"}]),
        };
        assert!(apply(&object, &[bad]).is_err());
    }

    fn validator() -> Registration {
        let mut reg = Registration::new("v", HandlerKind::Validate, None);
        reg.resource = Some(crate::model::ResolvedResource {
            group: "demo.capstan.dev".into(),
            version: "v1".into(),
            plural: "examples".into(),
            kind: "Example".into(),
            namespaced: true,
            status_subresource: false,
        });
        reg.options = KindOptions::Admission(AdmissionOptions::default());
        reg
    }

    #[tokio::test]
    async fn admission_is_served_while_dispatch_is_paused() {
        use capstan_proto::pb;
        let hub = Hub::default();
        let (tx, mut rx) = tokio::sync::mpsc::channel(8);
        let (conn, taken) = hub.attach(tx, 8, false, vec![validator()]);
        assert!(taken.is_empty());
        hub.open(conn);
        hub.set_paused(true);
        let (_keep, handlers) = watch::channel(Arc::new(vec![validator()]));
        let admission = Admission::new(hub.clone(), handlers);
        let task = tokio::spawn(async move {
            admission
                .review(
                    Phase::Validating,
                    None,
                    &review("CREATE"),
                    Instant::now() + Duration::from_secs(10),
                )
                .await
        });
        let sent = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("dispatched while paused")
            .expect("a message");
        let Some(pb::connect_response::Message::Invocation(invocation)) = sent.message else {
            panic!("an invocation");
        };
        let Some(pb::invocation::Payload::Admission(request)) = &invocation.payload else {
            panic!("an admission request");
        };
        assert_eq!(
            request.headers.get("User-Agent").map(String::as_str),
            Some("kube-apiserver-admission"),
            "the request's headers go with it"
        );
        let verdict = pb::AdmissionVerdict {
            allowed: false,
            message: "not while frozen? yes, while frozen".into(),
            code: 403,
            warnings: vec!["w".into()],
        };
        let result = pb::InvocationResult {
            invocation_id: invocation.invocation_id,
            outcome: Some(pb::invocation_result::Outcome::Success(pb::Success {
                result: None,
                kind_result: Some(pb::success::KindResult::Admission(verdict)),
            })),
            ..Default::default()
        };
        hub.complete(conn, &result).expect("in flight");
        let Answer::Verdict(v) = task.await.expect("joined") else {
            panic!("a verdict");
        };
        assert!(!v.allowed);
        assert_eq!(v.code, 403);
        assert_eq!(v.warnings, vec!["w".to_owned()]);
    }

    #[tokio::test]
    async fn unknown_resources_and_absent_processes_follow_the_failure_policy() {
        let hub = Hub::default();
        let mut reg = Registration::new("v", HandlerKind::Validate, None);
        reg.resource = Some(crate::model::ResolvedResource {
            group: "demo.capstan.dev".into(),
            version: "v1".into(),
            plural: "examples".into(),
            kind: "Example".into(),
            namespaced: true,
            status_subresource: false,
        });
        reg.options = KindOptions::Admission(AdmissionOptions::default());
        let (tx, rx) = watch::channel(Arc::new(vec![reg.clone()]));
        let admission = Admission::new(hub, rx);
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut other = review("CREATE");
        other.resource = "others".into();
        assert!(matches!(
            admission.review(Phase::Validating, None, &other, deadline).await,
            Answer::Unknown(_)
        ));
        let Answer::Verdict(v) = admission
            .review(Phase::Validating, None, &review("CREATE"), deadline)
            .await
        else {
            panic!("a verdict");
        };
        assert!(!v.allowed);
        assert!(v.message.contains("no handler process"), "{}", v.message);
        reg.options = KindOptions::Admission(AdmissionOptions {
            ignore_failures: true,
            ..AdmissionOptions::default()
        });
        tx.send_replace(Arc::new(vec![reg]));
        let Answer::Verdict(v) = admission
            .review(Phase::Validating, None, &review("CREATE"), deadline)
            .await
        else {
            panic!("a verdict");
        };
        assert!(v.allowed);
    }
}
