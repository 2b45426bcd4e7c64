//! Property-based fuzzing of the conversion layer (`grpc::convert`): every message a handler
//! process can send, decoded from arbitrary protobuf wire data, goes through the functions
//! that turn it into the controller's model. None may panic, and every rejection must be a
//! [`Diagnostic`] with a reason and a summary, as the protocol promises.
//!
//! The inputs are protobuf wire data built field by field (field numbers, wire types,
//! nested messages, arbitrary scalars, bytes and UTF-8), so that decoding reaches deep into
//! the messages, plus byte-level mutations of realistic messages. The number of cases comes
//! from `PROPTEST_CASES` (256 by default; `scripts/faults.sh --long` raises it), and the
//! seeds of past failures are kept in `tests/fuzz_convert.proptest-regressions` and replayed
//! first.

use capstan::{
    grpc::convert,
    model::{Diagnostic, ResourceRef},
};
use capstan_proto::pb;
use proptest::{prelude::*, test_runner::FileFailurePersistence};
use prost::Message as _;

/// One protobuf field: number, and a value of one of the wire types.
#[derive(Clone, Debug)]
enum Field {
    Varint(u32, u64),
    Fixed64(u32, u64),
    Bytes(u32, Vec<u8>),
    Message(u32, Vec<Field>),
    Fixed32(u32, u32),
}

fn key(out: &mut Vec<u8>, number: u32, wire: u8) {
    prost::encoding::encode_varint((u64::from(number) << 3) | u64::from(wire), out);
}

fn encode(fields: &[Field]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in fields {
        match f {
            Field::Varint(n, v) => {
                key(&mut out, *n, 0);
                prost::encoding::encode_varint(*v, &mut out);
            }
            Field::Fixed64(n, v) => {
                key(&mut out, *n, 1);
                out.extend_from_slice(&v.to_le_bytes());
            }
            Field::Bytes(n, b) => {
                key(&mut out, *n, 2);
                prost::encoding::encode_varint(b.len() as u64, &mut out);
                out.extend_from_slice(b);
            }
            Field::Message(n, inner) => {
                let b = encode(inner);
                key(&mut out, *n, 2);
                prost::encoding::encode_varint(b.len() as u64, &mut out);
                out.extend_from_slice(&b);
            }
            Field::Fixed32(n, v) => {
                key(&mut out, *n, 5);
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    out
}

/// Scalars that tend to find edges: small numbers, enum values just past the known ones,
/// extremes of every width, negative numbers as varints.
fn varint() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..24,
        Just(u64::from(u32::MAX)),
        Just(u64::MAX),
        Just(i64::MIN as u64),
        Just(-1i64 as u64),
        any::<u64>(),
    ]
}

/// Bytes that tend to find edges: text (JSON-ish, paths, names), invalid UTF-8, deep nesting.
fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        any::<String>().prop_map(String::into_bytes),
        "[a-z0-9./_~*!=-]{0,40}".prop_map(String::into_bytes),
        prop::sample::select(vec![
            "{}",
            "[]",
            "null",
            "1e999",
            "-0",
            "\"x\"",
            "{\"a\":{\"b\":[1,2,{\"c\":null}]}}",
            "[{\"op\":\"add\",\"path\":\"/metadata/labels/x\",\"value\":1}]",
            "[{\"op\":\"remove\",\"path\":\"/\"}]",
            "[{\"op\":\"move\",\"from\":\"/a\",\"path\":\"/a/b\"}]",
            "{\"metadata\":{\"finalizers\":null}}",
            "{\"status\":{\"x\":1}}",
            "spec.field",
            "metadata.labels.x",
            "examples",
            "examples.demo.capstan.dev",
            "v1",
        ])
        .prop_map(|s| s.as_bytes().to_vec()),
        (1usize..2000).prop_map(|n| "[".repeat(n).into_bytes()),
        prop::collection::vec(any::<u8>(), 0..64),
    ]
}

fn fields() -> impl Strategy<Value = Vec<Field>> {
    let leaf = prop_oneof![
        (1u32..24, varint()).prop_map(|(n, v)| Field::Varint(n, v)),
        (1u32..24, bytes()).prop_map(|(n, b)| Field::Bytes(n, b)),
        (1u32..24, any::<u64>()).prop_map(|(n, v)| Field::Fixed64(n, v)),
        (1u32..24, any::<u32>()).prop_map(|(n, v)| Field::Fixed32(n, v)),
    ];
    let field = leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            3 => (1u32..24, prop::collection::vec(inner.clone(), 0..8))
                .prop_map(|(n, f)| Field::Message(n, f)),
            1 => inner,
        ]
    });
    prop::collection::vec(field, 0..12)
}

