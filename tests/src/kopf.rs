//! A real kopf operator for end-to-end tests: kopf from PyPI in a virtualenv under
//! `$HOME/.cache/capstan/kopf-venv` (created once, reused while it has the pinned release),
//! running `tests/kopf/operator.py` against a testenv.
//!
//! The operator handles the example resource with the e2e handler process's ids
//! (`create_fn`, `update_fn`) and logs `<handler> <name>` per call to a file;
//! `spec.temporary.<handler>: N` fails its first N attempts with a 1 s retry delay.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use tokio::{process::Command, sync::OnceCell};

use crate::{
    process::Process,
    testenv::{TestEnv, repo_root},
};

/// The kopf release the tests run against.
pub const VERSION: &str = "1.45.2";

static KOPF: OnceCell<PathBuf> = OnceCell::const_new();

/// The `kopf` executable of a virtualenv with the pinned release.
///
/// # Errors
/// When python3, its venv module or PyPI is not available.
pub async fn binary() -> Result<PathBuf> {
    KOPF.get_or_try_init(install).await.cloned()
}

async fn install() -> Result<PathBuf> {
    let home = std::env::var_os("HOME").context("HOME is not set; it locates the kopf virtualenv")?;
    let venv = Path::new(&home).join(".cache/capstan/kopf-venv");
    let kopf = venv.join("bin/kopf");
    if version(&kopf).await.as_deref() == Some(VERSION) {
        return Ok(kopf);
    }
    std::fs::create_dir_all(venv.parent().unwrap_or(&venv))?;
    setup(
        Command::new("python3").arg("-m").arg("venv").arg(&venv),
        "python3 -m venv (python3 with the venv module is needed to run kopf)",
    )
    .await?;
    setup(
        Command::new(venv.join("bin/python"))
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
            .arg(format!("kopf=={VERSION}")),
        &format!("pip install kopf=={VERSION} (PyPI must be reachable)"),
    )
    .await?;
    match version(&kopf).await {
        Some(v) if v == VERSION => Ok(kopf),
        other => bail!(
            "{} reports version {other:?} after installing kopf=={VERSION}",
            kopf.display()
        ),
    }
}

/// `kopf --version` prints `kopf, version X`.
async fn version(kopf: &Path) -> Option<String> {
    let out = Command::new(kopf).arg("--version").output().await.ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim().rsplit(' ').next().map(str::to_owned)
}

async fn setup(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd
        .output()
        .await
        .with_context(|| format!("could not start {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Starts the test operator with `kopf` against `env`, logging calls to `calls`; killed when
/// dropped.
///
/// # Errors
/// When the process cannot be spawned.
pub async fn start(env: &TestEnv, kopf: &Path, name: &str, calls: &Path) -> Result<Process> {
    let operator = repo_root().join("tests/kopf/operator.py");
    let args: Vec<String> = ["run", "--standalone", "-A", &operator.to_string_lossy()]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    let vars: HashMap<String, String> = [
        ("KUBECONFIG", env.kubeconfig.to_string_lossy().into_owned()),
        ("KOPF_E2E_LOG", calls.to_string_lossy().into_owned()),
        ("PYTHONUNBUFFERED", "1".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    Process::spawn(name, kopf, &args, &vars, env.scratch())
}
