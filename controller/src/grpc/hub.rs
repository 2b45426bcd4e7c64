//! The hub: which handler process owns which handler, and the dispatch of work to them.
//!
//! The engine (or a test) calls [`Hub::invoke`] with one [`Work`] and awaits one [`Outcome`].
//! Everything in between happens here: waiting until some connection has registered the
//! handler, the per-handler and per-process in-flight caps (fair, first come first served),
//! the attempt's deadline and the `Cancel` it triggers (an attempt the SDK stopped at its
//! deadline before that timed out too), and redelivery when a connection drops
//! (a new invocation id, the next attempt number, and the poison-pill guard after repeated
//! losses). Work that cannot be dispatched waits here, in memory, never in gRPC buffers.
//!
//! `grpc::connection` feeds the hub with what arrives on each stream; the hub never touches the
//! stream itself except through each connection's bounded outgoing channel.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use capstan_proto::pb;
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tracing::{Instrument, debug, info_span, warn};

use super::{Control, convert};

/// How much earlier than the controller an SDK may find an attempt's deadline passed: it is
/// sent as a wall-clock time and enforced on the process's own clock. A `Cancelled` the
/// controller did not ask for, this close to the deadline, is the attempt timing out.
const CLOCK_SKEW: std::time::Duration = std::time::Duration::from_millis(500);
use crate::model::{
    CancelReason, Diagnostic, HandlerId, Outcome, Patch, Posting, Registration, ResourceRef, Work,
    operator_settings::{Field, OperatorSettings},
};

/// Identifies one connection (one `Connect` stream) for the controller's lifetime.
pub type ConnectionId = u64;

/// Tunables of the hub.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Grace given to an invocation after `Cancel` before it is abandoned. Default 5 s.
    pub cancel_grace: Duration,
    /// After this many consecutive connection losses while the same work was in flight, the
    /// work fails permanently (poison-pill guard). Default 3.
    pub max_losses: u32,
    /// Most pieces of work of one handler waiting in the hub for a connection with room.
    /// Further callers of [`Hub::invoke`] for that handler wait, first come first served,
    /// before their work enters the hub: the backpressure reaches the engine's queues instead
    /// of growing a list here, and one handler's backlog (its process away or slow, thousands
    /// of daemons) never holds up another handler's work. Default 10,000.
    pub max_waiting: usize,
    /// The operator-wide settings whose flags were given to the controller, with the flags'
    /// values: a process's other value for them is not applied, and the process is told so.
    pub operator_flags: OperatorSettings,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            cancel_grace: Duration::from_secs(5),
            max_losses: 3,
            max_waiting: 10_000,
            operator_flags: OperatorSettings::default(),
        }
    }
}

/// Dispatches work to connected handler processes. Cheap to clone.
#[derive(Clone)]
pub struct Hub {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    settings: Settings,
    ids: AtomicU64,
    /// Makes invocation ids unique across controller restarts: ids are `<boot>-<conn>-<n>`.
    boot: String,
    /// Room for each handler's work waiting for dispatch ([`Settings::max_waiting`]).
    waiting: Mutex<HashMap<HandlerId, Arc<tokio::sync::Semaphore>>>,
    registrations: watch::Sender<Arc<Vec<Registration>>>,
    paused: watch::Sender<bool>,
    postings: tokio::sync::broadcast::Sender<Posting>,
    /// Rings when a process that is leaving asks for its cleanup handlers
    /// ([`Hub::leave_with_cleanup`]).
    leaving: Notify,
    /// The operator-wide settings in effect, from the processes' `ProcessSettings`.
    operator: watch::Sender<OperatorSettings>,
}

#[derive(Default)]
struct State {
    connections: HashMap<ConnectionId, Conn>,
    owners: HashMap<HandlerId, ConnectionId>,
    in_flight: HashMap<String, InFlight>,
    waiters: HashMap<HandlerId, VecDeque<(u64, Arc<Notify>)>>,
    granted: HashMap<u64, Grant>,
    paused: bool,
    /// Processes that said goodbye asking for their cleanup handlers, not yet taken by
    /// [`Hub::next_leaving`]; each connection at most once, so bounded by the connections.
    leaving: VecDeque<ConnectionId>,
}

struct Conn {
    tx: mpsc::Sender<pb::ConnectResponse>,
    open: bool,
    /// The process said goodbye asking for its cleanup handlers: only those are dispatched
    /// to it now (it is no longer `open`).
    cleaning_up: bool,
    /// How the process wants its handlers' outcomes posted (its `ProcessSettings`).
    outcome_events: crate::model::posting::OutcomeEvents,
    /// The operator-wide settings the process sent (its `ProcessSettings.operator`).
    operator: OperatorSettings,
    /// The process accepts `ObjectUpdate` messages.
    object_updates: bool,
    /// The process wants `ObjectGone` messages.
    object_gone: bool,
    max_in_flight: u32,
    in_flight: u32,
    handlers: HashMap<HandlerId, HandlerSlot>,
    /// Handler ids in the order of the connection's hello.
    order: Vec<HandlerId>,
    /// The connection's index handlers whose index is not built yet: until it is empty, the
    /// connection gets no resource work other than indexing (kopf's readiness gate).
    unbuilt: HashSet<HandlerId>,
}

struct HandlerSlot {
    registration: Registration,
    max_in_flight: Option<u32>,
    in_flight: u32,
    /// Daemons run for an object's lifetime: they do not count against the process cap, so
    /// they can never starve change handlers.
    uncapped: bool,
    /// The same handler registered for more resources (same id and kind).
    also: Vec<Registration>,
}

#[derive(Clone)]
struct Grant {
    conn: ConnectionId,
    tx: mpsc::Sender<pb::ConnectResponse>,
    object_updates: bool,
}

struct InFlight {
    conn: ConnectionId,
    handler: HandlerId,
    object: Option<ResourceRef>,
    trace: crate::model::TraceContext,
    reply: oneshot::Sender<Delivery>,
    updates: Option<mpsc::UnboundedSender<Vec<Patch>>>,
}

#[allow(clippy::large_enum_variant, reason = "one per invocation, moved once")]
enum Delivery {
    Result(Outcome),
    Lost,
}

/// Why a result or update was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No invocation with that id is in flight on this connection.
    #[error("invocation {0:?} is unknown or no longer in flight (stale result)")]
    Stale(String),
}

impl Default for Hub {
    fn default() -> Self {
        Self::new(Settings::default())
    }
}

