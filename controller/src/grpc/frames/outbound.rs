//! The server-to-client direction of `grpc::frames`: watched, never changed. `RST_STREAM` and
//! `GOAWAY` frames with an error are logged with what the request asked for; the server's
//! `SETTINGS` tell the inbound side what the client may send.

use tracing::{debug, warn};

use super::{FRAME_HEADER, FrameHeader, Streams, flag, kind};

/// The server-to-client frame observer.
#[derive(Default)]
pub(super) struct Outbound {
    header: [u8; FRAME_HEADER],
    header_len: usize,
    /// The frame being skipped or collected.
    current: Option<(FrameHeader, usize)>,
    collected: Vec<u8>,
    /// `SETTINGS_HEADER_TABLE_SIZE` the server announced, not yet applied.
    pub(super) header_table_size: Option<usize>,
    /// `SETTINGS_MAX_FRAME_SIZE` the server announced, not yet applied.
    pub(super) max_frame_size: Option<usize>,
}

/// The most of a `GOAWAY`'s debug data that is logged.
const MAX_DEBUG_DATA: usize = 256;

impl Outbound {
    pub(super) fn observe(&mut self, mut bytes: &[u8], streams: &mut Streams) {
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
