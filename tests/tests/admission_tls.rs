//! The webhook server's TLS and HTTP edges against the real `capstan`: certificates from files
//! replaced on disk are served without a restart (checked by a TLS client and by the real API
//! server through an unmanaged configuration), and bad input — not a review, an oversized
//! body, an unknown resource, plaintext — is answered without disturbing other requests.

use std::time::Duration;

use anyhow::{Result, anyhow, bail};
use capstan::webhooks::certs::{self, Generated};
use capstan_tests::{
    process::free_port,
    scenario::{Scenario, tail},
    webhook_tls,
};
use kube::api::{DynamicObject, PostParams};
use rustls_pki_types::ServerName;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_rustls::TlsConnector;

const LONG: Duration = Duration::from_secs(60);

fn write_certs(dir: &std::path::Path, generated: &Generated) -> Result<()> {
    // Written beside and renamed into place, as the kubelet swaps a Secret's files.
    for (name, text) in [
        (certs::CA_FILE, &generated.ca),
        (certs::CERT_FILE, &generated.chain),
        (certs::KEY_FILE, &generated.key),
    ] {
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, dir.join(name))?;
    }
    Ok(())
}

fn connector(ca_pem: &str) -> Result<TlsConnector> {
    webhook_tls::connector(ca_pem.as_bytes(), None)
}

/// Sends one raw HTTP/1.1 request over TLS trusting `ca_pem`; returns (status, body).
async fn https(port: u16, ca_pem: &str, head: &str, body: &[u8]) -> Result<(u16, String)> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let name = ServerName::try_from("127.0.0.1")?.to_owned();
    let mut tls =
        tokio::time::timeout(Duration::from_secs(10), connector(ca_pem)?.connect(name, tcp)).await??;
    tls.write_all(head.as_bytes()).await?;
    // The server may answer (413) and close before it has read everything.
    let _ = tls.write_all(body).await;
    let _ = tls.flush().await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), tls.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("no HTTP response: {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

async fn post(port: u16, ca_pem: &str, path: &str, body: &[u8]) -> Result<(u16, String)> {
    let head = format!(
        "POST {path}?timeout=5s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    https(port, ca_pem, &head, body).await
}

fn review(resource: &str, size: i64) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "0000-1111",
            "kind": {"group": "demo.capstan.dev", "version": "v1", "kind": "Example"},
            "resource": {"group": "demo.capstan.dev", "version": "v1", "resource": resource},
            "namespace": "default",
            "name": "direct",
            "operation": "CREATE",
            "userInfo": {"username": "tester"},
            "object": {"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
                       "metadata": {"name": "direct", "namespace": "default"}, "spec": {"size": size}},
            "dryRun": false
        }
    }))
    .unwrap_or_default()
}

#[tokio::test]
async fn bad_input_is_answered_with_400_413_or_404_and_plaintext_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let first = certs::generate_pem(&certs::names(None, &[]))?;
    write_certs(dir.path(), &first)?;
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let cert_dir = dir.path().to_string_lossy().into_owned();
    let s = Scenario::start(
        "validate",
        &[
            "--webhooks",
            "on",
            "--webhook-listen",
            &listen,
            "--webhook-cert-dir",
            &cert_dir,
            "--webhook-max-body",
            "65536",
        ],
    )
    .await?;

    let (status, body) = post(port, &first.ca, "/validate", b"{not json").await?;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("not a valid AdmissionReview"), "{body}");
    let (status, body) = post(
        port,
        &first.ca,
        "/validate",
        br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#,
    )
    .await?;
    assert_eq!(status, 400);
    assert!(body.contains("request is missing"), "{body}");

    // Declared too large: refused before the body is sent.
    let head =
        "POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\nConnection: close\r\n\r\n";
    let (status, _) = https(port, &first.ca, head, b"").await?;
    assert_eq!(status, 413);
    // Not declared (chunked) and too large: refused once the limit is passed.
    let chunk = vec![b' '; 70_000];
    let mut chunked = format!("{:x}\r\n", chunk.len()).into_bytes();
    chunked.extend_from_slice(&chunk);
    chunked.extend_from_slice(b"\r\n0\r\n\r\n");
    let head = "POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
    let (status, _) = https(port, &first.ca, head, &chunked).await?;
    assert_eq!(status, 413);

    let (status, body) = post(port, &first.ca, "/validate", &review("others", 1)).await?;
    assert_eq!(status, 404, "{body}");
    let (status, _) = post(port, &first.ca, "/elsewhere", &review("examples", 1)).await?;
    assert_eq!(status, 404);

    // Plaintext to the TLS port: no HTTP answer.
    let mut plain = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    plain
        .write_all(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        .await?;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(15), plain.read_to_end(&mut out)).await;
    assert!(!String::from_utf8_lossy(&out).contains("HTTP/1."), "{out:?}");

    // None of it disturbed the server: a real review is answered by the handler.
    let (status, body) = post(port, &first.ca, "/validate", &review("examples", 20)).await?;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body)?;
    assert_eq!(answer["response"]["uid"], "0000-1111");
    assert_eq!(answer["response"]["allowed"], false);
    assert_eq!(answer["response"]["status"]["message"], "size 20 is too large");
    assert_eq!(answer["response"]["warnings"], json!(["checked by check_size"]));
    let (status, body) = post(port, &first.ca, "/validate/check_size", &review("examples", 1)).await?;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"allowed\":true"), "{body}");
    let log = s.controller.process.output();
    assert!(
        !log.contains(first.key.lines().nth(1).unwrap_or("-----")),
        "the private key never appears in the log"
    );
    Ok(())
}

