//! Messages as the cases write them: protobuf's JSON form with the `.proto` files' field names,
//! and every `Json` message as `{"$json": value}` rather than base64 of its text.
//!
//! The runner works on the wire with bytes and on the cases with JSON, through the protocol's
//! descriptors (`prost-reflect`): a case can then name any field of any message, including
//! fields a typed client would fill in for it, and the runner sees exactly what an SDK sent
//! (defaults included), not what a typed decoder made of it.

use std::sync::LazyLock;

use anyhow::{Context as _, Result, anyhow};
use base64::Engine as _;
use capstan_proto::pb::FILE_DESCRIPTOR_SET;
use prost::Message as _;
use prost_reflect::{
    DescriptorPool, DeserializeOptions, DynamicMessage, MessageDescriptor, SerializeOptions,
};
use serde_json::{Map, Value};

/// The key that stands for a `Json` message in cases.
pub const JSON_KEY: &str = "$json";

static POOL: LazyLock<Result<DescriptorPool, String>> =
    LazyLock::new(|| DescriptorPool::decode(FILE_DESCRIPTOR_SET).map_err(|error| error.to_string()));

fn descriptor(name: &str) -> Result<MessageDescriptor> {
    let pool = POOL
        .as_ref()
        .map_err(|error| anyhow!("the protocol's descriptors: {error}"))?;
    pool.get_message_by_name(name)
        .ok_or_else(|| anyhow!("no message {name} in the protocol"))
}

/// Encodes a `ConnectResponse` written as a case writes it.
pub fn encode_response(message: &Value) -> Result<Vec<u8>> {
    encode("capstan.v1.ConnectResponse", message)
}

/// Encodes the message `name` written as a case writes it.
pub fn encode(name: &str, message: &Value) -> Result<Vec<u8>> {
    let wire = to_wire_json(message);
    let dynamic = DynamicMessage::deserialize_with_options(
        descriptor(name)?,
        &wire,
        &DeserializeOptions::new().deny_unknown_fields(true),
    )
    .with_context(|| format!("not a {name}: {message}"))?;
    Ok(dynamic.encode_to_vec())
}

/// Decodes a `ConnectRequest` into the form patterns match: every field present (defaults
/// included), enums by name, `Json` messages as `{"$json": value}`.
pub fn decode_request(bytes: &[u8]) -> Result<Value> {
    let dynamic = DynamicMessage::decode(descriptor("capstan.v1.ConnectRequest")?, bytes)
        .context("not a capstan.v1.ConnectRequest")?;
    let options = SerializeOptions::new()
        .skip_default_fields(false)
        .use_proto_field_name(true)
        .stringify_64_bit_integers(false);
    let value = dynamic
        .serialize_with_options(serde_json::value::Serializer, &options)
        .context("a ConnectRequest as JSON")?;
    Ok(from_wire_json(value))
}

/// `{"$json": v}` → `{"json": base64(text of v)}`, everywhere in `value`.
fn to_wire_json(value: &Value) -> Value {
    match value {
        Value::Object(map) if map.len() == 1 && map.contains_key(JSON_KEY) => {
            let text = serde_json::to_vec(&map[JSON_KEY]).unwrap_or_default();
            let mut wire = Map::new();
            wire.insert(
                "json".into(),
                Value::String(base64::engine::general_purpose::STANDARD.encode(text)),
            );
            Value::Object(wire)
        }
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(key, value)| (key.clone(), to_wire_json(value)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(to_wire_json).collect()),
        other => other.clone(),
    }
}

/// `{"json": base64}` → `{"$json": value}` (or `{"$json_text": text}` when the text is no JSON),
/// everywhere in `value`. Only `Json` messages have the single field `json`.
fn from_wire_json(value: Value) -> Value {
    match value {
        Value::Object(map) if map.len() == 1 && map.get("json").is_some_and(Value::is_string) => {
            let encoded = map.get("json").and_then(Value::as_str).unwrap_or_default();
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .unwrap_or_default();
            let mut out = Map::new();
            match serde_json::from_slice::<Value>(&bytes) {
                Ok(parsed) => out.insert(JSON_KEY.into(), parsed),
                Err(_) => out.insert(
                    "$json_text".into(),
                    Value::String(String::from_utf8_lossy(&bytes).into_owned()),
                ),
            };
            Value::Object(out)
        }
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(key, value)| (key, from_wire_json(value)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(from_wire_json).collect()),
        other => other,
    }
}

/// The kind of a `ConnectRequest` as decoded: the name of its set `oneof` field.
pub fn kind_of(message: &Value) -> Option<&str> {
    message.as_object()?.keys().next().map(String::as_str)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_response_written_with_json_values_encodes_as_the_typed_message() {
        let bytes = encode_response(&json!({"invocation": {
            "invocation_id": "i1", "handler_id": "create", "attempt": 2,
            "body": {"$json": {"spec": {"a": 1}}},
            "change": {"reason": "CHANGE_REASON_UPDATE"},
        }}))
        .expect("encodes");
        let typed = capstan_proto::pb::ConnectResponse::decode(bytes.as_slice()).expect("decodes");
        let Some(capstan_proto::pb::connect_response::Message::Invocation(invocation)) = typed.message else {
            panic!("not an invocation: {typed:?}");
        };
        assert_eq!(invocation.attempt, 2);
        let body: Value = serde_json::from_slice(&invocation.body.expect("a body").json).expect("JSON");
        assert_eq!(body, json!({"spec": {"a": 1}}));
    }

    #[test]
    fn a_request_decodes_with_defaults_enum_names_and_json_values() {
        use capstan_proto::pb;
        let request = pb::ConnectRequest {
            message: Some(pb::connect_request::Message::Result(pb::InvocationResult {
                invocation_id: "i1".into(),
                outcome: Some(pb::invocation_result::Outcome::Success(pb::Success {
                    result: Some(pb::Json {
                        json: b"{\"a\":1}".to_vec(),
                    }),
                    kind_result: None,
                })),
                patches: vec![pb::Patch {
                    r#type: pb::PatchType::Merge.into(),
                    target: 0,
                    body: None,
                }],
                ..Default::default()
            })),
        };
        let value = decode_request(&request.encode_to_vec()).expect("decodes");
        assert_eq!(kind_of(&value), Some("result"));
        assert_eq!(value["result"]["success"]["result"], json!({"$json": {"a": 1}}));
        assert_eq!(value["result"]["patches"][0]["type"], json!("PATCH_TYPE_MERGE"));
        assert_eq!(
            value["result"]["patches"][0]["target"],
            json!("PATCH_TARGET_UNSPECIFIED")
        );
    }

    #[test]
    fn an_unknown_field_in_a_case_is_an_error() {
        let error = encode_response(&json!({"ping": {"nonce": 1, "typo": 2}})).expect_err("refused");
        assert!(format!("{error:#}").contains("typo"), "{error:#}");
    }
}
