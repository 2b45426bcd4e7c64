"""Runs one handler call, independent of the wire: builds kopf's kwargs from a `Call`, runs
the handler (sync ones in a thread pool, async ones on the loop), runs the sub-handlers it
declared, and classifies what happened into an `Outcome`.

The connection and the test kit both go through `run()`, so that a handler behaves the same
in tests as under the controller.
"""

import asyncio
import contextvars
import dataclasses
import datetime
import functools
import inspect
import json
import logging
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from capstan import lifecycles
from capstan import settings as settings_module
from capstan import threads
from capstan.errors import AdmissionError, PermanentError, RegistrationError, TemporaryError
from capstan.indexes import KEEP, REMOVE, change_of
from capstan.registry import Handler, build_handler
from capstan.structs import (
    Body, DaemonStopped, Diff, Memo, Patch, SyncDaemonStopped, _Stop,
)

#: The call being run in this context, for `capstan.subhandler` and `capstan.register`.
_current: contextvars.ContextVar = contextvars.ContextVar("capstan_call", default=None)


@dataclasses.dataclass
class SubState:
    """The persisted state of one sub-handler (from earlier attempts)."""

    retries: int = 0
    success: bool = False
    failure: bool = False
    delayed_until: Optional[datetime.datetime] = None
    message: str = ""
    started: Optional[datetime.datetime] = None


@dataclasses.dataclass
class Call:
    """Everything a handler call needs, decoded from an invocation (or built by a test)."""

    handler: Handler
    body: Dict[str, Any] = dataclasses.field(default_factory=dict)
    resource: Any = None
    attempt: int = 1
    started: Optional[datetime.datetime] = None
    reason: Optional[str] = None
    old: Any = None
    new: Any = None
    diff: Diff = Diff()
    event_type: Optional[str] = None
    param: Any = None
    memo: Optional[Memo] = None
    subhandlers: Dict[str, SubState] = dataclasses.field(default_factory=dict)
    log_sink: Optional[Callable[[int, str], None]] = None
    event_sink: Optional[Callable[[dict], None]] = None
    invocation_id: str = ""
    # The indexes of this call's stream (every handler reads them by name), and for an index handler's
    # call whether its object is leaving the index.
    indexes: Any = None
    index_deleted: bool = False
    # For a validate or mutate handler's call: the admission request's parts.
    admission: Optional[Dict[str, Any]] = None
    # The operator's settings (kopf's `settings` kwarg of activity handlers); None: the
    # process's (`capstan.settings.active()`).
    settings: Any = None
    # The controller takes sub-handlers left for a later call (CAPABILITY_DEFERRED_SUBHANDLERS):
    # kopf's lifecycle then picks which of a parent's sub-handlers run in this call.
    defers: bool = False


@dataclasses.dataclass
class Outcome:
    """What happened to one call or sub-handler call."""

    status: str  # success, temporary, permanent, unclassified, cancelled, skipped, deferred
    result: Any = None
    # An admission handler's answer: allowed, message, code, warnings.
    verdict: Optional[Dict[str, Any]] = None
    delay: Optional[float] = None
    message: str = ""
    error_type: str = ""
    stack: str = ""
    object_patch: Optional[dict] = None
    status_patch: Optional[dict] = None
    subhandlers: List["SubOutcome"] = dataclasses.field(default_factory=list)

    @property
    def patch(self):
        """Both parts of the patch as one merge patch, for tests."""
        merged = dict(self.object_patch or {})
        if self.status_patch:
            merged.update(self.status_patch)
        return merged


@dataclasses.dataclass
class SubOutcome:
    """A sub-handler's outcome, its id relative to the top-level handler."""

    id: str
    outcome: Outcome


