//! Structural differences between two essences, as kopf computes them: objects are compared
//! key by key, recursively; everything else (lists included) is compared as a whole value.

use serde_json::Value;

use crate::model::{DiffItem, DiffOperation};

/// The differences from `old` to `new` (either may be absent), in key order.
pub fn diff(old: Option<&Value>, new: Option<&Value>) -> Vec<DiffItem> {
    let mut out = Vec::new();
    walk(&mut Vec::new(), old, new, &mut out);
    out
}

fn walk(path: &mut Vec<String>, old: Option<&Value>, new: Option<&Value>, out: &mut Vec<DiffItem>) {
    match (old, new) {
        (None, None) => {}
        (Some(Value::Object(a)), Some(Value::Object(b))) => {
            let mut keys: Vec<&String> = a.keys().chain(b.keys().filter(|k| !a.contains_key(*k))).collect();
            keys.sort();
            for key in keys {
                path.push(key.clone());
                walk(path, a.get(key), b.get(key), out);
                path.pop();
            }
        }
        (Some(a), Some(b)) if a == b => {}
        (None, Some(b)) => out.push(DiffItem {
            operation: DiffOperation::Add,
            path: path.clone(),
            old: None,
            new: Some(b.clone()),
        }),
        (Some(a), None) => out.push(DiffItem {
            operation: DiffOperation::Remove,
            path: path.clone(),
            old: Some(a.clone()),
            new: None,
        }),
        (Some(a), Some(b)) => out.push(DiffItem {
            operation: DiffOperation::Change,
            path: path.clone(),
            old: Some(a.clone()),
            new: Some(b.clone()),
        }),
    }
}

/// The diff items under `field`, with paths made relative to it (what field handlers get).
pub fn reduce(items: &[DiffItem], field: &[String]) -> Vec<DiffItem> {
    items
        .iter()
        .filter_map(|item| {
            if item.path.starts_with(field) {
                Some(DiffItem {
                    path: item.path[field.len()..].to_vec(),
                    ..item.clone()
                })
            } else if field.starts_with(&item.path) {
                // A whole parent changed: narrow its values down to the field.
                let rest = &field[item.path.len()..];
                let old = item
                    .old
                    .as_ref()
                    .and_then(|v| super::essence::lookup(v, rest))
                    .cloned();
                let new = item
                    .new
                    .as_ref()
                    .and_then(|v| super::essence::lookup(v, rest))
                    .cloned();
                let operation = match (&old, &new) {
                    (None, None) => return None,
                    (a, b) if a == b => return None,
                    (None, Some(_)) => DiffOperation::Add,
                    (Some(_), None) => DiffOperation::Remove,
                    _ => DiffOperation::Change,
                };
                Some(DiffItem {
                    operation,
                    path: Vec::new(),
                    old,
                    new,
                })
            } else {
                None
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn diffs_objects_recursively_and_lists_whole() {
        let old = json!({"spec": {"a": 1, "b": [1, 2], "c": "x"}});
        let new = json!({"spec": {"a": 2, "b": [1, 2, 3], "d": true}});
        let items = diff(Some(&old), Some(&new));
        let summary: Vec<(DiffOperation, String)> =
            items.iter().map(|i| (i.operation, i.path.join("."))).collect();
        assert_eq!(
            summary,
            vec![
                (DiffOperation::Change, "spec.a".into()),
                (DiffOperation::Change, "spec.b".into()),
                (DiffOperation::Remove, "spec.c".into()),
                (DiffOperation::Add, "spec.d".into()),
            ]
        );
        assert!(diff(Some(&old), Some(&old)).is_empty());
        assert_eq!(diff(None, Some(&new))[0].operation, DiffOperation::Add);
    }

    #[test]
    fn reduces_to_a_field() {
        let items = diff(
            Some(&json!({"spec": {"a": 1}})),
            Some(&json!({"spec": {"a": 2, "b": 1}})),
        );
        let reduced = reduce(&items, &["spec".to_owned(), "a".to_owned()]);
        assert_eq!(reduced.len(), 1);
        assert!(reduced[0].path.is_empty());
        let whole = diff(None, Some(&json!({"spec": {"a": 2}})));
        let reduced = reduce(&whole, &["spec".to_owned(), "a".to_owned()]);
        assert_eq!(reduced[0].new, Some(json!(2)));
    }
}
