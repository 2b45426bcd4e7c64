//! A watch's answer, one event per line, each line split before its object is parsed.
//!
//! kube's `Api::watch` parses each line whole into a `WatchEvent`: an object that does not
//! parse (one nested deeper than serde_json's recursion limit, which the API server accepts)
//! fails the line, the watch restarts from the version before it, and fails on it again —
//! for ever. Here a line is first split into its type and its object's text (skipped over
//! without recursion), and the object is parsed alone: one that does not parse is
//! [`Unparsed`] (quarantined by the watch, which moves its resourceVersion past it).

use futures::{AsyncBufRead, AsyncBufReadExt as _, Stream, StreamExt as _};
use kube::{api::DynamicObject, core::Status};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::{k8s::quarantine::Unparsed, model::EventType};

/// One line of a watch.
#[derive(Debug)]
pub enum Line {
    /// An object was added, modified or deleted.
    Event(EventType, Box<DynamicObject>),
    /// An object that does not parse was added, modified or deleted.
    Unparsable(EventType, Unparsed),
    /// The watch has seen every change up to this resourceVersion.
    Bookmark(String),
    /// The server ended the watch with this status (`410 Gone`: too old a resourceVersion).
    Error(Box<Status>),
}

/// Why a line is not a watch event.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The line is no JSON watch event, nor a status.
    #[error("a watch line that is no event: {0}")]
    NoEvent(#[source] serde_json::Error),
    /// The event's type is none of a watch's.
    #[error("a watch event of unknown type {0:?}")]
    UnknownType(String),
}

/// Parses one line of a watch.
///
/// # Errors
/// [`Error`] when the line is no watch event (an object that does not parse is no error: it
/// is [`Line::Unparsable`]).
pub fn parse(line: &str) -> Result<Line, Error> {
    #[derive(Deserialize)]
    struct Wire<'a> {
        #[serde(rename = "type")]
        kind: String,
        #[serde(borrow)]
        object: &'a RawValue,
    }
    let wire: Wire<'_> = match serde_json::from_str(line) {
        Ok(wire) => wire,
        // A server's error may come as a bare status.
        Err(e) => {
            return serde_json::from_str::<Status>(line)
                .ok()
                .filter(|s| s.code != 0)
                .map(|s| Line::Error(Box::new(s)))
                .ok_or(Error::NoEvent(e));
        }
    };
    let object = wire.object.get();
    let event_type = match wire.kind.as_str() {
        "ADDED" => EventType::Added,
        "MODIFIED" => EventType::Modified,
        "DELETED" => EventType::Deleted,
        "BOOKMARK" => {
            return Ok(Line::Bookmark(
                crate::k8s::quarantine::Identity::of(object)
                    .resource_version
                    .unwrap_or_default(),
            ));
        }
        "ERROR" => {
            return serde_json::from_str::<Status>(object)
                .map(|s| Line::Error(Box::new(s)))
                .map_err(Error::NoEvent);
        }
        other => return Err(Error::UnknownType(other.to_owned())),
    };
    Ok(match serde_json::from_str::<DynamicObject>(object) {
        Ok(parsed) => Line::Event(event_type, Box::new(parsed)),
        Err(e) => Line::Unparsable(event_type, Unparsed::new(object, e)),
    })
}

/// How a watch's answer ended or failed.
#[derive(Debug)]
pub enum Read {
    /// A line.
    Line(Line),
    /// A line that is no event.
    Bad(Error),
    /// The connection failed while reading (the API server or the way to it: an outage, not a
    /// problem of the watch).
    Failed(std::io::Error),
}

/// The lines of a watch's answer, parsed one by one. The stream ends where the answer ends,
/// also when it is cut off mid-line (the watch resumes from its last version).
pub fn lines(body: impl AsyncBufRead + Unpin) -> impl Stream<Item = Read> {
    body.lines().filter_map(|line| async move {
        match line {
            Ok(line) if line.trim().is_empty() => None,
            Ok(line) => Some(match parse(&line) {
                Ok(line) => Read::Line(line),
                Err(Error::NoEvent(e)) if e.is_eof() => return None,
                Err(e) => Read::Bad(e),
            }),
            Err(e) if ends_the_answer(&e) => None,
            Err(e) => Some(Read::Failed(e)),
        }
    })
}

/// Whether a read error only ends the answer (the connection closed mid-answer or timed out):
/// the watch resumes from its last version, as after any end.
fn ends_the_answer(e: &std::io::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(error) = source {
        if error.downcast_ref::<std::io::Error>().is_some_and(|io| {
            matches!(
                io.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::TimedOut
            )
        }) || error.to_string().contains("unexpected EOF")
        {
            return true;
        }
        source = error.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deep(depth: usize) -> String {
        format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth))
    }

    #[test]
    fn events_bookmarks_and_errors_are_told_apart() {
        let added = r#"{"type":"ADDED","object":{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"a","uid":"u1","resourceVersion":"5"}}}"#;
        match parse(added).unwrap() {
            Line::Event(EventType::Added, o) => assert_eq!(o.metadata.name.as_deref(), Some("a")),
            other => panic!("{other:?}"),
        }
        let bookmark =
            r#"{"type":"BOOKMARK","object":{"kind":"ConfigMap","metadata":{"resourceVersion":"b-77"}}}"#;
        assert!(matches!(parse(bookmark).unwrap(), Line::Bookmark(rv) if rv == "b-77"));
        let gone = r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Expired","code":410}}"#;
        assert!(matches!(parse(gone).unwrap(), Line::Error(s) if s.code == 410));
        let status = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","code":500,"message":"boom"}"#;
        assert!(matches!(parse(status).unwrap(), Line::Error(s) if s.code == 500));
        assert!(matches!(parse("[1]"), Err(Error::NoEvent(_))));
        assert!(matches!(
            parse(r#"{"type":"SURPRISE","object":{}}"#),
            Err(Error::UnknownType(_))
        ));
    }

    #[test]
    fn an_object_deeper_than_the_parser_allows_is_unparsable_with_its_identity() {
        let line = format!(
            r#"{{"type":"MODIFIED","object":{{"metadata":{{"name":"deep","namespace":"n","uid":"u-deep","resourceVersion":"41"}},"spec":{}}}}}"#,
            deep(200)
        );
        match parse(&line).unwrap() {
            Line::Unparsable(EventType::Modified, unparsed) => {
                assert_eq!(unparsed.identity.uid, "u-deep");
                assert_eq!(unparsed.identity.resource_version.as_deref(), Some("41"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_stream_of_lines_goes_on_after_an_unparsable_object() {
        let text = format!(
            "{}\n{}\n\n{}\n",
            r#"{"type":"ADDED","object":{"metadata":{"name":"a"}}}"#,
            format_args!(
                r#"{{"type":"ADDED","object":{{"metadata":{{"name":"deep"}},"spec":{}}}}}"#,
                deep(300)
            ),
            r#"{"type":"ADDED","object":{"metadata":{"name":"b"}}}"#,
        );
        let read: Vec<Read> = lines(futures::io::Cursor::new(text.into_bytes())).collect().await;
        assert_eq!(read.len(), 3);
        assert!(matches!(&read[0], Read::Line(Line::Event(_, o)) if o.metadata.name.as_deref() == Some("a")));
        assert!(matches!(&read[1], Read::Line(Line::Unparsable(_, u)) if u.identity.name == "deep"));
        assert!(matches!(&read[2], Read::Line(Line::Event(_, o)) if o.metadata.name.as_deref() == Some("b")));
    }
}
