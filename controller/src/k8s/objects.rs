//! Reading and patching objects of any resource as plain JSON.
//!
//! Errors are classified by what the engine must do about them: an object that is gone is
//! dropped quietly, a conflict is re-read and retried, an invalid patch is recorded against the
//! handler that sent it, and anything else means the API is unavailable for now.

use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, Patch, PatchParams},
};
use serde_json::Value;

use crate::model::ResolvedResource;

/// The field manager name Capstan writes with.
pub const FIELD_MANAGER: &str = "capstan";

/// Why a read or write failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The object does not exist (any more).
    #[error("the object is gone")]
    NotFound,
    /// The object changed since it was read (optimistic locking).
    #[error("conflict: {0}")]
    Conflict(String),
    /// The API server refused the content (422, e.g. schema validation).
    #[error("the API server rejected the patch: {0}")]
    Invalid(String),
    /// The controller's identity lacks a permission (403): fix the RBAC; retried meanwhile.
    #[error("not permitted (check the operator's RBAC): {0}")]
    Forbidden(String),
    /// An admission webhook or policy denied the request, whatever status code it chose: its
    /// verdict may depend on state that changes (a freeze window, a locked namespace), so the
    /// write is retried, unlike content the API server itself finds invalid.
    #[error("denied by admission: {0}")]
    Denied(String),
    /// Anything else: retry later.
    #[error("the API server is unavailable or failed")]
    Unavailable(#[source] kube::Error),
}

impl From<kube::Error> for Error {
    fn from(e: kube::Error) -> Self {
        match &e {
            kube::Error::Api(status) if is_admission_denial(&status.message) => {
                Self::Denied(status.message.clone())
            }
            kube::Error::Api(status) => match status.code {
                404 => Self::NotFound,
                409 => Self::Conflict(status.message.clone()),
                422 | 400 => Self::Invalid(status.message.clone()),
                403 => Self::Forbidden(status.message.clone()),
                _ => Self::Unavailable(e),
            },
            _ => Self::Unavailable(e),
        }
    }
}

/// Whether an API error's message is an admission webhook's or a validating admission
/// policy's denial (the API server's wording for both).
fn is_admission_denial(message: &str) -> bool {
    (message.starts_with("admission webhook ") && message.contains(" denied the request"))
        || (message.starts_with("ValidatingAdmissionPolicy ") && message.contains(" denied request"))
}

/// Access to objects through one client.
#[derive(Clone)]
pub struct Objects {
    client: Client,
}

impl Objects {
    /// Wraps a client.
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// The client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The dynamic API of a resource, namespaced or not.
    pub fn api(&self, resource: &ResolvedResource, namespace: Option<&str>) -> Api<DynamicObject> {
        let ar = api_resource(resource);
        match namespace.filter(|ns| resource.namespaced && !ns.is_empty()) {
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, &ar),
            None => Api::all_with(self.client.clone(), &ar),
        }
    }

    /// Reads one object.
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn get(
        &self,
        resource: &ResolvedResource,
        namespace: &str,
        name: &str,
    ) -> Result<Value, Error> {
        let obj = self.api(resource, Some(namespace)).get(name).await?;
        Ok(to_value(obj))
    }

    /// Applies a JSON merge patch to the object or its status subresource and returns the
    /// object as the server stored it.
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn merge_patch(
        &self,
        resource: &ResolvedResource,
        namespace: &str,
        name: &str,
        patch: &Value,
        status: bool,
    ) -> Result<Value, Error> {
        self.send_merge_patch(resource, namespace, name, patch, status, false)
            .await
    }

    /// Validates a merge patch with a server-side dry run (nothing is stored).
    ///
    /// # Errors
    /// See [`Error`]; [`Error::Invalid`] when the API server would reject it.
    pub async fn merge_patch_dry_run(
        &self,
        resource: &ResolvedResource,
        namespace: &str,
        name: &str,
        patch: &Value,
        status: bool,
    ) -> Result<(), Error> {
        self.send_merge_patch(resource, namespace, name, patch, status, true)
            .await
            .map(|_| ())
    }

    async fn send_merge_patch(
        &self,
        resource: &ResolvedResource,
        namespace: &str,
        name: &str,
        patch: &Value,
        status: bool,
        dry_run: bool,
    ) -> Result<Value, Error> {
        let api = self.api(resource, Some(namespace));
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            dry_run,
            ..PatchParams::default()
        };
        let obj = if status {
            api.patch_status(name, &params, &Patch::Merge(patch)).await?
        } else {
            api.patch(name, &params, &Patch::Merge(patch)).await?
        };
        Ok(to_value(obj))
    }
}

/// kube's description of a resolved resource.
pub fn api_resource(resource: &ResolvedResource) -> ApiResource {
    ApiResource {
        group: resource.group.clone(),
        version: resource.version.clone(),
        api_version: resource.api_version(),
        kind: resource.kind.clone(),
        plural: resource.plural.clone(),
    }
}

/// An object as JSON, without `managedFields` (never needed, often the bulk of the body).
pub fn to_value(obj: DynamicObject) -> Value {
    to_body(obj, false)
}

/// An object as JSON, with its `managedFields` only when `managed` (a watch event on its way
/// to event handlers, which see the raw event as kopf passes it).
pub fn to_body(mut obj: DynamicObject, managed: bool) -> Value {
    if !managed {
        obj.metadata.managed_fields = None;
    }
    serde_json::to_value(obj).unwrap_or(Value::Null)
}

/// Drops `metadata.managedFields` from a body that kept them for its event handlers.
pub fn drop_managed_fields(body: &mut Value) {
    if let Some(meta) = body.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("managedFields");
    }
}
