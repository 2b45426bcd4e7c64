//! Hostile peers of the admission webhook port: connections that stall after the TLS handshake,
//! send half a header, trickle a body, never start TLS or idle after a review on a keep-alive
//! connection, more of them than the server has
//! connection slots; and a burst of 8 MiB bodies (flat arrays, deep nesting, well-formed
//! reviews) at once. Throughout, a legitimate review is answered within a second, every bad
//! connection is closed by the server within 30 s, and the controller's resident memory stays
//! within its budget.
//!
//! The legitimate reviews come both as the API server sends them (one keep-alive connection,
//! reused, opened again when the server closed it while idle, as Go's client does) and each on
//! a connection of its own, so that a full server must shed hostile connections and never one
//! whose request is arriving.
//!
//! Sizes: CI by default (160 hostile connections over 128 slots); `CAPSTAN_FAULTS_LONG=1`
//! (`scripts/faults.sh --long`) runs 1,100 against the default 1,024 slots.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow, ensure};
use capstan::webhooks::certs::{self, Generated};
use capstan_tests::{
    faults::{self, peak_rss_kib},
    process::free_port,
    scenario::{Scenario, tail},
    webhook_tls,
};
use futures::{StreamExt as _, stream};
use rustls_pki_types::ServerName;
use serde_json::{Value, json};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
    time::Instant,
};
use tokio_rustls::{TlsConnector, client::TlsStream};

/// The slowest a legitimate review may be answered while the port is under attack.
const LEGIT_BOUND: Duration = Duration::from_secs(1);
/// The longest a hostile connection may stay open.
const CLOSE_BOUND: Duration = Duration::from_secs(30);
/// The controller's resident memory while big bodies arrive (a debug build).
const RSS_BOUND_KIB: u64 = 128 * 1024;

fn write_certs(dir: &std::path::Path, generated: &Generated) -> Result<()> {
    for (name, text) in [
        (certs::CA_FILE, &generated.ca),
        (certs::CERT_FILE, &generated.chain),
        (certs::KEY_FILE, &generated.key),
    ] {
        std::fs::write(dir.join(name), text)?;
    }
    Ok(())
}

async fn tls(port: u16, connector: &TlsConnector) -> Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
    let name = ServerName::try_from("127.0.0.1")?.to_owned();
    Ok(tokio::time::timeout(Duration::from_secs(20), connector.connect(name, tcp)).await??)
}

/// The status of the HTTP answer in `out`, if any.
fn status_of(out: &[u8]) -> Option<u16> {
    let text = String::from_utf8_lossy(out.get(..out.len().min(64)).unwrap_or_default()).into_owned();
    text.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

/// An answer's status (`None`: closed without one) and body.
type Answered = (Option<u16>, String);

/// Sends `head` and `body` over a new TLS connection; returns the answer's status (`None`:
/// closed without an answer) and body.
async fn exchange(
    port: u16,
    connector: &TlsConnector,
    head: &str,
    body: &[u8],
) -> Result<(Option<u16>, String)> {
    let mut tls = tls(port, connector).await?;
    tls.write_all(head.as_bytes()).await?;
    // The server may answer (413) and close before it has read everything.
    let _ = tls.write_all(body).await;
    let _ = tls.flush().await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), tls.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status_of(&out), body))
}

fn review(uid: &str, object: &Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "demo.capstan.dev", "version": "v1", "kind": "Example"},
            "resource": {"group": "demo.capstan.dev", "version": "v1", "resource": "examples"},
            "namespace": "default",
            "name": "direct",
            "operation": "CREATE",
            "userInfo": {"username": "tester"},
            "object": object,
            "dryRun": false
        }
    }))
    .unwrap_or_default()
}

fn legit_object(size: i64) -> Value {
    json!({"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
           "metadata": {"name": "direct", "namespace": "default"}, "spec": {"size": size}})
}

fn head(length: Option<usize>) -> String {
    match length {
        Some(n) => format!(
            "POST /validate?timeout=10s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n"
        ),
        None => "POST /validate?timeout=10s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_owned(),
    }
}

