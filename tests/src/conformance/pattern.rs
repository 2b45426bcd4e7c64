//! Patterns: what a case expects of a message, as a subset of it with a few matchers.
//!
//! A pattern names only what a case is about, so that an SDK is free in everything else (the
//! order of its log records, the diagnostics it adds, the fields of a newer protocol revision).
//! Every object key of a pattern must be present and match; arrays match element by element;
//! an object with one `$`-key is a matcher.

use std::fmt::Write as _;

use serde_json::Value;

use super::wire::JSON_KEY;

/// Checks `actual` against `pattern`; the error names the first path that differs.
pub fn check(pattern: &Value, actual: &Value) -> Result<(), String> {
    check_at(pattern, Some(actual), "")
}

fn check_at(pattern: &Value, actual: Option<&Value>, path: &str) -> Result<(), String> {
    if let Some(matchers) = matchers(pattern) {
        return matchers
            .into_iter()
            .try_for_each(|(name, argument)| check_matcher(name, argument, actual, path));
    }
    let Some(actual) = actual else {
        return Err(format!("{}: absent, expected {pattern}", show(path)));
    };
    match (pattern, actual) {
        (Value::Object(expected), Value::Object(got)) => {
            for (key, value) in expected {
                check_at(value, got.get(key), &format!("{path}.{key}"))?;
            }
            Ok(())
        }
        (Value::Array(expected), Value::Array(got)) => {
            if expected.len() != got.len() {
                return Err(format!(
                    "{}: {} elements, expected {}: {actual}",
                    show(path),
                    got.len(),
                    expected.len()
                ));
            }
            for (index, (value, item)) in expected.iter().zip(got).enumerate() {
                check_at(value, Some(item), &format!("{path}[{index}]"))?;
            }
            Ok(())
        }
        (Value::Number(expected), Value::Number(got)) if expected.as_f64() == got.as_f64() => Ok(()),
        (expected, got) if expected == got => Ok(()),
        (expected, got) => Err(format!("{}: {got}, expected {expected}", show(path))),
    }
}

/// An object whose keys all start with `$` is matchers, all of which must hold.
fn matchers(pattern: &Value) -> Option<Vec<(&str, &Value)>> {
    let map = pattern.as_object()?;
    if map.is_empty() || !map.keys().all(|key| key.starts_with('$')) {
        return None;
    }
    Some(
        map.iter()
            .map(|(name, argument)| (name.as_str(), argument))
            .collect(),
    )
}

fn check_matcher(name: &str, argument: &Value, actual: Option<&Value>, path: &str) -> Result<(), String> {
    let present = actual.filter(|value| !value.is_null());
    match name {
        "$absent" => match present {
            Some(value) if argument.as_bool() != Some(false) => {
                Err(format!("{}: {value}, expected nothing", show(path)))
            }
            None if argument.as_bool() == Some(false) => Err(format!("{}: absent", show(path))),
            _ => Ok(()),
        },
        "$any" => present
            .map(|_| ())
            .ok_or_else(|| format!("{}: absent, expected a value", show(path))),
        "$json" => {
            let inner = present.and_then(|value| value.get(JSON_KEY));
            match (inner, present.and_then(|value| value.get("$json_text"))) {
                (Some(inner), _) => check_at(argument, Some(inner), &format!("{path}(json)")),
                (None, Some(text)) => Err(format!("{}: not JSON: {text}", show(path))),
                (None, None) => Err(format!(
                    "{}: {}, expected a Json value",
                    show(path),
                    shown(present)
                )),
            }
        }
        "$regex" => {
            let pattern = argument.as_str().unwrap_or_default();
            let text = present.and_then(Value::as_str);
            match text {
                Some(text) if regex::Regex::new(pattern).is_ok_and(|regex| regex.is_match(text)) => Ok(()),
                _ => Err(format!(
                    "{}: {}, expected to match /{pattern}/",
                    show(path),
                    shown(present)
                )),
            }
        }
        "$contains" => {
            let Some(items) = present.and_then(Value::as_array) else {
                return Err(format!("{}: {}, expected an array", show(path), shown(present)));
            };
            for wanted in argument.as_array().map(Vec::as_slice).unwrap_or_default() {
                if !items.iter().any(|item| check(wanted, item).is_ok()) {
                    return Err(format!(
                        "{}: no element matches {wanted}: {}",
                        show(path),
                        shown(present)
                    ));
                }
            }
            Ok(())
        }
        "$len" => {
            let length = present.and_then(Value::as_array).map(Vec::len);
            if length.is_some_and(|length| Some(length as u64) == argument.as_u64()) {
                Ok(())
            } else {
                Err(format!(
                    "{}: {}, expected {argument} elements",
                    show(path),
                    shown(present)
                ))
            }
        }
        "$gte" | "$lte" => {
            let (Some(got), Some(bound)) = (present.and_then(number), number(argument)) else {
                return Err(format!(
                    "{}: {}, expected a number {name} {argument}",
                    show(path),
                    shown(present)
                ));
            };
            let holds = if name == "$gte" {
                got >= bound
            } else {
                got <= bound
            };
            if holds {
                Ok(())
            } else {
                Err(format!("{}: {got}, expected {name} {bound}", show(path)))
            }
        }
        "$one_of" => {
            let options = argument.as_array().map(Vec::as_slice).unwrap_or_default();
            let mut reasons = String::new();
            for option in options {
                match check_at(option, actual, path) {
                    Ok(()) => return Ok(()),
                    Err(reason) => {
                        let _ = write!(reasons, "; {reason}");
                    }
                }
            }
            Err(format!("{}: matches none of {argument}{reasons}", show(path)))
        }
        "$not" => match check_at(argument, actual, path) {
            Ok(()) => Err(format!(
                "{}: {}, expected not {argument}",
                show(path),
                shown(present)
            )),
            Err(_) => Ok(()),
        },
        other => Err(format!("{}: unknown matcher {other}", show(path))),
    }
}

