//! kopf's `settings` that are the controller's work (the finalizer, where state is persisted,
//! watch timeouts, the worker limit), sent by a handler process in `ProcessSettings.operator`
//! as a kopf operator's startup handler sets them: the real `capstan` binary applies them as
//! if given as flags, before its first watch; a later change restarts its engine; a flag given
//! to the controller wins, and so does the process connected first, each said in a `Notice`.
//! The processes are raw protocol clients, so what is tested is the wire contract every SDK
//! relies on.

use std::time::Duration;

use anyhow::{Result, bail};
use capstan_proto::pb::{self, connect_request::Message as In, connect_response::Message as Out};
use capstan_tests::{
    grpc::{RawClient, hello, registration, success, unix_channel},
    process::Controller,
    testenv::{TestEnv, create_example, examples},
};
use serde_json::{Value, json};

/// How long each step may take.
const T: Duration = Duration::from_secs(60);

async fn env_with_crd() -> Result<TestEnv> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    Ok(env)
}

/// A process with a startup handler (`configure`) and create and delete handlers on examples
/// (a delete handler needs the finalizer), able to send `ProcessSettings`.
async fn connect(controller: &Controller) -> Result<RawClient> {
    connect_with(
        controller,
        vec![
            registration("create", pb::HandlerKind::Create),
            registration("delete", pb::HandlerKind::Delete),
        ],
    )
    .await
}

/// A process with a startup handler (`configure`) and `handlers`, able to send
/// `ProcessSettings`.
async fn connect_with(controller: &Controller, handlers: Vec<pb::HandlerRegistration>) -> Result<RawClient> {
    let mut registrations = vec![pb::HandlerRegistration {
        handler_id: "configure".into(),
        kind: pb::HandlerKind::Startup as i32,
        ..Default::default()
    }];
    registrations.extend(handlers);
    let mut handshake = hello(registrations);
    handshake.capabilities.extend([
        pb::Capability::ProcessSettings as i32,
        pb::Capability::OperatorSettings as i32,
    ]);
    let (client, welcome) =
        RawClient::connect(unix_channel(controller.socket.clone()).await?, handshake).await?;
    assert!(
        welcome
            .capabilities
            .contains(&(pb::Capability::OperatorSettings as i32)),
        "the controller does not take operator settings: {welcome:?}"
    );
    // As an SDK does: the settings as they are at the start, right after the welcome (the
    // process's registrations take effect once they came).
    client.send(settings(pb::OperatorSettings::default())).await?;
    Ok(client)
}

fn settings(operator: pb::OperatorSettings) -> In {
    In::Settings(pb::ProcessSettings {
        operator: Some(operator),
        ..Default::default()
    })
}

/// Answers the startup invocation after sending `first` (as an SDK sends the settings a
/// startup handler changed before its result).
async fn start_up(client: &mut RawClient, first: pb::OperatorSettings) -> Result<()> {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if let Out::Invocation(i) = client.recv_within(left).await?
            && i.handler_id == "configure"
        {
            client.send(settings(first)).await?;
            client.send(success(&i.invocation_id, None, vec![])).await?;
            return Ok(());
        }
    }
}

/// Answers every invocation with success until the object `name` satisfies `done`; returns
/// it and the notices received meanwhile.
async fn handle_until(
    env: &TestEnv,
    client: &mut RawClient,
    name: &str,
    done: impl Fn(&Value) -> bool,
) -> Result<(Value, Vec<pb::Notice>)> {
    let api = examples(&env.client().await?, "default");
    let deadline = tokio::time::Instant::now() + T;
    let mut notices = Vec::new();
    loop {
        if let Some(object) = api.get_opt(name).await? {
            let object = serde_json::to_value(object)?;
            if done(&object) {
                return Ok((object, notices));
            }
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{name} never got there");
        }
        answer_a_while(client, &mut notices).await?;
    }
}

/// Waits up to 200 ms for a message: answers an invocation with success, keeps a notice.
async fn answer_a_while(client: &mut RawClient, notices: &mut Vec<pb::Notice>) -> Result<()> {
    match client.recv_within(Duration::from_millis(200)).await {
        Ok(Out::Invocation(i)) => client.send(success(&i.invocation_id, None, vec![])).await?,
        Ok(Out::Notice(n)) => notices.push(n),
        Ok(_) => {}
        Err(e) if e.to_string().contains("nothing received") => {}
        Err(e) => return Err(e),
    }
    Ok(())
}

