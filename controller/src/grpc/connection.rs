//! One `Connect` stream: the handshake with one handler process, then the loop that carries
//! invocations out and results, updates, logs and pongs in.
//!
//! The handshake validates every registration on its own (a bad one is rejected with
//! diagnostics in `Welcome`, the rest carry on) and ends the stream with `FAILED_PRECONDITION`
//! only when nothing was accepted. After it, the connection is attached to the [`Hub`], which
//! owns dispatch; this module only moves messages and watches liveness (application pings).
//! A protocol violation ends this stream and no other.

use std::{sync::Arc, time::Duration};

use capstan_proto::pb::{self, connect_request::Message as In, connect_response::Message as Out};
use futures::future::BoxFuture;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Status, Streaming};
use tracing::{Instrument, Level, debug, info, info_span, warn};

use super::{
    convert,
    hub::{ConnectionId, Hub, sleep_until_opt},
};
use crate::model::{
    Diagnostic, HandlerId, HandlerKind, Registration, ResolvedResource, ResourceSelector, Severity,
};

/// Resolves resource selectors during the handshake (through discovery, in the real
/// controller). Lives outside `grpc` so that this layer never talks to the API server.
pub trait Resolver: Send + Sync + 'static {
    /// Resolves one selector.
    ///
    /// # Errors
    /// A diagnostic saying why the selector matches no resource (or several). An error
    /// rejects the registration; a *warning* (`RESOURCE_NOT_FOUND_YET`) accepts it unresolved,
    /// to be watched when the resource appears.
    fn resolve<'a>(
        &'a self,
        selector: &'a ResourceSelector,
    ) -> BoxFuture<'a, Result<ResolvedResource, Diagnostic>>;
}

/// Per-connection tunables.
#[derive(Clone, Debug)]
pub struct Settings {
    /// How long to wait for `Hello`. Default 10 s.
    pub handshake_timeout: Duration,
    /// How often to ping. Default 10 s.
    pub ping_interval: Duration,
    /// How long a pong may take before the stream is ended. Default 30 s.
    pub ping_timeout: Duration,
    /// The process-wide in-flight cap, and the default for processes that ask for none.
    /// Default 256.
    pub max_in_flight: u32,
    /// Largest message either side may send. Default 16 MiB.
    pub max_message_bytes: usize,
    /// Grace period advertised for cancelled invocations.
    pub cancel_grace: Duration,
    /// The handler kinds the controller runs; `None` accepts every kind of the protocol.
    /// Registrations of other kinds are rejected with `UNSUPPORTED_HANDLER_KIND`.
    pub supported_kinds: Option<Vec<HandlerKind>>,
    /// Why admission handlers are not run when [`Self::supported_kinds`] leaves them out,
    /// said in their refusal (webhooks off, or not servable).
    pub admission_unavailable: Option<String>,
    /// Most registrations (`Hello.handlers` entries) one handler process may make. A larger
    /// `hello` ends the stream with `RESOURCE_EXHAUSTED` (`TOO_MANY_HANDLERS:`) before any of
    /// it is validated, so that one process cannot stall registration for the others.
    /// Default 1,000 (kopf operators have dozens).
    pub max_handlers: usize,
    /// How long a new connection has to send the HTTP/2 preface and its first frame before
    /// it is closed (below gRPC; `hello` has `handshake_timeout` after that). Default 10 s.
    pub preface_timeout: Duration,
    /// Serve TCP on an address that is not loopback (`--listen-insecure-non-loopback`): the
    /// protocol has no authentication. Default false: such an address is refused.
    pub insecure_non_loopback: bool,
}

/// The default of [`Settings::max_handlers`].
pub const MAX_HANDLERS: usize = 1_000;

