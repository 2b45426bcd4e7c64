//! The handshake through the real gRPC server over a real Unix socket: per-registration
//! acceptance and rejection, refusal of streams that break the protocol, health and
//! reflection on the same socket.

use std::time::Duration;

use capstan_proto::pb::{self, connect_request::Message as In};
use capstan_tests::grpc::{RawClient, TestServer, hello, registration};
use tonic::Code;

#[tokio::test]
async fn registrations_are_accepted_or_rejected_one_by_one() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut unknown = registration("unknown_fn", pb::HandlerKind::Create);
    unknown.resource = Some(pb::ResourceSelector {
        name: "nonexistents".into(),
        ..Default::default()
    });
    let mut bad_filter = registration("filtered_fn", pb::HandlerKind::Update);
    bad_filter.filters = Some(pb::Filters {
        value: Some(pb::ValueMatch {
            condition: Some(pb::value_match::Condition::Presence(1)),
        }),
        ..Default::default()
    });
    let mut bad_kind = registration("weird_fn", pb::HandlerKind::Create);
    bad_kind.kind = 42;
    let handlers = vec![
        registration("create_fn", pb::HandlerKind::Create),
        unknown,
        bad_filter,
        registration("create_fn", pb::HandlerKind::Update),
        bad_kind,
        pb::HandlerRegistration {
            handler_id: "startup_fn".into(),
            kind: pb::HandlerKind::Startup as i32,
            ..Default::default()
        },
    ];
    let (_client, welcome) = RawClient::connect(server.channel().await?, hello(handlers)).await?;
    let verdicts: Vec<(String, bool, String)> = welcome
        .registrations
        .iter()
        .map(|r| {
            (
                r.handler_id.clone(),
                r.accepted,
                r.diagnostics
                    .first()
                    .map(|d| d.reason.clone())
                    .unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        verdicts,
        vec![
            ("create_fn".into(), true, String::new()),
            ("unknown_fn".into(), false, "UNKNOWN_RESOURCE".into()),
            ("filtered_fn".into(), false, "BAD_FILTER".into()),
            ("create_fn".into(), false, "DUPLICATE_HANDLER_ID".into()),
            ("weird_fn".into(), false, "UNKNOWN_HANDLER_KIND".into()),
            ("startup_fn".into(), true, String::new()),
        ]
    );
    let resolved = welcome.registrations[0]
        .resource
        .clone()
        .expect("resolved resource");
    assert_eq!(
        (resolved.plural.as_str(), resolved.group.as_str()),
        ("examples", "demo.capstan.dev")
    );
    let limits = welcome.limits.expect("limits");
    assert_eq!(limits.max_message_bytes, 16 * 1024 * 1024);
    assert!(
        welcome
            .capabilities
            .contains(&(pb::Capability::SdkFilters as i32))
    );
    assert_eq!(server.hub.registrations().borrow().len(), 2);
    Ok(())
}

#[tokio::test]
async fn nothing_accepted_ends_the_stream_with_failed_precondition() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let mut unknown = registration("unknown_fn", pb::HandlerKind::Create);
    unknown.resource = Some(pb::ResourceSelector {
        name: "nonexistents".into(),
        ..Default::default()
    });
    let refused = RawClient::open(server.channel().await?, In::Hello(hello(vec![unknown]))).await?;
    let status = refused.err().expect("the stream must be refused");
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status.message().contains("NO_HANDLERS_ACCEPTED"),
        "{}",
        status.message()
    );
    assert!(status.message().contains("nonexistents"), "{}", status.message());
    Ok(())
}

#[tokio::test]
async fn anything_but_hello_first_is_a_protocol_violation() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let refused = RawClient::open(
        server.channel().await?,
        In::Pong(pb::Pong {
            nonce: 1,
            in_flight: 0,
        }),
    )
    .await?;
    let status = refused.err().expect("the stream must be refused");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("first message must be hello"),
        "{}",
        status.message()
    );
    // The server is unaffected: a proper client still connects.
    let (_client, welcome) = RawClient::connect(
        server.channel().await?,
        hello(vec![registration("c", pb::HandlerKind::Create)]),
    )
    .await?;
    assert!(welcome.registrations[0].accepted);
    Ok(())
}

#[tokio::test]
async fn a_handler_id_owned_by_a_live_connection_is_rejected() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let (_first, _) = RawClient::connect(
        server.channel().await?,
        hello(vec![registration("c", pb::HandlerKind::Create)]),
    )
    .await?;
    let second = RawClient::open(
        server.channel().await?,
        In::Hello(hello(vec![registration("c", pb::HandlerKind::Create)])),
    )
    .await?;
    let status = second.err().expect("nothing accepted");
    assert!(status.message().contains("HANDLER_ID_TAKEN") || status.message().contains("already registered"));
    Ok(())
}

#[tokio::test]
async fn a_second_hello_ends_the_stream() -> anyhow::Result<()> {
    let server = TestServer::start().await?;
    let handlers = vec![registration("c", pb::HandlerKind::Create)];
    let (mut client, _) = RawClient::connect(server.channel().await?, hello(handlers.clone())).await?;
    client.send(In::Hello(hello(handlers))).await?;
    let status = client.ended(Duration::from_secs(5)).await?;
    assert_eq!(status.code(), Code::InvalidArgument);
    Ok(())
}

#[tokio::test]
async fn health_and_reflection_are_served_on_the_socket() -> anyhow::Result<()> {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    let server = TestServer::start().await?;
    let mut health = HealthClient::new(server.channel().await?);
    let response = health
        .check(HealthCheckRequest {
            service: "capstan.v1.RuntimeService".into(),
        })
        .await?
        .into_inner();
    assert_eq!(response.status(), ServingStatus::Serving);
    Ok(())
}