#[tokio::test]
async fn certificate_files_replaced_on_disk_are_served_without_a_restart() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let first = certs::generate_pem(&certs::names(None, &[]))?;
    write_certs(dir.path(), &first)?;
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let cert_dir = dir.path().to_string_lossy().into_owned();
    let s = Scenario::start(
        "validate",
        &[
            "--webhooks",
            "on",
            "--webhook-listen",
            &listen,
            "--webhook-cert-dir",
            &cert_dir,
            "--webhook-cert-poll",
            "300ms",
        ],
    )
    .await?;
    // Unmanaged: the configuration is the user's, trusting the second CA only.
    let second = certs::generate_pem(&certs::names(None, &[]))?;
    let config = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "user-owned"},
        "webhooks": [{
            "name": "examples.demo.capstan.dev.user-owned",
            "clientConfig": {
                "url": format!("https://127.0.0.1:{port}/validate"),
                "caBundle": serde_json::to_value(k8s_openapi::ByteString(second.ca.clone().into_bytes()))?,
            },
            "rules": [{"apiGroups": ["demo.capstan.dev"], "apiVersions": ["v1"], "resources": ["examples"], "operations": ["CREATE"]}],
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 10
        }]
    });
    s.env.apply(&serde_json::to_string(&config)?).await?;

    // Served now: the first certificate.
    let (status, _) = post(port, &first.ca, "/validate", &review("examples", 1)).await?;
    assert_eq!(status, 200);
    assert!(
        post(port, &second.ca, "/validate", &review("examples", 1))
            .await
            .is_err()
    );

    write_certs(dir.path(), &second)?;
    let deadline = tokio::time::Instant::now() + LONG;
    while post(port, &second.ca, "/validate", &review("examples", 1))
        .await
        .is_err()
    {
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the replaced certificate is not served\n{}",
                tail(&s.controller.process.output(), 40)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        post(port, &first.ca, "/validate", &review("examples", 1))
            .await
            .is_err()
    );
    // And the API server, trusting only the new CA, gets the handler's verdict.
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
            "metadata": {"name": "big", "namespace": "default"}, "spec": {"size": 30}
        }))?;
        match s.api().create(&PostParams::default(), &obj).await {
            Err(kube::Error::Api(status)) if status.message.contains("size 30 is too large") => break,
            other => {
                if tokio::time::Instant::now() > deadline {
                    bail!("the API server did not get the handler's verdict: {other:?}");
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        s.controller
            .process
            .output()
            .contains("webhook certificate reloaded")
    );
    Ok(())
}

/// POSTs a review presenting `client`; `None` when the server refused the caller (no TLS
/// session, or no HTTP answer).
async fn post_as(port: u16, ca_pem: &str, client: Option<&Generated>, body: &[u8]) -> Result<Option<u16>> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let name = ServerName::try_from("127.0.0.1")?.to_owned();
    let connector = webhook_tls::connector(ca_pem.as_bytes(), client)?;
    let Ok(Ok(mut tls)) = tokio::time::timeout(Duration::from_secs(10), connector.connect(name, tcp)).await
    else {
        return Ok(None);
    };
    let head = format!(
        "POST /validate?timeout=5s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    // With TLS 1.3 the server's verdict on the client certificate arrives after the handshake.
    if tls.write_all(head.as_bytes()).await.is_err() || tls.write_all(body).await.is_err() {
        return Ok(None);
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out);
    Ok(text.split_whitespace().nth(1).and_then(|s| s.parse().ok()))
}

#[tokio::test]
async fn with_a_client_ca_only_callers_with_its_certificate_are_served() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let serving = certs::generate_pem(&certs::names(None, &[]))?;
    write_certs(dir.path(), &serving)?;
    let caller = certs::generate_client_pem("kube-apiserver")?;
    let stranger = certs::generate_client_pem("kube-apiserver")?;
    let ca_file = dir.path().join("client-ca.crt");
    std::fs::write(&ca_file, &caller.ca)?;
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let cert_dir = dir.path().to_string_lossy().into_owned();
    let client_ca = ca_file.to_string_lossy().into_owned();
    let s = Scenario::start(
        "validate",
        &[
            "--webhooks",
            "on",
            "--webhook-listen",
            &listen,
            "--webhook-cert-dir",
            &cert_dir,
            "--webhook-client-ca",
            &client_ca,
            "--webhook-cert-poll",
            "300ms",
        ],
    )
    .await?;
    let body = review("examples", 1);
    assert_eq!(post_as(port, &serving.ca, Some(&caller), &body).await?, Some(200));
    assert_eq!(
        post_as(port, &serving.ca, None, &body).await?,
        None,
        "no client certificate"
    );
    assert_eq!(
        post_as(port, &serving.ca, Some(&stranger), &body).await?,
        None,
        "a certificate of another CA"
    );

    // The CA file is replaced: the new CA's callers are served, the old one's no longer.
    std::fs::write(&ca_file, &stranger.ca)?;
    let deadline = tokio::time::Instant::now() + LONG;
    while post_as(port, &serving.ca, Some(&stranger), &body).await? != Some(200) {
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the replaced client CA is not used\n{}",
                tail(&s.controller.process.output(), 40)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(post_as(port, &serving.ca, Some(&caller), &body).await?, None);
    assert!(
        s.controller
            .process
            .output()
            .contains("webhook client CA reloaded")
    );
    Ok(())
}