impl Default for Settings {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(10),
            ping_interval: Duration::from_secs(10),
            ping_timeout: Duration::from_secs(30),
            max_in_flight: 256,
            max_message_bytes: capstan_proto::MAX_MESSAGE_BYTES,
            cancel_grace: Duration::from_secs(5),
            supported_kinds: None,
            admission_unavailable: None,
            max_handlers: MAX_HANDLERS,
            preface_timeout: Duration::from_secs(10),
            insecure_non_loopback: false,
        }
    }
}

/// The capabilities this controller supports.
const SUPPORTED: [pb::Capability; 10] = [
    pb::Capability::ResultAck,
    pb::Capability::InvocationUpdates,
    pb::Capability::SdkFilters,
    pb::Capability::Subhandlers,
    pb::Capability::ObjectUpdates,
    pb::Capability::ObjectGone,
    pb::Capability::CleanupOnGoodbye,
    pb::Capability::ProcessSettings,
    pb::Capability::DeferredSubhandlers,
    pb::Capability::OperatorSettings,
];

/// The response stream of one connection.
pub type ResponseStream = ReceiverStream<Result<pb::ConnectResponse, Status>>;

/// Performs the handshake on `inbound` and, if it succeeds, spawns the connection's task and
/// returns its response stream.
///
/// # Errors
/// `INVALID_ARGUMENT` when the first message is not `Hello`, `DEADLINE_EXCEEDED` when it does
/// not come in time, `FAILED_PRECONDITION` when no registration was accepted.
pub async fn accept(
    hub: Hub,
    resolver: Arc<dyn Resolver>,
    settings: Settings,
    shutdown: CancellationToken,
    mut inbound: Streaming<pb::ConnectRequest>,
) -> Result<ResponseStream, Status> {
    let first = tokio::time::timeout(settings.handshake_timeout, inbound.message())
        .await
        .map_err(|_| Status::deadline_exceeded("no hello received within the handshake timeout"))?
        .map_err(|e| {
            if too_large(&e) {
                warn!(error = %e.message(), "handler process sent an oversized hello");
                Status::resource_exhausted(format!(
                    "MESSAGE_TOO_LARGE: messages are limited to {} bytes: {}",
                    settings.max_message_bytes,
                    e.message()
                ))
            } else {
                Status::invalid_argument(format!("reading the hello failed: {}", e.message()))
            }
        })?;
    let hello = match first.and_then(|m| m.message) {
        Some(In::Hello(hello)) => hello,
        Some(other) => {
            warn!(
                got = message_name(&other),
                "handler process sent something other than hello first"
            );
            return Err(Status::invalid_argument(format!(
                "PROTOCOL_VIOLATION: the first message must be hello, got {}",
                message_name(&other)
            )));
        }
        None => {
            return Err(Status::invalid_argument(
                "PROTOCOL_VIOLATION: the stream ended before hello",
            ));
        }
    };
    if hello.handlers.len() > settings.max_handlers {
        warn!(
            handlers = hello.handlers.len(),
            limit = settings.max_handlers,
            "handler process registers too many handlers"
        );
        return Err(Status::resource_exhausted(format!(
            "TOO_MANY_HANDLERS: hello registers {} handlers; a handler process may register at most {}",
            hello.handlers.len(),
            settings.max_handlers
        )));
    }
    let capabilities: Vec<pb::Capability> = hello
        .capabilities
        .iter()
        .filter_map(|c| pb::Capability::try_from(*c).ok())
        .filter(|c| SUPPORTED.contains(c))
        .collect();
    let (mut statuses, accepted) = validate(
        &hub,
        resolver.as_ref(),
        &hello,
        Supported {
            kinds: settings.supported_kinds.as_deref(),
            admission_unavailable: settings.admission_unavailable.as_deref(),
        },
    )
    .await;
    let sdk = hello.sdk.clone().unwrap_or_default();
    if accepted.is_empty() {
        let why: Vec<String> = statuses
            .iter()
            .map(|s| {
                let reasons: Vec<&str> = s.diagnostics.iter().map(|d| d.reason.as_str()).collect();
                format!(
                    "{}: [{}] {}",
                    s.handler_id,
                    reasons.join(","),
                    convert_summary(&s.diagnostics)
                )
            })
            .collect();
        warn!(sdk = %sdk.name, rejected = %why.join("; "), "no handler registration accepted");
        return Err(Status::failed_precondition(format!(
            "NO_HANDLERS_ACCEPTED: no handler registration was accepted ({})",
            if why.is_empty() {
                "hello registered no handlers".to_owned()
            } else {
                why.join("; ")
            }
        )));
    }
    let max_in_flight = match hello.max_in_flight {
        0 => settings.max_in_flight,
        n => n.min(settings.max_in_flight),
    };
    let (out_tx, out_rx) = mpsc::channel(64);
    let object_updates = capabilities.contains(&pb::Capability::ObjectUpdates);
    let (conn, taken) = hub.attach(out_tx, max_in_flight, object_updates, accepted);
    if capabilities.contains(&pb::Capability::ObjectGone) {
        hub.send_object_gone(conn);
    }
    for reg in &taken {
        reject_taken(&mut statuses, &reg.id);
    }
    let accepted_count = statuses.iter().filter(|s| s.accepted).count();
    let welcome = pb::Welcome {
        connection_id: conn.to_string(),
        capabilities: capabilities.iter().map(|c| *c as i32).collect(),
        runtime: Some(pb::SoftwareInfo {
            name: "capstan".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            language: "rust".into(),
        }),
        limits: Some(pb::Limits {
            max_message_bytes: settings.max_message_bytes as u64,
            ping_interval: prost_types::Duration::try_from(settings.ping_interval).ok(),
            ping_timeout: prost_types::Duration::try_from(settings.ping_timeout).ok(),
            max_in_flight,
            cancel_grace_period: prost_types::Duration::try_from(settings.cancel_grace).ok(),
        }),
        registrations: statuses,
    };
    let (resp_tx, resp_rx) = mpsc::channel(16);
    let _ = resp_tx
        .send(Ok(pb::ConnectResponse {
            message: Some(Out::Welcome(welcome)),
        }))
        .await;
    // A process that sends operator-wide settings sends them right after the welcome: its
    // registrations wait for them (bounded by the handshake timeout), so that no watch starts
    // with the flags' settings only to be restarted a moment later.
    let awaits_settings = capabilities.contains(&pb::Capability::OperatorSettings);
    if !awaits_settings {
        hub.open(conn);
    }
    let span = info_span!("connection", connection.id = conn, sdk = %sdk.name, sdk.version = %sdk.version, peer.instance = %hello.instance_id);
    span.in_scope(|| {
        info!(
            handlers = accepted_count,
            max_in_flight, "handler process connected"
        )
    });
    let task = Connection {
        hub,
        conn,
        settings,
        acks: capabilities.contains(&pb::Capability::ResultAck),
        cleanup_on_goodbye: capabilities.contains(&pb::Capability::CleanupOnGoodbye),
        operator_settings: awaits_settings,
        opening: std::sync::atomic::AtomicBool::new(awaits_settings),
        resp_tx,
        shutdown,
    };
    tokio::spawn(task.run(inbound, out_rx).instrument(span));
    Ok(ReceiverStream::new(resp_rx))
}

