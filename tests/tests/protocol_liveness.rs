//! Liveness and limits through the real gRPC server: a handler process that stops answering
//! pings is dropped, an oversized message ends only the offending stream, and `Goodbye` stops
//! new dispatch to a process.

use std::time::Duration;

use capstan::{
    grpc::connection,
    model::{Outcome, Payload, Work},
};
use capstan_proto::pb::{self, connect_request::Message as In};
use capstan_tests::grpc::{RawClient, TestServer, hello, registration, success};
use tonic::Code;

#[tokio::test]
async fn a_process_that_stops_answering_pings_is_dropped() -> anyhow::Result<()> {
    let settings = connection::Settings {
        ping_interval: Duration::from_millis(100),
        ping_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let server = TestServer::with_settings(settings, Default::default()).await?;
    let (mut client, welcome) = RawClient::connect(
        server.channel().await?,
        hello(vec![registration("c", pb::HandlerKind::Create)]),
    )
    .await?;
    assert_eq!(
        welcome
            .limits
            .expect("limits")
            .ping_timeout
            .expect("timeout")
            .nanos,
        300_000_000
    );
    // A responsive process survives several ping rounds.
    assert!(
        client.recv_within(Duration::from_millis(800)).await.is_err(),
        "nothing but pings expected"
    );
    assert_eq!(server.hub.connections(), 1);
    client.auto_pong = false;
    let status = client.ended(Duration::from_secs(5)).await?;
    assert_eq!(status.code(), Code::Unavailable);
    assert!(status.message().contains("PING_TIMEOUT"), "{}", status.message());
    assert_eq!(server.hub.connections(), 0);
    Ok(())
}

#[tokio::test]
async fn an_oversized_message_ends_only_that_stream() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let (mut bystander, _) = RawClient::connect(
        server.channel().await?,
        hello(vec![registration("other", pb::HandlerKind::Create)]),
    )
    .await?;
    let (mut client, _) = RawClient::connect(
        server.channel().await?,
        hello(vec![registration("c", pb::HandlerKind::Create)]),
    )
    .await?;
    let huge = "x".repeat(17 * 1024 * 1024);
    client
        .send(In::Log(pb::LogRecord {
            message: huge,
            level: pb::LogLevel::Info as i32,
            ..Default::default()
        }))
        .await?;
    let status = client.ended(Duration::from_secs(10)).await?;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("MESSAGE_TOO_LARGE"),
        "{}",
        status.message()
    );
    // The other connection still works.
    let hub = server.hub.clone();
    let outcome = tokio::spawn(async move { hub.invoke(Work::new("other", "k", Payload::Probe)).await });
    let inv = bystander.invocation().await?;
    bystander.send(success(&inv.invocation_id, None, vec![])).await?;
    assert_eq!(outcome.await?, Outcome::success(None));
    Ok(())
}

#[tokio::test]
async fn goodbye_stops_new_dispatch_but_finishes_running_work() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let (mut client, _) = RawClient::connect(
        server.channel().await?,
        hello(vec![registration("c", pb::HandlerKind::Create)]),
    )
    .await?;
    let hub = server.hub.clone();
    let running = tokio::spawn(async move { hub.invoke(Work::new("c", "a", Payload::Probe)).await });
    let inv = client.invocation().await?;
    client
        .send(In::Goodbye(pb::Goodbye {
            reason: "SIGTERM".into(),
            cleanup: false,
        }))
        .await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let hub = server.hub.clone();
    let waiting = tokio::spawn(async move { hub.invoke(Work::new("c", "b", Payload::Probe)).await });
    client.send(success(&inv.invocation_id, None, vec![])).await?;
    assert_eq!(running.await?, Outcome::success(None));
    assert!(
        client.recv_within(Duration::from_millis(300)).await.is_err(),
        "no new work after goodbye"
    );
    assert!(!waiting.is_finished());
    waiting.abort();
    Ok(())
}
