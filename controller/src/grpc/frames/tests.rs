//! Unit tests of the HTTP/2 frame layer.

use super::{
    inbound::{diagnose, encode_integer, frame_header},
    *,
};

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
