"""The stream to the controller: `Hello`/`Welcome`, invocations run as tasks, `Cancel`,
`ObjectUpdate` for daemons, `Ping`/`Pong`, `Drain`, `Goodbye`, and reconnection with jittered
exponential backoff.

One writer task owns the stream's send side; everything else puts messages on its bounded
queue. Logs are dropped when it is full; results wait for room, but no longer than
`STALL_TIMEOUT`: a stream that takes nothing for that long is closed with `StreamStalled`, and
the process connects again. Invocations of a broken stream are stopped, since the controller re-queues them as new
attempts for the next connection.
"""

import asyncio
import json
import logging
import os
import random
import time
import uuid

import grpc

from capstan import __version__, events, flags, wire
from capstan import settings as settings_module
from capstan.errors import ConnectionFatal, StreamStalled
from capstan.indexes import Indexes
from capstan.invoke import Running, run
from capstan.registry import Registry
from capstan.structs import DaemonStoppingReason, Memo
from capstan.v1 import invocation_pb2 as inv
from capstan.v1 import runtime_service_pb2 as rs
from capstan.v1 import runtime_service_pb2_grpc as rs_grpc

log = logging.getLogger("capstan")

DEFAULT_ENDPOINT = "unix:///run/capstan/capstan.sock"
MAX_MESSAGE = 16 * 1024 * 1024
#: Bound of the outgoing queue: results wait for room, logs are dropped when it is full.
QUEUE_BOUND = 1024
#: How long a result waits for room in the outgoing queue before the stream counts as stalled.
STALL_TIMEOUT = 30.0
#: Bound of the per-object memos kept (kopf's memo); the oldest are forgotten first.
MEMO_BOUND = 10000
BACKOFF_MIN, BACKOFF_MAX = 0.2, 15.0
#: How long running handlers have to finish on SIGTERM.
STOP_GRACE = 10.0
#: How long handlers cancelled at the end of `STOP_GRACE` have to answer.
CANCEL_ANSWER_TIMEOUT = 1.0
#: How long a process whose handler ids are all taken by another connection keeps dialling: a
#: process that died frees them once the controller notices (at once when its socket closes, at
#: the ping timeout, 30 s, when it hangs); ids held longer are held by a live process.
ID_TAKEN_PATIENCE = 40.0
#: How long the controller has to end the stream after the handler process closed its side.
CLOSE_TIMEOUT = 5.0
#: How long a stopping process waits for the controller to run its cleanup handlers (counted
#: from its goodbye; the controller's own bound is its shutdown grace, 20 s by default). With
#: the stream's close (`CLOSE_TIMEOUT`) it stays within a pod's default 30 s grace period and
#: leaves the controller, stopped after this container, time to stop too (the tasks handlers
#: left running get what is left of those 25 s: `runner.STOP_BUDGET`).
CLEANUP_TIMEOUT = 20.0
_LEVELS = {
    logging.DEBUG: rs.LOG_LEVEL_DEBUG, logging.INFO: rs.LOG_LEVEL_INFO,
    logging.WARNING: rs.LOG_LEVEL_WARNING, logging.ERROR: rs.LOG_LEVEL_ERROR,
}
_CANCEL_REASONS = {
    inv.CANCEL_REASON_RESOURCE_DELETED: DaemonStoppingReason.RESOURCE_DELETED,
    inv.CANCEL_REASON_FILTER_MISMATCH: DaemonStoppingReason.FILTERS_MISMATCH,
    inv.CANCEL_REASON_DEADLINE_EXCEEDED: DaemonStoppingReason.DEADLINE_EXCEEDED,
    inv.CANCEL_REASON_SUPERSEDED: DaemonStoppingReason.SUPERSEDED,
    inv.CANCEL_REASON_RUNTIME_SHUTDOWN: DaemonStoppingReason.OPERATOR_EXITING,
    inv.CANCEL_REASON_HANDLER_UNREGISTERED: DaemonStoppingReason.HANDLER_UNREGISTERED,
    inv.CANCEL_REASON_PAUSED: DaemonStoppingReason.OPERATOR_PAUSING,
}


def _level(levelno):
    for threshold in (logging.ERROR, logging.WARNING, logging.INFO):
        if levelno >= threshold:
            return _LEVELS[threshold]
    return rs.LOG_LEVEL_DEBUG