impl Hub {
    /// An empty hub.
    pub fn new(settings: Settings) -> Self {
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                waiting: Mutex::new(HashMap::new()),
                settings,
                ids: AtomicU64::new(1),
                boot: boot_id(),
                registrations: watch::channel(Arc::new(Vec::new())).0,
                paused: watch::channel(false).0,
                postings: tokio::sync::broadcast::channel(1024).0,
                leaving: Notify::new(),
                operator: watch::channel(OperatorSettings::default()).0,
            }),
        }
    }

    /// The hub's settings.
    pub fn settings(&self) -> &Settings {
        &self.inner.settings
    }

    /// A fresh id (connections, invocations).
    pub(crate) fn next_id(&self) -> u64 {
        self.inner.ids.fetch_add(1, Ordering::Relaxed)
    }

    /// This controller run's part of every invocation id: random per process start, so that
    /// ids are never reused after a restart.
    pub fn boot_id(&self) -> &str {
        &self.inner.boot
    }

    /// The registrations of all connected handler processes, updated on every change.
    pub fn registrations(&self) -> watch::Receiver<Arc<Vec<Registration>>> {
        self.inner.registrations.subscribe()
    }

    /// How many handler processes are connected (and past the handshake).
    pub fn connections(&self) -> usize {
        self.inner
            .state
            .lock()
            .connections
            .values()
            .filter(|c| c.open)
            .count()
    }

    /// The connection that owns `handler`, if one does.
    pub fn owner(&self, handler: &HandlerId) -> Option<ConnectionId> {
        self.inner.state.lock().owners.get(handler).copied()
    }

    /// Which of `ids` are owned by a live connection already.
    pub(crate) fn owned(&self, ids: &[HandlerId]) -> HashSet<HandlerId> {
        let state = self.inner.state.lock();
        ids.iter()
            .filter(|id| state.owners.contains_key(*id))
            .cloned()
            .collect()
    }

    /// Attaches a connection with its accepted registrations, closed for dispatch until
    /// [`Hub::open`]. Registrations whose id another connection took in the meantime are
    /// returned and not attached.
    pub(crate) fn attach(
        &self,
        tx: mpsc::Sender<pb::ConnectResponse>,
        max_in_flight: u32,
        object_updates: bool,
        registrations: Vec<Registration>,
    ) -> (ConnectionId, Vec<Registration>) {
        let id = self.next_id();
        let mut state = self.inner.state.lock();
        let mut handlers = HashMap::new();
        let mut order = Vec::new();
        let mut taken = Vec::new();
        let mut unbuilt = HashSet::new();
        for reg in registrations {
            if let Some(slot) = handlers.get_mut(&reg.id) {
                // Another selector of a handler of this same connection.
                let slot: &mut HandlerSlot = slot;
                slot.also.push(reg);
                continue;
            }
            if state.owners.contains_key(&reg.id) {
                taken.push(reg);
                continue;
            }
            state.owners.insert(reg.id.clone(), id);
            order.push(reg.id.clone());
            if reg.kind == crate::model::HandlerKind::Index {
                unbuilt.insert(reg.id.clone());
            }
            handlers.insert(
                reg.id.clone(),
                HandlerSlot {
                    max_in_flight: reg.max_in_flight,
                    uncapped: reg.kind == crate::model::HandlerKind::Daemon,
                    registration: reg,
                    in_flight: 0,
                    also: Vec::new(),
                },
            );
        }
        state.connections.insert(
            id,
            Conn {
                tx,
                open: false,
                cleaning_up: false,
                outcome_events: crate::model::posting::OutcomeEvents::Default,
                operator: OperatorSettings::default(),
                object_updates,
                object_gone: false,
                max_in_flight,
                in_flight: 0,
                handlers,
                order,
                unbuilt,
            },
        );
        (id, taken)
    }

    /// Opens a connection for dispatch (after its `Welcome` was queued).
    pub(crate) fn open(&self, conn: ConnectionId) {
        let mut state = self.inner.state.lock();
        if let Some(c) = state.connections.get_mut(&conn) {
            if c.cleaning_up {
                return;
            }
            c.open = true;
        }
        state.pump_conn(conn);
        self.publish(&state);
    }

    /// Stops new dispatch to a connection (its `Goodbye`); running invocations go on.
    pub(crate) fn close_for_dispatch(&self, conn: ConnectionId) {
        if let Some(c) = self.inner.state.lock().connections.get_mut(&conn) {
            c.open = false;
        }
    }

    /// A process leaving before the controller asks for its cleanup handlers (its `Goodbye`
    /// with `cleanup`): nothing else is dispatched to it, and [`Hub::next_leaving`] hands its
    /// cleanup registrations to whoever runs them. Returns false when it has none (nothing to
    /// wait for: answer with `Farewell` at once).
    pub(crate) fn leave_with_cleanup(&self, conn: ConnectionId) -> bool {
        let mut state = self.inner.state.lock();
        let Some(c) = state.connections.get_mut(&conn) else {
            return false;
        };
        c.open = false;
        let any = c
            .handlers
            .values()
            .any(|s| s.registration.kind == crate::model::HandlerKind::Cleanup);
        if any && !c.cleaning_up {
            c.cleaning_up = true;
            state.leaving.push_back(conn);
            self.inner.leaving.notify_one();
        }
        any
    }

    /// The next process that asked for its cleanup handlers as it leaves, with those
    /// registrations (the ones it still owns). Connections gone meanwhile are skipped.
    ///
    /// # Cancel safety
    /// Cancel-safe: a request is taken only when this resolves.
    pub async fn next_leaving(&self) -> (ConnectionId, Vec<Registration>) {
        loop {
            let notified = self.inner.leaving.notified();
            {
                let mut state = self.inner.state.lock();
                while let Some(conn) = state.leaving.pop_front() {
                    let Some(c) = state.connections.get(&conn) else {
                        continue;
                    };
                    let cleanups = c
                        .order
                        .iter()
                        .filter_map(|id| c.handlers.get(id))
                        .filter(|s| s.registration.kind == crate::model::HandlerKind::Cleanup)
                        .filter(|s| state.owners.get(&s.registration.id) == Some(&conn))
                        .map(|s| s.registration.clone())
                        .collect();
                    return (conn, cleanups);
                }
            }
            notified.await;
        }
    }

    /// Tells a leaving process that its cleanup is done (`Farewell`); it may close its stream.
    /// Waits at most `within` for room in its outgoing queue.
    pub async fn farewell(&self, conn: ConnectionId, reason: String, within: Duration) {
        let tx = {
            let state = self.inner.state.lock();
            state.connections.get(&conn).map(|c| c.tx.clone())
        };
        if let Some(tx) = tx {
            let message = pb::ConnectResponse {
                message: Some(pb::connect_response::Message::Farewell(pb::Farewell { reason })),
            };
            let _ = tokio::time::timeout(within, tx.send(message)).await;
        }
    }

    /// Takes a process's `ProcessSettings` (the latest replaces the earlier ones).
    pub(crate) fn set_outcome_events(&self, conn: ConnectionId, wants: crate::model::posting::OutcomeEvents) {
        if let Some(c) = self.inner.state.lock().connections.get_mut(&conn) {
            c.outcome_events = wants;
        }
    }

    /// Takes a process's operator-wide settings (the latest replace the earlier ones) and
    /// brings those in effect up to date. Returns, per field, why a value is not applied (a
    /// flag given to the controller, or a process connected earlier that set another).
    pub(crate) fn set_operator_settings(
        &self,
        conn: ConnectionId,
        wanted: OperatorSettings,
    ) -> Vec<(Field, String)> {
        let mut state = self.inner.state.lock();
        // An expelled or departed process's settings change nothing.
        if !state.connections.contains_key(&conn) {
            return Vec::new();
        }
        let mut earlier: Vec<(ConnectionId, &OperatorSettings)> = state
            .connections
            .iter()
            .filter(|(id, _)| **id < conn)
            .map(|(id, c)| (*id, &c.operator))
            .collect();
        earlier.sort_by_key(|(id, _)| *id);
        let why = OperatorSettings::overruled(
            &wanted,
            &self.inner.settings.operator_flags,
            earlier.iter().map(|(_, o)| *o),
        );
        // In effect: each field this process sets, unless a flag fixes it or a process
        // connected earlier sets it. Nothing else changes (a value stays when its process
        // leaves, and an overruled one does not take over then).
        let flags = &self.inner.settings.operator_flags;
        self.inner.operator.send_if_modified(|current| {
            let mut next = current.clone();
            for field in wanted.set_fields() {
                let fixed = flags.is_set(field) || earlier.iter().any(|(_, o)| o.is_set(field));
                if !fixed {
                    next.take(field, &wanted);
                }
            }
            let changed = next != *current;
            *current = next;
            changed
        });
        if let Some(c) = state.connections.get_mut(&conn) {
            c.operator = wanted;
        }
        why
    }

    /// The operator-wide settings in effect, updated when a process sends or takes away a
    /// value that changes them.
    pub fn operator_settings(&self) -> watch::Receiver<OperatorSettings> {
        self.inner.operator.subscribe()
    }

    /// How the process that owns `handler` wants its outcomes posted as Events; as the
    /// controller's settings say when no process owns it.
    pub fn outcome_events(&self, handler: &HandlerId) -> crate::model::posting::OutcomeEvents {
        let state = self.inner.state.lock();
        state
            .owners
            .get(handler)
            .and_then(|conn| state.connections.get(conn))
            .map(|c| c.outcome_events)
            .unwrap_or_default()
    }

    /// Removes a connection: its handlers become unowned and its in-flight work is re-queued
    /// as new attempts by the callers waiting for it.
    pub(crate) fn detach(&self, conn: ConnectionId) {
        let mut state = self.inner.state.lock();
        let Some(c) = state.connections.remove(&conn) else {
            return;
        };
        for id in c.handlers.keys() {
            if state.owners.get(id) == Some(&conn) {
                state.owners.remove(id);
            }
        }
        let lost: Vec<String> = state
            .in_flight
            .iter()
            .filter(|(_, f)| f.conn == conn)
            .map(|(id, _)| id.clone())
            .collect();
        for id in lost {
            if let Some(f) = state.in_flight.remove(&id) {
                let _ = f.reply.send(Delivery::Lost);
            }
        }
        self.publish(&state);
    }

    /// Withdraws every registration of the process that owns `handler` (as [`Hub::detach`]
    /// does when it leaves) and tells it why with a `Notice`; the stream stays open, and the
    /// process may reconnect. Returns whether such a process was connected.
    pub(crate) fn expel(&self, handler: &HandlerId, diagnostic: &Diagnostic) -> bool {
        let owner = {
            let state = self.inner.state.lock();
            state
                .owners
                .get(handler)
                .and_then(|conn| state.connections.get(conn).map(|c| (*conn, c.tx.clone())))
        };
        let Some((conn, tx)) = owner else {
            return false;
        };
        let _ = tx.try_send(pb::ConnectResponse {
            message: Some(pb::connect_response::Message::Notice(pb::Notice {
                invocation_id: String::new(),
                diagnostics: vec![convert::diagnostic_to_pb(diagnostic)],
            })),
        });
        self.detach(conn);
        true
    }

    /// Changes a connection's caps (`FlowControl`): `None` handler means the process cap; 0
    /// pauses.
    pub(crate) fn flow_control(&self, conn: ConnectionId, handler: Option<&HandlerId>, max_in_flight: u32) {
        let mut state = self.inner.state.lock();
        let Some(c) = state.connections.get_mut(&conn) else {
            return;
        };
        match handler {
            None => c.max_in_flight = max_in_flight,
            Some(h) => {
                if let Some(slot) = c.handlers.get_mut(h) {
                    slot.max_in_flight = Some(max_in_flight);
                }
            }
        }
        state.pump_conn(conn);
    }

    /// Makes connection `conn` receive `ObjectGone` (it negotiated `CAPABILITY_OBJECT_GONE`).
    pub(crate) fn send_object_gone(&self, conn: ConnectionId) {
        if let Some(c) = self.inner.state.lock().connections.get_mut(&conn) {
            c.object_gone = true;
        }
    }

    /// Tells every connection that wants it and has handlers for the object's resource that
    /// the object is gone. Best effort: a congested connection misses it.
    pub fn object_gone(&self, object: &ResourceRef) {
        let message = pb::ConnectResponse {
            message: Some(pb::connect_response::Message::ObjectGone(pb::ObjectGone {
                object: Some(convert::resource_ref_to_pb(object)),
            })),
        };
        let state = self.inner.state.lock();
        for c in state.connections.values().filter(|c| c.open && c.object_gone) {
            let handles = c.handlers.values().any(|s| {
                std::iter::once(&s.registration).chain(&s.also).any(|r| {
                    r.resource.as_ref().is_none_or(|res| {
                        res.group == object.resource.group && res.plural == object.resource.plural
                    })
                })
            });
            if handles && c.tx.try_send(message.clone()).is_err() {
                debug!(object.uid = %object.uid, "object-gone notice not sent: the connection is congested");
            }
        }
    }

    /// The index handlers of open connections, with the connection that owns each.
    pub fn index_owners(&self) -> Vec<(HandlerId, ConnectionId)> {
        let state = self.inner.state.lock();
        let mut owners: Vec<(HandlerId, ConnectionId)> = state
            .connections
            .iter()
            .filter(|(_, c)| c.open)
            .flat_map(|(conn, c)| {
                c.handlers
                    .values()
                    .filter(|s| s.registration.kind == crate::model::HandlerKind::Index)
                    .map(|s| (s.registration.id.clone(), *conn))
            })
            .collect();
        owners.sort();
        owners
    }

    /// Records that `handler`'s index on connection `conn` is built (every object of its
    /// listing went through it once). When the connection's last index is built, the rest of
    /// its work is dispatched.
    pub fn index_built(&self, conn: ConnectionId, handler: &HandlerId) {
        let mut state = self.inner.state.lock();
        let Some(c) = state.connections.get_mut(&conn) else {
            return;
        };
        if c.unbuilt.remove(handler) && c.unbuilt.is_empty() {
            debug!(connection = conn, "every index of the handler process is built");
            state.pump_conn(conn);
        }
    }

    /// Whether every index of connection `conn` is built (its resource work is no longer held);
    /// `false` for a connection that is not attached.
    pub fn indexes_built(&self, conn: ConnectionId) -> bool {
        self.inner
            .state
            .lock()
            .connections
            .get(&conn)
            .is_some_and(|c| c.unbuilt.is_empty())
    }

    /// Pauses or resumes all dispatch (drain at shutdown, freezing, loss of leadership).
    pub fn set_paused(&self, paused: bool) {
        self.inner
            .paused
            .send_if_modified(|p| std::mem::replace(p, paused) != paused);
        let mut state = self.inner.state.lock();
        state.paused = paused;
        if !paused {
            let conns: Vec<ConnectionId> = state.connections.keys().copied().collect();
            for conn in conns {
                state.pump_conn(conn);
            }
        }
    }

    /// Whether dispatch is paused, updated on every change (daemons stop while paused).
    pub fn paused(&self) -> watch::Receiver<bool> {
        self.inner.paused.subscribe()
    }

    /// Sends a message to every open connection, best effort (`Drain`).
    pub fn broadcast(&self, message: pb::connect_response::Message) {
        let txs: Vec<_> = self
            .inner
            .state
            .lock()
            .connections
            .values()
            .map(|c| c.tx.clone())
            .collect();
        for tx in txs {
            let _ = tx.try_send(pb::ConnectResponse {
                message: Some(message.clone()),
            });
        }
    }

    /// How many pieces of work wait in the hub for a connection with room (at most
    /// [`Settings::max_waiting`]; further callers wait before entering).
    pub fn waiting(&self) -> usize {
        self.inner.state.lock().waiters.values().map(VecDeque::len).sum()
    }

    /// How many invocations are in flight in total.
    pub fn in_flight(&self) -> usize {
        self.inner.state.lock().in_flight.len()
    }

    /// Delivers a result from connection `conn`.
    ///
    /// # Errors
    /// [`Error::Stale`] when no such invocation is in flight on that connection. Otherwise the
    /// result is delivered; a diagnostic is returned when it had to be turned into a failure
    /// (malformed patch or JSON), so the handler process can be told.
    pub(crate) fn complete(
        &self,
        conn: ConnectionId,
        result: &pb::InvocationResult,
    ) -> Result<Option<Diagnostic>, Error> {
        let (outcome, problem) = convert::outcome(result);
        let mut state = self.inner.state.lock();
        let owned = state
            .in_flight
            .get(&result.invocation_id)
            .is_some_and(|f| f.conn == conn);
        if !owned {
            return Err(Error::Stale(result.invocation_id.clone()));
        }
        let Some(f) = state.in_flight.remove(&result.invocation_id) else {
            return Err(Error::Stale(result.invocation_id.clone()));
        };
        state.release(f.conn, &f.handler);
        let _ = f.reply.send(Delivery::Result(outcome));
        Ok(problem)
    }

    /// Delivers the patches of an `InvocationUpdate`.
    ///
    /// # Errors
    /// [`Error::Stale`] when no such invocation is in flight on that connection.
    pub(crate) fn update(
        &self,
        conn: ConnectionId,
        invocation_id: &str,
        patches: Vec<Patch>,
    ) -> Result<bool, Error> {
        let state = self.inner.state.lock();
        match state.in_flight.get(invocation_id) {
            Some(f) if f.conn == conn => Ok(f.updates.as_ref().is_some_and(|tx| tx.send(patches).is_ok())),
            _ => Err(Error::Stale(invocation_id.to_owned())),
        }
    }

    /// The handler and object of an invocation in flight, for logs.
    pub(crate) fn handler_of(&self, invocation_id: &str) -> Option<(HandlerId, Option<ResourceRef>)> {
        self.inner
            .state
            .lock()
            .in_flight
            .get(invocation_id)
            .map(|f| (f.handler.clone(), f.object.clone()))
    }

    /// The trace of an invocation in flight, for logs of its records.
    pub(crate) fn trace_of(&self, invocation_id: &str) -> Option<crate::model::TraceContext> {
        self.inner
            .state
            .lock()
            .in_flight
            .get(invocation_id)
            .map(|f| f.trace)
    }

    /// Publishes a record that may become a Kubernetes Event (best effort: a lagging
    /// subscriber loses the oldest records).
    pub(crate) fn post(&self, posting: Posting) {
        let _ = self.inner.postings.send(posting);
    }

    /// Records from handler processes that may become Kubernetes Events.
    pub fn postings(&self) -> tokio::sync::broadcast::Receiver<Posting> {
        self.inner.postings.subscribe()
    }

    fn publish(&self, state: &State) {
        let mut conns: Vec<(&ConnectionId, &Conn)> =
            state.connections.iter().filter(|(_, c)| c.open).collect();
        conns.sort_by_key(|(id, _)| **id);
        let all: Vec<Registration> = conns
            .into_iter()
            .flat_map(|(_, c)| {
                c.order
                    .iter()
                    .filter_map(|id| c.handlers.get(id))
                    .flat_map(|s| std::iter::once(s.registration.clone()).chain(s.also.iter().cloned()))
            })
            .collect();
        self.inner.registrations.send_if_modified(|current| {
            if **current == all {
                false
            } else {
                *current = Arc::new(all);
                true
            }
        });
    }

    /// Runs `work` to one outcome: waits for a connection that registered the handler and has
    /// room, sends the invocation, enforces the attempt deadline, and redelivers the work as
    /// a new attempt when the connection drops.
    ///
    /// # Cancel safety
    /// Dropping the future withdraws the work: a waiting request leaves the queue, and an
    /// invocation in flight is cancelled on the handler side (`Cancel{SUPERSEDED}`) and its
    /// late result is ignored.
    pub async fn invoke(&self, work: Work) -> Outcome {
        self.dispatch(work, Control::default()).await
    }

    /// Like [`Hub::invoke`], steered by `control`: cancelled by its token (with its reason),
    /// patches of the running invocation sent to its `updates`, the object's newer bodies
    /// taken from its `body_updates`.
    ///
    /// # Cancel safety
    /// As [`Hub::invoke`].
    pub async fn dispatch(&self, mut work: Work, control: Control) -> Outcome {
        let span = info_span!("invocation", handler.id = %work.handler_id, key = %work.idempotency_key, trace.id = %work.trace.trace_id());
        async move {
            let mut losses = 0u32;
            loop {
                let grant = tokio::select! {
                    grant = self.wait_and_acquire(&work.handler_id) => grant,
                    // Withdrawn before it reached a handler: nothing to abandon.
                    () = control.cancel.cancelled() => return Outcome::Cancelled,
                };
                let started = tokio::time::Instant::now();
                match self.attempt(&work, &control, grant).await {
                    Delivery::Result(outcome) => {
                        crate::observability::metrics::global().invocation(
                            work.handler_id.0.as_str(),
                            outcome.as_str(),
                            started.elapsed(),
                        );
                        return outcome;
                    }
                    Delivery::Lost if work.report_losses => return Outcome::Lost,
                    Delivery::Lost => {
                        losses += 1;
                        if losses >= self.inner.settings.max_losses {
                            warn!(losses, "handler process lost repeatedly while running this work");
                            return Outcome::Permanent {
                                diagnostics: vec![Diagnostic::error(
                                    "HANDLER_PROCESS_LOST",
                                    format!(
                                        "the handler process disconnected {losses} times while processing"
                                    ),
                                )],
                                subhandlers: Vec::new(),
                            };
                        }
                        work.attempt += 1;
                        work.last_error = Some(Diagnostic::error(
                            "HANDLER_PROCESS_LOST",
                            "the handler process disconnected during the previous attempt",
                        ));
                        debug!(attempt = work.attempt, "re-queued after a lost connection");
                    }
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Waits for room among the handler's waiting work, then for a connection with room.
    async fn wait_and_acquire(&self, handler: &HandlerId) -> Grant {
        // The semaphore is never closed, so a permit always comes.
        let permit = self.room_for(handler).acquire_owned().await.ok();
        let grant = self.acquire(handler).await;
        drop(permit);
        grant
    }

    /// The handler's room for waiting work. Rooms nobody uses are forgotten once there are
    /// many, so handler ids that come and go do not accumulate.
    fn room_for(&self, handler: &HandlerId) -> Arc<tokio::sync::Semaphore> {
        const FORGET_IDLE_ABOVE: usize = 1024;
        let mut rooms = self.inner.waiting.lock();
        if rooms.len() > FORGET_IDLE_ABOVE {
            rooms.retain(|_, room| Arc::strong_count(room) > 1);
        }
        let max = self.inner.settings.max_waiting.max(1);
        rooms
            .entry(handler.clone())
            .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(max)))
            .clone()
    }

    async fn attempt(&self, work: &Work, control: &Control, grant: Grant) -> Delivery {
        let invocation_id = format!("{}-{}-{}", self.inner.boot, grant.conn, self.next_id());
        // Durations are bounded where they come off the wire; a deadline that would overflow
        // the clock is no deadline at all.
        let deadline = work
            .attempt_timeout
            .and_then(|t| tokio::time::Instant::now().checked_add(t));
        let wall_deadline = work
            .attempt_timeout
            .and_then(|t| SystemTime::now().checked_add(t));
        let (reply_tx, mut reply_rx) = oneshot::channel();
        {
            let mut state = self.inner.state.lock();
            if !state.connections.contains_key(&grant.conn) {
                return Delivery::Lost;
            }
            state.in_flight.insert(
                invocation_id.clone(),
                InFlight {
                    conn: grant.conn,
                    handler: work.handler_id.clone(),
                    object: work.object.clone(),
                    trace: work.trace,
                    reply: reply_tx,
                    updates: control.updates.clone(),
                },
            );
        }
        let mut guard = AttemptGuard {
            hub: self,
            invocation_id: &invocation_id,
            armed: true,
            cancel_sent: false,
        };
        let invocation = convert::invocation(work, &invocation_id, work.attempt, wall_deadline);
        let message = pb::ConnectResponse {
            message: Some(pb::connect_response::Message::Invocation(invocation)),
        };
        // Bounded: a connection whose process stops reading is dropped after its ping
        // timeout, which closes this channel; withdrawn work stops waiting at once.
        tokio::select! {
            sent = grant.tx.send(message) => if sent.is_err() {
                guard.withdraw();
                return Delivery::Lost;
            },
            () = control.cancel.cancelled() => {
                guard.withdraw();
                return Delivery::Result(Outcome::Cancelled);
            }
        }
        let grace = work.cancel_grace.unwrap_or(self.inner.settings.cancel_grace);
        let mut bodies = control.body_updates.clone().filter(|_| grant.object_updates);
        if let Some(b) = bodies.as_mut() {
            b.mark_unchanged();
        }
        let reason = loop {
            tokio::select! {
                delivery = &mut reply_rx => {
                    guard.armed = false;
                    return match delivery {
                        // Not asked to stop: the SDK stopped it at the deadline it was sent,
                        // on its own clock, a moment before ours.
                        Ok(Delivery::Result(Outcome::Cancelled)) if deadline.is_some_and(|d| tokio::time::Instant::now() + CLOCK_SKEW >= d) => {
                            Delivery::Result(Outcome::TimedOut)
                        }
                        Ok(delivery) => delivery,
                        Err(_) => Delivery::Lost,
                    };
                }
                () = sleep_until_opt(deadline) => break CancelReason::DeadlineExceeded,
                () = control.cancel.cancelled() => break control.reason(),
                changed = changed_opt(bodies.as_mut()) => {
                    if !changed {
                        bodies = None;
                        continue;
                    }
                    let body = bodies.as_mut().map(|b| b.borrow_and_update().clone());
                    if let Some(body) = body {
                        let update = pb::ObjectUpdate { invocation_id: invocation_id.clone(), body: Some(convert::to_json(&body)) };
                        // Never awaited here: the deadline and the cancellation stay polled. A
                        // congested connection misses this body; the next change brings a newer one.
                        if grant.tx.try_send(pb::ConnectResponse { message: Some(pb::connect_response::Message::ObjectUpdate(update)) }).is_err() {
                            debug!(%invocation_id, "object update not sent: the connection is congested");
                        }
                    }
                }
            }
        };
        let _ = grant.tx.try_send(cancel_message(&invocation_id, reason, grace));
        guard.cancel_sent = true;
        tokio::select! {
            delivery = &mut reply_rx => {
                guard.armed = false;
                match delivery {
                    // A handler that stopped because its deadline passed timed out.
                    Ok(Delivery::Result(Outcome::Cancelled)) if reason == CancelReason::DeadlineExceeded => {
                        Delivery::Result(Outcome::TimedOut)
                    }
                    Ok(delivery) => delivery,
                    Err(_) => Delivery::Lost,
                }
            }
            () = sleep_until_opt(tokio::time::Instant::now().checked_add(grace)) => {
                guard.withdraw();
                warn!(%invocation_id, ?reason, "invocation did not end within its cancel grace period; abandoned");
                Delivery::Result(if reason == CancelReason::DeadlineExceeded { Outcome::TimedOut } else { Outcome::Abandoned })
            }
        }
    }

    async fn acquire(&self, handler: &HandlerId) -> Grant {
        let waiter_id = self.next_id();
        let notify = Arc::new(Notify::new());
        {
            let mut state = self.inner.state.lock();
            state
                .waiters
                .entry(handler.clone())
                .or_default()
                .push_back((waiter_id, notify.clone()));
            if let Some(&conn) = state.owners.get(handler) {
                state.pump_conn(conn);
            }
        }
        let guard = WaiterGuard {
            hub: self,
            handler,
            waiter_id,
        };
        loop {
            notify.notified().await;
            if let Some(grant) = self.inner.state.lock().granted.remove(&waiter_id) {
                std::mem::forget(guard);
                return grant;
            }
        }
    }
}

/// A random id for this process start: 12 hex digits from the standard library's randomly
/// keyed hasher (seeded from the operating system), mixed with the time and the process id.
fn boot_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.write_u32(std::process::id());
    format!("{:012x}", hasher.finish() & 0xffff_ffff_ffff)
}

