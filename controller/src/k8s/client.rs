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

/// Builds a client with Capstan's user agent.
///
/// # Errors
/// [`Error::Config`] when neither a kubeconfig nor an in-cluster configuration works.
pub async fn connect() -> Result<Client, Error> {
    let config = kube::Config::infer().await.map_err(|e| Error::Config(kube::Error::InferConfig(e)))?;
    Client::try_from(config).map_err(Error::Config)
}
