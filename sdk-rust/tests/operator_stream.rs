//! The real `Operator` against an in-test controller serving `RuntimeService` over a Unix
//! socket: handshake, invocations, ping/pong, cancel, reconnect, goodbye, and rejection.

#![allow(clippy::unwrap_used)]

use std::{pin::Pin, time::Duration};

// This test plays the controller's side of the raw protocol, so it uses the generated types
// directly; the SDK's API never exposes them.
use capstan_proto::pb::{
    self,
    connect_request::Message as Up,
    connect_response::Message as Down,
    runtime_service_server::{RuntimeService, RuntimeServiceServer},
};
use capstan_sdk::{Context, Error, HandlerError, Operator, Registry};
use serde_json::json;
use tokio::{net::UnixListener, sync::mpsc, task::JoinHandle};
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::{Request, Response, Status, Streaming};

type Outbound = mpsc::Sender<Result<pb::ConnectResponse, Status>>;

struct Session {
    inbound: Streaming<pb::ConnectRequest>,
    outbound: Outbound,
}

impl Session {
    async fn recv(&mut self) -> Option<Up> {
        let message = tokio::time::timeout(Duration::from_secs(10), self.inbound.message())
            .await
            .ok()?;
        message.ok().flatten().and_then(|m| m.message)
    }

    /// The next message that is not a log record.
    async fn recv_significant(&mut self) -> Option<Up> {
        loop {
            match self.recv().await? {
                Up::Log(_) => continue,
                other => return Some(other),
            }
        }
    }

    async fn send(&self, message: Down) {
        self.outbound
            .send(Ok(pb::ConnectResponse {
                message: Some(message),
            }))
            .await
            .unwrap();
    }
}

struct Controller {
    sessions: mpsc::Sender<Session>,
    reject: bool,
}

#[tonic::async_trait]
impl RuntimeService for Controller {
    type ConnectStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::ConnectResponse, Status>> + Send>>;

    async fn connect(
        &self,
        request: Request<Streaming<pb::ConnectRequest>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        if self.reject {
            return Err(Status::failed_precondition(
                "no handler registration was accepted",
            ));
        }
        let (outbound, rx) = mpsc::channel(16);
        self.sessions
            .send(Session {
                inbound: request.into_inner(),
                outbound,
            })
            .await
            .unwrap();
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

fn serve(reject: bool) -> (tempfile::TempDir, String, mpsc::Receiver<Session>, JoinHandle<()>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("capstan.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let (sessions, rx) = mpsc::channel(4);
    let server = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(RuntimeServiceServer::new(Controller { sessions, reject }))
            .serve_with_incoming(UnixListenerStream::new(listener))
            .await
            .unwrap();
    });
    (dir, format!("unix://{}", path.display()), rx, server)
}

fn registry() -> Registry {
    let mut registry = Registry::new();
    registry.on_create(
        "examples.demo.capstan.dev",
        "create_fn",
        |ctx: Context| async move {
            ctx.info("hello from create_fn");
            ctx.patch().label("handled", "yes");
            Ok::<_, HandlerError>(json!({"message": format!("hello {}", ctx.name())}))
        },
    );
    registry.on_create(
        "examples.demo.capstan.dev",
        "slow_fn",
        |ctx: Context| async move {
            ctx.cancelled().await;
            Err::<(), _>(HandlerError::retry("cancelled"))
        },
    );
    registry
}

fn invocation(id: &str, handler_id: &str) -> Down {
    let body = json!({"metadata": {"name": "one", "namespace": "default"}});
    Down::Invocation(pb::Invocation {
        invocation_id: id.to_owned(),
        handler_id: handler_id.to_owned(),
        attempt: 1,
        body: Some(pb::Json {
            json: body.to_string().into_bytes(),
        }),
        payload: Some(pb::invocation::Payload::Change(pb::ResourceChange {
            reason: pb::ChangeReason::Create as i32,
            ..pb::ResourceChange::default()
        })),
        ..pb::Invocation::default()
    })
}

fn welcome(hello: &pb::Hello) -> Down {
    Down::Welcome(pb::Welcome {
        connection_id: "c1".to_owned(),
        registrations: hello
            .handlers
            .iter()
            .map(|h| pb::RegistrationStatus {
                handler_id: h.handler_id.clone(),
                accepted: true,
                ..Default::default()
            })
            .collect(),
        ..pb::Welcome::default()
    })
}

#[tokio::test]
async fn operator_serves_reconnects_and_says_goodbye() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("capstan_sdk=debug")
        .with_test_writer()
        .try_init();
    let (_dir, endpoint, mut sessions, server) = serve(false);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let operator = tokio::spawn(
        Operator::new(registry())
            .endpoint(endpoint)
            .shutdown_grace(Duration::from_secs(2))
            .run(async {
                let _ = stop_rx.await;
            }),
    );

