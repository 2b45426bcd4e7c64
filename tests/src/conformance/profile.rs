//! SDK profiles: how to build and start an SDK's conformance handler, what it claims, and what
//! it is known to fail.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;

use super::features::FEATURES;

/// A profile as written in `tests/conformance/sdks/<name>.yaml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// The SDK's name in reports.
    pub name: String,
    /// The folder the build and the handler run in, relative to the profile's folder.
    #[serde(default)]
    pub dir: Option<String>,
    /// Commands run once before the first case.
    #[serde(default)]
    pub build: Vec<Vec<String>>,
    /// The conformance handler's command line.
    pub command: Vec<String>,
    /// Extra environment, for the build and the handler.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The features the SDK claims.
    pub features: Vec<String>,
    /// Cases the SDK is known to fail, each with its reason.
    #[serde(default)]
    pub known_failing: Vec<KnownFailing>,
    /// Where the profile was read from (set when loading).
    #[serde(skip)]
    pub path: PathBuf,
}

/// A case an SDK is known to fail.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KnownFailing {
    /// The case's name.
    pub case: String,
    /// Why, for a person.
    pub why: String,
}

impl Profile {
    /// Reads and checks a profile.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut profile: Self =
            serde_saphyr::from_str(&text).with_context(|| format!("the profile {}", path.display()))?;
        profile.path = path.to_path_buf();
        for feature in &profile.features {
            if !FEATURES.iter().any(|known| known.name == feature) {
                bail!("{}: unknown feature {feature}", path.display());
            }
        }
        if profile.command.is_empty() {
            bail!("{}: an empty command", path.display());
        }
        Ok(profile)
    }

    /// The folder commands run in.
    pub fn workdir(&self) -> PathBuf {
        let folder = self.path.parent().unwrap_or(Path::new("."));
        match &self.dir {
            Some(dir) => folder.join(dir),
            None => folder.to_path_buf(),
        }
    }

    /// Whether the SDK claims a feature.
    pub fn claims(&self, feature: &str) -> bool {
        self.features.iter().any(|claimed| claimed == feature)
    }

    /// Why a case is known to fail, if it is.
    pub fn known_failing(&self, case: &str) -> Option<&str> {
        self.known_failing
            .iter()
            .find(|known| known.case == case)
            .map(|known| known.why.as_str())
    }
}

/// Expands `${VAR}` and `${VAR:-default}` from `vars`, then from the environment.
pub fn expand(text: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let Some(end) = rest[start..].find('}') else {
            out.push_str(&rest[start..]);
            return out;
        };
        let inner = &rest[start + 2..start + end];
        let (name, default) = match inner.split_once(":-") {
            Some((name, default)) => (name, Some(default)),
            None => (inner, None),
        };
        let value = vars
            .get(name)
            .cloned()
            .or_else(|| std::env::var(name).ok().filter(|value| !value.is_empty()))
            .or_else(|| default.map(str::to_owned))
            .unwrap_or_default();
        out.push_str(&value);
        rest = &rest[start + end + 1..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_expand_from_the_given_then_the_environment_then_the_default() {
        let vars = BTreeMap::from([("OUT".to_owned(), "/o".to_owned())]);
        assert_eq!(expand("${OUT}/h", &vars), "/o/h");
        assert_eq!(
            expand("${CAPSTAN_SURELY_UNSET_VARIABLE:-python3} x", &vars),
            "python3 x"
        );
        assert_eq!(expand("a${OUT", &vars), "a${OUT");
    }
}
