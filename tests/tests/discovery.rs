//! Resource discovery at run time: a handler registered for a resource whose CRD does not
//! exist yet is accepted with a warning, its objects are handled once the CRD is created,
//! the watch stops quietly when the CRD is deleted, and recreating the CRD resumes it.

use std::time::Duration;

use tokio::time::Instant;

use anyhow::{Result, bail, ensure};
use capstan_tests::{
    process::{Controller, Process, start_handler},
    scenario::tail,
    testenv::TestEnv,
};

const T: Duration = Duration::from_secs(60);

const CRD: &str = r"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.late.capstan.dev
spec:
  group: late.capstan.dev
  names: {kind: Widget, plural: widgets, singular: widget, listKind: WidgetList}
  scope: Namespaced
  versions:
    - name: v1
      served: true
      storage: true
      subresources: {status: {}}
      schema:
        openAPIV3Schema:
          type: object
          x-kubernetes-preserve-unknown-fields: true
";

fn widget(name: &str) -> String {
    format!(
        "apiVersion: late.capstan.dev/v1\nkind: Widget\nmetadata: {{name: {name}, namespace: default}}\nspec: {{size: 1}}\n"
    )
}

async fn wait_call(
    calls: &std::path::Path,
    line: &str,
    controller: &Controller,
    handler: &Process,
) -> Result<()> {
    let deadline = Instant::now() + T;
    loop {
        let text = std::fs::read_to_string(calls).unwrap_or_default();
        if text.lines().any(|l| l == line) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "no {line:?} in the call log:\n{text}\ncontroller:\n{}\nhandler:\n{}",
                tail(&controller.process.output(), 40),
                tail(&handler.output(), 20)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_crd_created_after_start_is_watched_dropped_when_deleted_and_resumed_when_recreated() -> Result<()>
{
    let env = TestEnv::start().await?;
    let mut controller = Controller::start(&env, "capstan", &[]).await?;
    let calls = env.scratch().join("calls.log");
    let log = calls.to_string_lossy().into_owned();
    let mut handler = start_handler(
        &env,
        "handler",
        &controller.endpoint(),
        &[("E2E_HANDLERS", "late"), ("E2E_LOG", log.as_str())],
    )?;
    controller
        .process
        .wait_for("handler process connected", T)
        .await?;
    ensure!(
        controller
            .process
            .output()
            .contains("is watched as soon as it is served"),
        "the registration must be accepted with a warning: {}",
        tail(&controller.process.output(), 20)
    );

    env.apply_crd(CRD, "widgets.late.capstan.dev").await?;
    env.apply(&widget("w1")).await?;
    wait_call(&calls, "late_create w1 1", &controller, &handler).await?;

    env.kubectl_ok(&["delete", "crd", "widgets.late.capstan.dev", "--wait=true"])
        .await?;
    controller
        .process
        .wait_for("resource is not served any more; waiting for it to appear", T)
        .await?;
    let deleted_at = controller.process.output().len();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = controller.process.output()[deleted_at..].to_owned();
    let warnings = after
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .count();
    ensure!(warnings <= 3, "errors flood after the CRD was deleted:\n{after}");
    ensure!(controller.process.running());

    env.apply_crd(CRD, "widgets.late.capstan.dev").await?;
    env.apply(&widget("w2")).await?;
    wait_call(&calls, "late_create w2 1", &controller, &handler).await?;

    let status = controller.process.terminate().await?;
    ensure!(status.success(), "exit status {status}");
    handler.kill().await?;
    env.stop().await
}