fn cancel_message(invocation_id: &str, reason: CancelReason, grace: Duration) -> pb::ConnectResponse {
    pb::ConnectResponse {
        message: Some(pb::connect_response::Message::Cancel(pb::Cancel {
            invocation_id: invocation_id.to_owned(),
            reason: convert::cancel_reason_to_pb(reason) as i32,
            grace_period: prost_types::Duration::try_from(grace).ok(),
        })),
    }
}

/// Waits for the next change; `false` when the sender is gone; forever without a receiver.
async fn changed_opt(rx: Option<&mut watch::Receiver<serde_json::Value>>) -> bool {
    match rx {
        Some(rx) => rx.changed().await.is_ok(),
        None => std::future::pending().await,
    }
}

/// Sleeps until `deadline`, or forever when there is none.
pub(crate) async fn sleep_until_opt(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

impl State {
    /// Hands capacity on `conn` to the handlers' waiters, first come first served.
    fn pump_conn(&mut self, conn: ConnectionId) {
        let Some(c) = self.connections.get(&conn) else {
            return;
        };
        if !c.open && !c.cleaning_up {
            return;
        }
        // While paused, only admission handlers are served: the API server waits for them,
        // and admission is never frozen (kopf serves webhooks on paused operators). A process
        // leaving with cleanup gets its cleanup handlers only, paused or not.
        let admitted = |h: &HandlerId| {
            let kind = c.handlers.get(h).map(|s| s.registration.kind);
            if c.open {
                !self.paused || kind.is_some_and(crate::model::HandlerKind::is_admission)
            } else {
                kind == Some(crate::model::HandlerKind::Cleanup)
            }
        };
        // Only the handlers that have waiting work: linear in what waits, not in what is
        // registered.
        let handlers: Vec<HandlerId> = self
            .waiters
            .iter()
            .filter(|(h, q)| !q.is_empty() && self.owners.get(*h) == Some(&conn) && admitted(h))
            .map(|(h, _)| h.clone())
            .collect();
        for handler in handlers {
            loop {
                let Some(c) = self.connections.get_mut(&conn) else {
                    return;
                };
                let indexing = !c.unbuilt.is_empty();
                let Some(slot) = c.handlers.get_mut(&handler) else {
                    break;
                };
                if indexing && held_while_indexing(slot.registration.kind) {
                    break;
                }
                // A leaving process's cleanup handlers are not held behind its running work.
                if !slot.uncapped && c.open && c.in_flight >= c.max_in_flight {
                    break;
                }
                if slot.max_in_flight.is_some_and(|cap| slot.in_flight >= cap) {
                    break;
                }
                let Some((waiter_id, notify)) = self.waiters.get_mut(&handler).and_then(VecDeque::pop_front)
                else {
                    break;
                };
                slot.in_flight += 1;
                if !slot.uncapped {
                    c.in_flight += 1;
                }
                self.granted.insert(
                    waiter_id,
                    Grant {
                        conn,
                        tx: c.tx.clone(),
                        object_updates: c.object_updates,
                    },
                );
                notify.notify_one();
            }
        }
    }

    fn release(&mut self, conn: ConnectionId, handler: &HandlerId) {
        let Some(c) = self.connections.get_mut(&conn) else {
            return;
        };
        c.in_flight = c.in_flight.saturating_sub(1);
        if let Some(slot) = c.handlers.get_mut(handler) {
            slot.in_flight = slot.in_flight.saturating_sub(1);
        }
        self.pump_conn(conn);
    }
}

/// Whether work of `kind` waits while its process's indexes are being built: resource
/// handlers other than the indexes themselves. Activities are not held (startup and login run
/// before anything is watched, kopf gives them no index guarantee), nor is admission (the API
/// server waits for its answer).
fn held_while_indexing(kind: crate::model::HandlerKind) -> bool {
    use crate::model::HandlerKind as K;
    kind.is_resource_kind() && !matches!(kind, K::Index | K::Validate | K::Mutate)
}

/// Withdraws a waiting request (and any capacity granted to it) when `acquire` is dropped.
struct WaiterGuard<'a> {
    hub: &'a Hub,
    handler: &'a HandlerId,
    waiter_id: u64,
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        let mut state = self.hub.inner.state.lock();
        if let Some(queue) = state.waiters.get_mut(self.handler) {
            queue.retain(|(id, _)| *id != self.waiter_id);
        }
        if let Some(grant) = state.granted.remove(&self.waiter_id) {
            state.release(grant.conn, self.handler);
        }
    }
}

