//! Protocol fuzzing of the connection state machine over a real Unix socket: arbitrary
//! sequences of `ConnectRequest` messages (a hello anywhere or never, several hellos, results
//! and updates for unknown, empty or repeated invocation ids, patches of every type with any
//! body, log records, pongs and flow control with extreme values, goodbyes), sent to the
//! controller's real gRPC server. The server must neither panic nor stall: every rejection is a
//! diagnostic (a rejected registration carries one with a reason; a stream the server ends
//! carries a status message), and after every sequence a well-behaved handler process still
//! connects and is welcomed.
//!
//! `PROPTEST_CASES` sets the number of sequences (256 by default; `scripts/faults.sh --long`
//! raises it); failing seeds are kept in `tests/faults_protocol.proptest-regressions` and
//! replayed first.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use anyhow::Result;
use capstan_proto::pb::{self, connect_request::Message as In, connect_response::Message as Out};
use capstan_tests::grpc::{RawClient, TestServer, hello, registration};
use proptest::{
    prelude::*,
    test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner},
};

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "",
            "create_fn",
            "examples",
            "Example",
            "nope",
            "i-1",
            "spec.field",
            "a/b",
            "..",
            "*",
        ])
        .prop_map(str::to_owned),
        "[a-zA-Z0-9_./-]{0,24}",
        any::<String>(),
        (0usize..3).prop_map(|n| "x".repeat(n * 70_000)),
    ]
}

fn json() -> impl Strategy<Value = Option<pb::Json>> {
    prop::option::of(
        prop_oneof![
            prop::sample::select(vec![
                "{}",
                "null",
                "[]",
                "{\"metadata\":{\"labels\":{\"a\":\"b\"}}}",
                "[{\"op\":\"remove\",\"path\":\"/spec\"}]",
                "{\"status\":{\"a\":1}}",
                "{\"metadata\":{\"finalizers\":[]}}",
            ])
            .prop_map(|s| s.as_bytes().to_vec()),
            prop::collection::vec(any::<u8>(), 0..48),
            (1usize..400).prop_map(|n| "[".repeat(n).into_bytes()),
        ]
        .prop_map(|json| pb::Json { json }),
    )
}

