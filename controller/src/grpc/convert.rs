//! Conversions between the wire types of `capstan.v1` and the controller's `model` types, with
//! validation.
//!
//! Everything the handler process sends is untrusted input: registrations are checked one by
//! one (a bad one is rejected with diagnostics while the others are accepted), JSON must parse,
//! merge patches must be objects and JSON patches valid RFC 6902 operation lists. Nothing here
//! panics on bad input.

use std::time::{Duration, SystemTime};

use capstan_proto::pb;
use serde_json::Value;

use crate::model::{
    self, Activity, AdmissionOptions, CancelReason, ChangeReason, DaemonOptions, Diagnostic, DiffOperation,
    ErrorsMode, EventType, HandlerKind, KindOptions, KindResult, Level, MetaMatch, ObjectSelector, Outcome,
    Patch, PatchTarget, PatchType, Payload, Policy, Posting, Registration, ResolvedResource, ResourceRef,
    ResourceSelector, Severity, SubhandlerOutcome, TimerOptions, ValueMatch, Work,
};

/// Converts and validates one registration. `index` is its position in `Hello.handlers`, used
/// in diagnostics.
///
/// # Errors
/// Every problem found, as diagnostics pointing at the offending field.
pub fn registration(index: usize, reg: &pb::HandlerRegistration) -> Result<Registration, Vec<Diagnostic>> {
    let at = |field: &str| format!("handlers[{index}].{field}");
    let mut problems = Vec::new();
    if reg.handler_id.trim().is_empty() {
        problems
            .push(Diagnostic::error("INVALID_HANDLER_ID", "the handler id is empty").at(at("handler_id")));
    }
    let kind = match handler_kind(reg.kind) {
        Some(kind) => kind,
        None => {
            problems.push(
                Diagnostic::error(
                    "UNKNOWN_HANDLER_KIND",
                    format!("unknown handler kind {}", reg.kind),
                )
                .at(at("kind")),
            );
            return Err(problems);
        }
    };
    let selector = match (&reg.resource, kind.is_resource_kind()) {
        (Some(sel), true) if !sel.name.trim().is_empty() => Some(ResourceSelector {
            group: sel.group.clone(),
            version: sel.version.clone(),
            name: sel.name.clone(),
            label_selector: sel.label_selector.clone(),
            field_selector: sel.field_selector.clone(),
        }),
        (_, true) => {
            problems.push(
                Diagnostic::error(
                    "MISSING_RESOURCE",
                    format!("{kind} handlers need a resource selector"),
                )
                .at(at("resource")),
            );
            None
        }
        (Some(_), false) => {
            problems.push(
                Diagnostic::error(
                    "UNEXPECTED_RESOURCE",
                    format!("{kind} handlers take no resource selector"),
                )
                .at(at("resource")),
            );
            None
        }
        (None, false) => None,
    };
    let mut out = Registration::new(reg.handler_id.clone(), kind, selector);
    match filters(reg.filters.as_ref(), kind) {
        Ok(f) => out.filters = f,
        Err(mut diags) => {
            for d in &mut diags {
                d.field = at(&format!("filters.{}", d.field));
            }
            problems.extend(diags);
        }
    }
    out.errors = match pb::ErrorsMode::try_from(reg.errors_mode) {
        Ok(pb::ErrorsMode::Unspecified) => kind.default_errors_mode(),
        Ok(pb::ErrorsMode::Temporary) => ErrorsMode::Temporary,
        Ok(pb::ErrorsMode::Permanent) => ErrorsMode::Permanent,
        Ok(pb::ErrorsMode::Ignored) => ErrorsMode::Ignored,
        Err(_) => {
            problems.push(
                Diagnostic::error(
                    "UNKNOWN_ERRORS_MODE",
                    format!("unknown errors mode {}", reg.errors_mode),
                )
                .at(at("errors_mode")),
            );
            kind.default_errors_mode()
        }
    };
    if let Some(sel) = reg.resource.as_ref().filter(|_| kind.is_resource_kind()) {
        match ObjectSelector::parse(&sel.label_selector, &sel.field_selector) {
            Ok(parsed) => out.filters.selector = parsed,
            Err(e) => {
                let name = if ObjectSelector::parse(&sel.label_selector, "").is_err() {
                    "label_selector"
                } else {
                    "field_selector"
                };
                problems.push(
                    Diagnostic::error("BAD_SELECTOR", format!("{name}: {e}"))
                        .at(at(&format!("resource.{name}"))),
                );
            }
        }
    }
    out.retries = (reg.retries > 0).then_some(reg.retries);
    if let Some(backoff) = duration(reg.backoff.as_ref(), &at("backoff"), &mut problems) {
        out.backoff = backoff;
    }
    out.timeout = duration(reg.timeout.as_ref(), &at("timeout"), &mut problems).filter(|d| !d.is_zero());
    out.max_in_flight = (reg.max_in_flight > 0).then_some(reg.max_in_flight);
    out.param = match reg.param.as_ref().map(json) {
        Some(Ok(v)) => Some(v),
        Some(Err(e)) => {
            problems
                .push(Diagnostic::error("MALFORMED_JSON", format!("param is not JSON: {e}")).at(at("param")));
            None
        }
        None => None,
    };
    out.options = kind_options(reg, kind, &at, &mut problems);
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(problems)
    }
}

