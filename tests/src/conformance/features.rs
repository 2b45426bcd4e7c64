//! The fixed handler set of a conformance handler, by feature, and the invocations the runner
//! makes of it: what `tests/conformance/README.md` documents, in one place for the runner.

use serde_json::{Map, Value, json};

/// A feature an SDK may claim, and the handlers it registers for it.
pub struct Feature {
    /// Its name in profiles and cases.
    pub name: &'static str,
    /// Ids of the handlers a conformance handler registers for it.
    pub handlers: &'static [&'static str],
}

/// Every feature.
pub const FEATURES: &[Feature] = &[
    Feature {
        name: "change",
        handlers: &["create", "update", "delete", "resume"],
    },
    Feature {
        name: "field",
        handlers: &["field/spec.watched"],
    },
    Feature {
        name: "event",
        handlers: &["event"],
    },
    Feature {
        name: "daemon",
        handlers: &["daemon"],
    },
    Feature {
        name: "timer",
        handlers: &["timer"],
    },
    Feature {
        name: "index",
        handlers: &["index"],
    },
    Feature {
        name: "admission",
        handlers: &["validate", "mutate"],
    },
    Feature {
        name: "sdk_filters",
        handlers: &["when"],
    },
    Feature {
        name: "activities",
        handlers: &["startup", "cleanup", "login"],
    },
    Feature {
        name: "probe",
        handlers: &["probe"],
    },
    Feature {
        name: "subhandlers",
        handlers: &[],
    },
    Feature {
        name: "object_updates",
        handlers: &[],
    },
    Feature {
        name: "result_ack",
        handlers: &[],
    },
    Feature {
        name: "cleanup_on_goodbye",
        handlers: &[],
    },
    Feature {
        name: "tcp",
        handlers: &[],
    },
    Feature {
        name: "flow_control",
        handlers: &[],
    },
    Feature {
        name: "message_limit",
        handlers: &[],
    },
    Feature {
        name: "invocation_updates",
        handlers: &[],
    },
    Feature {
        name: "process_settings",
        handlers: &[],
    },
    Feature {
        name: "deferred_subhandlers",
        handlers: &[],
    },
    Feature {
        name: "attempt_details",
        handlers: &[],
    },
];

/// The group, version and plural of the resource of every resource handler.
pub const GROUP: &str = "conformance.capstan.dev";
/// See [`GROUP`].
pub const VERSION: &str = "v1";
/// See [`GROUP`].
pub const PLURAL: &str = "widgets";
/// The namespace of the objects the runner makes up.
pub const NAMESPACE: &str = "conformance";

/// The handler ids registered for these features.
pub fn handlers_of<'a>(features: impl IntoIterator<Item = &'a String>) -> Vec<&'static str> {
    let mut ids: Vec<&'static str> = features
        .into_iter()
        .filter_map(|name| FEATURES.iter().find(|feature| feature.name == name))
        .flat_map(|feature| feature.handlers.iter().copied())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Whether a handler of the fixed set has an object (all but the activities and the probe).
pub fn has_object(handler: &str) -> bool {
    !matches!(handler, "startup" | "cleanup" | "login" | "probe")
}

/// What the controller resolves a registration of this handler to.
pub fn resolved_resource(handler: &str) -> Value {
    if has_object(handler) {
        json!({"group": GROUP, "version": VERSION, "plural": PLURAL, "kind": "Widget", "namespaced": true})
    } else {
        Value::Null
    }
}

/// A Widget named `name` whose `spec` is `spec`.
pub fn widget(name: &str, uid: &str, spec: Value, labels: Value) -> Value {
    json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": "Widget",
        "metadata": {
            "name": name, "namespace": NAMESPACE, "uid": uid,
            "resourceVersion": "1", "generation": 1, "labels": labels,
        },
        "spec": spec,
    })
}

