//! Which handlers apply to an object and a cause: the registration's label and field selectors,
//! declarative filters (labels, annotations, field values, old/new) and kopf's selection rules
//! for change handlers.
//!
//! "Prematching" is everything but the field-change checks; it decides whether an object needs
//! our finalizer at all.

use serde_json::Value;

use super::{causes::Cause, essence::lookup};
use crate::model::{ChangeReason, HandlerKind, KindOptions, Registration};

/// The states a filter may look at.
#[derive(Clone, Copy, Debug)]
pub struct Subject<'a> {
    /// The current body.
    pub body: &'a Value,
    /// The old essence (diff-base), for change causes.
    pub old: Option<&'a Value>,
    /// The new essence, for change causes.
    pub new: Option<&'a Value>,
}

/// Whether labels, annotations and the field value match (no change checks).
pub fn prematch(reg: &Registration, s: Subject<'_>) -> bool {
    let f = &reg.filters;
    if !f.selector.matches(s.body) {
        return false;
    }
    let meta = |kind: &str, key: &str| -> Option<String> {
        s.body
            .pointer(&format!("/metadata/{kind}"))?
            .get(key)?
            .as_str()
            .map(str::to_owned)
    };
    if !f
        .labels
        .iter()
        .all(|(k, m)| m.matches(meta("labels", k).as_deref()))
    {
        return false;
    }
    if !f
        .annotations
        .iter()
        .all(|(k, m)| m.matches(meta("annotations", k).as_deref()))
    {
        return false;
    }
    if let Some(value) = &f.value {
        let matched = if s.old.is_some() || s.new.is_some() {
            value.matches(s.old.and_then(|o| lookup(o, &f.field)))
                || value.matches(s.new.and_then(|n| lookup(n, &f.field)))
        } else {
            value.matches(lookup(s.body, &f.field))
        };
        if !matched {
            return false;
        }
    }
    true
}

/// Whether the old/new conditions hold and, where kopf requires it, the field changed.
fn change_matches(reg: &Registration, s: Subject<'_>) -> bool {
    let f = &reg.filters;
    if f.field.is_empty() {
        return true;
    }
    let old = s.old.and_then(|o| lookup(o, &f.field));
    let new = s.new.and_then(|n| lookup(n, &f.field));
    if f.old.as_ref().is_some_and(|m| !m.matches(old)) || f.new.as_ref().is_some_and(|m| !m.matches(new)) {
        return false;
    }
    let needs_change = matches!(reg.kind, HandlerKind::Field | HandlerKind::Update);
    !needs_change || old != new
}

/// The change handlers to run for `cause`, in registration order.
pub fn select<'a>(
    handlers: &'a [Registration],
    cause: Cause,
    initial: bool,
    s: Subject<'_>,
) -> Vec<&'a Registration> {
    let Some(reason) = cause.reason() else {
        return Vec::new();
    };
    handlers
        .iter()
        .filter(|h| match h.kind {
            HandlerKind::Create => reason == ChangeReason::Create,
            HandlerKind::Update => reason == ChangeReason::Update,
            HandlerKind::Delete => reason == ChangeReason::Delete,
            HandlerKind::Resume => {
                initial
                    && reason != ChangeReason::Create
                    && (reason != ChangeReason::Delete
                        || matches!(h.options, KindOptions::Resume { deleted: true }))
            }
            HandlerKind::Field => reason != ChangeReason::Delete,
            _ => false,
        })
        .filter(|h| prematch(h, s) && change_matches(h, s))
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::model::{MetaMatch, ValueMatch};

    fn reg(id: &str, kind: HandlerKind) -> Registration {
        Registration::new(id, kind, None)
    }

    #[test]
    fn label_and_annotation_filters() {
        let mut r = reg("a", HandlerKind::Create);
        r.filters
            .labels
            .insert("app".into(), MetaMatch::Equals("db".into()));
        r.filters.annotations.insert("skip".into(), MetaMatch::Absent);
        let body = json!({"metadata": {"labels": {"app": "db"}}});
        assert!(prematch(
            &r,
            Subject {
                body: &body,
                old: None,
                new: None
            }
        ));
        let body = json!({"metadata": {"labels": {"app": "db"}, "annotations": {"skip": "1"}}});
        assert!(!prematch(
            &r,
            Subject {
                body: &body,
                old: None,
                new: None
            }
        ));
    }

    #[test]
    fn field_handlers_need_a_change_and_respect_old_new() {
        let mut r = reg("f/spec.size", HandlerKind::Field);
        r.filters.field = vec!["spec".into(), "size".into()];
        let old = json!({"spec": {"size": 1}});
        let new = json!({"spec": {"size": 2}});
        let s = Subject {
            body: &new,
            old: Some(&old),
            new: Some(&new),
        };
        let handlers = [r.clone()];
        assert_eq!(select(&handlers, Cause::Update, false, s).len(), 1);
        assert_eq!(
            select(&handlers, Cause::Update, false, Subject { old: Some(&new), ..s }).len(),
            0
        );
        r.filters.new = Some(ValueMatch::Equals(json!(3)));
        assert_eq!(select(&[r], Cause::Update, false, s).len(), 0);
    }

    #[test]
    fn resume_handlers_only_when_initial_and_not_on_create() {
        let handlers = [
            reg("c", HandlerKind::Create),
            reg("r", HandlerKind::Resume),
            reg("u", HandlerKind::Update),
        ];
        let body = json!({});
        let s = Subject {
            body: &body,
            old: None,
            new: None,
        };
        let ids = |c, i| {
            select(&handlers, c, i, s)
                .iter()
                .map(|h| h.id.0.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(Cause::Create, true), ["c"]);
        assert_eq!(ids(Cause::Resume, true), ["r"]);
        assert_eq!(ids(Cause::Update, true), ["r", "u"]);
        assert_eq!(ids(Cause::Update, false), ["u"]);
        assert!(ids(Cause::Delete, true).is_empty());
    }
}
