//! [`Registry`]: where handlers are registered, with kopf's options and filters.
//!
//! Each `on_*` method (and `index`, `daemon`, `timer`) stores the handler together with its
//! wire `HandlerRegistration` and returns a [`HandlerOptions`] handle whose chainable setters
//! refine that registration in place — kopf's decorator keyword arguments. Because the handle
//! writes through, dropping it at the end of a chain is the normal way to finish; that is why
//! its setters are not `#[must_use]`. Inconsistent options (kopf's decoration-time `TypeError`s,
//! such as `value` together with `old`) are collected and reported by
//! [`Registry::check`], which the runner and the test kit call (through the crate-private
//! `Registry::registrations`, which also yields the wire registrations) before anything runs.
//! The validated registry becomes the dispatch module's handler table.

use std::{collections::HashMap, sync::Arc, time::Duration};

use serde_json::Value;

use crate::{
    Context, Error, Handler, Operation, Selector, convert,
    error::Result,
    filters::{MetaFilter, ValueFilter, WhenFn},
    pb,
    pb::handler_registration::KindOptions,
};

/// How errors that a handler did not classify are treated (kopf's `ErrorsMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorsMode {
    /// Retried after the backoff.
    Temporary,
    /// Final failure, not retried until the next change.
    Permanent,
    /// Logged and treated as done.
    Ignored,
}

/// One registered handler.
pub(crate) struct Entry {
    pub(crate) registration: pb::HandlerRegistration,
    /// More resources the same handler is registered for (`also_for`).
    pub(crate) also: Vec<pb::ResourceSelector>,
    pub(crate) handler: Arc<dyn Handler>,
    pub(crate) when: Option<WhenFn>,
    problems: Vec<String>,
}

impl Entry {
    pub(crate) fn kind(&self) -> pb::HandlerKind {
        pb::HandlerKind::try_from(self.registration.kind).unwrap_or(pb::HandlerKind::Unspecified)
    }
}

/// The handlers of one handler process, registered kopf-style.
///
/// ```no_run
/// # use capstan_sdk::{Context, HandlerResult, Registry};
/// async fn create_fn(ctx: Context) -> HandlerResult {
///     Ok(Some(serde_json::json!({"message": format!("hello {}", ctx.name())})))
/// }
/// let mut registry = Registry::new();
/// registry.on_create("examples.demo.capstan.dev", "create_fn", create_fn).retries(5);
/// ```
#[derive(Default)]
pub struct Registry {
    entries: Vec<Entry>,
    memo: crate::Memo,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<&str> = self
            .entries
            .iter()
            .map(|e| e.registration.handler_id.as_str())
            .collect();
        f.debug_struct("Registry").field("handlers", &ids).finish()
    }
}

macro_rules! resource_kinds {
    ($($(#[$doc:meta])* $name:ident => $kind:ident;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(
                &mut self,
                selector: impl Into<Selector>,
                id: impl Into<String>,
                handler: impl Handler,
            ) -> HandlerOptions<'_> {
                self.add(pb::HandlerKind::$kind, Some(selector.into()), id.into(), Arc::new(handler))
            }
        )*
    };
}