class Running:
    """A running call's controls: its stop flag (daemons' `stopped`) and live body."""

    def __init__(self, call: Call):
        self.call = call
        self.stop = _Stop()
        self.body = Body(call.body)
        self.cancelled = False
        self.declared: List[Handler] = []
        # The lifecycle `kopf.execute(lifecycle=...)` asked for its sub-handlers; None: the
        # default (`lifecycles.get_default_lifecycle()`, kopf's `asap`).
        self.lifecycle = None
        # An admission handler's `warnings` (kopf's kwarg), returned to the client.
        self.warnings: List[str] = []
        # The timer that ends the attempt at its deadline (`connection`), cancelled when it ends.
        self.deadline = None


class _Router(logging.Handler):
    """Forwards the records of handlers' loggers to the sink of the invocation that logged
    them (the controller's LogRecord, or the test kit's list)."""

    def __init__(self):
        super().__init__(logging.DEBUG)

    def emit(self, record):
        sink = getattr(record, "capstan_sink", None)
        if sink is None:
            return
        try:
            sink(record.levelno, record.getMessage())
        except Exception:  # a log sink must never break the handler
            self.handleError(record)


_ROUTER = _Router()


def _logger(call: Call, handler_id: str):
    logger = logging.getLogger(f"capstan.handlers.{handler_id}")
    if _ROUTER not in logger.handlers:
        logger.addHandler(_ROUTER)
    if logger.level == logging.NOTSET or logger.level > logging.DEBUG:
        logger.setLevel(logging.DEBUG)
    meta = call.body.get("metadata") if isinstance(call.body, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    name = meta.get("name") or ""
    obj = f"{meta['namespace']}/{name}" if meta.get("namespace") else name
    return ObjectLogger(logger, call.log_sink, obj, call.invocation_id)


class ObjectLogger(logging.LoggerAdapter):
    """The handler's `logger` (kopf's `kopf.ObjectLogger`): logs locally, with the object and
    the invocation as record attributes (`capstan_object`, `capstan_invocation`, shown by the
    runner's formats), and forwards the message to the controller (posted as an Event only as
    `settings.posting` says)."""

    def __init__(self, logger, sink, obj, invocation_id):
        super().__init__(logger, {"capstan_sink": sink, "capstan_object": obj, "capstan_invocation": invocation_id})

    def process(self, msg, kwargs):
        kwargs["extra"] = {**self.extra, **(kwargs.get("extra") or {})}
        return msg, kwargs

    def isEnabledFor(self, level):
        return True

    def close(self):
        self.extra = {**self.extra, "capstan_sink": None}


class LocalObjectLogger(ObjectLogger):
    """An object's logger that only logs locally (kopf's `kopf.LocalObjectLogger`)."""

    def __init__(self, logger, sink=None, obj="", invocation_id=""):
        super().__init__(logger, None, obj, invocation_id)


def kwargs_for(call: Call, handler: Handler, running: Running, logger, patch, retry, started):
    """kopf's handler kwargs for this call."""
    body = running.body
    meta = body.metadata
    now = datetime.datetime.now(datetime.timezone.utc)
    started = started or now
    values = {
        "logger": logger,
        "memo": call.memo if call.memo is not None else Memo(),
        "param": handler.param if handler.param is not None else call.param,
        "retry": retry,
        "started": started,
        "runtime": now - started,
    }
    if handler.kind in ("startup", "cleanup", "login", "probe"):
        values["settings"] = call.settings if call.settings is not None else settings_module.active()
    else:
        values.update(
            body=body, spec=body.spec, meta=meta, status=body.status, name=meta.name,
            namespace=meta.namespace, uid=meta.uid, labels=meta.labels,
            annotations=meta.annotations, patch=patch, resource=call.resource,
        )
    if handler.kind in ("create", "update", "delete", "resume", "field"):
        values.update(reason=call.reason, diff=call.diff, old=call.old, new=call.new)
        if handler.kind == "field":
            values["value"] = call.new
    if handler.kind == "event":
        values.update(event={"type": call.event_type, "object": body._data}, type=call.event_type)
    if handler.kind == "daemon":
        values["stopped"] = DaemonStopped(running.stop) if handler.is_async else SyncDaemonStopped(running.stop)
    if handler.kind in ("validate", "mutate"):
        request = call.admission or {}
        values.update(warnings=running.warnings, userinfo=request.get("userinfo") or {},
                      dryrun=bool(request.get("dryrun")), subresource=request.get("subresource"),
                      operation=request.get("operation"), old=request.get("old"), new=body._data,
                      headers=request.get("headers") or {}, sslpeer={})
    if call.indexes is not None:
        values.update(call.indexes.views())
    if handler.takes is not None:
        values = {k: v for k, v in values.items() if k in handler.takes}
    return values


def subhandler(*args, **options):
    """kopf's `@kopf.subhandler(id=...)`: declares a sub-handler from inside a running
    handler; it runs after its parent and is retried on its own."""
    if args and callable(args[0]) and len(args) == 1 and not options:
        return _declare(args[0], {})

    def decorate(fn):
        return _declare(fn, options)

    return decorate


def register(fn, **options):
    """kopf's `kopf.register(fn, id=...)`: declares a sub-handler, as `subhandler`."""
    return _declare(fn, options)


_SUB_OPTIONS = {"id", "errors", "timeout", "retries", "backoff", "param", "labels", "annotations", "when", "field", "value"}


def _declare(fn, options):
    running = _current.get()
    name = options.get("id") or getattr(fn, "__qualname__", repr(fn))
    if running is None:
        raise RegistrationError(f"sub-handler {name!r}: capstan.subhandler and capstan.register work only inside a running handler")
    unknown = sorted(set(options) - _SUB_OPTIONS)
    if unknown:
        raise RegistrationError(f"sub-handler {name!r}: unknown option(s) {', '.join(unknown)}")
    parent = running.call.handler
    kind = parent.kind if parent.kind in ("create", "update", "delete", "resume", "field") else "create"
    handler = build_handler(kind if kind != "field" else "update", fn, **options)
    indexes = set(running.call.indexes.views()) if running.call.indexes is not None else set()
    unknown = sorted(handler.wants - indexes)
    if unknown:
        raise RegistrationError(f"sub-handler {handler.id!r}: unknown kwarg(s) {', '.join(map(repr, unknown))}")
    if any(h.id == handler.id for h in running.declared):
        raise RegistrationError(f"sub-handler {handler.id!r} is declared twice in {parent.id!r}")
    running.declared.append(handler)
    return fn


def _classify(error, handler_id) -> Outcome:
    stack = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    kind = type(error).__name__
    if isinstance(error, TemporaryError):
        return Outcome("temporary", delay=error.delay, message=str(error) or kind, error_type=kind, stack=stack)
    if isinstance(error, PermanentError):
        return Outcome("permanent", message=str(error) or kind, error_type=kind, stack=stack)
    return Outcome("unclassified", message=f"{kind}: {error}" if str(error) else kind, error_type=kind, stack=stack)


def _encode(value, what, handler_id):
    if value is None:
        return None
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as error:
        raise PermanentError(f"handler {handler_id!r} returned a {what} that is not JSON-serialisable: {error}") from None


async def _execute(handler: Handler, kwargs, executor):
    if handler.is_async:
        return await handler.fn(**kwargs)
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    func = functools.partial(ctx.run, handler.fn, **kwargs)
    if handler.kind == "daemon":
        return await _in_own_thread(loop, func, handler.id)
    return await loop.run_in_executor(executor, functools.partial(threads.handler_call, func))


def _in_own_thread(loop, func, name):
    """Runs a sync daemon in a thread of its own, so that daemons never starve the pool."""
    future = loop.create_future()

    def target():
        try:
            value = func()
        except BaseException as error:  # delivered to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, future, None, error)
        else:
            loop.call_soon_threadsafe(_settle, future, value, None)

    threading.Thread(target=target, name=f"capstan-daemon-{name}", daemon=True).start()
    return future


def _settle(future, value, error):
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _sdk_filters_pass(handler: Handler, kwargs_all) -> bool:
    for _, check in handler.sdk_filters:
        if callable(check):
            if not check(**_for(check, kwargs_all)):
                return False
            continue
        what, key, cond = check
        if what in ("labels", "annotations"):
            source = kwargs_all["labels"] if what == "labels" else kwargs_all["annotations"]
            if key not in source or not cond(source[key], **_for(cond, kwargs_all)):
                return False
        else:
            value = {"value": kwargs_all.get("new"), "old": kwargs_all.get("old"), "new": kwargs_all.get("new")}[what]
            if what == "value" and handler.field:
                value = _at(kwargs_all["body"]._data, handler.field)
            if not cond(value, **_for(cond, kwargs_all)):
                return False
    return True


def _at(data, path):
    for key in path.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _for(fn, kwargs_all):
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return kwargs_all
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs_all
    names = {p.name for p in params}
    return {k: v for k, v in kwargs_all.items() if k in names}


async def run(running: Running, executor=None) -> Outcome:
    """Runs the call's handler and its sub-handlers, and classifies the outcome."""
    call = running.call
    handler = call.handler
    retry = max(call.attempt - 1, 0)
    logger = _logger(call, handler.id)
    patch = Patch()
    token = _current.set(running)
    try:
        if handler.kind == "index":
            return await _run_index(running, handler, logger, retry, executor)
        if handler.kind in ("validate", "mutate"):
            return await _run_admission(running, handler, logger, retry, executor)
        if handler.sdk_filters:
            kwargs_all = kwargs_for(call, dataclasses.replace(handler, takes=None), running, logger, patch, retry,
                                    call.started)
            if not _sdk_filters_pass(handler, kwargs_all):
                return Outcome("skipped")
        kwargs = kwargs_for(call, handler, running, logger, patch, retry, call.started)
        # kopf's messages about the handling, in this process's log only (not sent over the wire).
        if handler.kind in _TITLES and call.reason is not None:
            logger.debug("%s is in progress: %r", _TITLES.get(str(call.reason), "Handling"), running.body,
                         extra=_LOCAL)
        value = await _execute(handler, kwargs, executor)
        if handler.kind in _TITLES:
            logger.info("Handler %r succeeded.", handler.id, extra=_LOCAL)
        if handler.kind == "login":
            outcome = Outcome("success", result=value)
        else:
            outcome = Outcome("success", result=_encode(value, "result", handler.id))
        if handler.kind == "startup":
            # What a startup handler set in `settings`: applied here, sent to the controller
            # (before this result, `connection`), or named once (the controller's flags, or no
            # meaning with Capstan).
            settings_module.review(call.settings if call.settings is not None else settings_module.active())
        obj, status = patch.as_documents()
        outcome.object_patch = _encode(obj, "patch", handler.id)
        outcome.status_patch = _encode(status, "patch", handler.id)
        if running.declared:
            await _run_subhandlers(running, outcome, logger, executor, prefix="")
        return outcome
    except asyncio.CancelledError:
        if running.cancelled:
            return Outcome("cancelled")
        raise
    except Exception as error:  # every handler failure becomes an outcome
        if running.cancelled:
            return Outcome("cancelled")
        outcome = _classify(error, handler.id)
        if handler.kind == "daemon":
            # kopf applies a daemon's patch after every attempt, failed ones included (the
            # connection sends it as a progress update: results carry patches of successes).
            obj, status = patch.as_documents()
            outcome.object_patch = _encode(obj, "patch", handler.id)
            outcome.status_patch = _encode(status, "patch", handler.id)
        logger.error("%s", _failure(handler, outcome))
        return outcome
    finally:
        _current.reset(token)
        logger.close()


#: A record's `extra` that keeps it out of the controller's log.
_LOCAL = {"capstan_sink": None}

#: kopf's titles of the causes of change handlers, for its "… is in progress" messages.
_TITLES = {"create": "Creation", "update": "Updating", "delete": "Deletion", "resume": "Resuming",
           "field": "Updating"}


def _failure(handler: Handler, outcome: Outcome) -> str:
    """kopf's message of a handler's failure."""
    what, message = f"Handler {handler.id!r}", outcome.message
    if outcome.status == "temporary":
        return f"{what} failed temporarily: {message}"
    if outcome.status == "permanent":
        return f"{what} failed permanently: {message}"
    # kopf's default: event and index handlers' errors are ignored, the others' retried.
    default = "ignored" if handler.kind in ("event", "index") else "temporary"
    mode = handler.errors.value if handler.errors is not None else default
    if mode == "ignored":
        return f"{what} failed with an exception and will ignore it: {message}"
    if mode == "permanent":
        return f"{what} failed with an exception and will stop now: {message}"
    backoff = handler.backoff if handler.backoff is not None else 60
    return f"{what} failed with an exception and will try again in {backoff:g} seconds: {message}"


async def _run_admission(running: Running, handler: Handler, logger, retry, executor) -> Outcome:
    """A validate or mutate handler's call: its answer is a verdict — allowed (with the
    warnings it appended, and for a mutating handler its patch), or denied by `AdmissionError`.
    Any other failure is the handler's: the controller then admits or denies as the handler's
    `ignore_failures` says."""
    call = running.call
    patch = Patch()
    if handler.sdk_filters:
        kwargs_all = kwargs_for(call, dataclasses.replace(handler, takes=None), running, logger, patch, retry, call.started)
        if not _sdk_filters_pass(handler, kwargs_all):
            return Outcome("skipped")
    try:
        await _execute(handler, kwargs_for(call, handler, running, logger, patch, retry, call.started), executor)
    except AdmissionError as denial:
        logger.info("Admission handler %r denied the request: %s", handler.id, denial)
        return Outcome("success", verdict={"allowed": False, "message": str(denial), "code": denial.code or 500,
                                           "warnings": list(running.warnings)})
    outcome = Outcome("success", verdict={"allowed": True, "warnings": list(running.warnings)})
    if handler.kind == "mutate":
        obj, status = patch.as_documents()
        outcome.object_patch = _encode(obj, "patch", handler.id)
        outcome.status_patch = _encode(status, "patch", handler.id)
    return outcome


async def _run_index(running: Running, handler: Handler, logger, retry, executor) -> Outcome:
    """An index handler's call: folds its result into its stream's index (kopf's rules, see
    `capstan.indexes`); an object leaving the index loses its entries without a call."""
    call = running.call
    meta = call.body.get("metadata") or {}
    obj = (meta.get("namespace") or "", meta.get("name") or "", meta.get("uid") or "")
    indexes = call.indexes
    if call.index_deleted:
        if indexes is not None:
            indexes.apply(handler.id, obj, REMOVE)
        return Outcome("success")
    if handler.sdk_filters:
        kwargs_all = kwargs_for(call, dataclasses.replace(handler, takes=None), running, logger, None, retry, call.started)
        if not _sdk_filters_pass(handler, kwargs_all):
            # No longer matching: the object leaves the index, as kopf does.
            if indexes is not None:
                indexes.apply(handler.id, obj, REMOVE)
            return Outcome("skipped")
    try:
        value = await _execute(handler, kwargs_for(call, handler, running, logger, None, retry, call.started), executor)
    except asyncio.CancelledError:
        raise
    except Exception as error:  # the handler's failure: its object leaves the index (or keeps it)
        outcome = _classify(error, handler.id)
    else:
        try:
            change = change_of(handler.id, value)
        except TypeError as error:  # a result the index cannot hold: the handler's mistake
            outcome = Outcome("permanent", message=str(error), error_type="TypeError")
        else:
            if indexes is not None:
                indexes.apply(handler.id, obj, change)
            # The value goes back too, as the protocol says (the index itself is kept here).
            # kopf's index values may be any Python object: one that is no JSON stays here only.
            try:
                result = _encode(value, "result", handler.id)
            except PermanentError:
                result = None
            return Outcome("success", result=result)
    mode = handler.errors.value if handler.errors is not None else "ignored"
    if outcome.status == "unclassified" and mode == "ignored":
        change = KEEP  # kopf keeps the stale values of an ignored error
    else:
        change = REMOVE
    if indexes is not None:
        indexes.apply(handler.id, obj, change)
    logger.log(logging.ERROR if outcome.status != "temporary" else logging.WARNING,
               "Index handler %r failed: %s", handler.id, outcome.message)
    return outcome


def _chosen(parent: Running, runnable: List[Handler], prefix: str) -> List[Handler]:
    """The sub-handlers that run in this call, as the lifecycle picks them among the runnable
    ones (kopf's `asap`: the one with the fewest retries); the others are deferred to the next
    call of the parent. Every runnable one when the controller cannot defer, and the first
    when a lifecycle picks none or fails (kopf would call the parent again for ever)."""
    if not parent.call.defers or len(runnable) < 2:
        return runnable
    lifecycle = parent.lifecycle or lifecycles.get_default_lifecycle()
    state = {sub.id: parent.call.subhandlers.get(prefix + sub.id, SubState()) for sub in runnable}
    try:
        picked = list(lifecycle(list(runnable), state=state))
    except Exception as error:  # a user's lifecycle must not lose the sub-handlers
        logging.getLogger("capstan").warning("lifecycle %r failed (%s); the sub-handlers run one by one", lifecycle, error)
        picked = []
    picked = [sub for sub in picked if any(sub is r for r in runnable)]
    return picked or runnable[:1]


async def _run_subhandlers(parent: Running, outcome: Outcome, logger, executor, prefix):
    """Runs the unfinished sub-handlers that `parent` declared, those the lifecycle picks;
    appends their outcomes (and `deferred` for the others) and patches to `outcome`."""
    call = parent.call
    now = datetime.datetime.now(datetime.timezone.utc)

    def pending(sub):
        state = call.subhandlers.get(prefix + sub.id, SubState())
        waiting = state.delayed_until is not None and state.delayed_until > now
        return not (state.success or state.failure or waiting)

    def passes(sub):
        # A sub-handler its filters reject is no candidate for the lifecycle (as in kopf): it
        # would be picked, skipped, and leave the others deferred for ever.
        state = call.subhandlers.get(prefix + sub.id, SubState())
        probe_call = dataclasses.replace(call, handler=sub, attempt=state.retries + 1, started=state.started or now)
        probe = Running(probe_call)
        probe.body = parent.body
        try:
            kwargs_all = kwargs_for(probe_call, dataclasses.replace(sub, takes=None), probe, logger, Patch(),
                                    state.retries, probe_call.started)
            verdict = _sdk_filters_pass(sub, kwargs_all)
        except Exception:  # the call below asks again and reports the failure as the sub-handler's
            return True
        probed.add(id(sub))
        return verdict

    ready = [sub for sub in parent.declared if pending(sub)]
    # The filters are asked here only when the lifecycle chooses among several (and then once).
    probed = set()
    if call.defers and len(ready) > 1:
        ready = [sub for sub in ready if not sub.sdk_filters or passes(sub)]
    chosen = _chosen(parent, ready, prefix)
    for sub in ready:
        if not any(sub is c for c in chosen):
            outcome.subhandlers.append(SubOutcome(prefix + sub.id, Outcome("deferred")))
    for sub in chosen:
        sub_id = prefix + sub.id
        state = call.subhandlers.get(sub_id, SubState())
        if sub.timeout is not None and state.started is not None and (now - state.started).total_seconds() > sub.timeout:
            outcome.subhandlers.append(SubOutcome(sub_id, Outcome("permanent", message=f"timed out after {sub.timeout}s", error_type="HandlerTimeoutError")))
            continue
        child_call = dataclasses.replace(call, handler=sub, attempt=state.retries + 1, started=state.started or now)
        child = Running(child_call)
        child.body = parent.body
        child.stop = parent.stop
        token = _current.set(child)
        patch = Patch()
        try:
            if sub.sdk_filters and id(sub) not in probed:
                kwargs_all = kwargs_for(child_call, dataclasses.replace(sub, takes=None), child, logger, patch,
                                        state.retries, child_call.started)
                if not _sdk_filters_pass(sub, kwargs_all):
                    continue
            value = await _execute(sub, kwargs_for(child_call, sub, child, logger, patch, state.retries, child_call.started), executor)
            result = Outcome("success", result=_encode(value, "result", sub.id))
            obj, status = patch.as_documents()
            _merge_into(outcome, _encode(obj, "patch", sub.id), _encode(status, "patch", sub.id))
            if child.declared:
                nested = Outcome("success")
                await _run_subhandlers(child, nested, logger, executor, prefix=sub_id + "/")
                outcome.subhandlers.extend(nested.subhandlers)
                _merge_into(outcome, nested.object_patch, nested.status_patch)
                if any(s.outcome.status not in ("success", "permanent") for s in nested.subhandlers):
                    continue
            outcome.subhandlers.append(SubOutcome(sub_id, result))
        except asyncio.CancelledError:
            raise  # the parent is cancelled with it: `run` answers cancelled
        except Exception as error:  # a sub-handler's failure is its own outcome
            if parent.cancelled:
                # Cancelled, not finished: `run` answers cancelled for the parent, so that the
                # sub-handlers left run on its next call.
                raise asyncio.CancelledError() from error
            failed = _classify(error, sub.id)
            if failed.status == "unclassified" and sub.errors is not None:
                mode = sub.errors.value
                if mode == "ignored":
                    failed = Outcome("success")
                elif mode == "permanent":
                    failed.status = "permanent"
                else:
                    failed.status = "temporary"
                    failed.delay = sub.backoff if sub.backoff is not None else 60.0
            if failed.status in ("temporary", "unclassified") and sub.retries is not None and state.retries + 1 >= sub.retries:
                failed = Outcome("permanent", message=f"{failed.message} (after {state.retries + 1} attempts)", error_type=failed.error_type)
            logger.error("Sub-handler %r failed: %s", sub_id, failed.message)
            outcome.subhandlers.append(SubOutcome(sub_id, failed))
        finally:
            _current.reset(token)


def _merge_into(outcome, obj, status):
    for attr, part in (("object_patch", obj), ("status_patch", status)):
        if not part:
            continue
        current = getattr(outcome, attr) or {}
        setattr(outcome, attr, _merge(current, part))


def _merge(base, patch):
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def monotonic():
    return time.monotonic()


async def execute(*, fns=None, handlers=None, registry=None, lifecycle=None, cause=None):
    """kopf's `await kopf.execute(fns=...)`: declares the functions (a mapping of ids to
    functions, or functions named by their qualified names) as sub-handlers of the running
    handler. They run once the handler returns, each retried on its own, as sub-handlers
    declared with `subhandler` do (kopf runs them inside `execute`)."""
    if handlers is not None or registry is not None or cause is not None:
        raise RegistrationError("kopf.execute takes fns= only with Capstan (handlers=, registry= and cause= are kopf's internals)")
    if fns is None:
        return
    running = _current.get()
    if lifecycle is not None and running is not None:
        running.lifecycle = lifecycle
    items = fns.items() if isinstance(fns, dict) else [(None, fn) for fn in fns]
    for handler_id, fn in items:
        _declare(fn, {"id": handler_id} if handler_id else {})
