//! Kubernetes label and field selectors, parsed once and evaluated against object bodies.
//!
//! A registration may narrow its resource with `label_selector` / `field_selector` (for
//! example `spec.nodeName=node-1` for a per-node operator). When every handler of a resource
//! asks for the same selectors, the watch applies them on the server; when they differ, the
//! watch sees every object and each handler's selectors are checked here, so a handler is
//! never called for an object its selectors exclude. Parsing at registration time also turns
//! a malformed selector into a clear diagnostic instead of a watch the API server refuses.

use std::collections::BTreeSet;

use serde_json::Value;
use thiserror::Error;

/// Why a selector string could not be parsed.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SelectorError {
    /// A requirement with nothing in it (e.g. `a=b,,c=d`).
    #[error("empty requirement in {0:?}")]
    Empty(String),
    /// A key that is not a valid label key or field path.
    #[error("invalid key {key:?} in {requirement:?}")]
    Key {
        /// The offending key.
        key: String,
        /// The requirement it appears in.
        requirement: String,
    },
    /// A value that is not a valid label value.
    #[error("invalid value {value:?} in {requirement:?}")]
    Value {
        /// The offending value.
        value: String,
        /// The requirement it appears in.
        requirement: String,
    },
    /// A requirement that is not one of the known forms.
    #[error(
        "cannot parse {0:?}: expected key, !key, key=value, key!=value, key in (a,b), key notin (a,b), key>N or key<N"
    )]
    Syntax(String),
    /// Unbalanced parentheses.
    #[error("unbalanced parentheses in {0:?}")]
    Parentheses(String),
    /// A field selector requirement without an operator.
    #[error("field requirement {0:?} needs key=value, key==value or key!=value")]
    FieldSyntax(String),
}

/// What one label requirement demands.
#[derive(Clone, Debug, PartialEq, Eq)]
enum LabelOp {
    Equals(String),
    NotEquals(String),
    In(BTreeSet<String>),
    NotIn(BTreeSet<String>),
    Exists,
    DoesNotExist,
    GreaterThan(i64),
    LessThan(i64),
}

/// One label requirement: a key and what its value must be.
#[derive(Clone, Debug, PartialEq, Eq)]
struct LabelRequirement {
    key: String,
    op: LabelOp,
}

impl LabelRequirement {
    fn matches(&self, value: Option<&str>) -> bool {
        let number = || value.and_then(|v| v.parse::<i64>().ok());
        match &self.op {
            LabelOp::Equals(expected) => value == Some(expected.as_str()),
            LabelOp::NotEquals(expected) => value != Some(expected.as_str()),
            LabelOp::In(set) => value.is_some_and(|v| set.contains(v)),
            LabelOp::NotIn(set) => value.is_none_or(|v| !set.contains(v)),
            LabelOp::Exists => value.is_some(),
            LabelOp::DoesNotExist => value.is_none(),
            LabelOp::GreaterThan(n) => number().is_some_and(|v| v > *n),
            LabelOp::LessThan(n) => number().is_some_and(|v| v < *n),
        }
    }
}

/// One field requirement: a dotted path, equal or not equal to a value.
#[derive(Clone, Debug, PartialEq, Eq)]
struct FieldRequirement {
    path: Vec<String>,
    value: String,
    equal: bool,
}

/// A registration's label and field selectors; the empty selector matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObjectSelector {
    labels: Vec<LabelRequirement>,
    fields: Vec<FieldRequirement>,
}

impl ObjectSelector {
    /// Parses a label selector and a field selector (either may be empty).
    pub fn parse(labels: &str, fields: &str) -> Result<Self, SelectorError> {
        Ok(Self {
            labels: parse_labels(labels)?,
            fields: parse_fields(fields)?,
        })
    }

    /// Whether this selector restricts nothing.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty() && self.fields.is_empty()
    }

    /// Whether `body` satisfies every requirement.
    pub fn matches(&self, body: &Value) -> bool {
        if self.is_empty() {
            return true;
        }
        let labels = body.pointer("/metadata/labels").and_then(Value::as_object);
        let label = |key: &str| labels.and_then(|m| m.get(key)).and_then(Value::as_str);
        self.labels.iter().all(|r| r.matches(label(&r.key)))
            && self
                .fields
                .iter()
                .all(|r| (field_value(body, &r.path) == r.value) == r.equal)
    }
}

/// A field's value as the API server compares it: strings as they are, other scalars in their
/// JSON form, and a missing field or null as the empty string.
fn field_value(body: &Value, path: &[String]) -> String {
    match path.iter().try_fold(body, |v, key| v.as_object()?.get(key)) {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// Splits on commas outside parentheses.
fn split_top_level(s: &str) -> Result<Vec<&str>, SelectorError> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| SelectorError::Parentheses(s.to_owned()))?
            }
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(SelectorError::Parentheses(s.to_owned()));
    }
    parts.push(&s[start..]);
    Ok(parts)
}

fn parse_labels(s: &str) -> Result<Vec<LabelRequirement>, SelectorError> {
    if s.trim().is_empty() {
        return Ok(Vec::new());
    }
    split_top_level(s)?.into_iter().map(parse_label).collect()
}

