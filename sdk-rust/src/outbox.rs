//! The outgoing half of the stream as seen by running invocations.
//!
//! Handlers log, post Events and send daemon progress while the connection module's reader keeps
//! reading; both paths meet in one bounded channel of `ConnectRequest`s that the connection
//! drains into the gRPC stream (or that the test kit drains into its records). Log records are
//! best effort — dropped with a warning when the channel is full, so a chatty handler can never
//! block — while results and updates wait for room.

use tokio::sync::mpsc;

use crate::{Error, error::Result, pb};

/// How many messages may wait for the stream before log records start being dropped.
pub(crate) const CAPACITY: usize = 1024;

/// A sender of messages to the controller.
#[derive(Debug, Clone)]
pub(crate) struct Outbox {
    tx: mpsc::Sender<pb::ConnectRequest>,
}

impl Outbox {
    /// A new outbox and the receiver that drains it.
    pub(crate) fn channel() -> (Self, mpsc::Receiver<pb::ConnectRequest>) {
        let (tx, rx) = mpsc::channel(CAPACITY);
        (Self { tx }, rx)
    }

    /// Sends a log record without waiting; drops it when the stream is congested or gone.
    pub(crate) fn log(&self, record: pb::LogRecord) {
        let message = pb::ConnectRequest {
            message: Some(pb::connect_request::Message::Log(record)),
        };
        if let Err(error) = self.tx.try_send(message) {
            tracing::warn!(%error, "dropping a log record");
        }
    }

    /// Sends any message, waiting for room.
    ///
    /// # Errors
    ///
    /// [`Error::StreamClosed`] when the stream is gone.
    pub(crate) async fn send(&self, message: pb::connect_request::Message) -> Result<()> {
        self.tx
            .send(pb::ConnectRequest {
                message: Some(message),
            })
            .await
            .map_err(|_| Error::StreamClosed)
    }
}
