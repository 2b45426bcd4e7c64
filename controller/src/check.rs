//! `capstan check`: checks a running controller through its admin endpoint.
//!
//! The chart's `helm test` hook runs it in the capstan image (distroless: no shell, no curl),
//! so that a test needs no other image. It passes when `/healthz` and `/readyz` answer 200
//! and `/metrics` counts at least one connected handler process
//! (`capstan_handler_processes`), and keeps trying until its timeout, because a test may start
//! while the operator is still starting. The admin endpoint is plain HTTP/1.1 without
//! authentication (`observability::admin`); the check reads only its status lines and that
//! one gauge.

use std::time::Duration;

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
    time::Instant,
};

/// The most bytes read from one admin answer.
const MAX_ANSWER: u64 = 4 * 1024 * 1024;
/// The deadline of one request (connect, send, read).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The pause between two attempts.
const RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Why the check failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The admin address is not `http://HOST:PORT` or `HOST:PORT`.
    #[error("the admin address {0:?} is not http://HOST:PORT")]
    Address(String),
    /// The controller did not pass within the timeout.
    #[error("the controller at {admin} did not pass within {timeout:?}: {reason}")]
    Failed {
        /// The admin endpoint.
        admin: String,
        /// How long the check tried.
        timeout: Duration,
        /// What failed in the last attempt.
        reason: String,
    },
}

/// The result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An admin endpoint: host and port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admin {
    host: String,
    port: u16,
}

impl std::str::FromStr for Admin {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::Address(s.to_owned());
        let rest = s.strip_prefix("http://").unwrap_or(s).trim_end_matches('/');
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || host.contains(['/', '@', ' ']) {
            return Err(bad());
        }
        Ok(Self {
            host: host.to_owned(),
            port: port.parse().map_err(|_| bad())?,
        })
    }
}

impl std::fmt::Display for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "http://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "http://{}:{}", self.host, self.port)
        }
    }
}

/// Checks the controller at `admin` until it passes or `timeout` ends; returns the report.
///
/// # Errors
///
/// [`Error::Failed`] with the reason of the last attempt.
pub async fn run(admin: &Admin, timeout: Duration) -> Result<Vec<String>> {
    let deadline = Instant::now() + timeout;
    loop {
        let reason = match attempt(admin).await {
            Ok(report) => return Ok(report),
            Err(reason) => reason,
        };
        if Instant::now() + RETRY_PAUSE > deadline {
            return Err(Error::Failed {
                admin: admin.to_string(),
                timeout,
                reason,
            });
        }
        tokio::time::sleep(RETRY_PAUSE).await;
    }
}

/// One pass over the admin pages; the error says what failed.
async fn attempt(admin: &Admin) -> Result<Vec<String>, String> {
    for path in ["/healthz", "/readyz"] {
        let (code, body) = get(admin, path).await?;
        if code != 200 {
            return Err(format!("{path} answered {code}: {}", failing_checks(&body)));
        }
    }
    let (code, body) = get(admin, "/metrics").await?;
    if code != 200 {
        return Err(format!("/metrics answered {code}"));
    }
    let processes = body
        .lines()
        .find_map(|l| l.strip_prefix("capstan_handler_processes "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .ok_or("/metrics has no capstan_handler_processes gauge")?;
    if processes < 1.0 {
        return Err("no handler process is connected".to_owned());
    }
    Ok(vec![
        format!("{admin}/healthz: ok"),
        format!("{admin}/readyz: ok"),
        format!("handler processes connected: {processes}"),
    ])
}

/// What a health page says fails: the message of each failing check of its JSON report, or
/// the start of the body when it is no such report.
fn failing_checks(body: &str) -> String {
    let report: Option<serde_json::Value> = serde_json::from_str(body).ok();
    let failing: Vec<String> = report
        .as_ref()
        .and_then(|r| r.get("checks"))
        .and_then(serde_json::Value::as_object)
        .map(|checks| {
            checks
                .iter()
                .filter(|(_, c)| c.get("ok").and_then(serde_json::Value::as_bool) == Some(false))
                .map(|(name, c)| {
                    let message = c
                        .get("message")
                        .and_then(serde_json::Value::as_str)
                        .unwrap_or("failed");
                    format!("{name}: {message}")
                })
                .collect()
        })
        .unwrap_or_default();
    if failing.is_empty() {
        body.chars().take(500).collect()
    } else {
        failing.join("; ")
    }
}

/// GETs `path` over HTTP/1.1 and returns the status code and body.
async fn get(admin: &Admin, path: &str) -> Result<(u16, String), String> {
    let exchange = async {
        let mut stream = TcpStream::connect((admin.host.as_str(), admin.port))
            .await
            .map_err(|e| format!("cannot connect to {admin}: {e}"))?;
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nUser-Agent: capstan-check\r\n\r\n",
            admin.host
        );
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("GET {path}: {e}"))?;
        let mut raw = Vec::new();
        stream
            .take(MAX_ANSWER)
            .read_to_end(&mut raw)
            .await
            .map_err(|e| format!("GET {path}: {e}"))?;
        Ok::<_, String>(raw)
    };
    let raw = tokio::time::timeout(REQUEST_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("GET {path} got no answer within {REQUEST_TIMEOUT:?}"))??;
    let text = String::from_utf8_lossy(&raw);
    let code = text
        .lines()
        .next()
        .and_then(|status| status.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("GET {path}: not an HTTP answer"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((code, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_report_names_its_failing_checks() {
        let body = r#"{"ok": false, "checks": {
            "activities": {"ok": true, "message": "done"},
            "handler-processes": {"ok": false, "message": "no handler process is connected"}}}"#;
        assert_eq!(
            failing_checks(body),
            "handler-processes: no handler process is connected"
        );
        assert_eq!(failing_checks("plain text"), "plain text");
    }

    #[test]
    fn admin_addresses_parse() {
        let a: Admin = "http://capstan-check.ops.svc:8080".parse().expect("valid");
        assert_eq!(a.to_string(), "http://capstan-check.ops.svc:8080");
        let b: Admin = "127.0.0.1:9".parse().expect("valid");
        assert_eq!(b.port, 9);
        let c: Admin = "http://[::1]:8080/".parse().expect("valid");
        assert_eq!(c.to_string(), "http://[::1]:8080");
        for bad in ["http://host", "host:port", ":80", "http://u@h:1", "https://h:1"] {
            assert!(bad.parse::<Admin>().is_err(), "{bad} parsed");
        }
    }

    #[tokio::test]
    async fn a_closed_port_fails_with_the_reason_after_the_timeout() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let admin: Admin = format!("127.0.0.1:{port}").parse().expect("valid");
        let err = run(&admin, Duration::from_millis(10))
            .await
            .expect_err("nothing listens");
        assert!(err.to_string().contains("cannot connect"), "{err}");
    }
}
