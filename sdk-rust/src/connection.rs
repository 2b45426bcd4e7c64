//! One connection to the controller: dial, handshake, and the bidirectional stream loop.
//!
//! The runner module owns the reconnect loop; this module runs one stream from `Hello` to its
//! end. Its reader never waits on user code: every invocation runs in its own task (owned by a
//! `JoinSet`, with a span carrying the handler id, invocation id and object), `Ping` is
//! answered from the reader at once, `Cancel` only flips the invocation's token, and an
//! `ObjectUpdate` only swaps the body the invocation's `Context` reads. On shutdown
//! it sends `Goodbye`, gives running invocations a bounded grace (still answering pings and
//! cancels), cancels what is left, and closes its side. A process with cleanup handlers asks
//! in its goodbye for them (where the controller offers `CAPABILITY_CLEANUP_ON_GOODBYE`): in a
//! pod whose controller is a native sidecar, this process is stopped first, so the controller
//! runs them then, on this stream, and the stream closes after its `Farewell` (bounded). When the stream is lost, running
//! invocations are cancelled and dropped: the controller re-queues them as new attempts.

use std::{collections::HashMap, path::PathBuf, sync::Arc, time::Duration};

use hyper_util::rt::TokioIo;
use tokio::{net::UnixStream, task::JoinSet};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{
    Code,
    transport::{Channel, Endpoint},
};
use tracing::Instrument;

use crate::{
    Error,
    control::Control,
    convert, dispatch,
    error::Result,
    outbox::Outbox,
    pb::{self, connect_request::Message as Up, connect_response::Message as Down},
    registry::Table,
};

/// How long invocations that ignore a shutdown cancel get before they are dropped.
const ABANDON_AFTER: Duration = Duration::from_secs(1);
/// How long to wait for the controller to end the stream after this side closed it.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a stopping process waits for the controller to run its cleanup handlers (counted
/// from its goodbye; the controller's own bound is its shutdown grace, 20 s by default).
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(20);

/// Where the controller listens.
#[derive(Debug, Clone)]
pub(crate) enum Dialer {
    /// A Unix domain socket.
    Unix(PathBuf),
    /// Loopback (or any) TCP.
    Tcp(Box<Endpoint>),
}

impl Dialer {
    /// Parses `unix:///path`, `unix:/path` or `http(s)://host:port`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidEndpoint`] for anything else.
    pub(crate) fn parse(endpoint: &str) -> Result<Self> {
        let invalid = |source| Error::InvalidEndpoint {
            endpoint: endpoint.to_owned(),
            source,
        };
        if let Some(path) = endpoint
            .strip_prefix("unix://")
            .or_else(|| endpoint.strip_prefix("unix:"))
        {
            if !path.starts_with('/') {
                return Err(invalid(None));
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            return Err(invalid(None));
        }
        let parsed = Endpoint::from_shared(endpoint.to_owned()).map_err(|e| invalid(Some(e)))?;
        Ok(Self::Tcp(Box::new(parsed)))
    }

    /// Opens a channel to the controller.
    pub(crate) async fn connect(&self) -> std::result::Result<Channel, tonic::transport::Error> {
        match self {
            Self::Tcp(endpoint) => tuned((**endpoint).clone()).connect().await,
            Self::Unix(path) => {
                let path = path.clone();
                // The URI is required by the HTTP/2 layer but unused by the connector.
                tuned(Endpoint::from_static("http://[::]:50051"))
                    .connect_with_connector(tower::service_fn(move |_| {
                        let path = path.clone();
                        async move { UnixStream::connect(path).await.map(TokioIo::new) }
                    }))
                    .await
            }
        }
    }
}

fn tuned(endpoint: Endpoint) -> Endpoint {
    endpoint
        .connect_timeout(Duration::from_secs(10))
        .http2_keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(20))
        .keep_alive_while_idle(true)
}

/// How a stream ended, when it did not fail for good.
#[derive(Debug)]
pub(crate) enum Ended {
    /// Shutdown was requested and the stream was closed cleanly.
    Shutdown,
    /// The stream broke; `welcomed` tells whether the handshake had completed.
    Lost {
        /// Why.
        reason: String,
        /// Whether `Welcome` had arrived.
        welcomed: bool,
    },
}