fn kind_options(
    reg: &pb::HandlerRegistration,
    kind: HandlerKind,
    at: &dyn Fn(&str) -> String,
    problems: &mut Vec<Diagnostic>,
) -> KindOptions {
    use pb::handler_registration::KindOptions as K;
    let mismatch = |name: &str| {
        Diagnostic::error(
            "OPTIONS_KIND_MISMATCH",
            format!("{name} options given for a {kind} handler"),
        )
        .at(at(name))
    };
    match (&reg.kind_options, kind) {
        (None, HandlerKind::Timer) => {
            problems.push(
                Diagnostic::error("MISSING_INTERVAL", "timer handlers need an interval").at(at("timer")),
            );
            KindOptions::None
        }
        (None, _) => KindOptions::None,
        (Some(K::Daemon(d)), HandlerKind::Daemon) => KindOptions::Daemon(DaemonOptions {
            initial_delay: duration(d.initial_delay.as_ref(), &at("daemon.initial_delay"), problems)
                .unwrap_or_default(),
            cancellation_backoff: duration(
                d.cancellation_backoff.as_ref(),
                &at("daemon.cancellation_backoff"),
                problems,
            ),
            cancellation_timeout: duration(
                d.cancellation_timeout.as_ref(),
                &at("daemon.cancellation_timeout"),
                problems,
            ),
            restart_backoff: duration(
                d.restart_backoff.as_ref(),
                &at("daemon.restart_backoff"),
                problems,
            ),
            no_restart_after_success: d.no_restart_after_success,
        }),
        (Some(K::Timer(t)), HandlerKind::Timer) => {
            let interval = duration(t.interval.as_ref(), &at("timer.interval"), problems).unwrap_or_default();
            if interval.is_zero() {
                problems.push(
                    Diagnostic::error("MISSING_INTERVAL", "timer handlers need a positive interval")
                        .at(at("timer.interval")),
                );
            }
            KindOptions::Timer(TimerOptions {
                interval,
                initial_delay: duration(t.initial_delay.as_ref(), &at("timer.initial_delay"), problems)
                    .unwrap_or_default(),
                idle: duration(t.idle.as_ref(), &at("timer.idle"), problems),
                sharp: t.sharp,
            })
        }
        (Some(K::Admission(a)), HandlerKind::Validate | HandlerKind::Mutate) => {
            let mut operations = Vec::new();
            for op in &a.operations {
                match pb::Operation::try_from(*op) {
                    Ok(pb::Operation::Create) => operations.push("CREATE".to_owned()),
                    Ok(pb::Operation::Update) => operations.push("UPDATE".to_owned()),
                    Ok(pb::Operation::Delete) => operations.push("DELETE".to_owned()),
                    Ok(pb::Operation::Connect) => operations.push("CONNECT".to_owned()),
                    _ => problems.push(
                        Diagnostic::error("UNKNOWN_OPERATION", format!("unknown admission operation {op}"))
                            .at(at("admission.operations")),
                    ),
                }
            }
            KindOptions::Admission(AdmissionOptions {
                operations,
                subresource: a.subresource.clone(),
                side_effects: a.side_effects,
                ignore_failures: a.ignore_failures,
            })
        }
        (Some(K::Delete(d)), HandlerKind::Delete) => KindOptions::Delete { optional: d.optional },
        (Some(K::Resume(r)), HandlerKind::Resume) => KindOptions::Resume { deleted: r.deleted },
        (Some(K::Daemon(_)), _) => {
            problems.push(mismatch("daemon"));
            KindOptions::None
        }
        (Some(K::Timer(_)), _) => {
            problems.push(mismatch("timer"));
            KindOptions::None
        }
        (Some(K::Admission(_)), _) => {
            problems.push(mismatch("admission"));
            KindOptions::None
        }
        (Some(K::Delete(_)), _) => {
            problems.push(mismatch("delete"));
            KindOptions::None
        }
        (Some(K::Resume(_)), _) => {
            problems.push(mismatch("resume"));
            KindOptions::None
        }
    }
}

fn handler_kind(raw: i32) -> Option<HandlerKind> {
    use pb::HandlerKind as K;
    Some(match K::try_from(raw).ok()? {
        K::Unspecified => return None,
        K::Create => HandlerKind::Create,
        K::Update => HandlerKind::Update,
        K::Delete => HandlerKind::Delete,
        K::Resume => HandlerKind::Resume,
        K::Field => HandlerKind::Field,
        K::Event => HandlerKind::Event,
        K::Index => HandlerKind::Index,
        K::Daemon => HandlerKind::Daemon,
        K::Timer => HandlerKind::Timer,
        K::Startup => HandlerKind::Startup,
        K::Cleanup => HandlerKind::Cleanup,
        K::Login => HandlerKind::Login,
        K::Probe => HandlerKind::Probe,
        K::Validate => HandlerKind::Validate,
        K::Mutate => HandlerKind::Mutate,
    })
}

fn filters(f: Option<&pb::Filters>, kind: HandlerKind) -> Result<model::Filters, Vec<Diagnostic>> {
    let Some(f) = f else {
        return if kind == HandlerKind::Field {
            Err(vec![
                Diagnostic::error("MISSING_FIELD", "field handlers need a field").at("field"),
            ])
        } else {
            Ok(model::Filters::default())
        };
    };
    let mut problems = Vec::new();
    let mut out = model::Filters {
        sdk_when: f.sdk_when,
        ..model::Filters::default()
    };
    for (name, source, target) in [
        ("labels", &f.labels, &mut out.labels),
        ("annotations", &f.annotations, &mut out.annotations),
    ] {
        for (key, m) in source {
            if key.is_empty() {
                problems.push(Diagnostic::error("BAD_FILTER", format!("empty key in {name}")).at(name));
                continue;
            }
            match meta_match(m) {
                Some(m) => {
                    target.insert(key.clone(), m);
                }
                None => problems.push(
                    Diagnostic::error(
                        "BAD_FILTER",
                        format!("{name}[{key}] needs a value or PRESENT/ABSENT (use PRESENT for any value)"),
                    )
                    .at(format!("{name}[{key}]")),
                ),
            }
        }
    }
    if !f.field.is_empty() {
        if f.field.split('.').any(str::is_empty) {
            problems.push(
                Diagnostic::error("BAD_FILTER", format!("malformed field path {:?}", f.field)).at("field"),
            );
        }
        out.field = f.field.split('.').map(str::to_owned).collect();
    } else if kind == HandlerKind::Field {
        problems.push(Diagnostic::error("MISSING_FIELD", "field handlers need a field").at("field"));
    }
    let has_field = !f.field.is_empty();
    for (name, source, target) in [
        ("value", &f.value, &mut out.value),
        ("old", &f.old, &mut out.old),
        ("new", &f.new, &mut out.new),
    ] {
        let Some(m) = source else { continue };
        if !has_field {
            problems
                .push(Diagnostic::error("BAD_FILTER", format!("{name} is given without a field")).at(name));
        }
        match value_match(m) {
            Ok(m) => *target = Some(m),
            Err(d) => problems.push(d.at(name)),
        }
    }
    if f.value.is_some() && (f.old.is_some() || f.new.is_some()) {
        problems
            .push(Diagnostic::error("BAD_FILTER", "value cannot be combined with old or new").at("value"));
    }
    if (f.old.is_some() || f.new.is_some()) && !matches!(kind, HandlerKind::Update | HandlerKind::Field) {
        problems.push(
            Diagnostic::error(
                "BAD_FILTER",
                format!("old and new filters are not allowed for {kind} handlers"),
            )
            .at("old"),
        );
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(problems)
    }
}