/// Whether reading a message failed because it is above the size limit.
fn too_large(status: &Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
    ) || status.message().contains("too large")
}

fn convert_summary(diagnostics: &[pb::Diagnostic]) -> String {
    let ds: Vec<Diagnostic> = diagnostics.iter().map(convert::diagnostic_from_pb).collect();
    Diagnostic::summarize(&ds)
}

fn reject_taken(statuses: &mut [pb::RegistrationStatus], id: &HandlerId) {
    if let Some(s) = statuses.iter_mut().find(|s| s.handler_id == id.0 && s.accepted) {
        s.accepted = false;
        s.diagnostics.push(convert::diagnostic_to_pb(&Diagnostic::error(
            "HANDLER_ID_TAKEN",
            format!("handler {id} is already registered by another connected handler process"),
        )));
    }
}

/// The handler kinds a controller runs, and why admission handlers are not when they are not.
#[derive(Clone, Copy)]
struct Supported<'a> {
    kinds: Option<&'a [HandlerKind]>,
    admission_unavailable: Option<&'a str>,
}

/// Validates every registration of `hello`: conversion, duplicates, ownership, resolution.
async fn validate(
    hub: &Hub,
    resolver: &dyn Resolver,
    hello: &pb::Hello,
    supported: Supported<'_>,
) -> (Vec<pb::RegistrationStatus>, Vec<Registration>) {
    let mut statuses = Vec::with_capacity(hello.handlers.len());
    let mut accepted = Vec::new();
    // The same handler may be registered for several selectors (same id and kind, another
    // resource): kopf's one function under several decorators.
    let mut seen: std::collections::HashMap<String, (i32, Vec<Option<pb::ResourceSelector>>)> =
        std::collections::HashMap::new();
    let ids: Vec<HandlerId> = hello
        .handlers
        .iter()
        .map(|h| HandlerId(h.handler_id.clone()))
        .collect();
    let owned = hub.owned(&ids);
    // Each distinct selector is resolved once per hello, however many handlers use it.
    let mut resolved: std::collections::HashMap<ResourceSelector, Result<ResolvedResource, Diagnostic>> =
        std::collections::HashMap::new();
    for (index, raw) in hello.handlers.iter().enumerate() {
        let mut status = pb::RegistrationStatus {
            handler_id: raw.handler_id.clone(),
            ..Default::default()
        };
        let result = match convert::registration(index, raw) {
            Err(diags) => Err(diags),
            Ok(_) if !first_or_another_selector(&mut seen, raw) => Err(vec![
                Diagnostic::error(
                    "DUPLICATE_HANDLER_ID",
                    format!("handler id {:?} is registered more than once", raw.handler_id),
                )
                .at(format!("handlers[{index}].handler_id")),
            ]),
            Ok(reg) if supported.kinds.is_some_and(|kinds| !kinds.contains(&reg.kind)) => Err(vec![
                Diagnostic::error(
                    "UNSUPPORTED_HANDLER_KIND",
                    match supported.admission_unavailable {
                        Some(why) if reg.kind.is_admission() => {
                            format!("this controller does not run {} handlers: {why}", reg.kind)
                        }
                        _ => format!("this controller does not run {} handlers", reg.kind),
                    },
                )
                .at(format!("handlers[{index}].kind")),
            ]),
            Ok(reg) if owned.contains(&reg.id) => Err(vec![Diagnostic::error(
                "HANDLER_ID_TAKEN",
                format!(
                    "handler {} is already registered by another connected handler process",
                    reg.id
                ),
            )]),
            Ok(mut reg) => match &reg.selector {
                Some(selector) => match match resolved.get(selector) {
                    Some(known) => known.clone(),
                    None => {
                        let found = resolver.resolve(selector).await;
                        resolved.insert(selector.clone(), found.clone());
                        found
                    }
                } {
                    Ok(resource) => {
                        status.resource = Some(convert::resolved_to_pb(&resource));
                        reg.resource = Some(resource);
                        Ok(reg)
                    }
                    // A warning means "not served yet" (kopf §7.7): accepted, watched once the
                    // resource appears.
                    Err(d) if d.severity == Severity::Warning => {
                        let d = d.at(format!("handlers[{index}].resource"));
                        info!(handler.id = %raw.handler_id, "{}", d.summary);
                        status.diagnostics.push(convert::diagnostic_to_pb(&d));
                        Ok(reg)
                    }
                    Err(d) => Err(vec![d.at(format!("handlers[{index}].resource"))]),
                },
                None => Ok(reg),
            },
        };
        match result {
            Ok(reg) => {
                status.accepted = true;
                accepted.push(reg);
            }
            Err(diags) => {
                warn!(handler.id = %raw.handler_id, problems = %Diagnostic::summarize(&diags), "registration rejected");
                status.diagnostics = diags.iter().map(convert::diagnostic_to_pb).collect();
            }
        }
        statuses.push(status);
    }
    (statuses, accepted)
}

