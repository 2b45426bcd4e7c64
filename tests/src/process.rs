//! Real processes for end-to-end tests: the `capstan` binary and handler processes, with their
//! output captured to files, readiness waits, SIGTERM and SIGKILL.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::{ExitStatus, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow, bail};
use tokio::{
    process::{Child, Command},
    sync::OnceCell,
};

use crate::testenv::{TestEnv, repo_root};

static CAPSTAN: OnceCell<PathBuf> = OnceCell::const_new();

/// The directory holding this build's binaries (`target/<profile>`).
pub fn bin_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let deps = exe
        .parent()
        .ok_or_else(|| anyhow!("no parent of {}", exe.display()))?;
    let dir = if deps.ends_with("deps") {
        deps.parent().unwrap_or(deps)
    } else {
        deps
    };
    Ok(dir.to_path_buf())
}

/// The `capstan` binary of this build, built on first use, or `CAPSTAN_TEST_BINARY` when set
/// (`scripts/test.sh` sets it to the binary its workspace build made: a nested `cargo build`
/// from inside a test process resolves other features and environment, recompiles the
/// dependencies and the binary while tests run, and starves timing-sensitive tests of CPU).
pub async fn capstan_binary() -> Result<PathBuf> {
    CAPSTAN
        .get_or_try_init(|| async {
            if let Some(bin) = std::env::var_os("CAPSTAN_TEST_BINARY").map(PathBuf::from) {
                if !bin.is_file() {
                    bail!("CAPSTAN_TEST_BINARY={} is not a file", bin.display());
                }
                return Ok(bin);
            }
            let dir = bin_dir()?;
            let profile = dir
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("debug")
                .to_owned();
            let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
            cmd.current_dir(repo_root())
                .args(["build", "-p", "capstan", "--bin", "capstan"]);
            if profile == "release" {
                cmd.arg("--release");
            }
            if let Some(target) = dir.parent() {
                cmd.env("CARGO_TARGET_DIR", target);
            }
            let status = cmd
                .status()
                .await
                .context("running cargo build for the capstan binary")?;
            if !status.success() {
                bail!("building the capstan binary failed");
            }
            Ok(dir.join("capstan"))
        })
        .await
        .cloned()
}

/// The end-to-end handler process binary of the tests crate.
pub fn handler_binary() -> Result<PathBuf> {
    let path = bin_dir()?.join("capstan-e2e-handler");
    if !path.is_file() {
        bail!(
            "{} is missing; run the tests with cargo test -p capstan-tests",
            path.display()
        );
    }
    Ok(path)
}

/// A free loopback TCP port.
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A child process with its output in a log file.
pub struct Process {
    child: Child,
    /// Its combined stdout and stderr (appended to when a process is restarted under the
    /// same name).
    pub log: PathBuf,
    name: String,
    /// Where this process's own output starts in the log.
    offset: u64,
}

