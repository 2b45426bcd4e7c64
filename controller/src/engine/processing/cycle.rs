//! The steps of one processing cycle: decide the cause ([`Cycle::begin`]), run each selected
//! handler ([`Cycle::run`], with checkpoints while one runs long), and fold the steps into the
//! plan ([`Cycle::finish`]). `engine::processing` holds what the steps share: the plan, the
//! composition of the desired body, and the progress bookkeeping.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use super::{
    retrying::{consume_retry, rerun, reset},
    *,
};

pub(super) async fn run(input: Input<'_>, invoker: &dyn Invoker) -> Plan {
    let mut cycle = match Cycle::begin(&input) {
        Ok(cycle) => cycle,
        Err(mut plan) => {
            if plan.cause == Cause::Noop && plan.done && input.storage.conditions.covers(input.resource) {
                observe(input.body, &mut plan);
            }
            consume_retry(&input, &mut plan, &[]);
            return plan;
        }
    };
    let subject = Subject {
        body: input.body,
        old: cycle.old.as_ref(),
        new: Some(&cycle.new),
    };
    let mut selected = matching::select(
        input.handlers,
        cycle.cause,
        cycle.initial || cycle.forcing,
        subject,
    );
    if cycle.forcing {
        // A re-run of a completed change: only the handlers asked for, or still unfinished.
        let keys = &input.storage.keys;
        let purpose = Some(causes::purpose(cycle.reason));
        selected.retain(|h| {
            let unfinished = input
                .storage
                .progress
                .fetch(&h.id.0, input.body)
                .is_some_and(|r| r.rerun && r.purpose.as_deref() == purpose && !r.finished());
            unfinished
                || cycle
                    .retry
                    .as_ref()
                    .is_some_and(|r| !r.handlers.is_empty() && r.wants(&h.id.0, keys))
        });
    }
    for reg in selected {
        cycle.run(reg, invoker).await;
    }
    cycle.finish()
}

/// Conditions on an object with nothing to handle: set as ready when they are missing
/// (conditions turned on for an object handled before), or brought up to the object's
/// generation when a write moved it on (a handler that patched the spec in the cycle's write
/// bumped it after the conditions were composed). One write, only when something differs.
fn observe(body: &Value, plan: &mut Plan) {
    use super::super::conditions;
    let mut desired = plan.desired.take().unwrap_or_else(|| plan.base.clone());
    if conditions::present(body) {
        conditions::observe(&mut desired);
    } else {
        let summary = conditions::Summary {
            done: true,
            cause: "last change".into(),
            ..Default::default()
        };
        conditions::apply(&mut desired, &summary, SystemTime::now());
    }
    plan.desired = (desired != plan.base).then_some(desired);
}

/// The state of one cycle while its handlers run, step by step: [`Cycle::begin`] decides the
/// cause (or ends the cycle early), [`Cycle::run`] runs one handler, [`Cycle::finish`] folds
/// the steps into the plan.
struct Cycle<'i, 'a> {
    input: &'i Input<'a>,
    now: SystemTime,
    rules: Rules,
    cause: Cause,
    reason: ChangeReason,
    initial: bool,
    /// A re-run of a change that was complete: handlers named by a retry request, for the
    /// unchanged object ([`rerun`]), or those of them still unfinished.
    forcing: bool,
    /// The stored diff-base (a whole essence brought to the current rules), and the paths
    /// the handlers watch.
    stored: Option<DiffBase>,
    watched: Watched,
    /// The old essence (the stored diff-base over the current essence), and the current
    /// essence.
    old: Option<Value>,
    new: Value,
    finalizer: FinalizerChange,
    /// The body with the patches of the handlers that ran so far.
    running: Value,
    /// The body as last stored (the input, or what a checkpoint wrote).
    base: Value,
    steps: Vec<Step>,
    interrupted: bool,
    notes: Vec<Note>,
    /// A retry request on the object (`persistence::retry`), if it decodes.
    retry: Option<crate::persistence::retry::Request>,
    /// The handlers run again because of it.
    retried: Vec<String>,
    /// The sub-handler records of the running handler reset by it (full id, record).
    resets: Vec<(String, ProgressRecord)>,
    /// The cycle's trace; each invocation is a span of it (`model::trace`).
    trace: crate::model::TraceContext,
    /// A handler failed in this cycle; one of them is to be retried.
    failed: bool,
    retrying: bool,
}

