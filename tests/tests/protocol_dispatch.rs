//! Dispatch through the real gRPC server over a real Unix socket, with the test acting as the
//! engine: invocation → result, temporary errors redelivered after their delay, cancellation,
//! redelivery after a dropped connection, stale results and malformed patches.

use std::time::Duration;

use tokio::time::Instant;

use capstan::model::{ChangeReason, Outcome, Patch, PatchTarget, PatchType, Payload, Work};
use capstan_proto::pb::{self, connect_request::Message as In, connect_response::Message as Out};
use capstan_tests::grpc::{RawClient, TestServer, cancelled, hello, merge_patch, registration, success};
use serde_json::json;

fn create_work(key: &str) -> Work {
    let mut work = Work::new(
        "create_fn",
        key,
        Payload::Change {
            reason: ChangeReason::Create,
            old: None,
            new: Some(json!({"spec": {}})),
            diff: vec![],
            field: String::new(),
        },
    );
    work.body = Some(json!({"metadata": {"name": "one"}, "spec": {"size": 1}}));
    work
}

async fn connect(server: &TestServer) -> anyhow::Result<RawClient> {
    let (client, _) = RawClient::connect(
        server.channel().await?,
        hello(vec![registration("create_fn", pb::HandlerKind::Create)]),
    )
    .await?;
    Ok(client)
}

#[tokio::test]
async fn an_invocation_round_trips_with_result_and_patch() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut client = connect(&server).await?;
    let hub = server.hub.clone();
    let outcome = tokio::spawn(async move { hub.invoke(create_work("uid-1/create_fn")).await });
    let inv = client.invocation().await?;
    assert_eq!(inv.handler_id, "create_fn");
    assert_eq!(inv.attempt, 1);
    assert_eq!(inv.idempotency_key, "uid-1/create_fn");
    let body: serde_json::Value = serde_json::from_slice(&inv.body.expect("body").json)?;
    assert_eq!(body["spec"]["size"], 1);
    let Some(pb::invocation::Payload::Change(change)) = inv.payload else {
        panic!("not a change")
    };
    assert_eq!(change.reason, pb::ChangeReason::Create as i32);
    client
        .send(success(
            &inv.invocation_id,
            Some(r#"{"message":"hello"}"#),
            vec![merge_patch(r#"{"spec":{"size":2}}"#)],
        ))
        .await?;
    let Outcome::Success { result, patches, .. } = outcome.await? else {
        panic!("not a success")
    };
    assert_eq!(result, Some(json!({"message": "hello"})));
    assert_eq!(
        patches,
        vec![Patch {
            patch_type: PatchType::Merge,
            target: PatchTarget::Object,
            body: json!({"spec": {"size": 2}})
        }]
    );
    Ok(())
}

#[tokio::test]
async fn a_temporary_error_is_redelivered_after_its_delay() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut client = connect(&server).await?;
    let hub = server.hub.clone();
    // The test is the engine: it retries temporary errors after the requested delay.
    let engine = tokio::spawn(async move {
        let mut work = create_work("uid-2/create_fn");
        loop {
            match hub.invoke(work.clone()).await {
                Outcome::Temporary {
                    delay, diagnostics, ..
                } => {
                    tokio::time::sleep(delay.unwrap_or_default()).await;
                    work.attempt += 1;
                    work.last_error = diagnostics.into_iter().next();
                }
                other => return other,
            }
        }
    });
    let first = client.invocation().await?;
    let failed_at = Instant::now();
    client
        .send(In::Result(pb::InvocationResult {
            invocation_id: first.invocation_id.clone(),
            outcome: Some(pb::invocation_result::Outcome::TemporaryError(
                pb::TemporaryError {
                    retry_after: Some(prost_types::Duration {
                        seconds: 0,
                        nanos: 400_000_000,
                    }),
                    diagnostics: vec![pb::Diagnostic {
                        summary: "not yet".into(),
                        ..Default::default()
                    }],
                },
            )),
            ..Default::default()
        }))
        .await?;
    let second = client.invocation().await?;
    assert!(
        failed_at.elapsed() >= Duration::from_millis(400),
        "redelivered too early"
    );
    assert_eq!(second.attempt, 2);
    assert_eq!(second.idempotency_key, first.idempotency_key);
    assert_ne!(second.invocation_id, first.invocation_id);
    assert_eq!(second.last_error.expect("last error").summary, "not yet");
    client.send(success(&second.invocation_id, None, vec![])).await?;
    assert_eq!(engine.await?, Outcome::success(None));
    Ok(())
}

#[tokio::test]
async fn a_long_invocation_is_cancelled_and_answers_cancelled() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut client = connect(&server).await?;
    let hub = server.hub.clone();
    let work = create_work("uid-3/create_fn");
    let control = capstan::grpc::Control::default();
    *control.reason.lock() = capstan::model::CancelReason::ResourceDeleted;
    let stop = control.cancel.clone();
    let outcome = tokio::spawn(async move { hub.dispatch(work, control).await });
    let inv = client.invocation().await?;
    stop.cancel();
    let Out::Cancel(cancel) = client.recv().await? else {
        panic!("expected a cancel")
    };
    assert_eq!(cancel.invocation_id, inv.invocation_id);
    assert_eq!(cancel.reason, pb::CancelReason::ResourceDeleted as i32);
    assert!(cancel.grace_period.is_some());
    client.send(cancelled(&inv.invocation_id)).await?;
    assert_eq!(outcome.await?, Outcome::Cancelled);
    Ok(())
}