impl Process {
    /// Starts `program` with `args` and `env`, logging to `<dir>/<name>.log`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        env: &HashMap<String, String>,
        dir: &Path,
    ) -> Result<Self> {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&log)?;
        let offset = file.metadata()?.len();
        let child = Command::new(program)
            .args(args)
            .envs(env)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        Ok(Self {
            child,
            log,
            name: name.to_owned(),
            offset,
        })
    }

    /// This process's output so far.
    pub fn output(&self) -> String {
        let all = std::fs::read(&self.log).unwrap_or_default();
        let start = usize::try_from(self.offset).unwrap_or(0).min(all.len());
        String::from_utf8_lossy(&all[start..]).into_owned()
    }

    /// Waits until the output contains `needle`.
    pub async fn wait_for(&mut self, needle: &str, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.output().contains(needle) {
                return Ok(());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "{} exited ({status}) before printing {needle:?}:\n{}",
                    self.name,
                    tail(&self.output())
                );
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "{} did not print {needle:?} within {timeout:?}:\n{}",
                    self.name,
                    tail(&self.output())
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends SIGTERM and waits for the exit.
    pub async fn terminate(&mut self) -> Result<ExitStatus> {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status()
                .await;
        }
        match tokio::time::timeout(Duration::from_secs(40), self.child.wait()).await {
            Ok(status) => Ok(status?),
            Err(_) => {
                self.child.start_kill()?;
                bail!("{} did not exit within 40 s of SIGTERM", self.name)
            }
        }
    }

    /// Kills the process with SIGKILL, as a crash would.
    pub async fn kill(&mut self) -> Result<()> {
        self.child.start_kill()?;
        let _ = self.child.wait().await;
        Ok(())
    }

    /// Its process id, while it runs.
    pub fn id(&self) -> Option<u32> {
        self.child.id()
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// A `capstan` controller process against a testenv.
pub struct Controller {
    /// The process.
    pub process: Process,
    /// The socket handler processes dial.
    pub socket: PathBuf,
    /// The admin endpoint address.
    pub admin: String,
}

impl Controller {
    /// Starts `capstan run` with extra arguments, listening on a socket in the testenv's
    /// scratch directory. `name` distinguishes several controllers of one test.
    pub async fn start(env: &TestEnv, name: &str, extra: &[&str]) -> Result<Self> {
        Self::start_with(env, &env.kubeconfig, name, extra).await
    }

    /// Like [`Controller::start`] with another kubeconfig (a proxy, an impersonated identity).
    pub async fn start_with(env: &TestEnv, kubeconfig: &Path, name: &str, extra: &[&str]) -> Result<Self> {
        let mut controller = Self::spawn_with(env, kubeconfig, name, extra).await?;
        controller
            .process
            .wait_for("capstan started", Duration::from_secs(60))
            .await?;
        Ok(controller)
    }

    /// Like [`Controller::start`], without waiting for it to have started.
    pub async fn spawn(env: &TestEnv, name: &str, extra: &[&str]) -> Result<Self> {
        Self::spawn_with(env, &env.kubeconfig, name, extra).await
    }

    /// Like [`Controller::start_with`], without waiting for it to have started.
    pub async fn spawn_with(env: &TestEnv, kubeconfig: &Path, name: &str, extra: &[&str]) -> Result<Self> {
        let bin = capstan_binary().await?;
        let socket = env.scratch().join(format!("{name}.sock"));
        let admin = format!("127.0.0.1:{}", free_port()?);
        let mut args: Vec<String> = vec![
            "run".into(),
            "--listen".into(),
            format!("unix://{}", socket.display()),
            "--admin-listen".into(),
            admin.clone(),
            "--log".into(),
            "info,capstan=debug".into(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let mut vars = HashMap::new();
        vars.insert("KUBECONFIG".to_owned(), kubeconfig.to_string_lossy().into_owned());
        vars.insert("NO_COLOR".to_owned(), "1".to_owned());
        let process = Process::spawn(name, &bin, &args, &vars, env.scratch())?;
        Ok(Self {
            process,
            socket,
            admin,
        })
    }

    /// Restarts the controller with the same socket and arguments after it stopped.
    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// GETs an admin path and returns (status code, body).
    pub async fn admin_get(&self, path: &str) -> Result<(u16, String)> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(&self.admin).await?;
        stream
            .write_all(
                format!(
                    "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
                    self.admin
                )
                .as_bytes(),
            )
            .await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        let text = String::from_utf8_lossy(&raw);
        let code = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok((code, body))
    }
}

/// A handler process of the tests crate (`capstan-e2e-handler`).
pub fn start_handler(env: &TestEnv, name: &str, endpoint: &str, vars: &[(&str, &str)]) -> Result<Process> {
    let bin = handler_binary()?;
    let mut env_vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    env_vars.insert("CAPSTAN_ENDPOINT".into(), endpoint.to_owned());
    env_vars.entry("RUST_LOG".into()).or_insert_with(|| "info".into());
    Process::spawn(name, &bin, &[], &env_vars, env.scratch())
}

/// The python of a virtualenv with pinned dependencies: `$var` when set (as `scripts/test.sh`
/// does), or else the path that `script` (relative to the repository root) prints on its last
/// line after creating the venv. The Python SDK's and the grpcio interop venvs are found the
/// same way.
pub async fn venv_python(var: &str, script: &str) -> Result<PathBuf> {
    if let Ok(python) = std::env::var(var) {
        return Ok(PathBuf::from(python));
    }
    let out = Command::new("bash")
        .arg(repo_root().join(script))
        .output()
        .await
        .with_context(|| format!("running {script}"))?;
    if !out.status.success() {
        bail!("{script} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let stdout = String::from_utf8(out.stdout)?;
    Ok(PathBuf::from(stdout.lines().last().unwrap_or_default().trim()))
}

/// The Python SDK's venv python (`$CAPSTAN_PYTHON_SDK_PYTHON`, or what
/// `sdk-python/scripts/venv.sh` creates).
pub async fn sdk_python() -> Result<PathBuf> {
    venv_python("CAPSTAN_PYTHON_SDK_PYTHON", "sdk-python/scripts/venv.sh").await
}

/// Starts `python -m capstan run FILE` (the Python SDK from the repository) against
/// `endpoint`, logging as `name`.
///
/// # Errors
/// When the process cannot be started.
pub fn python_operator(
    python: &Path,
    env: &TestEnv,
    name: &str,
    file: &Path,
    endpoint: String,
) -> Result<Process> {
    let vars = HashMap::from([
        ("CAPSTAN_ENDPOINT".to_owned(), endpoint),
        (
            "PYTHONPATH".to_owned(),
            repo_root().join("sdk-python").display().to_string(),
        ),
        ("PYTHONUNBUFFERED".to_owned(), "1".to_owned()),
    ]);
    let args = [
        "-m".to_owned(),
        "capstan".to_owned(),
        "run".to_owned(),
        file.display().to_string(),
    ];
    Process::spawn(name, python, &args, &vars, env.scratch())
}
