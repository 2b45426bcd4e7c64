//! Resolves kopf-style resource selectors through API discovery.
//!
//! A selector names a resource by plural, kind, singular, short name or category, optionally
//! qualified by version and group (`"examples"`, `"Example"`, `"cex"`,
//! `"examples.demo.capstan.dev"`, `"cex.v1.demo.capstan.dev"`). As in kopf, versionless
//! selectors match only a group's preferred version, the core `v1` group wins over other groups
//! for the same name, and a selector that still matches several resources is ambiguous and
//! refused rather than guessed. Resources that cannot be listed, watched and patched are
//! refused too. Results of the (comparatively expensive) discovery calls are cached briefly.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::APIResource;
use kube::Client;
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::model::{ResolvedResource, ResourceSelector};

/// Why a selector could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No served resource matches.
    #[error("no resource matches {0:?}")]
    NotFound(String),
    /// Several resources match.
    #[error("{selector:?} is ambiguous: it matches {candidates}; qualify it with a group")]
    Ambiguous {
        /// The selector.
        selector: String,
        /// The matching resources.
        candidates: String,
    },
    /// The resource exists but lacks verbs the controller needs.
    #[error("{resource} cannot be {missing} (verbs: {verbs})")]
    NotWatchable {
        /// The resource.
        resource: String,
        /// The missing verbs.
        missing: String,
        /// The verbs it has.
        verbs: String,
    },
    /// A discovery call failed.
    #[error("discovery failed")]
    Api(#[source] kube::Error),
}

impl Error {
    /// The machine reason for diagnostics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotFound(_) => "UNKNOWN_RESOURCE",
            Self::Ambiguous { .. } => "AMBIGUOUS_RESOURCE",
            Self::NotWatchable { .. } => "RESOURCE_NOT_WATCHABLE",
            Self::Api(_) => "DISCOVERY_FAILED",
        }
    }
}

/// One served resource as discovery describes it.
#[derive(Clone, Debug)]
struct Served {
    resolved: ResolvedResource,
    preferred: bool,
    singular: String,
    short_names: Vec<String>,
    categories: Vec<String>,
    verbs: Vec<String>,
}

/// Resolves selectors against the API server's discovery documents.
pub struct Discovery {
    client: Client,
    ttl: Duration,
    cache: Mutex<Option<(Instant, std::sync::Arc<Vec<Served>>)>>,
}

impl Discovery {
    /// A resolver that re-reads discovery at most every `ttl`.
    pub fn new(client: Client, ttl: Duration) -> Self {
        Self {
            client,
            ttl,
            cache: Mutex::new(None),
        }
    }

    /// Resolves one selector.
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn resolve(&self, selector: &ResourceSelector) -> Result<ResolvedResource, Error> {
        let wanted = Wanted::parse(selector);
        let served = self.served(false).await?;
        match pick(&wanted, &served) {
            Err(Error::NotFound(_)) => {
                // A CRD may have been created since the last scan.
                let fresh = self.served(true).await?;
                pick(&wanted, &fresh)
            }
            other => other,
        }
    }

    /// Re-reads discovery now (a CRD appeared or went away) and returns the fresh view, in
    /// which selectors resolve without further API calls.
    ///
    /// # Errors
    /// [`Error::Api`] when discovery fails.
    pub async fn rescan(&self) -> Result<Scan, Error> {
        Ok(Scan(self.served(true).await?))
    }

    async fn served(&self, refresh: bool) -> Result<std::sync::Arc<Vec<Served>>, Error> {
        if !refresh
            && let Some((at, served)) = self.cache.lock().as_ref()
            && at.elapsed() < self.ttl
        {
            return Ok(served.clone());
        }
        let served = std::sync::Arc::new(scan(&self.client).await?);
        *self.cache.lock() = Some((Instant::now(), served.clone()));
        Ok(served)
    }
}

/// One discovery result, for resolving many selectors against the same view.
pub struct Scan(std::sync::Arc<Vec<Served>>);

impl Scan {
    /// Resolves one selector against this view.
    ///
    /// # Errors
    /// As [`Discovery::resolve`], never [`Error::Api`].
    pub fn resolve(&self, selector: &ResourceSelector) -> Result<ResolvedResource, Error> {
        pick(&Wanted::parse(selector), &self.0)
    }
}