macro_rules! activity_kinds {
    ($($(#[$doc:meta])* $name:ident => $kind:ident;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(&mut self, id: impl Into<String>, handler: impl Handler) -> HandlerOptions<'_> {
                self.add(pb::HandlerKind::$kind, None, id.into(), Arc::new(handler))
            }
        )*
    };
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The operator-wide memo (kopf's `kopf.run(memo=…)`): fill it before the operator runs.
    /// Activities get it as their memo; every object's memo starts as a shallow copy of it.
    pub fn memo(&self) -> &crate::Memo {
        &self.memo
    }

    resource_kinds! {
        /// Registers a handler called once when an object is first seen (kopf `on.create`).
        on_create => Create;
        /// Registers a handler called when the object's essence changes (kopf `on.update`).
        on_update => Update;
        /// Registers a handler called when the object is marked for deletion (kopf `on.delete`).
        /// The object keeps a finalizer until it succeeds unless it is [`HandlerOptions::optional`].
        on_delete => Delete;
        /// Registers a handler for objects that existed before the controller started
        /// (kopf `on.resume`).
        on_resume => Resume;
        /// Registers a handler called for every watch event; not persisted, not retried by
        /// default (kopf `on.event`).
        on_event => Event;
        /// Registers an index handler; its result is the object's index value (kopf `index`).
        index => Index;
        /// Registers a daemon: one long invocation per object, cancelled when the object goes
        /// away (kopf `daemon`).
        daemon => Daemon;
        /// Registers a timer, invoked every [`HandlerOptions::interval`] per object (kopf
        /// `timer`).
        timer => Timer;
        /// Registers a validating admission handler (kopf `on.validate`); deny with
        /// [`crate::HandlerError::deny`].
        on_validate => Validate;
        /// Registers a mutating admission handler (kopf `on.mutate`); changes go in
        /// [`Context::patch`].
        on_mutate => Mutate;
    }

    activity_kinds! {
        /// Registers a handler run once before any watching starts (kopf `on.startup`).
        on_startup => Startup;
        /// Registers a handler run once when the controller stops (kopf `on.cleanup`).
        on_cleanup => Cleanup;
        /// Registers a handler returning API credentials (kopf `on.login`).
        on_login => Login;
        /// Registers a handler whose result is served by the liveness endpoint (kopf
        /// `on.probe`).
        on_probe => Probe;
    }

    /// Registers a handler called when the dotted `field` changes, for any cause (kopf
    /// `on.field`). As in kopf, the handler id becomes `<id>/<field>`.
    pub fn on_field(
        &mut self,
        selector: impl Into<Selector>,
        field: &str,
        id: impl Into<String>,
        handler: impl Handler,
    ) -> HandlerOptions<'_> {
        let id = format!("{}/{field}", id.into());
        let mut options = self.add(
            pb::HandlerKind::Field,
            Some(selector.into()),
            id,
            Arc::new(handler),
        );
        options.filters().field = field.to_owned();
        options
    }

    fn add(
        &mut self,
        kind: pb::HandlerKind,
        selector: Option<Selector>,
        handler_id: String,
        handler: Arc<dyn Handler>,
    ) -> HandlerOptions<'_> {
        let kind_options = match kind {
            pb::HandlerKind::Daemon => Some(KindOptions::Daemon(pb::DaemonOptions::default())),
            pb::HandlerKind::Timer => Some(KindOptions::Timer(pb::TimerOptions::default())),
            pb::HandlerKind::Validate | pb::HandlerKind::Mutate => {
                Some(KindOptions::Admission(pb::AdmissionOptions::default()))
            }
            pb::HandlerKind::Delete => Some(KindOptions::Delete(pb::DeleteOptions::default())),
            pb::HandlerKind::Resume => Some(KindOptions::Resume(pb::ResumeOptions::default())),
            _ => None,
        };
        let registration = pb::HandlerRegistration {
            handler_id,
            kind: kind as i32,
            resource: selector.map(|s| s.to_pb()),
            filters: None,
            kind_options,
            ..pb::HandlerRegistration::default()
        };
        self.entries.push(Entry {
            registration,
            also: Vec::new(),
            handler,
            when: None,
            problems: Vec::new(),
        });
        let index = self.entries.len() - 1;
        HandlerOptions {
            entry: &mut self.entries[index],
        }
    }

    /// Checks the registrations as kopf does at decoration time, as [`crate::Operator::run`]
    /// and [`crate::testing::TestKit::new`] do before anything runs.
    ///
    /// # Errors
    ///
    /// [`Error::Register`] for the first inconsistent registration: an empty or duplicate id, an
    /// option that does not apply to the handler's kind, `value`/`old`/`new` without `field`,
    /// `value` together with `old`/`new`, or a timer without an interval.
    pub fn check(&self) -> Result<()> {
        self.registrations().map(drop)
    }

    /// The wire registrations sent in `Hello`, after checking them (see [`Registry::check`]).
    pub(crate) fn registrations(&self) -> Result<Vec<pb::HandlerRegistration>> {
        let mut seen = HashMap::new();
        for entry in &self.entries {
            let id = &entry.registration.handler_id;
            let fail = |reason: &str| Error::Register {
                handler_id: id.clone(),
                reason: reason.to_owned(),
            };
            if id.is_empty() {
                return Err(fail("the handler id is empty"));
            }
            if seen.insert(id.as_str(), ()).is_some() {
                return Err(fail("the handler id is registered twice"));
            }
            if let Some(problem) = entry.problems.first() {
                return Err(fail(problem));
            }
            if let Some(filters) = &entry.registration.filters {
                let has_value = filters.value.is_some();
                let has_old_new = filters.old.is_some() || filters.new.is_some();
                if (has_value || has_old_new) && filters.field.is_empty() {
                    return Err(fail("`value`, `old` and `new` need `field`"));
                }
                if has_value && has_old_new {
                    return Err(fail("`value` cannot be combined with `old` or `new`"));
                }
                let kind = entry.kind();
                if has_old_new && !matches!(kind, pb::HandlerKind::Update | pb::HandlerKind::Field) {
                    return Err(fail("`old` and `new` apply only to update and field handlers"));
                }
            }
            if let Some(KindOptions::Timer(timer)) = &entry.registration.kind_options
                && timer.interval.is_none()
            {
                return Err(fail("a timer needs an interval"));
            }
        }
        Ok(self
            .entries
            .iter()
            .flat_map(|e| {
                std::iter::once(e.registration.clone()).chain(e.also.iter().map(|selector| {
                    let mut r = e.registration.clone();
                    r.resource = Some(selector.clone());
                    r
                }))
            })
            .collect())
    }

    /// Validates the registry and turns it into the dispatch table.
    pub(crate) fn into_table(self) -> Result<Table> {
        let registrations = self.registrations()?;
        let indexes = crate::index::Indexes::new(
            self.entries
                .iter()
                .filter(|e| e.kind() == pb::HandlerKind::Index)
                .map(|e| e.registration.handler_id.as_str()),
        );
        let mut by_id = HashMap::new();
        for (index, entry) in self.entries.into_iter().enumerate() {
            by_id.insert(entry.registration.handler_id.clone(), (index, Arc::new(entry)));
        }
        Ok(Table {
            by_id,
            registrations,
            indexes,
            memos: crate::memo::Memos::new(self.memo),
        })
    }
}

