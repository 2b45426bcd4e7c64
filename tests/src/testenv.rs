//! A real Kubernetes API server per test: builds `capstan-testenv` from `tests/testenv` when
//! needed, starts an instance on a free loopback port with its own data directory and audit
//! log, and stops it cleanly.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow, bail};
use kube::{
    Api, Client,
    api::{DynamicObject, Patch, PatchParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
    core::GroupVersionKind,
    discovery::ApiResource,
};
use serde_json::{Value, json};
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
    sync::OnceCell,
};

/// The Kubernetes minor a [`TestEnv`] runs. Both are built from the same sources in
/// `tests/testenv`; 1.35 is the server every test uses unless it needs something newer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Kube {
    /// kube-apiserver 1.35 (`tests/testenv/go.mod`).
    #[default]
    V1_35,
    /// kube-apiserver 1.36 (`tests/testenv/go.1.36.mod`), for 1.36-only features such as
    /// KEP-5866's sharded list and watch (feature gate `ShardedListAndWatch`, alpha).
    V1_36,
}

impl Kube {
    /// The minor as `build.sh` spells it (`CAPSTAN_TESTENV_KUBE`).
    pub fn minor(self) -> &'static str {
        match self {
            Self::V1_35 => "1.35",
            Self::V1_36 => "1.36",
        }
    }

    /// The variable that names a prebuilt binary of this minor (also read by `build.sh`).
    fn binary_var(self) -> &'static str {
        match self {
            Self::V1_35 => "CAPSTAN_TESTENV_BIN",
            Self::V1_36 => "CAPSTAN_TESTENV_BIN_1_36",
        }
    }

    /// Where this minor's binary is remembered once found: each is built at most once per
    /// test process.
    fn cell(self) -> &'static OnceCell<PathBuf> {
        static V1_35: OnceCell<PathBuf> = OnceCell::const_new();
        static V1_36: OnceCell<PathBuf> = OnceCell::const_new();
        match self {
            Self::V1_35 => &V1_35,
            Self::V1_36 => &V1_36,
        }
    }
}

/// How to start a [`TestEnv`]; the default is what [`TestEnv::start`] starts.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options<'a> {
    /// The Kubernetes minor.
    pub kube: Kube,
    /// kube-apiserver feature gates, each `Name=true` or `Name=false` (`--feature-gates`).
    pub feature_gates: &'a [&'a str],
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// Builds (or finds) the default (1.35) testenv binary once per test process.
pub async fn binary() -> Result<PathBuf> {
    binary_for(Kube::default()).await
}

/// Builds (or finds) the testenv binary of `kube` once per test process: the file named by
/// its variable (`CAPSTAN_TESTENV_BIN`, `CAPSTAN_TESTENV_BIN_1_36`) when that is one, else
/// what `tests/testenv/build.sh` builds (or finds up to date) for that minor.
pub async fn binary_for(kube: Kube) -> Result<PathBuf> {
    kube.cell()
        .get_or_try_init(|| async {
            if let Ok(bin) = std::env::var(kube.binary_var())
                && Path::new(&bin).is_file()
            {
                return Ok(PathBuf::from(bin));
            }
            let script = repo_root().join("tests/testenv/build.sh");
            let out = Command::new("bash")
                .arg(&script)
                .env("CAPSTAN_TESTENV_KUBE", kube.minor())
                .stderr(Stdio::inherit())
                .output()
                .await
                .with_context(|| format!("running {}", script.display()))?;
            if !out.status.success() {
                bail!(
                    "building capstan-testenv for Kubernetes {} failed ({}); see the output above",
                    kube.minor(),
                    out.status
                );
            }
            let stdout = String::from_utf8_lossy(&out.stdout);
            let path = stdout.lines().last().map(str::trim).unwrap_or_default();
            if path.is_empty() {
                bail!("tests/testenv/build.sh printed no binary path");
            }
            Ok(PathBuf::from(path))
        })
        .await
        .cloned()
}

/// One running API server.
pub struct TestEnv {
    child: Child,
    /// The admin kubeconfig.
    pub kubeconfig: PathBuf,
    /// The audit log (every request: verb, resource, user).
    pub audit_log: PathBuf,
    /// The API server's stderr log.
    pub log: PathBuf,
    dir: tempfile::TempDir,
}

impl TestEnv {
    /// Starts an instance (Kubernetes 1.35, default feature gates) and waits until it is ready.
    pub async fn start() -> Result<Self> {
        Self::start_with(Options::default()).await
    }

    /// Starts an instance of `options.kube` with `options.feature_gates` and waits until it is
    /// ready, e.g. a 1.36 server with sharded list and watch:
    ///
    /// ```no_run
    /// # async fn f() -> anyhow::Result<()> {
    /// use capstan_tests::testenv::{Kube, Options, TestEnv};
    /// let env = TestEnv::start_with(Options {
    ///     kube: Kube::V1_36,
    ///     feature_gates: &["ShardedListAndWatch=true"],
    /// })
    /// .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// A gate the server does not know fails the start, with kube-apiserver's message.
    pub async fn start_with(options: Options<'_>) -> Result<Self> {
        let bin = binary_for(options.kube).await?;
        // The server picks free ports and binds them a moment later; a test running beside
        // may take one in between. That race is the only start failure worth a second try.
        let mut attempt = 1;
        loop {
            match Self::start_once(&bin, &options).await {
                Err(error) if attempt < 3 && format!("{error:#}").contains("address already in use") => {
                    attempt += 1;
                }
                outcome => return outcome,
            }
        }
    }