fn finalizers(object: &Value) -> Vec<String> {
    object
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|f| f.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

fn annotation_prefixes(object: &Value) -> Vec<String> {
    let mut prefixes: Vec<String> = object
        .pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .map(|a| {
            a.keys()
                .filter_map(|k| k.split_once('/').map(|(p, _)| p.to_owned()))
                .collect()
        })
        .unwrap_or_default();
    prefixes.dedup();
    prefixes
}

/// What a startup handler sets is in effect for an object that was there before the process
/// connected (its finalizer, the prefix of its progress and diff-base annotations), with no
/// flag given: the first watch already follows it; a change sent while
/// resources are watched restarts the engine, and objects handled after it follow it.
#[tokio::test]
async fn a_startup_handlers_settings_apply_before_the_first_watch_and_a_change_restarts_the_engine()
-> Result<()> {
    let env = env_with_crd().await?;
    let mut controller = Controller::start(&env, "capstan", &[]).await?;
    // There before the process: listed by the first watch, which must already follow the
    // settings the startup handler sends.
    create_example(&env, "first", json!({"field": "a"})).await?;
    let mut client = connect(&controller).await?;
    start_up(
        &mut client,
        pb::OperatorSettings {
            finalizer: "settings.example.com/finalizer".into(),
            persistence_prefix: "settings.example.com".into(),
            watch_server_timeout: Some(prost_types::Duration {
                seconds: 120,
                nanos: 0,
            }),
            worker_limit: 16,
            ..Default::default()
        },
    )
    .await?;
    let (first, notices) = handle_until(&env, &mut client, "first", |o| {
        annotation_prefixes(o).contains(&"settings.example.com".to_owned())
    })
    .await?;
    assert!(notices.is_empty(), "settings refused: {notices:?}");
    assert_eq!(finalizers(&first), ["settings.example.com/finalizer"], "{first}");
    assert_eq!(
        annotation_prefixes(&first),
        ["settings.example.com"],
        "capstan.dev's annotations were written too: {first}"
    );
    controller
        .process
        .wait_for("the handler processes' operator settings are applied", T)
        .await?;

    // A change once resources are watched: the engine restarts with it.
    client
        .send(settings(pb::OperatorSettings {
            finalizer: "changed.example.com/finalizer".into(),
            persistence_prefix: "settings.example.com".into(),
            ..Default::default()
        }))
        .await?;
    controller
        .process
        .wait_for("operator settings changed; the engine restarts with them", T)
        .await?;
    create_example(&env, "second", json!({"field": "b"})).await?;
    let (second, _) = handle_until(&env, &mut client, "second", |o| {
        annotation_prefixes(o).contains(&"settings.example.com".to_owned())
    })
    .await?;
    assert_eq!(finalizers(&second), ["changed.example.com/finalizer"], "{second}");
    Ok(())
}

/// A flag given to the controller wins over a process's setting, a process connected later
/// does not overrule the first, and values out of range are refused: each is said to the
/// process in a `Notice`, and the rest of its settings (the prefix) still applies.
#[tokio::test]
async fn a_given_flag_and_the_first_process_win_and_the_process_is_told() -> Result<()> {
    let env = env_with_crd().await?;
    let controller =
        Controller::start(&env, "capstan", &["--finalizer", "flag.example.com/finalizer"]).await?;
    let mut client = connect(&controller).await?;
    start_up(
        &mut client,
        pb::OperatorSettings {
            finalizer: "settings.example.com/finalizer".into(),
            persistence_prefix: "first.example.com".into(),
            status_field: "not/a/name".into(),
            worker_limit: 1_000_000,
            ..Default::default()
        },
    )
    .await?;
    // A second process, connected later, wants another prefix.
    let mut late = RawClient::connect(
        unix_channel(controller.socket.clone()).await?,
        pb::Hello {
            capabilities: vec![
                pb::Capability::ProcessSettings as i32,
                pb::Capability::OperatorSettings as i32,
            ],
            ..hello(vec![registration("late_create", pb::HandlerKind::Create)])
        },
    )
    .await?
    .0;
    late.send(settings(pb::OperatorSettings {
        persistence_prefix: "late.example.com".into(),
        ..Default::default()
    }))
    .await?;
    let late_notice = loop {
        match late.recv_within(T).await? {
            Out::Notice(n) => break n,
            Out::Invocation(i) => late.send(success(&i.invocation_id, None, vec![])).await?,
            _ => {}
        }
    };
    assert!(
        late_notice
            .diagnostics
            .iter()
            .any(|d| d.reason == "SETTING_OVERRULED"
                && d.summary.contains("connected earlier set \"first.example.com\"")),
        "{late_notice:?}"
    );
    let answer_late = tokio::spawn(async move {
        while let Ok(message) = late.recv_within(T).await {
            if let Out::Invocation(i) = message {
                let _ = late.send(success(&i.invocation_id, None, vec![])).await;
            }
        }
    });

    create_example(&env, "flagged", json!({"field": "a"})).await?;
    let (object, notices) = handle_until(&env, &mut client, "flagged", |o| {
        annotation_prefixes(o).contains(&"first.example.com".to_owned())
    })
    .await?;
    answer_late.abort();
    let said: Vec<(&str, &str, &str)> = notices
        .iter()
        .flat_map(|n| &n.diagnostics)
        .map(|d| (d.reason.as_str(), d.field.as_str(), d.summary.as_str()))
        .collect();
    for (reason, field) in [
        ("SETTING_OVERRULED", "settings.operator.finalizer"),
        ("BAD_SETTING", "settings.operator.status_field"),
        ("BAD_SETTING", "settings.operator.worker_limit"),
    ] {
        assert!(
            said.iter().any(|(r, f, _)| *r == reason && *f == field),
            "no {reason} about {field}: {said:?}"
        );
    }
    assert!(
        said.iter()
            .any(|(_, _, s)| s.contains("--finalizer flag.example.com/finalizer wins")),
        "{said:?}"
    );
    assert_eq!(finalizers(&object), ["flag.example.com/finalizer"], "{object}");
    assert_eq!(annotation_prefixes(&object), ["first.example.com"], "{object}");
    Ok(())
}

/// The entries of the cluster-wide peering `name` (its status; empty while it does not exist).
async fn peers(env: &TestEnv, name: &str) -> Result<Value> {
    let status = env
        .kubectl_ok(&[
            "get",
            "clustercapstanpeering",
            name,
            "-o",
            "jsonpath={.status}",
            "--ignore-not-found",
        ])
        .await?;
    Ok(serde_json::from_str(&status).unwrap_or(Value::Null))
}

/// kopf's `settings.peering` set by a startup handler: the operator's peering restarts under
/// the name and priority set (its entry leaves the peering of the flags), before the first
/// object is handled.
#[tokio::test]
async fn a_startup_handlers_peering_settings_move_the_operator_to_their_peering() -> Result<()> {
    let env = env_with_crd().await?;
    env.apply_peering_crds().await?;
    let mut controller = Controller::start(&env, "capstan", &["--peer-id", "settings-peer"]).await?;
    let deadline = tokio::time::Instant::now() + T;
    while peers(&env, "default").await?.get("settings-peer").is_none() {
        if tokio::time::Instant::now() > deadline {
            bail!("the operator never joined the default peering");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut client = connect(&controller).await?;
    start_up(
        &mut client,
        pb::OperatorSettings {
            peering_name: "from-settings".into(),
            peering_priority: 7,
            ..Default::default()
        },
    )
    .await?;
    controller
        .process
        .wait_for("peering restarts with them", T)
        .await?;
    create_example(&env, "peered", json!({"field": "a"})).await?;
    let (_, notices) = handle_until(&env, &mut client, "peered", |o| {
        !annotation_prefixes(o).is_empty()
    })
    .await?;
    assert!(notices.is_empty(), "{notices:?}");
    let moved = peers(&env, "from-settings").await?;
    assert_eq!(moved["settings-peer"]["priority"], json!(7), "{moved}");
    let left = peers(&env, "default").await?;
    assert!(
        left.get("settings-peer").is_none(),
        "still in the default peering: {left}"
    );
    Ok(())
}

/// A process that says it sends operator settings but sends none: its registrations wait for
/// them only as long as the handshake timeout, then take effect without them.
#[tokio::test]
async fn a_process_that_sends_no_settings_is_served_after_the_handshake_timeout() -> Result<()> {
    let env = env_with_crd().await?;
    let controller = Controller::start(&env, "capstan", &["--handshake-timeout", "2s"]).await?;
    let (mut client, _) = RawClient::connect(
        unix_channel(controller.socket.clone()).await?,
        pb::Hello {
            capabilities: vec![
                pb::Capability::ProcessSettings as i32,
                pb::Capability::OperatorSettings as i32,
            ],
            ..hello(vec![registration("create", pb::HandlerKind::Create)])
        },
    )
    .await?;
    let connected = tokio::time::Instant::now();
    create_example(&env, "unsettled", json!({"field": "a"})).await?;
    let invocation = loop {
        if let Out::Invocation(i) = client.recv_within(T).await? {
            break i;
        }
    };
    assert!(
        connected.elapsed() >= Duration::from_millis(1500),
        "invoked before the handshake timeout: {:?}",
        connected.elapsed()
    );
    client
        .send(success(&invocation.invocation_id, None, vec![]))
        .await?;
    Ok(())
}

/// The names of the validating webhook configurations in the cluster.
async fn validating_configurations(env: &TestEnv) -> Result<Vec<String>> {
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
    let list = kube::Api::<ValidatingWebhookConfiguration>::all(env.client().await?)
        .list(&Default::default())
        .await?;
    let mut names: Vec<String> = list.items.into_iter().filter_map(|c| c.metadata.name).collect();
    names.sort();
    Ok(names)
}

/// Answers invocations and collects notices until the validating configurations are `wanted`.
async fn configurations_become(
    env: &TestEnv,
    client: &mut RawClient,
    wanted: &[&str],
) -> Result<Vec<pb::Notice>> {
    let deadline = tokio::time::Instant::now() + T;
    let mut notices = Vec::new();
    loop {
        let names = validating_configurations(env).await?;
        if names == wanted {
            return Ok(notices);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the validating configurations are {names:?}, not {wanted:?}");
        }
        answer_a_while(client, &mut notices).await?;
    }
}

/// kopf's `admission.managed` and `networking.request_timeout` from a startup handler, with no
/// `--webhook-managed` or `--api-timeout` given: the controller writes the managed webhook
/// configurations under the setting's name and takes the timeout for its next requests; a new
/// name removes the configurations of the old one and writes them anew. Neither restarts the
/// engine.
#[tokio::test]
async fn the_managed_configurations_name_and_the_api_timeout_follow_the_settings() -> Result<()> {
    let env = env_with_crd().await?;
    let listen = format!("127.0.0.1:{}", capstan_tests::process::free_port()?);
    let mut controller = Controller::start(&env, "capstan", &["--webhook-listen", &listen]).await?;
    let mut client = connect_with(
        &controller,
        vec![registration("check", pb::HandlerKind::Validate)],
    )
    .await?;
    let wanted = |name: &str| pb::OperatorSettings {
        webhook_managed: name.into(),
        api_timeout: Some(prost_types::Duration {
            seconds: 45,
            nanos: 0,
        }),
        ..Default::default()
    };
    start_up(&mut client, wanted("first.example.com")).await?;
    let notices = configurations_become(&env, &mut client, &["first.example.com"]).await?;
    assert!(notices.is_empty(), "{notices:?}");
    controller
        .process
        .wait_for("the API requests' timeout changed", T)
        .await?;
    assert!(
        controller.process.output().contains("45s"),
        "{}",
        controller.process.output()
    );

    client.send(settings(wanted("second.example.com"))).await?;
    let notices = configurations_become(&env, &mut client, &["second.example.com"]).await?;
    assert!(notices.is_empty(), "{notices:?}");
    // A restart would follow the peering's check of the same change: give it the time.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let output = controller.process.output();
    assert!(
        !output.contains("the engine restarts with them"),
        "the engine restarted for settings that are not its own:\n{output}"
    );
    Ok(())
}
