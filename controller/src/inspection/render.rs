//! Renders `capstan status` reports as kubectl does: aligned columns for people (`wide` adds
//! columns), JSON or YAML for scripts.
//!
//! A table has one row per handler record, and one row for an object without records (its
//! handlers all done, or never handled). The state word is coloured only when asked for —
//! the caller decides, from whether standard output is a terminal and `NO_COLOR`; colours
//! never change the alignment. Messages are kept on one line and, except in `wide`, cut to
//! [`MESSAGE_WIDTH`] characters. Nothing read from an object reaches the terminal as a control
//! character or a bidirectional override ([`escape`]).

mod escape;

use serde::Serialize;

use super::{ObjectReport, State};

/// The longest message shown in a normal table.
pub const MESSAGE_WIDTH: usize = 72;

/// Why a report could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// JSON serialisation failed.
    #[error("cannot write JSON")]
    Json(#[source] serde_json::Error),
    /// YAML serialisation failed.
    #[error("cannot write YAML")]
    Yaml(#[source] serde_saphyr::ser::Error),
}

/// The output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Aligned columns.
    #[default]
    Table,
    /// Aligned columns with the purpose, start, next attempt time and storage place.
    Wide,
    /// JSON (`{"items": [...]}`).
    Json,
    /// YAML.
    Yaml,
}

#[derive(Serialize)]
struct List<'a> {
    items: &'a [ObjectReport],
}

/// Renders `reports`; `namespaced` shows a namespace column (all namespaces), `colour`
/// colours the states.
///
/// # Errors
/// [`Error`] when serialisation fails (it does not for these types).
pub fn render(
    reports: &[ObjectReport],
    output: Output,
    namespaced: bool,
    colour: bool,
) -> Result<String, Error> {
    match output {
        Output::Json => serde_json::to_string_pretty(&List { items: reports })
            .map(escape::json)
            .map_err(Error::Json),
        Output::Yaml => serde_saphyr::to_string(&List {
            items: &with_strings(reports, escape::escape_bidi),
        })
        .map_err(Error::Yaml),
        Output::Table | Output::Wide => Ok(table(reports, output == Output::Wide, namespaced, colour)),
    }
}

fn table(reports: &[ObjectReport], wide: bool, namespaced: bool, colour: bool) -> String {
    if reports.is_empty() {
        return "No objects found.".into();
    }
    let nodes = reports
        .iter()
        .any(|r| r.handlers.iter().any(|h| h.node.is_some()));
    let mut header = Vec::new();
    if namespaced {
        header.push("NAMESPACE");
    }
    header.push("NAME");
    let members = reports.iter().any(|r| r.member.is_some());
    if members {
        header.push("MEMBER");
    }
    if nodes {
        header.push("NODE");
    }
    header.extend(["HANDLER", "STATE", "RETRIES", "NEXT ATTEMPT"]);
    if wide {
        header.extend(["PURPOSE", "STARTED", "STORED IN"]);
    }
    header.push("MESSAGE");
    let mut rows: Vec<(Vec<String>, Option<State>)> = Vec::new();
    for r in reports {
        let mut lead = Vec::new();
        if namespaced {
            lead.push(r.namespace.clone().unwrap_or_else(|| "-".into()));
        }
        lead.push(r.name.clone());
        if members {
            lead.push(r.member.clone().unwrap_or_else(|| "-".into()));
        }
        if r.handlers.is_empty() {
            let mut row = lead.clone();
            if nodes {
                row.push("-".into());
            }
            let (state, message) = idle(r);
            row.extend(["-".into(), state.into(), "-".into(), "-".into()]);
            if wide {
                row.extend(["-".into(), "-".into(), "-".into()]);
            }
            row.push(message);
            rows.push((escaped(row), None));
            continue;
        }
        for h in &r.handlers {
            let mut row = lead.clone();
            if nodes {
                row.push(h.node.clone().unwrap_or_else(|| "-".into()));
            }
            let next = match (h.next_attempt_in_seconds, &h.next_attempt) {
                (Some(s), Some(at)) if wide => format!("{} ({at})", relative(s)),
                (Some(s), _) => relative(s),
                _ => "-".into(),
            };
            row.extend([
                if h.handler.is_empty() {
                    "-".into()
                } else {
                    h.handler.clone()
                },
                h.state.word().into(),
                h.retries.to_string(),
                next,
            ]);
            if wide {
                row.extend([
                    h.purpose.clone().unwrap_or_else(|| "-".into()),
                    h.started.clone().unwrap_or_else(|| "-".into()),
                    h.stored_in.clone(),
                ]);
            }
            let message = escape::escape(&one_line(h.message.as_deref().unwrap_or("-")));
            row.push(if wide {
                message
            } else {
                cut(&message, MESSAGE_WIDTH)
            });
            rows.push((escaped(row), Some(h.state)));
        }
    }
    let state_column = header.iter().position(|h| *h == "STATE").unwrap_or(0);
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for (row, _) in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|h| (*h).to_owned()).collect();
    line(&mut out, &header, &widths, None, state_column);
    for (row, state) in &rows {
        out.push('\n');
        line(&mut out, row, &widths, state.filter(|_| colour), state_column);
    }
    out
}