/// Withdraws an invocation in flight when its attempt is dropped or abandoned.
struct AttemptGuard<'a> {
    hub: &'a Hub,
    invocation_id: &'a str,
    armed: bool,
    cancel_sent: bool,
}

impl AttemptGuard<'_> {
    fn withdraw(&mut self) {
        if !self.armed {
            return;
        }
        self.armed = false;
        let mut state = self.hub.inner.state.lock();
        if let Some(f) = state.in_flight.remove(self.invocation_id) {
            let tx = state
                .connections
                .get(&f.conn)
                .filter(|_| !self.cancel_sent)
                .map(|c| c.tx.clone());
            state.release(f.conn, &f.handler);
            drop(state);
            if let Some(tx) = tx {
                let _ = tx.try_send(cancel_message(
                    self.invocation_id,
                    CancelReason::Superseded,
                    Duration::ZERO,
                ));
            }
        }
    }
}

impl Drop for AttemptGuard<'_> {
    fn drop(&mut self) {
        self.withdraw();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{HandlerKind, Payload};

    fn reg(id: &str, cap: Option<u32>) -> Registration {
        let mut r = Registration::new(id, HandlerKind::Probe, None);
        r.max_in_flight = cap;
        r
    }

    fn attach(
        hub: &Hub,
        regs: Vec<Registration>,
        cap: u32,
    ) -> (ConnectionId, mpsc::Receiver<pb::ConnectResponse>) {
        let (tx, rx) = mpsc::channel(64);
        let (id, taken) = hub.attach(tx, cap, false, regs);
        assert!(taken.is_empty());
        hub.open(id);
        (id, rx)
    }

    fn invocation_of(msg: pb::ConnectResponse) -> pb::Invocation {
        match msg.message {
            Some(pb::connect_response::Message::Invocation(i)) => i,
            other => panic!("expected an invocation, got {other:?}"),
        }
    }

    fn success(id: &str) -> pb::InvocationResult {
        pb::InvocationResult {
            invocation_id: id.to_owned(),
            outcome: Some(pb::invocation_result::Outcome::Success(pb::Success::default())),
            ..Default::default()
        }
    }

    #[test]
    fn a_process_leaving_before_it_was_opened_is_never_opened() {
        let hub = Hub::default();
        let (tx, _rx) = mpsc::channel(8);
        let regs = vec![Registration::new("cleanup_fn", HandlerKind::Cleanup, None)];
        let (conn, _) = hub.attach(tx, 8, false, regs);
        assert!(hub.leave_with_cleanup(conn));
        hub.open(conn);
        assert!(
            hub.registrations().borrow().is_empty(),
            "a leaving process's registrations took effect"
        );
    }

    #[test]
    fn operator_settings_follow_the_first_process_stay_when_it_leaves_and_flags_overrule() {
        use crate::model::operator_settings::{Field, OperatorSettings};
        let hub = Hub::new(Settings {
            operator_flags: OperatorSettings {
                worker_limit: Some(16),
                ..OperatorSettings::default()
            },
            ..Settings::default()
        });
        let changes = hub.operator_settings();
        let (first, _rx1) = attach(&hub, vec![reg("a", None)], 8);
        let (second, _rx2) = attach(&hub, vec![reg("b", None)], 8);
        let wanted = |finalizer: &str| OperatorSettings {
            finalizer: Some(finalizer.into()),
            worker_limit: Some(4),
            ..OperatorSettings::default()
        };
        let why = hub.set_operator_settings(first, wanted("a.example/f"));
        assert_eq!(
            why.iter().map(|(f, _)| *f).collect::<Vec<_>>(),
            [Field::WorkerLimit]
        );
        assert!(changes.has_changed().unwrap());
        let why = hub.set_operator_settings(second, wanted("b.example/f"));
        assert_eq!(
            why.iter().map(|(f, _)| *f).collect::<Vec<_>>(),
            [Field::Finalizer, Field::WorkerLimit],
            "{why:?}"
        );
        assert_eq!(
            hub.operator_settings().borrow().finalizer.as_deref(),
            Some("a.example/f")
        );
        // A value stays when its process leaves; the overruled one does not take over unasked.
        assert_eq!(
            hub.operator_settings().borrow().worker_limit,
            None,
            "the flag's, not published"
        );
        hub.detach(first);
        assert_eq!(
            hub.operator_settings().borrow().finalizer.as_deref(),
            Some("a.example/f")
        );
        // Asked again, once no process connected earlier sets it, the value is taken.
        hub.set_operator_settings(second, wanted("b.example/f"));
        assert_eq!(
            hub.operator_settings().borrow().finalizer.as_deref(),
            Some("b.example/f")
        );
        hub.detach(second);
        assert_eq!(
            hub.operator_settings().borrow().finalizer.as_deref(),
            Some("b.example/f")
        );
    }

    #[tokio::test]
    async fn work_waits_for_a_connection_then_completes() {
        let hub = Hub::default();
        let task = tokio::spawn({
            let hub = hub.clone();
            async move { hub.invoke(Work::new("p", "k", Payload::Probe)).await }
        });
        tokio::task::yield_now().await;
        let (conn, mut rx) = attach(&hub, vec![reg("p", None)], 8);
        let inv = invocation_of(rx.recv().await.unwrap());
        assert_eq!(inv.attempt, 1);
        assert!(
            hub.complete(conn, &success(&inv.invocation_id))
                .unwrap()
                .is_none()
        );
        assert_eq!(task.await.unwrap(), Outcome::success(None));
        assert_eq!(hub.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_process_leaving_with_cleanup_gets_its_cleanup_handlers_only() {
        let hub = Hub::default();
        let regs = vec![
            Registration::new("create_fn", HandlerKind::Create, None),
            Registration::new("cleanup_fn", HandlerKind::Cleanup, None),
        ];
        let (conn, mut rx) = attach(&hub, regs, 8);
        let (bare, _bare_rx) = attach(&hub, vec![reg("probe_fn", None)], 8);
        assert!(
            !hub.leave_with_cleanup(bare),
            "a process without cleanup handlers waits for nothing"
        );
        assert!(hub.leave_with_cleanup(conn));
        assert!(hub.leave_with_cleanup(conn), "asking twice is harmless");
        let (leaving, cleanups) = hub.next_leaving().await;
        assert_eq!(leaving, conn);
        let ids: Vec<&str> = cleanups.iter().map(|r| r.id.0.as_str()).collect();
        assert_eq!(ids, ["cleanup_fn"]);
        let change = tokio::spawn({
            let hub = hub.clone();
            async move { hub.invoke(Work::new("create_fn", "c", Payload::Probe)).await }
        });
        let cleanup = tokio::spawn({
            let hub = hub.clone();
            async move { hub.invoke(Work::new("cleanup_fn", "x", Payload::Probe)).await }
        });
        let inv = invocation_of(rx.recv().await.unwrap());
        assert_eq!(inv.handler_id, "cleanup_fn");
        hub.complete(conn, &success(&inv.invocation_id)).unwrap();
        assert_eq!(cleanup.await.unwrap(), Outcome::success(None));
        hub.farewell(conn, "done".into(), Duration::from_secs(1)).await;
        match rx.recv().await.unwrap().message {
            Some(pb::connect_response::Message::Farewell(f)) => assert_eq!(f.reason, "done"),
            other => panic!("expected a farewell, got {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            rx.try_recv().is_err(),
            "a change handler was sent to a leaving process"
        );
        assert!(
            tokio::time::timeout(Duration::from_millis(50), hub.next_leaving())
                .await
                .is_err(),
            "each leaving process is handed out once"
        );
        change.abort();
    }

    #[tokio::test]
    async fn resource_work_waits_until_the_process_indexes_are_built() {
        let hub = Hub::default();
        let regs = vec![
            Registration::new("by_label", HandlerKind::Index, None),
            Registration::new("create_fn", HandlerKind::Create, None),
            reg("probe_fn", None),
        ];
        let (conn, mut rx) = attach(&hub, regs, 8);
        assert_eq!(hub.index_owners(), vec![(HandlerId::from("by_label"), conn)]);
        let change = tokio::spawn({
            let hub = hub.clone();
            async move { hub.invoke(Work::new("create_fn", "c", Payload::Probe)).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            rx.try_recv().is_err(),
            "a change handler ran before the index was built"
        );
        let index = tokio::spawn({
            let hub = hub.clone();
            async move {
                hub.invoke(Work::new("by_label", "i", Payload::Index { deleted: false }))
                    .await
            }
        });
        let probe = tokio::spawn({
            let hub = hub.clone();
            async move { hub.invoke(Work::new("probe_fn", "p", Payload::Probe)).await }
        });
        let mut first = vec![
            invocation_of(rx.recv().await.unwrap()),
            invocation_of(rx.recv().await.unwrap()),
        ];
        first.sort_by(|a, b| a.handler_id.cmp(&b.handler_id));
        assert_eq!(first[0].handler_id, "by_label", "index work is not held");
        assert_eq!(first[1].handler_id, "probe_fn", "activities are not held");
        for inv in &first {
            hub.complete(conn, &success(&inv.invocation_id)).unwrap();
        }
        index.await.unwrap();
        probe.await.unwrap();
        assert!(rx.try_recv().is_err(), "still held");
        hub.index_built(conn, &HandlerId::from("by_label"));
        let held = invocation_of(rx.recv().await.unwrap());
        assert_eq!(held.handler_id, "create_fn");
        hub.complete(conn, &success(&held.invocation_id)).unwrap();
        assert_eq!(change.await.unwrap(), Outcome::success(None));
    }

    #[tokio::test]
    async fn object_gone_reaches_the_processes_that_asked_and_handle_the_resource() {
        let hub = Hub::default();
        let examples = crate::model::ResolvedResource {
            group: "demo.capstan.dev".into(),
            version: "v1".into(),
            plural: "examples".into(),
            kind: "Example".into(),
            namespaced: true,
            status_subresource: false,
        };
        let mut others = examples.clone();
        others.plural = "others".into();
        let with = |id: &str, resource: &crate::model::ResolvedResource| {
            let mut r = Registration::new(id, HandlerKind::Create, None);
            r.resource = Some(resource.clone());
            r
        };
        let (wants, mut wants_rx) = attach(&hub, vec![with("a", &examples)], 8);
        hub.send_object_gone(wants);
        let (_silent, mut silent_rx) = attach(&hub, vec![with("b", &examples)], 8);
        let (elsewhere, mut elsewhere_rx) = attach(&hub, vec![with("c", &others)], 8);
        hub.send_object_gone(elsewhere);
        let object = ResourceRef {
            resource: examples,
            namespace: "default".into(),
            name: "one".into(),
            uid: "uid-one".into(),
            resource_version: "1".into(),
            generation: 1,
        };
        hub.object_gone(&object);
        match wants_rx.try_recv().map(|m| m.message) {
            Ok(Some(pb::connect_response::Message::ObjectGone(gone))) => {
                assert_eq!(gone.object.unwrap().uid, "uid-one");
            }
            other => panic!("expected object_gone, got {other:?}"),
        }
        assert!(silent_rx.try_recv().is_err(), "sent without the capability");
        assert!(elsewhere_rx.try_recv().is_err(), "sent for another resource");
    }

    #[tokio::test]
    async fn per_handler_cap_is_respected() {
        let hub = Hub::default();
        let (conn, mut rx) = attach(&hub, vec![reg("p", Some(1))], 8);
        let a = tokio::spawn({
            let hub = hub.clone();
            async move { hub.invoke(Work::new("p", "a", Payload::Probe)).await }
        });
        let b = tokio::spawn({
            let hub = hub.clone();
            async move { hub.invoke(Work::new("p", "b", Payload::Probe)).await }
        });
        let first = invocation_of(rx.recv().await.unwrap());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            rx.try_recv().is_err(),
            "second invocation dispatched despite the cap"
        );
        hub.complete(conn, &success(&first.invocation_id)).unwrap();
        let second = invocation_of(rx.recv().await.unwrap());
        hub.complete(conn, &success(&second.invocation_id)).unwrap();
        a.await.unwrap();
        b.await.unwrap();
    }

    #[tokio::test]
    async fn lost_connection_redelivers_as_next_attempt() {
        let hub = Hub::default();
        let (conn, mut rx) = attach(&hub, vec![reg("p", None)], 8);
        let task = tokio::spawn({
            let hub = hub.clone();
            async move { hub.invoke(Work::new("p", "k", Payload::Probe)).await }
        });
        let first = invocation_of(rx.recv().await.unwrap());
        hub.detach(conn);
        let (conn2, mut rx2) = attach(&hub, vec![reg("p", None)], 8);
        let second = invocation_of(rx2.recv().await.unwrap());
        assert_eq!(second.attempt, 2);
        assert_ne!(second.invocation_id, first.invocation_id);
        assert_eq!(second.last_error.unwrap().reason, "HANDLER_PROCESS_LOST");
        assert!(matches!(
            hub.complete(conn, &success(&first.invocation_id)),
            Err(Error::Stale(_))
        ));
        hub.complete(conn2, &success(&second.invocation_id)).unwrap();
        assert_eq!(task.await.unwrap(), Outcome::success(None));
    }

    #[tokio::test]
    async fn repeated_losses_become_permanent() {
        let hub = Hub::new(Settings {
            max_losses: 2,
            ..Settings::default()
        });
        let task = tokio::spawn({
            let hub = hub.clone();
            async move { hub.invoke(Work::new("p", "k", Payload::Probe)).await }
        });
        for _ in 0..2 {
            let (conn, mut rx) = attach(&hub, vec![reg("p", None)], 8);
            invocation_of(rx.recv().await.unwrap());
            hub.detach(conn);
        }
        let Outcome::Permanent { diagnostics, .. } = task.await.unwrap() else {
            panic!("not permanent")
        };
        assert_eq!(diagnostics[0].reason, "HANDLER_PROCESS_LOST");
    }

    #[tokio::test(start_paused = true)]
    async fn deadline_sends_cancel_then_times_out() {
        let hub = Hub::new(Settings {
            cancel_grace: Duration::from_secs(1),
            ..Settings::default()
        });
        let (_conn, mut rx) = attach(&hub, vec![reg("p", None)], 8);
        let mut work = Work::new("p", "k", Payload::Probe);
        work.attempt_timeout = Some(Duration::from_secs(2));
        let task = tokio::spawn({
            let hub = hub.clone();
            async move { hub.invoke(work).await }
        });
        invocation_of(rx.recv().await.unwrap());
        let cancel = rx.recv().await.unwrap();
        let Some(pb::connect_response::Message::Cancel(c)) = cancel.message else {
            panic!("no cancel")
        };
        assert_eq!(c.reason, pb::CancelReason::DeadlineExceeded as i32);
        assert_eq!(task.await.unwrap(), Outcome::TimedOut);
        assert_eq!(hub.in_flight(), 0);
    }

    #[tokio::test]
    async fn waiting_work_is_bounded_and_the_rest_waits_outside() {
        let hub = Hub::new(Settings {
            max_waiting: 2,
            ..Settings::default()
        });
        let tasks: Vec<_> = (0..3)
            .map(|i| {
                let hub = hub.clone();
                tokio::spawn(async move { hub.invoke(Work::new("p", format!("k{i}"), Payload::Probe)).await })
            })
            .collect();
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        assert_eq!(hub.waiting(), 2, "the third caller waits before entering the hub");
        let (conn, mut rx) = attach(&hub, vec![reg("p", None)], 8);
        for _ in 0..3 {
            let inv = invocation_of(rx.recv().await.unwrap());
            hub.complete(conn, &success(&inv.invocation_id)).unwrap();
        }
        for t in tasks {
            assert_eq!(t.await.unwrap(), Outcome::success(None));
        }
        assert_eq!(hub.waiting(), 0);
    }

    #[tokio::test]
    async fn one_handlers_backlog_does_not_hold_up_another_handler() {
        let hub = Hub::new(Settings {
            max_waiting: 2,
            ..Settings::default()
        });
        // "absent" has no process: its work waits, up to the bound, and more waits outside.
        let _absent: Vec<_> = (0..5)
            .map(|i| {
                let hub = hub.clone();
                tokio::spawn(async move {
                    hub.invoke(Work::new("absent", format!("k{i}"), Payload::Probe))
                        .await
                })
            })
            .collect();
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        let (conn, mut rx) = attach(&hub, vec![reg("p", None)], 8);
        let served = tokio::spawn({
            let hub = hub.clone();
            async move { hub.invoke(Work::new("p", "k", Payload::Probe)).await }
        });
        let inv = invocation_of(
            tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .expect("the other handler's work is dispatched")
                .unwrap(),
        );
        hub.complete(conn, &success(&inv.invocation_id)).unwrap();
        assert_eq!(served.await.unwrap(), Outcome::success(None));
    }

    #[tokio::test]
    async fn invocation_ids_carry_the_boot_id() {
        let (a, b) = (Hub::default(), Hub::default());
        assert_ne!(a.boot_id(), b.boot_id());
        let (_conn, mut rx) = attach(&a, vec![reg("p", None)], 8);
        let task = tokio::spawn({
            let hub = a.clone();
            async move { hub.invoke(Work::new("p", "k", Payload::Probe)).await }
        });
        let inv = invocation_of(rx.recv().await.unwrap());
        assert!(
            inv.invocation_id.starts_with(&format!("{}-", a.boot_id())),
            "{}",
            inv.invocation_id
        );
        task.abort();
    }

    #[tokio::test]
    async fn dropping_the_work_withdraws_it() {
        let hub = Hub::default();
        let (_conn, mut rx) = attach(&hub, vec![reg("p", Some(1))], 8);
        let task = tokio::spawn({
            let hub = hub.clone();
            async move { hub.invoke(Work::new("p", "k", Payload::Probe)).await }
        });
        invocation_of(rx.recv().await.unwrap());
        task.abort();
        let _ = task.await;
        let Some(pb::connect_response::Message::Cancel(c)) = rx.recv().await.unwrap().message else {
            panic!("no cancel")
        };
        assert_eq!(c.reason, pb::CancelReason::Superseded as i32);
        assert_eq!(hub.in_flight(), 0);
        // The capacity came back: the next work is dispatched.
        let next = tokio::spawn({
            let hub = hub.clone();
            async move { hub.invoke(Work::new("p", "k2", Payload::Probe)).await }
        });
        invocation_of(rx.recv().await.unwrap());
        next.abort();
    }
}