    // Handshake.
    let mut session = sessions.recv().await.unwrap();
    let Some(Up::Hello(hello)) = session.recv().await else {
        panic!("expected hello")
    };
    assert_eq!(hello.handlers.len(), 2);
    assert!(hello.capabilities.contains(&(pb::Capability::SdkFilters as i32)));
    assert!(hello.capabilities.contains(&(pb::Capability::Subhandlers as i32)));
    assert!(
        hello
            .capabilities
            .contains(&(pb::Capability::ObjectUpdates as i32))
    );
    assert_eq!(hello.sdk.as_ref().unwrap().language, "rust");
    session.send(welcome(&hello)).await;

    // One invocation, one result.
    session.send(invocation("i1", "create_fn")).await;
    let Some(Up::Result(result)) = session.recv_significant().await else {
        panic!("expected a result")
    };
    assert_eq!(result.invocation_id, "i1");
    let Some(pb::invocation_result::Outcome::Success(success)) = result.outcome else {
        panic!("not a success")
    };
    assert_eq!(success.result.unwrap().json, br#"{"message":"hello one"}"#);
    assert_eq!(result.patches.len(), 1);
    assert!(result.duration.is_some());

    // A long invocation does not block pings; a cancel ends it.
    session.send(invocation("i2", "slow_fn")).await;
    session
        .send(Down::Ping(pb::Ping {
            nonce: 7,
            sent_time: None,
        }))
        .await;
    let Some(Up::Pong(pong)) = session.recv_significant().await else {
        panic!("expected a pong")
    };
    assert_eq!((pong.nonce, pong.in_flight), (7, 1));
    session
        .send(Down::Cancel(pb::Cancel {
            invocation_id: "i2".to_owned(),
            reason: pb::CancelReason::Superseded as i32,
            grace_period: None,
        }))
        .await;
    let Some(Up::Result(result)) = session.recv_significant().await else {
        panic!("expected a result")
    };
    assert_eq!(result.invocation_id, "i2");
    assert!(matches!(
        result.outcome,
        Some(pb::invocation_result::Outcome::Cancelled(_))
    ));

    // Notices, acks and drains are only logged.
    session
        .send(Down::Notice(pb::Notice {
            invocation_id: "i1".to_owned(),
            diagnostics: vec![],
        }))
        .await;
    session
        .send(Down::Drain(pb::Drain {
            reason: "test".to_owned(),
            ..Default::default()
        }))
        .await;

    // Losing the stream makes the SDK reconnect and register again.
    drop(session);
    let mut session = tokio::time::timeout(Duration::from_secs(10), sessions.recv())
        .await
        .unwrap()
        .unwrap();
    let Some(Up::Hello(again)) = session.recv().await else {
        panic!("expected a second hello")
    };
    assert_eq!(again.instance_id, hello.instance_id);
    session.send(welcome(&again)).await;
    session
        .send(Down::Ping(pb::Ping {
            nonce: 8,
            sent_time: None,
        }))
        .await;
    let Some(Up::Pong(pong)) = session.recv_significant().await else {
        panic!("expected a pong")
    };
    assert_eq!(pong.nonce, 8);

    // Shutdown sends goodbye and closes the stream.
    stop_tx.send(()).unwrap();
    let Some(Up::Goodbye(_)) = session.recv_significant().await else {
        panic!("expected goodbye")
    };
    assert!(session.recv().await.is_none());
    drop(session);
    tokio::time::timeout(Duration::from_secs(10), operator)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    server.abort();
}

#[tokio::test]
async fn object_updates_reach_running_daemons() {
    let (_dir, endpoint, mut sessions, server) = serve(false);
    let mut registry = Registry::new();
    registry.daemon("examples.demo.capstan.dev", "scaler", |ctx: Context| async move {
        while ctx.spec()["size"] == 1 {
            if ctx.wait_stopped(Duration::from_millis(10)).await {
                return Err(HandlerError::retry("stopped"));
            }
        }
        Ok(json!({"size": ctx.spec()["size"], "name": ctx.name()}))
    });
    let operator = tokio::spawn(
        Operator::new(registry)
            .endpoint(endpoint)
            .run(std::future::pending()),
    );
    let mut session = sessions.recv().await.unwrap();
    let Some(Up::Hello(hello)) = session.recv().await else {
        panic!("expected hello")
    };
    session.send(welcome(&hello)).await;
    let body = |size: u32| pb::Json {
        json: json!({"metadata": {"name": "one"}, "spec": {"size": size}})
            .to_string()
            .into_bytes(),
    };
    session
        .send(Down::Invocation(pb::Invocation {
            invocation_id: "d1".to_owned(),
            handler_id: "scaler".to_owned(),
            attempt: 1,
            body: Some(body(1)),
            payload: Some(pb::invocation::Payload::Daemon(pb::DaemonStart { restarts: 0 })),
            ..pb::Invocation::default()
        }))
        .await;
    // Updates for other invocations and malformed ones are ignored.
    for (invocation_id, json) in [("other", body(5).json), ("d1", b"{not json".to_vec())] {
        session
            .send(Down::ObjectUpdate(pb::ObjectUpdate {
                invocation_id: invocation_id.to_owned(),
                body: Some(pb::Json { json }),
            }))
            .await;
    }
    session
        .send(Down::ObjectUpdate(pb::ObjectUpdate {
            invocation_id: "d1".to_owned(),
            body: Some(body(2)),
        }))
        .await;
    let Some(Up::Result(result)) = session.recv_significant().await else {
        panic!("expected a result")
    };
    assert_eq!(result.invocation_id, "d1");
    let Some(pb::invocation_result::Outcome::Success(success)) = result.outcome else {
        panic!("not a success: {:?}", result.outcome)
    };
    assert_eq!(success.result.unwrap().json, br#"{"name":"one","size":2}"#);
    operator.abort();
    server.abort();
}

#[tokio::test]
async fn operator_stops_when_nothing_is_accepted() {
    let (_dir, endpoint, _sessions, server) = serve(true);
    let outcome = tokio::time::timeout(
        Duration::from_secs(10),
        Operator::new(registry())
            .endpoint(endpoint)
            .run(std::future::pending()),
    )
    .await
    .unwrap();
    assert!(matches!(outcome, Err(Error::Rejected { .. })), "{outcome:?}");
    server.abort();
}

#[tokio::test]
async fn invalid_setups_fail_fast() {
    let bad_endpoint = Operator::new(registry())
        .endpoint("localhost:1")
        .run(std::future::pending())
        .await;
    assert!(matches!(bad_endpoint, Err(Error::InvalidEndpoint { .. })));
    let mut duplicate = registry();
    duplicate.on_update("cex", "create_fn", |_ctx: Context| async {});
    let bad_registry = Operator::new(duplicate).run(std::future::pending()).await;
    assert!(matches!(bad_registry, Err(Error::Register { .. })));
}

#[tokio::test]
async fn kinds_the_controller_does_not_run_stop_the_operator_with_their_names() {
    let (_dir, endpoint, mut sessions, server) = serve(false);
    let mut registry = registry();
    registry.index(
        "examples.demo.capstan.dev",
        "by_size",
        |_ctx: Context| async move { Ok::<_, HandlerError>(None) },
    );
    let operator = tokio::spawn(
        Operator::new(registry)
            .endpoint(endpoint)
            .run(std::future::pending()),
    );
    let mut session = sessions.recv().await.unwrap();
    let Some(Up::Hello(hello)) = session.recv().await else {
        panic!("expected hello");
    };
    let Down::Welcome(mut welcome) = welcome(&hello) else {
        unreachable!()
    };
    for status in &mut welcome.registrations {
        if status.handler_id == "by_size" {
            status.accepted = false;
            status.diagnostics.push(pb::Diagnostic {
                severity: pb::Severity::Error as i32,
                summary: "this controller does not run index handlers".into(),
                reason: "UNSUPPORTED_HANDLER_KIND".into(),
                field: "handlers[2].kind".into(),
                ..Default::default()
            });
        }
    }
    session.send(Down::Welcome(welcome)).await;
    let result = tokio::time::timeout(Duration::from_secs(10), operator)
        .await
        .unwrap()
        .unwrap();
    match result {
        Err(error @ Error::Unsupported { .. }) => {
            let text = error.to_string();
            assert!(text.contains("by_size"), "{text}");
            assert!(text.contains("does not run index handlers"), "{text}");
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
    server.abort();
}

#[tokio::test]
async fn memos_live_per_object_until_the_controller_says_it_is_gone() {
    let (_dir, endpoint, mut sessions, server) = serve(false);
    let mut registry = Registry::new();
    registry.memo().insert("greeting", "hello");
    registry.on_create(
        "examples.demo.capstan.dev",
        "count_fn",
        |ctx: Context| async move {
            let calls = ctx
                .memo()
                .get_or_insert_with("calls", || std::sync::atomic::AtomicU32::new(0));
            let n = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            let greeting = ctx.memo().get::<&str>("greeting").map(|g| *g).unwrap_or("none");
            Ok::<_, HandlerError>(json!({"calls": n, "greeting": greeting}))
        },
    );
    let operator = tokio::spawn(
        Operator::new(registry)
            .endpoint(endpoint)
            .run(std::future::pending()),
    );
    let mut session = sessions.recv().await.unwrap();
    let Some(Up::Hello(hello)) = session.recv().await else {
        panic!("expected hello");
    };
    assert!(hello.capabilities.contains(&(pb::Capability::ObjectGone as i32)));
    session.send(welcome(&hello)).await;
    let call = |id: &str| {
        let Down::Invocation(mut inv) = invocation(id, "count_fn") else {
            unreachable!()
        };
        inv.resource = Some(pb::ResourceRef {
            uid: "uid-one".into(),
            name: "one".into(),
            ..Default::default()
        });
        Down::Invocation(inv)
    };
    let mut results = Vec::new();
    for id in ["i1", "i2", "i3"] {
        if id == "i3" {
            session
                .send(Down::ObjectGone(pb::ObjectGone {
                    object: Some(pb::ResourceRef {
                        uid: "uid-one".into(),
                        ..Default::default()
                    }),
                }))
                .await;
        }
        session.send(call(id)).await;
        let Some(Up::Result(result)) = session.recv_significant().await else {
            panic!("expected a result");
        };
        let Some(pb::invocation_result::Outcome::Success(success)) = result.outcome else {
            panic!("expected success");
        };
        let value: serde_json::Value = serde_json::from_slice(&success.result.unwrap().json).unwrap();
        results.push(value);
    }
    assert_eq!(
        results[0],
        json!({"calls": 1, "greeting": "hello"}),
        "copied from the operator memo"
    );
    assert_eq!(results[1]["calls"], 2, "kept between calls of one object");
    assert_eq!(results[2]["calls"], 1, "dropped once the object is gone");
    operator.abort();
    server.abort();
}
