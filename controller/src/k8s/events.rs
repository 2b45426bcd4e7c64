//! Posting Kubernetes Events (`core/v1`) about objects, and bumping the count of an Event
//! that repeats.
//!
//! Events of cluster-scoped objects go to the `default` namespace (Events are namespaced).
//! Messages longer than 1024 characters are cut in the middle. An Event about an object
//! named without its uid (a handler posting on another object) gets the uid looked up, so
//! that `kubectl describe` finds it. Posting is best effort: the caller logs failures and
//! carries on.

use k8s_openapi::api::core::v1::Event;
use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams},
};
use serde_json::json;
use tracing::debug;

use crate::{
    model::{Level, Posting, ResourceRef},
    persistence::time,
};

/// The longest Event message posted.
pub const MAX_MESSAGE: usize = 1024;

/// Creates and updates Events.
#[derive(Clone)]
pub struct Events {
    client: Client,
    instance: String,
}

/// Where a posted Event lives, to bump its count later.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Posted {
    /// The Event's namespace.
    pub namespace: String,
    /// The Event's name.
    pub name: String,
}

impl Events {
    /// A poster reporting as `instance` (e.g. the pod or host name).
    pub fn new(client: Client, instance: String) -> Self {
        Self { client, instance }
    }

    /// Creates an Event.
    ///
    /// # Errors
    /// When the API refuses or is unreachable.
    pub async fn create(&self, posting: &Posting) -> Result<Posted, kube::Error> {
        let namespace = if posting.object.namespace.is_empty() {
            "default"
        } else {
            &posting.object.namespace
        };
        let now = time::format(std::time::SystemTime::now());
        let object = &posting.object;
        let uid = if object.uid.is_empty() && !object.name.is_empty() {
            self.uid_of(object).await
        } else {
            Some(object.uid.clone())
        };
        let event: Event = serde_json::from_value(json!({
            "metadata": {
                "generateName": format!("{}.", if object.name.is_empty() { "capstan" } else { &object.name }),
                "namespace": namespace,
            },
            "involvedObject": {
                "apiVersion": object.resource.api_version(),
                "kind": object.resource.kind,
                "name": object.name,
                "namespace": if object.namespace.is_empty() { None } else { Some(&object.namespace) },
                "uid": uid,
            },
            "reason": posting.reason,
            "message": cut(&posting.message),
            "type": event_type(posting.level),
            "source": {"component": "capstan"},
            "reportingComponent": "capstan",
            "reportingInstance": self.instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }))
        .map_err(kube::Error::SerdeError)?;
        let api: Api<Event> = Api::namespaced(self.client.clone(), namespace);
        let created = api.create(&PostParams::default(), &event).await?;
        Ok(Posted {
            namespace: namespace.to_owned(),
            name: created.metadata.name.unwrap_or_default(),
        })
    }

    /// The uid of a named object, if it can be read.
    async fn uid_of(&self, object: &ResourceRef) -> Option<String> {
        let r = &object.resource;
        let resource = ApiResource {
            group: r.group.clone(),
            version: r.version.clone(),
            api_version: r.api_version(),
            kind: r.kind.clone(),
            plural: r.plural.clone(),
        };
        let api: Api<DynamicObject> = if object.namespace.is_empty() {
            Api::all_with(self.client.clone(), &resource)
        } else {
            Api::namespaced_with(self.client.clone(), &object.namespace, &resource)
        };
        match api.get_metadata(&object.name).await {
            Ok(meta) => meta.metadata.uid,
            Err(e) => {
                debug!(object = %object, error = %e, "the Event's object could not be read; posting without its uid");
                None
            }
        }
    }

    /// Sets the count and last time of a posted Event.
    ///
    /// # Errors
    /// When the API refuses or is unreachable.
    pub async fn bump(&self, posted: &Posted, count: u32) -> Result<(), kube::Error> {
        let api: Api<Event> = Api::namespaced(self.client.clone(), &posted.namespace);
        let patch = json!({"count": count, "lastTimestamp": time::format(std::time::SystemTime::now())});
        api.patch(&posted.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }
}

fn event_type(level: Level) -> &'static str {
    match level {
        Level::Debug | Level::Info => "Normal",
        Level::Warning | Level::Error => "Warning",
    }
}

/// Cuts a message longer than the limit in the middle, keeping both ends.
pub fn cut(message: &str) -> String {
    if message.chars().count() <= MAX_MESSAGE {
        return message.to_owned();
    }
    let keep = (MAX_MESSAGE - 3) / 2;
    let head: String = message.chars().take(keep).collect();
    let tail: String = message
        .chars()
        .rev()
        .take(keep)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    format!("{head}...{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_are_cut_in_the_middle() {
        let long = format!("{}{}", "a".repeat(2000), "z".repeat(10));
        let cut = cut(&long);
        assert_eq!(cut.chars().count(), MAX_MESSAGE - 1);
        assert!(cut.starts_with("aaa") && cut.ends_with("zzz") && cut.contains("..."));
        assert_eq!(super::cut("short"), "short");
    }
}
