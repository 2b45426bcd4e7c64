//! Running one case against one SDK: a fresh fake controller and a fresh handler process, the
//! steps in order, and a verdict with the transcript of what went by.

use std::{
    collections::BTreeMap,
    path::Path,
    process::Stdio,
    time::{Duration, SystemTime},
};

use anyhow::{Context as _, Result, anyhow, bail};
use serde_json::{Map, Value, json};
use tokio::{sync::mpsc, task::JoinHandle};

use super::process::HandlerProcess;
use tonic::{Status, codegen::Bytes};

use super::{
    case::{Case, Step},
    features::{handlers_of, invocation, resolved_resource},
    pattern,
    profile::{Profile, expand},
    server::{Connection, FakeController},
    wire,
};

/// How long a handler process may take to connect.
const CONNECT_WITHIN: Duration = Duration::from_secs(30);
/// How long a hello may take once connected.
const HELLO_WITHIN: Duration = Duration::from_secs(10);
/// How long a message may wait for room in the stream.
const SEND_WITHIN: Duration = Duration::from_secs(10);
/// The kind given to frames that are no `ConnectRequest`.
const UNDECODABLE: &str = "(undecodable)";
/// How long a whole case may take.
const CASE_WITHIN: Duration = Duration::from_secs(180);
/// Every capability the runner can play the controller's side of.
const CAPABILITIES: [&str; 10] = [
    "CAPABILITY_RESULT_ACK",
    "CAPABILITY_INVOCATION_UPDATES",
    "CAPABILITY_SDK_FILTERS",
    "CAPABILITY_SUBHANDLERS",
    "CAPABILITY_OBJECT_UPDATES",
    "CAPABILITY_OBJECT_GONE",
    "CAPABILITY_CLEANUP_ON_GOODBYE",
    "CAPABILITY_PROCESS_SETTINGS",
    "CAPABILITY_DEFERRED_SUBHANDLERS",
    "CAPABILITY_OPERATOR_SETTINGS",
];

/// What running a case came to.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// Whether every step held.
    pub passed: bool,
    /// Why not.
    pub failure: Option<String>,
    /// The messages both ways and the steps, for `--verbose` and failures.
    pub transcript: Vec<String>,
    /// The end of the handler process's standard error.
    pub stderr_tail: String,
    /// How long the case took.
    pub took: Duration,
}

/// Runs `case` with a fresh handler process of `profile`.
pub async fn run_case(case: &Case, profile: &Profile, vars: &BTreeMap<String, String>) -> Verdict {
    let started = tokio::time::Instant::now();
    let dir = match tempfile::Builder::new().prefix("capstan-conformance-").tempdir() {
        Ok(dir) => dir,
        Err(error) => return Verdict::broken(format!("a temporary folder: {error}"), started),
    };
    let mut session = Session {
        transcript: Vec::new(),
        ..Session::default()
    };
    let result = tokio::time::timeout(CASE_WITHIN, session.run(case, profile, vars, dir.path()))
        .await
        .unwrap_or_else(|_| Err(anyhow!("the case did not end within {CASE_WITHIN:?}")));
    if let Some(mut handler) = session.handler.take() {
        handler.stop().await;
    }
    let stderr = std::fs::read_to_string(dir.path().join("handler.stderr")).unwrap_or_default();
    let tail: Vec<&str> = stderr.lines().rev().take(40).collect();
    let stderr_tail = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
    Verdict {
        passed: result.is_ok(),
        failure: result.err().map(|error| format!("{error:#}")),
        transcript: session.transcript,
        stderr_tail,
        took: started.elapsed(),
    }
}

impl Verdict {
    fn broken(failure: String, started: tokio::time::Instant) -> Self {
        Self {
            passed: false,
            failure: Some(failure),
            transcript: Vec::new(),
            stderr_tail: String::new(),
            took: started.elapsed(),
        }
    }
}

/// One message received.
struct Received {
    kind: String,
    message: Value,
    consumed: bool,
    connection: usize,
}

enum Incoming {
    Message(Value),
    Undecodable(String),
    Ended(Option<Status>),
}

