//! Builds the API client: from the kubeconfig (`KUBECONFIG`, `~/.kube/config`) or the
//! in-cluster service account, whichever kube-rs finds first.

use kube::Client;

/// Why the API client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No kubeconfig and no in-cluster configuration were usable.
    #[error("no usable Kubernetes configuration (set KUBECONFIG or run in a cluster)")]
    Config(#[source] kube::Error),
}

/// The user agent of every API request, so audit logs show which writes are Capstan's.
pub const USER_AGENT: &str = concat!("capstan/", env!("CARGO_PKG_VERSION"));

/// Builds a client with Capstan's user agent for terminal commands (`capstan freeze`): they
/// make no watches, so every read is bounded by kube-rs's read timeout (the controller's
/// clients are bounded per request instead, see [`crate::k8s::switch`]).
///
/// # Errors
/// [`Error::Config`] when neither a kubeconfig nor an in-cluster configuration works.
pub async fn connect() -> Result<Client, Error> {
    let mut config = kube::Config::infer()
        .await
        .map_err(|e| Error::Config(kube::Error::InferConfig(e)))?;
    config.read_timeout = Some(super::switch::DEFAULT_REQUEST_TIMEOUT);
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static(USER_AGENT),
    ));
    Client::try_from(config).map_err(Error::Config)
}

/// The user the API server authenticates `client` as (a `SelfSubjectReview`); `None` when it
/// cannot tell.
pub async fn username(client: &kube::Client) -> Option<String> {
    use k8s_openapi::api::authentication::v1::SelfSubjectReview;
    let api: kube::Api<SelfSubjectReview> = kube::Api::all(client.clone());
    api.create(&kube::api::PostParams::default(), &SelfSubjectReview::default())
        .await
        .ok()
        .and_then(|r| r.status?.user_info?.username)
        .filter(|u| !u.is_empty())
}
