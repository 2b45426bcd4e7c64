//! Hostile peers on the admin port: a flood of idle connections, and connections that trickle
//! their headers, idle between requests, send bodies or never stop asking. The port has no
//! authentication, so every peer that can reach the pod can do this; the controller must
//! close such connections by itself, keep its descriptors bounded, and answer the kubelet's
//! `/healthz` within a second throughout.
//!
//! Sizes: a few hundred idle connections by default; `CAPSTAN_FAULTS_LONG=1`
//! (`scripts/faults.sh --long`) opens 2,000.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use capstan_tests::{faults, process::Controller, testenv::TestEnv};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
    time::Instant,
};

/// The controller's defaults (`--admin-connections`, `--admin-header-timeout`).
const CONNECTIONS: usize = 64;
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// Open descriptors of a process.
fn descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

/// GETs `/healthz` on a new connection, as the kubelet does; its status code and how long the
/// answer took (a failure or no answer within 5 s counts as 5 s).
async fn healthz(admin: &str) -> (u16, Duration) {
    let started = Instant::now();
    let code = tokio::time::timeout(Duration::from_secs(5), async {
        let mut stream = TcpStream::connect(admin).await.ok()?;
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.ok()?;
        String::from_utf8_lossy(&raw)
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
    })
    .await
    .ok()
    .flatten();
    (code.unwrap_or(0), started.elapsed())
}