/// A table row with every cell escaped (escaping twice changes nothing).
fn escaped(row: Vec<String>) -> Vec<String> {
    row.iter().map(|cell| escape::escape(cell)).collect()
}

/// `reports` with `f` applied to every string read from the objects.
fn with_strings(reports: &[ObjectReport], f: impl Fn(&str) -> String) -> Vec<ObjectReport> {
    let all = |v: &mut Vec<String>| v.iter_mut().for_each(|s| *s = f(s));
    let some = |o: &mut Option<String>| {
        if let Some(s) = o.as_mut() {
            *s = f(s);
        }
    };
    let mut reports = reports.to_vec();
    for r in &mut reports {
        some(&mut r.namespace);
        r.name = f(&r.name);
        some(&mut r.member);
        all(&mut r.handled_by);
        all(&mut r.finalizers);
        for h in &mut r.handlers {
            h.handler = f(&h.handler);
            some(&mut h.node);
            h.owner = f(&h.owner);
            h.stored_in = f(&h.stored_in);
            some(&mut h.purpose);
            some(&mut h.started);
            some(&mut h.stopped);
            some(&mut h.next_attempt);
            some(&mut h.message);
        }
    }
    reports
}

/// The state and message of an object without records.
fn idle(r: &ObjectReport) -> (&'static str, String) {
    if r.deleting && !r.finalizers.is_empty() {
        ("deleting", format!("held by {}", r.finalizers.join(", ")))
    } else if !r.handled_by.is_empty() {
        (
            "handled",
            format!(
                "every handler of the last change is done ({})",
                r.handled_by.join(", ")
            ),
        )
    } else {
        (
            "-",
            "no handler progress recorded on the object (operators with node-local storage, --node-storage, keep theirs in files on their nodes)".into(),
        )
    }
}

fn line(out: &mut String, cells: &[String], widths: &[usize], state: Option<State>, state_column: usize) {
    let last = cells.len().saturating_sub(1);
    for (i, (cell, width)) in cells.iter().zip(widths).enumerate() {
        let pad = width.saturating_sub(cell.chars().count());
        match state {
            Some(s) if i == state_column => {
                out.push_str(colour_code(s));
                out.push_str(cell);
                out.push_str("\x1b[0m");
            }
            _ => out.push_str(cell),
        }
        if i < last {
            out.extend(std::iter::repeat_n(' ', pad + 3));
        }
    }
}

fn colour_code(state: State) -> &'static str {
    match state {
        State::Done => "\x1b[32m",
        State::Running => "\x1b[36m",
        State::Retrying => "\x1b[33m",
        State::Failed | State::Malformed => "\x1b[31m",
    }
}

/// `in 45s`, `in 3m20s`, `due` (overdue by less than a minute) or `overdue 5m`.
fn relative(seconds: i64) -> String {
    if seconds >= 0 {
        format!("in {}", duration(seconds.unsigned_abs()))
    } else if seconds > -60 {
        "due".into()
    } else {
        format!("overdue {}", duration(seconds.unsigned_abs()))
    }
}