/// The validated handlers of a process, shared by the connection's invocation tasks.
pub(crate) struct Table {
    by_id: HashMap<String, (usize, Arc<Entry>)>,
    registrations: Vec<pb::HandlerRegistration>,
    /// The indexes of this process's index handlers.
    pub(crate) indexes: crate::index::Indexes,
    /// The operator-wide memo and the objects' memos.
    pub(crate) memos: crate::memo::Memos,
}

impl Table {
    pub(crate) fn get(&self, handler_id: &str) -> Option<&Arc<Entry>> {
        self.by_id.get(handler_id).map(|(_, entry)| entry)
    }

    pub(crate) fn registrations(&self) -> &[pb::HandlerRegistration] {
        &self.registrations
    }

    /// The entries in registration order.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(crate) fn entries(&self) -> Vec<&Arc<Entry>> {
        let mut entries: Vec<_> = self.by_id.values().collect();
        entries.sort_by_key(|(index, _)| *index);
        entries.into_iter().map(|(_, entry)| entry).collect()
    }
}

/// Options of one registered handler: kopf's decorator keyword arguments.
///
/// The setters write through to the registry, so a chain may simply end; options that do not
/// apply to the handler's kind make [`Registry::check`] fail.
pub struct HandlerOptions<'a> {
    entry: &'a mut Entry,
}

impl std::fmt::Debug for HandlerOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerOptions")
            .field("registration", &self.entry.registration)
            .finish()
    }
}