/// Runs one stream until shutdown or loss.
///
/// # Errors
///
/// [`Error::Rejected`] when the controller accepted none of the handlers.
pub(crate) async fn run(
    channel: Channel,
    table: Arc<Table>,
    hello: pb::Hello,
    stop: &CancellationToken,
    grace: Duration,
) -> Result<Ended> {
    // A new stream starts with empty indexes: the controller feeds every object again before
    // any other handler of this process runs.
    table.indexes.clear();
    let (outbox, rx) = Outbox::channel();
    outbox.send(Up::Hello(hello)).await?;
    let mut client = pb::runtime_service_client::RuntimeServiceClient::new(channel)
        .max_decoding_message_size(capstan_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(capstan_proto::MAX_MESSAGE_BYTES);
    let response = tokio::select! {
        response = client.connect(ReceiverStream::new(rx)) => response,
        () = stop.cancelled() => return Ok(Ended::Shutdown),
    };
    let inbound = match response {
        Ok(response) => response.into_inner(),
        Err(status) => return lost_or_rejected(status, false),
    };
    let mut stream = Stream {
        inbound,
        outbox,
        table,
        tasks: JoinSet::new(),
        running: HashMap::new(),
        welcomed: false,
        cleanup_on_goodbye: false,
        farewell: false,
    };
    let ended = stream.serve(stop).await;
    match ended {
        Ok(Ended::Shutdown) => {
            stream.shut_down(grace).await;
            stream.close().await;
            Ok(Ended::Shutdown)
        }
        other => {
            stream.abandon(pb::CancelReason::RuntimeShutdown);
            other
        }
    }
}

/// Whether every rejected registration of a `NO_HANDLERS_ACCEPTED` status was rejected only
/// because another connection holds its id (`[HANDLER_ID_TAKEN]` in the message).
fn only_taken(message: &str) -> bool {
    let Some(list) = message
        .split_once('(')
        .map(|(_, rest)| rest.trim_end_matches(')'))
    else {
        return false;
    };
    let reasons: Vec<&str> = list
        .split("; ")
        .filter_map(|item| item.split_once('['))
        .filter_map(|(_, r)| r.split_once(']'))
        .map(|(r, _)| r)
        .collect();
    !reasons.is_empty()
        && reasons
            .iter()
            .all(|r| r.split(',').all(|x| x == "HANDLER_ID_TAKEN"))
}

fn lost_or_rejected(status: tonic::Status, welcomed: bool) -> Result<Ended> {
    // Handler ids still held by a previous connection of a process that just died are taken
    // only until the controller notices it is gone: retry those; anything else is final.
    if status.code() == Code::FailedPrecondition && !only_taken(status.message()) {
        return Err(Error::Rejected { status });
    }
    Ok(Ended::Lost {
        reason: format!("{}: {}", status.code(), status.message()),
        welcomed,
    })
}

struct Stream {
    inbound: tonic::Streaming<pb::ConnectResponse>,
    outbox: Outbox,
    table: Arc<Table>,
    tasks: JoinSet<String>,
    running: HashMap<String, Control>,
    welcomed: bool,
    /// The welcome put `CAPABILITY_CLEANUP_ON_GOODBYE` in effect.
    cleanup_on_goodbye: bool,
    /// The controller said farewell: the cleanup the goodbye asked for is done.
    farewell: bool,
}

impl Stream {
    /// Reads the stream until shutdown is requested or the stream ends.
    async fn serve(&mut self, stop: &CancellationToken) -> Result<Ended> {
        loop {
            tokio::select! {
                () = stop.cancelled() => return Ok(Ended::Shutdown),
                message = self.inbound.message() => match message {
                    Ok(Some(message)) => self.handle(message).await?,
                    Ok(None) => {
                        return Ok(Ended::Lost {
                            reason: "the controller closed the stream".to_owned(),
                            welcomed: self.welcomed,
                        });
                    }
                    Err(status) => return lost_or_rejected(status, self.welcomed),
                },
                Some(joined) = self.tasks.join_next() => self.finished(joined),
            }
        }
    }

    /// Says goodbye, lets running invocations finish within `grace`, then cancels the rest;
    /// with cleanup handlers, also answers their invocations until the controller's farewell.
    async fn shut_down(&mut self, grace: Duration) {
        let cleanup = self.cleanup_on_goodbye
            && self
                .table
                .registrations()
                .iter()
                .any(|r| r.kind == pb::HandlerKind::Cleanup as i32);
        tracing::info!(
            running = self.running.len(),
            cleanup,
            "saying goodbye to the controller"
        );
        let goodbye = pb::Goodbye {
            reason: "the handler process is shutting down".to_owned(),
            cleanup,
        };
        if self.outbox.send(Up::Goodbye(goodbye)).await.is_err() {
            return;
        }
        let now = tokio::time::Instant::now();
        // Only what ran before the goodbye is cancelled at the grace: the cleanup handlers
        // that come after it have the controller's own bound.
        let before: Vec<String> = self.running.keys().cloned().collect();
        let deadline = now + grace;
        let last = now + (grace + ABANDON_AFTER).max(if cleanup { CLEANUP_TIMEOUT } else { Duration::ZERO });
        let mut cancelled = false;
        while !self.tasks.is_empty() || (cleanup && !self.farewell) {
            tokio::select! {
                Some(joined) = self.tasks.join_next() => self.finished(joined),
                message = self.inbound.message() => match message {
                    Ok(Some(message)) => {
                        if self.handle(message).await.is_err() {
                            break;
                        }
                    }
                    _ => break,
                },
                () = tokio::time::sleep_until(deadline), if !cancelled => {
                    cancelled = true;
                    let late: Vec<&Control> = before.iter().filter_map(|id| self.running.get(id)).collect();
                    if !late.is_empty() {
                        tracing::warn!(running = late.len(), "shutdown grace passed; cancelling invocations");
                    }
                    for control in late {
                        control.cancel(pb::CancelReason::RuntimeShutdown);
                    }
                }
                () = tokio::time::sleep_until(last) => {
                    if cleanup && !self.farewell {
                        tracing::warn!("the controller did not finish this process's cleanup handlers in time");
                    }
                    break;
                }
            }
        }
        self.abandon(pb::CancelReason::RuntimeShutdown);
    }

    /// Closes this side of the stream and waits (bounded) for the controller to end its side,
    /// so that the goodbye and the last results are delivered rather than reset.
    async fn close(self) {
        let Self {
            mut inbound,
            outbox,
            tasks,
            ..
        } = self;
        drop(tasks);
        drop(outbox);
        let drained = tokio::time::timeout(CLOSE_TIMEOUT, async {
            while let Ok(Some(_)) = inbound.message().await {}
        })
        .await;
        if drained.is_err() {
            tracing::debug!("the controller did not close the stream in time");
        }
    }

    /// Cancels and drops every running invocation.
    fn abandon(&mut self, reason: pb::CancelReason) {
        for control in self.running.values() {
            control.cancel(reason);
        }
        self.running.clear();
        self.tasks.abort_all();
    }

    fn finished(&mut self, joined: std::result::Result<String, tokio::task::JoinError>) {
        match joined {
            Ok(invocation_id) => {
                self.running.remove(&invocation_id);
            }
            Err(error) => tracing::error!(%error, "an invocation task failed"),
        }
    }

    async fn handle(&mut self, message: pb::ConnectResponse) -> Result<()> {
        match message.message {
            Some(Down::Welcome(welcome)) => {
                self.welcomed = true;
                self.cleanup_on_goodbye = welcome
                    .capabilities
                    .contains(&(pb::Capability::CleanupOnGoodbye as i32));
                log_welcome(&welcome, self.table.registrations());
                let unsupported = unsupported_kinds(&welcome, self.table.registrations());
                if !unsupported.is_empty() {
                    return Err(Error::Unsupported {
                        handlers: unsupported,
                    });
                }
            }
            Some(Down::ObjectGone(gone)) => {
                let uid = gone.object.as_ref().map_or("", |o| o.uid.as_str());
                if self.table.memos.forget(uid) {
                    tracing::debug!(object.uid = %uid, "the object is gone; its memo is dropped");
                }
            }
            Some(Down::Invocation(invocation)) => self.start(invocation),
            Some(Down::Cancel(cancel)) => {
                let reason =
                    pb::CancelReason::try_from(cancel.reason).unwrap_or(pb::CancelReason::Unspecified);
                match self.running.get(&cancel.invocation_id) {
                    Some(control) => {
                        tracing::debug!(invocation.id = %cancel.invocation_id, ?reason, "cancelling");
                        control.cancel(reason);
                    }
                    None => {
                        tracing::debug!(invocation.id = %cancel.invocation_id, "cancel for an unknown invocation")
                    }
                }
            }
            Some(Down::ObjectUpdate(update)) => self.update_body(&update),
            Some(Down::Ping(ping)) => {
                let in_flight = u32::try_from(self.running.len()).unwrap_or(u32::MAX);
                self.outbox
                    .send(Up::Pong(pb::Pong {
                        nonce: ping.nonce,
                        in_flight,
                    }))
                    .await?;
            }
            Some(Down::Drain(drain)) => {
                let grace = drain.grace_period.as_ref().map(convert::duration_from_pb);
                tracing::info!(reason = %drain.reason, ?grace, running = self.running.len(), "the controller is draining");
            }
            Some(Down::ResultAck(ack)) if ack.accepted => {
                tracing::debug!(invocation.id = %ack.invocation_id, "result acknowledged");
            }
            Some(Down::ResultAck(ack)) => {
                for d in &ack.diagnostics {
                    tracing::warn!(invocation.id = %ack.invocation_id, reason = %d.reason, "result not accepted: {}", d.summary);
                }
            }
            Some(Down::Notice(notice)) => {
                for d in &notice.diagnostics {
                    tracing::warn!(invocation.id = %notice.invocation_id, reason = %d.reason, "notice from the controller: {}", d.summary);
                }
            }
            Some(Down::Farewell(farewell)) => {
                tracing::info!(reason = %farewell.reason, "the controller ran this process's cleanup");
                self.farewell = true;
            }
            None => tracing::debug!("ignoring an empty or unknown message"),
        }
        Ok(())
    }

    /// Hands the latest body of a running invocation's object to its `Context`.
    fn update_body(&self, update: &pb::ObjectUpdate) {
        let Some(control) = self.running.get(&update.invocation_id) else {
            tracing::debug!(invocation.id = %update.invocation_id, "object update for an invocation that is not running; ignored");
            return;
        };
        match convert::json_from_pb(update.body.as_ref()) {
            Ok(Some(body)) => control.update_body(body),
            Ok(None) => {
                tracing::debug!(invocation.id = %update.invocation_id, "object update without a body; ignored");
            }
            Err(error) => {
                tracing::warn!(invocation.id = %update.invocation_id, %error, "object update with malformed JSON; ignored");
            }
        }
    }

    fn start(&mut self, invocation: pb::Invocation) {
        let span = tracing::info_span!(
            "invocation",
            handler.id = %invocation.handler_id,
            invocation.id = %invocation.invocation_id,
            attempt = invocation.attempt,
            object = %object_name(invocation.resource.as_ref()),
            trace.id = %crate::context::trace_id(&invocation).unwrap_or_default(),
        );
        let control = Control::new();
        let invocation_id = invocation.invocation_id.clone();
        self.running.insert(invocation_id.clone(), control.clone());
        let table = self.table.clone();
        let outbox = self.outbox.clone();
        self.tasks.spawn(
            async move {
                tracing::debug!("invocation started");
                let result = dispatch::run(&table, invocation, control, outbox.clone()).await;
                tracing::debug!(outcome = outcome_name(&result), "invocation finished");
                if outbox.send(Up::Result(result)).await.is_err() {
                    tracing::debug!("the stream closed before the result could be sent");
                }
                invocation_id
            }
            .instrument(span),
        );
    }
}

/// The registrations the controller rejected because it does not run their kind
/// (`UNSUPPORTED_HANDLER_KIND`), as `(handler id, the controller's explanation)`.
fn unsupported_kinds(
    welcome: &pb::Welcome,
    registrations: &[pb::HandlerRegistration],
) -> Vec<(String, String)> {
    welcome
        .registrations
        .iter()
        .enumerate()
        .filter(|(_, status)| !status.accepted)
        .filter_map(|(index, status)| {
            let diagnostic = status
                .diagnostics
                .iter()
                .find(|d| d.reason == "UNSUPPORTED_HANDLER_KIND")?;
            let id = if status.handler_id.is_empty() {
                registrations
                    .get(index)
                    .map(|r| r.handler_id.clone())
                    .unwrap_or_default()
            } else {
                status.handler_id.clone()
            };
            Some((id, diagnostic.summary.clone()))
        })
        .collect()
}

fn log_welcome(welcome: &pb::Welcome, registrations: &[pb::HandlerRegistration]) {
    tracing::info!(
        connection.id = %welcome.connection_id,
        runtime = welcome.runtime.as_ref().map(|r| format!("{} {}", r.name, r.version)).unwrap_or_default(),
        "connected to the controller"
    );
    for (index, status) in welcome.registrations.iter().enumerate() {
        let handler_id = if status.handler_id.is_empty() {
            registrations
                .get(index)
                .map(|r| r.handler_id.as_str())
                .unwrap_or_default()
        } else {
            status.handler_id.as_str()
        };
        let resource = status
            .resource
            .as_ref()
            .map(|r| format!("{}/{}/{}", r.group, r.version, r.plural))
            .unwrap_or_default();
        if status.accepted {
            tracing::info!(handler.id = %handler_id, %resource, "handler accepted");
        } else {
            tracing::warn!(handler.id = %handler_id, "handler rejected");
        }
        for d in &status.diagnostics {
            tracing::warn!(handler.id = %handler_id, reason = %d.reason, field = %d.field, "{}", d.summary);
        }
    }
}

fn object_name(resource: Option<&pb::ResourceRef>) -> String {
    match resource {
        Some(r) if r.namespace.is_empty() => format!("{}/{}", r.plural, r.name),
        Some(r) => format!("{}/{}/{}", r.plural, r.namespace, r.name),
        None => String::new(),
    }
}

fn outcome_name(result: &pb::InvocationResult) -> &'static str {
    use pb::invocation_result::Outcome;
    match result.outcome {
        Some(Outcome::Success(_)) => "success",
        Some(Outcome::TemporaryError(_)) => "temporary_error",
        Some(Outcome::PermanentError(_)) => "permanent_error",
        Some(Outcome::UnclassifiedError(_)) => "unclassified_error",
        Some(Outcome::Cancelled(_)) => "cancelled",
        Some(Outcome::Skipped(_)) => "skipped",
        None => "none",
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        assert!(
            matches!(Dialer::parse("unix:///run/capstan/capstan.sock"), Ok(Dialer::Unix(p)) if p == std::path::Path::new("/run/capstan/capstan.sock"))
        );
        assert!(matches!(Dialer::parse("unix:/tmp/x.sock"), Ok(Dialer::Unix(_))));
        assert!(matches!(
            Dialer::parse("http://127.0.0.1:7070"),
            Ok(Dialer::Tcp(_))
        ));
        assert!(Dialer::parse("unix://relative").is_err());
        assert!(Dialer::parse("127.0.0.1:7070").is_err());
    }
}

#[cfg(test)]
mod taken_tests {
    use super::only_taken;

    #[test]
    fn retries_only_when_every_id_is_merely_taken() {
        let taken = "NO_HANDLERS_ACCEPTED: no handler registration was accepted (a: [HANDLER_ID_TAKEN] held; b: [HANDLER_ID_TAKEN] held)";
        assert!(only_taken(taken));
        let bad = "NO_HANDLERS_ACCEPTED: no handler registration was accepted (a: [HANDLER_ID_TAKEN] held; b: [BAD_FILTER] x)";
        assert!(!only_taken(bad));
        assert!(!only_taken("NO_HANDLERS_ACCEPTED: something else"));
    }
}
