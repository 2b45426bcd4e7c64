//! One operator file of our own, run once under real kopf (pinned from PyPI, `kopf run
//! --standalone -n default`) and once under `capstan.kopf` on the real Capstan controller
//! (`--persistence kopf`, `python -m capstan run`), each against its own API server, so that
//! what the handlers saw can be compared. The operator files pick their framework from
//! `CAPSTAN_DIFFERENTIAL` and append every call as one JSON line to `$DIFFERENTIAL_LOG` (and
//! calls whose timing is their own, such as event handlers', to `$DIFFERENTIAL_SIDE_LOG`).
//!
//! The differential tests (`python_kopf_*`) share this: the way each framework is started, the
//! call logs, and the waits on calls and objects.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Result, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, PostParams},
};
use serde_json::{Value, json};

use crate::{
    process::{Controller, Process, sdk_python},
    testenv::{TestEnv, repo_root},
};

/// kopf's last-handled configuration: written when a cause's handling is over.
pub const DIFFBASE: &str = "kopf.zalando.org/last-handled-configuration";

/// How long an operator may take to connect to its controller, and a wait on calls or objects
/// may take.
const WAIT: Duration = Duration::from_secs(90);

/// Which framework runs the operator file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framework {
    /// Real kopf.
    Kopf,
    /// `capstan.kopf` on the Capstan controller.
    Capstan,
}

/// The flags each framework's runner gets besides the operator file.
#[derive(Clone, Copy, Debug)]
pub struct Flags<'a> {
    /// `kopf run`'s, before `-n default <file>`: `--standalone` by default.
    pub kopf: &'a [&'a str],
    /// Capstan's controller's, after `--persistence kopf`: none by default (it runs without
    /// peering when the peering CRDs are not installed).
    pub controller: &'a [&'a str],
}

impl Default for Flags<'_> {
    fn default() -> Self {
        Self {
            kopf: &["--standalone"],
            controller: &[],
        }
    }
}

/// An operator file running under one framework against one API server.
pub struct Operator {
    /// The operator's process (kopf, or the Python handler process).
    pub process: Process,
    /// Capstan's controller, under [`Framework::Capstan`].
    pub controller: Option<Controller>,
}

impl Operator {
    /// Starts `file` (relative to the repository root) under `framework`, its calls logged to
    /// `log` and its side calls to [`side_log`], with the extra environment `vars`; both get
    /// the API server's kubeconfig (for the handlers' own kubectl). `run` tells the processes
    /// of several runs against one API server apart.
    ///
    /// # Errors
    /// When kopf, the SDK's Python or the controller cannot start, or the operator does not
    /// connect to its controller.
    pub async fn start(
        framework: Framework,
        env: &TestEnv,
        file: &str,
        log: &Path,
        vars: &[(&str, &str)],
        run: usize,
    ) -> Result<Self> {
        Self::start_with(framework, env, file, log, vars, run, Flags::default()).await
    }

    /// [`Operator::start`], with other flags for each framework (`kopf run`'s, such as
    /// peering; Capstan's controller's, for what kopf's process does itself, such as serving
    /// webhooks).
    ///
    /// # Errors
    /// As [`Operator::start`].
    pub async fn start_with(
        framework: Framework,
        env: &TestEnv,
        file: &str,
        log: &Path,
        vars: &[(&str, &str)],
        run: usize,
        flags: Flags<'_>,
    ) -> Result<Self> {
        let file = repo_root().join(file).display().to_string();
        let mut vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        vars.insert("DIFFERENTIAL_LOG".to_owned(), log.display().to_string());
        vars.insert(
            "DIFFERENTIAL_SIDE_LOG".to_owned(),
            side_log(log).display().to_string(),
        );
        vars.insert("PYTHONUNBUFFERED".to_owned(), "1".to_owned());
        vars.insert("KUBECONFIG".to_owned(), env.kubeconfig.display().to_string());
        let args = |parts: &[&str]| -> Vec<String> { parts.iter().map(|s| (*s).to_owned()).collect() };
        match framework {
            Framework::Kopf => {
                let kopf = crate::kopf::binary().await?;
                let mut kopf_args = vec!["run"];
                kopf_args.extend_from_slice(flags.kopf);
                kopf_args.extend(["-n", "default", &file]);
                let process = Process::spawn(
                    &format!("kopf-{run}"),
                    &kopf,
                    &args(&kopf_args),
                    &vars,
                    env.scratch(),
                )?;
                Ok(Self {
                    process,
                    controller: None,
                })
            }
            Framework::Capstan => {
                let python = sdk_python().await?;
                let mut controller_flags = vec!["--persistence", "kopf"];
                controller_flags.extend_from_slice(flags.controller);
                let controller = Controller::start(env, &format!("capstan-{run}"), &controller_flags).await?;
                vars.insert("CAPSTAN_ENDPOINT".to_owned(), controller.endpoint());
                vars.insert("CAPSTAN_DIFFERENTIAL".to_owned(), "capstan".to_owned());
                vars.insert(
                    "PYTHONPATH".to_owned(),
                    repo_root().join("sdk-python").display().to_string(),
                );
                let mut process = Process::spawn(
                    &format!("capstan-kopf-{run}"),
                    &python,
                    &args(&["-m", "capstan", "run", &file]),
                    &vars,
                    env.scratch(),
                )?;
                process.wait_for("connected to the controller", WAIT).await?;
                Ok(Self {
                    process,
                    controller: Some(controller),
                })
            }
        }
    }

