//! Installs the tracing subscriber: human-readable or JSON lines on stderr, filtered by
//! `RUST_LOG`-style directives.
//!
//! Many field values come from handler processes (log messages, handler ids, invocation ids,
//! diagnostics) and are untrusted: a newline in one of them would start a line of its own in
//! the text format and forge a log record, an escape sequence would reach the terminal. The
//! text format therefore writes every field through [`Escaped`], which escapes control
//! characters (`\n` becomes `\\n`, ESC becomes `\\u{1b}`), so that one event is always one
//! line. The JSON format escapes them by its nature.

use std::fmt;

use tracing::field::{Field, Visit};
use tracing_subscriber::{
    EnvFilter,
    field::RecordFields,
    fmt::{self as tfmt, FormatFields, format::Writer},
    prelude::*,
};

/// The log line format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Why logging could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The filter directives did not parse.
    #[error("invalid log filter {0:?}")]
    Filter(String, #[source] tracing_subscriber::filter::ParseError),
    /// A subscriber was already installed.
    #[error("logging was already initialised")]
    AlreadySet(#[source] tracing_subscriber::util::TryInitError),
}

/// Installs the global subscriber.
///
/// # Errors
/// See [`Error`].
pub fn init(format: Format, filter: &str) -> Result<(), Error> {
    let filter = EnvFilter::try_new(filter).map_err(|e| Error::Filter(filter.to_owned(), e))?;
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        Format::Text => registry
            .with(tfmt::layer().fmt_fields(Escaped).with_writer(std::io::stderr))
            .try_init(),
        Format::Json => registry
            .with(
                tfmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_writer(std::io::stderr),
            )
            .try_init(),
    }
    .map_err(Error::AlreadySet)
}

/// Formats event and span fields as `message name=value …`, with control characters
/// escaped in every value.
#[derive(Clone, Copy, Debug, Default)]
pub struct Escaped;

impl<'writer> FormatFields<'writer> for Escaped {
    fn format_fields<R: RecordFields>(&self, mut writer: Writer<'writer>, fields: R) -> fmt::Result {
        let mut visitor = Visitor {
            writer: &mut writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct Visitor<'a, 'writer> {
    writer: &'a mut Writer<'writer>,
    first: bool,
    result: fmt::Result,
}

impl Visit for Visitor<'_, '_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.result.is_err() {
            return;
        }
        let name = field.name();
        if name.starts_with("log.") {
            return;
        }
        let text = format!("{value:?}");
        let separator = if self.first { "" } else { " " };
        self.first = false;
        self.result = (|| {
            self.writer.write_str(separator)?;
            if name != "message" {
                self.writer.write_str(name.strip_prefix("r#").unwrap_or(name))?;
                self.writer.write_char('=')?;
            }
            escape_into(&text, self.writer)
        })();
    }
}

/// Writes `text` with every control character escaped.
fn escape_into(text: &str, out: &mut impl fmt::Write) -> fmt::Result {
    for c in text.chars() {
        match c {
            '\n' => out.write_str("\\n")?,
            '\r' => out.write_str("\\r")?,
            '\t' => out.write_str("\\t")?,
            c if c.is_control() => write!(out, "\\u{{{:x}}}", u32::from(c))?,
            c => out.write_char(c)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn escape(text: &str) -> String {
        let mut out = String::new();
        escape_into(text, &mut out).unwrap();
        out
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(
            escape("a\nFORGED line\r\t\u{1b}[31m"),
            "a\\nFORGED line\\r\\t\\u{1b}[31m"
        );
        assert_eq!(escape("plain ünïcode"), "plain ünïcode");
    }

    #[test]
    fn every_field_of_a_text_line_is_escaped() {
        let buffer = std::sync::Arc::new(parking_lot::Mutex::new(Vec::<u8>::new()));
        let sink = buffer.clone();
        let subscriber = tracing_subscriber::registry().with(
            tfmt::layer()
                .fmt_fields(Escaped)
                .with_ansi(false)
                .with_writer(move || SharedWriter(sink.clone())),
        );
        tracing::subscriber::with_default(subscriber, || {
            let id = "h\nFORGED id";
            let span = tracing::info_span!("connection", peer = %"p\nFORGED span");
            let _entered = span.enter();
            tracing::info!(handler_id = %id, "a\nFORGED line");
        });
        let text = String::from_utf8(buffer.lock().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(!text.lines().any(|l| l.starts_with("FORGED")), "{text}");
        assert!(text.contains("a\\nFORGED line"), "{text}");
        assert!(text.contains("handler_id=h\\nFORGED id"), "{text}");
    }

    struct SharedWriter(std::sync::Arc<parking_lot::Mutex<Vec<u8>>>);

    impl std::io::Write for SharedWriter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}
