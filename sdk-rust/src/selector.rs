//! Resource selectors: which Kubernetes resource a handler watches.
//!
//! The SDK does no discovery. It passes the selector to the controller, which resolves it as kopf
//! does (plural, kind, singular, short name or category, optionally qualified as `name.group` or
//! `name.version.group`) and reports the result per handler in `Welcome`. A string containing
//! slashes is split here: `group/version/name`, `version/name` for the core group (`v1/pods`) or
//! `group/name`.

use crate::pb;

/// Selects one Kubernetes resource for a handler.
///
/// Built from a string (`"examples.demo.capstan.dev"`, `"Example"`, `"cex"`,
/// `"demo.capstan.dev/v1/examples"`, `"v1/pods"`) or with [`Selector::new`] and the setters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Selector {
    /// The API group; empty matches any group.
    pub group: String,
    /// The API version; empty means the group's preferred version.
    pub version: String,
    /// The plural, kind, singular, short name or category, possibly dotted with the group.
    pub name: String,
    /// A server-side label selector for the watch (e.g. `app=db`).
    pub label_selector: String,
    /// A server-side field selector for the watch.
    pub field_selector: String,
}

impl Selector {
    /// Selects a resource by name (plural, kind, singular, short name or category).
    #[must_use]
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ..Self::default()
        }
    }

    /// Narrows the selection to one API group (empty: the core group or any group).
    #[must_use]
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = group.into();
        self
    }

    /// Narrows the selection to one API version.
    #[must_use]
    pub fn version(mut self, version: impl Into<String>) -> Self {
        self.version = version.into();
        self
    }

    /// Watches only objects matching this server-side label selector.
    #[must_use]
    pub fn label_selector(mut self, selector: impl Into<String>) -> Self {
        self.label_selector = selector.into();
        self
    }

    /// Watches only objects matching this server-side field selector.
    #[must_use]
    pub fn field_selector(mut self, selector: impl Into<String>) -> Self {
        self.field_selector = selector.into();
        self
    }

    pub(crate) fn to_pb(&self) -> pb::ResourceSelector {
        pb::ResourceSelector {
            group: self.group.clone(),
            version: self.version.clone(),
            name: self.name.clone(),
            label_selector: self.label_selector.clone(),
            field_selector: self.field_selector.clone(),
        }
    }
}

/// Whether a path segment looks like a Kubernetes API version (`v1`, `v1beta2`, `v2alpha1`).
fn is_version(segment: &str) -> bool {
    let Some(rest) = segment.strip_prefix('v') else {
        return false;
    };
    let digits = rest.chars().take_while(char::is_ascii_digit).count();
    if digits == 0 {
        return false;
    }
    let tail = &rest[digits..];
    tail.is_empty()
        || ["alpha", "beta"].iter().any(|stage| {
            tail.strip_prefix(stage)
                .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
        })
}

impl From<&str> for Selector {
    fn from(text: &str) -> Self {
        let parts: Vec<&str> = text.split('/').collect();
        match parts.as_slice() {
            [group, version, name] => Self::new(*name).group(*group).version(*version),
            [first, name] if is_version(first) => Self::new(*name).version(*first),
            [group, name] => Self::new(*name).group(*group),
            _ => Self::new(text),
        }
    }
}

impl From<String> for Selector {
    fn from(text: String) -> Self {
        Self::from(text.as_str())
    }
}

impl From<&String> for Selector {
    fn from(text: &String) -> Self {
        Self::from(text.as_str())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_pass_through_for_the_controller_to_resolve() {
        for name in [
            "examples.demo.capstan.dev",
            "Example",
            "cex",
            "cex.v1.demo.capstan.dev",
        ] {
            assert_eq!(Selector::from(name), Selector::new(name));
        }
    }

    #[test]
    fn slashes_split_into_group_version_and_name() {
        let s = Selector::from("demo.capstan.dev/v1/examples");
        assert_eq!(
            (s.group.as_str(), s.version.as_str(), s.name.as_str()),
            ("demo.capstan.dev", "v1", "examples")
        );
        let core = Selector::from("v1/pods");
        assert_eq!((core.group.as_str(), core.version.as_str()), ("", "v1"));
        let beta = Selector::from("v2beta1/things");
        assert_eq!(beta.version, "v2beta1");
        let grouped = Selector::from("apps/deployments");
        assert_eq!((grouped.group.as_str(), grouped.version.as_str()), ("apps", ""));
        assert!(!is_version("vendor") && !is_version("v1beta") && !is_version("v"));
    }
}