#[tokio::test]
async fn a_deadline_sends_cancel_and_an_unanswered_attempt_times_out() -> anyhow::Result<()> {
    let server = TestServer::with_settings(
        Default::default(),
        capstan::grpc::hub::Settings {
            cancel_grace: Duration::from_millis(200),
            ..Default::default()
        },
    )
    .await?;
    let mut client = connect(&server).await?;
    let hub = server.hub.clone();
    let mut work = create_work("uid-4/create_fn");
    work.attempt_timeout = Some(Duration::from_millis(300));
    let outcome = tokio::spawn(async move { hub.invoke(work).await });
    let inv = client.invocation().await?;
    assert!(inv.deadline.is_some());
    let Out::Cancel(cancel) = client.recv().await? else {
        panic!("expected a cancel")
    };
    assert_eq!(cancel.reason, pb::CancelReason::DeadlineExceeded as i32);
    assert_eq!(outcome.await?, Outcome::TimedOut);
    // The late result is stale now.
    client.send(success(&inv.invocation_id, None, vec![])).await?;
    let Out::Notice(notice) = client.recv().await? else {
        panic!("expected a notice")
    };
    assert_eq!(notice.diagnostics[0].reason, "STALE_INVOCATION");
    Ok(())
}

/// An SDK enforces the deadline it was sent on its own clock and reports `Cancelled` when it
/// passes, a moment before the controller's own Cancel would go out: that attempt timed out.
/// (An admission handler stopped so was reported "cancelled" instead of "did not answer in
/// time".)
#[tokio::test]
async fn a_handler_that_stops_itself_at_its_deadline_timed_out() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut client = connect(&server).await?;
    let hub = server.hub.clone();
    let mut work = create_work("uid-4b/create_fn");
    work.attempt_timeout = Some(Duration::from_millis(1500));
    let outcome = tokio::spawn(async move { hub.invoke(work).await });
    let inv = client.invocation().await?;
    tokio::time::sleep(Duration::from_millis(1400)).await;
    client.send(cancelled(&inv.invocation_id)).await?;
    assert_eq!(outcome.await?, Outcome::TimedOut);
    Ok(())
}

