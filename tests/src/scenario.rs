//! A complete end-to-end setup in one call: a testenv with the example CRD, a `capstan`
//! controller and an SDK handler process, plus helpers to poll objects and read the handler
//! call log.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Result, bail};
use kube::{
    Api, Client,
    api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};

use crate::{
    process::{Controller, Process, start_handler},
    testenv::{TestEnv, examples},
};

/// A running testenv, controller and handler process.
pub struct Scenario {
    /// The API server.
    pub env: TestEnv,
    /// An admin client.
    pub client: Client,
    /// The controller.
    pub controller: Controller,
    /// The handler process.
    pub handler: Process,
    /// The handlers' call log.
    pub calls: PathBuf,
    /// The presets given to the handler process.
    pub presets: String,
    /// The namespace of the test's objects.
    pub namespace: String,
}

impl Scenario {
    /// Starts everything; `presets` is the handler process's `E2E_HANDLERS`.
    pub async fn start(presets: &str, controller_args: &[&str]) -> Result<Self> {
        let env = TestEnv::start().await?;
        env.apply_example_crd().await?;
        let kubeconfig = env.kubeconfig.clone();
        Self::attach(env, &kubeconfig, presets, controller_args, "default").await
    }

    /// Starts a controller with `kubeconfig` (e.g. an impersonated identity) and a handler
    /// process on an existing testenv, with objects in `namespace`.
    pub async fn attach(
        env: TestEnv,
        kubeconfig: &Path,
        presets: &str,
        controller_args: &[&str],
        namespace: &str,
    ) -> Result<Self> {
        let client = env.client().await?;
        let mut controller = Controller::start_with(&env, kubeconfig, "capstan", controller_args).await?;
        let calls = env.scratch().join("calls.log");
        let handler = start_handler(
            &env,
            "handler",
            &controller.endpoint(),
            &[("E2E_HANDLERS", presets), ("E2E_LOG", &calls.to_string_lossy())],
        )?;
        controller
            .process
            .wait_for("handler process connected", Duration::from_secs(60))
            .await?;
        Ok(Self {
            env,
            client,
            controller,
            handler,
            calls,
            presets: presets.to_owned(),
            namespace: namespace.into(),
        })
    }

    /// Wraps a controller and an SDK's operator process (in place of the e2e handler process)
    /// on `env` into a scenario in `default`, once the controller saw the process connect and
    /// the process logged its connection, each within `timeout`. The SDK example tests (Go,
    /// Python) start their operators differently but join them to a scenario this one way.
    pub async fn with_operator(
        env: TestEnv,
        mut controller: Controller,
        mut operator: Process,
        timeout: Duration,
    ) -> Result<Self> {
        let client = env.client().await?;
        controller
            .process
            .wait_for("handler process connected", timeout)
            .await?;
        operator
            .wait_for("capstan: connected to the controller", timeout)
            .await?;
        let calls = env.scratch().join("calls.log");
        Ok(Self {
            env,
            client,
            controller,
            handler: operator,
            calls,
            presets: String::new(),
            namespace: "default".into(),
        })
    }

    /// The example API in the test namespace.
    pub fn api(&self) -> Api<DynamicObject> {
        examples(&self.client, &self.namespace)
    }

    /// Creates an example object with the given spec.
    pub async fn create(&self, name: &str, spec: Value) -> Result<Value> {
        self.create_with(name, spec, json!({})).await
    }

