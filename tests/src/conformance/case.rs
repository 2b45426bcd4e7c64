//! Cases as data: what a case file holds, read and checked before anything runs.
//!
//! A case is a script of steps against one handler process. Steps are written as one-key maps
//! (`- expect: {...}`), the form YAML makes easy to read; each is checked here (its kind, its
//! durations, its matchers) so that a typo in a case fails the run at load, never passes.

use std::{collections::BTreeSet, path::Path, time::Duration};

use anyhow::{Context as _, Result, anyhow, bail};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::{features::FEATURES, pattern};

/// One case of a case file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    /// Unique: `<group>/<name>`.
    pub name: String,
    /// What the case shows, for a person.
    pub about: String,
    /// The features an SDK must claim for the case to run.
    #[serde(default)]
    pub requires: Vec<String>,
    /// `unix` (the default) or `tcp`.
    #[serde(default)]
    pub transport: Transport,
    /// Steps as written.
    pub steps: Vec<Value>,
}

/// How the handler process dials the runner.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// A Unix socket (`unix:///…`).
    #[default]
    Unix,
    /// Loopback TCP (`127.0.0.1:port`).
    Tcp,
}

/// The kinds of message a handler process sends (`ConnectRequest`'s fields).
pub const REQUEST_KINDS: [&str; 8] = [
    "hello",
    "result",
    "update",
    "log",
    "pong",
    "flow_control",
    "goodbye",
    "settings",
];

/// One step, parsed.
#[derive(Debug, Clone)]
pub enum Step {
    /// Wait for a connection and its hello; answer with a welcome.
    Handshake {
        welcome: Value,
        same_instance: bool,
        hello: Option<Value>,
    },
    /// Wait for a new connection.
    Connect,
    /// Send a `ConnectResponse`.
    Send(Value),
    /// Send raw bytes as one message.
    SendRaw(Vec<u8>),
    /// Send an invocation of a handler of the fixed set.
    Invoke(Map<String, Value>),
    /// The next message of `kind` matching `pattern` comes within `within`.
    Expect {
        kind: String,
        pattern: Value,
        within: Duration,
    },
    /// No message of `kind` (matching `pattern`) comes for `during`.
    ExpectNone {
        kind: String,
        pattern: Value,
        during: Duration,
    },
    /// Received messages matching these came in this order.
    ExpectOrder(Vec<(String, Value)>),
    /// End the stream with a status.
    Close { code: tonic::Code, message: String },
    /// The handler process ends its side of the stream.
    ExpectClosed { within: Duration },
    /// Send a signal to the handler process.
    Signal(i32),
    /// The handler process exits.
    ExpectExit { within: Duration, code: Option<i32> },
    /// Wait.
    Sleep(Duration),
}

/// How long an `expect` waits unless it says.
pub const DEFAULT_WITHIN: Duration = Duration::from_secs(5);

impl Case {
    /// The steps, parsed.
    pub fn parsed_steps(&self) -> Result<Vec<Step>> {
        self.steps
            .iter()
            .enumerate()
            .map(|(index, step)| {
                parse_step(step).with_context(|| format!("step {} of {}", index + 1, self.name))
            })
            .collect()
    }
}

