//! What the index end-to-end tests share: relabelling the ConfigMaps that indexes fold, and
//! reading what a handler reports of an index (`status.peek`).

use anyhow::Result;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

/// Sets (or with `None` removes) the `e2e/app` label of a ConfigMap.
///
/// # Errors
/// When the API server refuses the patch.
pub async fn relabel(api: &Api<ConfigMap>, name: &str, app: Option<&str>) -> Result<()> {
    let patch = json!({"metadata": {"labels": {"e2e/app": app}}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// `status.peek`: the whole index as sorted `<key>=<name>` entries.
pub fn peek(obj: &Value) -> Option<Vec<String>> {
    obj.pointer("/status/peek")?
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
}

/// Index entries as `peek` gives them: `<key>=<name>`, sorted.
pub fn entries<K: AsRef<str>, N: AsRef<str>>(items: &[(K, N)]) -> Vec<String> {
    let mut v: Vec<String> = items
        .iter()
        .map(|(k, n)| format!("{}={}", k.as_ref(), n.as_ref()))
        .collect();
    v.sort();
    v
}
