//! A handler process is user code: buggy or hostile, it must not stall, crash or starve the
//! controller or the other processes. Each test drives the real `capstan` binary against the
//! real API server over its real socket with a raw protocol client that misbehaves in one way:
//! extreme durations, a process that stops reading, a huge `hello`, a silent connection; plus
//! what a controller restart, a second controller on the same socket and a non-loopback
//! `--listen` must do.

use std::{collections::BTreeSet, collections::HashMap, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result, anyhow, bail};
use capstan_proto::pb::{self, connect_request::Message as In, connect_response::Message as Out};
use capstan_tests::{
    grpc::{RawClient, hello, registration, success, unix_channel},
    process::{Controller, Process, capstan_binary, free_port},
    testenv::{TestEnv, create_example},
};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::{io::AsyncReadExt as _, net::UnixStream};
use tonic::Code;

async fn env_with_crd() -> Result<TestEnv> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    Ok(env)
}

fn duration(seconds: i64, nanos: i32) -> prost_types::Duration {
    prost_types::Duration { seconds, nanos }
}

fn status_of<'a>(welcome: &'a pb::Welcome, id: &str) -> &'a pb::RegistrationStatus {
    welcome
        .registrations
        .iter()
        .find(|s| s.handler_id == id)
        .unwrap_or_else(|| panic!("no status for {id}"))
}

/// Receives messages until an invocation comes (answering pings), within `timeout`.
async fn next_invocation(client: &mut RawClient, timeout: Duration) -> Result<pb::Invocation> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match client.recv_within(left).await? {
            Out::Invocation(i) => return Ok(i),
            _ => continue,
        }
    }
}

/// Durations at the edges of what the wire can carry are rejected at the handshake
/// (`BAD_DURATION`) or, for a result's `retry_after`, replaced by the handler's backoff; the
/// controller neither panics nor wedges the object.
#[tokio::test]
async fn extreme_durations_are_bad_durations_and_nothing_panics() -> Result<()> {
    let env = env_with_crd().await?;
    let controller = Controller::start(&env, "capstan", &[]).await?;
    let extreme = [
        ("u64_max_seconds", duration(u64::MAX as i64, 0)),
        ("i64_max_seconds", duration(i64::MAX, 999_999_999)),
        ("negative", duration(-5, 0)),
        ("nanos_out_of_range", duration(1, 2_000_000_000)),
        ("ten_years", duration(10 * 365 * 86_400, 0)),
    ];
    let mut handlers = Vec::new();
    for (name, d) in extreme {
        let mut timer = registration(&format!("timer_{name}"), pb::HandlerKind::Timer);
        timer.kind_options = Some(pb::handler_registration::KindOptions::Timer(pb::TimerOptions {
            interval: Some(d),
            ..Default::default()
        }));
        handlers.push(timer);
        let mut create = registration(&format!("create_{name}"), pb::HandlerKind::Create);
        create.timeout = Some(d);
        create.backoff = Some(d);
        handlers.push(create);
    }
    let mut good = registration("good", pb::HandlerKind::Create);
    good.backoff = Some(duration(1, 0));
    handlers.push(good);
    let (mut client, welcome) = RawClient::connect(unix_channel(controller.socket.clone()).await?, {
        let mut h = hello(handlers);
        h.capabilities.push(pb::Capability::ResultAck as i32);
        h
    })
    .await?;
    for (name, _) in extreme {
        for id in [format!("timer_{name}"), format!("create_{name}")] {
            let status = status_of(&welcome, &id);
            assert!(!status.accepted, "{id} accepted");
            assert!(
                status.diagnostics.iter().any(|d| d.reason == "BAD_DURATION"),
                "{id}: {:?}",
                status.diagnostics
            );
        }
    }
    assert!(status_of(&welcome, "good").accepted);

    create_example(&env, "one", json!({"size": 1})).await?;
    let first = next_invocation(&mut client, Duration::from_secs(60)).await?;
    assert_eq!(first.handler_id, "good");
    client
        .send(In::Result(pb::InvocationResult {
            invocation_id: first.invocation_id.clone(),
            outcome: Some(pb::invocation_result::Outcome::TemporaryError(
                pb::TemporaryError {
                    retry_after: Some(duration(i64::MAX, 999_999_999)),
                    diagnostics: vec![],
                },
            )),
            ..Default::default()
        }))
        .await?;
    let ack = loop {
        match client.recv_within(Duration::from_secs(30)).await? {
            Out::ResultAck(ack) => break ack,
            _ => continue,
        }
    };
    assert!(!ack.accepted, "an unusable retry_after is reported");
    assert_eq!(ack.diagnostics[0].reason, "BAD_DURATION");
    // The backoff (1 s) applies instead: the handler is called again, and the controller lives.
    let second = next_invocation(&mut client, Duration::from_secs(60))
        .await
        .with_context(|| format!("controller log:\n{}", controller.process.output()))?;
    assert_eq!(second.attempt, 2);
    client.send(success(&second.invocation_id, None, vec![])).await?;
    assert!(!controller.process.output().contains("panicked"));
    Ok(())
}