fn meta_match(m: &pb::MetaMatch) -> Option<MetaMatch> {
    match m.condition.as_ref()? {
        pb::meta_match::Condition::Equals(v) => Some(MetaMatch::Equals(v.clone())),
        pb::meta_match::Condition::Presence(p) => match pb::Presence::try_from(*p).ok()? {
            pb::Presence::Present => Some(MetaMatch::Present),
            pb::Presence::Absent => Some(MetaMatch::Absent),
            pb::Presence::Unspecified => None,
        },
    }
}

fn value_match(m: &pb::ValueMatch) -> Result<ValueMatch, Diagnostic> {
    let bad = || Diagnostic::error("BAD_FILTER", "the condition needs a value or PRESENT/ABSENT");
    match m.condition.as_ref().ok_or_else(bad)? {
        pb::value_match::Condition::Equals(v) => json(v)
            .map(ValueMatch::Equals)
            .map_err(|e| Diagnostic::error("MALFORMED_JSON", format!("the value is not JSON: {e}"))),
        pb::value_match::Condition::Presence(p) => match pb::Presence::try_from(*p) {
            Ok(pb::Presence::Present) => Ok(ValueMatch::Present),
            Ok(pb::Presence::Absent) => Ok(ValueMatch::Absent),
            _ => Err(bad()),
        },
    }
}

/// The longest duration accepted from a handler process: 365 days. Longer backoffs,
/// timeouts, intervals, delays and grace periods make no sense for an operator, and the bound
/// keeps every `now + duration` far from the end of the clocks.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// Checks a wire duration: not negative, nanoseconds within `0..1e9`, at most
/// [`MAX_DURATION`].
///
/// # Errors
/// A `BAD_DURATION` diagnostic saying what is wrong.
pub fn bounded_duration(d: &prost_types::Duration) -> Result<Duration, Diagnostic> {
    let bad = |why: &str| Diagnostic::error("BAD_DURATION", format!("the duration {why}"));
    if d.seconds < 0 || d.nanos < 0 {
        return Err(bad("is negative"));
    }
    if d.nanos >= 1_000_000_000 {
        return Err(bad("has nanos outside 0..999999999"));
    }
    let secs = u64::try_from(d.seconds).map_err(|_| bad("is negative"))?;
    let nanos = u32::try_from(d.nanos).map_err(|_| bad("is negative"))?;
    let out = Duration::new(secs, nanos);
    if out > MAX_DURATION {
        return Err(bad(&format!(
            "is longer than the maximum of {} days",
            MAX_DURATION.as_secs() / 86_400
        )));
    }
    Ok(out)
}

fn duration(
    d: Option<&prost_types::Duration>,
    field: &str,
    problems: &mut Vec<Diagnostic>,
) -> Option<Duration> {
    match bounded_duration(d?) {
        Ok(d) => Some(d),
        Err(diag) => {
            problems.push(diag.at(field));
            None
        }
    }
}

/// A `retry_after` from a result: unset, valid, or invalid (then the handler's backoff
/// applies, and the diagnostic tells the handler process).
fn retry_after(d: Option<&prost_types::Duration>, field: &str) -> (Option<Duration>, Option<Diagnostic>) {
    match d.map(bounded_duration) {
        None => (None, None),
        Some(Ok(d)) => (Some(d), None),
        Some(Err(diag)) => {
            let mut diag = diag.at(field);
            diag.severity = Severity::Warning;
            diag.summary = format!("{}; the handler's backoff applies instead", diag.summary);
            (None, Some(diag))
        }
    }
}

/// Parses a wire JSON value.
///
/// # Errors
/// When the bytes are not one valid JSON value.
pub fn json(j: &pb::Json) -> Result<Value, serde_json::Error> {
    serde_json::from_slice(&j.json)
}

/// Encodes a JSON value for the wire.
pub fn to_json(v: &Value) -> pb::Json {
    pb::Json {
        json: serde_json::to_vec(v).unwrap_or_else(|_| b"null".to_vec()),
    }
}

fn opt_json(v: Option<&Value>) -> Option<pb::Json> {
    v.map(to_json)
}

fn timestamp(t: SystemTime) -> prost_types::Timestamp {
    prost_types::Timestamp::from(t)
}

/// The wire form of a diagnostic.
pub fn diagnostic_to_pb(d: &Diagnostic) -> pb::Diagnostic {
    pb::Diagnostic {
        severity: match d.severity {
            Severity::Error => pb::Severity::Error,
            Severity::Warning => pb::Severity::Warning,
            Severity::Info => pb::Severity::Info,
        } as i32,
        summary: d.summary.clone(),
        detail: d.detail.clone(),
        reason: d.reason.clone(),
        field: d.field.clone(),
        error_type: d.error_type.clone(),
        stack_trace: d.stack_trace.clone(),
        metadata: Default::default(),
    }
}

/// The model form of a wire diagnostic.
pub fn diagnostic_from_pb(d: &pb::Diagnostic) -> Diagnostic {
    Diagnostic {
        severity: match pb::Severity::try_from(d.severity) {
            Ok(pb::Severity::Warning) => Severity::Warning,
            Ok(pb::Severity::Info) => Severity::Info,
            _ => Severity::Error,
        },
        summary: d.summary.clone(),
        detail: d.detail.clone(),
        reason: d.reason.clone(),
        field: d.field.clone(),
        error_type: d.error_type.clone(),
        stack_trace: d.stack_trace.clone(),
    }
}

/// The wire form of a resolved resource.
pub fn resolved_to_pb(r: &ResolvedResource) -> pb::ResolvedResource {
    pb::ResolvedResource {
        group: r.group.clone(),
        version: r.version.clone(),
        plural: r.plural.clone(),
        kind: r.kind.clone(),
        namespaced: r.namespaced,
    }
}

