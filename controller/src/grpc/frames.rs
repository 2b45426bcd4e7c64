//! The HTTP/2 frame layer between a handler process's socket and the HTTP/2 server: the
//! handshake deadline, the `:authority` that gRPC C-core sends over Unix sockets, and a log line
//! for every stream or connection refused below the gRPC layer.
//!
//! # Why this layer exists
//!
//! gRPC C-core (and so Python's `grpcio`, Ruby, PHP, C++ and others built on it) sends the
//! percent-encoded socket path as the HTTP/2 `:authority` of every request on a Unix socket
//! (`unix:///run/capstan/capstan.sock` becomes `%2Frun%2Fcapstan%2Fcapstan.sock`); grpc-java
//! sends the bare path. Neither is an RFC 3986 authority, and the HTTP/2 implementation under
//! tonic refuses such requests with `RST_STREAM(PROTOCOL_ERROR)` before any gRPC code runs. No
//! version or setting of it accepts them, and the client cannot always be configured (the
//! `grpc.default_authority` channel option exists, but a stock client must work as it comes).
//!
//! The fix lives here, on the server side, at the only place that sees the request headers
//! before they are validated: the bytes arriving from the client. [`Guarded`] wraps the
//! accepted socket and reads the client's frames. Every frame except the header blocks passes
//! through unchanged and unbuffered. Every header block (`HEADERS` plus its `CONTINUATION`s)
//! is HPACK-decoded with a decoder that follows the client's dynamic table, an `:authority`
//! that is not a valid authority is replaced by `localhost` (what grpc-go and kubelet send on
//! Unix sockets), and the block is encoded again with literal representations only. The
//! server's decoder therefore never sees a dynamic-table entry, so the two HPACK contexts can
//! never disagree, however the client indexes its headers. Valid authorities (`localhost`,
//! `127.0.0.1:PORT`) are left as they are.
//!
//! The re-encoded block is at most as large as the decoded header list, which is bounded
//! (larger blocks close the connection); it is split into frames of at most 16 KiB, the HTTP/2
//! minimum that every server accepts. Padding is dropped, priority data is kept.
//!
//! # Handshake deadline
//!
//! A client that connects and never sends the HTTP/2 connection preface (or stops half-way)
//! would otherwise hold its socket forever. Until the preface and the first frame after it
//! have arrived, reads are bounded by the handshake timeout; then the connection is closed
//! with a log line. HTTP/2 keepalive pings take over from there.
//!
//! # What is logged
//!
//! The same wrapper watches the frames the server writes: every `RST_STREAM` with an error
//! code other than `NO_ERROR`/`CANCEL`, and every `GOAWAY` with an error, is logged at `warn`
//! with the stream's request path and, where the request headers explain it (an uppercase
//! header name, a connection-specific header, a missing pseudo-header), the reason. A
//! connection this layer closes itself (a malformed frame sequence, an undecodable header
//! block) is logged with its reason too.
//!
//! `grpc::server` wraps every accepted connection in [`Guarded`]; nothing above it knows.