/// A channel whose HTTP/2 windows are small, so that a process that stops reading is
/// congested after a few messages.
async fn small_window_channel(path: PathBuf) -> Result<tonic::transport::Channel> {
    Ok(tonic::transport::Endpoint::from_static("http://capstan.invalid")
        .initial_stream_window_size(Some(65_535))
        .initial_connection_window_size(Some(65_535))
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await?)
}

/// A process that registers and then never reads stalls nothing: its connection is dropped
/// within the ping timeout, and its work goes to the next process that registers the handler.
#[tokio::test]
async fn a_process_that_stops_reading_is_dropped_and_its_work_redelivered() -> Result<()> {
    let env = env_with_crd().await?;
    let controller = Controller::start(
        &env,
        "capstan",
        &["--ping-interval", "1s", "--ping-timeout", "3s"],
    )
    .await?;
    let (stalled, _) = RawClient::connect(
        small_window_channel(controller.socket.clone()).await?,
        hello(vec![registration("stall_fn", pb::HandlerKind::Create)]),
    )
    .await?;
    // Enough large invocations to fill the stalled process's window and every buffer behind it.
    let names: BTreeSet<String> = (0..30).map(|i| format!("big-{i}")).collect();
    let filler = "x".repeat(30_000);
    for name in &names {
        create_example(&env, name, json!({"filler": filler})).await?;
    }
    // Another process gets the handler as soon as the stalled one is gone.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let mut rescuer = loop {
        let attempt = RawClient::connect(
            unix_channel(controller.socket.clone()).await?,
            hello(vec![registration("stall_fn", pb::HandlerKind::Create)]),
        )
        .await;
        match attempt {
            Ok((client, welcome)) if welcome.registrations.iter().all(|s| s.accepted) => break client,
            _ if tokio::time::Instant::now() > deadline => bail!(
                "the stalled process still holds its handler:\n{}",
                controller.process.output()
            ),
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    };
    let mut handled = BTreeSet::new();
    while handled != names {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let invocation = next_invocation(&mut rescuer, left.max(Duration::from_secs(1)))
            .await
            .with_context(|| {
                format!(
                    "handled {handled:?}; controller log:\n{}",
                    controller.process.output()
                )
            })?;
        let name = invocation.resource.map(|r| r.name).unwrap_or_default();
        rescuer
            .send(success(&invocation.invocation_id, None, vec![]))
            .await?;
        handled.insert(name);
    }
    let log = controller.process.output();
    assert!(
        log.contains("SEND_TIMEOUT") || log.contains("stopped reading") || log.contains("no pong in time"),
        "the stall was noticed:\n{log}"
    );
    drop(stalled);
    Ok(())
}