/// Records a registration; false when its id is already taken by another kind, or by the same
/// kind with the same selector.
fn first_or_another_selector(
    seen: &mut std::collections::HashMap<String, (i32, Vec<Option<pb::ResourceSelector>>)>,
    raw: &pb::HandlerRegistration,
) -> bool {
    match seen.get_mut(&raw.handler_id) {
        None => {
            seen.insert(raw.handler_id.clone(), (raw.kind, vec![raw.resource.clone()]));
            true
        }
        Some((kind, selectors))
            if *kind == raw.kind && raw.resource.is_some() && !selectors.contains(&raw.resource) =>
        {
            selectors.push(raw.resource.clone());
            true
        }
        Some(_) => false,
    }
}

fn message_name(m: &In) -> &'static str {
    match m {
        In::Hello(_) => "hello",
        In::Result(_) => "result",
        In::Update(_) => "update",
        In::Log(_) => "log",
        In::Pong(_) => "pong",
        In::FlowControl(_) => "flow_control",
        In::Goodbye(_) => "goodbye",
        In::Settings(_) => "settings",
    }
}

/// The running side of one accepted connection.
struct Connection {
    hub: Hub,
    conn: ConnectionId,
    settings: Settings,
    acks: bool,
    /// `CAPABILITY_CLEANUP_ON_GOODBYE`: a goodbye may ask for the process's cleanup handlers.
    cleanup_on_goodbye: bool,
    /// `CAPABILITY_OPERATOR_SETTINGS`: the process's `ProcessSettings.operator` is applied.
    operator_settings: bool,
    /// The registrations wait for the process's first settings (see [`Connection::open`]).
    opening: std::sync::atomic::AtomicBool,
    resp_tx: mpsc::Sender<Result<pb::ConnectResponse, Status>>,
    shutdown: CancellationToken,
}