fn parse_step(step: &Value) -> Result<Step> {
    let map = step
        .as_object()
        .filter(|map| map.len() == 1)
        .ok_or_else(|| anyhow!("a step is a map of one key: {step}"))?;
    let Some((name, argument)) = map.iter().next() else {
        bail!("an empty step");
    };
    let object = || argument.as_object().cloned().unwrap_or_default();
    Ok(match name.as_str() {
        "handshake" => {
            let mut options = object();
            let welcome = options.remove("welcome").unwrap_or(Value::Object(Map::new()));
            let same_instance = options
                .remove("same_instance")
                .and_then(|value| value.as_bool())
                .unwrap_or(false);
            let hello = options.remove("hello");
            if let Some(unknown) = hello
                .as_ref()
                .map(pattern::unknown_matchers)
                .filter(|unknown| !unknown.is_empty())
            {
                bail!("unknown matchers {unknown:?}");
            }
            refuse_rest(&options, "handshake")?;
            Step::Handshake {
                welcome,
                same_instance,
                hello,
            }
        }
        "connect" => Step::Connect,
        "send" => Step::Send(argument.clone()),
        "send_raw" => {
            let options = object();
            if let Some(hex) = options.get("hex").and_then(Value::as_str) {
                Step::SendRaw(decode_hex(hex)?)
            } else if let Some(count) = options.get("bytes").and_then(Value::as_u64) {
                Step::SendRaw(vec![0; usize::try_from(count)?])
            } else {
                bail!("send_raw takes hex or bytes: {argument}");
            }
        }
        "invoke" => Step::Invoke(object()),
        "expect" => {
            let mut options = object();
            let within = take_duration(&mut options, "within")?.unwrap_or(DEFAULT_WITHIN);
            let (kind, pattern) = one_kind(options, "expect")?;
            Step::Expect {
                kind,
                pattern,
                within,
            }
        }
        "expect_none" => {
            let mut options = object();
            let during =
                take_duration(&mut options, "for")?.ok_or_else(|| anyhow!("expect_none needs `for`"))?;
            let kind = options
                .remove("kind")
                .and_then(|kind| kind.as_str().map(str::to_owned));
            let (kind, pattern) = match kind {
                Some(kind) => (kind, Value::Object(Map::new())),
                None => one_kind(options, "expect_none")?,
            };
            check_kind(&kind)?;
            Step::ExpectNone {
                kind,
                pattern,
                during,
            }
        }
        "expect_order" => {
            let items = argument
                .as_array()
                .ok_or_else(|| anyhow!("expect_order takes a list"))?;
            let order = items
                .iter()
                .map(|item| match item {
                    Value::String(kind) => {
                        check_kind(kind).map(|()| (kind.clone(), Value::Object(Map::new())))
                    }
                    other => one_kind(other.as_object().cloned().unwrap_or_default(), "expect_order"),
                })
                .collect::<Result<_>>()?;
            Step::ExpectOrder(order)
        }
        "close" => {
            let options = object();
            let code = options.get("code").and_then(Value::as_str).unwrap_or("OK");
            let message = options
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            Step::Close {
                code: status_code(code)?,
                message,
            }
        }
        "expect_closed" => {
            let mut options = object();
            Step::ExpectClosed {
                within: take_duration(&mut options, "within")?.unwrap_or(DEFAULT_WITHIN),
            }
        }
        "signal" => Step::Signal(match argument.as_str() {
            Some("TERM") => 15,
            Some("KILL") => 9,
            Some("INT") => 2,
            _ => bail!("signal is TERM, KILL or INT: {argument}"),
        }),
        "expect_exit" => {
            let mut options = object();
            let within = take_duration(&mut options, "within")?.unwrap_or(Duration::from_secs(15));
            let code = options
                .get("code")
                .and_then(Value::as_i64)
                .map(i32::try_from)
                .transpose()?;
            Step::ExpectExit { within, code }
        }
        "sleep" => Step::Sleep(duration(argument)?),
        other => bail!("unknown step {other}"),
    })
}

fn refuse_rest(options: &Map<String, Value>, step: &str) -> Result<()> {
    match options.keys().next() {
        Some(key) => bail!("{step} does not take {key}"),
        None => Ok(()),
    }
}

fn one_kind(mut options: Map<String, Value>, step: &str) -> Result<(String, Value)> {
    if options.len() != 1 {
        bail!("{step} names one kind of message: {}", Value::Object(options));
    }
    let key = options.keys().next().cloned().unwrap_or_default();
    let pattern = options.remove(&key).unwrap_or(Value::Null);
    check_kind(&key)?;
    let unknown = pattern::unknown_matchers(&pattern);
    if !unknown.is_empty() {
        bail!("unknown matchers {unknown:?}");
    }
    Ok((key, pattern))
}

fn check_kind(kind: &str) -> Result<()> {
    if REQUEST_KINDS.contains(&kind) {
        Ok(())
    } else {
        bail!("{kind} is no kind of message a handler process sends ({REQUEST_KINDS:?})")
    }
}

fn take_duration(options: &mut Map<String, Value>, key: &str) -> Result<Option<Duration>> {
    options.remove(key).map(|value| duration(&value)).transpose()
}