/// A `hello` with 150,000 registrations (about 10 MB, under the message limit) is refused at
/// once with `TOO_MANY_HANDLERS`, and never delays another process's registration.
#[tokio::test]
async fn a_huge_hello_is_refused_quickly_and_blocks_nobody() -> Result<()> {
    let env = env_with_crd().await?;
    let controller = Controller::start(&env, "capstan", &[]).await?;
    let huge: Vec<pb::HandlerRegistration> = (0..150_000)
        .map(|i| registration(&format!("handler_number_{i:06}"), pb::HandlerKind::Create))
        .collect();
    let socket = controller.socket.clone();
    let started = tokio::time::Instant::now();
    let flood = tokio::spawn(async move {
        let refused = RawClient::open(unix_channel(socket).await?, In::Hello(hello(huge))).await?;
        let status = match refused {
            Err(status) => status,
            Ok(mut client) => client.ended(Duration::from_secs(120)).await?,
        };
        anyhow::Ok((status, started.elapsed()))
    });
    // Meanwhile a normal process registers.
    let (_normal, welcome) = tokio::time::timeout(
        Duration::from_secs(30),
        RawClient::connect(
            unix_channel(controller.socket.clone()).await?,
            hello(vec![registration("normal", pb::HandlerKind::Create)]),
        ),
    )
    .await
    .map_err(|_| anyhow!("a normal hello was not answered within 30 s during the flood"))??;
    assert!(welcome.registrations[0].accepted);
    let (status, took) = tokio::time::timeout(Duration::from_secs(120), flood)
        .await
        .map_err(|_| anyhow!("the huge hello was not answered within 120 s"))???;
    eprintln!("huge hello refused after {took:?}");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("TOO_MANY_HANDLERS"),
        "{}",
        status.message()
    );
    assert!(took < Duration::from_secs(60), "refusing took {took:?}");

    // The documented cap itself is accepted, in linear time.
    let at_cap: Vec<pb::HandlerRegistration> = (0..1_000)
        .map(|i| registration(&format!("capped_{i:04}"), pb::HandlerKind::Create))
        .collect();
    let started = tokio::time::Instant::now();
    let (_capped, welcome) =
        RawClient::connect(unix_channel(controller.socket.clone()).await?, hello(at_cap)).await?;
    eprintln!("1,000 registrations welcomed after {:?}", started.elapsed());
    assert!(welcome.registrations.iter().all(|s| s.accepted));
    Ok(())
}

/// Invocation ids are never reused, even by a restarted controller.
#[tokio::test]
async fn invocation_ids_differ_across_controller_restarts() -> Result<()> {
    let env = env_with_crd().await?;
    let mut ids = Vec::new();
    for (round, name) in ["first", "second"].into_iter().enumerate() {
        let mut controller = Controller::start(&env, "capstan", &[]).await?;
        let (mut client, _) = RawClient::connect(
            unix_channel(controller.socket.clone()).await?,
            hello(vec![registration(
                &format!("ids_{round}"),
                pb::HandlerKind::Create,
            )]),
        )
        .await?;
        create_example(&env, name, json!({"size": 1})).await?;
        let invocation = next_invocation(&mut client, Duration::from_secs(60)).await?;
        client
            .send(success(&invocation.invocation_id, None, vec![]))
            .await?;
        ids.push(invocation.invocation_id);
        drop(client);
        controller.process.terminate().await?;
    }
    assert_ne!(ids[0], ids[1], "an invocation id was reused after a restart");
    Ok(())
}

/// Starts `capstan run` with `args` and returns the process (not waiting for it).
async fn spawn_capstan(env: &TestEnv, name: &str, args: &[&str]) -> Result<Process> {
    let mut all: Vec<String> = vec![
        "run".into(),
        "--admin-listen".into(),
        format!("127.0.0.1:{}", free_port()?),
    ];
    all.extend(args.iter().map(|s| (*s).to_owned()));
    let vars: HashMap<String, String> = [
        (
            "KUBECONFIG".to_owned(),
            env.kubeconfig.to_string_lossy().into_owned(),
        ),
        ("NO_COLOR".to_owned(), "1".to_owned()),
    ]
    .into();
    Process::spawn(name, &capstan_binary().await?, &all, &vars, env.scratch())
}