impl Connection {
    /// Opens the connection for dispatch (its registrations take effect) if it waited for the
    /// process's first settings.
    fn open(&self) {
        if self.opening.swap(false, std::sync::atomic::Ordering::Relaxed) {
            self.hub.open(self.conn);
        }
    }

    async fn run(
        self,
        mut inbound: Streaming<pb::ConnectRequest>,
        mut out_rx: mpsc::Receiver<pb::ConnectResponse>,
    ) {
        let mut ping = tokio::time::interval(self.settings.ping_interval);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ping.tick().await;
        let mut awaiting: Option<(u64, tokio::time::Instant)> = None;
        let mut nonce = 0u64;
        let open_by = self
            .opening
            .load(std::sync::atomic::Ordering::Relaxed)
            .then(|| tokio::time::Instant::now() + self.settings.handshake_timeout);
        // The message the handler process has not taken yet, and since when. Sends are never
        // awaited inside the loop: a process that stops reading is noticed by the same deadline
        // as a missing pong, and shutdown is always polled.
        let mut pending: Option<(pb::ConnectResponse, tokio::time::Instant)> = None;
        let end: Option<Status> = loop {
            let pong_deadline = awaiting.and_then(|(_, sent)| sent.checked_add(self.settings.ping_timeout));
            let send_deadline = pending
                .as_ref()
                .and_then(|(_, since)| since.checked_add(self.settings.ping_timeout));
            tokio::select! {
                biased;
                () = self.shutdown.cancelled() => {
                    break Some(Status::unavailable("the controller is shutting down"));
                }
                permit = self.resp_tx.reserve(), if pending.is_some() => match (permit, pending.take()) {
                    (Ok(permit), Some((message, _))) => permit.send(Ok(message)),
                    _ => break None,
                },
                Some(message) = out_rx.recv(), if pending.is_none() => {
                    match self.resp_tx.try_send(Ok(message)) {
                        Ok(()) => {}
                        Err(mpsc::error::TrySendError::Full(Ok(message))) => {
                            pending = Some((message, tokio::time::Instant::now()));
                        }
                        Err(_) => break None,
                    }
                }
                incoming = inbound.message() => match incoming {
                    Ok(Some(request)) => {
                        if let Some(status) = self.handle(request, &mut awaiting).await {
                            break Some(status);
                        }
                    }
                    Ok(None) => {
                        debug!("handler process closed its side of the stream");
                        break None;
                    }
                    Err(status) => break Some(self.inbound_error(status)),
                },
                () = sleep_until_opt(open_by), if self.opening.load(std::sync::atomic::Ordering::Relaxed) => {
                    warn!(timeout = ?self.settings.handshake_timeout, "no process settings after the welcome; its registrations take effect without them");
                    self.open();
                }
                () = sleep_until_opt(pong_deadline) => {
                    warn!(timeout = ?self.settings.ping_timeout, "no pong in time; dropping the connection");
                    break Some(Status::unavailable(format!(
                        "PING_TIMEOUT: no pong within {:?}", self.settings.ping_timeout
                    )));
                }
                () = sleep_until_opt(send_deadline) => {
                    warn!(timeout = ?self.settings.ping_timeout, "handler process stopped reading its stream; dropping the connection");
                    break Some(Status::unavailable(format!(
                        "SEND_TIMEOUT: the handler process took no message for {:?}", self.settings.ping_timeout
                    )));
                }
                _ = ping.tick(), if awaiting.is_none() => {
                    let ping = pb::ConnectResponse { message: Some(Out::Ping(pb::Ping {
                        nonce: nonce + 1,
                        sent_time: Some(prost_types::Timestamp::from(std::time::SystemTime::now())),
                    })) };
                    // A congested stream skips this ping: the pong deadline runs only for a ping
                    // that was sent (a process that stopped reading meets the send deadline).
                    match self.resp_tx.try_send(Ok(ping)) {
                        Ok(()) => {
                            nonce += 1;
                            awaiting = Some((nonce, tokio::time::Instant::now()));
                        }
                        Err(mpsc::error::TrySendError::Full(_)) => {}
                        Err(mpsc::error::TrySendError::Closed(_)) => break None,
                    }
                }
            }
        };
        self.hub.detach(self.conn);
        if let Some(status) = end {
            let _ = self.resp_tx.try_send(Err(status));
        }
        info!(
            in_flight_elsewhere = self.hub.in_flight(),
            "handler process disconnected"
        );
    }