/// The model form of a wire object reference (the fields a log record's target carries).
pub fn resource_ref(r: &pb::ResourceRef) -> ResourceRef {
    ResourceRef {
        resource: ResolvedResource {
            group: r.group.clone(),
            version: r.version.clone(),
            plural: r.plural.clone(),
            kind: r.kind.clone(),
            namespaced: !r.namespace.is_empty(),
            status_subresource: false,
        },
        namespace: r.namespace.clone(),
        name: r.name.clone(),
        uid: r.uid.clone(),
        resource_version: r.resource_version.clone(),
        generation: r.generation,
    }
}

/// An object reference for the wire.
pub fn resource_ref_to_pb(o: &ResourceRef) -> pb::ResourceRef {
    pb::ResourceRef {
        group: o.resource.group.clone(),
        version: o.resource.version.clone(),
        kind: o.resource.kind.clone(),
        plural: o.resource.plural.clone(),
        namespace: o.namespace.clone(),
        name: o.name.clone(),
        uid: o.uid.clone(),
        resource_version: o.resource_version.clone(),
        generation: o.generation,
    }
}

/// What a process's `ProcessSettings` say about posting its handlers' outcomes.
pub fn outcome_events(settings: &pb::ProcessSettings) -> crate::model::posting::OutcomeEvents {
    use crate::model::posting::OutcomeEvents;
    match pb::EventPosting::try_from(settings.outcome_events) {
        Ok(pb::EventPosting::Never) => OutcomeEvents::Never,
        Ok(pb::EventPosting::Always) => {
            OutcomeEvents::From(match pb::LogLevel::try_from(settings.outcome_level) {
                Ok(pb::LogLevel::Debug) => Level::Debug,
                Ok(pb::LogLevel::Warning) => Level::Warning,
                Ok(pb::LogLevel::Error) => Level::Error,
                _ => Level::Info,
            })
        }
        _ => OutcomeEvents::Default,
    }
}

/// The longest watch inactivity or server timeout a process may set: one day.
const MAX_WATCH_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// The most workers a process may ask for.
const MAX_WORKER_LIMIT: u32 = 100_000;

/// The operator-wide settings of a process's `ProcessSettings`, each checked: a value out of
/// range is left unset, with a diagnostic (a warning: the rest applies).
pub fn operator_settings(
    wire: &pb::OperatorSettings,
) -> (crate::model::operator_settings::OperatorSettings, Vec<Diagnostic>) {
    use crate::model::{
        operator_settings::{DiffBaseKind, Field, OperatorSettings, ProgressKind},
        selector::valid_label_key,
    };
    let mut problems = Vec::new();
    let finalizer = setting_text(
        Field::Finalizer,
        &wire.finalizer,
        &valid_label_key,
        "a qualified name (prefix/name)",
        &mut problems,
    );
    let persistence_prefix = setting_text(
        Field::PersistencePrefix,
        &wire.persistence_prefix,
        &dns_subdomain,
        "a DNS subdomain",
        &mut problems,
    );
    let diffbase_key = setting_text(
        Field::DiffBaseKey,
        &wire.diffbase_key,
        &valid_label_key,
        "an annotation key ([prefix/]name)",
        &mut problems,
    );
    let status_field = setting_text(
        Field::StatusField,
        &wire.status_field,
        &|f| {
            (1..=63).contains(&f.len())
                && f.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        },
        "a name of at most 63 letters, digits, - and _",
        &mut problems,
    );
    let watch_inactivity_timeout = watch_timeout(
        Field::WatchInactivityTimeout,
        wire.watch_inactivity_timeout.as_ref(),
        &mut problems,
    );
    // The API server takes whole seconds.
    let watch_server_timeout = watch_timeout(
        Field::WatchServerTimeout,
        wire.watch_server_timeout.as_ref(),
        &mut problems,
    )
    .map(|d| Duration::from_secs(d.as_secs().max(1)));
    let worker_limit = match wire.worker_limit {
        0 => None,
        n if n <= MAX_WORKER_LIMIT => Some(n),
        n => {
            problems.push(bad_setting(
                Field::WorkerLimit,
                &format!("of {n} is more than {MAX_WORKER_LIMIT}"),
            ));
            None
        }
    };
    let peering_name = setting_text(
        Field::PeeringName,
        &wire.peering_name,
        &dns_subdomain,
        "a DNS subdomain",
        &mut problems,
    );
    let peering_priority = match wire.peering_priority {
        0 => None,
        n if n.unsigned_abs() <= 1 << 31 => Some(n),
        n => {
            problems.push(bad_setting(
                Field::PeeringPriority,
                &format!("of {n} is beyond 2^31 either way"),
            ));
            None
        }
    };
    let peering_lifetime = watch_timeout(
        Field::PeeringLifetime,
        wire.peering_lifetime.as_ref(),
        &mut problems,
    );
    let api_timeout = watch_timeout(Field::ApiTimeout, wire.api_timeout.as_ref(), &mut problems);
    let webhook_managed = setting_text(
        Field::WebhookManaged,
        &wire.webhook_managed,
        &dns_subdomain,
        "a DNS subdomain",
        &mut problems,
    );
    let settings = OperatorSettings {
        api_timeout,
        webhook_managed,
        peering_name,
        peering_priority,
        peering_standalone: wire.peering_standalone.then_some(true),
        peering_mandatory: wire.peering_mandatory.then_some(true),
        peering_lifetime,
        finalizer,
        persistence_prefix,
        progress_storage: match pb::ProgressStorageKind::try_from(wire.progress_storage) {
            Ok(pb::ProgressStorageKind::Annotations) => Some(ProgressKind::Annotations),
            Ok(pb::ProgressStorageKind::Status) => Some(ProgressKind::Status),
            Ok(pb::ProgressStorageKind::Smart) => Some(ProgressKind::Smart),
            _ => None,
        },
        diffbase_storage: match pb::DiffBaseStorageKind::try_from(wire.diffbase_storage) {
            Ok(pb::DiffBaseStorageKind::Annotations) => Some(DiffBaseKind::Annotations),
            Ok(pb::DiffBaseStorageKind::Status) => Some(DiffBaseKind::Status),
            _ => None,
        },
        diffbase_key,
        status_field,
        watch_inactivity_timeout,
        watch_server_timeout,
        worker_limit,
    };
    (settings, problems)
}

/// Whether `name` is a DNS subdomain: what a label key's prefix may be.
fn dns_subdomain(name: &str) -> bool {
    !name.contains('/') && crate::model::selector::valid_label_key(&format!("{name}/x"))
}