/// One legitimate review on a connection of its own: answered by the handler (size 20 is
/// denied with its message).
async fn legit(port: u16, connector: &TlsConnector) -> Result<Duration> {
    let started = Instant::now();
    let body = review("legit", &legit_object(20));
    let (status, answer) = tokio::time::timeout(
        Duration::from_secs(15),
        exchange(port, connector, &head(Some(body.len())), &body),
    )
    .await
    .context("no answer to a legitimate review in 15 s")??;
    judge(status, &answer)?;
    Ok(started.elapsed())
}

/// Whether an answer is the handler's verdict on a legitimate review.
fn judge(status: Option<u16>, answer: &str) -> Result<()> {
    ensure!(
        status == Some(200),
        "a legitimate review got {status:?}: {answer}"
    );
    ensure!(answer.contains("size 20 is too large"), "{answer}");
    Ok(())
}

/// A legitimate caller as the API server is one: reviews one after another on one keep-alive
/// connection. As Go's HTTP client does, it opens a new connection when the server closed the
/// idle one before a request is sent; a connection closed once a request is on its way is a
/// failure.
struct KeptAlive {
    port: u16,
    connector: TlsConnector,
    tls: TlsStream<TcpStream>,
    /// Idle connections the server closed.
    reopened: usize,
}

impl KeptAlive {
    async fn open(port: u16, connector: &TlsConnector) -> Result<Self> {
        Ok(Self {
            port,
            connector: connector.clone(),
            tls: tls(port, connector).await?,
            reopened: 0,
        })
    }

    /// Whether the server closed the idle connection (asked without waiting).
    async fn closed_while_idle(&mut self) -> bool {
        let mut buf = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::ZERO, self.tls.read(&mut buf)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    /// One review on the open connection; how long its answer took.
    async fn review(&mut self) -> Result<Duration> {
        if self.closed_while_idle().await {
            self.tls = tls(self.port, &self.connector).await?;
            self.reopened += 1;
        }
        let started = Instant::now();
        let body = review("kept-alive-legit", &legit_object(20));
        let head = head(Some(body.len())).replace("Connection: close", "Connection: keep-alive");
        self.tls.write_all(head.as_bytes()).await?;
        self.tls.write_all(&body).await?;
        self.tls.flush().await?;
        let (status, answer) = tokio::time::timeout(Duration::from_secs(15), self.answer())
            .await
            .context("no answer to a legitimate review on a keep-alive connection in 15 s")??;
        judge(status, &answer).context("a legitimate review on a keep-alive connection was not answered")?;
        Ok(started.elapsed())
    }

    /// Reads one answer: its head, then as many body bytes as its `Content-Length` says.
    async fn answer(&mut self) -> Result<Answered> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            if let Some(end) = out.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&out[..end]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if out.len() >= end + 4 + length {
                    let body = String::from_utf8_lossy(&out[end + 4..end + 4 + length]);
                    return Ok((status_of(&out), body.into_owned()));
                }
            }
            match self.tls.read(&mut buf).await? {
                0 => return Ok((status_of(&out), String::from_utf8_lossy(&out).into_owned())),
                n => out.extend_from_slice(&buf[..n]),
            }
        }
    }
}

async fn start(dir: &tempfile::TempDir, extra: &[&str]) -> Result<(Scenario, u16, TlsConnector)> {
    let generated = certs::generate_pem(&certs::names(None, &[]))?;
    write_certs(dir.path(), &generated)?;
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let cert_dir = dir.path().to_string_lossy().into_owned();
    let mut args = vec![
        "--webhooks",
        "on",
        "--webhook-listen",
        &listen,
        "--webhook-cert-dir",
        &cert_dir,
    ];
    args.extend_from_slice(extra);
    let s = Scenario::start("validate", &args).await?;
    let connector = webhook_tls::connector(generated.ca.as_bytes(), None)?;
    legit(port, &connector).await?;
    Ok((s, port, connector))
}

