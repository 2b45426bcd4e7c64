//! Writing and removing the managed webhook configurations
//! (`admissionregistration.k8s.io/v1` `ValidatingWebhookConfiguration` and
//! `MutatingWebhookConfiguration`).
//!
//! Writes are server-side applies with the controller's field manager, forced: the
//! configuration is the controller's, and a replica that takes over from another (or a user who
//! edited it) is overwritten as a whole, like kopf's managed configurations.

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use kube::{
    Api, Client,
    api::{DeleteParams, Patch, PatchParams},
};
use serde_json::Value;

use super::objects::FIELD_MANAGER;

/// Which of the two configurations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    /// The `ValidatingWebhookConfiguration`.
    Validating,
    /// The `MutatingWebhookConfiguration`.
    Mutating,
}

/// Why a configuration could not be written or removed.
#[derive(Debug, thiserror::Error)]
#[error("the {which:?} webhook configuration {name:?} could not be written")]
pub struct Error {
    which: Which,
    name: String,
    #[source]
    source: kube::Error,
}

/// Writes (creates or replaces) the configuration `body`, whose `metadata.name` is `name`.
///
/// # Errors
/// When the API server refuses or cannot be reached.
pub async fn apply(client: &Client, which: Which, name: &str, body: &Value) -> Result<(), Error> {
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let result = match which {
        Which::Validating => Api::<ValidatingWebhookConfiguration>::all(client.clone())
            .patch(name, &params, &Patch::Apply(body))
            .await
            .map(drop),
        Which::Mutating => Api::<MutatingWebhookConfiguration>::all(client.clone())
            .patch(name, &params, &Patch::Apply(body))
            .await
            .map(drop),
    };
    result.map_err(|source| Error {
        which,
        name: name.to_owned(),
        source,
    })
}

/// Removes the configuration `name`; one that does not exist is fine.
///
/// # Errors
/// When the API server refuses or cannot be reached.
pub async fn remove(client: &Client, which: Which, name: &str) -> Result<(), Error> {
    let params = DeleteParams::default();
    let result = match which {
        Which::Validating => Api::<ValidatingWebhookConfiguration>::all(client.clone())
            .delete(name, &params)
            .await
            .map(drop),
        Which::Mutating => Api::<MutatingWebhookConfiguration>::all(client.clone())
            .delete(name, &params)
            .await
            .map(drop),
    };
    match result {
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        other => other.map_err(|source| Error {
            which,
            name: name.to_owned(),
            source,
        }),
    }
}