/// The stream of the current connection.
struct Live {
    number: usize,
    outbound: Option<mpsc::Sender<Result<Bytes, Status>>>,
    events: mpsc::Receiver<Incoming>,
    ended: bool,
    reader: JoinHandle<()>,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

#[derive(Default)]
struct Session {
    controller: Option<FakeController>,
    handler: Option<HandlerProcess>,
    live: Option<Live>,
    connections: usize,
    received: Vec<Received>,
    instance_id: Option<String>,
    expected_handlers: Vec<&'static str>,
    transcript: Vec<String>,
}

impl Session {
    async fn run(
        &mut self,
        case: &Case,
        profile: &Profile,
        vars: &BTreeMap<String, String>,
        dir: &Path,
    ) -> Result<()> {
        let steps = case.parsed_steps()?;
        let controller = FakeController::start(case.transport, dir).await?;
        self.expected_handlers = handlers_of(&profile.features);
        self.handler = Some(spawn_handler(profile, vars, &controller.endpoint, dir)?);
        self.controller = Some(controller);
        for (index, step) in steps.iter().enumerate() {
            self.note(format!("step {}: {}", index + 1, case.steps[index]));
            let context = || format!("step {} ({})", index + 1, case.steps[index]);
            self.step(step).await.with_context(context)?;
            // A frame that is no ConnectRequest fails the case, whatever the step looked at.
            if let Some(bad) = self.received.iter().find(|got| got.kind == UNDECODABLE) {
                return Err(anyhow!(
                    "the handler process sent a frame that is no ConnectRequest: {}",
                    bad.message
                ))
                .with_context(context);
            }
        }
        Ok(())
    }

    fn note(&mut self, line: String) {
        const MAX_LINE: usize = 600;
        let line = if line.len() > MAX_LINE {
            let mut end = MAX_LINE;
            while !line.is_char_boundary(end) {
                end -= 1;
            }
            format!("{}… ({} bytes)", &line[..end], line.len())
        } else {
            line
        };
        self.transcript.push(line);
    }

    async fn step(&mut self, step: &Step) -> Result<()> {
        match step {
            Step::Handshake {
                welcome,
                same_instance,
                hello,
            } => self.handshake(welcome, *same_instance, hello.as_ref()).await,
            Step::Connect => self.connect().await,
            Step::Send(message) => self.send(message).await,
            Step::SendRaw(bytes) => self.send_bytes(Bytes::from(bytes.clone())).await,
            Step::Invoke(options) => {
                let made =
                    invocation(options, &timestamp(SystemTime::now())).map_err(|error| anyhow!(error))?;
                self.send(&json!({"invocation": made})).await
            }
            Step::Expect {
                kind,
                pattern,
                within,
            } => self.expect(kind, pattern, *within).await.map(|_| ()),
            Step::ExpectNone {
                kind,
                pattern,
                during,
            } => self.expect_none(kind, pattern, *during).await,
            Step::ExpectOrder(order) => self.expect_order(order).await,
            Step::Close { code, message } => {
                let live = self.live.as_mut().ok_or_else(|| anyhow!("no stream to close"))?;
                match (code, live.outbound.take()) {
                    (tonic::Code::Ok, _) => {}
                    (code, Some(outbound)) => {
                        offer(&outbound, Err(Status::new(*code, message.clone()))).await?;
                    }
                    (_, None) => bail!("the stream is closed already"),
                }
                self.note(format!("→ closed with {code:?} {message}"));
                Ok(())
            }
            Step::ExpectClosed { within } => self.expect_closed(*within).await,
            Step::Signal(signal) => {
                let pid = self
                    .handler
                    .as_ref()
                    .and_then(|handler| handler.child.id())
                    .ok_or_else(|| anyhow!("the handler process is gone"))?;
                let status = tokio::process::Command::new("kill")
                    .arg(format!("-{signal}"))
                    .arg(pid.to_string())
                    .status()
                    .await?;
                if !status.success() {
                    bail!("kill -{signal} {pid} failed");
                }
                Ok(())
            }
            Step::ExpectExit { within, code } => {
                let handler = self
                    .handler
                    .as_mut()
                    .ok_or_else(|| anyhow!("no handler process"))?;
                let status = tokio::time::timeout(*within, handler.child.wait())
                    .await
                    .map_err(|_| anyhow!("the handler process still runs after {within:?}"))??;
                self.note(format!("handler process exited: {status}"));
                if let Some(code) = code
                    && status.code() != Some(*code)
                {
                    bail!("the handler process exited with {status}, expected code {code}");
                }
                Ok(())
            }
            Step::Sleep(duration) => {
                tokio::time::sleep(*duration).await;
                Ok(())
            }
        }
    }

