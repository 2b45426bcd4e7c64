//! Operator activities (kopf `on.startup`, `on.cleanup`, `on.login`, `on.probe`): handlers
//! that belong to the operator, not to an object.
//!
//! - **login** handlers run once the startup handlers have succeeded (kopf starts logging in
//!   only after its startup activities), before any resource is watched; the credentials they return
//!   (the highest priority first) are checked against the API server and swapped into the
//!   shared API client ([`crate::k8s::switch`]). Rejected or unusable credentials are logged
//!   and retried after the handler's backoff while everything else keeps serving. A
//!   `401 Unauthorized` from the API later calls them again (kopf's re-login), and so does
//!   the approach of the `expiration` of the credentials in use: they are replaced before
//!   they expire ([`relogin_in`]: a fifth of their remaining lifetime ahead, at most a minute,
//!   as kube-rs refreshes the exec-plugin tokens of a kubeconfig), not only after the API
//!   rejected them; credentials that have expired already are not installed. Every login
//!   call has a deadline (`login_timeout`, whether the handler never answers or its process
//!   has left meanwhile), `/readyz` reports the wait and its last problem, and when no login
//!   handler is registered any more the wait ends: the credentials in use stay.
//!
//!   A login handler that never answers stalls no one. The login handlers are called
//!   together, and the credentials of the first to answer with usable ones are installed at
//!   once (the highest priority among those that answered together). kopf's rule that the
//!   highest priority wins still holds: the other calls go on in the background until their
//!   deadline, and a usable answer of a higher priority than the credentials in use replaces
//!   them when it arrives (on every login, the first and the renewals alike). Login gates
//!   resource watching only until the operator first starts: a process that connects later
//!   with a login handler while the controller already works with credentials (its own, or
//!   a login handler's) is logged in by a background task, the credentials in use stay in
//!   use until a new login answers, and nothing already served — watches, dispatch, other
//!   processes' new registrations and startup handlers — waits for it.
//! - **startup** handlers run first, each until it succeeds, with kopf's error rules
//!   (temporary and unclassified errors retried after their delay/backoff; permanent errors,
//!   exhausted retries or timeout fail it). The engine starts no resource watch while a
//!   registered startup (or login) handler has not succeeded ([`Activities::ready`], reported
//!   by `/readyz`). A startup handler whose process leaves is no longer waited for. Startup
//!   runs once per controller lifetime: the ids that succeeded are remembered, so a
//!   reconnecting handler process does not re-run them, and the state lives here, outside
//!   the engine, which is replaced on every resume.
//!
//!   kopf's startup gates the whole operator; here several handler processes share one
//!   controller, so what a failure stops depends on when it happens. The operator *starts*
//!   the first time a round of login and startup handlers completes with registrations
//!   present (resource watching is allowed from then on). A startup handler that fails for
//!   good **before** that ends the controller with [`Error::StartupFailed`] (non-zero exit,
//!   as kopf's operator does). A **late** startup handler — one of a process that connects
//!   once the operator runs, while other processes may be serving — affects only its own
//!   process: all of that process's registrations are withdrawn (as if it had left) and it
//!   gets a `Notice` with `STARTUP_FAILED`; everything else carries on. Its stream stays open;
//!   when the process connects again its startup handler runs again. Caveat: the engine's gate
//!   is one for all processes, so while a late startup handler is still being retried no
//!   *new* resource watch starts for anyone (running watches and dispatch go on).
//! - **probe** handlers feed `/healthz`: each id's last result is shown as kopf's liveness
//!   endpoint shows it, plus a `probe/<id>` liveness check. The HTTP endpoint answers from a
//!   cache; a request that finds the cache older than 10 s wakes the prober, which re-runs
//!   the probes with a bounded timeout (a hanging probe becomes a failing check, never a hung
//!   endpoint).
//! - **cleanup** handlers run at shutdown, after resource work drained and before the gRPC
//!   server stops, bounded by the shutdown grace; their outcomes are logged. A process that
//!   stops first — in a pod whose controller is a native sidecar, kubelet sends SIGTERM to the
//!   handler container and stops the controller only after it exited — asks for its cleanup
//!   handlers in its goodbye: they run then, on its stream, and it is told with `Farewell`
//!   when they are done. Each cleanup handler runs once, whichever stops first.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    future::Future,
    sync::{Arc, Weak},
    time::{Duration, SystemTime},
};

use futures::{
    FutureExt as _, StreamExt as _,
    future::join_all,
    stream::{BoxStream, FuturesUnordered},
};
use parking_lot::Mutex;
use serde_json::Value;
use tokio::{
    sync::Notify,
    sync::watch,
    task::{AbortHandle, JoinHandle, JoinSet},
    time::Instant,
};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, debug, error, info, info_span, warn};

use super::execution::{self, Verdict};
use crate::{
    grpc::{Hub, hub::ConnectionId},
    k8s::switch::Switchable,
    model::{
        Activity, Credentials, Diagnostic, HandlerId, HandlerKind, KindResult, Outcome, Payload,
        Registration, Work,
    },
    observability::health::{Check, Health},
    persistence::ProgressRecord,
};

/// Why the activities stopped the controller.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A startup handler failed for good.
    #[error("startup handler {handler} failed: {message}")]
    StartupFailed {
        /// The handler.
        handler: String,
        /// Why.
        message: String,
    },
}

/// Tunables of activities.
#[derive(Clone, Debug)]
pub struct Settings {
    /// How long one probe handler may take. Default 5 s.
    pub probe_timeout: Duration,
    /// Probe results are reused this long (kopf: 10 s).
    pub probe_cache: Duration,
    /// How long one login attempt may take. Default 30 s.
    pub login_timeout: Duration,
    /// How long the cleanup handlers of a process leaving before the controller may take
    /// (its goodbye asked for them): the controller's shutdown grace. Default 20 s.
    pub cleanup_grace: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            probe_timeout: Duration::from_secs(5),
            probe_cache: Duration::from_secs(10),
            login_timeout: Duration::from_secs(30),
            cleanup_grace: Duration::from_secs(20),
        }
    }
}

/// The activities of one controller. Cheap to clone.
#[derive(Clone)]
pub struct Activities {
    inner: Arc<Inner>,
}