/// A setting refused: a warning, since the rest of the settings applies.
fn bad_setting(field: crate::model::operator_settings::Field, why: &str) -> Diagnostic {
    Diagnostic::warning(
        "BAD_SETTING",
        format!("{field} {why}; the controller's own is used"),
    )
    .at(format!("settings.operator.{field}"))
}

/// A text setting: empty is unset, else it must be `valid`.
fn setting_text(
    field: crate::model::operator_settings::Field,
    value: &str,
    valid: &dyn Fn(&str) -> bool,
    shape: &str,
    problems: &mut Vec<Diagnostic>,
) -> Option<String> {
    if value.is_empty() {
        return None;
    }
    if valid(value) {
        return Some(value.to_owned());
    }
    let shown: String = value.chars().take(80).collect();
    problems.push(bad_setting(field, &format!("{shown:?} is not {shape}")));
    None
}

/// A timeout setting (watches, the peering lifetime, API requests): 1 s to a day.
fn watch_timeout(
    field: crate::model::operator_settings::Field,
    d: Option<&prost_types::Duration>,
    problems: &mut Vec<Diagnostic>,
) -> Option<Duration> {
    match bounded_duration(d?) {
        Ok(d) if (Duration::from_secs(1)..=MAX_WATCH_TIMEOUT).contains(&d) => Some(d),
        Ok(d) => {
            problems.push(bad_setting(field, &format!("of {d:?} is outside 1 s to 1 day")));
            None
        }
        Err(diag) => {
            problems.push(bad_setting(field, &diag.summary));
            None
        }
    }
}

/// A log record as a posting about `object`.
pub fn posting(record: &pb::LogRecord, object: ResourceRef) -> Posting {
    Posting {
        object,
        level: match pb::LogLevel::try_from(record.level) {
            Ok(pb::LogLevel::Debug) => Level::Debug,
            Ok(pb::LogLevel::Warning) => Level::Warning,
            Ok(pb::LogLevel::Error) => Level::Error,
            _ => Level::Info,
        },
        reason: if record.reason.is_empty() {
            "Logging".to_owned()
        } else {
            record.reason.clone()
        },
        message: record.message.clone(),
        policy: match pb::EventPosting::try_from(record.posting) {
            Ok(pb::EventPosting::Always) => Policy::Always,
            Ok(pb::EventPosting::Never) => Policy::Never,
            _ => Policy::ByLevel,
        },
        event_type: crate::model::posting::event_type(&record.event_type),
    }
}

/// The wire form of a cancel reason.
pub fn cancel_reason_to_pb(r: CancelReason) -> pb::CancelReason {
    match r {
        CancelReason::ResourceDeleted => pb::CancelReason::ResourceDeleted,
        CancelReason::FilterMismatch => pb::CancelReason::FilterMismatch,
        CancelReason::DeadlineExceeded => pb::CancelReason::DeadlineExceeded,
        CancelReason::Superseded => pb::CancelReason::Superseded,
        CancelReason::RuntimeShutdown => pb::CancelReason::RuntimeShutdown,
        CancelReason::HandlerUnregistered => pb::CancelReason::HandlerUnregistered,
        CancelReason::Paused => pb::CancelReason::Paused,
    }
}

/// Builds the wire invocation for one attempt of `work`.
pub fn invocation(
    work: &Work,
    invocation_id: &str,
    attempt: u32,
    deadline: Option<SystemTime>,
) -> pb::Invocation {
    use pb::invocation::Payload as P;
    let payload = match &work.payload {
        Payload::Change {
            reason,
            old,
            new,
            diff,
            field,
        } => P::Change(pb::ResourceChange {
            reason: match reason {
                ChangeReason::Create => pb::ChangeReason::Create,
                ChangeReason::Update => pb::ChangeReason::Update,
                ChangeReason::Delete => pb::ChangeReason::Delete,
                ChangeReason::Resume => pb::ChangeReason::Resume,
            } as i32,
            old: opt_json(old.as_ref()),
            new: opt_json(new.as_ref()),
            diff: diff
                .iter()
                .map(|item| pb::DiffItem {
                    operation: match item.operation {
                        DiffOperation::Add => pb::DiffOperation::Add,
                        DiffOperation::Change => pb::DiffOperation::Change,
                        DiffOperation::Remove => pb::DiffOperation::Remove,
                    } as i32,
                    path: item.path.clone(),
                    old: opt_json(item.old.as_ref()),
                    new: opt_json(item.new.as_ref()),
                })
                .collect(),
            field: field.clone(),
        }),
        Payload::Event { event_type } => P::Event(pb::ResourceEvent {
            r#type: match event_type {
                EventType::Listing => pb::EventType::Unspecified,
                EventType::Added => pb::EventType::Added,
                EventType::Modified => pb::EventType::Modified,
                EventType::Deleted => pb::EventType::Deleted,
            } as i32,
        }),
        Payload::Daemon { restarts } => P::Daemon(pb::DaemonStart { restarts: *restarts }),
        Payload::Timer { scheduled } => P::Timer(pb::TimerTick {
            scheduled_time: Some(timestamp(*scheduled)),
        }),
        Payload::Index { deleted } => P::Index(pb::IndexRequest { deleted: *deleted }),
        Payload::Admission {
            uid,
            operation,
            subresource,
            dry_run,
            old_object,
            user_info,
            headers,
        } => P::Admission(pb::AdmissionRequest {
            uid: uid.clone(),
            operation: operation.clone(),
            subresource: subresource.clone(),
            dry_run: *dry_run,
            old_object: opt_json(old_object.as_ref()),
            user_info: opt_json(user_info.as_ref()),
            headers: headers.iter().cloned().collect(),
        }),
        Payload::Probe => P::Probe(pb::ProbeRequest {}),
        Payload::Activity(a) => P::Activity(pb::ActivityRequest {
            activity: match a {
                Activity::Startup => pb::Activity::Startup,
                Activity::Cleanup => pb::Activity::Cleanup,
                Activity::Login => pb::Activity::Login,
            } as i32,
        }),
    };
    pb::Invocation {
        invocation_id: invocation_id.to_owned(),
        handler_id: work.handler_id.0.clone(),
        attempt,
        idempotency_key: work.idempotency_key.clone(),
        deadline: deadline.map(timestamp),
        started_time: Some(timestamp(work.started)),
        resource: work.object.as_ref().map(|o| pb::ResourceRef {
            group: o.resource.group.clone(),
            version: o.resource.version.clone(),
            kind: o.resource.kind.clone(),
            plural: o.resource.plural.clone(),
            namespace: o.namespace.clone(),
            name: o.name.clone(),
            uid: o.uid.clone(),
            resource_version: o.resource_version.clone(),
            generation: o.generation,
        }),
        body: opt_json(work.body.as_ref()),
        trace_context: [("traceparent".to_owned(), work.trace.traceparent())].into(),
        last_error: work.last_error.as_ref().map(diagnostic_to_pb),
        param: opt_json(work.param.as_ref()),
        subhandlers: work
            .subhandlers
            .iter()
            .map(|s| pb::SubhandlerState {
                subhandler_id: s.id.clone(),
                retries: s.retries,
                success: s.success,
                failure: s.failure,
                delayed_until: s.delayed_until.map(timestamp),
                message: s.message.clone(),
                started_time: s.started.map(timestamp),
            })
            .collect(),
        payload: Some(payload),
    }
}