impl HandlerOptions<'_> {
    /// Registers the same handler for another resource selector too. Where several selectors
    /// name the same resource, the controller calls the handler once per event of an object,
    /// as kopf does for one function under several decorators.
    pub fn also_for(self, selector: impl Into<Selector>) -> Self {
        let selector: Selector = selector.into();
        self.entry.also.push(selector.to_pb());
        self
    }

    fn filters(&mut self) -> &mut pb::Filters {
        self.entry
            .registration
            .filters
            .get_or_insert_with(pb::Filters::default)
    }

    fn kind(&self) -> pb::HandlerKind {
        self.entry.kind()
    }

    fn problem(&mut self, option: &str) {
        let kind = self.kind().as_str_name();
        self.entry
            .problems
            .push(format!("`{option}` does not apply to {kind} handlers"));
    }

    fn resource_filter(&mut self, option: &str) -> bool {
        if self.entry.registration.resource.is_none() {
            self.problem(option);
            return false;
        }
        true
    }

    fn daemon_options(&mut self, option: &str) -> Option<&mut pb::DaemonOptions> {
        if !matches!(self.entry.registration.kind_options, Some(KindOptions::Daemon(_))) {
            self.problem(option);
        }
        match &mut self.entry.registration.kind_options {
            Some(KindOptions::Daemon(options)) => Some(options),
            _ => None,
        }
    }

    fn timer_options(&mut self, option: &str) -> Option<&mut pb::TimerOptions> {
        if !matches!(self.entry.registration.kind_options, Some(KindOptions::Timer(_))) {
            self.problem(option);
        }
        match &mut self.entry.registration.kind_options {
            Some(KindOptions::Timer(options)) => Some(options),
            _ => None,
        }
    }

    fn admission_options(&mut self, option: &str) -> Option<&mut pb::AdmissionOptions> {
        if !matches!(
            self.entry.registration.kind_options,
            Some(KindOptions::Admission(_))
        ) {
            self.problem(option);
        }
        match &mut self.entry.registration.kind_options {
            Some(KindOptions::Admission(options)) => Some(options),
            _ => None,
        }
    }

    /// How unclassified errors are treated; default: the kind's (kopf's) default.
    pub fn errors(self, mode: ErrorsMode) -> Self {
        let mode = match mode {
            ErrorsMode::Temporary => pb::ErrorsMode::Temporary,
            ErrorsMode::Permanent => pb::ErrorsMode::Permanent,
            ErrorsMode::Ignored => pb::ErrorsMode::Ignored,
        };
        self.entry.registration.errors_mode = mode as i32;
        self
    }

    /// At most this many attempts in total; default unlimited.
    pub fn retries(self, attempts: u32) -> Self {
        self.entry.registration.retries = attempts;
        self
    }

    /// Delay before retrying an unclassified error; default 60 s.
    pub fn backoff(self, delay: Duration) -> Self {
        self.entry.registration.backoff = Some(convert::duration_to_pb(delay));
        self
    }

    /// Give up once this long has passed since the first attempt; also bounds each attempt.
    pub fn timeout(self, timeout: Duration) -> Self {
        self.entry.registration.timeout = Some(convert::duration_to_pb(timeout));
        self
    }

    /// At most this many invocations of this handler in flight at once; 0: the default.
    pub fn max_in_flight(self, limit: u32) -> Self {
        self.entry.registration.max_in_flight = limit;
        self
    }

    /// An opaque value echoed in every invocation ([`Context::param`]).
    pub fn param(self, param: impl Into<Value>) -> Self {
        self.entry.registration.param = Some(convert::json_to_pb(&param.into()));
        self
    }

    /// Only objects whose label `key` matches: an exact value or a [`crate::Presence`].
    pub fn label(mut self, key: impl Into<String>, filter: impl Into<MetaFilter>) -> Self {
        if self.resource_filter("label") {
            self.filters().labels.insert(key.into(), filter.into().to_pb());
        }
        self
    }

    /// Several label filters at once.
    pub fn labels<K: Into<String>, F: Into<MetaFilter>>(
        self,
        filters: impl IntoIterator<Item = (K, F)>,
    ) -> Self {
        filters
            .into_iter()
            .fold(self, |options, (key, filter)| options.label(key, filter))
    }

    /// Only objects whose annotation `key` matches: an exact value or a [`crate::Presence`].
    pub fn annotation(mut self, key: impl Into<String>, filter: impl Into<MetaFilter>) -> Self {
        if self.resource_filter("annotation") {
            self.filters()
                .annotations
                .insert(key.into(), filter.into().to_pb());
        }
        self
    }

    /// Several annotation filters at once.
    pub fn annotations<K: Into<String>, F: Into<MetaFilter>>(
        self,
        filters: impl IntoIterator<Item = (K, F)>,
    ) -> Self {
        filters
            .into_iter()
            .fold(self, |options, (key, filter)| options.annotation(key, filter))
    }

    /// The dotted field that `value`, `old` and `new` test.
    pub fn field(mut self, field: impl Into<String>) -> Self {
        if self.resource_filter("field") {
            self.filters().field = field.into();
        }
        self
    }

    /// The field's value must match (in the old or new state for change handlers).
    pub fn value(mut self, filter: impl Into<ValueFilter>) -> Self {
        if self.resource_filter("value") {
            self.filters().value = Some(filter.into().to_pb());
        }
        self
    }

    /// The field's old value must match (update and field handlers).
    pub fn old(mut self, filter: impl Into<ValueFilter>) -> Self {
        if self.resource_filter("old") {
            self.filters().old = Some(filter.into().to_pb());
        }
        self
    }

    /// The field's new value must match (update and field handlers).
    pub fn new(mut self, filter: impl Into<ValueFilter>) -> Self {
        if self.resource_filter("new") {
            self.filters().new = Some(filter.into().to_pb());
        }
        self
    }

    /// A callable filter evaluated by the SDK before the handler runs (kopf's `when=`); when
    /// it returns `false` the invocation is answered `Skipped` and nothing is recorded.
    pub fn when(mut self, filter: impl Fn(&Context) -> bool + Send + Sync + 'static) -> Self {
        if self.resource_filter("when") {
            self.filters().sdk_when = true;
            self.entry.when = Some(Arc::new(filter));
        }
        self
    }

    /// A delete handler that never blocks deletion with a finalizer (kopf `optional=True`).
    pub fn optional(mut self, optional: bool) -> Self {
        match &mut self.entry.registration.kind_options {
            Some(KindOptions::Delete(options)) => options.optional = optional,
            _ => self.problem("optional"),
        }
        self
    }

    /// A resume handler that also resumes objects already marked for deletion.
    pub fn deleted(mut self, deleted: bool) -> Self {
        match &mut self.entry.registration.kind_options {
            Some(KindOptions::Resume(options)) => options.deleted = deleted,
            _ => self.problem("deleted"),
        }
        self
    }

    /// Delay between the object's appearance and the daemon's start or the timer's first tick.
    pub fn initial_delay(mut self, delay: Duration) -> Self {
        let delay = Some(convert::duration_to_pb(delay));
        match &mut self.entry.registration.kind_options {
            Some(KindOptions::Daemon(options)) => options.initial_delay = delay,
            Some(KindOptions::Timer(options)) => options.initial_delay = delay,
            _ => self.problem("initial_delay"),
        }
        self
    }

    /// A daemon's grace between a stop request and its cancellation.
    pub fn cancellation_backoff(mut self, delay: Duration) -> Self {
        if let Some(options) = self.daemon_options("cancellation_backoff") {
            options.cancellation_backoff = Some(convert::duration_to_pb(delay));
        }
        self
    }

    /// How long a cancelled daemon may take to end before it is abandoned; default forever.
    pub fn cancellation_timeout(mut self, timeout: Duration) -> Self {
        if let Some(options) = self.daemon_options("cancellation_timeout") {
            options.cancellation_timeout = Some(convert::duration_to_pb(timeout));
        }
        self
    }

    /// How long to wait before restarting a daemon that failed temporarily without asking for
    /// a delay (default: the handler's backoff). A daemon that returns, or fails permanently,
    /// is done for its object until the controller restarts (kopf).
    pub fn restart_backoff(mut self, delay: Duration) -> Self {
        if let Some(options) = self.daemon_options("restart_backoff") {
            options.restart_backoff = Some(convert::duration_to_pb(delay));
        }
        self
    }

    /// Without effect, kept for compatibility: a daemon that returns is never restarted (kopf's
    /// semantics); to run again later, fail with [`crate::HandlerError::temporary`] and a delay.
    #[deprecated(note = "daemons that return are never restarted; this option has no effect")]
    pub fn no_restart_after_success(mut self, no_restart: bool) -> Self {
        if let Some(options) = self.daemon_options("no_restart_after_success") {
            options.no_restart_after_success = no_restart;
        }
        self
    }

    /// A timer's period. Required for timers.
    pub fn interval(mut self, interval: Duration) -> Self {
        if let Some(options) = self.timer_options("interval") {
            options.interval = Some(convert::duration_to_pb(interval));
        }
        self
    }

    /// Only tick once the object has not changed for this long.
    pub fn idle(mut self, idle: Duration) -> Self {
        if let Some(options) = self.timer_options("idle") {
            options.idle = Some(convert::duration_to_pb(idle));
        }
        self
    }

    /// Align ticks to a fixed schedule instead of counting from the previous tick's end.
    pub fn sharp(mut self, sharp: bool) -> Self {
        if let Some(options) = self.timer_options("sharp") {
            options.sharp = sharp;
        }
        self
    }

    /// The admission operations intercepted; default all. [`Operation::Unknown`] is refused
    /// (the registration fails, as the controller would refuse it).
    pub fn operations(mut self, operations: impl IntoIterator<Item = Operation>) -> Self {
        let operations: Vec<Operation> = operations.into_iter().collect();
        let unknown = operations.contains(&Operation::Unknown);
        // Said only of an admission handler: another kind's problem is that it has no
        // operations at all.
        let applies = match self.admission_options("operations") {
            Some(options) => {
                options.operations = operations
                    .into_iter()
                    .filter(|op| *op != Operation::Unknown)
                    .map(|op| op.to_pb() as i32)
                    .collect();
                true
            }
            None => false,
        };
        if applies && unknown {
            self.entry
                .problems
                .push("`operations` names an unknown operation (CREATE, UPDATE, DELETE, CONNECT)".to_owned());
        }
        self
    }

    /// The subresource an admission handler intercepts, e.g. `status`.
    pub fn subresource(mut self, subresource: impl Into<String>) -> Self {
        if let Some(options) = self.admission_options("subresource") {
            options.subresource = subresource.into();
        }
        self
    }

    /// Declare that the admission handler has side effects.
    pub fn side_effects(mut self, side_effects: bool) -> Self {
        if let Some(options) = self.admission_options("side_effects") {
            options.side_effects = side_effects;
        }
        self
    }

    /// Fail open: admit requests when the handler is unreachable or fails.
    pub fn ignore_failures(mut self, ignore: bool) -> Self {
        if let Some(options) = self.admission_options("ignore_failures") {
            options.ignore_failures = ignore;
        }
        self
    }

    /// A label selector (Kubernetes syntax, e.g. `app=db,tier in (a,b)`): the handler is
    /// called only for objects it selects. When every handler of the resource gives the same
    /// selectors, the controller's watch applies them on the server and watches fewer objects.
    pub fn label_selector(mut self, selector: impl Into<String>) -> Self {
        match &mut self.entry.registration.resource {
            Some(resource) => resource.label_selector = selector.into(),
            None => self.problem("label_selector"),
        }
        self
    }

    /// A field selector (e.g. `spec.nodeName=node-1` for node-local handlers), with the same
    /// scope as [`label_selector`](Self::label_selector). A missing field compares as empty.
    pub fn field_selector(mut self, selector: impl Into<String>) -> Self {
        match &mut self.entry.registration.resource {
            Some(resource) => resource.field_selector = selector.into(),
            None => self.problem("field_selector"),
        }
        self
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::{HandlerResult, Presence};

    async fn noop(_ctx: Context) -> HandlerResult {
        Ok(None)
    }

    #[test]
    fn field_handlers_get_kopf_ids_and_filters() {
        let mut registry = Registry::new();
        registry
            .on_field("cex", "spec.field", "field_fn", noop)
            .new(Presence::Present);
        let regs = registry.registrations().unwrap();
        assert_eq!(regs[0].handler_id, "field_fn/spec.field");
        let filters = regs[0].filters.as_ref().unwrap();
        assert_eq!(filters.field, "spec.field");
        assert!(filters.new.is_some());
    }

    #[test]
    fn options_land_in_the_registration() {
        let mut registry = Registry::new();
        registry
            .on_create("demo.capstan.dev/v1/examples", "create_fn", noop)
            .errors(ErrorsMode::Permanent)
            .retries(3)
            .backoff(Duration::from_secs(5))
            .timeout(Duration::from_secs(60))
            .param(json!({"x": 1}))
            .label("app", "db")
            .annotation("skip", Presence::Absent)
            .when(|ctx| ctx.name() != "ignored");
        registry
            .timer("cex", "tick", noop)
            .interval(Duration::from_secs(10))
            .sharp(true);
        registry.on_delete("cex", "delete_fn", noop).optional(true);
        let regs = registry.registrations().unwrap();
        let create = &regs[0];
        assert_eq!(create.errors_mode, pb::ErrorsMode::Permanent as i32);
        assert_eq!(create.retries, 3);
        assert_eq!(create.resource.as_ref().unwrap().group, "demo.capstan.dev");
        let filters = create.filters.as_ref().unwrap();
        assert!(
            filters.sdk_when
                && filters.labels.contains_key("app")
                && filters.annotations.contains_key("skip")
        );
        assert!(
            matches!(&regs[1].kind_options, Some(KindOptions::Timer(t)) if t.sharp && t.interval.is_some())
        );
        assert!(matches!(&regs[2].kind_options, Some(KindOptions::Delete(d)) if d.optional));
    }

    #[test]
    fn declarative_options_land_in_the_registration() {
        let mut registry = Registry::new();
        registry
            .on_create("cex", "labelled", noop)
            .label("app", "db")
            .annotation("skip", Presence::Absent)
            .field("spec.size")
            .value(Presence::Present)
            .retries(3)
            .backoff(Duration::from_secs(7))
            .timeout(Duration::from_secs(60));
        registry.on_resume("cex", "resume", noop).deleted(true);
        registry
            .daemon("cex", "monitor", noop)
            .initial_delay(Duration::from_secs(1))
            .cancellation_timeout(Duration::from_secs(5));
        registry
            .timer("cex", "tick", noop)
            .interval(Duration::from_secs(10))
            .idle(Duration::from_secs(3));
        registry
            .on_validate("cex", "validate", noop)
            .operations([Operation::Create, Operation::Update]);
        registry.on_startup("startup", noop);
        let regs = registry.registrations().unwrap();
        let labelled = &regs[0];
        assert_eq!(labelled.kind, pb::HandlerKind::Create as i32);
        assert_eq!(labelled.resource.as_ref().unwrap().name, "cex");
        let filters = labelled.filters.as_ref().unwrap();
        assert_eq!(
            filters.labels["app"].condition,
            Some(pb::meta_match::Condition::Equals("db".to_owned()))
        );
        assert_eq!(
            filters.annotations["skip"].condition,
            Some(pb::meta_match::Condition::Presence(pb::Presence::Absent as i32))
        );
        assert_eq!(filters.field, "spec.size");
        assert!(filters.value.is_some());
        assert_eq!(
            (
                labelled.retries,
                labelled.backoff.unwrap().seconds,
                labelled.timeout.unwrap().seconds
            ),
            (3, 7, 60)
        );
        assert!(matches!(&regs[1].kind_options, Some(KindOptions::Resume(r)) if r.deleted));
        assert!(
            matches!(&regs[2].kind_options, Some(KindOptions::Daemon(d)) if d.initial_delay.is_some() && d.cancellation_timeout.is_some())
        );
        assert!(matches!(&regs[3].kind_options, Some(KindOptions::Timer(t)) if t.idle.is_some()));
        assert!(matches!(
            &regs[4].kind_options,
            Some(KindOptions::Admission(a))
                if a.operations == [pb::Operation::Create as i32, pb::Operation::Update as i32]
        ));
        assert!(regs[5].resource.is_none());
    }

    #[test]
    fn inconsistent_registrations_are_rejected() {
        fn invalid(build: impl FnOnce(&mut Registry)) -> bool {
            let mut registry = Registry::new();
            build(&mut registry);
            registry.check().is_err()
        }
        assert!(invalid(|r| {
            let _ = r.on_create("cex", "a", noop).interval(Duration::from_secs(1));
        }));
        assert!(invalid(|r| {
            let _ = r.on_create("cex", "a", noop).value(1_i64);
        }));
        assert!(invalid(|r| {
            let _ = r
                .on_update("cex", "a", noop)
                .field("spec.x")
                .value(1_i64)
                .old(2_i64);
        }));
        assert!(invalid(|r| {
            let _ = r.on_create("cex", "a", noop).field("spec.x").new(1_i64);
        }));
        assert!(invalid(|r| {
            let _ = r.timer("cex", "a", noop);
        }));
        assert!(invalid(|r| {
            let _ = r.on_startup("a", noop).label("x", "y");
        }));
        assert!(invalid(|r| {
            r.on_create("cex", "a", noop);
            r.on_update("cex", "a", noop);
        }));
        assert!(invalid(|r| {
            let _ = r.on_create("cex", "", noop);
        }));
        assert!(invalid(|r| {
            let _ = r
                .on_validate("cex", "a", noop)
                .operations([Operation::Create, Operation::Unknown]);
        }));
        assert!(!invalid(|r| {
            let _ = r.on_validate("cex", "a", noop).operations([Operation::Delete]);
        }));
        assert!(!invalid(|r| {
            let _ = r.on_update("cex", "a", noop).field("spec.x").old(1_i64);
        }));
    }
}