/// Realistic messages to mutate.
fn seeds() -> Vec<Vec<u8>> {
    let registration = pb::HandlerRegistration {
        handler_id: "create_fn".into(),
        kind: pb::HandlerKind::Create as i32,
        resource: Some(pb::ResourceSelector {
            name: "examples".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let result = pb::InvocationResult {
        invocation_id: "i-1".into(),
        outcome: Some(pb::invocation_result::Outcome::Success(pb::Success {
            result: Some(pb::Json {
                json: b"{\"a\":1}".to_vec(),
            }),
            kind_result: None,
        })),
        patches: vec![pb::Patch {
            r#type: pb::PatchType::Merge as i32,
            target: pb::PatchTarget::Object as i32,
            body: Some(pb::Json {
                json: b"{\"metadata\":{\"labels\":{\"a\":\"b\"}}}".to_vec(),
            }),
        }],
        ..Default::default()
    };
    vec![registration.encode_to_vec(), result.encode_to_vec()]
}

fn mutated() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::sample::select(seeds()),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..8),
    )
        .prop_map(|(mut bytes, edits)| {
            for (at, byte, op) in edits {
                if bytes.is_empty() {
                    bytes.push(byte);
                    continue;
                }
                let i = at.index(bytes.len());
                match op {
                    0 => bytes[i] = byte,
                    1 => bytes.insert(i, byte),
                    _ => bytes.truncate(i),
                }
            }
            bytes
        })
}

fn wire() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![3 => fields().prop_map(|f| encode(&f)), 1 => mutated()]
}

fn check_diagnostic(d: &Diagnostic) -> Result<(), TestCaseError> {
    prop_assert!(!d.reason.is_empty(), "a rejection without a reason: {d:?}");
    prop_assert!(!d.summary.is_empty(), "a rejection without a summary: {d:?}");
    Ok(())
}

fn config() -> ProptestConfig {
    ProptestConfig {
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fuzz_convert.proptest-regressions"
        )))),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn registrations_convert_or_are_rejected_with_diagnostics(data in wire(), index in 0usize..10_000) {
        let Ok(reg) = pb::HandlerRegistration::decode(data.as_slice()) else { return Ok(()) };
        if let Err(diagnostics) = convert::registration(index, &reg) {
            prop_assert!(!diagnostics.is_empty(), "rejected without a diagnostic: {reg:?}");
            for d in &diagnostics {
                check_diagnostic(d)?;
            }
        }
    }

    #[test]
    fn results_convert_or_are_rejected_with_diagnostics(data in wire()) {
        let Ok(result) = pb::InvocationResult::decode(data.as_slice()) else { return Ok(()) };
        let (_outcome, problem) = convert::outcome(&result);
        if let Some(d) = problem {
            check_diagnostic(&d)?;
        }
        if let Err(d) = convert::patches(&result.patches) {
            check_diagnostic(&d)?;
        }
    }

    #[test]
    fn every_other_message_converts_without_panicking(data in wire()) {
        if let Ok(log) = pb::LogRecord::decode(data.as_slice()) {
            let object = log.object.as_ref().map_or_else(ResourceRef::default, convert::resource_ref);
            let _ = convert::posting(&log, object);
        }
        if let Ok(r) = pb::ResourceRef::decode(data.as_slice()) {
            let _ = convert::resource_ref(&r);
        }
        if let Ok(d) = pb::Diagnostic::decode(data.as_slice()) {
            let back = convert::diagnostic_to_pb(&convert::diagnostic_from_pb(&d));
            prop_assert_eq!(back.summary, d.summary);
        }
        if let Ok(j) = pb::Json::decode(data.as_slice())
            && let Ok(value) = convert::json(&j)
        {
            // What was accepted survives the way back.
            prop_assert_eq!(convert::json(&convert::to_json(&value)).ok(), Some(value));
        }
        if let Ok(request) = pb::ConnectRequest::decode(data.as_slice()) {
            match request.message {
                Some(pb::connect_request::Message::Hello(hello)) => {
                    for (i, reg) in hello.handlers.iter().enumerate() {
                        if let Err(ds) = convert::registration(i, reg) {
                            prop_assert!(!ds.is_empty());
                            for d in &ds {
                                check_diagnostic(d)?;
                            }
                        }
                    }
                }
                Some(pb::connect_request::Message::Result(result)) => {
                    let _ = convert::outcome(&result);
                    let _ = convert::patches(&result.patches);
                }
                Some(pb::connect_request::Message::Update(update)) => {
                    let _ = convert::patches(&update.patches);
                }
                _ => {}
            }
        }
    }
}