/// Validates and converts patches.
///
/// # Errors
/// A diagnostic naming the first malformed patch.
pub fn patches(patches: &[pb::Patch]) -> Result<Vec<Patch>, Diagnostic> {
    patches
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let field = format!("patches[{i}]");
            let body = p
                .body
                .as_ref()
                .ok_or_else(|| Diagnostic::error("MALFORMED_PATCH", "the patch has no body").at(&field))
                .and_then(|b| {
                    json(b).map_err(|e| {
                        Diagnostic::error("MALFORMED_PATCH", format!("the patch is not JSON: {e}")).at(&field)
                    })
                })?;
            let patch_type = match pb::PatchType::try_from(p.r#type) {
                Ok(pb::PatchType::Merge) if body.is_object() => PatchType::Merge,
                Ok(pb::PatchType::Merge) => {
                    return Err(
                        Diagnostic::error("MALFORMED_PATCH", "a merge patch must be a JSON object")
                            .at(&field),
                    );
                }
                Ok(pb::PatchType::Json) => {
                    serde_json::from_value::<json_patch::Patch>(body.clone()).map_err(|e| {
                        Diagnostic::error("MALFORMED_PATCH", format!("not a valid RFC 6902 JSON patch: {e}"))
                            .at(&field)
                    })?;
                    PatchType::Json
                }
                _ => {
                    return Err(Diagnostic::error(
                        "MALFORMED_PATCH",
                        format!("unknown patch type {}", p.r#type),
                    )
                    .at(&field));
                }
            };
            let target = match pb::PatchTarget::try_from(p.target) {
                Ok(pb::PatchTarget::Status) => PatchTarget::Status,
                Ok(_) => PatchTarget::Object,
                Err(_) => {
                    return Err(Diagnostic::error(
                        "MALFORMED_PATCH",
                        format!("unknown patch target {}", p.target),
                    )
                    .at(&field));
                }
            };
            Ok(Patch {
                patch_type,
                target,
                body,
            })
        })
        .collect()
}

/// Converts a result into an outcome. A result that cannot be used (malformed patch or JSON,
/// no outcome) becomes a permanent failure carrying the reason, and the diagnostic is returned
/// too so the handler process can be told.
pub fn outcome(result: &pb::InvocationResult) -> (Outcome, Option<Diagnostic>) {
    use pb::invocation_result::Outcome as O;
    let subhandlers = match subhandler_outcomes(&result.subhandlers) {
        Ok(s) => s,
        Err(d) => {
            return (
                Outcome::Permanent {
                    diagnostics: vec![d.clone()],
                    subhandlers: Vec::new(),
                },
                Some(d),
            );
        }
    };
    let diags = |ds: &[pb::Diagnostic]| ds.iter().map(diagnostic_from_pb).collect::<Vec<_>>();
    let mut warning = None;
    let converted = match &result.outcome {
        Some(O::Success(s)) => success(s, &result.patches, subhandlers),
        Some(O::TemporaryError(t)) => {
            let (delay, problem) = retry_after(t.retry_after.as_ref(), "temporary_error.retry_after");
            warning = problem;
            Ok(Outcome::Temporary {
                delay,
                diagnostics: diags(&t.diagnostics),
                subhandlers,
            })
        }
        Some(O::PermanentError(p)) => Ok(Outcome::Permanent {
            diagnostics: diags(&p.diagnostics),
            subhandlers,
        }),
        Some(O::UnclassifiedError(u)) => Ok(Outcome::Unclassified {
            diagnostics: diags(&u.diagnostics),
            subhandlers,
        }),
        Some(O::Cancelled(_)) => Ok(Outcome::Cancelled),
        Some(O::Skipped(_)) => Ok(Outcome::Skipped),
        None => Err(Diagnostic::error(
            "MISSING_OUTCOME",
            "the result carries no outcome",
        )),
    };
    match converted {
        Ok(o) => (o, warning),
        Err(d) => (
            Outcome::Permanent {
                diagnostics: vec![d.clone()],
                subhandlers: Vec::new(),
            },
            Some(d),
        ),
    }
}

fn success(
    s: &pb::Success,
    raw_patches: &[pb::Patch],
    subhandlers: Vec<SubhandlerOutcome>,
) -> Result<Outcome, Diagnostic> {
    let result = match s.result.as_ref().map(json) {
        Some(Ok(Value::Null)) | None => None,
        Some(Ok(v)) => Some(v),
        Some(Err(e)) => {
            return Err(Diagnostic::error(
                "MALFORMED_JSON",
                format!("the result is not JSON: {e}"),
            ));
        }
    };
    let kind_result = match &s.kind_result {
        Some(pb::success::KindResult::Admission(a)) => Some(KindResult::Admission(model::AdmissionVerdict {
            allowed: a.allowed,
            message: a.message.clone(),
            code: a.code,
            warnings: a.warnings.clone(),
        })),
        Some(pb::success::KindResult::Credentials(c)) => Some(KindResult::Credentials(model::Credentials {
            server: c.server.clone(),
            certificate_authority: c.certificate_authority.clone(),
            insecure: c.insecure,
            username: c.username.clone(),
            password: c.password.clone(),
            token: c.token.clone(),
            client_certificate: c.client_certificate.clone(),
            client_key: c.client_key.clone(),
            default_namespace: c.default_namespace.clone(),
            expiration: c.expiration_time.and_then(|t| SystemTime::try_from(t).ok()),
            priority: c.priority,
        })),
        None => None,
    };
    Ok(Outcome::Success {
        result,
        kind_result,
        patches: patches(raw_patches)?,
        subhandlers,
    })
}