    fn inbound_error(&self, status: Status) -> Status {
        if too_large(&status) {
            warn!(error = %status.message(), "handler process sent an oversized message");
            Status::resource_exhausted(format!(
                "MESSAGE_TOO_LARGE: messages are limited to {} bytes: {}",
                self.settings.max_message_bytes,
                status.message()
            ))
        } else {
            debug!(error = %status, "stream from the handler process failed");
            Status::cancelled(format!("stream failed: {}", status.message()))
        }
    }

    /// Handles one message; returns a status when the stream must end.
    async fn handle(
        &self,
        request: pb::ConnectRequest,
        awaiting: &mut Option<(u64, tokio::time::Instant)>,
    ) -> Option<Status> {
        match request.message {
            Some(In::Hello(_)) => {
                warn!("handler process sent a second hello");
                return Some(Status::invalid_argument(
                    "PROTOCOL_VIOLATION: hello may be sent only once",
                ));
            }
            Some(In::Result(result)) => return self.on_result(&result).await.err(),
            Some(In::Update(update)) => return self.on_update(update).await.err(),
            Some(In::Log(record)) => self.on_log(&record),
            Some(In::Pong(pong)) => {
                if awaiting.is_some_and(|(n, _)| n == pong.nonce) {
                    *awaiting = None;
                } else {
                    debug!(nonce = pong.nonce, "unexpected pong ignored");
                }
            }
            Some(In::FlowControl(fc)) => {
                let handler = (!fc.handler_id.is_empty()).then(|| HandlerId(fc.handler_id.clone()));
                debug!(handler = ?handler, max_in_flight = fc.max_in_flight, "flow control");
                self.hub
                    .flow_control(self.conn, handler.as_ref(), fc.max_in_flight);
            }
            Some(In::Settings(settings)) => {
                let wants = convert::outcome_events(&settings);
                debug!(?wants, "process settings");
                self.hub.set_outcome_events(self.conn, wants);
                let (operator, mut problems) = if self.operator_settings {
                    convert::operator_settings(&settings.operator.unwrap_or_default())
                } else {
                    Default::default()
                };
                let overruled = self.hub.set_operator_settings(self.conn, operator);
                self.open();
                for (field, why) in overruled {
                    warn!(%field, "{why}");
                    problems.push(
                        Diagnostic::warning("SETTING_OVERRULED", why)
                            .at(format!("settings.operator.{field}")),
                    );
                }
                if !problems.is_empty() {
                    let notice = pb::Notice {
                        invocation_id: String::new(),
                        diagnostics: problems.iter().map(convert::diagnostic_to_pb).collect(),
                    };
                    return self.emit(Out::Notice(notice)).await.err();
                }
            }
            Some(In::Goodbye(goodbye)) if goodbye.cleanup && self.cleanup_on_goodbye => {
                info!(reason = %goodbye.reason, "handler process says goodbye; its cleanup handlers run, nothing else");
                // A process leaving before its settings came is never opened.
                self.opening.store(false, std::sync::atomic::Ordering::Relaxed);
                if !self.hub.leave_with_cleanup(self.conn) {
                    let farewell = pb::Farewell {
                        reason: "the process has no cleanup handlers".into(),
                    };
                    return self.emit(Out::Farewell(farewell)).await.err();
                }
            }
            Some(In::Goodbye(goodbye)) => {
                info!(reason = %goodbye.reason, "handler process says goodbye; no new invocations");
                self.opening.store(false, std::sync::atomic::Ordering::Relaxed);
                self.hub.close_for_dispatch(self.conn);
            }
            None => {
                return self
                    .notice(
                        "",
                        Diagnostic::warning("UNKNOWN_MESSAGE", "a message with no known content was ignored"),
                    )
                    .await
                    .err();
            }
        }
        None
    }

