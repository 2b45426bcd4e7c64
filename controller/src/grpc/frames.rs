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
use tracing::{debug, info, warn};

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

/// The client-to-server direction: a frame parser that rewrites header blocks.
struct Inbound {
    state: InState,
    /// A `HEADERS` frame waiting for its `CONTINUATION`s.
    open_block: Option<Block>,
    decoder: loona_hpack::Decoder<'static>,
    /// The largest header frame accepted (the server's `SETTINGS_MAX_FRAME_SIZE`).
    max_frame: usize,
    /// Frames complete after the preface; the handshake is over after the first.
    frames: u64,
    /// The connection did not start with the preface: passed through untouched, for the
    /// server to refuse.
    transparent: bool,
    rewrites: u64,
}

enum InState {
    Preface { seen: usize },
    Header { bytes: [u8; FRAME_HEADER], len: usize },
    Pass { remaining: usize },
    Collect { header: FrameHeader, payload: Vec<u8> },
}

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

struct Block {
    stream: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

impl Default for Inbound {
    fn default() -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(HEADER_TABLE_SIZE);
        Self {
            state: InState::Preface { seen: 0 },
            open_block: None,
            decoder,
            max_frame: MAX_FRAME,
            frames: 0,
            transparent: false,
            rewrites: 0,
        }
    }
}

impl Inbound {
    fn handshaken(&self) -> bool {
        self.frames > 0
    }