    async fn connect(&mut self) -> Result<()> {
        let controller = self
            .controller
            .as_mut()
            .ok_or_else(|| anyhow!("no fake controller"))?;
        let handler = self
            .handler
            .as_mut()
            .ok_or_else(|| anyhow!("no handler process"))?;
        let Connection {
            mut inbound,
            outbound,
        } = tokio::select! {
            connection = controller.next_connection(CONNECT_WITHIN) => connection?,
            status = handler.child.wait() => bail!("the handler process exited ({}) instead of connecting", status?),
        };
        self.connections += 1;
        let (sender, events) = mpsc::channel(4096);
        let reader = tokio::spawn(async move {
            loop {
                let event = match inbound.message().await {
                    Ok(Some(bytes)) => match wire::decode_request(&bytes) {
                        Ok(message) => Incoming::Message(message),
                        Err(error) => Incoming::Undecodable(format!("{error:#}")),
                    },
                    Ok(None) => Incoming::Ended(None),
                    Err(status) => Incoming::Ended(Some(status)),
                };
                let last = matches!(event, Incoming::Ended(_));
                if sender.send(event).await.is_err() || last {
                    return;
                }
            }
        });
        self.live = Some(Live {
            number: self.connections,
            outbound: Some(outbound),
            events,
            ended: false,
            reader,
        });
        self.note(format!("connection {} opened", self.connections));
        Ok(())
    }