fn patch() -> impl Strategy<Value = pb::Patch> {
    (-1i32..5, -1i32..4, json()).prop_map(|(r#type, target, body)| pb::Patch { r#type, target, body })
}

fn diagnostic() -> impl Strategy<Value = pb::Diagnostic> {
    (-1i32..5, text(), text()).prop_map(|(severity, summary, reason)| pb::Diagnostic {
        severity,
        summary,
        reason,
        ..Default::default()
    })
}

fn handler_registration() -> impl Strategy<Value = pb::HandlerRegistration> {
    (text(), -1i32..20, prop::option::of(text()), any::<bool>()).prop_map(|(id, kind, resource, good)| {
        if good {
            let kind = pb::HandlerKind::try_from(kind.clamp(1, 3)).unwrap_or(pb::HandlerKind::Create);
            registration(if id.is_empty() { "h" } else { &id }, kind)
        } else {
            pb::HandlerRegistration {
                handler_id: id,
                kind,
                resource: resource.map(|name| pb::ResourceSelector {
                    name,
                    ..Default::default()
                }),
                ..Default::default()
            }
        }
    })
}

fn outcome() -> impl Strategy<Value = Option<pb::invocation_result::Outcome>> {
    use pb::invocation_result::Outcome;
    prop_oneof![
        Just(None),
        json().prop_map(|result| Some(Outcome::Success(pb::Success {
            result,
            kind_result: None
        }))),
        (
            prop::option::of(any::<i64>()),
            prop::collection::vec(diagnostic(), 0..3)
        )
            .prop_map(
                |(secs, diagnostics)| Some(Outcome::TemporaryError(pb::TemporaryError {
                    retry_after: secs.map(|seconds| prost_types::Duration { seconds, nanos: 0 }),
                    diagnostics,
                }))
            ),
        prop::collection::vec(diagnostic(), 0..3)
            .prop_map(|diagnostics| Some(Outcome::PermanentError(pb::PermanentError { diagnostics }))),
    ]
}

/// Operator-wide settings with any text, enum value, duration and worker limit.
fn operator_settings() -> impl Strategy<Value = pb::OperatorSettings> {
    let duration = || {
        prop::option::of(
            (any::<i64>(), any::<i32>())
                .prop_map(|(seconds, nanos)| prost_types::Duration { seconds, nanos }),
        )
    };
    (
        (text(), text(), -1i32..5, -1i32..4),
        (text(), text(), duration(), duration(), any::<u32>()),
        (text(), any::<i64>(), any::<bool>(), any::<bool>(), duration()),
        (duration(), text()),
    )
        .prop_map(
            |(
                (finalizer, persistence_prefix, progress_storage, diffbase_storage),
                (diffbase_key, status_field, watch_inactivity_timeout, watch_server_timeout, worker_limit),
                (peering_name, peering_priority, peering_standalone, peering_mandatory, peering_lifetime),
                (api_timeout, webhook_managed),
            )| pb::OperatorSettings {
                finalizer,
                persistence_prefix,
                progress_storage,
                diffbase_storage,
                diffbase_key,
                status_field,
                watch_inactivity_timeout,
                watch_server_timeout,
                worker_limit,
                peering_name,
                peering_priority,
                peering_standalone,
                peering_mandatory,
                peering_lifetime,
                api_timeout,
                webhook_managed,
            },
        )
}

fn message() -> impl Strategy<Value = In> {
    prop_oneof![
        2 => prop::collection::vec(handler_registration(), 0..6).prop_map(|h| {
            let mut hello = hello(h);
            hello.capabilities.push(pb::Capability::OperatorSettings as i32);
            In::Hello(hello)
        }),
        3 => (text(), outcome(), prop::collection::vec(patch(), 0..4)).prop_map(|(invocation_id, outcome, patches)| {
            In::Result(pb::InvocationResult {
                invocation_id,
                outcome,
                patches,
                ..Default::default()
            })
        }),
        2 => (text(), prop::collection::vec(patch(), 0..4))
            .prop_map(|(invocation_id, patches)| In::Update(pb::InvocationUpdate { invocation_id, patches })),
        2 => (text(), -1i32..8, text(), text()).prop_map(|(invocation_id, level, message, event_type)| In::Log(pb::LogRecord {
            invocation_id,
            level,
            message,
            event_type,
            ..Default::default()
        })),
        1 => (any::<u64>(), any::<u32>()).prop_map(|(nonce, in_flight)| In::Pong(pb::Pong { nonce, in_flight })),
        1 => (text(), any::<u32>())
            .prop_map(|(handler_id, max_in_flight)| In::FlowControl(pb::FlowControl { handler_id, max_in_flight })),
        1 => (text(), any::<bool>()).prop_map(|(reason, cleanup)| In::Goodbye(pb::Goodbye { reason, cleanup })),
        1 => (-1i32..5, -1i32..6, prop::option::of(operator_settings())).prop_map(
            |(outcome_events, outcome_level, operator)| In::Settings(pb::ProcessSettings {
                outcome_events,
                outcome_level,
                operator,
            })
        ),
    ]
}

/// Plays one sequence against the server and checks what it answered.
async fn play(server: &TestServer, sequence: Vec<In>) -> Result<(), TestCaseError> {
    let fail = |e: anyhow::Error| TestCaseError::fail(e.to_string());
    let mut messages = sequence.into_iter();
    let Some(first) = messages.next() else {
        return Ok(());
    };
    let channel = server.channel().await.map_err(fail)?;
    match RawClient::open(channel, first).await.map_err(fail)? {
        Err(status) => {
            prop_assert!(
                !status.message().is_empty(),
                "refused without a reason: {status:?}"
            );
        }
        Ok(mut client) => {
            for m in messages {
                if client.send(m).await.is_err() {
                    break;
                }
            }
            client.close_send();
            loop {
                match client.recv_within(Duration::from_millis(300)).await {
                    Ok(Out::Welcome(w)) => {
                        for r in &w.registrations {
                            prop_assert!(
                                r.accepted
                                    || r.diagnostics
                                        .iter()
                                        .any(|d| !d.reason.is_empty() && !d.summary.is_empty()),
                                "a registration rejected without a diagnostic: {r:?}"
                            );
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        if let Some(ended) = e.downcast_ref::<capstan_tests::grpc::StreamEnded>() {
                            prop_assert!(
                                ended.0.code() == tonic::Code::Ok || !ended.0.message().is_empty(),
                                "the stream ended without a reason: {:?}",
                                ended.0
                            );
                        }
                        break;
                    }
                }
            }
        }
    }
    // The server is still there for a well-behaved process (with a handler id of its own: the
    // previous probe's connection may not be gone yet).
    static PROBES: AtomicU64 = AtomicU64::new(0);
    let id = format!("probe_{}", PROBES.fetch_add(1, Ordering::Relaxed));
    let channel = server.channel().await.map_err(fail)?;
    let (mut client, welcome) =
        RawClient::connect(channel, hello(vec![registration(&id, pb::HandlerKind::Create)]))
            .await
            .map_err(fail)?;
    prop_assert!(
        welcome.registrations.first().is_some_and(|r| r.accepted),
        "a good hello after the sequence was not accepted: {welcome:?}"
    );
    client.close_send();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arbitrary_message_sequences_are_answered_with_diagnostics_and_never_stall_the_server() -> Result<()>
{
    let server = TestServer::start().await?;
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(256);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/faults_protocol.proptest-regressions"
        )))),
        source_file: Some(file!()),
        ..Config::default()
    });
    let handle = tokio::runtime::Handle::current();
    let started = tokio::time::Instant::now();
    let result = runner.run(&prop::collection::vec(message(), 1..10), |sequence| {
        tokio::task::block_in_place(|| handle.block_on(play(&server, sequence)))
    });
    println!(
        "{cases} message sequences in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    server.stop().await;
    result.map_err(|e| anyhow::anyhow!("{e}"))
}