class Memos:
    """kopf's memos: one per object (by uid), one for the operator's activities."""

    def __init__(self, base=None):
        self.operator = base if base is not None else Memo()
        self._by_uid = {}

    def of(self, uid):
        if not uid:
            return self.operator
        memo = self._by_uid.get(uid)
        if memo is None:
            if len(self._by_uid) >= MEMO_BOUND:
                self._by_uid.pop(next(iter(self._by_uid)))
            memo = Memo(self.operator)
            self._by_uid[uid] = memo
        return memo

    def forget(self, uid):
        self._by_uid.pop(uid, None)


class Session:
    """One connection's state."""

    def __init__(self, operator, call):
        self.operator = operator
        self.call = call
        # This stream's own indexes: the controller feeds every object to the index handlers
        # again on a new stream, and an index handler of a lost stream that answers late
        # folds into the lost stream's indexes, never into these.
        self.indexes = Indexes(operator.registry.index_names())
        self.queue = asyncio.Queue(QUEUE_BOUND)
        self.running = {}  # invocation id -> (Running, task)
        self.draining = False
        self.closed = False
        #: What the controller's welcome put in effect.
        self.capabilities = frozenset()
        #: Set by the controller's farewell: the cleanup a goodbye asked for is done.
        self.farewell = asyncio.Event()
        #: The `ProcessSettings` last sent on this stream.
        self.sent_settings = None
        self.dropped_logs = 0
        self.loop = asyncio.get_running_loop()
        #: Fails with `StreamStalled` once a message waited `STALL_TIMEOUT` for room.
        self.stalled = self.loop.create_future()

    async def send_settings(self):
        """Sends what kopf's `settings` say about the controller's work, when the controller
        takes it and it changed since the last time: for this process's handlers (their
        outcome Events: kopf 1.45 posts them only with `posting.loggers`), and for the whole
        operator (`settings_module.operator_settings`: the finalizer, the storages, the
        watches, the worker limit). A controller that takes no settings is given none; the
        flags that would do their job are named instead (once)."""
        settings = self.operator.settings
        # A controller that does not list the capability would drop the operator's settings
        # without a word: their flags are named instead.
        carried = rs.CAPABILITY_OPERATOR_SETTINGS in self.capabilities
        if not carried:
            settings_module.review(settings, carried=False)
        if rs.CAPABILITY_PROCESS_SETTINGS not in self.capabilities:
            return
        posting = settings.posting
        wanted = rs.ProcessSettings(
            outcome_events=rs.EVENT_POSTING_ALWAYS if posting.enabled and posting.loggers else rs.EVENT_POSTING_NEVER,
            outcome_level=_level(posting.level),
            operator=settings_module.operator_settings(settings) if carried else None)
        if wanted != self.sent_settings:
            self.sent_settings = wanted
            await self.send(rs.ConnectRequest(settings=wanted))

    async def send(self, message):
        """Queues a message that must not be dropped (a result, a pong, the goodbye): waits for
        room, and raises `StreamStalled` (ending the session) when there is none for
        `STALL_TIMEOUT`, so that neither the reader nor a stop waits on a stalled stream
        forever."""
        try:
            await asyncio.wait_for(self.queue.put(message), STALL_TIMEOUT)
        except asyncio.TimeoutError:
            error = StreamStalled(f"the stream to the controller took no message for {STALL_TIMEOUT:g}s "
                                  f"({self.queue.qsize()} waiting); closing it")
            if not self.stalled.done():
                self.stalled.set_exception(error)
            raise error from None

    def send_nowait(self, message):
        try:
            self.queue.put_nowait(message)
        except asyncio.QueueFull:
            self.dropped_logs += 1

    def event_sink(self, invocation_id):
        # The Event keeps its type (kopf.event's any name, kopf.exception's Error); the level
        # is for the controller's log.
        levels = {"Warning": rs.LOG_LEVEL_WARNING, "Error": rs.LOG_LEVEL_ERROR}

        def sink(record):
            ref = record["object"]
            message = rs.ConnectRequest(log=rs.LogRecord(
                invocation_id=invocation_id, level=levels.get(record["type"], rs.LOG_LEVEL_INFO),
                message=record["message"], posting=rs.EVENT_POSTING_ALWAYS, reason=record["reason"],
                object=wire.common.ResourceRef(**ref), event_type=str(record["type"] or ""),))
            self.loop.call_soon_threadsafe(self.send_nowait, message)

        return sink

    def log_sink(self, invocation_id):
        settings = self.operator.settings

        def sink(levelno, message):
            # kopf 1.45 posts log records as Events only with settings.posting.loggers.
            posting = rs.EVENT_POSTING_ALWAYS if settings_module.posts_log(settings, levelno) else rs.EVENT_POSTING_NEVER
            record = rs.ConnectRequest(log=rs.LogRecord(invocation_id=invocation_id, level=_level(levelno), message=message,
                                                        posting=posting))
            self.loop.call_soon_threadsafe(self.send_nowait, record)

        return sink