fn subhandler_outcomes(raw: &[pb::SubhandlerOutcome]) -> Result<Vec<SubhandlerOutcome>, Diagnostic> {
    use pb::subhandler_outcome::Outcome as O;
    raw.iter()
        .map(|s| {
            if s.subhandler_id.is_empty() {
                return Err(Diagnostic::error(
                    "INVALID_HANDLER_ID",
                    "a sub-handler outcome has no id",
                ));
            }
            let diags = |ds: &[pb::Diagnostic]| ds.iter().map(diagnostic_from_pb).collect::<Vec<_>>();
            let outcome = match &s.outcome {
                Some(O::Success(ok)) => success(ok, &[], Vec::new())?,
                Some(O::TemporaryError(t)) => {
                    // A sub-handler's invalid retry_after falls back to the backoff silently:
                    // the parent's result is still used.
                    let (delay, _) = retry_after(t.retry_after.as_ref(), "subhandlers.retry_after");
                    Outcome::Temporary {
                        delay,
                        diagnostics: diags(&t.diagnostics),
                        subhandlers: Vec::new(),
                    }
                }
                Some(O::PermanentError(p)) => Outcome::Permanent {
                    diagnostics: diags(&p.diagnostics),
                    subhandlers: Vec::new(),
                },
                Some(O::UnclassifiedError(u)) => Outcome::Unclassified {
                    diagnostics: diags(&u.diagnostics),
                    subhandlers: Vec::new(),
                },
                // Left for a later call of the parent (see `SubhandlerOutcome::outcome`).
                Some(O::Deferred(_)) => Outcome::Skipped,
                None => {
                    return Err(Diagnostic::error(
                        "MISSING_OUTCOME",
                        format!("sub-handler {} has no outcome", s.subhandler_id),
                    ));
                }
            };
            Ok(SubhandlerOutcome {
                id: s.subhandler_id.clone(),
                outcome,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(kind: pb::HandlerKind) -> pb::HandlerRegistration {
        pb::HandlerRegistration {
            handler_id: "h".into(),
            kind: kind as i32,
            resource: Some(pb::ResourceSelector {
                name: "examples".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn operator_settings_out_of_range_are_refused_one_by_one() {
        use crate::model::operator_settings::ProgressKind;
        let d = |seconds| Some(prost_types::Duration { seconds, nanos: 0 });
        let (settings, problems) = operator_settings(&pb::OperatorSettings {
            finalizer: "example.com/finalizer".into(),
            persistence_prefix: "Not A Prefix".into(),
            progress_storage: pb::ProgressStorageKind::Smart as i32,
            diffbase_key: "example.com/last".into(),
            status_field: "x".repeat(64),
            watch_inactivity_timeout: d(0),
            watch_server_timeout: Some(prost_types::Duration {
                seconds: 90,
                nanos: 500,
            }),
            worker_limit: 100_001,
            ..Default::default()
        });
        assert_eq!(settings.finalizer.as_deref(), Some("example.com/finalizer"));
        assert_eq!(settings.progress_storage, Some(ProgressKind::Smart));
        assert_eq!(settings.diffbase_key.as_deref(), Some("example.com/last"));
        assert_eq!(settings.watch_server_timeout, Some(Duration::from_secs(90)));
        assert_eq!(settings.persistence_prefix, None);
        assert_eq!(settings.status_field, None);
        assert_eq!(settings.watch_inactivity_timeout, None);
        assert_eq!(settings.worker_limit, None);
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "settings.operator.persistence_prefix",
                "settings.operator.status_field",
                "settings.operator.watch_inactivity_timeout",
                "settings.operator.worker_limit",
            ]
        );
        assert!(
            problems
                .iter()
                .all(|p| p.reason == "BAD_SETTING" && p.severity == Severity::Warning)
        );
        let (peering, problems) = operator_settings(&pb::OperatorSettings {
            peering_name: "mine".into(),
            peering_priority: -(1 << 40),
            peering_standalone: true,
            peering_lifetime: d(86_401),
            api_timeout: d(0),
            webhook_managed: "Not_A_Name".into(),
            ..Default::default()
        });
        assert_eq!(peering.peering_name.as_deref(), Some("mine"));
        assert_eq!(
            (peering.peering_priority, peering.peering_standalone),
            (None, Some(true))
        );
        assert_eq!(
            (peering.peering_mandatory, peering.peering_lifetime),
            (None, None)
        );
        assert_eq!((&peering.api_timeout, &peering.webhook_managed), (&None, &None));
        assert_eq!(problems.len(), 4, "{problems:?}");
        let (client, problems) = operator_settings(&pb::OperatorSettings {
            api_timeout: d(20),
            webhook_managed: "example.com".into(),
            ..Default::default()
        });
        assert_eq!(client.api_timeout, Some(Duration::from_secs(20)));
        assert_eq!(client.webhook_managed.as_deref(), Some("example.com"));
        assert!(problems.is_empty(), "{problems:?}");
        // Nothing set is nothing applied.
        let (empty, problems) = operator_settings(&pb::OperatorSettings::default());
        assert_eq!(
            empty,
            crate::model::operator_settings::OperatorSettings::default()
        );
        assert!(problems.is_empty());
    }

    #[test]
    fn accepts_a_plain_create_handler_with_kopf_defaults() {
        let r = registration(0, &reg(pb::HandlerKind::Create)).unwrap();
        assert_eq!(r.kind, HandlerKind::Create);
        assert_eq!(r.errors, ErrorsMode::Temporary);
        assert_eq!(r.backoff, Duration::from_secs(60));
        assert_eq!(r.selector.unwrap().name, "examples");
    }

    #[test]
    fn rejects_unknown_kind_and_missing_selector() {
        let mut bad = reg(pb::HandlerKind::Create);
        bad.kind = 99;
        let err = registration(3, &bad).unwrap_err();
        assert_eq!(err[0].reason, "UNKNOWN_HANDLER_KIND");
        assert_eq!(err[0].field, "handlers[3].kind");
        let mut no_sel = reg(pb::HandlerKind::Update);
        no_sel.resource = None;
        assert_eq!(
            registration(0, &no_sel).unwrap_err()[0].reason,
            "MISSING_RESOURCE"
        );
    }

    #[test]
    fn rejects_bad_filters() {
        let mut r = reg(pb::HandlerKind::Create);
        r.filters = Some(pb::Filters {
            value: Some(pb::ValueMatch {
                condition: Some(pb::value_match::Condition::Presence(1)),
            }),
            labels: [("app".to_owned(), pb::MetaMatch { condition: None })].into(),
            ..Default::default()
        });
        let err = registration(0, &r).unwrap_err();
        let reasons: Vec<_> = err.iter().map(|d| d.field.as_str()).collect();
        assert!(reasons.contains(&"handlers[0].filters.value"), "{err:?}");
        assert!(reasons.contains(&"handlers[0].filters.labels[app]"), "{err:?}");
    }

    #[test]
    fn selectors_are_parsed_and_malformed_ones_are_rejected_where_they_are() {
        let mut r = reg(pb::HandlerKind::Create);
        if let Some(sel) = r.resource.as_mut() {
            sel.label_selector = "app in (db,web)".into();
            sel.field_selector = "spec.nodeName=n1".into();
        }
        let ok = registration(0, &r).unwrap();
        assert!(!ok.filters.selector.is_empty());
        assert!(ok.filters.selector.matches(
            &serde_json::json!({"metadata": {"labels": {"app": "db"}}, "spec": {"nodeName": "n1"}})
        ));
        for (labels, fields, at) in [
            ("app in (db", "", "handlers[0].resource.label_selector"),
            ("", "spec.nodeName", "handlers[0].resource.field_selector"),
        ] {
            if let Some(sel) = r.resource.as_mut() {
                sel.label_selector = labels.into();
                sel.field_selector = fields.into();
            }
            let err = registration(0, &r).unwrap_err();
            assert_eq!(err[0].reason, "BAD_SELECTOR");
            assert_eq!(err[0].field, at);
        }
    }

    #[test]
    fn field_handlers_need_a_field_and_timers_an_interval() {
        assert_eq!(
            registration(0, &reg(pb::HandlerKind::Field)).unwrap_err()[0].reason,
            "MISSING_FIELD"
        );
        assert_eq!(
            registration(0, &reg(pb::HandlerKind::Timer)).unwrap_err()[0].reason,
            "MISSING_INTERVAL"
        );
    }

    #[test]
    fn activities_take_no_selector() {
        let mut r = reg(pb::HandlerKind::Startup);
        assert_eq!(registration(0, &r).unwrap_err()[0].reason, "UNEXPECTED_RESOURCE");
        r.resource = None;
        assert!(registration(0, &r).is_ok());
    }

    fn result_with_patch(t: pb::PatchType, body: &str) -> pb::InvocationResult {
        pb::InvocationResult {
            invocation_id: "i".into(),
            outcome: Some(pb::invocation_result::Outcome::Success(pb::Success::default())),
            patches: vec![pb::Patch {
                r#type: t as i32,
                target: pb::PatchTarget::Object as i32,
                body: Some(pb::Json {
                    json: body.as_bytes().to_vec(),
                }),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn malformed_patches_become_permanent_failures() {
        let (o, d) = outcome(&result_with_patch(
            pb::PatchType::Json,
            r#"[{"op":"frobnicate"}]"#,
        ));
        assert_eq!(d.unwrap().reason, "MALFORMED_PATCH");
        assert!(matches!(o, Outcome::Permanent { .. }));
        let (_, d) = outcome(&result_with_patch(pb::PatchType::Merge, "[1]"));
        assert_eq!(d.unwrap().reason, "MALFORMED_PATCH");
        let (_, d) = outcome(&result_with_patch(pb::PatchType::Merge, "{not json"));
        assert_eq!(d.unwrap().reason, "MALFORMED_PATCH");
    }

    #[test]
    fn extreme_durations_are_bad_durations() {
        let extreme = [
            prost_types::Duration {
                seconds: i64::MAX,
                nanos: 999_999_999,
            },
            prost_types::Duration {
                seconds: u64::MAX as i64,
                nanos: 0,
            },
            prost_types::Duration {
                seconds: -1,
                nanos: 0,
            },
            prost_types::Duration {
                seconds: 0,
                nanos: -1,
            },
            prost_types::Duration {
                seconds: 1,
                nanos: 1_000_000_000,
            },
            prost_types::Duration {
                seconds: 366 * 86_400,
                nanos: 0,
            },
        ];
        for d in extreme {
            let mut r = reg(pb::HandlerKind::Timer);
            r.kind_options = Some(pb::handler_registration::KindOptions::Timer(pb::TimerOptions {
                interval: Some(d),
                ..Default::default()
            }));
            r.timeout = Some(d);
            let err = registration(0, &r).unwrap_err();
            assert!(
                err.iter()
                    .any(|e| e.reason == "BAD_DURATION" && e.field == "handlers[0].timeout"),
                "{d:?}: {err:?}"
            );
            assert!(
                err.iter().any(|e| e.field == "handlers[0].timer.interval"),
                "{d:?}: {err:?}"
            );
            let result = pb::InvocationResult {
                invocation_id: "i".into(),
                outcome: Some(pb::invocation_result::Outcome::TemporaryError(
                    pb::TemporaryError {
                        retry_after: Some(d),
                        ..Default::default()
                    },
                )),
                ..Default::default()
            };
            let (o, problem) = outcome(&result);
            assert!(
                matches!(o, Outcome::Temporary { delay: None, .. }),
                "{d:?}: {o:?}"
            );
            assert_eq!(problem.unwrap().reason, "BAD_DURATION");
        }
        assert_eq!(
            bounded_duration(&prost_types::Duration { seconds: 2, nanos: 5 }).unwrap(),
            Duration::new(2, 5)
        );
    }

    #[test]
    fn valid_patches_pass() {
        let (o, d) = outcome(&result_with_patch(
            pb::PatchType::Json,
            r#"[{"op":"add","path":"/a","value":1}]"#,
        ));
        assert!(d.is_none());
        let Outcome::Success { patches, .. } = o else {
            panic!("not a success")
        };
        assert_eq!(patches[0].patch_type, PatchType::Json);
    }
}