/// What a selector asks for, after splitting qualified names.
#[derive(Debug, PartialEq, Eq)]
struct Wanted {
    name: String,
    group: Option<String>,
    version: Option<String>,
    display: String,
}

impl Wanted {
    fn parse(selector: &ResourceSelector) -> Self {
        let mut name = selector.name.clone();
        let mut group = (!selector.group.is_empty()).then(|| selector.group.clone());
        let mut version = (!selector.version.is_empty()).then(|| selector.version.clone());
        if group.is_none()
            && version.is_none()
            && let Some((first, rest)) = selector.name.split_once('.')
        {
            name = first.to_owned();
            match rest.split_once('.') {
                Some((v, g)) if looks_like_version(v) => {
                    version = Some(v.to_owned());
                    group = Some(g.to_owned());
                }
                _ if looks_like_version(rest) => version = Some(rest.to_owned()),
                _ => group = Some(rest.to_owned()),
            }
        }
        if version.is_none() && group.as_deref().is_some_and(looks_like_version) {
            version = group.take();
            group = Some(String::new());
        }
        Self {
            name,
            group,
            version,
            display: selector.to_string(),
        }
    }
}

fn looks_like_version(s: &str) -> bool {
    let Some(rest) = s.strip_prefix('v') else {
        return false;
    };
    let digits = rest.chars().take_while(char::is_ascii_digit).count();
    if digits == 0 {
        return false;
    }
    let tail = &rest[digits..];
    tail.is_empty()
        || ["alpha", "beta"].iter().any(|p| {
            tail.strip_prefix(p)
                .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
        })
}