struct Inner {
    hub: Hub,
    switch: Option<Switchable>,
    health: Health,
    settings: Settings,
    state: Mutex<State>,
    changed: watch::Sender<u64>,
    failed: watch::Sender<Option<String>>,
    probe_wanted: Notify,
    /// Counts the probe runs, so that a stale `/healthz` can wait for the next one.
    probes_ran: watch::Sender<u64>,
    /// Counts the cleanup runs that finished, so that a leaving process whose cleanup the
    /// controller's own stop runs waits for it before its `Farewell`.
    cleanups_ran: watch::Sender<u64>,
    login_lock: tokio::sync::Mutex<()>,
    /// The background task collecting a login round's later answers ([`upgrade_from`]).
    upgrade: Mutex<Option<AbortHandle>>,
}

#[derive(Default)]
struct State {
    started: HashSet<HandlerId>,
    logged_in: bool,
    probes: BTreeMap<String, (Check, Option<Value>)>,
    probes_run_at: Option<Instant>,
    /// The operator started (see the module docs): later startup failures are confined.
    operating: bool,
    /// Why the last round of login calls gave no usable credentials.
    login_problem: Option<String>,
    /// When the credentials in use expire, if they said so.
    expires_at: Option<SystemTime>,
    /// Counts the rounds of login calls: a later answer of an earlier round installs nothing.
    login_round: u64,
    /// Cleanup handlers run (true) or running (false), by the connection of the process they
    /// ran for: each runs once per process, whether it left first or the controller stops
    /// first. One entry per cleanup handler of a process that left or was cleaned up, so
    /// bounded by those.
    cleaned: HashMap<(ConnectionId, HandlerId), bool>,
}

/// The shortest time between two logins for credentials that expire (however short-lived the
/// credentials a login handler returns, its calls are this far apart).
const MIN_RELOGIN_INTERVAL: Duration = Duration::from_secs(5);

/// The longest margin before an expiration at which the credentials are replaced.
const MAX_EXPIRY_MARGIN: Duration = Duration::from_secs(60);

/// How long from `now` until credentials expiring at `expiration` are replaced: a fifth of
/// their remaining lifetime before they expire, at most [`MAX_EXPIRY_MARGIN`], and never
/// sooner than [`MIN_RELOGIN_INTERVAL`].
pub fn relogin_in(expiration: SystemTime, now: SystemTime) -> Duration {
    let remaining = expiration.duration_since(now).unwrap_or_default();
    let margin = (remaining / 5).min(MAX_EXPIRY_MARGIN);
    remaining.saturating_sub(margin).max(MIN_RELOGIN_INTERVAL)
}

/// Extra time a login call gets beyond its attempt timeout, for the cancel to reach it.
const LOGIN_SLACK: Duration = Duration::from_secs(5);

impl Activities {
    /// Activities dispatched through `hub`; login credentials go into `switch`.
    pub fn new(hub: Hub, health: Health, switch: Option<Switchable>, settings: Settings) -> Self {
        let (changed, _) = watch::channel(0);
        let (failed, _) = watch::channel(None);
        let inner = Arc::new(Inner {
            hub,
            switch,
            health: health.clone(),
            settings,
            state: Mutex::new(State::default()),
            changed,
            failed,
            probe_wanted: Notify::new(),
            probes_ran: watch::channel(0).0,
            cleanups_ran: watch::channel(0).0,
            login_lock: tokio::sync::Mutex::new(()),
            upgrade: Mutex::new(None),
        });
        let weak = Arc::downgrade(&inner);
        health.readiness("activities", move || {
            let Some(inner) = weak.upgrade() else {
                return Check::pass("stopped");
            };
            let registrations = inner.hub.registrations().borrow().clone();
            match awaited(&inner, &registrations) {
                Ok(()) => Check::pass("operator activities done"),
                Err(why) => Check::fail(why),
            }
        });
        let weak = Arc::downgrade(&inner);
        health.probe_refresh(move || {
            let weak = weak.clone();
            Box::pin(async move {
                let mut ran = {
                    let Some(inner) = weak.upgrade() else {
                        return;
                    };
                    let state = inner.state.lock();
                    let stale = state
                        .probes_run_at
                        .is_none_or(|t| t.elapsed() >= inner.settings.probe_cache);
                    if state.probes.is_empty() || !stale {
                        return;
                    }
                    let ran = inner.probes_ran.subscribe();
                    inner.probe_wanted.notify_one();
                    ran
                };
                ran.borrow_and_update();
                let _ = ran.changed().await;
            })
        });
        let weak = Arc::downgrade(&inner);
        health.probe_values(move || {
            let Some(inner) = weak.upgrade() else {
                return BTreeMap::new();
            };
            let state = inner.state.lock();
            if !state.probes.is_empty()
                && state
                    .probes_run_at
                    .is_none_or(|t| t.elapsed() >= inner.settings.probe_cache)
            {
                inner.probe_wanted.notify_one();
            }
            state
                .probes
                .iter()
                .filter_map(|(id, (_, v))| v.clone().map(|v| (id.clone(), v)))
                .collect()
        });
        Self { inner }
    }

