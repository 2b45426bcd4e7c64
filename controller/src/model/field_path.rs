//! Field paths into JSON objects (`["spec", "size"]` for kopf's `field="spec.size"`): what
//! handlers' `field`s point at in essences, diff-bases and bodies. Only objects are walked;
//! lists are values as a whole, as in kopf's field handling.

use serde_json::{Map, Value};

/// The value at `path`, if present. The empty path is the whole value.
pub fn lookup<'a>(value: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, key| v.as_object()?.get(key))
}

/// Puts `new` at `path`, creating objects on the way (and replacing any non-object in it).
/// The empty path replaces the whole value.
pub fn set(value: &mut Value, path: &[String], new: Value) {
    let Some((last, parents)) = path.split_last() else {
        *value = new;
        return;
    };
    let mut current = value;
    for key in parents {
        if !current.is_object() {
            *current = Value::Object(Map::new());
        }
        let Some(map) = current.as_object_mut() else {
            return;
        };
        current = map
            .entry(key.clone())
            .or_insert_with(|| Value::Object(Map::new()));
    }
    if !current.is_object() {
        *current = Value::Object(Map::new());
    }
    if let Some(map) = current.as_object_mut() {
        map.insert(last.clone(), new);
    }
}

/// Removes what is at `path`, if anything; the empty path removes nothing.
pub fn remove(value: &mut Value, path: &[String]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let parent = parents
        .iter()
        .try_fold(value, |v, key| v.as_object_mut()?.get_mut(key));
    if let Some(map) = parent.and_then(Value::as_object_mut) {
        map.remove(last);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn path(p: &str) -> Vec<String> {
        p.split('.').map(str::to_owned).collect()
    }

    #[test]
    fn set_creates_objects_on_the_way_and_remove_takes_only_the_leaf() {
        let mut v = json!({"spec": 1});
        set(&mut v, &path("spec.a.b"), json!(2));
        assert_eq!(v, json!({"spec": {"a": {"b": 2}}}));
        assert_eq!(lookup(&v, &path("spec.a.b")), Some(&json!(2)));
        assert_eq!(lookup(&v, &path("spec.x")), None);
        remove(&mut v, &path("spec.a.b"));
        assert_eq!(v, json!({"spec": {"a": {}}}));
        remove(&mut v, &path("nothing.here"));
        set(&mut v, &[], json!(null));
        assert_eq!(v, json!(null));
    }
}
