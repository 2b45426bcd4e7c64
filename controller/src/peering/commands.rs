//! `capstan freeze` and `capstan resume`: pause and resume operators from a terminal.
//!
//! kopf's semantics: a freeze is a peering entry like any operator's, with the given priority
//! (100 by default) and lifetime, under the identity `<user>@<host>` (or `--id`); operators of
//! a lower priority pause until it is removed or expires. `resume` removes the entry. Both act
//! with the user's kubeconfig and report what they did as lines of text for the terminal.

use std::time::{Duration, SystemTime};

use kube::Client;

use super::keepalive::{Peer, peers, removal};
use crate::{
    k8s::peering::{Error, Peerings, Target},
    persistence::time,
};

/// The peering CRDs, as printed by `capstan crds`.
pub const CRDS: &str = include_str!("../../crds/peering.yaml");

/// The identity of a person at a terminal: `<user>@<host>`.
pub fn user_identity() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "someone".into());
    format!("{user}@{}", super::hostname())
}

/// What `capstan freeze` writes.
#[derive(Clone, Debug)]
pub struct Freeze {
    /// The peering objects.
    pub targets: Vec<Target>,
    /// The entry's identity.
    pub id: String,
    /// Operators below this priority pause.
    pub priority: i64,
    /// How long the freeze lasts.
    pub lifetime: Duration,
    /// Why, for whoever looks at the peering object.
    pub message: Option<String>,
}

/// Writes the freeze entry into every target (creating missing peering objects).
///
/// # Errors
/// When the CRDs are missing or the API refuses.
pub async fn freeze(client: Client, freeze: &Freeze) -> Result<Vec<String>, Error> {
    let api = Peerings::new(client);
    let now = SystemTime::now();
    let entry = Peer {
        id: freeze.id.clone(),
        priority: freeze.priority,
        lifetime: freeze.lifetime,
        lastseen: now,
        message: freeze.message.clone().filter(|m| !m.is_empty()),
        lease: None,
        node: None,
    };
    let until = now + freeze.lifetime;
    let mut report = Vec::new();
    for target in &freeze.targets {
        api.check_installed(target).await?;
        api.ensure(target).await?;
        let mut patch = serde_json::Map::new();
        patch.insert(entry.id.clone(), entry.entry());
        let status = api.patch(target, patch).await?;
        let paused: Vec<String> = peers(&status)
            .into_iter()
            .filter(|p| p.id != entry.id && !p.is_dead(now) && p.priority < entry.priority)
            .map(|p| format!("{} (priority {})", p.id, p.priority))
            .collect();
        report.push(format!(
            "froze {target}: operators below priority {} pause until {} ({}s) or `capstan resume`; entry {:?}",
            entry.priority,
            time::format(until),
            freeze.lifetime.as_secs(),
            entry.id,
        ));
        if paused.is_empty() {
            report.push("  no live operator below that priority is registered right now".into());
        } else {
            report.push(format!("  pausing: {}", paused.join(", ")));
        }
    }
    Ok(report)
}

/// Removes the entry `id` from every target.
///
/// # Errors
/// When the CRDs are missing or the API refuses.
pub async fn resume(client: Client, targets: &[Target], id: &str) -> Result<Vec<String>, Error> {
    let api = Peerings::new(client);
    let mut report = Vec::new();
    for target in targets {
        api.check_installed(target).await?;
        let entry = match api.status(target).await {
            Ok(status) => status.get(id).cloned(),
            Err(Error::NotFound(_)) => None,
            Err(e) => return Err(e),
        };
        let Some(entry) = entry else {
            report.push(format!("{target}: no freeze by {id:?}; nothing to resume"));
            continue;
        };
        api.patch(target, removal(id)).await?;
        let expired = Peer::parse(id, &entry).is_none_or(|p| p.is_dead(SystemTime::now()));
        report.push(if expired {
            format!("{target}: the freeze by {id:?} had expired already; removed its entry")
        } else {
            format!("resumed {target}: removed the freeze by {id:?}")
        });
    }
    Ok(report)
}