/// The invocation `invoke` sends, written as a case writes messages (see the README). Keys that
/// are fields of `Invocation` replace what is made up.
pub fn invocation(options: &Map<String, Value>, now: &str) -> Result<Value, String> {
    let mut options = options.clone();
    let id = take_string(&mut options, "id")?.ok_or("invoke needs an id")?;
    let handler = take_string(&mut options, "handler")?.ok_or("invoke needs a handler")?;
    let script = options.remove("script");
    let extra_spec = options.remove("spec");
    let labels = options.remove("labels").unwrap_or_else(|| json!({}));
    let name = take_string(&mut options, "object")?.unwrap_or_else(|| format!("w-{id}"));
    let pad = options
        .remove("pad")
        .and_then(|pad| pad.as_u64())
        .map(|bytes| "x".repeat(usize::try_from(bytes).unwrap_or(0)));
    let mut invocation = json!({
        "invocation_id": id,
        "handler_id": handler,
        "attempt": 1,
        "idempotency_key": format!("key-{id}"),
        "started_time": now,
        "trace_context": {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    });
    if has_object(&handler) {
        let mut spec = Map::new();
        if let Some(script) = script {
            spec.insert("script".into(), script);
        }
        if let Some(Value::Object(extra)) = extra_spec {
            spec.extend(extra);
        }
        if let Some(padding) = pad {
            spec.insert("padding".into(), Value::String(padding));
        }
        let spec = Value::Object(spec);
        let uid = format!("uid-{name}");
        invocation["resource"] = json!({
            "group": GROUP, "version": VERSION, "kind": "Widget", "plural": PLURAL,
            "namespace": NAMESPACE, "name": name, "uid": uid, "resource_version": "1", "generation": 1,
        });
        let body = widget(&name, &uid, spec.clone(), labels.clone());
        invocation["body"] = json!({"$json": body});
        let essence = json!({"metadata": {"labels": labels}, "spec": spec});
        let created = json!({"reason": "CHANGE_REASON_CREATE", "new": {"$json": essence},
            "diff": [{"operation": "DIFF_OPERATION_ADD", "path": [], "new": {"$json": essence}}]});
        match handler.as_str() {
            "create" | "when" => invocation["change"] = created,
            "update" => {
                invocation["change"] = json!({"reason": "CHANGE_REASON_UPDATE",
                "old": {"$json": {"metadata": {"labels": labels}, "spec": {}}}, "new": {"$json": essence},
                "diff": [{"operation": "DIFF_OPERATION_ADD", "path": ["spec", "script"], "new": {"$json": spec["script"]}}]})
            }
            "delete" => {
                invocation["change"] = json!({"reason": "CHANGE_REASON_DELETE", "old": {"$json": essence}})
            }
            "resume" => {
                invocation["change"] = json!({"reason": "CHANGE_REASON_RESUME", "new": {"$json": essence}})
            }
            "field/spec.watched" => {
                invocation["change"] = json!({"reason": "CHANGE_REASON_UPDATE", "field": "spec.watched",
                "old": {"$json": null}, "new": {"$json": spec.get("watched").cloned().unwrap_or(Value::Null)},
                "diff": [{"operation": "DIFF_OPERATION_ADD", "path": [],
                    "new": {"$json": spec.get("watched").cloned().unwrap_or(Value::Null)}}]})
            }
            "event" => invocation["event"] = json!({"type": "EVENT_TYPE_ADDED"}),
            "daemon" => invocation["daemon"] = json!({"restarts": 0}),
            "timer" => invocation["timer"] = json!({"scheduled_time": now}),
            "index" => invocation["index"] = json!({"deleted": false}),
            "validate" | "mutate" => {
                invocation["admission"] = json!({"uid": format!("review-{id}"), "operation": "CREATE",
                    "user_info": {"$json": {"username": "conformance"}}});
            }
            _ => {}
        }
        if handler == "create" {
            invocation["param"] = json!({"$json": {"p": 1}});
        }
    } else if handler == "probe" {
        invocation["probe"] = json!({});
    } else {
        let activity = match handler.as_str() {
            "startup" => "ACTIVITY_STARTUP",
            "cleanup" => "ACTIVITY_CLEANUP",
            "login" => "ACTIVITY_LOGIN",
            _ => "ACTIVITY_UNSPECIFIED",
        };
        invocation["activity"] = json!({"activity": activity});
    }
    // Payload keys given replace the made-up payload (an invocation has exactly one).
    const PAYLOADS: [&str; 8] = [
        "change",
        "event",
        "daemon",
        "timer",
        "index",
        "admission",
        "probe",
        "activity",
    ];
    if let (Some(given), Value::Object(made)) = (
        PAYLOADS.iter().find(|key| options.contains_key(**key)),
        &mut invocation,
    ) {
        for payload in PAYLOADS {
            if payload != *given {
                made.remove(payload);
            }
        }
    }
    if let Value::Object(made) = &mut invocation {
        made.extend(options);
    }
    Ok(invocation)
}

fn take_string(options: &mut Map<String, Value>, key: &str) -> Result<Option<String>, String> {
    match options.remove(key) {
        None => Ok(None),
        Some(Value::String(text)) => Ok(Some(text)),
        Some(other) => Err(format!("{key} is a string: {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_invocation_of_a_create_handler_carries_its_object_and_script() {
        let options = json!({"id": "i1", "handler": "create", "script": [{"return": 1}], "attempt": 2});
        let made = invocation(options.as_object().expect("an object"), "2026-01-01T00:00:00Z").expect("made");
        assert_eq!(made["attempt"], json!(2));
        assert_eq!(made["body"]["$json"]["spec"]["script"], json!([{"return": 1}]));
        assert_eq!(made["change"]["reason"], json!("CHANGE_REASON_CREATE"));
        assert_eq!(made["param"], json!({"$json": {"p": 1}}));
        crate::conformance::wire::encode_response(&json!({"invocation": made})).expect("a valid invocation");
    }

    #[test]
    fn a_given_payload_replaces_the_made_up_one() {
        let options = json!({"id": "i1", "handler": "create", "event": {"type": "EVENT_TYPE_MODIFIED"}});
        let made = invocation(options.as_object().expect("an object"), "2026-01-01T00:00:00Z").expect("made");
        assert!(made.get("change").is_none());
        assert_eq!(made["event"]["type"], json!("EVENT_TYPE_MODIFIED"));
    }

    #[test]
    fn every_handler_of_every_feature_makes_a_valid_invocation() {
        for feature in FEATURES {
            for handler in feature.handlers {
                let options = json!({"id": "i1", "handler": handler});
                let made = invocation(options.as_object().expect("an object"), "2026-01-01T00:00:00Z")
                    .expect("made");
                crate::conformance::wire::encode_response(&json!({"invocation": made}))
                    .unwrap_or_else(|error| panic!("{handler}: {error:#}"));
            }
        }
    }
}