/// Reads until the server closes the connection (EOF or reset); what it sent and when it
/// closed, measured from `since`.
async fn until_closed(mut stream: tokio::net::tcp::OwnedReadHalf, since: Instant) -> (Vec<u8>, Duration) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return (got, since.elapsed()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_flood_is_shed_and_healthz_is_answered_within_a_second() -> Result<()> {
    let n = faults::size(300, 2000);
    let env = TestEnv::start().await?;
    let controller = Controller::start(&env, "capstan", &[]).await?;
    let pid = controller.process.id().context("the controller is not running")?;
    let admin = controller.admin.clone();
    let baseline = descriptors(pid);

    // The flood: `n` connections that never send a byte, each watched until the server closes
    // it.
    let flood_open = Arc::new(AtomicBool::new(false));
    let flood = {
        let admin = admin.clone();
        let flood_open = flood_open.clone();
        tokio::spawn(async move {
            let mut closed = Vec::with_capacity(n);
            for _ in 0..n {
                let Ok(stream) = TcpStream::connect(&admin).await else {
                    continue;
                };
                let (read, write) = stream.into_split();
                closed.push(tokio::spawn(async move {
                    let closed = until_closed(read, Instant::now()).await;
                    drop(write);
                    closed.1
                }));
            }
            flood_open.store(true, Ordering::Relaxed);
            closed
        })
    };

    // The controller's descriptors while the flood opens. A probe that connects in the very
    // instant of a burst can lose its slot before its request arrives (nothing tells it from
    // the flood yet; the kubelet's failure threshold absorbs one such probe), so the probes
    // start once the flood is open, and run while the server holds and sheds it.
    let mut peak = baseline;
    let opening = Instant::now();
    while !flood_open.load(Ordering::Relaxed) && opening.elapsed() < HEADER_TIMEOUT {
        peak = peak.max(descriptors(pid));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // The kubelet meanwhile: a probe every 100 ms, and the controller's descriptors.
    let probing = HEADER_TIMEOUT + Duration::from_secs(5);
    let started = Instant::now();
    let mut latencies = Vec::new();
    let mut codes = Vec::new();
    while started.elapsed() < probing {
        let (code, took) = healthz(&admin).await;
        codes.push(code);
        latencies.push(took);
        peak = peak.max(descriptors(pid));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let watchers = flood.await?;
    let opened = watchers.len();
    let mut lifetimes = Vec::with_capacity(opened);
    // Every idle connection is closed by the header timeout at the latest.
    let deadline = Instant::now() + HEADER_TIMEOUT + Duration::from_secs(5);
    for mut w in watchers {
        match tokio::time::timeout_at(deadline, &mut w).await {
            Ok(lived) => lifetimes.push(lived?),
            Err(_) => {
                w.abort();
                lifetimes.push(Duration::MAX);
            }
        }
    }

    latencies.sort();
    let median = latencies[latencies.len() / 2];
    let worst = latencies[latencies.len() - 1];
    let open_too_long = lifetimes
        .iter()
        .filter(|l| **l > HEADER_TIMEOUT + Duration::from_secs(2))
        .count();
    println!(
        "{opened} idle connections: /healthz answered {} times, median {median:?}, worst {worst:?}; \
         controller descriptors {baseline} before, at most {peak} during the flood; \
         {open_too_long} connections open past the header timeout",
        latencies.len()
    );
    ensure!(opened == n, "only {opened} of {n} connections could be opened");
    ensure!(
        codes.iter().all(|c| *c == 200),
        "/healthz did not always answer 200: {codes:?}"
    );
    ensure!(worst < Duration::from_secs(1), "/healthz took {worst:?} at worst");
    ensure!(
        open_too_long == 0,
        "{open_too_long} idle connections stayed open past the header timeout"
    );
    ensure!(
        peak <= baseline + CONNECTIONS + 16,
        "the controller held {peak} descriptors during the flood ({baseline} before, cap {CONNECTIONS})"
    );
    Ok(())
}

/// One hostile connection: what it sends first, then what it keeps sending (every `every`),
/// and the window in which the server must close it.
struct Hostile {
    what: &'static str,
    first: &'static str,
    trickle: &'static str,
    every: Duration,
    closed_within: Duration,
    answer: Option<&'static str>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_headers_idle_keep_alives_and_bodies_are_cut_or_refused() -> Result<()> {
    let env = TestEnv::start().await?;
    let controller = Controller::start(
        &env,
        "capstan",
        &["--admin-header-timeout", "2s", "--admin-request-timeout", "4s"],
    )
    .await?;
    let admin = controller.admin.clone();
    let slack = Duration::from_millis(1500);
    let cases = [
        Hostile {
            what: "headers trickled a line at a time",
            first: "GET /healthz HTTP/1.1\r\nHost: admin\r\n",
            trickle: "X-Trickle: 1\r\n",
            every: Duration::from_millis(300),
            closed_within: Duration::from_secs(2) + slack,
            answer: None,
        },
        Hostile {
            what: "a kept-alive connection idle after its answer",
            first: "GET /healthz HTTP/1.1\r\nHost: admin\r\n\r\n",
            trickle: "",
            every: Duration::from_secs(3600),
            closed_within: Duration::from_secs(2) + slack,
            answer: Some("HTTP/1.1 200"),
        },
        Hostile {
            what: "an announced body, trickled",
            first: "POST /healthz HTTP/1.1\r\nHost: admin\r\nContent-Length: 1000000\r\n\r\n",
            trickle: "x",
            every: Duration::from_millis(300),
            closed_within: slack,
            answer: Some("HTTP/1.1 413"),
        },
        Hostile {
            what: "a chunked body, trickled",
            first: "GET /healthz HTTP/1.1\r\nHost: admin\r\nTransfer-Encoding: chunked\r\n\r\n",
            trickle: "1\r\nx\r\n",
            every: Duration::from_millis(300),
            closed_within: Duration::from_secs(4) + slack,
            answer: Some("HTTP/1.1 200"),
        },
        Hostile {
            what: "requests without end on one connection",
            first: "GET /healthz HTTP/1.1\r\nHost: admin\r\n\r\n",
            trickle: "GET /healthz HTTP/1.1\r\nHost: admin\r\n\r\n",
            every: Duration::from_millis(500),
            closed_within: Duration::from_secs(4) + slack,
            answer: Some("HTTP/1.1 200"),
        },
    ];
    let mut running = Vec::new();
    for case in cases {
        let stream = TcpStream::connect(&admin).await?;
        let since = Instant::now();
        let (read, mut write) = stream.into_split();
        let writer = tokio::spawn(async move {
            if write.write_all(case.first.as_bytes()).await.is_err() {
                return;
            }
            loop {
                tokio::time::sleep(case.every).await;
                if write.write_all(case.trickle.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
        let reader = tokio::spawn(tokio::time::timeout(
            Duration::from_secs(30),
            until_closed(read, since),
        ));
        running.push((case, reader, writer));
    }
    let mut failures = Vec::new();
    for (case, reader, writer) in running {
        let outcome = reader.await?;
        writer.abort();
        let Ok((got, after)) = outcome else {
            failures.push(format!("{}: still open after 30 s", case.what));
            continue;
        };
        let got = String::from_utf8_lossy(&got);
        println!("{}: closed by the server after {after:?}", case.what);
        if after > case.closed_within {
            failures.push(format!(
                "{}: closed after {after:?}, not within {:?}",
                case.what, case.closed_within
            ));
        }
        if let Some(answer) = case.answer
            && !got.starts_with(answer)
        {
            failures.push(format!("{}: answered {got:?}, not {answer}", case.what));
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    let (code, took) = healthz(&admin).await;
    ensure!(
        code == 200,
        "/healthz answered {code} after the hostile connections"
    );
    println!("/healthz answered in {took:?} afterwards");
    Ok(())
}