    /// Parses `input`, appending what the server should read to `out`.
    fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>, streams: &mut Streams) -> Result<(), Refusal> {
        if self.transparent {
            out.extend_from_slice(input);
            return Ok(());
        }
        while !input.is_empty() {
            match &mut self.state {
                InState::Preface { seen } => {
                    let want = PREFACE.get(*seen..).unwrap_or_default();
                    let n = want.len().min(input.len());
                    let (head, rest) = input.split_at(n);
                    out.extend_from_slice(head);
                    input = rest;
                    if want.get(..n) != Some(head) {
                        // Not HTTP/2 with prior knowledge: the server refuses it on its own.
                        debug!("connection does not start with the HTTP/2 preface");
                        self.transparent = true;
                        out.extend_from_slice(input);
                        return Ok(());
                    }
                    *seen += n;
                    if *seen == PREFACE.len() {
                        self.state = InState::Header {
                            bytes: [0; FRAME_HEADER],
                            len: 0,
                        };
                    }
                }
                InState::Header { bytes, len } => {
                    let n = (FRAME_HEADER - *len).min(input.len());
                    let (head, rest) = input.split_at(n);
                    if let Some(dst) = bytes.get_mut(*len..*len + n) {
                        dst.copy_from_slice(head);
                    }
                    *len += n;
                    input = rest;
                    if *len == FRAME_HEADER {
                        let raw = *bytes;
                        self.start_frame(&raw, out, streams)?;
                    }
                }
                InState::Pass { remaining } => {
                    let n = (*remaining).min(input.len());
                    let (head, rest) = input.split_at(n);
                    out.extend_from_slice(head);
                    *remaining -= n;
                    input = rest;
                    if *remaining == 0 {
                        self.end_frame();
                    }
                }
                InState::Collect { header, payload } => {
                    let n = (header.length - payload.len()).min(input.len());
                    let (head, rest) = input.split_at(n);
                    payload.extend_from_slice(head);
                    input = rest;
                    if payload.len() == header.length {
                        let header = *header;
                        let payload = std::mem::take(payload);
                        self.end_frame();
                        self.header_frame(header, &payload, out, streams)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn end_frame(&mut self) {
        self.frames += 1;
        self.state = InState::Header {
            bytes: [0; FRAME_HEADER],
            len: 0,
        };
    }

    fn start_frame(
        &mut self,
        raw: &[u8; FRAME_HEADER],
        out: &mut Vec<u8>,
        streams: &mut Streams,
    ) -> Result<(), Refusal> {
        let header = FrameHeader::parse(raw);
        match header.kind {
            kind::HEADERS | kind::CONTINUATION => {
                if header.length > self.max_frame {
                    return Err(Refusal::Sequence(
                        "header frame larger than the maximum frame size",
                    ));
                }
                match (header.kind, &self.open_block) {
                    (kind::HEADERS, Some(_)) => {
                        return Err(Refusal::Sequence("HEADERS while a header block is open"));
                    }
                    (kind::CONTINUATION, None) => {
                        return Err(Refusal::Sequence("CONTINUATION without an open header block"));
                    }
                    (kind::CONTINUATION, Some(b)) if b.stream != header.stream => {
                        return Err(Refusal::Sequence("CONTINUATION on another stream"));
                    }
                    _ => {}
                }
                if header.length == 0 {
                    self.end_frame();
                    return self.header_frame(header, &[], out, streams);
                }
                self.state = InState::Collect {
                    header,
                    payload: Vec::with_capacity(header.length),
                };
            }
            _ if self.open_block.is_some() => {
                return Err(Refusal::Sequence("a frame interleaved with a header block"));
            }
            kind::PUSH_PROMISE => return Err(Refusal::Sequence("PUSH_PROMISE from a client")),
            _ => {
                out.extend_from_slice(raw);
                if header.length == 0 {
                    self.end_frame();
                } else {
                    self.state = InState::Pass {
                        remaining: header.length,
                    };
                }
            }
        }
        Ok(())
    }

    fn header_frame(
        &mut self,
        header: FrameHeader,
        payload: &[u8],
        out: &mut Vec<u8>,
        streams: &mut Streams,
    ) -> Result<(), Refusal> {
        if header.kind == kind::HEADERS {
            let mut rest = payload;
            let mut pad = 0usize;
            if header.flags & flag::PADDED != 0 {
                let (&p, tail) = rest
                    .split_first()
                    .ok_or(Refusal::Sequence("PADDED frame without a pad length"))?;
                pad = usize::from(p);
                rest = tail;
            }
            let mut priority = None;
            if header.flags & flag::PRIORITY != 0 {
                let (p, tail) = rest
                    .split_first_chunk::<5>()
                    .ok_or(Refusal::Sequence("PRIORITY flag without priority data"))?;
                priority = Some(*p);
                rest = tail;
            }
            let fragment = rest
                .get(
                    ..rest
                        .len()
                        .checked_sub(pad)
                        .ok_or(Refusal::Sequence("padding longer than the frame"))?,
                )
                .unwrap_or_default();
            self.open_block = Some(Block {
                stream: header.stream,
                flags: header.flags & flag::END_STREAM,
                priority,
                fragment: fragment.to_vec(),
            });
        } else if let Some(block) = self.open_block.as_mut() {
            block.fragment.extend_from_slice(payload);
        }
        if self
            .open_block
            .as_ref()
            .is_some_and(|b| b.fragment.len() > MAX_BLOCK)
        {
            return Err(Refusal::BlockTooLarge);
        }
        if header.flags & flag::END_HEADERS != 0
            && let Some(block) = self.open_block.take()
        {
            self.rewrite(&block, out, streams)?;
        }
        Ok(())
    }

    /// Decodes a complete header block and writes it out again with literals only.
    fn rewrite(&mut self, block: &Block, out: &mut Vec<u8>, streams: &mut Streams) -> Result<(), Refusal> {
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut size = 0usize;
        self.decoder
            .decode_with_cb(&block.fragment, |name, value| {
                size = size.saturating_add(name.len() + value.len() + 32);
                if size <= MAX_BLOCK {
                    fields.push((name.into_owned(), value.into_owned()));
                }
            })
            .map_err(|e| Refusal::Compression(e.to_string()))?;
        if size > MAX_BLOCK {
            return Err(Refusal::BlockTooLarge);
        }
        let mut path = String::new();
        for (name, value) in &mut fields {
            match name.as_slice() {
                b":authority" if http::uri::Authority::try_from(value.as_slice()).is_err() => {
                    if self.rewrites == 0 {
                        info!(
                            authority = %String::from_utf8_lossy(value).escape_debug(),
                            "client sent an :authority that is not a valid authority (gRPC C-core sends the socket path); using localhost"
                        );
                    }
                    self.rewrites += 1;
                    *value = LOCALHOST.to_vec();
                }
                b":path" => path = String::from_utf8_lossy(value).escape_debug().to_string(),
                _ => {}
            }
        }
        streams.remember(block.stream, path, diagnose(&fields));
        let mut encoded = Vec::with_capacity(size);
        for (name, value) in &fields {
            // Literal header field without indexing, new name (RFC 7541 §6.2.2).
            encoded.push(0);
            encode_string(name, &mut encoded);
            encode_string(value, &mut encoded);
        }
        write_block(block, &encoded, out);
        Ok(())
    }
}

/// Writes a header block as `HEADERS` and as many `CONTINUATION`s as it takes.
fn write_block(block: &Block, encoded: &[u8], out: &mut Vec<u8>) {
    let priority = block.priority.as_ref().map_or(&[][..], |p| &p[..]);
    let first = encoded.len().min(MAX_FRAME - priority.len());
    let (head, mut rest) = encoded.split_at(first);
    let mut flags = block.flags;
    if block.priority.is_some() {
        flags |= flag::PRIORITY;
    }
    if rest.is_empty() {
        flags |= flag::END_HEADERS;
    }
    frame_header(
        priority.len() + head.len(),
        kind::HEADERS,
        flags,
        block.stream,
        out,
    );
    out.extend_from_slice(priority);
    out.extend_from_slice(head);
    while !rest.is_empty() {
        let n = rest.len().min(MAX_FRAME);
        let (chunk, tail) = rest.split_at(n);
        rest = tail;
        let flags = if rest.is_empty() { flag::END_HEADERS } else { 0 };
        frame_header(chunk.len(), kind::CONTINUATION, flags, block.stream, out);
        out.extend_from_slice(chunk);
    }
}

fn frame_header(length: usize, kind: u8, flags: u8, stream: u32, out: &mut Vec<u8>) {
    let len = u32::try_from(length).unwrap_or(u32::MAX).to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
}

/// An HPACK string literal without Huffman coding (RFC 7541 §5.2).
fn encode_string(s: &[u8], out: &mut Vec<u8>) {
    encode_integer(s.len(), 7, 0, out);
    out.extend_from_slice(s);
}

/// An HPACK integer with an `n`-bit prefix (RFC 7541 §5.1).
fn encode_integer(mut value: usize, prefix: u8, high: u8, out: &mut Vec<u8>) {
    let max = (1usize << prefix) - 1;
    if value < max {
        out.push(high | value as u8);
        return;
    }
    out.push(high | max as u8);
    value -= max;
    while value >= 128 {
        out.push((value % 128) as u8 | 0x80);
        value /= 128;
    }
    out.push(value as u8);
}

/// Why the HTTP/2 server would refuse these request headers, when it can be told from them.
fn diagnose(fields: &[(Vec<u8>, Vec<u8>)]) -> Option<String> {
    const CONNECTION_SPECIFIC: [&[u8]; 5] = [
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"upgrade",
    ];
    for (name, value) in fields {
        let shown = || String::from_utf8_lossy(name).escape_debug().to_string();
        if name.iter().any(u8::is_ascii_uppercase) {
            return Some(format!("uppercase header name {}", shown()));
        }
        if CONNECTION_SPECIFIC.contains(&name.as_slice()) {
            return Some(format!("connection-specific header {}", shown()));
        }
        if name.as_slice() == b"te" && value.as_slice() != b"trailers" {
            return Some("te header other than \"trailers\"".to_owned());
        }
        if name.first() == Some(&b':')
            && ![&b":method"[..], b":scheme", b":path", b":authority", b":protocol"]
                .contains(&name.as_slice())
        {
            return Some(format!("unknown pseudo-header {}", shown()));
        }
    }
    for required in [&b":method"[..], b":scheme", b":path"] {
        if !fields.iter().any(|(n, _)| n.as_slice() == required) {
            return Some(format!("missing {}", String::from_utf8_lossy(required)));
        }
    }
    None
}

/// The server-to-client direction: only watched, for the refusal log.
#[derive(Default)]
struct Outbound {
    header: [u8; FRAME_HEADER],
    header_len: usize,
    /// The frame being skipped or collected.
    current: Option<(FrameHeader, usize)>,
    collected: Vec<u8>,
    /// `SETTINGS_HEADER_TABLE_SIZE` the server announced, not yet applied.
    header_table_size: Option<usize>,
    /// `SETTINGS_MAX_FRAME_SIZE` the server announced, not yet applied.
    max_frame_size: Option<usize>,
}

/// The most of a `GOAWAY`'s debug data that is logged.
const MAX_DEBUG_DATA: usize = 256;

impl Outbound {
    fn observe(&mut self, mut bytes: &[u8], streams: &mut Streams) {
        while !bytes.is_empty() {
            match self.current.as_mut() {
                None => {
                    let n = (FRAME_HEADER - self.header_len).min(bytes.len());
                    let (head, rest) = bytes.split_at(n);
                    if let Some(dst) = self.header.get_mut(self.header_len..self.header_len + n) {
                        dst.copy_from_slice(head);
                    }
                    self.header_len += n;
                    bytes = rest;
                    if self.header_len == FRAME_HEADER {
                        self.header_len = 0;
                        let header = FrameHeader::parse(&self.header);
                        self.collected.clear();
                        if header.length == 0 {
                            self.frame_done(header, streams);
                        } else {
                            self.current = Some((header, header.length));
                        }
                    }
                }
                Some((header, remaining)) => {
                    let n = (*remaining).min(bytes.len());
                    let (head, rest) = bytes.split_at(n);
                    if matches!(header.kind, kind::RST_STREAM | kind::GOAWAY | kind::SETTINGS) {
                        let room = (8 + MAX_DEBUG_DATA).saturating_sub(self.collected.len());
                        self.collected
                            .extend_from_slice(head.get(..n.min(room)).unwrap_or_default());
                    }
                    *remaining -= n;
                    bytes = rest;
                    if *remaining == 0 {
                        let header = *header;
                        self.current = None;
                        self.frame_done(header, streams);
                    }
                }
            }
        }
    }

    fn frame_done(&mut self, header: FrameHeader, streams: &Streams) {
        let word = |at: usize| {
            self.collected
                .get(at..at + 4)
                .and_then(|b| <[u8; 4]>::try_from(b).ok())
                .map(u32::from_be_bytes)
        };
        match header.kind {
            kind::SETTINGS if header.flags & flag::ACK == 0 => {
                for setting in self.collected.chunks_exact(6) {
                    let &[a, b, c, d, e, f] = setting else { continue };
                    let value = usize::try_from(u32::from_be_bytes([c, d, e, f])).unwrap_or(usize::MAX);
                    match u16::from_be_bytes([a, b]) {
                        0x1 => self.header_table_size = Some(value),
                        0x5 => self.max_frame_size = Some(value),
                        _ => {}
                    }
                }
            }
            kind::RST_STREAM => {
                let code = word(0).unwrap_or(0);
                let (path, problem) = streams.about(header.stream);
                if matches!(code, 0 | 8) {
                    debug!(stream = header.stream, code = error_name(code), %path, "stream reset");
                } else {
                    warn!(
                        stream = header.stream,
                        code = error_name(code),
                        %path,
                        reason = %problem,
                        "stream refused below the gRPC layer"
                    );
                }
            }
            kind::GOAWAY => {
                let code = word(4).unwrap_or(0);
                let debug_data = self.collected.get(8..).unwrap_or_default();
                let debug_data = String::from_utf8_lossy(debug_data).escape_debug().to_string();
                if code == 0 {
                    debug!(last_stream = word(0).unwrap_or(0), "connection going away");
                } else {
                    // A connection error names no stream: the latest request explains it, if
                    // anything does.
                    let (path, problem) = streams.latest();
                    warn!(
                        last_stream = word(0).unwrap_or(0) & 0x7fff_ffff,
                        code = error_name(code),
                        debug = %debug_data,
                        %path,
                        reason = %problem,
                        "connection refused below the gRPC layer"
                    );
                }
            }
            _ => {}
        }
    }
}

/// The name of an HTTP/2 error code (RFC 9113 §7).
fn error_name(code: u32) -> &'static str {
    match code {
        0x0 => "NO_ERROR",
        0x1 => "PROTOCOL_ERROR",
        0x2 => "INTERNAL_ERROR",
        0x3 => "FLOW_CONTROL_ERROR",
        0x4 => "SETTINGS_TIMEOUT",
        0x5 => "STREAM_CLOSED",
        0x6 => "FRAME_SIZE_ERROR",
        0x7 => "REFUSED_STREAM",
        0x8 => "CANCEL",
        0x9 => "COMPRESSION_ERROR",
        0xa => "CONNECT_ERROR",
        0xb => "ENHANCE_YOUR_CALM",
        0xc => "INADEQUATE_SECURITY",
        0xd => "HTTP_1_1_REQUIRED",
        _ => "UNKNOWN",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        frame_header(payload.len(), kind, flags, stream, &mut out);
        out.extend_from_slice(payload);
        out
    }

    /// Feeds `input` in chunks of `step` bytes and returns what the server would read.
    fn run(input: &[u8], step: usize) -> Result<Vec<u8>, Refusal> {
        let mut inbound = Inbound::default();
        let mut streams = Streams::default();
        let mut out = Vec::new();
        for chunk in input.chunks(step) {
            inbound.feed(chunk, &mut out, &mut streams)?;
        }
        Ok(out)
    }

    /// Splits the server's view into frames and decodes every header block.
    type Fields = Vec<(Vec<u8>, Vec<u8>)>;

    fn server_view(bytes: &[u8]) -> Vec<(u8, u32, Fields)> {
        assert_eq!(&bytes[..24], PREFACE);
        let mut rest = &bytes[24..];
        let mut decoder = loona_hpack::Decoder::new();
        let mut frames = Vec::new();
        let mut block = Vec::new();
        while !rest.is_empty() {
            let header = FrameHeader::parse(rest[..9].try_into().unwrap());
            let payload = &rest[9..9 + header.length];
            rest = &rest[9 + header.length..];
            match header.kind {
                kind::HEADERS | kind::CONTINUATION => {
                    let skip = if header.flags & flag::PRIORITY != 0 { 5 } else { 0 };
                    block.extend_from_slice(&payload[skip..]);
                    if header.flags & flag::END_HEADERS != 0 {
                        let fields = decoder.decode(&block).unwrap();
                        block.clear();
                        frames.push((kind::HEADERS, header.stream, fields));
                    }
                }
                k => frames.push((k, header.stream, Vec::new())),
            }
        }
        frames
    }

    fn request(encoder: &mut loona_hpack::Encoder<'_>, authority: &[u8]) -> Vec<u8> {
        encoder.encode(vec![
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/capstan.v1.RuntimeService/Connect"),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ])
    }

    #[test]
    fn socket_path_authorities_become_localhost_and_indexing_stays_consistent() {
        let mut encoder = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[]));
        // The client indexes the bad authority, then refers to it by index.
        let first = request(&mut encoder, b"%2Frun%2Fcapstan%2Fcapstan.sock");
        let second = request(&mut encoder, b"%2Frun%2Fcapstan%2Fcapstan.sock");
        assert!(
            second.len() < first.len(),
            "the second block uses the dynamic table"
        );
        input.extend(frame(kind::HEADERS, flag::END_HEADERS, 1, &first));
        input.extend(frame(0x0, flag::END_STREAM, 1, b"hello"));
        // A block split over HEADERS (padded, with priority) and a CONTINUATION.
        let (a, b) = second.split_at(3);
        let mut padded = vec![4u8];
        padded.extend_from_slice(&[0, 0, 0, 0, 16]);
        padded.extend_from_slice(a);
        padded.extend_from_slice(&[0; 4]);
        input.extend(frame(kind::HEADERS, flag::PADDED | flag::PRIORITY, 3, &padded));
        input.extend(frame(kind::CONTINUATION, flag::END_HEADERS, 3, b));
        for step in [1, 7, 4096] {
            let view = server_view(&run(&input, step).unwrap());
            assert_eq!(view.len(), 4, "settings, headers, data, headers");
            for (kind, _, fields) in view.iter().filter(|(k, ..)| *k == kind::HEADERS) {
                assert_eq!(*kind, kind::HEADERS);
                let authority = fields.iter().find(|(n, _)| n == b":authority").unwrap();
                assert_eq!(authority.1, b"localhost");
                assert!(
                    fields
                        .iter()
                        .any(|(n, v)| n == b":path" && v.starts_with(b"/capstan"))
                );
            }
        }
    }

    #[test]
    fn valid_authorities_are_kept() {
        let mut encoder = loona_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            kind::HEADERS,
            flag::END_HEADERS,
            1,
            &request(&mut encoder, b"127.0.0.1:7000"),
        ));
        let view = server_view(&run(&input, 5).unwrap());
        assert!(
            view[0]
                .2
                .contains(&(b":authority".to_vec(), b"127.0.0.1:7000".to_vec()))
        );
    }

    #[test]
    fn large_blocks_are_split_into_continuations() {
        let mut encoder = loona_hpack::Encoder::new();
        let big = vec![b'x'; 40_000];
        let block = encoder.encode(vec![(&b":path"[..], &b"/x"[..]), (b"x-big", &big[..])]);
        let mut input = PREFACE.to_vec();
        for (i, chunk) in block.chunks(MAX_FRAME).enumerate() {
            let last = (i + 1) * MAX_FRAME >= block.len();
            let kind = if i == 0 { kind::HEADERS } else { kind::CONTINUATION };
            input.extend(frame(kind, if last { flag::END_HEADERS } else { 0 }, 1, chunk));
        }
        let out = run(&input, 10_000).unwrap();
        let view = server_view(&out);
        assert!(view[0].2.iter().any(|(n, v)| n == b"x-big" && v.len() == 40_000));
    }

    #[test]
    fn malformed_sequences_are_refused() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(kind::HEADERS, 0, 1, &[0x82]));
        input.extend(frame(0x0, 0, 1, b"x"));
        assert!(matches!(run(&input, 100), Err(Refusal::Sequence(_))));
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            kind::HEADERS,
            flag::END_HEADERS,
            1,
            &[0xff, 0xff, 0xff, 0xff, 0x0f],
        ));
        assert!(matches!(run(&input, 100), Err(Refusal::Compression(_))));
        let mut input = PREFACE.to_vec();
        input.extend(frame(kind::CONTINUATION, flag::END_HEADERS, 1, &[0x82]));
        assert!(matches!(run(&input, 100), Err(Refusal::Sequence(_))));
    }

    #[test]
    fn the_servers_settings_are_followed() {
        let mut outbound = Outbound::default();
        let mut streams = Streams::default();
        let mut settings = Vec::new();
        settings.extend_from_slice(&[0, 1, 0, 0, 0x20, 0]);
        settings.extend_from_slice(&[0, 5, 0, 1, 0, 0]);
        let bytes = frame(kind::SETTINGS, 0, 0, &settings);
        // Written in pieces, as the server's writes come.
        for chunk in bytes.chunks(4) {
            outbound.observe(chunk, &mut streams);
        }
        assert_eq!(outbound.header_table_size, Some(8_192));
        assert_eq!(outbound.max_frame_size, Some(65_536));
        let mut ack = Outbound::default();
        ack.observe(&frame(kind::SETTINGS, flag::ACK, 0, &[]), &mut streams);
        assert_eq!(ack.header_table_size, None);
    }

    #[test]
    fn other_protocols_pass_through_untouched() {
        let input = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        assert_eq!(run(input, 3).unwrap(), input);
    }

    #[test]
    fn integers_encode_as_rfc_7541_says() {
        let mut out = Vec::new();
        encode_integer(1337, 5, 0, &mut out);
        assert_eq!(out, [31, 154, 10]);
        out.clear();
        encode_integer(10, 5, 0, &mut out);
        assert_eq!(out, [10]);
    }

    #[test]
    fn refusals_are_explained() {
        let fields = |pairs: &[(&str, &str)]| -> Vec<(Vec<u8>, Vec<u8>)> {
            pairs
                .iter()
                .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
                .collect()
        };
        let ok = [(":method", "POST"), (":scheme", "http"), (":path", "/x")];
        assert_eq!(diagnose(&fields(&ok)), None);
        let mut bad = ok.to_vec();
        bad.push(("Connection", "close"));
        assert!(diagnose(&fields(&bad)).unwrap().contains("uppercase"));
        assert!(diagnose(&fields(&ok[..2])).unwrap().contains(":path"));
    }

    #[tokio::test(start_paused = true)]
    async fn silent_connections_are_closed_after_the_handshake_timeout() {
        use tokio::io::AsyncReadExt;
        let (client, server) = tokio::io::duplex(1024);
        let mut guarded = Guarded::new(server, Duration::from_secs(10));
        let err = guarded.read(&mut [0u8; 16]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        drop(client);
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_ends_with_the_first_frame() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, server) = tokio::io::duplex(1024);
        let mut guarded = Guarded::new(server, Duration::from_secs(10));
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(0x4, 0, 0, &[]));
        client.write_all(&hello).await.unwrap();
        let mut got = vec![0u8; hello.len()];
        guarded.read_exact(&mut got).await.unwrap();
        assert_eq!(got, hello);
        let read = tokio::time::timeout(Duration::from_secs(60), guarded.read(&mut [0u8; 1])).await;
        assert!(read.is_err(), "still open after the handshake timeout");
    }
}