    /// Moves whenever [`Activities::ready`] may have changed.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.inner.changed.subscribe()
    }

    /// Whether resources may be watched for these registrations: every startup handler
    /// succeeded, and login credentials are in use when login handlers exist. `Err` says
    /// what is still awaited.
    ///
    /// # Errors
    /// What is still awaited, for logs.
    pub fn ready(&self, registrations: &[Registration]) -> Result<(), String> {
        awaited(&self.inner, registrations)
    }

    /// Resolves when a startup handler failed for good.
    pub async fn failed(&self) -> Error {
        let mut rx = self.inner.failed.subscribe();
        loop {
            if let Some((handler, message)) = rx.borrow_and_update().as_ref().and_then(|m| m.split_once('\0'))
            {
                return Error::StartupFailed {
                    handler: handler.to_owned(),
                    message: message.to_owned(),
                };
            }
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Runs login, startup and probes until `cancel` fires.
    pub async fn run(self, cancel: CancellationToken) {
        let mut tasks = JoinSet::new();
        tasks.spawn(
            self.clone()
                .preflight(cancel.clone())
                .instrument(info_span!("activities", activity = "startup")),
        );
        tasks.spawn(
            self.clone()
                .relogin(cancel.clone())
                .instrument(info_span!("activities", activity = "login")),
        );
        tasks.spawn(
            self.clone()
                .probes(cancel.clone())
                .instrument(info_span!("activities", activity = "probe")),
        );
        tasks.spawn(
            self.clone()
                .leavers(cancel.clone())
                .instrument(info_span!("activities", activity = "cleanup")),
        );
        cancel.cancelled().await;
        if let Some(upgrade) = self.inner.upgrade.lock().take() {
            upgrade.abort();
        }
        while tasks.join_next().await.is_some() {}
    }

    fn of_kind(&self, kind: HandlerKind) -> Vec<Registration> {
        self.inner
            .hub
            .registrations()
            .borrow()
            .iter()
            .filter(|r| r.kind == kind)
            .cloned()
            .collect()
    }

    fn bump(&self) {
        self.inner.changed.send_modify(|n| *n += 1);
    }

    /// Every startup handler not run yet, then login (kopf logs in once its startup activities
    /// finished); again whenever registrations change.
    async fn preflight(self, cancel: CancellationToken) {
        let mut registrations = self.inner.hub.registrations();
        let mut late_login: Option<JoinHandle<()>> = None;
        loop {
            registrations.borrow_and_update();
            let logins = self.of_kind(HandlerKind::Login);
            let (logged_in, operating) = {
                let state = self.inner.state.lock();
                (state.logged_in, state.operating)
            };
            let login_wanted = !logins.is_empty() && !logged_in;
            // The operator works with the credentials in use: a late login runs beside it, and
            // nothing waits for it (nor it for late startup handlers).
            if login_wanted && operating && late_login.as_ref().is_none_or(JoinHandle::is_finished) {
                info!(
                    "a login handler registered while the operator runs; logging in meanwhile with the credentials in use"
                );
                let this = self.clone();
                let cancel = cancel.clone();
                late_login = Some(tokio::spawn(
                    async move {
                        tokio::select! {
                            () = cancel.cancelled() => {}
                            () = this.login() => {}
                        }
                    }
                    .in_current_span(),
                ));
            }
            let pending: Vec<Registration> = {
                let state = self.inner.state.lock();
                self.of_kind(HandlerKind::Startup)
                    .into_iter()
                    .filter(|r| !state.started.contains(&r.id))
                    .collect()
            };
            for reg in pending {
                let result = tokio::select! {
                    () = cancel.cancelled() => return,
                    () = self.gone(&reg.id) => {
                        info!(handler.id = %reg.id, "the startup handler's process left; it is not waited for");
                        self.bump();
                        continue;
                    }
                    result = self.startup(&reg) => result,
                };
                match result {
                    Ok(()) => {
                        self.inner.state.lock().started.insert(reg.id.clone());
                        self.bump();
                    }
                    Err(message) if self.inner.state.lock().operating => self.refuse(&reg, &message),
                    Err(message) => {
                        error!(handler.id = %reg.id, %message, "startup handler failed for good; the controller stops");
                        self.inner
                            .failed
                            .send_replace(Some(format!("{}\0{message}", reg.id)));
                        return;
                    }
                }
            }
            // Before the operator first starts, login comes once the startup handlers succeeded.
            if login_wanted && !operating {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = self.login() => {}
                }
            }
            let current = self.inner.hub.registrations().borrow().clone();
            if !current.is_empty() && awaited(&self.inner, &current).is_ok() {
                let mut state = self.inner.state.lock();
                if !state.operating {
                    state.operating = true;
                    debug!("the operator started: later startup failures affect only their own process");
                }
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                changed = registrations.changed() => if changed.is_err() { return },
            }
        }
    }

    /// Resolves once no connected process registers `id`.
    async fn gone(&self, id: &HandlerId) {
        let mut registrations = self.inner.hub.registrations();
        loop {
            if !registrations.borrow_and_update().iter().any(|r| &r.id == id) {
                return;
            }
            if registrations.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Confines a late startup failure to its process (see the module docs).
    fn refuse(&self, reg: &Registration, message: &str) {
        let diagnostic = Diagnostic::error(
            "STARTUP_FAILED",
            format!(
                "startup handler {} failed for good: {message}; this process's registrations are withdrawn \
                 (the operator is already running, so the controller carries on)",
                reg.id
            ),
        );
        let expelled = self.inner.hub.expel(&reg.id, &diagnostic);
        error!(handler.id = %reg.id, %message, expelled, "late startup handler failed for good; its process's registrations are withdrawn");
        self.bump();
    }

    /// Runs one startup handler until it succeeds or fails for good.
    async fn startup(&self, reg: &Registration) -> Result<(), String> {
        let started = SystemTime::now();
        let mut record = ProgressRecord::started(started, "startup");
        let mut last_error: Option<Diagnostic> = None;
        loop {
            if let Some(message) = execution::exhausted(reg, &record, SystemTime::now()) {
                return Err(message);
            }
            let mut work = Work::new(
                reg.id.0.clone(),
                format!("startup/{}", reg.id),
                Payload::Activity(Activity::Startup),
            );
            work.attempt = record.retries + 1;
            work.started = started;
            work.param.clone_from(&reg.param);
            work.last_error = last_error.clone();
            info!(handler.id = %reg.id, attempt = work.attempt, "running startup handler");
            let outcome = self.inner.hub.invoke(work).await;
            if matches!(outcome, Outcome::Skipped) {
                return Ok(());
            }
            last_error = diagnostics_of(&outcome);
            let abandoned = matches!(outcome, Outcome::Cancelled | Outcome::Abandoned);
            match execution::judge(reg, &mut record, outcome, SystemTime::now()) {
                Verdict::Success { .. } => {
                    info!(handler.id = %reg.id, "startup handler succeeded");
                    return Ok(());
                }
                Verdict::Failure => return Err(record.message.clone().unwrap_or_else(|| "failed".into())),
                Verdict::Retry | Verdict::Unrecorded => {
                    let delay = if abandoned {
                        reg.backoff
                    } else {
                        record
                            .delayed_until()
                            .and_then(|t| t.duration_since(SystemTime::now()).ok())
                            .unwrap_or_default()
                    };
                    warn!(handler.id = %reg.id, message = record.message.as_deref().unwrap_or("abandoned"), retry_in = ?delay, "startup handler failed; retrying");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// Calls the login handlers until credentials from one of them work, or until no login
    /// handler is registered any more. Returns once the first usable answer is installed;
    /// the answers still coming are collected in the background until the login deadline,
    /// and one of a higher priority replaces it ([`upgrade_from`]).
    async fn login(&self) {
        let Some(switch) = &self.inner.switch else {
            return;
        };
        let _serial = self.inner.login_lock.lock().await;
        let round = self.new_login_round();
        let mut registrations = self.inner.hub.registrations();
        loop {
            registrations.borrow_and_update();
            let logins = self.of_kind(HandlerKind::Login);
            if logins.is_empty() {
                info!("no login handler is registered any more; the credentials in use stay");
                self.inner.state.lock().login_problem = None;
                self.bump();
                return;
            }
            let mut answers = self.call_logins(&logins);
            let mut install = |id: HandlerId, credentials: Credentials| {
                let switch = switch.clone();
                async move {
                    switch
                        .install(&id.0, &credentials)
                        .await
                        .map_err(|e| crate::diagnostic::chain(&e))
                }
            };
            let mut problems = Vec::new();
            if let Some((id, credentials)) =
                next_installed(&mut answers, None, &mut install, &mut problems).await
            {
                self.installed(&id, &credentials);
                self.upgrade_later(answers, credentials.priority, round);
                return;
            }
            let backoff = logins
                .iter()
                .map(|r| r.backoff)
                .min()
                .unwrap_or(Duration::from_secs(60));
            error!(problems = %problems.join("; "), retry_in = ?backoff, "login failed; the previous credentials stay in use");
            self.inner.state.lock().login_problem = Some(problems.join("; "));
            self.bump();
            // A process that leaves (or a new login handler) is noticed at once.
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                _ = registrations.changed() => {}
            }
        }
    }

    /// Starts a round of login calls (under the login lock): the answers of earlier rounds
    /// still being collected are withdrawn and may no longer install anything.
    fn new_login_round(&self) -> u64 {
        if let Some(earlier) = self.inner.upgrade.lock().take() {
            earlier.abort();
        }
        let mut state = self.inner.state.lock();
        state.login_round += 1;
        state.login_round
    }

    /// Calls every login handler at once; their answers as they arrive, each within the
    /// login deadline.
    fn call_logins(&self, logins: &[Registration]) -> Answers {
        logins
            .iter()
            .map(|reg| {
                let this = self.clone();
                let reg = reg.clone();
                async move {
                    let answer = this.call_login(&reg).await;
                    (reg.id, answer)
                }
            })
            .collect::<FuturesUnordered<_>>()
            .boxed()
    }

    /// Records that the credentials of `id` are in use.
    fn installed(&self, id: &HandlerId, credentials: &Credentials) {
        let expires = credentials.expiration.map(crate::persistence::time::format);
        info!(handler.id = %id, server = %credentials.server, priority = credentials.priority, expires, "logged in: the API client now uses the login handler's credentials");
        {
            let mut state = self.inner.state.lock();
            state.logged_in = true;
            state.login_problem = None;
            state.expires_at = credentials.expiration;
        }
        self.bump();
    }

    /// Collects the rest of a round's `answers` in the background, installing those that
    /// outrank the credentials in use, until the calls end (at their deadline at the latest),
    /// a new round starts, or the activities stop.
    fn upgrade_later(&self, mut answers: Answers, priority: i32, round: u64) {
        let Some(switch) = self.inner.switch.clone() else {
            return;
        };
        let this = self.clone();
        let task = tokio::spawn(
            async move {
                let mut install = |id: HandlerId, credentials: Credentials| {
                    let this = this.clone();
                    let switch = switch.clone();
                    async move {
                        let _serial = this.inner.login_lock.lock().await;
                        if this.inner.state.lock().login_round != round {
                            return Err("a newer login round runs".to_owned());
                        }
                        switch
                            .install(&id.0, &credentials)
                            .await
                            .map_err(|e| crate::diagnostic::chain(&e))?;
                        this.installed(&id, &credentials);
                        Ok(())
                    }
                };
                upgrade_from(&mut answers, priority, &mut install).await;
            }
            .in_current_span(),
        );
        *self.inner.upgrade.lock() = Some(task.abort_handle());
    }

    /// Calls one login handler, within the login deadline: its credentials, or why there are
    /// none.
    async fn call_login(&self, reg: &Registration) -> Result<Credentials, String> {
        let timeout = self.inner.settings.login_timeout;
        let mut work = Work::new(
            reg.id.0.clone(),
            format!("login/{}", reg.id),
            Payload::Activity(Activity::Login),
        );
        work.attempt_timeout = Some(timeout);
        work.param.clone_from(&reg.param);
        // Dropping the invocation withdraws it, whether it waits for its process or runs.
        let answer = tokio::select! {
            answer = tokio::time::timeout(timeout + LOGIN_SLACK, self.inner.hub.invoke(work)) => answer,
            () = self.gone(&reg.id) => return Err("its process left".into()),
        };
        let Ok(outcome) = answer else {
            return Err(format!("no answer within {timeout:?}"));
        };
        match outcome {
            Outcome::Success {
                kind_result: Some(KindResult::Credentials(c)),
                ..
            } => Ok(c),
            Outcome::Success { .. } => Err("returned no credentials".into()),
            other => Err(diagnostics_of(&other).map_or_else(|| other.as_str().to_owned(), |d| d.summary)),
        }
    }

    /// Calls the login handlers again after the API answered 401, and before the credentials
    /// in use expire.
    async fn relogin(self, cancel: CancellationToken) {
        let Some(switch) = self.inner.switch.clone() else {
            return;
        };
        let mut unauthorized = switch.unauthorized();
        let mut changed = self.inner.changed.subscribe();
        loop {
            let expires_at = {
                let state = self.inner.state.lock();
                state.expires_at.filter(|_| state.logged_in)
            };
            let expiring = async {
                match expires_at {
                    Some(at) => tokio::time::sleep(relogin_in(at, SystemTime::now())).await,
                    None => std::future::pending().await,
                }
            };
            let expiring_now = tokio::select! {
                () = cancel.cancelled() => return,
                seen = unauthorized.changed() => if seen.is_err() { return } else { false },
                () = expiring => true,
                // A login elsewhere (or another change) may have set another expiration.
                seen = changed.changed() => if seen.is_err() { return } else { continue },
            };
            let logins = self.of_kind(HandlerKind::Login);
            if logins.is_empty() || !self.inner.state.lock().logged_in {
                continue;
            }
            if expiring_now {
                let expires = expires_at.map(crate::persistence::time::format);
                info!(identity = %switch.identity(), expires, "the login credentials are about to expire; calling the login handlers again");
            } else {
                warn!(identity = %switch.identity(), "the API server answered 401 Unauthorized; calling the login handlers again");
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = self.login() => {}
            }
            // Requests that failed with the old credentials meanwhile need no second login.
            unauthorized.borrow_and_update();
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            unauthorized.borrow_and_update();
        }
    }

    /// Keeps the probe results fresh enough for `/healthz`.
    async fn probes(self, cancel: CancellationToken) {
        let mut registrations = self.inner.hub.registrations();
        let mut known: Vec<String> = Vec::new();
        loop {
            registrations.borrow_and_update();
            let probes = self.of_kind(HandlerKind::Probe);
            let ids: Vec<String> = probes.iter().map(|r| r.id.0.clone()).collect();
            let added = ids.iter().any(|id| !known.contains(id));
            for gone in known.iter().filter(|id| !ids.contains(id)) {
                self.inner.health.remove(&format!("probe/{gone}"));
                self.inner.state.lock().probes.remove(gone);
            }
            for id in ids.iter().filter(|id| !known.contains(id)) {
                self.register_check(id);
            }
            known = ids;
            let stale = self
                .inner
                .state
                .lock()
                .probes_run_at
                .is_none_or(|t| t.elapsed() >= self.inner.settings.probe_cache);
            if !probes.is_empty() && (added || stale) {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = self.run_probes(&probes) => {}
                }
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = self.inner.probe_wanted.notified() => {}
                changed = registrations.changed() => if changed.is_err() { return },
            }
        }
    }

    fn register_check(&self, id: &str) {
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let key = id.to_owned();
        self.inner.health.liveness(&format!("probe/{id}"), move || {
            weak.upgrade()
                .and_then(|inner| inner.state.lock().probes.get(&key).map(|(c, _)| c.clone()))
                .unwrap_or_else(|| Check::pass("not run yet"))
        });
    }

    async fn run_probes(&self, probes: &[Registration]) {
        let timeout = self.inner.settings.probe_timeout;
        let results = join_all(probes.iter().map(|reg| async move {
            let mut work = Work::new(reg.id.0.clone(), format!("probe/{}", reg.id), Payload::Probe);
            work.attempt_timeout = Some(timeout);
            work.param.clone_from(&reg.param);
            // Dropping the invocation withdraws it (the handler gets a Cancel).
            let result = match tokio::time::timeout(timeout, self.inner.hub.invoke(work)).await {
                Err(_) => (
                    Check::fail(format!("the probe handler did not answer within {timeout:?}")),
                    None,
                ),
                Ok(outcome) => probe_result(outcome, timeout),
            };
            (reg.id.0.clone(), result)
        }))
        .await;
        let mut state = self.inner.state.lock();
        for (id, (check, value)) in results {
            if !check.ok {
                warn!(handler.id = %id, problem = %check.message, "probe failed");
            }
            state.probes.insert(id, (check, value));
        }
        state.probes_run_at = Some(Instant::now());
        drop(state);
        self.inner.probes_ran.send_modify(|n| *n += 1);
    }

    /// Runs the cleanup handlers of the connected handler processes, within `within` (those
    /// not run already because their process left first).
    pub async fn cleanup(&self, within: Duration) {
        let owned: Vec<(ConnectionId, Registration)> = self
            .of_kind(HandlerKind::Cleanup)
            .into_iter()
            .filter_map(|reg| Some((self.inner.hub.owner(&reg.id)?, reg)))
            .collect();
        let cleanups = self.claim_cleanups(owned);
        if cleanups.is_empty() {
            return;
        }
        self.run_cleanups(&cleanups, within)
            .instrument(info_span!("activities", activity = "cleanup"))
            .await;
    }

    /// Those of `cleanups` not run yet for their process, now marked as running.
    fn claim_cleanups(
        &self,
        cleanups: Vec<(ConnectionId, Registration)>,
    ) -> Vec<(ConnectionId, Registration)> {
        let mut state = self.inner.state.lock();
        cleanups
            .into_iter()
            .filter(|(conn, reg)| {
                let key = (*conn, reg.id.clone());
                if state.cleaned.contains_key(&key) {
                    return false;
                }
                state.cleaned.insert(key, false);
                true
            })
            .collect()
    }

    /// Waits (until `deadline`) for the cleanup handlers of `conn` that are running to finish
    /// (the controller's own stop may have claimed them first).
    async fn cleaned_up(&self, conn: ConnectionId, deadline: Instant) {
        let mut ran = self.inner.cleanups_ran.subscribe();
        loop {
            let running = self
                .inner
                .state
                .lock()
                .cleaned
                .iter()
                .any(|((c, _), done)| *c == conn && !done);
            if !running {
                return;
            }
            if tokio::time::timeout_at(deadline, ran.changed()).await.is_err() {
                return;
            }
        }
    }

    /// Runs the cleanup handlers of processes that leave before the controller (their
    /// goodbye asked for them; see the protocol's `CAPABILITY_CLEANUP_ON_GOODBYE`), then tells
    /// each process with `Farewell`. Several leave at once in a pod's shutdown: each runs on
    /// its own, bounded by [`Settings::cleanup_grace`]; a stop waits for those running (within
    /// that bound), since the controller's own cleanup skips them.
    async fn leavers(self, cancel: CancellationToken) {
        let grace = self.inner.settings.cleanup_grace;
        let mut running = JoinSet::new();
        loop {
            let (conn, cleanups) = tokio::select! {
                leaving = self.inner.hub.next_leaving() => leaving,
                () = cancel.cancelled() => break,
                Some(_) = running.join_next(), if !running.is_empty() => continue,
            };
            let this = self.clone();
            running.spawn(
                async move {
                    let ids: Vec<String> = cleanups.iter().map(|r| r.id.0.clone()).collect();
                    let cleanups = this.claim_cleanups(cleanups.into_iter().map(|r| (conn, r)).collect());
                    info!(connection.id = conn, handlers = ?ids, "running the cleanup handlers of a process that is leaving");
                    let reason = format!("cleanup handlers run: {}", ids.join(", "));
                    this.run_cleanups(&cleanups, grace).await;
                    // Those the controller's own stop claimed first are still its: waited for.
                    this.cleaned_up(conn, Instant::now() + grace.min(Duration::from_secs(3600))).await;
                    this.inner.hub.farewell(conn, reason, Duration::from_secs(5)).await;
                }
                .in_current_span(),
            );
        }
        while running.join_next().await.is_some() {}
    }

    /// Runs `cleanups` together, each until it succeeds, fails for good, its process is gone
    /// or `within` passed; each is marked as run when it ends.
    async fn run_cleanups(&self, cleanups: &[(ConnectionId, Registration)], within: Duration) {
        const YEAR: Duration = Duration::from_secs(365 * 86_400);
        let deadline = Instant::now() + within.min(YEAR);
        let runs = cleanups.iter().map(|(conn, reg)| async move {
            self.run_cleanup(reg, deadline).await;
            if let Some(done) = self.inner.state.lock().cleaned.get_mut(&(*conn, reg.id.clone())) {
                *done = true;
            }
            self.inner.cleanups_ran.send_modify(|n| *n += 1);
        });
        join_all(runs).await;
    }

    /// Runs one cleanup handler until it succeeds, fails for good, its process is gone or
    /// `deadline` comes.
    async fn run_cleanup(&self, reg: &Registration, deadline: Instant) {
        {
            let started = SystemTime::now();
            let mut record = ProgressRecord::started(started, "cleanup");
            loop {
                let mut work = Work::new(
                    reg.id.0.clone(),
                    format!("cleanup/{}", reg.id),
                    Payload::Activity(Activity::Cleanup),
                );
                work.attempt = record.retries + 1;
                work.started = started;
                work.param.clone_from(&reg.param);
                // A process that is gone is not waited for: its cleanup cannot run elsewhere.
                work.report_losses = true;
                let outcome = match tokio::time::timeout_at(deadline, self.inner.hub.invoke(work)).await {
                    Ok(Outcome::Lost) => {
                        warn!(handler.id = %reg.id, "the cleanup handler's process left before it finished");
                        return;
                    }
                    Ok(o) => o,
                    Err(_) => {
                        warn!(handler.id = %reg.id, "cleanup handler did not finish within the shutdown grace");
                        return;
                    }
                };
                match execution::judge(reg, &mut record, outcome, SystemTime::now()) {
                    Verdict::Success { .. } | Verdict::Unrecorded => {
                        info!(handler.id = %reg.id, "cleanup handler succeeded");
                        return;
                    }
                    Verdict::Failure => {
                        warn!(handler.id = %reg.id, message = record.message.as_deref().unwrap_or_default(), "cleanup handler failed");
                        return;
                    }
                    Verdict::Retry => {
                        let at = record.delayed_until().unwrap_or(started);
                        let delay = at.duration_since(SystemTime::now()).unwrap_or_default();
                        if Instant::now().checked_add(delay).is_none_or(|at| at >= deadline) {
                            warn!(handler.id = %reg.id, message = record.message.as_deref().unwrap_or_default(), "cleanup handler failed; no time left to retry");
                            return;
                        }
                        tokio::time::sleep(delay).await;
                    }
                }
            }
        }
    }
}

/// What resource watching still waits for (see [`Activities::ready`]).
fn awaited(inner: &Inner, registrations: &[Registration]) -> Result<(), String> {
    let state = inner.state.lock();
    // The startup handlers run before the login: they are what is waited for first.
    let waiting: Vec<&str> = registrations
        .iter()
        .filter(|r| r.kind == HandlerKind::Startup && !state.started.contains(&r.id))
        .map(|r| r.id.0.as_str())
        .collect();
    if !waiting.is_empty() {
        return Err(format!("waiting for startup handlers: {}", waiting.join(", ")));
    }
    let login = registrations.iter().any(|r| r.kind == HandlerKind::Login);
    // Once the operator runs, it runs on the credentials in use: a late login gates nothing.
    if login && !state.logged_in && !state.operating && inner.switch.is_some() {
        return Err(match &state.login_problem {
            Some(problem) => format!("waiting for a login handler's credentials (last attempt: {problem})"),
            None => "waiting for a login handler's credentials".into(),
        });
    }
    Ok(())
}

/// One round's login answers, as they arrive.
type Answers = BoxStream<'static, (HandlerId, Result<Credentials, String>)>;

/// Takes `answers` as they arrive until one is installed: credentials not expired yet, of a
/// priority above `above` (any, when `None`), that `install` accepts. Among answers ready
/// together, the highest priority is tried first. `None` when the answers ran out;
/// `problems` says why the others were not installed.
async fn next_installed<I, F>(
    answers: &mut Answers,
    above: Option<i32>,
    install: &mut I,
    problems: &mut Vec<String>,
) -> Option<(HandlerId, Credentials)>
where
    I: FnMut(HandlerId, Credentials) -> F,
    F: Future<Output = Result<(), String>>,
{
    while let Some(first) = answers.next().await {
        let mut ready = vec![first];
        while let Some(Some(more)) = answers.next().now_or_never() {
            ready.push(more);
        }
        let mut candidates = Vec::new();
        for (id, answer) in ready {
            match answer {
                Ok(credentials) if above.is_none_or(|p| credentials.priority > p) => {
                    candidates.push((id, credentials));
                }
                Ok(_) => {}
                Err(problem) => problems.push(format!("{id}: {problem}")),
            }
        }
        candidates.sort_by_key(|(_, c)| std::cmp::Reverse(c.priority));
        let now = SystemTime::now();
        for (id, credentials) in candidates {
            if let Some(at) = credentials.expiration.filter(|at| *at <= now) {
                problems.push(format!(
                    "{id}: the credentials expired at {}",
                    crate::persistence::time::format(at)
                ));
                continue;
            }
            match install(id.clone(), credentials.clone()).await {
                Ok(()) => return Some((id, credentials)),
                Err(problem) => problems.push(format!("{id}: {problem}")),
            }
        }
    }
    None
}

/// Installs, from the `answers` still coming, each that outranks the credentials in use (of
/// `priority`): kopf's highest priority wins, though the first usable answer was installed
/// without waiting for it.
async fn upgrade_from<I, F>(answers: &mut Answers, mut priority: i32, install: &mut I)
where
    I: FnMut(HandlerId, Credentials) -> F,
    F: Future<Output = Result<(), String>>,
{
    let mut problems = Vec::new();
    while let Some((_, credentials)) = next_installed(answers, Some(priority), install, &mut problems).await {
        priority = credentials.priority;
    }
    if !problems.is_empty() {
        debug!(problems = %problems.join("; "), "later login answers not installed");
    }
}

fn diagnostics_of(outcome: &Outcome) -> Option<Diagnostic> {
    match outcome {
        Outcome::Temporary { diagnostics, .. }
        | Outcome::Permanent { diagnostics, .. }
        | Outcome::Unclassified { diagnostics, .. } => {
            let mut d = diagnostics.first().cloned().unwrap_or_default();
            d.summary = Diagnostic::summarize(diagnostics);
            Some(d)
        }
        Outcome::TimedOut => Some(Diagnostic::error(
            "TIMED_OUT",
            "the attempt exceeded its deadline",
        )),
        _ => None,
    }
}

/// What one probe outcome shows in `/healthz`.
fn probe_result(outcome: Outcome, timeout: Duration) -> (Check, Option<Value>) {
    match outcome {
        Outcome::Success { result, .. } => (Check::pass("ok"), Some(result.unwrap_or(Value::Null))),
        Outcome::TimedOut | Outcome::Abandoned => (
            Check::fail(format!("the probe handler did not answer within {timeout:?}")),
            None,
        ),
        Outcome::Skipped => (Check::pass("skipped"), None),
        Outcome::Cancelled => (Check::fail("the probe was cancelled"), None),
        other => {
            let why = diagnostics_of(&other).map_or_else(|| other.as_str().to_owned(), |d| d.summary);
            (Check::fail(format!("the probe handler failed: {why}")), None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::hub;
    use capstan_proto::pb;

    fn reg(id: &str, kind: HandlerKind) -> Registration {
        Registration::new(id, kind, None)
    }

    #[test]
    fn ready_waits_for_startup_handlers_and_login() {
        let activities = Activities::new(
            Hub::new(hub::Settings::default()),
            Health::default(),
            None,
            Settings::default(),
        );
        let regs = [reg("s", HandlerKind::Startup), reg("c", HandlerKind::Create)];
        assert!(activities.ready(&regs).unwrap_err().contains('s'));
        activities
            .inner
            .state
            .lock()
            .started
            .insert(HandlerId("s".into()));
        assert!(activities.ready(&regs).is_ok());
        assert!(
            activities.ready(&[reg("l", HandlerKind::Login)]).is_ok(),
            "without a swappable client login handlers cannot gate"
        );
    }

    /// Login gates resource watching until the operator first starts; after that the
    /// operator runs on the credentials in use, and a late login handler gates nothing.
    #[tokio::test]
    async fn a_late_login_handler_gates_nothing_once_the_operator_runs() {
        let api = tower::service_fn(|_req: http::Request<kube::client::Body>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(kube::client::Body::empty()))
        });
        let switch = Switchable::new(
            kube::Config::new("https://127.0.0.1:6443".parse().expect("a URL")),
            kube::Client::new(api, "default"),
            Duration::from_secs(1),
        );
        let activities = Activities::new(
            Hub::new(hub::Settings::default()),
            Health::default(),
            Some(switch),
            Settings::default(),
        );
        let regs = [reg("l", HandlerKind::Login), reg("c", HandlerKind::Create)];
        assert!(
            activities.ready(&regs).unwrap_err().contains("login"),
            "before the operator starts, login gates the watching"
        );
        let with_startup = [reg("s", HandlerKind::Startup), regs[0].clone(), regs[1].clone()];
        assert!(
            activities
                .ready(&with_startup)
                .unwrap_err()
                .contains("startup handlers: s"),
            "the startup handlers run before the login: they are what is waited for first"
        );
        activities.inner.state.lock().operating = true;
        assert!(activities.ready(&regs).is_ok(), "a late login gates nothing");
    }

    #[test]
    fn credentials_are_replaced_ahead_of_their_expiration() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let secs = Duration::from_secs;
        // An hour: a minute ahead.
        assert_eq!(relogin_in(now + secs(3600), now), secs(3540));
        // Two minutes: a fifth ahead.
        assert_eq!(relogin_in(now + secs(120), now), secs(96));
        // Short-lived or expired: never more often than the floor.
        assert_eq!(relogin_in(now + secs(3), now), MIN_RELOGIN_INTERVAL);
        assert_eq!(relogin_in(now - secs(30), now), MIN_RELOGIN_INTERVAL);
        assert_eq!(relogin_in(SystemTime::UNIX_EPOCH, now), MIN_RELOGIN_INTERVAL);
    }

    #[test]
    fn probe_outcomes_become_checks_and_values() {
        let t = Duration::from_secs(5);
        let (check, value) = probe_result(Outcome::success(Some(serde_json::json!({"ok": 1}))), t);
        assert!(check.ok && value.unwrap()["ok"] == 1);
        let (check, value) = probe_result(Outcome::TimedOut, t);
        assert!(!check.ok && value.is_none() && check.message.contains("5s"));
        let (check, _) = probe_result(
            Outcome::Permanent {
                diagnostics: vec![Diagnostic::error("X", "boom")],
                subhandlers: vec![],
            },
            t,
        );
        assert!(!check.ok && check.message.contains("boom"));
    }

    #[tokio::test]
    async fn the_cache_shows_values_and_asks_for_a_refresh_when_stale() {
        let health = Health::default();
        let activities = Activities::new(
            Hub::new(hub::Settings::default()),
            health.clone(),
            None,
            Settings::default(),
        );
        activities
            .inner
            .state
            .lock()
            .probes
            .insert("p".into(), (Check::pass("ok"), Some(serde_json::json!(42))));
        activities.register_check("p");
        let live = health.live();
        assert_eq!(live.probes["p"], 42);
        assert!(live.checks["probe/p"].ok);
        // Never run: the provider asked the prober to run.
        tokio::time::timeout(Duration::from_secs(1), activities.inner.probe_wanted.notified())
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_stale_healthz_waits_for_the_probes_that_answer_in_time() {
        let health = Health::default();
        let hub = Hub::new(hub::Settings::default());
        let activities = Activities::new(hub.clone(), health.clone(), None, Settings::default());
        let cancel = CancellationToken::new();
        let running = tokio::spawn(activities.clone().run(cancel.clone()));
        // A process with a probe handler answering 7, then 8: the value at start is stale
        // later, and /healthz shows the new one, not the cached one.
        let (tx, mut rx) = tokio::sync::mpsc::channel(8);
        let (conn, _) = hub.attach(
            tx,
            8,
            false,
            vec![Registration::new("p", HandlerKind::Probe, None)],
        );
        hub.open(conn);
        let answer = |rx: &mut tokio::sync::mpsc::Receiver<pb::ConnectResponse>, value: i64| {
            let message = rx.try_recv();
            let Ok(pb::ConnectResponse {
                message: Some(pb::connect_response::Message::Invocation(inv)),
            }) = message
            else {
                return false;
            };
            let result = pb::InvocationResult {
                invocation_id: inv.invocation_id,
                outcome: Some(pb::invocation_result::Outcome::Success(pb::Success {
                    result: Some(pb::Json {
                        json: value.to_string().into_bytes(),
                    }),
                    ..Default::default()
                })),
                ..Default::default()
            };
            hub.complete(conn, &result).is_ok()
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while !answer(&mut rx, 7) {
            assert!(Instant::now() < deadline, "the probe was not run at start");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        while health.live().probes.get("p") != Some(&serde_json::json!(7)) {
            assert!(Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        activities.inner.state.lock().probes_run_at = Instant::now().checked_sub(Duration::from_secs(60));
        let fresh = tokio::spawn({
            let health = health.clone();
            async move { health.live_fresh().await }
        });
        while !answer(&mut rx, 8) {
            assert!(
                Instant::now() < deadline,
                "a stale /healthz did not run the probe"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(fresh.await.unwrap().probes["p"], 8);
        // A probe that does not answer leaves the cached value, within the bound.
        activities.inner.state.lock().probes_run_at = Instant::now().checked_sub(Duration::from_secs(60));
        let started = Instant::now();
        assert_eq!(health.live_fresh().await.probes["p"], 8);
        assert!(started.elapsed() < crate::observability::health::FRESH_WAIT + Duration::from_millis(500));
        cancel.cancel();
        running.await.unwrap();
    }

    #[tokio::test]
    async fn a_cleanup_handler_runs_once_per_process_and_a_leaver_waits_for_one_claimed_first() {
        let activities = Activities::new(
            Hub::new(hub::Settings::default()),
            Health::default(),
            None,
            Settings::default(),
        );
        let c = || Registration::new("cleanup_fn", HandlerKind::Cleanup, None);
        assert_eq!(activities.claim_cleanups(vec![(1, c())]).len(), 1);
        assert!(
            activities.claim_cleanups(vec![(1, c())]).is_empty(),
            "twice for one process"
        );
        // The same handler of the process that replaced it (a restarted container) runs again.
        assert_eq!(activities.claim_cleanups(vec![(2, c())]).len(), 1);
        // Process 2's cleanup is running (the controller's stop claimed it): a leaver waits.
        let waiting = tokio::spawn({
            let activities = activities.clone();
            async move {
                activities
                    .cleaned_up(2, Instant::now() + Duration::from_secs(5))
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished());
        *activities
            .inner
            .state
            .lock()
            .cleaned
            .get_mut(&(2, HandlerId::from("cleanup_fn")))
            .unwrap() = true;
        activities.inner.cleanups_ran.send_modify(|n| *n += 1);
        tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn a_failed_startup_is_reported() {
        let activities = Activities::new(
            Hub::new(hub::Settings::default()),
            Health::default(),
            None,
            Settings::default(),
        );
        activities.inner.failed.send_replace(Some("s\0boom".into()));
        let err = activities.failed().await;
        assert_eq!(err.to_string(), "startup handler s failed: boom");
    }

    /// kopf's rule: the highest priority wins. The first usable answer is installed at once
    /// (nothing waits for slower handlers), and an answer of a higher priority that arrives
    /// later within the login deadline replaces it; a lower one does not.
    #[tokio::test(start_paused = true)]
    async fn a_slower_higher_priority_login_answer_replaces_a_faster_lower_one() {
        fn answer(
            id: &str,
            after_ms: u64,
            priority: Option<i32>,
        ) -> futures::future::BoxFuture<'static, (HandlerId, Result<Credentials, String>)> {
            let id = HandlerId(id.into());
            async move {
                tokio::time::sleep(Duration::from_millis(after_ms)).await;
                let credentials = priority
                    .map(|priority| Credentials {
                        token: id.0.clone(),
                        priority,
                        ..Credentials::default()
                    })
                    .ok_or_else(|| "returned no credentials".to_owned());
                (id, credentials)
            }
            .boxed()
        }
        let mut answers: Answers = [
            answer("low", 10, Some(1)),
            answer("broken", 20, None),
            answer("high", 100, Some(5)),
            answer("middle", 150, Some(3)),
            answer("silent", 10_000_000, Some(9)),
        ]
        .into_iter()
        .collect::<FuturesUnordered<_>>()
        .boxed();
        let installed = Arc::new(Mutex::new(Vec::<(String, Duration)>::new()));
        let started = Instant::now();
        let mut install = |id: HandlerId, _: Credentials| {
            let installed = installed.clone();
            async move {
                installed.lock().push((id.0, started.elapsed()));
                Ok(())
            }
        };
        let mut problems = Vec::new();
        let (first, credentials) = next_installed(&mut answers, None, &mut install, &mut problems)
            .await
            .expect("an answer");
        assert_eq!(first.0, "low", "the first usable answer is installed at once");
        assert_eq!(started.elapsed(), Duration::from_millis(10));
        let upgrading = upgrade_from(&mut answers, credentials.priority, &mut install);
        // Upgrading collects the answers while calls run (each until its deadline).
        tokio::time::timeout(Duration::from_secs(60), upgrading)
            .await
            .expect_err("the silent call still runs");
        let installed: Vec<_> = installed.lock().clone();
        assert_eq!(
            installed,
            [
                ("low".to_owned(), Duration::from_millis(10)),
                ("high".to_owned(), Duration::from_millis(100)),
            ],
            "the higher priority replaced the lower one when it answered; a middle one did not"
        );
    }
}
