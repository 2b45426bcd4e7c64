//! The handler container's own API identity, as short-lived tokens the controller keeps
//! fresh (`--handler-identity`).
//!
//! Handlers that call the API themselves must not use the controller's rights, so they act as
//! a ServiceAccount of their own. A pod's projected tokens are always of the pod's
//! ServiceAccount — the controller's — so that identity cannot be projected by the kubelet; a
//! token Secret (`kubernetes.io/service-account-token`) would never expire and would outlive
//! the pod. Instead the controller asks the API server for a token of the handler's
//! ServiceAccount (a TokenRequest: the default audience, an hour's lifetime, bound to nothing
//! but its expiry) and writes it, with `ca.crt` and `namespace`, into a directory it shares
//! with the handler container only (an in-memory volume mounted at the standard in-cluster
//! path there). A new token replaces the file atomically when 80 % of the lifetime has
//! passed — as the kubelet does with projected tokens — and in-cluster clients read the file
//! again (client-go every minute, kube-rs, the Python client before expiry). The controller's
//! right to do so is limited to that one ServiceAccount (`resourceNames` in the chart).

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use k8s_openapi::api::{
    authentication::v1::{TokenRequest, TokenRequestSpec},
    core::v1::ServiceAccount,
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Where the controller's own in-cluster `ca.crt` is (copied for the handler).
const IN_CLUSTER: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The lifetime asked for (the API server may grant a different one).
pub const LIFETIME: Duration = Duration::from_secs(3600);

/// How long after a failed request to try again.
const RETRY: Duration = Duration::from_secs(10);
/// How soon a first token that could not be written is tried again.
const FIRST_RETRY: Duration = Duration::from_secs(2);

/// Errors of keeping the handler's identity.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `--handler-identity` is not `<namespace>/<name>`.
    #[error("--handler-identity takes <namespace>/<serviceaccount>, not {0:?}")]
    Invalid(String),
    /// The API server did not issue a token.
    #[error("cannot get a token of the ServiceAccount {namespace}/{name} for the handler")]
    Request {
        /// The account's namespace.
        namespace: String,
        /// The account.
        name: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// The API server answered without a token.
    #[error("the API server issued no token of the ServiceAccount {namespace}/{name}")]
    Empty {
        /// The account's namespace.
        namespace: String,
        /// The account.
        name: String,
    },
    /// The files cannot be written.
    #[error("cannot write the handler's identity into {path}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Whose tokens to keep, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    /// The ServiceAccount's namespace.
    pub namespace: String,
    /// The ServiceAccount.
    pub name: String,
    /// The directory shared with the handler container.
    pub dir: PathBuf,
}

impl Spec {
    /// Parses `<namespace>/<name>` with the directory `dir`.
    ///
    /// # Errors
    /// [`Error::Invalid`].
    pub fn parse(value: &str, dir: PathBuf) -> Result<Self, Error> {
        match value.split_once('/') {
            Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(Self {
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                    dir,
                })
            }
            _ => Err(Error::Invalid(value.to_owned())),
        }
    }
}