class Operator:
    """The handler process: its registry, and the reconnecting loop around sessions."""

    def __init__(self, registry: Registry, endpoint=None, memo=None, max_in_flight=0, stop=None, settings=None,
                 ready=None):
        self.registry = registry
        #: kopf's ready flag (`capstan.flags`): raised at the first welcome.
        self.ready = ready
        self.endpoint = endpoint or os.environ.get("CAPSTAN_ENDPOINT") or DEFAULT_ENDPOINT
        self.memos = Memos(memo)
        self.max_in_flight = max_in_flight
        self.stop = stop or asyncio.Event()
        self.instance_id = str(uuid.uuid4())
        # kopf's settings: startup handlers change them; the posting and the executor of sync
        # handlers are read from them on every use.
        self.settings = settings if settings is not None else settings_module.active()
        settings_module.activate(self.settings)
        # Settings given to kopf.run() or KopfRunner: named as a startup handler's are.
        settings_module.review(self.settings)
        self.by_id = {h.id: h for h in registry.handlers}
        registry.check()
        self.flow = {}  # handler id ("" for the process) -> the cap set with set_max_in_flight
        self.session = None

    @property
    def executor(self):
        """The executor of sync handlers (`settings.execution.executor`)."""
        return self.settings.execution.executor

    def set_max_in_flight(self, limit, handler=None):
        """Changes how many invocations the controller sends this process at once — or, with
        `handler` (an id), that handler — now and after reconnects; 0 pauses dispatch until a
        later call raises the cap. Safe to call from any thread, handlers included."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit < 2**32:
            raise ValueError(f"max_in_flight must be a non-negative integer, got {limit!r}")
        if handler is not None and handler not in self.by_id:
            raise ValueError(f"no handler {handler!r} is registered (known: {', '.join(sorted(self.by_id))})")
        self.flow[handler or ""] = limit
        session = self.session
        if session is not None and not session.closed:
            message = rs.ConnectRequest(flow_control=rs.FlowControl(handler_id=handler or "", max_in_flight=limit))
            asyncio.run_coroutine_threadsafe(session.queue.put(message), session.loop)

    def hello(self):
        return rs.ConnectRequest(hello=rs.Hello(
            capabilities=[rs.CAPABILITY_RESULT_ACK, rs.CAPABILITY_SDK_FILTERS, rs.CAPABILITY_SUBHANDLERS,
                          rs.CAPABILITY_OBJECT_UPDATES, rs.CAPABILITY_OBJECT_GONE, rs.CAPABILITY_INVOCATION_UPDATES,
                          rs.CAPABILITY_CLEANUP_ON_GOODBYE, rs.CAPABILITY_PROCESS_SETTINGS,
                          rs.CAPABILITY_DEFERRED_SUBHANDLERS, rs.CAPABILITY_OPERATOR_SETTINGS],
            sdk=rs.SoftwareInfo(name="capstan-python", version=__version__, language="python"),
            instance_id=self.instance_id,
            handlers=[wire.registration(h) for h in self.registry.handlers],
            max_in_flight=self.max_in_flight,
        ))

    async def run(self):
        """Connects, serves, and reconnects with jittered backoff until `stop` is set."""
        if not self.registry.handlers:
            raise ConnectionFatal("no handlers are registered: nothing to serve")
        delay = BACKOFF_MIN
        settings_module.use_executor(self.settings)
        taken_since = None
        try:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    await self._session()
                except ConnectionFatal:
                    raise
                except grpc.aio.AioRpcError as error:
                    if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        if not _only_taken(error.details() or ""):
                            raise ConnectionFatal(f"the controller accepted none of the handlers: {error.details()}") from None
                        # The ids are held by another connection: one of a process that just died
                        # lets go of them soon, so retry; one of a live process does not.
                        taken_since = taken_since if taken_since is not None else time.monotonic()
                        if time.monotonic() - taken_since > ID_TAKEN_PATIENCE:
                            raise ConnectionFatal(
                                f"the controller accepted none of the handlers: {error.details()} "
                                f"(still taken after {ID_TAKEN_PATIENCE:g}s)") from None
                    else:
                        taken_since = None
                    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        raise ConnectionFatal(f"the controller refused the handshake: {error.details()}") from None
                    log.warning("connection to %s lost: %s %s", self.endpoint, error.code().name, error.details())
                except (ConnectionError, OSError, asyncio.InvalidStateError) as error:
                    log.warning("connection to %s lost: %s: %s", self.endpoint, type(error).__name__, error)
                except Exception:  # an SDK bug must not end the process: reconnect and say so
                    log.exception("the session with %s failed", self.endpoint)
                if self.stop.is_set():
                    break
                if time.monotonic() - started > 30:
                    delay = BACKOFF_MIN
                wait = random.uniform(0, delay)
                log.info("reconnecting in %.1fs", wait)
                try:
                    await asyncio.wait_for(self.stop.wait(), wait)
                except asyncio.TimeoutError:
                    pass
                delay = min(delay * 2, BACKOFF_MAX)
        finally:
            # Sync handlers still running in it get the rest of the grace period (runner.run).
            settings_module.retire_executor(self.settings)

    async def _session(self):
        options = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]
        async with grpc.aio.insecure_channel(self.endpoint, options=options) as channel:
            call = rs_grpc.RuntimeServiceStub(channel).Connect()
            session = Session(self, call)
            events._set_process_sink(session.event_sink(""))
            writer = asyncio.create_task(self._writer(session))
            stopper = asyncio.create_task(self._stop_on_signal(session))
            self.session = session
            try:
                await session.queue.put(self.hello())
                # Caps set with set_max_in_flight hold on every connection (0, a pause, has no
                # place in the hello).
                for handler_id, limit in list(self.flow.items()):
                    await session.queue.put(rs.ConnectRequest(
                        flow_control=rs.FlowControl(handler_id=handler_id, max_in_flight=limit)))
                reader = asyncio.create_task(self._reader(session))
                try:
                    await asyncio.wait({reader, writer, session.stalled}, return_when=asyncio.FIRST_COMPLETED)
                    if session.stalled.done():
                        session.stalled.result()
                    if not reader.done():
                        # We said goodbye and closed our side: the controller ends the stream.
                        await asyncio.wait({reader}, timeout=CLOSE_TIMEOUT)
                    if reader.done():
                        reader.result()
                    elif writer.done():
                        writer.result()
                finally:
                    reader.cancel()
            finally:
                if session.stalled.done():
                    session.stalled.exception()  # raised above, or by the reader
                else:
                    session.stalled.cancel()
                stopper.cancel()
                events._set_process_sink(None)
                session.closed = True
                self.session = None
                for running, task in list(session.running.values()):
                    running.cancelled = True
                    running.stop.set(DaemonStoppingReason.CONNECTION_LOST)
                    task.cancel()
                writer.cancel()
                await asyncio.gather(writer, stopper, return_exceptions=True)
                call.cancel()

    async def _writer(self, session):
        while True:
            message = await session.queue.get()
            if message is None:
                await session.call.done_writing()
                return
            await session.call.write(message)

    async def _stop_on_signal(self, session):
        """On stop: goodbye, let running invocations end (they are told to stop), close.

        A process with cleanup handlers asks in its goodbye for them (when the controller
        offers it): in the chart's pod this process stops before the controller, which then
        invokes them on this stream and says farewell once they are done; the stream closes
        after that, or after `CLEANUP_TIMEOUT`."""
        await self.stop.wait()
        log.info("stopping")
        cleanup = (rs.CAPABILITY_CLEANUP_ON_GOODBYE in session.capabilities
                   and any(h.kind == "cleanup" for h in self.registry.handlers))
        said = time.monotonic()
        await session.send(rs.ConnectRequest(goodbye=rs.Goodbye(reason="handler process stopping", cleanup=cleanup)))
        for running, _ in list(session.running.values()):
            running.stop.set(DaemonStoppingReason.OPERATOR_EXITING)
        # What runs, and what came after the goodbye (crossing it on the wire), has until
        # `STOP_GRACE` from the goodbye to finish.
        deadline = said + STOP_GRACE
        while True:
            tasks = [task for _, task in session.running.values()]
            left = deadline - time.monotonic()
            if not tasks or left <= 0:
                break
            await asyncio.wait(tasks, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        if cleanup:
            left = max(0.0, CLEANUP_TIMEOUT - (time.monotonic() - said))
            try:
                # The farewell comes after the cleanup handlers' results: they are never cut
                # short by the grace of the others.
                await asyncio.wait_for(session.farewell.wait(), left)
            except asyncio.TimeoutError:
                log.warning("the controller did not finish this process's cleanup handlers within %gs", CLEANUP_TIMEOUT)
        # What still runs is cancelled, and its result sent: every invocation gets one.
        late = list(session.running.values())
        for running, task in late:
            running.cancelled = True
            task.cancel()
        if late:
            await asyncio.wait([task for _, task in late], timeout=CANCEL_ANSWER_TIMEOUT)
        await session.send(None)

    async def _reader(self, session):
        while True:
            message = await session.call.read()
            if message is grpc.aio.EOF:
                if not self.stop.is_set():
                    log.warning("the controller closed the stream")
                return
            which = message.WhichOneof("message")
            if which == "ping":
                in_flight = len(session.running)
                await session.send(rs.ConnectRequest(pong=rs.Pong(nonce=message.ping.nonce, in_flight=in_flight)))
            elif which == "welcome":
                session.capabilities = frozenset(message.welcome.capabilities)
                self._welcome(message.welcome)
                await session.send_settings()
            elif which == "farewell":
                log.info("the controller ran this process's cleanup (%s)", message.farewell.reason)
                session.farewell.set()
            elif which == "invocation":
                await self._start(session, message.invocation)
            elif which == "cancel":
                self._cancel(session, message.cancel)
            elif which == "object_update":
                entry = session.running.get(message.object_update.invocation_id)
                if entry is not None and message.object_update.body.json:
                    entry[0].body._replace(json.loads(message.object_update.body.json))
            elif which == "object_gone":
                # The object is gone: its memo goes with it (kopf drops memos of deleted objects).
                self.memos.forget(message.object_gone.object.uid)
            elif which == "drain":
                session.draining = True
                log.info("the controller is draining (%s)", message.drain.reason)
            elif which == "result_ack":
                ack = message.result_ack
                if not ack.accepted:
                    log.error("the controller did not accept the result of %s: %s", ack.invocation_id,
                              "; ".join(d.summary for d in ack.diagnostics))
            elif which == "notice":
                for d in message.notice.diagnostics:
                    log.warning("notice about %s: %s %s", message.notice.invocation_id or "the process", d.reason, d.summary)

    def _welcome(self, welcome):
        rejected = 0
        for status in welcome.registrations:
            if status.accepted:
                resource = status.resource
                what = f" resource={resource.plural}.{resource.version}.{resource.group}".replace("..", ".") if status.HasField("resource") else ""
                log.info("handler registered handler=%s%s", status.handler_id, what)
                for d in status.diagnostics:
                    log.warning("handler %s: %s: %s", status.handler_id, d.reason, d.summary)
            else:
                rejected += 1
                log.error("handler rejected handler=%s: %s", status.handler_id,
                          "; ".join(f"{d.reason}: {d.summary}" for d in status.diagnostics))
        log.info("connected to the controller %s (connection %s, %d rejected)",
                 welcome.runtime.name, welcome.connection_id, rejected)
        if self.ready is not None:
            flags.raise_flag(self.ready)
            self.ready = None

    async def _start(self, session, message):
        handler = self.by_id.get(message.handler_id)
        if handler is None:
            # A result like any other: it waits for room (the controller waits for it).
            await session.send(rs.ConnectRequest(result=inv.InvocationResult(
                invocation_id=message.invocation_id,
                permanent_error=inv.PermanentError(diagnostics=[wire.common.Diagnostic(
                    severity=wire.common.SEVERITY_ERROR, reason="UNKNOWN_HANDLER",
                    summary=f"no handler {message.handler_id!r} in this process")]))))
            return
        call = wire.call_of(message, handler)
        call.log_sink = session.log_sink(message.invocation_id)
        call.event_sink = session.event_sink(message.invocation_id)
        uid = (call.body.get("metadata") or {}).get("uid") if isinstance(call.body, dict) else None
        # Index calls get no memo (and removals must not make one for an object just gone).
        call.memo = self.memos.of(uid) if handler.kind != "index" else None
        call.settings = self.settings
        call.defers = rs.CAPABILITY_DEFERRED_SUBHANDLERS in session.capabilities
        call.indexes = session.indexes
        running = Running(call)
        task = asyncio.create_task(self._invoke(session, running, uid))
        session.running[message.invocation_id] = (running, task)
        if message.HasField("deadline"):
            # The attempt ends at its deadline, here too: as if the controller had cancelled it
            # for its deadline (the controller's own cancel may come later than the deadline).
            left = max(0.0, message.deadline.ToNanoseconds() / 1e9 - time.time())
            expired = inv.Cancel(invocation_id=message.invocation_id, reason=inv.CANCEL_REASON_DEADLINE_EXCEEDED)
            running.deadline = session.loop.call_later(left, self._cancel, session, expired)

    async def _invoke(self, session, running, uid):
        call = running.call
        started = time.monotonic()
        try:
            outcome = await run(running, self.executor)
        except asyncio.CancelledError:
            session.running.pop(call.invocation_id, None)
            return
        finally:
            if running.deadline is not None:
                running.deadline.cancel()
        session.running.pop(call.invocation_id, None)
        if session.closed:
            return
        if call.reason == "delete" and outcome.status == "success" and uid:
            self.memos.forget(uid)
        log.debug("handler=%s invocation=%s outcome=%s", call.handler.id, call.invocation_id, outcome.status)
        try:
            result = wire.result(call.invocation_id, call.handler.id, outcome, time.monotonic() - started)
        except Exception as error:  # an unencodable result is the handler's error, not the process's
            log.error("handler %r: its result could not be encoded: %s", call.handler.id, error)
            result = inv.InvocationResult(invocation_id=call.invocation_id, permanent_error=inv.PermanentError(
                diagnostics=[wire.common.Diagnostic(severity=wire.common.SEVERITY_ERROR,
                                                    summary=f"the result could not be encoded: {error}")]))
        try:
            if outcome.status != "success" and call.handler.kind == "daemon" and (outcome.object_patch or outcome.status_patch):
                # A failed daemon's patch is applied as kopf applies it: as a progress update
                # before its result (results carry the patches of successes only).
                await session.send(rs.ConnectRequest(update=inv.InvocationUpdate(
                    invocation_id=call.invocation_id, patches=wire.patches(outcome))))
            if call.handler.kind == "startup":
                # What the startup handler set in `settings` holds before watching starts
                # (the controller waits for this result, which comes after on the stream).
                await session.send_settings()
            await session.send(rs.ConnectRequest(result=result))
        except StreamStalled as error:  # the session ends with it (see `Session.stalled`)
            log.warning("result of %s not sent: %s", call.invocation_id, error)

    def _cancel(self, session, cancel):
        entry = session.running.get(cancel.invocation_id)
        if entry is None:
            return
        running, task = entry
        running.stop.set(_CANCEL_REASONS.get(cancel.reason, DaemonStoppingReason.NONE))
        grace = cancel.grace_period.ToTimedelta().total_seconds() if cancel.HasField("grace_period") else 0.0
        log.debug("cancel invocation=%s handler=%s grace=%.1fs", cancel.invocation_id, running.call.handler.id, grace)
        running.cancelled = True
        if running.call.handler.is_async:
            # The handler stops now, so that its result comes within the grace period: the
            # controller gives up on the invocation once the grace period is over.
            delay = 0.0
            if running.call.handler.kind == "daemon":
                # kopf's order: `stopped` first, the task cancelled once `cancellation_backoff`
                # passed (at once without one); `cancellation_timeout` is the time the cancelled
                # task then has (the controller's grace covers both).
                backoff = running.call.handler.options.get("cancellation_backoff")
                delay = min(grace, wire._secs(backoff)) if backoff is not None else 0.0
            session.loop.call_later(delay, _cancel_task, task)


def _only_taken(details):
    """Whether a NO_HANDLERS_ACCEPTED rejection names HANDLER_ID_TAKEN as every reason: the ids are
    held by a previous connection of a process that just died, so dialling again will succeed."""
    _, _, listed = details.partition("(")
    reasons = [item.split("[", 1)[1].split("]", 1)[0] for item in listed.rstrip(")").split("; ") if "[" in item and "]" in item]
    return bool(reasons) and all(reason == "HANDLER_ID_TAKEN" for each in reasons for reason in each.split(","))


def _cancel_task(task):
    if not task.done():
        task.cancel()
