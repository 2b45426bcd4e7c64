//! The client-to-server direction of `grpc::frames`: a frame parser that passes every frame
//! through except header blocks, which it decodes (following the client's HPACK dynamic
//! table), repairs (`:authority`) and encodes again with literals only.

use tracing::{debug, info};

use super::{
    FRAME_HEADER, FrameHeader, HEADER_TABLE_SIZE, LOCALHOST, MAX_BLOCK, MAX_FRAME, PREFACE, Refusal, Streams,
    flag, kind,
};

/// The client-to-server direction: a frame parser that rewrites header blocks.
pub(super) struct Inbound {
    state: InState,
    /// A `HEADERS` frame waiting for its `CONTINUATION`s.
    open_block: Option<Block>,
    pub(super) decoder: loona_hpack::Decoder<'static>,
    /// The largest header frame accepted (the server's `SETTINGS_MAX_FRAME_SIZE`).
    pub(super) max_frame: usize,
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
    pub(super) fn handshaken(&self) -> bool {
        self.frames > 0
    }

    /// Parses `input`, appending what the server should read to `out`.
    pub(super) fn feed(
        &mut self,
        mut input: &[u8],
        out: &mut Vec<u8>,
        streams: &mut Streams,
    ) -> Result<(), Refusal> {
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

pub(super) fn frame_header(length: usize, kind: u8, flags: u8, stream: u32, out: &mut Vec<u8>) {
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
pub(super) fn encode_integer(mut value: usize, prefix: u8, high: u8, out: &mut Vec<u8>) {
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
pub(super) fn diagnose(fields: &[(Vec<u8>, Vec<u8>)]) -> Option<String> {
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