#[tokio::test]
async fn a_dropped_connection_requeues_the_work_for_the_next_connection() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut first = connect(&server).await?;
    let hub = server.hub.clone();
    let outcome = tokio::spawn(async move { hub.invoke(create_work("uid-5/create_fn")).await });
    let lost = first.invocation().await?;
    drop(first);
    let mut second = connect_retrying(&server).await?;
    let again = second.invocation().await?;
    assert_eq!(again.attempt, 2);
    assert_eq!(again.idempotency_key, lost.idempotency_key);
    assert_eq!(
        again.last_error.expect("last error").reason,
        "HANDLER_PROCESS_LOST"
    );
    second
        .send(success(&again.invocation_id, Some("42"), vec![]))
        .await?;
    assert_eq!(outcome.await?, Outcome::success(Some(json!(42))));
    Ok(())
}

/// Connects, retrying while the previous connection's registration is still being released.
async fn connect_retrying(server: &TestServer) -> anyhow::Result<RawClient> {
    for _ in 0..50 {
        match RawClient::open(
            server.channel().await?,
            In::Hello(hello(vec![registration("create_fn", pb::HandlerKind::Create)])),
        )
        .await?
        {
            Ok(mut client) => {
                let Out::Welcome(_) = client.recv().await? else {
                    anyhow::bail!("no welcome")
                };
                return Ok(client);
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    anyhow::bail!("could not reconnect")
}

#[tokio::test]
async fn stale_results_and_malformed_patches_get_diagnostics() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut client = connect(&server).await?;
    client.send(success("no-such-invocation", None, vec![])).await?;
    let Out::Notice(notice) = client.recv().await? else {
        panic!("expected a notice")
    };
    assert_eq!(notice.invocation_id, "no-such-invocation");
    assert_eq!(notice.diagnostics[0].reason, "STALE_INVOCATION");

    let hub = server.hub.clone();
    let outcome = tokio::spawn(async move { hub.invoke(create_work("uid-6/create_fn")).await });
    let inv = client.invocation().await?;
    let bad = pb::Patch {
        r#type: pb::PatchType::Json as i32,
        target: pb::PatchTarget::Object as i32,
        body: Some(pb::Json {
            json: br#"{"op": "add"}"#.to_vec(),
        }),
    };
    client.send(success(&inv.invocation_id, None, vec![bad])).await?;
    let Out::Notice(notice) = client.recv().await? else {
        panic!("expected a notice")
    };
    assert_eq!(notice.diagnostics[0].reason, "MALFORMED_PATCH");
    let Outcome::Permanent { diagnostics, .. } = outcome.await? else {
        panic!("not permanent")
    };
    assert_eq!(diagnostics[0].reason, "MALFORMED_PATCH");
    // The connection is still usable.
    let hub = server.hub.clone();
    let next = tokio::spawn(async move { hub.invoke(create_work("uid-7/create_fn")).await });
    let inv = client.invocation().await?;
    client.send(success(&inv.invocation_id, None, vec![])).await?;
    assert_eq!(next.await?, Outcome::success(None));
    Ok(())
}

#[tokio::test]
async fn result_acks_are_sent_when_negotiated() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut h = hello(vec![registration("create_fn", pb::HandlerKind::Create)]);
    h.capabilities.push(pb::Capability::ResultAck as i32);
    let (mut client, welcome) = RawClient::connect(server.channel().await?, h).await?;
    assert!(welcome.capabilities.contains(&(pb::Capability::ResultAck as i32)));
    let hub = server.hub.clone();
    let outcome = tokio::spawn(async move { hub.invoke(create_work("uid-8/create_fn")).await });
    let inv = client.invocation().await?;
    client.send(success(&inv.invocation_id, None, vec![])).await?;
    let Out::ResultAck(ack) = client.recv().await? else {
        panic!("expected an ack")
    };
    assert!(ack.accepted);
    outcome.await?;
    client.send(success(&inv.invocation_id, None, vec![])).await?;
    let Out::ResultAck(ack) = client.recv().await? else {
        panic!("expected an ack")
    };
    assert!(!ack.accepted);
    assert_eq!(ack.diagnostics[0].reason, "STALE_INVOCATION");
    Ok(())
}