    /// Creates an example object with the given spec and metadata additions.
    pub async fn create_with(&self, name: &str, spec: Value, metadata: Value) -> Result<Value> {
        let mut meta = json!({"name": name, "namespace": self.namespace});
        json_patch::merge(&mut meta, &metadata);
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "demo.capstan.dev/v1", "kind": "Example", "metadata": meta, "spec": spec
        }))?;
        let created = self.api().create(&PostParams::default(), &obj).await?;
        Ok(serde_json::to_value(created)?)
    }

    /// Merge-patches an object (as a user would with kubectl).
    pub async fn patch(&self, name: &str, patch: Value) -> Result<()> {
        self.api()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    /// Deletes an object.
    pub async fn delete(&self, name: &str) -> Result<()> {
        self.api().delete(name, &DeleteParams::default()).await?;
        Ok(())
    }

    /// The object, or `None` when it does not exist.
    pub async fn get(&self, name: &str) -> Result<Option<Value>> {
        Ok(self
            .api()
            .get_opt(name)
            .await?
            .map(|o| serde_json::to_value(o).unwrap_or_default()))
    }

    /// Polls the object until `check` holds; returns it.
    pub async fn wait(
        &self,
        name: &str,
        timeout: Duration,
        what: &str,
        check: impl Fn(&Value) -> bool,
    ) -> Result<Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let current = self.get(name).await?;
            if let Some(obj) = &current
                && check(obj)
            {
                return Ok(obj.clone());
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "timed out after {timeout:?} waiting for {name}: {what}\nobject: {}\ncontroller log tail:\n{}\nhandler log tail:\n{}",
                    serde_json::to_string_pretty(&current).unwrap_or_default(),
                    tail(&self.controller.process.output(), 40),
                    tail(&self.handler.output(), 20)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Polls until the object is gone.
    pub async fn wait_gone(&self, name: &str, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.get(name).await?.is_some() {
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "{name} still exists after {timeout:?}\ncontroller log tail:\n{}",
                    tail(&self.controller.process.output(), 40)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// The handler calls so far: (handler id, object name, attempt).
    pub fn calls(&self) -> Vec<(String, String, u32)> {
        std::fs::read_to_string(&self.calls)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let mut parts = l.split_whitespace();
                let id = parts.next()?.to_owned();
                let name = parts.next()?.to_owned();
                let attempt = parts.next()?.parse().ok()?;
                Some((id, name, attempt))
            })
            .collect()
    }

    /// The handler process's notes of `kind` in the call log (lines like `lost <handler>
    /// <object> <attempt> <reason>` beside the calls), each as its words after `kind`.
    pub fn notes(&self, kind: &str) -> Vec<Vec<String>> {
        std::fs::read_to_string(&self.calls)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let mut words = l.split_whitespace();
                (words.next() == Some(kind)).then(|| words.map(str::to_owned).collect())
            })
            .collect()
    }

    /// How many times `handler` was called for `name`.
    pub fn count(&self, handler: &str, name: &str) -> usize {
        self.calls()
            .iter()
            .filter(|(h, n, _)| h == handler && n == name)
            .count()
    }

    /// Writes (create, update, patch, delete) by the controller to objects named `name`, from
    /// the audit log.
    pub fn writes(&self, name: &str) -> Vec<String> {
        writes_by(&self.env, name, "capstan/")
    }

    /// Restarts the handler process (after it was killed or stopped).
    pub async fn restart_handler(&mut self) -> Result<()> {
        self.handler = start_handler(
            &self.env,
            "handler",
            &self.controller.endpoint(),
            &[
                ("E2E_HANDLERS", &self.presets),
                ("E2E_LOG", &self.calls.to_string_lossy()),
            ],
        )?;
        Ok(())
    }
}

/// Write requests to the example object `name` by clients whose user agent starts with
/// `agent`, as `verb[/subresource]` strings.
pub fn writes_by(env: &TestEnv, name: &str, agent: &str) -> Vec<String> {
    env.audit_events()
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e["stage"] == "ResponseComplete")
        .filter(|e| e["userAgent"].as_str().is_some_and(|ua| ua.starts_with(agent)))
        .filter(|e| e["objectRef"]["resource"] == "examples" && e["objectRef"]["name"] == name)
        .filter(|e| matches!(e["verb"].as_str(), Some("create" | "update" | "patch" | "delete")))
        .map(|e| match e["objectRef"]["subresource"].as_str() {
            Some(sub) => format!("{}/{sub}", e["verb"].as_str().unwrap_or_default()),
            None => e["verb"].as_str().unwrap_or_default().to_owned(),
        })
        .collect()
}

/// The last `n` lines of a text.
pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// An annotation of an object.
pub fn annotation<'a>(obj: &'a Value, key: &str) -> Option<&'a str> {
    obj.pointer("/metadata/annotations")
        .and_then(|a| a.get(key))
        .and_then(Value::as_str)
}

/// A label of an object.
pub fn label<'a>(obj: &'a Value, key: &str) -> Option<&'a str> {
    obj.pointer("/metadata/labels")
        .and_then(|a| a.get(key))
        .and_then(Value::as_str)
}

/// Whether the object carries Capstan's finalizer.
pub fn has_finalizer(obj: &Value) -> bool {
    obj.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| f.iter().any(|x| x == "capstan.dev/finalizer"))
}

/// Capstan's progress annotations on an object (everything under the prefix except the
/// diff-base and the marker).
pub fn progress_keys(obj: &Value) -> Vec<String> {
    obj.pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .map(|a| {
            a.keys()
                .filter(|k| k.starts_with("capstan.dev/"))
                .filter(|k| !k.ends_with("/last-handled-configuration") && !k.ends_with("/kopf-managed"))
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}