/// Asks for a token and writes the identity's files; returns the token's lifetime.
///
/// # Errors
/// [`Error::Request`] or [`Error::Write`].
pub async fn renew(client: &kube::Client, spec: &Spec) -> Result<Duration, Error> {
    let api = kube::Api::<ServiceAccount>::namespaced(client.clone(), &spec.namespace);
    let request = TokenRequest {
        spec: TokenRequestSpec {
            // Empty: the API server's own audiences.
            audiences: Vec::new(),
            expiration_seconds: i64::try_from(LIFETIME.as_secs()).ok(),
            bound_object_ref: None,
        },
        ..TokenRequest::default()
    };
    let issued = api
        .create_token_request(&spec.name, &kube::api::PostParams::default(), &request)
        .await
        .map_err(|source| Error::Request {
            namespace: spec.namespace.clone(),
            name: spec.name.clone(),
            source,
        })?;
    let Some(status) = issued.status else {
        return Err(Error::Empty {
            namespace: spec.namespace.clone(),
            name: spec.name.clone(),
        });
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let expires = u64::try_from(status.expiration_timestamp.0.as_second()).unwrap_or(0);
    let lifetime = match expires.saturating_sub(now) {
        0 => LIFETIME,
        left => Duration::from_secs(left).min(LIFETIME * 24),
    };
    let (dir, namespace, token) = (spec.dir.clone(), spec.namespace.clone(), status.token);
    tokio::task::spawn_blocking(move || write(&dir, &namespace, &token))
        .await
        .unwrap_or_else(|e| {
            Err(Error::Write {
                path: PathBuf::new(),
                source: std::io::Error::other(e.to_string()),
            })
        })?;
    Ok(lifetime)
}

/// Writes `token`, `namespace` and (when the controller has one) `ca.crt` into `dir`, each
/// replaced atomically.
fn write(dir: &Path, namespace: &str, token: &str) -> Result<(), Error> {
    let put = |name: &str, text: &[u8]| {
        let path = dir.join(name);
        replace(dir, &path, text).map_err(|source| Error::Write { path, source })
    };
    if let Ok(ca) = std::fs::read(Path::new(IN_CLUSTER).join("ca.crt")) {
        put("ca.crt", &ca)?;
    }
    put("namespace", namespace.as_bytes())?;
    put("token", token.as_bytes())
}

fn replace(dir: &Path, path: &Path, text: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut file = tempfile::Builder::new().prefix(".").tempfile_in(dir)?;
    file.write_all(text)?;
    file.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// Keeps the identity fresh until `stop`: a new token when 80 % of the last one's lifetime
/// has passed, every 10 s after a failure (the previous token stays until it expires).
pub async fn keep(client: kube::Client, spec: Spec, first: Duration, stop: CancellationToken) {
    let mut next = first.mul_f64(0.8);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(next) => {}
        }
        next = match renew(&client, &spec).await {
            Ok(lifetime) => {
                debug!(account = %spec.name, ?lifetime, "the handler's token was renewed");
                lifetime.mul_f64(0.8)
            }
            Err(e) => {
                warn!(error = %crate::diagnostic::chain(&e), retry_in = ?RETRY, "renewing the handler's token failed");
                RETRY
            }
        };
    }
}

/// Writes the first token, trying again every [`FIRST_RETRY`] until it is written; its
/// lifetime, for [`keep`]. `None` when `stop` is cancelled first. The admin endpoint answers
/// only after this, so the startup probe, which lets kubelet start the handler container,
/// never passes before the token is there.
pub async fn first_written(client: &kube::Client, spec: &Spec, stop: &CancellationToken) -> Option<Duration> {
    let written = async {
        loop {
            if let Some(lifetime) = first(client, spec).await {
                return lifetime;
            }
            tokio::time::sleep(FIRST_RETRY).await;
        }
    };
    tokio::select! {
        lifetime = written => Some(lifetime),
        () = stop.cancelled() => None,
    }
}

/// Writes the first token once (reported when it fails); its lifetime.
async fn first(client: &kube::Client, spec: &Spec) -> Option<Duration> {
    match renew(client, spec).await {
        Ok(lifetime) => {
            info!(account = %format!("{}/{}", spec.namespace, spec.name), dir = %spec.dir.display(), ?lifetime, "the handler's identity is written");
            Some(lifetime)
        }
        Err(e) => {
            warn!(error = %crate::diagnostic::chain(&e), retry_in = ?FIRST_RETRY, "the handler's token could not be written; retrying");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_account_is_named_with_its_namespace_and_files_are_replaced_whole() {
        let dir = tempfile::tempdir().unwrap();
        let spec = Spec::parse("ops/ops-capstan-handler", dir.path().to_owned()).unwrap();
        assert_eq!(
            (spec.namespace.as_str(), spec.name.as_str()),
            ("ops", "ops-capstan-handler")
        );
        for bad in ["ops", "/x", "ops/", "a/b/c"] {
            assert!(Spec::parse(bad, PathBuf::new()).is_err(), "{bad}");
        }
        write(dir.path(), "ops", "one").unwrap();
        write(dir.path(), "ops", "two").unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join("token")).unwrap(), "two");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("namespace")).unwrap(),
            "ops"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(
            names.iter().all(|n| !n.to_string_lossy().starts_with('.')),
            "{names:?}"
        );
    }
}
