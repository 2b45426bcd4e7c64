//! One operator replica of an end-to-end test: a `capstan` controller with its own
//! `capstan-e2e-handler` process and that handler's call log. Tests of several replicas (peers,
//! a leader and its successor, sharding members, the operators of several nodes) start one
//! each and tell by the call logs which replica handled what.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Result, bail};

use crate::{
    process::{Controller, Process, start_handler},
    scenario::tail,
    testenv::TestEnv,
};

/// How long a handler process may take to connect to its controller.
const CONNECT: Duration = Duration::from_secs(60);

/// A controller, its handler process and the handler's call log (`E2E_LOG`: a line per call,
/// `<handler> <object> …`).
pub struct Operator {
    /// The name of its processes and files (`<name>`, `<name>-handler`, `<name>-calls.log`).
    pub name: String,
    /// The controller.
    pub controller: Controller,
    /// Its handler process.
    pub handler: Process,
    /// The handler's call log.
    pub calls: PathBuf,
}

/// How an [`Operator`] is started, beyond its name and the handler's presets.
#[derive(Clone, Copy, Debug, Default)]
pub struct Start<'a> {
    /// The controller's extra arguments.
    pub args: &'a [&'a str],
    /// The controller's kubeconfig, if not the testenv's (a fault-injecting proxy).
    pub kubeconfig: Option<&'a Path>,
    /// Extra environment of the handler process.
    pub handler_env: &'a [(&'a str, &'a str)],
}

impl Operator {
    /// Starts a controller with `args` and a handler process registering the `E2E_HANDLERS`
    /// presets `presets`, and waits until the handler connected.
    ///
    /// # Errors
    /// When either process does not start, or the handler does not connect in time.
    pub async fn start(env: &TestEnv, name: &str, presets: &str, args: &[&str]) -> Result<Self> {
        Self::start_with(
            env,
            name,
            presets,
            Start {
                args,
                ..Start::default()
            },
        )
        .await
    }

    /// Like [`Operator::start`], with everything [`Start`] offers.
    ///
    /// # Errors
    /// When either process does not start, or the handler does not connect in time.
    pub async fn start_with(env: &TestEnv, name: &str, presets: &str, start: Start<'_>) -> Result<Self> {
        let kubeconfig = start.kubeconfig.unwrap_or(&env.kubeconfig);
        let mut controller = Controller::start_with(env, kubeconfig, name, start.args).await?;
        let calls = env.scratch().join(format!("{name}-calls.log"));
        let calls_path = calls.to_string_lossy().into_owned();
        let mut vars = vec![("E2E_HANDLERS", presets), ("E2E_LOG", calls_path.as_str())];
        vars.extend_from_slice(start.handler_env);
        let handler = start_handler(env, &format!("{name}-handler"), &controller.endpoint(), &vars)?;
        controller
            .process
            .wait_for("handler process connected", CONNECT)
            .await?;
        Ok(Self {
            name: name.to_owned(),
            controller,
            handler,
            calls,
        })
    }

    /// The lines of its handler's call log.
    pub fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(&self.calls)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// How many times its handler `handler` was called for `object`.
    pub fn count(&self, handler: &str, object: &str) -> usize {
        self.calls()
            .iter()
            .filter(|l| l.split_whitespace().take(2).eq([handler, object]))
            .count()
    }

    /// The objects its handler `handler` was called for, with how often.
    pub fn called(&self, handler: &str) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for line in self.calls() {
            let mut parts = line.split_whitespace();
            if parts.next() == Some(handler)
                && let Some(object) = parts.next()
            {
                *out.entry(object.to_owned()).or_default() += 1;
            }
        }
        out
    }

    /// The controller's output so far.
    pub fn log(&self) -> String {
        self.controller.process.output()
    }

    /// Waits until the controller's output contains `needle` at least `n` times.
    ///
    /// # Errors
    /// When it does not within `timeout` (with the output's tail).
    pub async fn wait_log(&self, needle: &str, n: usize, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.log().matches(needle).count() < n {
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "{needle:?} did not appear {n} time(s) within {timeout:?}:\n{}",
                    tail(&self.log(), 30)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Waits until its handler `handler` was called for `object`.
    ///
    /// # Errors
    /// When it was not within `timeout` (with both processes' output).
    pub async fn wait_call(&self, handler: &str, object: &str, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.count(handler, object) == 0 {
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "no {handler} call for {object} within {timeout:?}\ncontroller:\n{}\nhandler:\n{}",
                    tail(&self.log(), 30),
                    tail(&self.handler.output(), 10)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Waits until at least `n` lines of the handler's call log start with `line`.
    ///
    /// # Errors
    /// When there are fewer within `timeout` (with the call log).
    pub async fn wait_line(&self, line: &str, n: usize, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let calls = self.calls();
            if calls.iter().filter(|l| l.starts_with(line)).count() >= n {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "{line:?} not {n} time(s) in the call log within {timeout:?}:\n{}",
                    calls.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops both processes gracefully (SIGTERM): the controller first, so that it drains
    /// while its handler process still answers.
    ///
    /// # Errors
    /// When a process cannot be signalled or waited for.
    pub async fn stop(mut self) -> Result<()> {
        self.controller.process.terminate().await?;
        self.handler.terminate().await?;
        Ok(())
    }

    /// Kills both processes (SIGKILL): a crash.
    ///
    /// # Errors
    /// When a process cannot be signalled or waited for.
    pub async fn kill(mut self) -> Result<()> {
        self.controller.process.kill().await?;
        self.handler.kill().await?;
        Ok(())
    }
}