fn parse_label(raw: &str) -> Result<LabelRequirement, SelectorError> {
    let r = raw.trim();
    if r.is_empty() {
        return Err(SelectorError::Empty(raw.to_owned()));
    }
    let key_ok = |key: &str| -> Result<String, SelectorError> {
        if valid_label_key(key) {
            Ok(key.to_owned())
        } else {
            Err(SelectorError::Key {
                key: key.to_owned(),
                requirement: r.to_owned(),
            })
        }
    };
    let value_ok = |value: &str| -> Result<String, SelectorError> {
        let value = value.trim();
        if valid_label_value(value) {
            Ok(value.to_owned())
        } else {
            Err(SelectorError::Value {
                value: value.to_owned(),
                requirement: r.to_owned(),
            })
        }
    };
    if let Some(key) = r.strip_prefix('!') {
        return Ok(LabelRequirement {
            key: key_ok(key.trim())?,
            op: LabelOp::DoesNotExist,
        });
    }
    // Operators are tried longest first so that "!=" and "==" are not read as "=".
    for (token, build) in [
        ("!=", LabelOp::NotEquals as fn(String) -> LabelOp),
        ("==", LabelOp::Equals),
        ("=", LabelOp::Equals),
    ] {
        if let Some((key, value)) = r.split_once(token) {
            return Ok(LabelRequirement {
                key: key_ok(key.trim())?,
                op: build(value_ok(value)?),
            });
        }
    }
    for (token, greater) in [(">", true), ("<", false)] {
        if let Some((key, value)) = r.split_once(token) {
            let n = value.trim().parse::<i64>().map_err(|_| SelectorError::Value {
                value: value.trim().to_owned(),
                requirement: r.to_owned(),
            })?;
            let op = if greater {
                LabelOp::GreaterThan(n)
            } else {
                LabelOp::LessThan(n)
            };
            return Ok(LabelRequirement {
                key: key_ok(key.trim())?,
                op,
            });
        }
    }
    let mut words = r.splitn(2, char::is_whitespace);
    let key = words.next().unwrap_or_default();
    let rest = words.next().unwrap_or_default().trim();
    if rest.is_empty() {
        return Ok(LabelRequirement {
            key: key_ok(key)?,
            op: LabelOp::Exists,
        });
    }
    let (negated, set) = if let Some(set) = rest.strip_prefix("notin") {
        (true, set)
    } else if let Some(set) = rest.strip_prefix("in") {
        (false, set)
    } else {
        return Err(SelectorError::Syntax(r.to_owned()));
    };
    let inner = set
        .trim()
        .strip_prefix('(')
        .and_then(|s| s.strip_suffix(')'))
        .ok_or_else(|| SelectorError::Syntax(r.to_owned()))?;
    let values = inner
        .split(',')
        .map(value_ok)
        .collect::<Result<BTreeSet<_>, _>>()?;
    Ok(LabelRequirement {
        key: key_ok(key)?,
        op: if negated {
            LabelOp::NotIn(values)
        } else {
            LabelOp::In(values)
        },
    })
}

/// `[prefix/]name`: the prefix a DNS subdomain, the name at most 63 characters of
/// alphanumerics, `-`, `_` and `.`, starting and ending alphanumeric.
pub(crate) fn valid_label_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                    && !part.starts_with('-')
                    && !part.ends_with('-')
            })
    });
    prefix_ok && !name.is_empty() && valid_label_value(name)
}

/// Empty, or at most 63 alphanumerics, `-`, `_` and `.`, starting and ending alphanumeric.
fn valid_label_value(value: &str) -> bool {
    let edge = |c: Option<char>| c.is_none_or(|c| c.is_ascii_alphanumeric());
    value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && edge(value.chars().next())
        && edge(value.chars().last())
}

fn parse_fields(s: &str) -> Result<Vec<FieldRequirement>, SelectorError> {
    if s.trim().is_empty() {
        return Ok(Vec::new());
    }
    split_unescaped(s, ',')
        .into_iter()
        .map(|raw| parse_field(&raw))
        .collect()
}

fn parse_field(raw: &str) -> Result<FieldRequirement, SelectorError> {
    let r = raw.trim();
    if r.is_empty() {
        return Err(SelectorError::Empty(raw.to_owned()));
    }
    let (key, value, equal) = if let Some((k, v)) = split_once_unescaped(r, "!=") {
        (k, v, false)
    } else if let Some((k, v)) = split_once_unescaped(r, "==") {
        (k, v, true)
    } else if let Some((k, v)) = split_once_unescaped(r, "=") {
        (k, v, true)
    } else {
        return Err(SelectorError::FieldSyntax(r.to_owned()));
    };
    let key = key.trim();
    let path: Vec<String> = key.split('.').map(str::to_owned).collect();
    let path_ok = path.iter().all(|p| {
        !p.is_empty()
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
    });
    if !path_ok {
        return Err(SelectorError::Key {
            key: key.to_owned(),
            requirement: r.to_owned(),
        });
    }
    Ok(FieldRequirement {
        path,
        value: unescape(value.trim()),
        equal,
    })
}