/// Waits until the process exits and returns whether it failed.
async fn exits_with_failure(process: &mut Process, timeout: Duration) -> Result<bool> {
    let deadline = tokio::time::Instant::now() + timeout;
    while process.running() {
        if tokio::time::Instant::now() > deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(true)
}

/// `--listen` on a TCP address that is not loopback is refused, unless the loudly named flag
/// allows it, and then a warning says so.
#[tokio::test]
async fn non_loopback_tcp_is_refused_without_the_insecure_flag() -> Result<()> {
    let env = TestEnv::start().await?;
    let port = free_port()?.to_string();
    let everywhere = format!("0.0.0.0:{port}");
    let mut refused = spawn_capstan(&env, "refused", &["--standalone", "--listen", &everywhere]).await?;
    assert!(
        exits_with_failure(&mut refused, Duration::from_secs(60)).await?,
        "capstan served on {everywhere}:\n{}",
        refused.output()
    );
    assert!(
        refused.output().contains("not a loopback address"),
        "{}",
        refused.output()
    );

    let mut allowed = spawn_capstan(
        &env,
        "allowed",
        &[
            "--standalone",
            "--listen",
            &everywhere,
            "--listen-insecure-non-loopback",
        ],
    )
    .await?;
    allowed
        .wait_for("capstan started", Duration::from_secs(60))
        .await?;
    assert!(allowed.output().contains("INSECURE"), "{}", allowed.output());
    allowed.terminate().await?;

    let loopback = format!("127.0.0.1:{}", free_port()?);
    let mut local = spawn_capstan(&env, "local", &["--standalone", "--listen", &loopback]).await?;
    local.wait_for("capstan started", Duration::from_secs(60)).await?;
    local.terminate().await?;
    Ok(())
}

/// A second controller on the same socket path refuses to start and leaves the first one's
/// socket alone; a socket nobody answers on is replaced.
#[tokio::test]
async fn a_second_controller_never_takes_a_live_socket_over() -> Result<()> {
    let env = env_with_crd().await?;
    let mut first = Controller::start(&env, "capstan", &[]).await?;
    let listen = first.endpoint();
    let mut second = spawn_capstan(&env, "second", &["--listen", &listen]).await?;
    assert!(
        exits_with_failure(&mut second, Duration::from_secs(60)).await?,
        "the second controller kept running:\n{}",
        second.output()
    );
    assert!(
        second.output().contains("another process is serving"),
        "{}",
        second.output()
    );
    // The first controller's socket still works.
    let (_client, welcome) = RawClient::connect(
        unix_channel(first.socket.clone()).await?,
        hello(vec![registration("still_here", pb::HandlerKind::Create)]),
    )
    .await
    .context("the first controller's socket was taken over")?;
    assert!(welcome.registrations[0].accepted);
    first
        .process
        .wait_for("handler process connected", Duration::from_secs(10))
        .await?;

    // After a crash (SIGKILL leaves the socket file behind), the next controller starts.
    first.process.kill().await?;
    assert!(first.socket.exists(), "a killed controller leaves its socket");
    let mut third = spawn_capstan(&env, "third", &["--listen", &listen]).await?;
    third.wait_for("capstan started", Duration::from_secs(60)).await?;
    third.terminate().await?;
    Ok(())
}

/// A connection that never sends the HTTP/2 preface is closed after the preface timeout.
#[tokio::test]
async fn a_silent_connection_is_closed_after_the_preface_timeout() -> Result<()> {
    let env = TestEnv::start().await?;
    let controller = Controller::start(&env, "capstan", &["--standalone", "--preface-timeout", "2s"]).await?;
    for partial in [&b""[..], &b"PRI * HTTP/2.0\r\n"[..]] {
        let mut raw = UnixStream::connect(&controller.socket).await?;
        tokio::io::AsyncWriteExt::write_all(&mut raw, partial).await?;
        let started = tokio::time::Instant::now();
        let mut buf = [0u8; 1024];
        let closed = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                match raw.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => continue,
                }
            }
        })
        .await;
        assert!(
            closed.is_ok(),
            "a connection that sent {partial:?} is still open after 30 s"
        );
        eprintln!(
            "connection that sent {} bytes closed after {:?}",
            partial.len(),
            started.elapsed()
        );
    }
    assert!(
        controller
            .process
            .output()
            .contains("no HTTP/2 connection preface")
    );
    Ok(())
}