/// `500ms`, `2s`, `1.5s`, or a number of seconds.
pub fn duration(value: &Value) -> Result<Duration> {
    let seconds = match value {
        Value::Number(number) => number.as_f64().unwrap_or(-1.0),
        Value::String(text) => {
            if let Some(millis) = text.strip_suffix("ms") {
                millis
                    .parse::<f64>()
                    .map(|millis| millis / 1000.0)
                    .unwrap_or(-1.0)
            } else {
                text.strip_suffix('s').unwrap_or(text).parse().unwrap_or(-1.0)
            }
        }
        _ => -1.0,
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| anyhow!("not a duration: {value}"))
}

fn status_code(name: &str) -> Result<tonic::Code> {
    use tonic::Code;
    Ok(match name {
        "OK" => Code::Ok,
        "CANCELLED" => Code::Cancelled,
        "UNKNOWN" => Code::Unknown,
        "INVALID_ARGUMENT" => Code::InvalidArgument,
        "DEADLINE_EXCEEDED" => Code::DeadlineExceeded,
        "FAILED_PRECONDITION" => Code::FailedPrecondition,
        "RESOURCE_EXHAUSTED" => Code::ResourceExhausted,
        "UNAVAILABLE" => Code::Unavailable,
        "INTERNAL" => Code::Internal,
        other => bail!("unknown status code {other}"),
    })
}

fn decode_hex(text: &str) -> Result<Vec<u8>> {
    let clean: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    if !clean.len().is_multiple_of(2) {
        bail!("odd hex: {text}");
    }
    (0..clean.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&clean[at..at + 2], 16).map_err(|_| anyhow!("not hex: {text}")))
        .collect()
}

/// Reads every `*.yaml` case file of a folder, in name order, and checks the cases.
pub fn load_cases(folder: &Path) -> Result<Vec<Case>> {
    let mut files: Vec<_> = std::fs::read_dir(folder)
        .with_context(|| format!("reading {}", folder.display()))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|extension| extension == "yaml"))
        .collect();
    files.sort();
    let mut cases = Vec::new();
    let mut names = BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
        let loaded: Vec<Case> =
            serde_saphyr::from_str(&text).with_context(|| format!("the cases of {}", file.display()))?;
        for case in loaded {
            if !names.insert(case.name.clone()) {
                bail!("two cases are named {}", case.name);
            }
            for feature in &case.requires {
                if !FEATURES.iter().any(|known| known.name == feature) {
                    bail!("{} requires the unknown feature {feature}", case.name);
                }
            }
            case.parsed_steps()?;
            cases.push(case);
        }
    }
    Ok(cases)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn steps_parse_with_their_defaults() {
        let case = Case {
            name: "x/y".into(),
            about: String::new(),
            requires: vec![],
            transport: Transport::Unix,
            steps: vec![
                json!({"handshake": {}}),
                json!({"expect": {"result": {"invocation_id": "i1"}, "within": "250ms"}}),
                json!({"expect_none": {"kind": "result", "for": 1}}),
                json!({"close": {"code": "UNAVAILABLE"}}),
                json!({"send_raw": {"hex": "0a 00"}}),
            ],
        };
        let steps = case.parsed_steps().expect("parses");
        assert!(
            matches!(&steps[1], Step::Expect { kind, within, .. } if kind == "result" && *within == Duration::from_millis(250))
        );
        assert!(matches!(&steps[2], Step::ExpectNone { during, .. } if *during == Duration::from_secs(1)));
        assert!(matches!(
            &steps[3],
            Step::Close {
                code: tonic::Code::Unavailable,
                ..
            }
        ));
        assert!(matches!(&steps[4], Step::SendRaw(bytes) if bytes == &[0x0a, 0]));
    }

    #[test]
    fn a_typo_in_a_case_is_an_error() {
        for step in [
            json!({"expect": {"reslt": {}}}),
            json!({"expect": {"result": {"a": {"$regexp": "x"}}}}),
            json!({"exepct": {}}),
            json!({"sleep": "soon"}),
            json!({"handshake": {"welcom": {}}}),
        ] {
            assert!(parse_step(&step).is_err(), "{step}");
        }
    }
}
