//! The Helm chart in tests: a pinned `helm` (installed from Go modules by `scripts/helm.sh`
//! once per test process), rendering with values files and `--set`, splitting the output into
//! documents, and a kubeconfig that impersonates the chart's ServiceAccount.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
};

use anyhow::{Context as _, Result, bail};
use kube::config::Kubeconfig;
use tokio::{process::Command, sync::OnceCell};

use crate::testenv::{TestEnv, rand_suffix, repo_root};

static HELM: OnceCell<PathBuf> = OnceCell::const_new();

/// The Kubernetes version `helm template` and `helm lint` render for: the testenv's. Without
/// it helm assumes 1.20, below the chart's `kubeVersion` (native sidecars need 1.29).
pub const KUBE_VERSION: &str = "1.35.0";

/// The chart's directory.
pub fn chart_dir() -> PathBuf {
    repo_root().join("charts/capstan")
}

/// The chart's CI values files (`ci/*.yaml`), sorted.
pub fn ci_values_files() -> Result<Vec<PathBuf>> {
    let dir = chart_dir().join("ci");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    Ok(files)
}

/// The pinned `helm` binary, installed by `scripts/helm.sh` on first use.
pub async fn helm() -> Result<PathBuf> {
    HELM.get_or_try_init(|| async {
        let script = repo_root().join("scripts/helm.sh");
        let out = Command::new("bash")
            .arg(&script)
            .stderr(Stdio::inherit())
            .output()
            .await
            .with_context(|| format!("running {}", script.display()))?;
        if !out.status.success() {
            bail!("installing helm failed ({}); see the output above", out.status);
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let path = stdout.lines().last().map(str::trim).unwrap_or_default();
        if path.is_empty() {
            bail!("scripts/helm.sh printed no binary path");
        }
        Ok(PathBuf::from(path))
    })
    .await
    .cloned()
}

/// The outcome of one helm command.
#[derive(Debug)]
pub struct Outcome {
    /// Whether helm exited successfully.
    pub success: bool,
    /// Its stdout.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
}

/// Runs helm with `args` (in the repository root, with a throwaway helm home).
pub async fn run(args: &[&str]) -> Result<Outcome> {
    let helm = helm().await?;
    let home = std::env::temp_dir().join("capstan-tests-helm");
    let out = Command::new(&helm)
        .args(args)
        .current_dir(repo_root())
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .output()
        .await
        .with_context(|| format!("running {}", helm.display()))?;
    Ok(Outcome {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// What to render: a release in a namespace, with values files and `--set` values.
#[derive(Clone, Debug, Default)]
pub struct Render<'a> {
    /// The release name.
    pub release: &'a str,
    /// The release namespace.
    pub namespace: &'a str,
    /// Values files, in order.
    pub values: Vec<PathBuf>,
    /// `--set` arguments (`key=value`).
    pub set: Vec<&'a str>,
    /// Only these templates (`templates/rbac.yaml`); all when empty.
    pub show_only: Vec<&'a str>,
}

impl Render<'_> {
    fn args(&self) -> Vec<String> {
        let mut args = vec![
            "template".to_owned(),
            self.release.to_owned(),
            chart_dir().to_string_lossy().into_owned(),
            "--namespace".to_owned(),
            self.namespace.to_owned(),
            "--kube-version".to_owned(),
            KUBE_VERSION.to_owned(),
        ];
        for v in &self.values {
            args.push("--values".into());
            args.push(v.to_string_lossy().into_owned());
        }
        for s in &self.set {
            args.push("--set".into());
            args.push((*s).to_owned());
        }
        for s in &self.show_only {
            args.push("--show-only".into());
            args.push((*s).to_owned());
        }
        args
    }

    /// Runs `helm template` and returns the outcome, successful or not.
    pub async fn outcome(&self) -> Result<Outcome> {
        let args = self.args();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run(&args).await
    }

    /// Runs `helm template` and returns the manifests; fails with helm's error.
    pub async fn manifests(&self) -> Result<String> {
        let out = self.outcome().await?;
        if !out.success {
            bail!("helm {} failed:\n{}", self.args().join(" "), out.stderr);
        }
        Ok(out.stdout)
    }
}

/// The non-empty YAML documents of a multi-document text.
pub fn documents(yaml: &str) -> Vec<String> {
    let mut docs = Vec::new();
    let mut current = String::new();
    for line in yaml.lines() {
        if line.trim_end() == "---" {
            docs.push(std::mem::take(&mut current));
        } else {
            current.push_str(line);
            current.push('\n');
        }
    }
    docs.push(current);
    docs.into_iter()
        .filter(|d| {
            d.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        })
        .collect()
}

/// The namespaces named in `metadata.namespace` of rendered manifests (the chart writes it at
/// two spaces of indentation).
pub fn namespaces_of(yaml: &str) -> Vec<String> {
    let mut found: Vec<String> = yaml
        .lines()
        .filter_map(|l| l.strip_prefix("  namespace: "))
        .map(|n| n.trim().trim_matches('"').to_owned())
        .collect();
    found.sort();
    found.dedup();
    found
}

/// Creates a namespace unless it exists.
pub async fn ensure_namespace(env: &TestEnv, name: &str) -> Result<()> {
    let out = env.kubectl().args(["create", "namespace", name]).output().await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && !stderr.contains("AlreadyExists") {
        bail!("creating namespace {name} failed: {stderr}");
    }
    Ok(())
}

/// Writes a copy of the testenv's admin kubeconfig whose user impersonates `user` (for a
/// ServiceAccount, `system:serviceaccount:<namespace>:<name>`): every request made with it is
/// authorized as that user, as kubectl's `--as` does. Returns its path.
pub async fn impersonating_kubeconfig(env: &TestEnv, user: &str) -> Result<PathBuf> {
    let mut config = Kubeconfig::read_from(&env.kubeconfig)
        .with_context(|| format!("reading {}", env.kubeconfig.display()))?;
    for named in &mut config.auth_infos {
        if let Some(auth) = named.auth_info.as_mut() {
            auth.impersonate = Some(user.to_owned());
        }
    }
    let path = env
        .scratch()
        .join(format!("kubeconfig-as-{}.yaml", rand_suffix()));
    // JSON is YAML: kubectl and kube-rs read it as a kubeconfig.
    std::fs::write(&path, serde_json::to_vec_pretty(&config)?)?;
    Ok(path)
}

/// Writes `text` to a fresh file in the testenv's scratch directory and returns its path.
pub fn scratch_file(env: &TestEnv, stem: &str, text: &str) -> Result<PathBuf> {
    let path = env.scratch().join(format!("{stem}-{}.yaml", rand_suffix()));
    std::fs::write(&path, text)?;
    Ok(path)
}

/// The file name of a path without its extension.
pub fn stem(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}