fn duration(s: u64) -> String {
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        3600..86_400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{}h", s / 86_400, s % 86_400 / 3600),
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn cut(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let head: String = s.chars().take(max.saturating_sub(1)).collect();
        format!("{head}…")
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use serde_json::json;

    use super::*;
    use crate::{inspection::object_report, persistence::survey::Scope};

    fn reports() -> Vec<ObjectReport> {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let a = json!({"metadata": {"name": "a", "namespace": "ns", "annotations": {
            "capstan.dev/create_fn": r#"{"retries":1,"failure":true,"message":"permanent\nfailure"}"#,
            "node-1.capstan.dev/other": r#"{"retries":0,"started":"x"}"#,
        }}});
        let b = json!({"metadata": {"name": "bee", "namespace": "ns", "annotations": {
            "capstan.dev/last-handled-configuration": "{}"}}});
        vec![
            object_report(&Scope::default(), &a, now),
            object_report(&Scope::default(), &b, now),
        ]
    }

    #[test]
    fn tables_are_aligned_and_plain_without_colour() {
        let text = render(&reports(), Output::Table, false, false).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        let at = |l: &str| {
            l.find("STATE")
                .or_else(|| l.find("failed"))
                .or_else(|| l.find("running"))
                .or_else(|| l.find("handled"))
        };
        let columns: Vec<Option<usize>> = lines.iter().map(|l| at(l)).collect();
        assert!(columns.windows(2).all(|w| w[0] == w[1]), "{text}");
        assert!(text.contains("permanent failure"), "{text}");
        assert!(!text.contains('\x1b'));
        assert!(
            lines[0].starts_with("NAME") && lines[0].contains("NODE"),
            "{text}"
        );
        let coloured = render(&reports(), Output::Table, false, true).unwrap();
        assert!(coloured.contains("\x1b[31mfailed\x1b[0m"));
    }

    #[test]
    fn json_and_yaml_carry_every_field() {
        let json: serde_json::Value =
            serde_json::from_str(&render(&reports(), Output::Json, true, true).unwrap()).unwrap();
        assert_eq!(json["items"][0]["handlers"][0]["state"], "failed");
        assert_eq!(json["items"][0]["handlers"][1]["node"], "node-1");
        assert_eq!(json["items"][1]["handledBy"], json!(["capstan.dev"]));
        let yaml = render(&reports(), Output::Yaml, true, false).unwrap();
        assert!(yaml.contains("state: failed"), "{yaml}");
    }

    #[test]
    fn control_characters_in_messages_are_escaped_in_tables() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let hostile = json!({"metadata": {"name": "a", "namespace": "ns", "annotations": {
            "capstan.dev/create_fn": serde_json::to_string(&json!({
                "retries": 1, "failure": true,
                "message": "\u{1b}]0;owned\u{7}\u{1b}[2Jgone\u{7f}\u{9b}31m \u{202e}txt.exe",
            })).unwrap(),
            "capstan.dev/\u{1b}[31mred": r#"{"retries":0,"started":"x"}"#,
        }}});
        let reports = vec![object_report(&Scope::default(), &hostile, now)];
        let steers = |c: char| c != '\n' && (c.is_control() || ('\u{202a}'..='\u{202e}').contains(&c));
        for output in [Output::Table, Output::Wide, Output::Json, Output::Yaml] {
            let text = render(&reports, output, true, false).unwrap();
            assert!(!text.chars().any(steers), "{output:?}:\n{text:?}");
        }
        let table = render(&reports, Output::Wide, false, false).unwrap();
        assert!(
            table.contains("\\x1b]0;owned\\x07\\x1b[2Jgone\\x7f\\x9b31m \\u{202e}txt.exe"),
            "{table}"
        );
        let json: serde_json::Value =
            serde_json::from_str(&render(&reports, Output::Json, false, false).unwrap()).unwrap();
        let messages: Vec<&str> = json["items"][0]["handlers"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|h| h["message"].as_str())
            .collect();
        assert_eq!(
            messages,
            ["\u{1b}]0;owned\u{7}\u{1b}[2Jgone\u{7f}\u{9b}31m \u{202e}txt.exe"],
            "JSON keeps the message as stored"
        );
    }

    #[test]
    fn times_read_like_kubectl() {
        assert_eq!(relative(45), "in 45s");
        assert_eq!(relative(200), "in 3m20s");
        assert_eq!(relative(-5), "due");
        assert_eq!(relative(-400), "overdue 6m40s");
    }
}