    async fn on_result(&self, result: &pb::InvocationResult) -> Result<(), Status> {
        let handler = self.hub.handler_of(&result.invocation_id).map(|(h, _)| h);
        match self.hub.complete(self.conn, result) {
            Ok(problem) => {
                debug!(invocation.id = %result.invocation_id, handler.id = ?handler, "result received");
                if let Some(d) = &problem {
                    warn!(invocation.id = %result.invocation_id, problem = %d, "result could not be used as sent");
                    self.notice(&result.invocation_id, d.clone()).await?;
                }
                if self.acks {
                    let ack = pb::ResultAck {
                        invocation_id: result.invocation_id.clone(),
                        accepted: problem.is_none(),
                        diagnostics: problem.iter().map(convert::diagnostic_to_pb).collect(),
                    };
                    self.emit(Out::ResultAck(ack)).await?;
                }
                Ok(())
            }
            Err(e) => {
                warn!(invocation.id = %result.invocation_id, "stale result ignored");
                let d = Diagnostic::warning("STALE_INVOCATION", e.to_string());
                if self.acks {
                    let ack = pb::ResultAck {
                        invocation_id: result.invocation_id.clone(),
                        accepted: false,
                        diagnostics: vec![convert::diagnostic_to_pb(&d)],
                    };
                    self.emit(Out::ResultAck(ack)).await
                } else {
                    self.notice(&result.invocation_id, d).await
                }
            }
        }
    }