    async fn start_once(bin: &Path, options: &Options<'_>) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("capstan-testenv-").tempdir()?;
        let instance = dir.path().join("instance");
        let audit_log = dir.path().join("audit.log");
        let log = dir.path().join("apiserver.log");
        let mut command = Command::new(bin);
        command
            .arg("start")
            .arg("--dir")
            .arg(&instance)
            .arg("--audit-log")
            .arg(&audit_log)
            .arg("--timeout")
            .arg("90s");
        if !options.feature_gates.is_empty() {
            // After `--`, capstan-testenv appends the rest to kube-apiserver's command line.
            command
                .arg("--")
                .arg(format!("--feature-gates={}", options.feature_gates.join(",")));
        }
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
            .await
            .map_err(|_| {
                anyhow!(
                    "the API server did not become ready in time; see {}",
                    log.display()
                )
            })??;
        let Some(line) = line else {
            let tail = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = tail.lines().rev().take(15).collect();
            bail!(
                "the API server exited before it was ready:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        };
        let kubeconfig = PathBuf::from(
            line.strip_prefix("ready ")
                .ok_or_else(|| anyhow!("unexpected line {line:?}"))?,
        );
        Ok(Self {
            child,
            kubeconfig,
            audit_log,
            log,
            dir,
        })
    }

    /// The API server's process id, while it runs (to freeze it with SIGSTOP).
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// A kube client with the admin credentials.
    pub async fn client(&self) -> Result<Client> {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig)?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
        Ok(Client::try_from(config)?)
    }

    /// A scratch directory that lives as long as the instance.
    pub fn scratch(&self) -> &Path {
        self.dir.path()
    }

    /// `kubectl` pointed at this instance.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new("kubectl");
        cmd.arg("--kubeconfig").arg(&self.kubeconfig);
        cmd
    }

    /// Runs kubectl and returns its stdout; fails with its stderr.
    pub async fn kubectl_ok(&self, args: &[&str]) -> Result<String> {
        let out = self.kubectl().args(args).output().await?;
        if !out.status.success() {
            bail!(
                "kubectl {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Applies YAML (one or more documents) with kubectl server-side apply.
    pub async fn apply(&self, yaml: &str) -> Result<()> {
        let file = self.dir.path().join(format!("apply-{}.yaml", rand_suffix()));
        std::fs::write(&file, yaml)?;
        self.kubectl_ok(&["apply", "--server-side", "-f", &file.to_string_lossy()])
            .await?;
        Ok(())
    }

    /// Applies a CRD and waits until it is established.
    pub async fn apply_crd(&self, yaml: &str, name: &str) -> Result<()> {
        self.apply_crds(yaml, &[name]).await
    }

    /// Applies manifests that define the CRDs `names` and waits until all are established.
    pub async fn apply_crds(&self, yaml: &str, names: &[&str]) -> Result<()> {
        self.apply(yaml).await?;
        let crds: Vec<String> = names.iter().map(|n| format!("crd/{n}")).collect();
        let mut args = vec!["wait", "--for=condition=Established", "--timeout=60s"];
        args.extend(crds.iter().map(String::as_str));
        self.kubectl_ok(&args).await?;
        Ok(())
    }

    /// Applies the example CRD (`examples.demo.capstan.dev`).
    pub async fn apply_example_crd(&self) -> Result<()> {
        let yaml = std::fs::read_to_string(repo_root().join("examples/crd.yaml"))?;
        self.apply_crd(&yaml, "examples.demo.capstan.dev").await
    }

    /// Applies Capstan's peering CRDs (`controller/crds/peering.yaml`).
    pub async fn apply_peering_crds(&self) -> Result<()> {
        let yaml = std::fs::read_to_string(repo_root().join("controller/crds/peering.yaml"))?;
        self.apply_crds(
            &yaml,
            &[
                "capstanpeerings.capstan.dev",
                "clustercapstanpeerings.capstan.dev",
            ],
        )
        .await
    }

    /// The audit events so far, as JSON.
    pub fn audit_events(&self) -> Result<Vec<Value>> {
        let text = std::fs::read_to_string(&self.audit_log).unwrap_or_default();
        Ok(text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect())
    }

    /// Stops the instance gracefully (SIGTERM) and waits for it.
    pub async fn stop(mut self) -> Result<()> {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status()
                .await;
        }
        match tokio::time::timeout(Duration::from_secs(40), self.child.wait()).await {
            Ok(status) => {
                status?;
            }
            Err(_) => self.child.start_kill()?,
        }
        Ok(())
    }
}

/// The dynamic API of the example resource in `namespace`.
pub fn examples(client: &Client, namespace: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("demo.capstan.dev", "v1", "Example"),
        "examples",
    );
    Api::namespaced_with(client.clone(), namespace, &ar)
}

/// Creates the example object `name` with `spec` in `default`, as a user would. For tests that
/// drive a controller without a [`Scenario`](crate::scenario::Scenario) (whose `create` does
/// the same in its own namespace), so that they share one spelling of an Example.
pub async fn create_example(env: &TestEnv, name: &str, spec: Value) -> Result<()> {
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
        "metadata": {"name": name, "namespace": "default"}, "spec": spec
    }))?;
    examples(&env.client().await?, "default")
        .create(&PostParams::default(), &obj)
        .await?;
    Ok(())
}

/// Server-side applies an object through a dynamic API.
pub async fn apply_object(api: &Api<DynamicObject>, name: &str, object: &Value) -> Result<DynamicObject> {
    let params = PatchParams::apply("capstan-tests").force();
    Ok(api.patch(name, &params, &Patch::Apply(object)).await?)
}

/// A short random suffix for names.
pub fn rand_suffix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{:x}{:x}", std::process::id(), nanos)
}
