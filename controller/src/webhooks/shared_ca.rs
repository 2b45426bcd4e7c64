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

use k8s_openapi::{ByteString, api::core::v1::Secret};
use kube::api::{Api, ObjectMeta, PostParams};
use tracing::info;

/// The CA certificate's key in the Secret.
pub const CA_CERT_KEY: &str = "ca.crt";
/// The CA private key's key in the Secret.
pub const CA_KEY_KEY: &str = "ca.key";

/// Why the shared CA could not be had.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or failed.
    #[error("cannot read or create the webhook CA Secret {namespace}/{name}")]
    Api {
        /// The Secret's namespace.
        namespace: String,
        /// The Secret's name.
        name: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
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
    let api: Api<Secret> = Api::namespaced(client, namespace);
    let api_error = |source| Error::Api {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        source,
    };
    if let Some(secret) = api.get_opt(name).await.map_err(api_error)? {
        return read(&secret, namespace, name);
    }
    let ca = super::certs::generate_ca()?;
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_owned(),
                "capstan".to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([
            (CA_CERT_KEY.to_owned(), ByteString(ca.cert.clone().into_bytes())),
            (CA_KEY_KEY.to_owned(), ByteString(ca.key.clone().into_bytes())),
        ])),
        ..Secret::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            info!(secret = %format!("{namespace}/{name}"), "webhook CA generated and kept in its Secret");
            Ok(ca)
        }
        // Another replica created it first: use theirs.
        Err(kube::Error::Api(status)) if status.code == 409 => {
            let secret = api.get(name).await.map_err(api_error)?;
            read(&secret, namespace, name)
        }
        Err(e) => Err(api_error(e)),
    }
}

fn read(secret: &Secret, namespace: &str, name: &str) -> Result<Ca, Error> {
    let field = |key: &str| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
            .filter(|s| !s.is_empty())
    };
    match (field(CA_CERT_KEY), field(CA_KEY_KEY)) {
        (Some(cert), Some(key)) => {
            info!(secret = %format!("{namespace}/{name}"), "webhook CA read from its Secret");
            Ok(Ca { cert, key })
        }
        _ => Err(Error::Unusable {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }),
    }
}