/// A number, or a duration of protobuf's JSON form (`"1.5s"`) in seconds.
fn number(value: &Value) -> Option<f64> {
    match value {
        Value::Number(number) => number.as_f64(),
        Value::String(text) => text.strip_suffix('s').unwrap_or(text).parse().ok(),
        _ => None,
    }
}

/// Lists the matchers a pattern uses that the runner does not know, for checking cases early.
pub fn unknown_matchers(pattern: &Value) -> Vec<String> {
    const KNOWN: [&str; 11] = [
        "$absent",
        "$any",
        "$json",
        "$regex",
        "$contains",
        "$len",
        "$gte",
        "$lte",
        "$one_of",
        "$not",
        "$json_text",
    ];
    let mut found = Vec::new();
    let mut stack = vec![pattern];
    while let Some(value) = stack.pop() {
        match value {
            Value::Object(map) => {
                let dollars = map.keys().filter(|key| key.starts_with('$')).count();
                if dollars > 0 && dollars < map.len() {
                    found.push(format!("matchers beside fields in {value}"));
                }
                for (key, inner) in map {
                    if key.starts_with('$') && !KNOWN.contains(&key.as_str()) {
                        found.push(key.clone());
                    }
                    stack.push(inner);
                }
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    found
}

fn show(path: &str) -> &str {
    if path.is_empty() {
        "the message"
    } else {
        path.trim_start_matches('.')
    }
}

fn shown(value: Option<&Value>) -> String {
    value.map_or_else(|| "absent".to_owned(), ToString::to_string)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_pattern_is_a_subset_and_names_the_path_that_differs() {
        let actual = json!({"result": {"invocation_id": "i1", "success": {"result": {"$json": {"a": 1, "b": 2}}}, "patches": []}});
        assert!(
            check(
                &json!({"result": {"success": {"result": {"$json": {"a": 1}}}}}),
                &actual
            )
            .is_ok()
        );
        let error = check(
            &json!({"result": {"success": {"result": {"$json": {"a": 2}}}}}),
            &actual,
        )
        .expect_err("differs");
        assert!(
            error.contains("result.success.result(json).a: 1, expected 2"),
            "{error}"
        );
        assert!(check(&json!({"result": {"temporary_error": {}}}), &actual).is_err());
        assert!(
            check(
                &json!({"result": {"temporary_error": {"$absent": true}}}),
                &actual
            )
            .is_ok()
        );
    }

    #[test]
    fn matchers_work_on_arrays_strings_numbers_and_durations() {
        let actual =
            json!({"list": [{"id": "a"}, {"id": "b"}], "text": "retry in 5s", "took": "1.500s", "n": 3});
        assert!(check(&json!({"list": {"$contains": [{"id": "b"}]}}), &actual).is_ok());
        assert!(check(&json!({"list": {"$contains": [{"id": "c"}]}}), &actual).is_err());
        assert!(check(&json!({"list": {"$len": 2}}), &actual).is_ok());
        assert!(check(&json!({"list": [{"id": "a"}]}), &actual).is_err());
        assert!(check(&json!({"text": {"$regex": "^retry in \\d+s$"}}), &actual).is_ok());
        assert!(check(&json!({"took": {"$gte": 1.5}, "n": {"$lte": 3}}), &actual).is_ok());
        assert!(check(&json!({"took": {"$lte": "1s"}}), &actual).is_err());
        assert!(check(&json!({"took": {"$gte": 1, "$lte": 2}}), &actual).is_ok());
        assert!(check(&json!({"took": {"$gte": 1, "$lte": 1.2}}), &actual).is_err());
        assert!(check(&json!({"n": {"$one_of": [1, 3]}}), &actual).is_ok());
        assert!(check(&json!({"n": {"$not": 3}}), &actual).is_err());
        assert!(check(&json!({"missing": {"$any": true}}), &actual).is_err());
    }

    #[test]
    fn unknown_matchers_are_found() {
        assert_eq!(
            unknown_matchers(&json!({"a": [{"$regexp": "x"}], "b": {"$json": 1}})),
            vec!["$regexp"]
        );
    }
}
