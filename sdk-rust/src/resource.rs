//! [`ResourceRef`]: which object an invocation is about, or which object to post an Event on.
//!
//! The SDK's own type for the wire `ResourceRef`, so that handler code never names a generated
//! protocol type (the Go and TypeScript SDKs call it `ResourceRef` too). The conversions both
//! ways live here; they copy every field, so nothing is lost on the way.

use crate::pb;

/// An object reference: its resource (group, version, kind, plural) and the object (namespace,
/// name, uid), with the version of it an invocation saw.
///
/// Build one with struct syntax and `..Default::default()` to post an Event on another object
/// with [`crate::Context::post_event_on`]; only the resource and object names are needed then.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ResourceRef {
    /// The API group; empty for the core group.
    pub group: String,
    /// The API version, e.g. `v1`.
    pub version: String,
    /// The kind, e.g. `Example`.
    pub kind: String,
    /// The plural resource name, e.g. `examples`.
    pub plural: String,
    /// The namespace; empty for cluster-scoped objects.
    pub namespace: String,
    /// The object's name.
    pub name: String,
    /// The object's uid; may be empty when posting an Event (the controller looks it up).
    pub uid: String,
    /// The `resourceVersion` of the body the invocation carried.
    pub resource_version: String,
    /// The `generation` of the body the invocation carried.
    pub generation: i64,
}

impl ResourceRef {
    /// The object's `apiVersion`: `group/version`, or `version` for the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// Decodes a wire reference.
    pub(crate) fn from_pb(resource: &pb::ResourceRef) -> Self {
        Self {
            group: resource.group.clone(),
            version: resource.version.clone(),
            kind: resource.kind.clone(),
            plural: resource.plural.clone(),
            namespace: resource.namespace.clone(),
            name: resource.name.clone(),
            uid: resource.uid.clone(),
            resource_version: resource.resource_version.clone(),
            generation: resource.generation,
        }
    }

    /// Encodes the reference for the wire.
    pub(crate) fn to_pb(&self) -> pb::ResourceRef {
        pb::ResourceRef {
            group: self.group.clone(),
            version: self.version.clone(),
            kind: self.kind.clone(),
            plural: self.plural.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            uid: self.uid.clone(),
            resource_version: self.resource_version.clone(),
            generation: self.generation,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_names_the_api_version() {
        let resource = ResourceRef {
            group: "demo.capstan.dev".into(),
            version: "v1".into(),
            kind: "Example".into(),
            plural: "examples".into(),
            namespace: "ns".into(),
            name: "a".into(),
            uid: "u1".into(),
            resource_version: "7".into(),
            generation: 2,
        };
        assert_eq!(ResourceRef::from_pb(&resource.to_pb()), resource);
        assert_eq!(resource.api_version(), "demo.capstan.dev/v1");
        let core = ResourceRef {
            version: "v1".into(),
            ..ResourceRef::default()
        };
        assert_eq!(core.api_version(), "v1");
    }
}