impl<'i, 'a> Cycle<'i, 'a> {
    /// Decides the finalizer change and the cause; `Err` is the plan of a cycle that runs no
    /// handler (gone, a finalizer to add first, nothing to handle).
    fn begin(input: &'i Input<'a>) -> Result<Self, Plan> {
        let body = input.body;
        if input.event == EventType::Deleted {
            return Err(Plan::idle(Cause::Gone, body, FinalizerChange::Keep));
        }
        let storage = input.storage;
        let deleting = body
            .pointer("/metadata/deletionTimestamp")
            .is_some_and(|v| !v.is_null());
        let present = has_finalizer(body, &storage.keys.finalizer);
        let rules = rules(storage, input.handlers);
        let watched = watched(storage, input.handlers);
        let new = rules.essence(body);
        let stored = fetch_diffbase(storage, &rules, body);
        let old = stored.as_ref().map(|s| s.overlay(&new, &watched));
        let body_only = Subject {
            body,
            old: None,
            new: None,
        };
        let must_block = storage.finalizers
            && input
                .handlers
                .iter()
                .any(|h| h.requires_finalizer() && matching::prematch(h, body_only));
        let mut finalizer = FinalizerChange::Keep;
        if !deleting && must_block && !present {
            return Err(Plan::idle(Cause::Noop, body, FinalizerChange::Add));
        }
        if !deleting && !must_block && present {
            finalizer = FinalizerChange::Remove;
        }
        // As in kopf: an object that no change handler could ever match is invisible to the
        // change machinery — no diff-base, no records, no writes (event-only operators, daemons).
        let changing = input
            .handlers
            .iter()
            .any(|h| h.kind.is_changing() && matching::prematch(h, body_only));
        if !changing {
            let finalizer = if deleting && present {
                FinalizerChange::Remove
            } else {
                finalizer
            };
            return Err(Plan::idle(Cause::Noop, body, finalizer));
        }
        let initial = input.memory.noticed_by_listing && !input.memory.fully_handled_once;
        let cause = causes::detect(Facts {
            event: input.event,
            deleting,
            finalizer_present: present,
            has_diffbase: stored.is_some(),
            changed: old.as_ref() != Some(&new),
            initial,
        });
        let (cause, forcing) = match cause {
            Cause::Noop => rerun(input, &storage.keys).map_or((cause, false), |c| (c, true)),
            cause => (cause, false),
        };
        // A handler watches a field that the stored diff-base does not cover (the handler was
        // added since): the field's value now becomes the base its changes are seen against.
        // The same for a whole essence whose unwatched values are out of date.
        if cause == Cause::Noop
            && !forcing
            && let Some(s) = &stored
            && (!s.covers(&watched) || s.stale(&new, &watched))
        {
            debug!("the diff-base is brought up to the watched fields");
            let mut desired = body.clone();
            storage
                .diffbase
                .store(&DiffBase::of(&new, &watched), &mut desired);
            mark_managed(storage, &mut desired);
            let mut plan = Plan::idle(cause, body, finalizer);
            plan.desired = Some(desired);
            plan.done = true;
            return Err(plan);
        }
        // A re-run of a creation sees no old state, as the creation did.
        let old = if forcing && cause == Cause::Create {
            None
        } else {
            old
        };
        let Some(reason) = cause.reason() else {
            let mut plan = Plan::idle(cause, body, finalizer);
            plan.done = cause == Cause::Noop;
            return Err(plan);
        };
        let trace = crate::model::TraceContext::root();
        tracing::Span::current().record("trace.id", tracing::field::display(trace.trace_id()));
        debug!(%cause, trace.id = %trace.trace_id(), "cycle started");
        Ok(Self {
            input,
            now: SystemTime::now(),
            rules,
            cause,
            reason,
            initial,
            forcing,
            stored,
            watched,
            old,
            new,
            finalizer,
            running: body.clone(),
            base: body.clone(),
            steps: Vec::new(),
            interrupted: false,
            notes: Vec::new(),
            retry: crate::persistence::retry::read(&storage.keys, body).and_then(Result::ok),
            retried: Vec::new(),
            resets: Vec::new(),
            trace,
            failed: false,
            retrying: false,
        })
    }