    /// The operator's output (and the controller's), for a failure's context.
    pub fn output(&self) -> String {
        let mut out = format!("the operator's log:\n{}", self.process.output());
        if let Some(controller) = &self.controller {
            out.push_str(&format!(
                "\nthe controller's log:\n{}",
                controller.process.output()
            ));
        }
        out
    }

    /// Stops the operator (and its controller) with SIGTERM.
    ///
    /// # Errors
    /// When a process cannot be signalled or waited for.
    pub async fn stop(mut self) -> Result<()> {
        self.process.terminate().await?;
        if let Some(mut controller) = self.controller {
            controller.process.terminate().await?;
        }
        Ok(())
    }
}

/// The side log (calls compared as sets: daemons, timers, event handlers) beside `log`.
pub fn side_log(log: &Path) -> PathBuf {
    log.with_extension("side.jsonl")
}

/// The calls recorded so far in `log`, one JSON object per line.
pub fn calls(log: &Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Waits until the calls in `log` satisfy `done`.
///
/// # Errors
/// When they do not in time (the calls so far are in the error).
pub async fn wait_until(what: &str, log: &Path, mut done: impl FnMut(&[Value]) -> bool) -> Result<()> {
    let within = WAIT;
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if done(&calls(log)) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{what} did not happen within {within:?}; calls: {:?}", calls(log));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the object `name` exists and satisfies `done`, and returns it.
///
/// # Errors
/// When it does not in time, or the API fails.
pub async fn wait_object(
    api: &Api<DynamicObject>,
    name: &str,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> Result<Value> {
    let within = WAIT;
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let object = api.get_opt(name).await?;
        let value = object.as_ref().map(serde_json::to_value).transpose()?;
        if let Some(value) = &value
            && done(value)
        {
            return Ok(value.clone());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{what} did not happen within {within:?}: {value:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the object `name` is gone (its deletion released).
///
/// # Errors
/// When it is not in time, or the API fails.
pub async fn wait_gone(api: &Api<DynamicObject>, name: &str) -> Result<()> {
    let within = WAIT;
    let deadline = tokio::time::Instant::now() + within;
    while api.get_opt(name).await?.is_some() {
        if tokio::time::Instant::now() > deadline {
            bail!("{name} was not released for deletion within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Whether a per-handler progress record (kopf's format) is left on the object.
pub fn has_progress(obj: &Value) -> bool {
    obj.pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .is_some_and(|a| {
            a.keys()
                .any(|k| k.starts_with("kopf.zalando.org/") && k != DIFFBASE)
        })
}

/// Whether the handling of the object's last cause is over: its last-handled configuration is
/// written and no per-handler progress record is left.
pub fn handled(obj: &Value) -> bool {
    obj.pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .is_some_and(|a| a.contains_key(DIFFBASE))
        && !has_progress(obj)
}

/// The Pods of `default`, as the operator files' built-in resource.
pub fn pods(client: &Client) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), "default", &ApiResource::erase::<Pod>(&()))
}

/// Creates a Pod named `name` in `default` with `labels` (nothing runs it: the API server has
/// no nodes).
///
/// # Errors
/// When the API server refuses it.
pub async fn create_pod(pods: &Api<DynamicObject>, name: &str, labels: Value) -> Result<()> {
    let pod: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "spec": {"containers": [{"name": "only", "image": "busybox", "command": ["sleep", "1"]}]},
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    Ok(())
}