use std::{
    collections::VecDeque,
    future::Future as _,
    io,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tracing::warn;

use self::{inbound::Inbound, outbound::Outbound};

mod inbound;
mod outbound;
#[cfg(test)]
mod tests;

/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The size of a frame header.
const FRAME_HEADER: usize = 9;
/// The largest frame this layer writes: the HTTP/2 default `SETTINGS_MAX_FRAME_SIZE`, which
/// every server accepts. Header frames up to what the server announces are accepted.
const MAX_FRAME: usize = 16_384;
/// The HTTP/2 default dynamic table size: the largest table the client's encoder may use until
/// the server announces another `SETTINGS_HEADER_TABLE_SIZE` (this layer follows the server's
/// `SETTINGS` frames).
const HEADER_TABLE_SIZE: usize = 4_096;
/// The largest `SETTINGS_MAX_FRAME_SIZE` HTTP/2 allows.
const LARGEST_FRAME: usize = 16_777_215;
/// The largest header block accepted, encoded (all fragments) and decoded (names, values and
/// HPACK's 32 bytes per field). Far above what a gRPC client sends; the server's own, smaller
/// header-list limit still applies after this layer.
const MAX_BLOCK: usize = 256 * 1024;
/// Request paths remembered per connection for the refusal log.
const REMEMBERED_STREAMS: usize = 32;
/// The authority put in place of one that is not valid.
const LOCALHOST: &[u8] = b"localhost";

/// HTTP/2 frame types used here.
mod kind {
    pub const HEADERS: u8 = 0x1;
    pub const SETTINGS: u8 = 0x4;
    pub const RST_STREAM: u8 = 0x3;
    pub const PUSH_PROMISE: u8 = 0x5;
    pub const GOAWAY: u8 = 0x7;
    pub const CONTINUATION: u8 = 0x9;
}

/// HTTP/2 frame flags used here.
mod flag {
    pub const END_STREAM: u8 = 0x1;
    pub const ACK: u8 = 0x1;
    pub const END_HEADERS: u8 = 0x4;
    pub const PADDED: u8 = 0x8;
    pub const PRIORITY: u8 = 0x20;
}

/// Why this layer closed a connection.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The preface or the first frame did not arrive in time.
    #[error("no HTTP/2 connection preface within {0:?}")]
    HandshakeTimeout(Duration),
    /// Frames out of the order HTTP/2 requires.
    #[error("malformed HTTP/2 frame sequence: {0}")]
    Sequence(&'static str),
    /// A header block that is too large.
    #[error("header block larger than {MAX_BLOCK} bytes")]
    BlockTooLarge,
    /// A header block that does not decode.
    #[error("undecodable header block (HPACK): {0}")]
    Compression(String),
}

impl From<Refusal> for io::Error {
    fn from(r: Refusal) -> Self {
        let kind = match r {
            Refusal::HandshakeTimeout(_) => io::ErrorKind::TimedOut,
            _ => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, r)
    }
}

/// An accepted connection, seen through the frame layer. See the module docs.
pub struct Guarded<S> {
    inner: S,
    inbound: Inbound,
    outbound: Outbound,
    streams: Streams,
    handshake: Option<(Pin<Box<tokio::time::Sleep>>, Duration)>,
    /// Bytes ready for the server.
    ready: Vec<u8>,
    /// How much of `ready` the server has taken.
    taken: usize,
    failed: bool,
}

impl<S> Guarded<S> {
    /// Wraps an accepted connection; the preface must arrive within `handshake_timeout`.
    pub fn new(inner: S, handshake_timeout: Duration) -> Self {
        Self {
            inner,
            inbound: Inbound::default(),
            outbound: Outbound::default(),
            streams: Streams::default(),
            handshake: Some((Box::pin(tokio::time::sleep(handshake_timeout)), handshake_timeout)),
            ready: Vec::new(),
            taken: 0,
            failed: false,
        }
    }

    fn deliver(&mut self, buf: &mut ReadBuf<'_>) {
        let pending = self.ready.get(self.taken..).unwrap_or_default();
        let n = pending.len().min(buf.remaining());
        buf.put_slice(pending.get(..n).unwrap_or_default());
        self.taken += n;
        if self.taken >= self.ready.len() {
            self.ready.clear();
            self.taken = 0;
        }
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for Guarded<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.failed {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "connection refused by the HTTP/2 frame layer",
            )));
        }
        loop {
            if this.taken < this.ready.len() {
                this.deliver(buf);
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut raw = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.inner).poll_read(cx, &mut raw) {
                Poll::Ready(Ok(())) => {
                    let filled = raw.filled();
                    if filled.is_empty() {
                        return Poll::Ready(Ok(()));
                    }
                    if let Err(refusal) = this.inbound.feed(filled, &mut this.ready, &mut this.streams) {
                        this.failed = true;
                        warn!(error = %refusal, "handler-process connection closed below the gRPC layer");
                        return Poll::Ready(Err(refusal.into()));
                    }
                    if this.inbound.handshaken() {
                        this.handshake = None;
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    if let Some((sleep, timeout)) = this.handshake.as_mut() {
                        ready!(sleep.as_mut().poll(cx));
                        let refusal = Refusal::HandshakeTimeout(*timeout);
                        this.failed = true;
                        warn!(error = %refusal, "handler-process connection closed below the gRPC layer");
                        return Poll::Ready(Err(refusal.into()));
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let n = ready!(Pin::new(&mut this.inner).poll_write(cx, buf))?;
        this.outbound
            .observe(buf.get(..n).unwrap_or_default(), &mut this.streams);
        // What the server announced bounds what the client may send; never below the defaults.
        if let Some(size) = this.outbound.header_table_size.take() {
            this.inbound
                .decoder
                .set_max_allowed_table_size(size.max(HEADER_TABLE_SIZE));
        }
        if let Some(size) = this.outbound.max_frame_size.take() {
            this.inbound.max_frame = size.clamp(MAX_FRAME, LARGEST_FRAME);
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// What the connection's recent streams asked for, for the refusal log.
#[derive(Default)]
struct Streams {
    recent: VecDeque<(u32, String, Option<String>)>,
}

impl Streams {
    fn remember(&mut self, id: u32, path: String, problem: Option<String>) {
        if self.recent.len() >= REMEMBERED_STREAMS {
            self.recent.pop_front();
        }
        self.recent.push_back((id, path, problem));
    }

    fn latest(&self) -> (String, String) {
        self.recent
            .back()
            .map(|(_, path, problem)| (path.clone(), problem.clone().unwrap_or_default()))
            .unwrap_or_default()
    }

    fn about(&self, id: u32) -> (String, String) {
        self.recent
            .iter()
            .rev()
            .find(|(s, ..)| *s == id)
            .map(|(_, path, problem)| (path.clone(), problem.clone().unwrap_or_default()))
            .unwrap_or_default()
    }
}

/// The fixed 9-byte header of every HTTP/2 frame.
#[derive(Clone, Copy)]
struct FrameHeader {
    length: usize,
    kind: u8,
    flags: u8,
    stream: u32,
}

impl FrameHeader {
    fn parse(b: &[u8; FRAME_HEADER]) -> Self {
        Self {
            length: usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]),
            kind: b[3],
            flags: b[4],
            stream: u32::from_be_bytes([b[5], b[6], b[7], b[8]]) & 0x7fff_ffff,
        }
    }
}