    async fn on_update(&self, update: pb::InvocationUpdate) -> Result<(), Status> {
        let patches = match convert::patches(&update.patches) {
            Ok(p) => p,
            Err(d) => {
                warn!(invocation.id = %update.invocation_id, problem = %d, "update with a malformed patch ignored");
                return self.notice(&update.invocation_id, d).await;
            }
        };
        match self.hub.update(self.conn, &update.invocation_id, patches) {
            Ok(true) => Ok(()),
            Ok(false) if update.patches.is_empty() => Ok(()),
            Ok(false) => {
                self.notice(
                    &update.invocation_id,
                    Diagnostic::warning(
                        "UPDATES_NOT_ACCEPTED",
                        "this invocation does not accept interim patches",
                    ),
                )
                .await
            }
            Err(e) => {
                self.notice(
                    &update.invocation_id,
                    Diagnostic::warning("STALE_INVOCATION", e.to_string()),
                )
                .await
            }
        }
    }

    fn on_log(&self, record: &pb::LogRecord) {
        let (handler, object) = self
            .hub
            .handler_of(&record.invocation_id)
            .unwrap_or((HandlerId(String::new()), None));
        let handler = handler.0;
        let level = match pb::LogLevel::try_from(record.level) {
            Ok(pb::LogLevel::Debug) => Level::DEBUG,
            Ok(pb::LogLevel::Warning) => Level::WARN,
            Ok(pb::LogLevel::Error) => Level::ERROR,
            _ => Level::INFO,
        };
        let inv = record.invocation_id.as_str();
        let msg = record.message.as_str();
        let trace = self.hub.trace_of(inv).map(|t| t.trace_id()).unwrap_or_default();
        match level {
            Level::DEBUG => {
                debug!(target: "capstan::handler", handler_id = %handler, invocation_id = %inv, trace.id = %trace, "{msg}")
            }
            Level::WARN => {
                warn!(target: "capstan::handler", handler_id = %handler, invocation_id = %inv, trace.id = %trace, "{msg}")
            }
            Level::ERROR => {
                tracing::error!(target: "capstan::handler", handler_id = %handler, invocation_id = %inv, trace.id = %trace, "{msg}")
            }
            _ => {
                info!(target: "capstan::handler", handler_id = %handler, invocation_id = %inv, trace.id = %trace, "{msg}")
            }
        }
        let target = record
            .object
            .as_ref()
            .filter(|o| !o.name.is_empty())
            .map(convert::resource_ref)
            .or(object);
        if let Some(object) = target {
            self.hub.post(convert::posting(record, object));
        }
    }

    async fn notice(&self, invocation_id: &str, diagnostic: Diagnostic) -> Result<(), Status> {
        let notice = pb::Notice {
            invocation_id: invocation_id.to_owned(),
            diagnostics: vec![convert::diagnostic_to_pb(&diagnostic)],
        };
        self.emit(Out::Notice(notice)).await
    }

    /// Sends one message to the handler process, waiting at most the ping timeout for room
    /// (and never past shutdown).
    ///
    /// # Errors
    /// The status that ends the stream when the process does not read, the controller stops,
    /// or the stream is gone.
    async fn emit(&self, message: Out) -> Result<(), Status> {
        let message = pb::ConnectResponse {
            message: Some(message),
        };
        tokio::select! {
            sent = self.resp_tx.send(Ok(message)) => sent.map_err(|_| Status::cancelled("the stream is gone")),
            () = tokio::time::sleep(self.settings.ping_timeout) => {
                warn!(timeout = ?self.settings.ping_timeout, "handler process stopped reading its stream; dropping the connection");
                Err(Status::unavailable(format!(
                    "SEND_TIMEOUT: the handler process took no message for {:?}",
                    self.settings.ping_timeout
                )))
            }
            () = self.shutdown.cancelled() => Err(Status::unavailable("the controller is shutting down")),
        }
    }
}