    async fn handshake(
        &mut self,
        overrides: &Value,
        same_instance: bool,
        hello_pattern: Option<&Value>,
    ) -> Result<()> {
        self.connect().await?;
        let hello = self
            .expect("hello", hello_pattern.unwrap_or(&json!({})), HELLO_WITHIN)
            .await?;
        let hello = &hello["hello"];
        let mut registered: Vec<&str> = hello["handlers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|handler| handler["handler_id"].as_str())
            .collect();
        registered.sort_unstable();
        if registered != self.expected_handlers {
            bail!(
                "the hello registers {registered:?}, the profile's features make {:?}",
                self.expected_handlers
            );
        }
        let instance = hello["instance_id"].as_str().unwrap_or_default().to_owned();
        if same_instance && self.instance_id.as_deref() != Some(instance.as_str()) {
            bail!(
                "the hello's instance_id is {instance:?}, the first connection's was {:?}",
                self.instance_id
            );
        }
        let mut overrides = overrides.clone();
        let mut take = |key: &str| {
            overrides
                .as_object_mut()
                .and_then(|map| map.remove(key))
                .unwrap_or(Value::Null)
        };
        let rejections = take("reject");
        let dropped = take("drop_capabilities");
        let added = take("add_capabilities");
        // What both sides support, as the controller answers; less what the case drops, plus
        // what it adds (values the SDK does not know).
        let mut capabilities: Vec<Value> = hello["capabilities"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|capability| {
                capability
                    .as_str()
                    .is_some_and(|name| CAPABILITIES.contains(&name))
            })
            .filter(|capability| {
                !dropped
                    .as_array()
                    .is_some_and(|dropped| dropped.contains(capability))
            })
            .cloned()
            .collect();
        capabilities.extend(added.as_array().into_iter().flatten().cloned());
        let registrations: Vec<Value> = hello["handlers"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|handler| {
                let id = handler["handler_id"].as_str().unwrap_or_default();
                match rejections.get(id) {
                    Some(diagnostic) => {
                        json!({"handler_id": id, "accepted": false, "diagnostics": [diagnostic]})
                    }
                    None => {
                        let mut status = json!({"handler_id": id, "accepted": true});
                        let resource = resolved_resource(id);
                        if !resource.is_null() {
                            status["resource"] = resource;
                        }
                        status
                    }
                }
            })
            .collect();
        let mut welcome = json!({
            "connection_id": format!("conformance-{}", self.connections),
            "capabilities": capabilities,
            "runtime": {"name": "capstan-conformance", "version": env!("CARGO_PKG_VERSION"), "language": "rust"},
            "limits": {
                "max_message_bytes": 16_777_216, "ping_interval": "10s", "ping_timeout": "30s",
                "max_in_flight": 256, "cancel_grace_period": "5s",
            },
            "registrations": registrations,
        });
        merge(&mut welcome, &overrides);
        self.send(&json!({"welcome": welcome})).await
    }

    async fn send(&mut self, message: &Value) -> Result<()> {
        let message = with_times(message, SystemTime::now());
        let bytes = wire::encode_response(&message)?;
        self.note(format!("→ {message}"));
        self.send_bytes(Bytes::from(bytes)).await
    }

    async fn send_bytes(&mut self, bytes: Bytes) -> Result<()> {
        let live = self
            .live
            .as_mut()
            .ok_or_else(|| anyhow!("no stream to send on"))?;
        let outbound = live
            .outbound
            .as_ref()
            .ok_or_else(|| anyhow!("the stream is closed"))?;
        offer(outbound, Ok(bytes)).await
    }

    /// Whether nothing more can come: no stream, or it ended.
    fn quiet(&self) -> bool {
        self.live.as_ref().is_none_or(|live| live.ended)
    }

    /// Takes what has arrived, waiting at most until `deadline` for something; returns at once
    /// when nothing more can come.
    async fn pump(&mut self, deadline: tokio::time::Instant) -> bool {
        let Some(live) = self.live.as_mut().filter(|live| !live.ended) else {
            return false;
        };
        let number = live.number;
        let event = tokio::select! {
            biased;
            event = live.events.recv() => event,
            () = tokio::time::sleep_until(deadline) => return false,
        };
        match event {
            Some(Incoming::Message(message)) => {
                let kind = wire::kind_of(&message).unwrap_or("(none)").to_owned();
                if kind == "hello" && self.instance_id.is_none() {
                    self.instance_id = message["hello"]["instance_id"].as_str().map(str::to_owned);
                }
                self.note(format!("← {message}"));
                self.received.push(Received {
                    kind,
                    message,
                    consumed: false,
                    connection: number,
                });
            }
            Some(Incoming::Undecodable(error)) => {
                self.note(format!("← undecodable: {error}"));
                self.received.push(Received {
                    kind: UNDECODABLE.into(),
                    message: json!({"error": error}),
                    consumed: false,
                    connection: number,
                });
            }
            Some(Incoming::Ended(status)) => {
                live.ended = true;
                // The handler process closed its side: the controller ends the stream then
                // (with OK, unless the case closed it already).
                live.outbound = None;
                self.note(format!(
                    "← stream ended: {}",
                    status.map_or_else(|| "OK".to_owned(), |status| format!("{status:?}"))
                ));
            }
            None => {
                if let Some(live) = self.live.as_mut() {
                    live.ended = true;
                    live.outbound = None;
                }
            }
        }
        true
    }

    /// Takes everything that has arrived, without waiting.
    async fn drain(&mut self) {
        while self.pump(tokio::time::Instant::now()).await {}
    }

    fn current(&self) -> usize {
        self.live.as_ref().map_or(0, |live| live.number)
    }

    /// Where the first message not taken yet of the current connection is that is of `kind`
    /// and matches `wrapped` (`{kind: pattern}`).
    fn waiting(&self, kind: &str, wrapped: &Value) -> Option<usize> {
        let current = self.current();
        self.received.iter().position(|got| {
            !got.consumed
                && got.connection == current
                && got.kind == kind
                && pattern::check(wrapped, &got.message).is_ok()
        })
    }

    async fn expect(&mut self, kind: &str, pattern: &Value, within: Duration) -> Result<Value> {
        let deadline = tokio::time::Instant::now() + within;
        let wrapped = json!({kind: pattern});
        loop {
            if let Some(at) = self.waiting(kind, &wrapped) {
                let current = self.current();
                let found = &mut self.received[at];
                found.consumed = true;
                let message = found.message.clone();
                if kind == "hello" {
                    let first = self.received.iter().find(|got| got.connection == current);
                    if let Some(first) = first.filter(|first| first.kind != "hello") {
                        bail!("a {} came before the hello: {}", first.kind, first.message);
                    }
                }
                return Ok(message);
            }
            if tokio::time::Instant::now() >= deadline || self.quiet() {
                break;
            }
            self.pump(deadline).await;
        }
        let near: Vec<String> = self
            .received
            .iter()
            .filter(|got| !got.consumed && got.connection == self.current() && got.kind == kind)
            .map(|got| pattern::check(&wrapped, &got.message).err().unwrap_or_default())
            .collect();
        let ended = self.quiet() && self.live.is_some();
        if near.is_empty() {
            bail!(
                "no {kind} within {within:?}{}",
                if ended {
                    " (the handler process ended the stream)"
                } else {
                    ""
                }
            );
        }
        bail!(
            "no {kind} matching within {within:?}; those that came differ: {}",
            near.join("; ")
        )
    }

    async fn expect_none(&mut self, kind: &str, pattern: &Value, during: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + during;
        while tokio::time::Instant::now() < deadline && !self.quiet() {
            self.pump(deadline).await;
        }
        match self.waiting(kind, &json!({kind: pattern})) {
            Some(at) => bail!("a {kind} came: {}", self.received[at].message),
            None => Ok(()),
        }
    }

    async fn expect_order(&mut self, order: &[(String, Value)]) -> Result<()> {
        self.drain().await;
        let current = self.current();
        let mut from = 0;
        for (kind, pattern) in order {
            let pattern = json!({kind.as_str(): pattern});
            let found = self.received[from..]
                .iter()
                .position(|got| {
                    got.connection == current
                        && &got.kind == kind
                        && pattern::check(&pattern, &got.message).is_ok()
                })
                .ok_or_else(|| anyhow!("no {pattern} after the messages before it in the order"))?;
            from += found + 1;
        }
        Ok(())
    }

    async fn expect_closed(&mut self, within: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + within;
        while !self.quiet() {
            if tokio::time::Instant::now() >= deadline {
                bail!("the handler process did not end its side of the stream within {within:?}");
            }
            self.pump(deadline).await;
        }
        Ok(())
    }
}

fn spawn_handler(
    profile: &Profile,
    vars: &BTreeMap<String, String>,
    endpoint: &str,
    dir: &Path,
) -> Result<HandlerProcess> {
    let stderr = std::fs::File::create(dir.join("handler.stderr"))?;
    let command: Vec<String> = profile.command.iter().map(|part| expand(part, vars)).collect();
    let mut process = tokio::process::Command::new(&command[0]);
    process
        .args(&command[1..])
        .current_dir(profile.workdir())
        .env("CAPSTAN_ENDPOINT", endpoint)
        .env("CAPSTAN_CONFORMANCE_FEATURES", profile.features.join(","))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        // A group of its own: what it starts (a shell's children) is stopped with it.
        .process_group(0)
        .kill_on_drop(true);
    for (key, value) in &profile.env {
        process.env(key, expand(value, vars));
    }
    let child = process
        .spawn()
        .with_context(|| format!("starting {command:?} in {}", profile.workdir().display()))?;
    Ok(HandlerProcess::new(child))
}

/// Merges `overrides` into `base`: objects key by key, anything else replaced.
fn merge(base: &mut Value, overrides: &Value) {
    match (base, overrides) {
        (Value::Object(base), Value::Object(overrides)) => {
            for (key, value) in overrides {
                merge(base.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
        (base, overrides) => *base = overrides.clone(),
    }
}

/// `{"$in": "2s"}` and `{"$ago": "2s"}` become timestamps relative to `now`.
fn with_times(value: &Value, now: SystemTime) -> Value {
    match value {
        Value::Object(map) if map.len() == 1 && (map.contains_key("$in") || map.contains_key("$ago")) => {
            let (key, offset) = map
                .iter()
                .next()
                .map(|(key, value)| (key.as_str(), value))
                .unwrap_or(("$in", &Value::Null));
            let offset = super::case::duration(offset).unwrap_or_default();
            let at = if key == "$in" {
                now + offset
            } else {
                now.checked_sub(offset).unwrap_or(now)
            };
            Value::String(timestamp(at))
        }
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(key, value)| (key.clone(), with_times(value, now)))
                .collect::<Map<_, _>>(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(|item| with_times(item, now)).collect()),
        other => other.clone(),
    }
}

/// RFC 3339, as protobuf's JSON form writes timestamps.
fn timestamp(at: SystemTime) -> String {
    prost_types::Timestamp::from(at).to_string()
}

/// Puts a message (or the status that ends the stream) on the stream, waiting at most
/// `SEND_WITHIN` for room.
async fn offer(outbound: &mpsc::Sender<Result<Bytes, Status>>, item: Result<Bytes, Status>) -> Result<()> {
    tokio::time::timeout(SEND_WITHIN, outbound.send(item))
        .await
        .map_err(|_| anyhow!("the handler process took nothing from the stream for {SEND_WITHIN:?}"))?
        .map_err(|_| anyhow!("the stream is gone"))
}
