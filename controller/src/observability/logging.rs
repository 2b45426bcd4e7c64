//! Installs the tracing subscriber: human-readable or JSON lines on stderr, filtered by
//! `RUST_LOG`-style directives.

use tracing_subscriber::{EnvFilter, fmt, prelude::*};

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
            .with(fmt::layer().with_writer(std::io::stderr))
            .try_init(),
        Format::Json => registry
            .with(
                fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_writer(std::io::stderr),
            )
            .try_init(),
    }
    .map_err(Error::AlreadySet)
}