/// Fields that come from a handler process (log messages, handler ids) cannot forge lines of
/// the controller's text log.
#[tokio::test]
async fn handler_fields_cannot_forge_log_lines() -> Result<()> {
    let env = env_with_crd().await?;
    let controller = Controller::start(&env, "capstan", &[]).await?;
    let (client, _) = RawClient::connect(
        unix_channel(controller.socket.clone()).await?,
        hello(vec![
            registration("plain", pb::HandlerKind::Create),
            // Rejected (no resource), so its id is logged with the rejection.
            pb::HandlerRegistration {
                handler_id: "bad\nFORGED handler id".into(),
                kind: pb::HandlerKind::Create as i32,
                ..Default::default()
            },
        ]),
    )
    .await?;
    client
        .send(In::Log(pb::LogRecord {
            level: pb::LogLevel::Warning as i32,
            message: "a\nFORGED line\r\n\u{1b}[31mFORGED too".into(),
            ..Default::default()
        }))
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !controller.process.output().contains("a\\nFORGED line") {
        if tokio::time::Instant::now() > deadline {
            bail!("the log record was not logged:\n{}", controller.process.output());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = controller.process.output();
    assert!(
        !log.lines()
            .any(|l| l.contains("FORGED") && l.trim_start().starts_with("FORGED")),
        "{log}"
    );
    assert!(
        !log.contains('\u{1b}'),
        "an escape sequence reached the log:\n{log}"
    );
    Ok(())
}

/// A `hello` above the message limit ends with `RESOURCE_EXHAUSTED` (`MESSAGE_TOO_LARGE`), as
/// documented.
#[tokio::test]
async fn an_oversized_hello_is_resource_exhausted() -> Result<()> {
    let env = TestEnv::start().await?;
    let controller = Controller::start(&env, "capstan", &["--standalone"]).await?;
    let mut reg = registration("big", pb::HandlerKind::Create);
    reg.param = Some(pb::Json {
        json: format!("\"{}\"", "x".repeat(20 * 1024 * 1024)).into_bytes(),
    });
    let status = match RawClient::open(
        unix_channel(controller.socket.clone()).await?,
        In::Hello(hello(vec![reg])),
    )
    .await?
    {
        Err(status) => status,
        Ok(mut client) => client.ended(Duration::from_secs(60)).await?,
    };
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("MESSAGE_TOO_LARGE"),
        "{}",
        status.message()
    );
    Ok(())
}

/// One HPACK "literal header field without indexing, new name" with short raw strings.
fn literal(name: &str, value: &str, out: &mut Vec<u8>) {
    out.push(0);
    for s in [name, value] {
        out.push(u8::try_from(s.len()).expect("short string"));
        out.extend_from_slice(s.as_bytes());
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8], out: &mut Vec<u8>) {
    let len = u32::try_from(payload.len()).expect("small frame").to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// Sends a request with one extra header over a raw HTTP/2 connection and waits until the
/// server resets the stream or closes the connection.
async fn refused_request(socket: &std::path::Path, extra: (&str, &str)) -> Result<()> {
    let mut block = Vec::new();
    literal(":method", "POST", &mut block);
    literal(":scheme", "http", &mut block);
    literal(":path", "/capstan.v1.RuntimeService/Connect", &mut block);
    literal(":authority", "localhost", &mut block);
    literal("content-type", "application/grpc", &mut block);
    literal(extra.0, extra.1, &mut block);
    let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    frame(0x4, 0, 0, &[], &mut bytes);
    frame(0x1, 0x4 | 0x1, 1, &block, &mut bytes);
    let mut raw = UnixStream::connect(socket).await?;
    tokio::io::AsyncWriteExt::write_all(&mut raw, &bytes).await?;
    let mut received = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), async {
        let mut buf = [0u8; 4096];
        loop {
            let n = raw.read(&mut buf).await?;
            if n == 0 {
                return anyhow::Ok(());
            }
            received.extend_from_slice(&buf[..n]);
            // A RST_STREAM (type 3) for stream 1, or a GOAWAY (type 7).
            if received
                .windows(9)
                .any(|w| (w[3] == 0x3 && w[5..9] == [0, 0, 0, 1]) || w[3] == 0x7)
            {
                return Ok(());
            }
        }
    })
    .await
    .map_err(|_| anyhow!("the malformed stream was neither reset nor closed"))?
}

