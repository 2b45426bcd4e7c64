//! References to Kubernetes resources and objects.
//!
//! A [`ResourceSelector`] is what a handler asks for ("examples", "Example.demo.capstan.dev");
//! a [`ResolvedResource`] is what discovery found for it; a [`ResourceRef`] names one object.

use std::fmt;

/// What a registration asks to handle, before discovery resolves it (kopf's selector).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ResourceSelector {
    /// The API group; empty matches any group.
    pub group: String,
    /// The API version; empty means the preferred version.
    pub version: String,
    /// The plural, kind, singular, short name or category.
    pub name: String,
    /// A server-side label selector for the watch.
    pub label_selector: String,
    /// A server-side field selector for the watch.
    pub field_selector: String,
}

impl fmt::Display for ResourceSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)?;
        if !self.version.is_empty() {
            write!(f, ".{}", self.version)?;
        }
        if !self.group.is_empty() {
            write!(f, ".{}", self.group)?;
        }
        Ok(())
    }
}

/// A resource as discovery resolved it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ResolvedResource {
    /// The API group; empty for the core group.
    pub group: String,
    /// The API version.
    pub version: String,
    /// The plural name.
    pub plural: String,
    /// The kind.
    pub kind: String,
    /// Whether it is namespaced.
    pub namespaced: bool,
    /// Whether it has a status subresource (status is then written through `/status`).
    pub status_subresource: bool,
}

impl ResolvedResource {
    /// The `apiVersion` string: `group/version`, or `version` for the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

impl fmt::Display for ResolvedResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.group.is_empty() {
            write!(f, "{}.{}", self.plural, self.version)
        } else {
            write!(f, "{}.{}.{}", self.plural, self.version, self.group)
        }
    }
}

/// One object, and the version of it that a piece of work saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResourceRef {
    /// The resource of the object.
    pub resource: ResolvedResource,
    /// The namespace; empty for cluster-scoped objects.
    pub namespace: String,
    /// The name.
    pub name: String,
    /// The uid.
    pub uid: String,
    /// The resourceVersion seen.
    pub resource_version: String,
    /// metadata.generation seen.
    pub generation: i64,
}

impl fmt::Display for ResourceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{}/{}", self.resource.plural, self.name)
        } else {
            write!(f, "{}/{}/{}", self.resource.plural, self.namespace, self.name)
        }
    }
}