fn pick(wanted: &Wanted, served: &[Served]) -> Result<ResolvedResource, Error> {
    let mut found: Vec<&Served> = served
        .iter()
        .filter(|s| wanted.group.as_ref().is_none_or(|g| *g == s.resolved.group))
        .filter(|s| match &wanted.version {
            Some(v) => *v == s.resolved.version,
            None => s.preferred,
        })
        .filter(|s| {
            let n = wanted.name.as_str();
            s.resolved.plural == n
                || s.resolved.kind == n
                || s.singular == n
                || s.short_names.iter().any(|x| x == n)
                || s.categories.iter().any(|x| x == n)
        })
        .collect();
    if found.len() > 1 && wanted.group.is_none() && found.iter().any(|s| s.resolved.group.is_empty()) {
        found.retain(|s| s.resolved.group.is_empty());
    }
    match found.as_slice() {
        [] => Err(Error::NotFound(wanted.display.clone())),
        [one] => {
            let missing: Vec<&str> = ["list", "watch", "patch"]
                .into_iter()
                .filter(|v| !one.verbs.iter().any(|x| x == v))
                .collect();
            if missing.is_empty() {
                Ok(one.resolved.clone())
            } else {
                Err(Error::NotWatchable {
                    resource: one.resolved.to_string(),
                    missing: missing.join("/"),
                    verbs: one.verbs.join(","),
                })
            }
        }
        many => Err(Error::Ambiguous {
            selector: wanted.display.clone(),
            candidates: many
                .iter()
                .map(|s| s.resolved.to_string())
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

async fn scan(client: &Client) -> Result<Vec<Served>, Error> {
    let mut out = Vec::new();
    let core = client.list_core_api_versions().await.map_err(Error::Api)?;
    for (i, version) in core.versions.iter().enumerate() {
        let list = client
            .list_core_api_resources(version)
            .await
            .map_err(Error::Api)?;
        collect(&mut out, "", version, i == 0, &list.resources);
    }
    let groups = client.list_api_groups().await.map_err(Error::Api)?;
    for group in groups.groups {
        let preferred = group.preferred_version.as_ref().map(|p| p.version.clone());
        for v in &group.versions {
            let list = match client.list_api_group_resources(&v.group_version).await {
                Ok(list) => list,
                // The API server itself stopped answering: the whole scan is void, or every
                // resource would look gone (and its watch be stopped) for the outage.
                Err(e @ (kube::Error::HyperError(_) | kube::Error::Service(_))) => return Err(Error::Api(e)),
                // An aggregated API that is down must not break resolution of everything else.
                Err(e) => {
                    tracing::debug!(group_version = %v.group_version, error = %e, "skipping unavailable API");
                    continue;
                }
            };
            let is_preferred = preferred.as_deref() == Some(v.version.as_str());
            collect(&mut out, &group.name, &v.version, is_preferred, &list.resources);
        }
    }
    Ok(out)
}

fn collect(out: &mut Vec<Served>, group: &str, version: &str, preferred: bool, resources: &[APIResource]) {
    for r in resources.iter().filter(|r| !r.name.contains('/')) {
        let status_subresource = resources.iter().any(|s| s.name == format!("{}/status", r.name));
        out.push(Served {
            resolved: ResolvedResource {
                group: group.to_owned(),
                version: version.to_owned(),
                plural: r.name.clone(),
                kind: r.kind.clone(),
                namespaced: r.namespaced,
                status_subresource,
            },
            preferred,
            singular: if r.singular_name.is_empty() {
                r.kind.to_lowercase()
            } else {
                r.singular_name.clone()
            },
            short_names: r.short_names.clone().unwrap_or_default(),
            categories: r.categories.clone().unwrap_or_default(),
            verbs: r.verbs.clone(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(group: &str, version: &str, plural: &str, kind: &str, preferred: bool) -> Served {
        Served {
            resolved: ResolvedResource {
                group: group.into(),
                version: version.into(),
                plural: plural.into(),
                kind: kind.into(),
                namespaced: true,
                status_subresource: true,
            },
            preferred,
            singular: kind.to_lowercase(),
            short_names: vec![format!("{}x", &plural[..1])],
            categories: vec!["all".into()],
            verbs: ["list", "watch", "patch", "get"].map(String::from).to_vec(),
        }
    }

    fn sel(name: &str) -> ResourceSelector {
        ResourceSelector {
            name: name.into(),
            ..Default::default()
        }
    }

    fn world() -> Vec<Served> {
        vec![
            served("", "v1", "pods", "Pod", true),
            served("metrics.k8s.io", "v1beta1", "pods", "PodMetrics", true),
            served("demo.capstan.dev", "v1", "examples", "Example", true),
            served("demo.capstan.dev", "v1beta1", "examples", "Example", false),
            served("other.dev", "v1", "examples", "Example", true),
        ]
    }

    #[test]
    fn parses_qualified_names() {
        let w = Wanted::parse(&sel("examples.demo.capstan.dev"));
        assert_eq!(
            (w.name.as_str(), w.group.as_deref(), w.version),
            ("examples", Some("demo.capstan.dev"), None)
        );
        let w = Wanted::parse(&sel("ex.v1beta1.demo.capstan.dev"));
        assert_eq!(w.version.as_deref(), Some("v1beta1"));
        assert_eq!(w.group.as_deref(), Some("demo.capstan.dev"));
        let w = Wanted::parse(&ResourceSelector {
            group: "v1".into(),
            name: "pods".into(),
            ..Default::default()
        });
        assert_eq!((w.group.as_deref(), w.version.as_deref()), (Some(""), Some("v1")));
        assert!(
            !looks_like_version("vx") && looks_like_version("v2alpha1") && !looks_like_version("v1alpha")
        );
    }

    #[test]
    fn core_wins_and_ambiguity_is_refused() {
        let w = world();
        assert_eq!(pick(&Wanted::parse(&sel("pods")), &w).unwrap().group, "");
        let err = pick(&Wanted::parse(&sel("examples")), &w).unwrap_err();
        assert_eq!(err.reason(), "AMBIGUOUS_RESOURCE");
        assert!(err.to_string().contains("examples.v1.other.dev"), "{err}");
        let ok = pick(&Wanted::parse(&sel("Example.demo.capstan.dev")), &w).unwrap();
        assert_eq!(
            ok.version, "v1",
            "versionless selectors take the preferred version"
        );
        assert_eq!(
            pick(&Wanted::parse(&sel("ex.demo.capstan.dev")), &w)
                .unwrap()
                .plural,
            "examples"
        );
        assert_eq!(
            pick(&Wanted::parse(&sel("nothing")), &w).unwrap_err().reason(),
            "UNKNOWN_RESOURCE"
        );
    }

    #[test]
    fn refuses_resources_that_cannot_be_watched() {
        let mut w = world();
        w[0].verbs = vec!["get".into()];
        let err = pick(&Wanted::parse(&sel("Pod")), &w[..1]).unwrap_err();
        assert_eq!(err.reason(), "RESOURCE_NOT_WATCHABLE");
    }
}