/// Requests that the HTTP/2 layer refuses before any gRPC code runs (a stream error and a
/// connection error) are logged with their reason.
#[tokio::test]
async fn streams_refused_below_grpc_are_logged_with_their_reason() -> Result<()> {
    let env = TestEnv::start().await?;
    let controller = Controller::start(&env, "capstan", &["--standalone"]).await?;
    for (extra, reason) in [
        (("connection", "close"), "connection-specific header"),
        (("X-Upper", "1"), "uppercase header name"),
    ] {
        refused_request(&controller.socket, extra).await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let log = controller.process.output();
            if let Some(line) = log
                .lines()
                .find(|l| l.contains("refused below the gRPC layer") && l.contains(reason))
            {
                assert!(line.contains("PROTOCOL_ERROR"), "{line}");
                assert!(line.contains("/capstan.v1.RuntimeService/Connect"), "{line}");
                break;
            }
            if tokio::time::Instant::now() > deadline {
                bail!("the refusal ({reason}) was not logged:\n{log}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// A result ack means "well formed and taken": a patch the API server refuses later is acked
/// `accepted: true`, recorded as a failed attempt and retried, and the next invocation's
/// `last_error` carries the server's message (as `proto/README.md` says).
#[tokio::test]
async fn acks_mean_taken_and_refused_patches_come_back_as_last_error() -> Result<()> {
    let env = env_with_crd().await?;
    let controller = Controller::start(&env, "capstan", &[]).await?;
    let mut reg = registration("schema_fn", pb::HandlerKind::Create);
    reg.backoff = Some(duration(1, 0));
    let mut h = hello(vec![reg]);
    h.capabilities.push(pb::Capability::ResultAck as i32);
    let (mut client, _) = RawClient::connect(unix_channel(controller.socket.clone()).await?, h).await?;
    create_example(&env, "schema", json!({"size": 1})).await?;
    let first = next_invocation(&mut client, Duration::from_secs(60)).await?;
    let invalid = pb::Patch {
        r#type: pb::PatchType::Merge as i32,
        target: pb::PatchTarget::Object as i32,
        body: Some(pb::Json {
            json: br#"{"spec":{"size":"not a number"}}"#.to_vec(),
        }),
    };
    client
        .send(success(&first.invocation_id, None, vec![invalid]))
        .await?;
    let ack = loop {
        match client.recv_within(Duration::from_secs(30)).await? {
            Out::ResultAck(ack) => break ack,
            _ => continue,
        }
    };
    assert!(ack.accepted, "a well-formed result is taken: {ack:?}");
    let second = next_invocation(&mut client, Duration::from_secs(60))
        .await
        .with_context(|| format!("controller log:\n{}", controller.process.output()))?;
    assert_eq!(second.attempt, 2);
    let last = second.last_error.context("no last_error")?;
    assert_eq!(last.reason, "PREVIOUS_ATTEMPT_FAILED");
    assert!(last.summary.contains("rejected"), "{last:?}");
    client.send(success(&second.invocation_id, None, vec![])).await?;
    Ok(())
}