    /// Runs one selected handler, unless it is finished, sleeping, out of limits, or the cycle
    /// was interrupted; records the step.
    async fn run(&mut self, reg: &Registration, invoker: &dyn Invoker) {
        let storage = self.input.storage;
        let body = self.input.body;
        let now = self.now;
        let purpose = causes::purpose(self.reason);
        let fetched = storage
            .progress
            .fetch(&reg.id.0, body)
            .filter(|r| r.purpose.as_deref() == Some(purpose));
        let mut record = fetched
            .clone()
            .unwrap_or_else(|| ProgressRecord::started(now, purpose));
        let mut step = Step {
            registration: reg.clone(),
            fetched,
            before: record.clone(),
            record: ProgressRecord::default(),
            children: Vec::new(),
            patched: false,
            skipped: false,
            delta: Value::Null,
        };
        // After an interruption, a handler that has no record yet gets none: nothing of it is
        // known, and thousands of fresh records could outgrow the object's annotations.
        if self.interrupted && step.fetched.is_none() {
            return;
        }
        // A retry request runs a failed or delayed handler once more, now, whatever its limits;
        // a failed or delayed sub-handler runs again within its parent.
        let retry = self
            .retry
            .as_ref()
            .filter(|_| !self.interrupted && step.fetched.is_some());
        let retryable = |r: &ProgressRecord| !r.success && (r.failure || r.delayed.is_some());
        let forced_self = retry.is_some_and(|r| retryable(&record) && r.wants(&reg.id.0, &storage.keys));
        let resets: Vec<(String, ProgressRecord)> = retry
            .map(|r| {
                record
                    .subrefs
                    .iter()
                    // Named themselves, or their parent named: its failed children run again.
                    .filter(|full| r.wants(full, &storage.keys) || r.wants(&reg.id.0, &storage.keys))
                    .filter_map(|full| {
                        let child = storage
                            .progress
                            .fetch(full, body)
                            .filter(|c| c.purpose == record.purpose && retryable(c))?;
                        Some((full.clone(), reset(child)))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let forced = forced_self || !resets.is_empty();
        if forced {
            let requester = self.retry.as_ref().map(|r| r.requester()).unwrap_or_default();
            info!(handler.id = %reg.id, requested.by = requester, sub_handlers = resets.len(), "handler retried on request");
            record = reset(record);
            if forced_self {
                self.retried.push(reg.id.0.clone());
            }
            self.retried.extend(resets.iter().map(|(id, _)| id.clone()));
        }
        self.resets = resets;
        if self.forcing && step.fetched.is_none() {
            info!(handler.id = %reg.id, requested.by = self.retry.as_ref().map(|r| r.requester()).unwrap_or_default(), "handler of a completed change run again on request");
            self.retried.push(reg.id.0.clone());
            record.rerun = true;
        }
        if self.interrupted || record.finished() || record.sleeping(now) {
            self.steps.push(step.with(record));
            return;
        }
        if !forced && let Some(message) = execution::exhausted(reg, &record, now) {
            warn!(handler.id = %reg.id, %message, "handler gives up");
            record.stopped = Some(time::format(now));
            record.failure = true;
            record.message = Some(message);
            self.steps.push(step.with(record));
            return;
        }
        let (outcome, withdrawn) = self.invoke(reg, &record, &step, invoker).await;
        if withdrawn {
            info!(handler.id = %reg.id, "handler withdrawn while the cycle waited for it; the object is processed again with the handlers registered now");
            self.interrupted = true;
            self.steps.push(step.with(record));
            return;
        }
        if matches!(outcome, Outcome::Cancelled | Outcome::Abandoned) && self.input.cancel.is_cancelled() {
            self.interrupted = true;
            self.steps.push(step.with(record));
            return;
        }
        let reported = subhandlers_of(&outcome);
        if matches!(outcome, Outcome::Skipped) {
            step.skipped = true;
        }
        let verdict = execution::judge_with_guard(reg, &mut record, outcome, now, self.input.max_losses);
        record_children(
            storage,
            body,
            reg,
            &mut record,
            &mut step,
            reported,
            &self.resets,
            now,
        );
        self.apply(reg, verdict, &mut record, &mut step);
        self.steps.push(step.with(record));
    }

    /// Invokes a handler; while it runs longer than the checkpoint time, writes what the
    /// handlers before it finished and, for a handler with a `timeout`, its own start (so that
    /// a crash of the controller does not restart its timeout clock). A handler that answers
    /// within the checkpoint time costs no write of its own, nor does a lone handler without
    /// a timeout however long it runs.
    async fn invoke(
        &mut self,
        reg: &Registration,
        record: &ProgressRecord,
        step: &Step,
        invoker: &dyn Invoker,
    ) -> (Outcome, bool) {
        let children = child_states(self.input.storage, reg, self.input.body, record, &self.resets);
        let mut work = work(
            self.input,
            reg,
            self.reason,
            record,
            &self.running,
            self.old.as_ref(),
            &self.new,
            children,
        );
        work.trace = self.trace.child();
        debug!(handler.id = %reg.id, attempt = work.attempt, trace.id = %work.trace.trace_id(), "invoking");
        let token = self.input.cancel.child_token();
        let withdrawn = Arc::new(AtomicBool::new(false));
        let invocation = withdrawable(
            invoker.invoke(work, Control::cancelled_by(token.clone())),
            token,
            self.input.registered.clone(),
            reg.id.clone(),
            withdrawn.clone(),
        );
        let outcome = self.checkpointed_invocation(invocation, reg, record, step).await;
        (outcome, withdrawn.load(Ordering::Relaxed))
    }

    /// Awaits an invocation, checkpointing the progress so far if it runs past the checkpoint
    /// time: the handlers finished before it, and its start where that is used (its timeout).
    async fn checkpointed_invocation(
        &mut self,
        invocation: impl Future<Output = Outcome>,
        reg: &Registration,
        record: &ProgressRecord,
        step: &Step,
    ) -> Outcome {
        let unsaved = reg.timeout.is_some() && step.fetched.as_ref() != Some(record);
        let Some(checkpoint) = self
            .input
            .checkpoint
            .filter(|_| unsaved || !self.steps.is_empty())
        else {
            return invocation.await;
        };
        tokio::pin!(invocation);
        tokio::select! {
            outcome = &mut invocation => outcome,
            () = tokio::time::sleep(self.input.checkpoint_after) => {
                // The running handler's record as it is before its attempt ends: its start.
                self.steps.push(step.clone().with(record.clone()));
                self.checkpoint(checkpoint).await;
                self.steps.pop();
                invocation.await
            }
        }
    }

    /// Writes the progress of the steps so far.
    async fn checkpoint(&mut self, checkpoint: &dyn Checkpoint) {
        let partial = compose(
            &self.base,
            self.running.clone(),
            &self.steps,
            self.input,
            self.cause,
            &self.rules,
            (self.stored.as_ref(), &self.watched),
            FinalizerChange::Keep,
            false,
        );
        if let Some(desired) = partial.desired {
            debug!(
                steps = self.steps.len(),
                "a handler is still running; checkpointing the progress so far"
            );
            if let Some(stored) = checkpoint.save(&self.base, &desired).await {
                self.checkpointed(desired, &stored);
            }
        }
    }

    /// After a checkpoint: what it wrote becomes the base of the next write, with the server's
    /// `resourceVersion` and finalizer list. The final write then carries only this cycle's
    /// changes since the checkpoint: whatever others wrote meanwhile (a user's edit of the spec,
    /// another controller's status) stays, and an edit of the essence is still seen as a change
    /// by the next cycle (the diff-base comes from what the handlers saw, not from the stored
    /// body).
    fn checkpointed(&mut self, mut written: Value, stored: &Value) {
        let finalizers = |body: &Value| body.pointer("/metadata/finalizers").cloned();
        let server = finalizers(stored);
        if finalizers(&self.running) == finalizers(&self.base) {
            set_metadata(&mut self.running, "finalizers", server.clone());
        }
        set_metadata(&mut written, "finalizers", server);
        set_metadata(
            &mut written,
            "resourceVersion",
            stored.pointer("/metadata/resourceVersion").cloned(),
        );
        self.base = written;
    }

    /// Applies a verdict: a success's patches and results to the running body, and the notes
    /// to report.
    fn apply(&mut self, reg: &Registration, verdict: Verdict, record: &mut ProgressRecord, step: &mut Step) {
        let storage = self.input.storage;
        match verdict {
            Verdict::Success { result, patches } => {
                let mut scratch = self.running.clone();
                match apply_patches(&mut scratch, &patches) {
                    Ok(()) => {
                        step.patched = !patches.is_empty()
                            || result.is_some()
                            || step.children.iter().any(|c| c.result.is_some());
                        let before = std::mem::replace(&mut self.running, scratch);
                        if let Some(result) = result {
                            store_result(&mut self.running, &reg.id.0, result);
                        }
                        for child in &step.children {
                            if let Some(result) = &child.result {
                                store_result(&mut self.running, &child.id, result.clone());
                            }
                        }
                        step.delta = merge_diff(&before, &self.running).unwrap_or(Value::Null);
                        let unfinished =
                            unfinished_children(storage, self.input.body, record, &step.children, self.now);
                        if !unfinished.is_empty() {
                            reopen_for_children(record, &unfinished, self.now);
                        } else {
                            info!(handler.id = %reg.id, "handler succeeded");
                            // Debug: logged, not posted — one Event per handled change is the summary below.
                            self.notes.push(Note::new(
                                Level::Debug,
                                format!("Handler '{}' succeeded.", reg.id),
                                vec![reg.id.clone()],
                            ));
                        }
                    }
                    Err(d) => {
                        warn!(handler.id = %reg.id, problem = %d, "handler patch does not apply");
                        record.success = false;
                        record.failure = true;
                        record.message = Some(d.to_string());
                        self.failed = true;
                    }
                }
            }
            Verdict::Retry => {
                let error = record.message.as_deref().unwrap_or_default();
                let delayed = record.delayed.as_deref().unwrap_or_default();
                info!(handler.id = %reg.id, error, delayed, "handler will be retried");
                crate::observability::metrics::global().retry(reg.id.0.as_str());
                self.failed = true;
                self.retrying = true;
                self.notes.push(Note::new(
                    Level::Error,
                    format!("Handler '{}' failed temporarily: {error}", reg.id),
                    vec![reg.id.clone()],
                ));
            }
            Verdict::Failure => {
                let error = record.message.as_deref().unwrap_or_default();
                warn!(handler.id = %reg.id, error, "handler failed permanently");
                self.failed = true;
                self.notes.push(Note::new(
                    Level::Error,
                    format!("Handler '{}' failed permanently: {error}", reg.id),
                    vec![reg.id.clone()],
                ));
            }
            Verdict::Unrecorded => {}
        }
    }

    /// Folds the steps into the plan. An interrupted cycle (shutdown, pause) still records
    /// what finished before it.
    fn finish(mut self) -> Plan {
        let running = std::mem::take(&mut self.running);
        let mut plan = compose(
            &self.base,
            running,
            &self.steps,
            self.input,
            self.cause,
            &self.rules,
            (self.stored.as_ref(), &self.watched),
            self.finalizer,
            true,
        );
        if plan.done && !self.steps.is_empty() {
            let failed = self.steps.iter().filter(|s| s.record.failure).count();
            let succeeded = self.steps.iter().filter(|s| s.record.success).count();
            let what = match self.cause {
                Cause::Create => "Creation",
                Cause::Update => "Updating",
                Cause::Delete => "Deletion",
                _ => "Resuming",
            };
            let handlers = self.steps.iter().map(|s| s.registration.id.clone()).collect();
            self.notes.push(Note::new(
                Level::Info,
                format!("{what} is processed: {succeeded} succeeded; {failed} failed."),
                handlers,
            ));
        }
        plan.notes = std::mem::take(&mut self.notes);
        plan.interrupted = self.interrupted;
        plan.failed = self.failed;
        plan.retrying = self.retrying;
        if self.interrupted {
            plan.done = false;
            plan.wake_at = None;
        }
        if self.input.storage.conditions.covers(self.input.resource) && !self.interrupted {
            self.set_conditions(&mut plan);
        }
        consume_retry(self.input, &mut plan, &self.retried);
        plan
    }

    /// Sets the status conditions in the plan's desired body (and in its fallback, where the
    /// handlers whose patches the API rejects become retried attempts).
    fn set_conditions(&self, plan: &mut Plan) {
        use super::super::conditions::{Summary, apply};
        let message = |r: &ProgressRecord| r.message.clone().unwrap_or_default();
        // Sub-handlers count as handlers of their own: a parent may succeed while one of its
        // children failed for good.
        let records: Vec<(&str, &ProgressRecord)> = self
            .steps
            .iter()
            .flat_map(|s| {
                std::iter::once((s.registration.id.0.as_str(), &s.record))
                    .chain(s.children.iter().map(|c| (c.id.as_str(), &c.record)))
            })
            .collect();
        let summary = Summary {
            done: plan.done,
            failed: records
                .iter()
                .filter(|(_, r)| r.failure)
                .map(|(id, r)| ((*id).to_owned(), message(r)))
                .collect(),
            retrying: records
                .iter()
                .filter(|(_, r)| !r.finished() && r.delayed.is_some())
                .map(|(id, r)| ((*id).to_owned(), message(r)))
                .collect(),
            cause: match self.cause {
                Cause::Create => "creation",
                Cause::Update => "update",
                Cause::Delete => "deletion",
                _ => "resumption",
            }
            .to_owned(),
        };
        let mut desired = plan.desired.take().unwrap_or_else(|| plan.base.clone());
        apply(&mut desired, &summary, self.now);
        plan.desired = (desired != plan.base).then_some(desired);
        if let Some(fallback) = plan.fallback.as_mut() {
            let rejected = Summary {
                done: false,
                retrying: plan
                    .patched
                    .iter()
                    .map(|p| {
                        (
                            p.registration.id.0.clone(),
                            "the API server rejected its patch".to_owned(),
                        )
                    })
                    .collect(),
                ..summary
            };
            apply(fallback, &rejected, self.now);
        }
    }
}

/// Sets (or, with `None`, removes) one field of a body's metadata.
fn set_metadata(body: &mut Value, key: &str, value: Option<Value>) {
    let Some(meta) = body.get_mut("metadata").and_then(Value::as_object_mut) else {
        return;
    };
    match value {
        Some(v) => {
            meta.insert(key.to_owned(), v);
        }
        None => {
            meta.remove(key);
        }
    }
}

/// An invocation that is cancelled when its handler is withdrawn from the resource's handlers
/// (its process left) before it ends; `withdrawn` then says so.
async fn withdrawable(
    invocation: BoxFuture<'static, Outcome>,
    token: CancellationToken,
    registered: Option<tokio::sync::watch::Receiver<Arc<Vec<Registration>>>>,
    id: HandlerId,
    withdrawn: Arc<AtomicBool>,
) -> Outcome {
    let Some(mut registered) = registered else {
        return invocation.await;
    };
    tokio::pin!(invocation);
    tokio::select! {
        biased;
        outcome = &mut invocation => outcome,
        // Also when the sender is gone (the resource's watch stops).
        () = async {
            // The guard of the watched value is dropped before the branch runs.
            let _ = registered.wait_for(|handlers| !handlers.iter().any(|h| h.id == id)).await.map(drop);
        } => {
            token.cancel();
            // Work already in flight ends as it ends (a process that left loses it, and the
            // loss is recorded); only work that was still waiting is withdrawn.
            let outcome = invocation.await;
            withdrawn.store(outcome == Outcome::Cancelled, Ordering::Relaxed);
            outcome
        }
    }
}