/// Splits on `sep` where it is not escaped with a backslash (field selector values may escape
/// `,`, `=` and `\`).
fn split_unescaped(s: &str, sep: char) -> Vec<String> {
    let mut parts = vec![String::new()];
    let mut escaped = false;
    for c in s.chars() {
        let current = parts.last_mut();
        match (escaped, c) {
            (false, '\\') => {
                escaped = true;
                if let Some(p) = current {
                    p.push(c);
                }
            }
            (false, c) if c == sep => parts.push(String::new()),
            _ => {
                escaped = false;
                if let Some(p) = current {
                    p.push(c);
                }
            }
        }
    }
    parts
}

/// The first unescaped occurrence of `token`.
fn split_once_unescaped<'a>(s: &'a str, token: &str) -> Option<(&'a str, &'a str)> {
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        if escaped {
            escaped = false;
            continue;
        }
        if c == '\\' {
            escaped = true;
            continue;
        }
        if s[i..].starts_with(token) {
            return Some((&s[..i], &s[i + token.len()..]));
        }
    }
    None
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(next) = chars.next() {
                out.push(next);
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(labels: Value, node: Option<&str>) -> Value {
        json!({"metadata": {"name": "p", "namespace": "ns", "labels": labels},
               "spec": {"nodeName": node, "replicas": 3}})
    }

    fn sel(labels: &str, fields: &str) -> ObjectSelector {
        ObjectSelector::parse(labels, fields).unwrap_or_else(|e| panic!("{labels:?} {fields:?}: {e}"))
    }

    #[test]
    fn the_empty_selector_matches_everything() {
        let s = sel("", " ");
        assert!(s.is_empty());
        assert!(s.matches(&json!({})));
    }

    #[test]
    fn label_equality_and_inequality() {
        let body = pod(json!({"app": "db", "tier": "x"}), None);
        assert!(sel("app=db", "").matches(&body));
        assert!(sel("app==db,tier=x", "").matches(&body));
        assert!(!sel("app=web", "").matches(&body));
        assert!(sel("app!=web", "").matches(&body));
        // A missing label is "not equal" to anything, as in Kubernetes.
        assert!(sel("missing!=x", "").matches(&body));
        assert!(!sel("app!=db", "").matches(&body));
    }

    #[test]
    fn label_sets_existence_and_numbers() {
        let body = pod(json!({"app": "db", "example.com/gen": "5"}), None);
        assert!(sel("app in (db, web)", "").matches(&body));
        assert!(!sel("app in (web)", "").matches(&body));
        assert!(sel("app notin (web,cache)", "").matches(&body));
        assert!(sel("other notin (web)", "").matches(&body));
        assert!(!sel("other in (web)", "").matches(&body));
        assert!(sel("app,!other", "").matches(&body));
        assert!(!sel("!app", "").matches(&body));
        assert!(sel("example.com/gen>4,example.com/gen<6", "").matches(&body));
        assert!(!sel("example.com/gen>5", "").matches(&body));
        assert!(!sel("app>1", "").matches(&body), "a non-number never compares");
        assert!(sel("app in (db),example.com/gen", "").matches(&body));
    }

    #[test]
    fn field_selectors_compare_the_value_at_a_path() {
        let here = pod(json!({}), Some("node-1"));
        let unscheduled = pod(json!({}), None);
        assert!(sel("", "spec.nodeName=node-1").matches(&here));
        assert!(!sel("", "spec.nodeName=node-1").matches(&unscheduled));
        assert!(
            sel("", "spec.nodeName=").matches(&unscheduled),
            "null is the empty string"
        );
        assert!(sel("", "spec.nodeName!=node-2,metadata.namespace==ns").matches(&here));
        assert!(
            sel("", "spec.replicas=3").matches(&here),
            "numbers in their JSON form"
        );
        assert!(!sel("", "spec.missing=x").matches(&here));
        assert!(sel("app", "spec.nodeName=node-1").matches(&pod(json!({"app": ""}), Some("node-1"))));
    }

    #[test]
    fn field_values_may_escape_separators() {
        let body = json!({"metadata": {"name": "a,b=c"}});
        assert!(sel("", r"metadata.name=a\,b\=c").matches(&body));
        assert!(!sel("", r"metadata.name=a\,b\=d").matches(&body));
    }

    #[test]
    fn malformed_selectors_are_refused_with_the_reason() {
        for (labels, fields) in [
            ("app=db,,x=y", ""),
            ("app in (db", ""),
            ("app in db", ""),
            ("app=db)", ""),
            ("bad key=x", ""),
            ("app=has space", ""),
            ("Example.COM/x=y", ""),
            ("a>b", ""),
            ("-x=y", ""),
            ("", "spec.nodeName"),
            ("", "spec..nodeName=x"),
            ("", "spec.nodeName=x,,"),
        ] {
            let err = ObjectSelector::parse(labels, fields);
            assert!(err.is_err(), "{labels:?} {fields:?} should be refused");
        }
        let err = ObjectSelector::parse("", "spec.nodeName").unwrap_err();
        assert!(err.to_string().contains("key=value"), "{err}");
    }
}
