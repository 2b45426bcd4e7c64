//! End to end: `capstan status` never passes terminal control characters from objects to the
//! terminal. Progress records are annotations that anyone with patch rights on an object can
//! write, and handler messages quote user content; a message with ESC sequences (clearing the
//! screen, setting the window title), BEL, a C1 control and a bidirectional override is shown
//! escaped in every output format, and JSON still decodes to the message as stored.

use anyhow::{Context as _, Result, ensure};
use capstan_tests::{
    process::capstan_binary,
    testenv::{TestEnv, examples},
};
use kube::api::{DynamicObject, PostParams};
use serde_json::json;

const HOSTILE: &str = "\u{1b}]0;owned\u{7}\u{1b}[2J\u{1b}[Hall clear\u{7}\u{9b}31m \u{202e}gpj.exe";

#[tokio::test]
async fn status_prints_no_control_characters_from_objects() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let record = json!({"retries": 2, "failure": true, "message": HOSTILE}).to_string();
    let object = json!({
        "apiVersion": "demo.capstan.dev/v1",
        "kind": "Example",
        "metadata": {"name": "hostile", "namespace": "default", "annotations": {
            "capstan.dev/create_fn": record,
        }},
        "spec": {},
    });
    let object: DynamicObject = serde_json::from_value(object)?;
    examples(&env.client().await?, "default")
        .create(&PostParams::default(), &object)
        .await?;

    let binary = capstan_binary().await?;
    let steers = |c: char| c != '\n' && (c.is_control() || ('\u{202a}'..='\u{202e}').contains(&c));
    for output in ["table", "wide", "json", "yaml"] {
        let out = tokio::process::Command::new(&binary)
            .args(["status", "examples", "-n", "default", "-o", output])
            .env("KUBECONFIG", &env.kubeconfig)
            .output()
            .await
            .context("running capstan status")?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success(),
            "capstan status -o {output} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        println!("$ capstan status examples -o {output}\n{}", stdout.escape_debug());
        let raw: Vec<char> = stdout.chars().filter(|c| steers(*c)).collect();
        ensure!(
            raw.is_empty(),
            "-o {output} printed {} control characters ({raw:?}):\n{}",
            raw.len(),
            stdout.escape_debug()
        );
        match output {
            "table" | "wide" => ensure!(
                stdout.contains(r"\x1b]0;owned\x07\x1b[2J"),
                "-o {output} does not show the escapes:\n{stdout}"
            ),
            "json" => {
                let report: serde_json::Value = serde_json::from_str(&stdout)?;
                ensure!(
                    report["items"][0]["handlers"][0]["message"] == HOSTILE,
                    "JSON does not decode to the stored message: {report}"
                );
            }
            _ => {}
        }
    }
    Ok(())
}
