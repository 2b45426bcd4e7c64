//! API access to the peering objects: `ClusterCapstanPeering` (cluster-scoped) and
//! `CapstanPeering` (namespaced), both `capstan.dev/v1`.
//!
//! Their `status` is a map of peer identity → entry, the shape kopf uses for its
//! `KopfPeering` objects. This module reads, creates, merge-patches and watches them as plain
//! JSON; what the entries mean (priorities, staleness, pausing) is `peering::keepalive`'s and
//! `peering::freeze`'s business. The CRDs live in `controller/crds/peering.yaml`.

use std::fmt;

use futures::{Stream, StreamExt as _};
use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams},
    core::GroupVersionKind,
    runtime::{WatchStreamExt as _, watcher},
};
use serde_json::{Map, Value, json};

use super::objects::FIELD_MANAGER;

/// The API group of the peering CRDs.
pub const GROUP: &str = "capstan.dev";
/// Their version.
pub const VERSION: &str = "v1";

/// Why a peering request failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The peering CRDs are not installed in the cluster.
    #[error(
        "the peering CRDs (clustercapstanpeerings.capstan.dev, capstanpeerings.capstan.dev) are not installed; \
         install them with `capstan crds | kubectl apply -f -` or the Helm chart value `crds.enabled=true`, \
         or run with --standalone to disable peering"
    )]
    NotInstalled,
    /// The peering object does not exist.
    #[error("{0} does not exist")]
    NotFound(Target),
    /// The API server could not be reached or refused the request.
    #[error("the peering API request for {target} failed")]
    Api {
        /// The object.
        target: Target,
        /// What the API said.
        #[source]
        source: kube::Error,
    },
}

/// Which peering object: cluster-wide or in one namespace, by name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Target {
    /// `None` for the cluster-wide `ClusterCapstanPeering`.
    pub namespace: Option<String>,
    /// The object's name.
    pub name: String,
}

impl Target {
    /// The cluster-wide peering `name`.
    pub fn cluster(name: &str) -> Self {
        Self {
            namespace: None,
            name: name.to_owned(),
        }
    }

    /// The peering `name` in `namespace`.
    pub fn namespaced(namespace: &str, name: &str) -> Self {
        Self {
            namespace: Some(namespace.to_owned()),
            name: name.to_owned(),
        }
    }

    fn resource(&self) -> ApiResource {
        let (kind, plural) = match self.namespace {
            None => ("ClusterCapstanPeering", "clustercapstanpeerings"),
            Some(_) => ("CapstanPeering", "capstanpeerings"),
        };
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, kind), plural)
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            None => write!(f, "clustercapstanpeering/{}", self.name),
            Some(ns) => write!(f, "capstanpeering/{} (namespace {ns})", self.name),
        }
    }
}

/// The peering objects' API.
#[derive(Clone)]
pub struct Peerings {
    client: Client,
}

impl Peerings {
    /// Peering access through `client`.
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    fn api(&self, target: &Target) -> Api<DynamicObject> {
        let ar = target.resource();
        match &target.namespace {
            None => Api::all_with(self.client.clone(), &ar),
            Some(ns) => Api::namespaced_with(self.client.clone(), ns, &ar),
        }
    }

    fn api_error(target: &Target, source: kube::Error) -> Error {
        match &source {
            kube::Error::Api(status) if status.code == 404 => Error::NotFound(target.clone()),
            _ => Error::Api {
                target: target.clone(),
                source,
            },
        }
    }

    /// Checks that the CRD serving `target` is installed (API discovery of `capstan.dev/v1`).
    ///
    /// # Errors
    /// [`Error::NotInstalled`] when it is not; [`Error::Api`] when discovery fails.
    pub async fn check_installed(&self, target: &Target) -> Result<(), Error> {
        let plural = target.resource().plural;
        match self
            .client
            .list_api_group_resources(&format!("{GROUP}/{VERSION}"))
            .await
        {
            Ok(list) if list.resources.iter().any(|r| r.name == plural) => Ok(()),
            Ok(_) => Err(Error::NotInstalled),
            Err(kube::Error::Api(status)) if status.code == 404 => Err(Error::NotInstalled),
            Err(source) => Err(Error::Api {
                target: target.clone(),
                source,
            }),
        }
    }

    /// The object's `status` (peer id → entry); [`Error::NotFound`] when it does not exist.
    ///
    /// # Errors
    /// [`Error::NotFound`], [`Error::Api`].
    pub async fn status(&self, target: &Target) -> Result<Map<String, Value>, Error> {
        let obj = self
            .api(target)
            .get(&target.name)
            .await
            .map_err(|e| Self::api_error(target, e))?;
        Ok(status_of(&obj))
    }

    /// Creates the object with an empty status unless it exists.
    ///
    /// # Errors
    /// [`Error::Api`] when it cannot be created.
    pub async fn ensure(&self, target: &Target) -> Result<(), Error> {
        let ar = target.resource();
        let mut obj = DynamicObject::new(&target.name, &ar);
        obj.metadata.namespace.clone_from(&target.namespace);
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PostParams::default()
        };
        match self.api(target).create(&params, &obj).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
            Err(source) => Err(Self::api_error(target, source)),
        }
    }

    /// Merge-patches `status` with `entries` (an entry of `null` removes that peer) and
    /// returns the whole status as stored.
    ///
    /// # Errors
    /// [`Error::NotFound`] when the object does not exist; [`Error::Api`].
    pub async fn patch(
        &self,
        target: &Target,
        entries: Map<String, Value>,
    ) -> Result<Map<String, Value>, Error> {
        let patch = json!({ "status": entries });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        let obj = self
            .api(target)
            .patch(&target.name, &params, &Patch::Merge(&patch))
            .await
            .map_err(|e| Self::api_error(target, e))?;
        Ok(status_of(&obj))
    }

    /// Watches the object: yields its status whenever it changes (an empty map when it is
    /// deleted), re-listing with backoff after errors.
    pub fn watch(
        &self,
        target: &Target,
    ) -> impl Stream<Item = Result<Map<String, Value>, Error>> + Send + 'static {
        let config = watcher::Config::default().fields(&format!("metadata.name={}", target.name));
        let target = target.clone();
        watcher(self.api(&target), config)
            .default_backoff()
            .filter_map(move |event| {
                let target = target.clone();
                async move {
                    match event {
                        Ok(watcher::Event::Apply(obj) | watcher::Event::InitApply(obj)) => {
                            Some(Ok(status_of(&obj)))
                        }
                        Ok(watcher::Event::Delete(_)) => Some(Ok(Map::new())),
                        Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
                        Err(e) => Some(Err(Error::Api {
                            target,
                            source: kube::Error::Service(Box::new(e)),
                        })),
                    }
                }
            })
    }
}

fn status_of(obj: &DynamicObject) -> Map<String, Value> {
    obj.data
        .get("status")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_pick_the_kind_by_scope() {
        assert_eq!(
            Target::cluster("default").resource().kind,
            "ClusterCapstanPeering"
        );
        assert_eq!(
            Target::namespaced("ns", "default").resource().plural,
            "capstanpeerings"
        );
        assert_eq!(
            Target::namespaced("ns", "p").to_string(),
            "capstanpeering/p (namespace ns)"
        );
    }
}
