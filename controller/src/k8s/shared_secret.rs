//! A Secret that several replicas share and none replaces: read by name, or created with what
//! the caller makes when it does not exist yet. A create that loses the race (409) reads the
//! winner's, so every replica ends up with the same data. Used for the CA of the generated
//! webhook certificates.

use std::collections::BTreeMap;

use k8s_openapi::{ByteString, api::core::v1::Secret};
use kube::{
    Api, Client,
    api::{ObjectMeta, PostParams},
};

/// Why the Secret could not be read or created.
#[derive(Debug, thiserror::Error)]
#[error("cannot read or create the Secret {namespace}/{name}")]
pub struct Error {
    namespace: String,
    name: String,
    #[source]
    source: kube::Error,
}

/// Where the data came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The Secret existed (or another replica created it first).
    Read,
    /// This call created it.
    Created,
}

/// The data of Secret `namespace/name`; created with `make()` when it does not exist.
///
/// # Errors
/// When the API server refuses or fails; or what `make` returns.
pub async fn read_or_create<E>(
    client: Client,
    namespace: &str,
    name: &str,
    make: impl FnOnce() -> Result<BTreeMap<String, Vec<u8>>, E>,
) -> Result<(BTreeMap<String, Vec<u8>>, Origin), E>
where
    E: From<Error>,
{
    let api: Api<Secret> = Api::namespaced(client, namespace);
    let failed = |source| Error {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        source,
    };
    if let Some(secret) = api.get_opt(name).await.map_err(failed)? {
        return Ok((data(secret), Origin::Read));
    }
    let made = make()?;
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
        data: Some(
            made.iter()
                .map(|(k, v)| (k.clone(), ByteString(v.clone())))
                .collect(),
        ),
        ..Secret::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok((made, Origin::Created)),
        Err(kube::Error::Api(status)) if status.code == 409 => {
            let secret = api.get(name).await.map_err(failed)?;
            Ok((data(secret), Origin::Read))
        }
        Err(e) => Err(failed(e).into()),
    }
}

fn data(secret: Secret) -> BTreeMap<String, Vec<u8>> {
    secret
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.0))
        .collect()
}
