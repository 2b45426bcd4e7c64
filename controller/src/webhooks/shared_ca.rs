//! One CA for every replica's generated serving certificate, kept in a Secret
//! (`--webhook-ca-secret`): the first replica to start generates it and creates the Secret, the
//! others (and every later pod of a rollout) read it. The leader writes the CA into the webhook
//! configurations, so the API server trusts every replica, old and new, during a rollout.
//!
//! Without a shared CA each process makes its own and only the leader's is trusted: with
//! leader election (or several replicas) a generated certificate is then refused at start
//! (`--webhooks=on`) or when the first admission handler registers (`auto`).
//!
//! The Secret is created, never replaced: a create that loses the race (409) reads the winner's.
//! The chart grants `get` on this one name and `create` on Secrets in the release namespace.

use std::collections::BTreeMap;

use tracing::info;

use crate::k8s::shared_secret::{self, Origin};

/// The CA certificate's key in the Secret.
pub const CA_CERT_KEY: &str = "ca.crt";
/// The CA private key's key in the Secret.
pub const CA_KEY_KEY: &str = "ca.key";

/// Why the shared CA could not be had.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or failed.
    #[error(transparent)]
    Api(#[from] shared_secret::Error),
    /// The Secret exists but does not hold a CA.
    #[error("the webhook CA Secret {namespace}/{name} has no usable {CA_CERT_KEY} and {CA_KEY_KEY}")]
    Unusable {
        /// The Secret's namespace.
        namespace: String,
        /// The Secret's name.
        name: String,
    },
    /// Generating the CA failed.
    #[error("cannot generate the webhook CA")]
    Generate(#[from] super::certs::Error),
}

/// A CA as PEM text.
#[derive(Clone, PartialEq, Eq)]
pub struct Ca {
    /// The CA certificate.
    pub cert: String,
    /// Its private key (PKCS#8).
    pub key: String,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca")
            .field("cert", &self.cert)
            .finish_non_exhaustive()
    }
}

/// The CA in Secret `namespace/name`, created with a new CA when it does not exist.
///
/// # Errors
/// When the API server refuses, or the Secret holds no CA.
pub async fn obtain(client: kube::Client, namespace: &str, name: &str) -> Result<Ca, Error> {
    let (data, origin) = shared_secret::read_or_create(client, namespace, name, || {
        let ca = super::certs::generate_ca()?;
        Ok::<_, Error>(BTreeMap::from([
            (CA_CERT_KEY.to_owned(), ca.cert.into_bytes()),
            (CA_KEY_KEY.to_owned(), ca.key.into_bytes()),
        ]))
    })
    .await?;
    let field = |key: &str| {
        data.get(key)
            .and_then(|b| String::from_utf8(b.clone()).ok())
            .filter(|s| !s.is_empty())
    };
    let (Some(cert), Some(key)) = (field(CA_CERT_KEY), field(CA_KEY_KEY)) else {
        return Err(Error::Unusable {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        });
    };
    let secret = format!("{namespace}/{name}");
    match origin {
        Origin::Created => info!(%secret, "webhook CA generated and kept in its Secret"),
        Origin::Read => info!(%secret, "webhook CA read from its Secret"),
    }
    Ok(Ca { cert, key })
}