/// The ways a hostile peer holds a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hostile {
    /// TLS, then nothing.
    Idle,
    /// TLS, then half a request header.
    StalledHeader,
    /// TLS, a header announcing a body, then a byte every two seconds.
    TrickledBody,
    /// TCP, and no TLS handshake at all.
    NoHandshake,
    /// One review on a keep-alive connection, answered, then nothing.
    KeptAlive,
}

/// Opens one hostile connection and holds it until the server closes it; returns how long that
/// took (or `None`: not closed within the bound).
async fn hostile(
    port: u16,
    connector: TlsConnector,
    kind: Hostile,
    counted: &AtomicUsize,
) -> Result<Option<Duration>> {
    if kind == Hostile::NoHandshake {
        let connected = TcpStream::connect(("127.0.0.1", port)).await;
        counted.fetch_add(1, Ordering::Relaxed);
        let mut tcp = connected?;
        let opened = Instant::now();
        let mut buf = [0u8; 256];
        let closed = tokio::time::timeout(CLOSE_BOUND + Duration::from_secs(5), async {
            loop {
                match tcp.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        return Ok(closed.ok().map(|()| opened.elapsed()));
    }
    let connecting = Instant::now();
    // A connection still in its handshake may be the longest idle one when the slots are
    // full: closed by the server, as it should be.
    let handshake = tls(port, &connector).await;
    counted.fetch_add(1, Ordering::Relaxed);
    let Ok(stream) = handshake else {
        return Ok(Some(connecting.elapsed()));
    };
    let opened = Instant::now();
    let (mut reader, mut writer) = tokio::io::split(stream);
    let kept_alive = {
        let body = review("kept-alive", &legit_object(1));
        let mut request = head(Some(body.len())).replace("Connection: close", "Connection: keep-alive");
        request.push_str(&String::from_utf8_lossy(&body));
        request.into_bytes()
    };
    let start: &[u8] = match kind {
        Hostile::StalledHeader => b"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty",
        Hostile::TrickledBody => {
            b"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n"
        }
        Hostile::KeptAlive => &kept_alive,
        _ => b"",
    };
    // A write that fails: the server closed the connection already (its slot was needed).
    if writer.write_all(start).await.is_err() || writer.flush().await.is_err() {
        return Ok(Some(opened.elapsed()));
    }
    let trickle = kind == Hostile::TrickledBody;
    let closed = tokio::time::timeout(CLOSE_BOUND + Duration::from_secs(5), async move {
        let mut buf = [0u8; 1024];
        let mut tick = tokio::time::interval(Duration::from_secs(2));
        loop {
            tokio::select! {
                read = reader.read(&mut buf) => match read {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                },
                _ = tick.tick(), if trickle => {
                    if writer.write_all(b" ").await.is_err() || writer.flush().await.is_err() {
                        return;
                    }
                }
            }
        }
    })
    .await;
    Ok(closed.ok().map(|()| opened.elapsed()))
}

/// The two tests load the machine heavily; run one at a time, so that one's bodies do not
/// stretch the other's latencies.
fn one_at_a_time() -> &'static tokio::sync::Mutex<()> {
    static SERIAL: std::sync::OnceLock<tokio::sync::Mutex<()>> = std::sync::OnceLock::new();
    SERIAL.get_or_init(|| tokio::sync::Mutex::new(()))
}

#[tokio::test]
async fn hostile_connections_are_closed_and_a_legitimate_review_is_answered_throughout() -> Result<()> {
    let _serial = one_at_a_time().lock().await;
    let long = faults::long();
    let n = faults::size(160, 1100);
    let dir = tempfile::tempdir()?;
    let slots = if long { "1024" } else { "128" };
    let (s, port, connector) = start(&dir, &["--webhook-max-connections", slots]).await?;

    // Legitimate reviews every 200 ms while the hostile connections are held and shed, from a
    // thread of their own so that the attackers' handshakes do not delay them on this side.
    // They start once the burst of hostile connections is open: a connection made in the very
    // instant of a burst beyond the slots is as old as the attackers' and may give way with
    // them before its request arrives (the server cannot tell them apart yet).
    let done = Arc::new(AtomicBool::new(false));
    let counted = Arc::new(AtomicUsize::new(0));
    let probe = {
        let (done, connector, counted) = (done.clone(), connector.clone(), counted.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async move {
                let burst = Instant::now();
                while counted.load(Ordering::Relaxed) < n && burst.elapsed() < Duration::from_secs(5) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let mut kept_alive = KeptAlive::open(port, &connector).await?;
                let one_each = async {
                    let mut slowest = Duration::ZERO;
                    let mut count = 0usize;
                    while !done.load(Ordering::Relaxed) {
                        slowest = slowest.max(legit(port, &connector).await?);
                        count += 1;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Ok::<_, anyhow::Error>((slowest, count))
                };
                let reused = async {
                    let mut slowest = Duration::ZERO;
                    let mut count = 0usize;
                    while !done.load(Ordering::Relaxed) {
                        slowest = slowest.max(kept_alive.review().await?);
                        count += 1;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Ok::<_, anyhow::Error>((slowest, count))
                };
                let ((a, m), (b, k)) = tokio::try_join!(one_each, reused)?;
                println!(
                    "the kept-alive legitimate connection was closed while idle {} times",
                    kept_alive.reopened
                );
                Ok::<_, anyhow::Error>((a.max(b), m + k))
            })
        })
    };
    let kinds = [
        Hostile::Idle,
        Hostile::StalledHeader,
        Hostile::TrickledBody,
        Hostile::NoHandshake,
        Hostile::KeptAlive,
    ];
    let started = Instant::now();
    let results: Vec<(Hostile, Result<Option<Duration>>)> = stream::iter(0..n)
        .map(|i| {
            let kind = kinds[i % kinds.len()];
            let (connector, counted) = (connector.clone(), counted.clone());
            async move { (kind, hostile(port, connector, kind, &counted).await) }
        })
        .buffer_unordered(n)
        .collect()
        .await;
    done.store(true, Ordering::Relaxed);
    let (slowest, probes) = probe.join().map_err(|_| anyhow!("the probe thread panicked"))??;
    let mut latest = Duration::ZERO;
    let mut open = 0usize;
    let mut open_kinds = Vec::new();
    let mut failed = Vec::new();
    for (kind, result) in results {
        match result {
            Ok(Some(took)) => latest = latest.max(took),
            Ok(None) => {
                open += 1;
                if !open_kinds.contains(&kind) {
                    open_kinds.push(kind);
                }
            }
            Err(e) => failed.push(e.to_string()),
        }
    }
    println!(
        "{n} hostile connections: the last closed after {:.1} s, {open} still open, {} not opened; \
         {probes} legitimate reviews, the slowest in {} ms; {:.1} s in all",
        latest.as_secs_f64(),
        failed.len(),
        slowest.as_millis(),
        started.elapsed().as_secs_f64()
    );
    let log = || tail(&s.controller.process.output(), 40);
    ensure!(
        failed.len() <= n / 100,
        "hostile connections could not even be opened: {:?}",
        failed.first()
    );
    ensure!(
        open == 0,
        "{open} hostile connections ({open_kinds:?}) were not closed in {CLOSE_BOUND:?}\n{}",
        log()
    );
    ensure!(latest <= CLOSE_BOUND);
    ensure!(
        slowest < LEGIT_BOUND,
        "a legitimate review took {slowest:?} while the port was under attack\n{}",
        log()
    );
    if let Err(e) = legit(port, &connector).await {
        eprintln!(
            "FINAL LEGIT FAILED: {e:?}\n{}",
            tail(&s.controller.process.output(), 60)
        );
        return Err(e);
    }
    Ok(())
}

/// What a big body holds.
#[derive(Clone, Copy, Debug)]
enum Big {
    /// `{"a":[0,0,…]}`.
    Flat,
    /// `[[[[…]]]]`.
    Nested,
    /// An `AdmissionReview` whose object carries a long array.
    Review,
}

fn big(kind: Big, bytes: usize) -> Vec<u8> {
    match kind {
        Big::Flat => {
            let mut out = b"{\"a\":[0".to_vec();
            while out.len() + 4 < bytes {
                out.extend_from_slice(b",0");
            }
            out.extend_from_slice(b"]}");
            out
        }
        Big::Nested => {
            let half = bytes / 2;
            let mut out = vec![b'['; half];
            out.extend(std::iter::repeat_n(b']', half));
            out
        }
        Big::Review => {
            let mut object = legit_object(1);
            let count = bytes.saturating_sub(1024) / 2;
            object["spec"]["items"] = Value::Array(vec![json!(0); count]);
            review("big", &object)
        }
    }
}

#[tokio::test]
async fn concurrent_big_bodies_stay_within_the_memory_budget() -> Result<()> {
    let _serial = one_at_a_time().lock().await;
    let dir = tempfile::tempdir()?;
    let (s, port, connector) = start(&dir, &[]).await?;
    let pid = s
        .controller
        .process
        .id()
        .context("the controller is not running")?;
    let before = peak_rss_kib(pid).context("no VmHWM for the controller")?;

    // 20 at once of each size: just under 8 MiB (what the API server never sends), and 5 MiB
    // (under the body limit, so that the parse is what the budget has to bound).
    for bytes in [(8 << 20) - 4096, 5 << 20] {
        let bodies: Vec<(Big, bool, Arc<Vec<u8>>)> = (0..20)
            .map(|i| {
                let kind = [Big::Flat, Big::Nested, Big::Review][i % 3];
                (kind, i % 2 == 0, Arc::new(big(kind, bytes)))
            })
            .collect();
        let answers: Vec<(Big, bool, Result<Answered>)> = stream::iter(bodies)
            .map(|(kind, declared, body)| {
                let connector = connector.clone();
                async move {
                    let answer = if declared {
                        exchange(port, &connector, &head(Some(body.len())), &body).await
                    } else {
                        let mut chunked = format!("{:x}\r\n", body.len()).into_bytes();
                        chunked.extend_from_slice(&body);
                        chunked.extend_from_slice(b"\r\n0\r\n\r\n");
                        exchange(port, &connector, &head(None), &chunked).await
                    };
                    (kind, declared, answer)
                }
            })
            .buffer_unordered(20)
            .collect()
            .await;
        let mut seen = Vec::new();
        for (kind, declared, answer) in answers {
            let (status, text) = answer.map_err(|e| anyhow!("{kind:?} (declared {declared}): {e}"))?;
            // Answered, or refused (400 not a review, 413 too large, 429/503 over the budget),
            // or closed by the server before the whole body was sent.
            ensure!(
                matches!(status, None | Some(200 | 400 | 413 | 429 | 503)),
                "{kind:?} of {bytes} bytes (declared {declared}): {status:?} {text}"
            );
            seen.push(format!(
                "{kind:?}/{}: {status:?}",
                if declared { "length" } else { "chunked" }
            ));
        }
        let peak = peak_rss_kib(pid).context("no VmHWM for the controller")?;
        println!(
            "20 bodies of {bytes} bytes: {}; controller peak RSS {:.1} MiB (before: {:.1} MiB)",
            seen.join(", "),
            peak as f64 / 1024.0,
            before as f64 / 1024.0
        );
        ensure!(
            peak < RSS_BOUND_KIB,
            "the controller's peak RSS {peak} KiB is over {RSS_BOUND_KIB} KiB\n{}",
            tail(&s.controller.process.output(), 30)
        );
        let took = legit(port, &connector).await?;
        ensure!(took < LEGIT_BOUND * 5, "the next legitimate review took {took:?}");
    }
    Ok(())
}
