//! Which namespaces an operator serves: kopf's namespace patterns.
//!
//! Patterns are globs (`*`, `?`) with `!` for negation, possibly comma-separated within one
//! argument; they are applied in order and the last one that matches decides, starting from
//! "excluded" — or from "included" when the first pattern is a negation (so `!kube-*` alone
//! means everything but `kube-*`). Exact names are watched one namespace at a time (so a
//! namespaced Role is enough); as soon as a glob or a negation is involved the resource is
//! watched cluster-wide and objects are filtered here, which also serves namespaces created
//! after the start without a restart.

use std::fmt;

/// A compiled set of namespace patterns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Namespaces {
    patterns: Vec<(bool, String)>,
}

/// Why a pattern is invalid.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// An empty pattern (e.g. from a stray comma).
    #[error("an empty namespace pattern in {0:?}")]
    Empty(String),
    /// Characters that no namespace name or glob may contain.
    #[error("{0:?} is not a namespace name or glob (letters, digits, '-', '*', '?', a leading '!')")]
    Invalid(String),
}

impl Namespaces {
    /// Compiles the `--namespace` arguments; none means cluster-wide.
    ///
    /// # Errors
    /// On empty or malformed patterns.
    pub fn parse(args: &[String]) -> Result<Self, Error> {
        let mut patterns = Vec::new();
        for arg in args {
            for raw in arg.split(',') {
                let raw = raw.trim();
                if raw.is_empty() {
                    return Err(Error::Empty(arg.clone()));
                }
                let (negated, glob) = match raw.strip_prefix('!') {
                    Some(rest) => (true, rest),
                    None => (false, raw),
                };
                let valid = !glob.is_empty()
                    && glob.chars().all(|c| {
                        c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '*' | '?' | '.')
                    });
                if !valid {
                    return Err(Error::Invalid(raw.to_owned()));
                }
                patterns.push((negated, glob.to_owned()));
            }
        }
        Ok(Self { patterns })
    }

    /// Whether every namespace is served.
    pub fn is_cluster_wide(&self) -> bool {
        self.patterns.is_empty()
    }

    /// The exact names to watch one by one, when no glob or negation is involved.
    pub fn exact(&self) -> Option<Vec<String>> {
        if self.patterns.is_empty()
            || self
                .patterns
                .iter()
                .any(|(neg, g)| *neg || g.contains(['*', '?']))
        {
            return None;
        }
        let mut names: Vec<String> = self.patterns.iter().map(|(_, g)| g.clone()).collect();
        names.dedup();
        Some(names)
    }

    /// Whether a namespace is served (cluster-scoped objects, with an empty namespace, always
    /// are).
    pub fn serves(&self, namespace: &str) -> bool {
        if self.patterns.is_empty() || namespace.is_empty() {
            return true;
        }
        let mut included = self.patterns.first().is_some_and(|(neg, _)| *neg);
        for (negated, glob) in &self.patterns {
            if glob_match(glob.as_bytes(), namespace.as_bytes()) {
                included = !negated;
            }
        }
        included
    }
}

impl fmt::Display for Namespaces {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.patterns.is_empty() {
            return f.write_str("*");
        }
        let parts: Vec<String> = self
            .patterns
            .iter()
            .map(|(neg, g)| if *neg { format!("!{g}") } else { g.clone() })
            .collect();
        f.write_str(&parts.join(","))
    }
}

/// Glob matching with `*` (any run) and `?` (any one character).
fn glob_match(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while t < text.len() {
        if p < pattern.len() && (pattern[p] == b'?' || pattern[p] == text[t]) {
            p += 1;
            t += 1;
        } else if p < pattern.len() && pattern[p] == b'*' {
            star = Some(p);
            mark = t;
            p += 1;
        } else if let Some(s) = star {
            p = s + 1;
            mark += 1;
            t = mark;
        } else {
            return false;
        }
    }
    while p < pattern.len() && pattern[p] == b'*' {
        p += 1;
    }
    p == pattern.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(args: &[&str]) -> Namespaces {
        Namespaces::parse(&args.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn globs_and_negations() {
        let n = ns(&["team-*", "!team-x"]);
        assert!(n.serves("team-a") && !n.serves("team-x") && !n.serves("other"));
        let n = ns(&["!kube-*"]);
        assert!(n.serves("default") && !n.serves("kube-system"));
        let n = ns(&["!team-*,team-a"]);
        assert!(n.serves("team-a") && !n.serves("team-b") && n.serves("x"));
        assert!(ns(&["a?c"]).serves("abc") && !ns(&["a?c"]).serves("abbc"));
        assert!(ns(&[]).serves("anything"));
        assert!(ns(&["x"]).serves(""), "cluster-scoped objects are always served");
    }

    #[test]
    fn exact_names_are_watched_one_by_one() {
        assert_eq!(
            ns(&["a", "b"]).exact(),
            Some(vec!["a".to_owned(), "b".to_owned()])
        );
        assert_eq!(ns(&["a", "b*"]).exact(), None);
        assert_eq!(ns(&["!a"]).exact(), None);
    }

    #[test]
    fn bad_patterns_are_refused() {
        assert!(matches!(
            Namespaces::parse(&["a,,b".into()]),
            Err(Error::Empty(_))
        ));
        assert!(matches!(
            Namespaces::parse(&["Team_A".into()]),
            Err(Error::Invalid(_))
        ));
        assert!(matches!(Namespaces::parse(&["!".into()]), Err(Error::Invalid(_))));
    }
}
