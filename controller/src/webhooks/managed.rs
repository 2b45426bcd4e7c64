//! Keeps the managed webhook configurations in step with the known admission handlers and the
//! CA bundle: written when they change (and once the first admission handler is known, never
//! before: an operator without webhooks leaves no configurations behind), retried with a
//! backoff when the API server refuses, and removed on exit (unless kept: kopf's `persistent`,
//! for all handlers).
//!
//! With leader election only the leader writes (the configurations are cluster-wide; two
//! replicas writing would only fight over the same content); every replica serves the
//! webhooks themselves. A standby that becomes leader writes at once.
//!
//! The configurations' name is the flag's (`--webhook-managed`; given empty: unmanaged) or,
//! without the flag, what a handler process's settings say (kopf's `admission.managed`, which a
//! startup handler sets), so it may come or change while the controller runs: under a new name
//! the old name's configurations are removed first (also with `--webhook-keep-on-exit`, which is
//! about the exit), and without a name nothing is written.

use std::{sync::Arc, time::Duration};

use serde_json::Value;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{
    admission::Phase,
    configs::{self, Layout},
};
use crate::{
    k8s::admission::{self as api, Which},
    model::Registration,
};

/// How often leadership is looked at.
const LEADERSHIP_POLL: Duration = Duration::from_secs(2);
/// The longest wait before a refused write is retried.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How long the removal on exit may take.
const REMOVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether this replica may write the configurations now.
pub type Leading = Arc<dyn Fn() -> bool + Send + Sync>;

/// The manager of the two configurations.
pub struct Manager {
    client: kube::Client,
    /// The layout; its `name` is the one written under, when `named`.
    layout: Layout,
    /// The name to write under (`None`: unmanaged).
    names: watch::Receiver<Option<String>>,
    /// Whether `layout.name` holds a name now.
    named: bool,
    handlers: watch::Receiver<Arc<Vec<Registration>>>,
    ca_bundle: watch::Receiver<Vec<u8>>,
    leading: Leading,
    /// What was last written (validating, mutating), `None` before the first write.
    written: Option<(Value, Value)>,
    /// Leave the configurations in place on exit.
    keep: bool,
}

impl Manager {
    /// A manager writing `layout`'s configurations for `handlers`, under the latest of `names`
    /// (the layout's own name is not used).
    pub fn new(
        client: kube::Client,
        layout: Layout,
        names: watch::Receiver<Option<String>>,
        handlers: watch::Receiver<Arc<Vec<Registration>>>,
        ca_bundle: watch::Receiver<Vec<u8>>,
        leading: Leading,
    ) -> Self {
        Self {
            client,
            layout,
            names,
            named: false,
            handlers,
            ca_bundle,
            leading,
            written: None,
            keep: false,
        }
    }

    /// Leaves the configurations in place when the controller stops (kopf's `persistent`).
    #[must_use]
    pub fn keep_on_exit(mut self, keep: bool) -> Self {
        self.keep = keep;
        self
    }

    /// Writes the configurations whenever they change until `stop`; then removes them if this
    /// replica wrote them.
    pub async fn run(mut self, stop: CancellationToken) {
        let mut backoff = Duration::from_secs(1);
        let mut was_leading = false;
        // The names' sender may go before the stop: the name stays then.
        let mut names_open = true;
        loop {
            let leading = (self.leading)();
            if leading && !was_leading {
                // Someone else may have written meanwhile: write again.
                self.written = None;
            }
            was_leading = leading;
            let wanted = self.names.borrow_and_update().clone();
            if wanted.as_deref() != self.named.then_some(self.layout.name.as_str()) {
                self.rename(wanted, leading).await;
            }
            let mut retry = false;
            if leading && self.named {
                match self.sync().await {
                    Ok(()) => backoff = Duration::from_secs(1),
                    Err(e) => {
                        warn!(error = %crate::diagnostic::chain(&e), ?backoff, "the managed webhook configurations could not be written; retrying");
                        retry = true;
                    }
                }
            }
            let wait = if retry { backoff } else { LEADERSHIP_POLL };
            if retry {
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
            tokio::select! {
                () = stop.cancelled() => break,
                changed = self.handlers.changed() => if changed.is_err() { break },
                changed = self.ca_bundle.changed() => if changed.is_err() { break },
                changed = self.names.changed(), if names_open => names_open = changed.is_ok(),
                () = tokio::time::sleep(wait) => {}
            }
        }
        if !self.named {
            return;
        }
        if self.keep {
            info!(name = %self.layout.name, "managed webhook configurations kept (--webhook-keep-on-exit)");
        } else if self.written.is_some() && (self.leading)() {
            self.remove().await;
        }
    }

    /// Moves to another name (or none): the leader removes what is under the old one (written
    /// by it or by a leader before it), and the new one is written from scratch.
    async fn rename(&mut self, wanted: Option<String>, leading: bool) {
        if self.named && leading {
            self.remove().await;
        }
        if self.named {
            info!(from = %self.layout.name, to = ?wanted, "the managed webhook configurations' name changed");
        }
        self.written = None;
        self.named = wanted.is_some();
        self.layout.name = wanted.unwrap_or_default();
    }

    async fn sync(&mut self) -> Result<(), api::Error> {
        let handlers = self.handlers.borrow_and_update().clone();
        if self.written.is_none() && !handlers.iter().any(|r| r.kind.is_admission()) {
            return Ok(());
        }
        self.layout.ca_bundle = self.ca_bundle.borrow_and_update().clone();
        let validating = configs::build(Phase::Validating, &handlers, &self.layout);
        let mutating = configs::build(Phase::Mutating, &handlers, &self.layout);
        let (old_v, old_m) = self.written.clone().unwrap_or_default();
        if old_v != validating {
            api::apply(&self.client, Which::Validating, &self.layout.name, &validating).await?;
        }
        if old_m != mutating {
            api::apply(&self.client, Which::Mutating, &self.layout.name, &mutating).await?;
        }
        if self.written.as_ref() != Some(&(validating.clone(), mutating.clone())) {
            info!(
                name = %self.layout.name,
                validating = validating["webhooks"].as_array().map_or(0, Vec::len),
                mutating = mutating["webhooks"].as_array().map_or(0, Vec::len),
                "managed webhook configurations written"
            );
        }
        self.written = Some((validating, mutating));
        Ok(())
    }

    async fn remove(&self) {
        let removal = async {
            for which in [Which::Validating, Which::Mutating] {
                if let Err(e) = api::remove(&self.client, which, &self.layout.name).await {
                    warn!(error = %crate::diagnostic::chain(&e), "a managed webhook configuration could not be removed");
                }
            }
        };
        if tokio::time::timeout(REMOVE_TIMEOUT, removal).await.is_err() {
            warn!("the managed webhook configurations were not removed in time");
        } else {
            info!(name = %self.layout.name, "managed webhook configurations removed");
        }
    }
}
