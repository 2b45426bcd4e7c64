"""Running an operator: the embeddable `operator()` coroutine, and `run()` for a process,
which stops cleanly on SIGTERM and SIGINT (goodbye, running handlers told to stop) and within
the grace period: tasks the handlers left running get kopf's 5 s to finish, then are
cancelled; sync handlers still running after the grace period are left behind (`os._exit`),
since Python can neither stop their threads nor exit while they run."""

import asyncio
import copy
import importlib
import importlib.util
import json
import logging
import os
import signal
import threading
import sys
import time

from capstan import connection, flags, threads
from capstan.connection import Operator
from capstan.errors import ConnectionFatal
from capstan.registry import Registry, get_default_registry

log = logging.getLogger("capstan")


async def operator(*, registry: Registry = None, endpoint: str = None, memo=None, stop_flag=None,
                   max_in_flight: int = 0, settings=None, ready_flag=None):
    """Serves the registered handlers until `stop_flag` is set (kopf's `kopf.operator()`):
    dials `endpoint` (default `$CAPSTAN_ENDPOINT`, else the pod's socket) and reconnects with
    backoff whenever the stream breaks. `ready_flag` is raised once the controller accepted
    the handlers (its welcome); the controller runs the startup handlers then, before any
    resource handler. Both flags may be asyncio or threading Events or futures, as kopf's
    (`capstan.flags`)."""
    flags.check("ready_flag", ready_flag)
    stop, unfollow = flags.stop_event(stop_flag)
    try:
        op = Operator(registry or get_default_registry(), endpoint=endpoint, memo=memo, max_in_flight=max_in_flight,
                      stop=stop, settings=settings, ready=ready_flag)
        await _serve(op)
    finally:
        unfollow()


async def _serve(op: Operator):
    op.loop = asyncio.get_running_loop()
    _running.append(op)
    if _stop_requested.is_set():
        op.stop.set()
    try:
        await op.run()
    finally:
        _running.remove(op)


#: Set by `stop_all()`: operators started later stop at once too.
_stop_requested = threading.Event()


def stop_all():
    """Asks every running operator of this process to stop — and any started later — from
    any thread (as SIGTERM does)."""
    _stop_requested.set()
    for op in list(_running):
        op.loop.call_soon_threadsafe(op.stop.set)


#: The operators running in this process (`operator()` calls in progress).
_running = []


def set_max_in_flight(limit: int, handler: str = None):
    """Flow control: how many invocations the controller sends this process at once (or, with
    `handler`, that handler's id); 0 pauses dispatch until a later call raises the cap. It holds
    across reconnects. Callable from handlers, sync or async."""
    if len(_running) != 1:
        raise RuntimeError(f"set_max_in_flight needs exactly one running operator, found {len(_running)}")
    _running[0].set_max_in_flight(limit, handler)


def run(*, registry: Registry = None, endpoint: str = None, memo=None, max_in_flight: int = 0, settings=None,
        signals: bool = True, stop_flag=None, ready_flag=None):
    """Runs `operator()` in a new event loop until SIGTERM or SIGINT (kopf's `kopf.run()`);
    with `signals=False`, until `stop_all()`; in both, until `stop_flag` too (`operator()`'s
    flags)."""

    signalled = []
    flags.check("stop_flag", stop_flag)
    flags.check("ready_flag", ready_flag)

    async def main():
        # The signals set the event that follows `stop_flag` (a new one without it).
        stop, unfollow = flags.stop_event(stop_flag)
        loop = asyncio.get_running_loop()

        def on_signal():
            if not signalled:
                signalled.append(time.monotonic())
            stop.set()

        if signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, on_signal)
        before = asyncio.all_tasks()
        try:
            await operator(registry=registry, endpoint=endpoint, memo=memo, stop_flag=stop,
                           max_in_flight=max_in_flight, settings=settings, ready_flag=ready_flag)
        finally:
            unfollow()
            await _finish_spawned_tasks(before, signalled[0] if signalled else None)

    try:
        asyncio.run(main())
    except ConnectionFatal as error:
        log.error("%s", error)
        _leave_hung_handlers(signalled, 1)
        raise SystemExit(1) from None
    _leave_hung_handlers(signalled, 0)
    log.info("stopped")


#: How long the tasks that handlers spawned may take to finish once the operator stopped, as
#: kopf gives them (its "hung tasks"), before they are cancelled.
SPAWNED_TASKS_GRACE = 5.0
#: How long cancelled tasks may take to end.
CANCELLED_TASKS_GRACE = 1.0
#: The whole stop, from the signal, within a pod's default 30 s grace period: the cleanup
#: handlers and the stream's close, then the spawned tasks (their grace is shortened to fit),
#: leaving the controller, stopped after this container, time to stop too.
STOP_BUDGET = connection.CLEANUP_TIMEOUT + connection.CLOSE_TIMEOUT


async def _finish_spawned_tasks(before, since=None):
    """kopf's end of an operator: tasks that handlers started and left running (the event loop
    is this process's, so every task it has that was not there before the operator belongs to
    the operator) get `SPAWNED_TASKS_GRACE` to finish — a cleanup handler may just have asked
    them to — and are cancelled after it. `since`: when the stop was asked for (monotonic), so
    that the whole stop keeps to `STOP_BUDGET`."""
    current = asyncio.current_task()
    spawned = {task for task in asyncio.all_tasks() if task not in before and task is not current}
    if not spawned:
        return
    spent = time.monotonic() - since if since is not None else 0.0
    grace = min(SPAWNED_TASKS_GRACE, max(0.0, STOP_BUDGET - CANCELLED_TASKS_GRACE - spent))
    _, pending = await asyncio.wait(spawned, timeout=grace)
    if not pending:
        return
    log.info("cancelling %d task(s) the handlers left running %.1fs after the stop: %s", len(pending), grace,
             ", ".join(sorted(task.get_name() for task in pending)))
    for task in pending:
        task.cancel()
    _, pending = await asyncio.wait(pending, timeout=CANCELLED_TASKS_GRACE)
    if pending:
        log.warning("%d cancelled task(s) did not end within %gs: %s", len(pending), CANCELLED_TASKS_GRACE,
                    ", ".join(sorted(task.get_name() for task in pending)))


def _leave_hung_handlers(signalled, code):
    """Gives sync handlers still running what is left of the grace period (counted from the
    signal), then exits without them: the interpreter would otherwise wait for their threads.
    Whatever the executor (the SDK's, or one a startup handler set): the threads that run a
    handler's call are known (`threads.handler_call`)."""
    since = signalled[0] if signalled else time.monotonic()
    left = max(0.0, connection.STOP_GRACE - (time.monotonic() - since))
    hung = threads.wait_handler_calls(left)
    if not hung:
        return
    log.error("%d sync handler(s) still running %.1fs after the stop was asked for (grace period %gs); "
              "exiting without them", len(hung), time.monotonic() - since, connection.STOP_GRACE)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _JsonFormatter(logging.Formatter):
    def format(self, record):
        data = {"time": self.formatTime(record), "level": record.levelname.lower(), "logger": record.name,
                "message": record.getMessage()}
        for attr, key in (("capstan_object", "object"), ("capstan_invocation", "invocation")):
            if getattr(record, attr, None):
                data[key] = getattr(record, attr)
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data)


class _TextFormatter(logging.Formatter):
    """kopf's text formats, with the handler's object in brackets before the message (as kopf
    shows it: `[namespace/name] message`)."""

    def format(self, record):
        obj = getattr(record, "capstan_object", None)
        if obj:
            record = copy.copy(record)
            record.msg = f"[{obj}] {record.getMessage()}"
            record.args = None
        return super().format(record)


FORMATS = {
    "plain": "%(asctime)s [%(levelname)-8s] %(message)s",
    "full": "%(asctime)s [%(levelname)-8s] %(name)s: %(message)s",
}


def configure_logging(verbose=False, debug=False, quiet=False, log_format="full"):
    """kopf's logging options: --verbose/--debug (DEBUG), --quiet (WARNING), INFO otherwise;
    --log-format plain, full or json."""
    level = logging.DEBUG if (verbose or debug) else logging.WARNING if quiet else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter(FORMATS.get(log_format, FORMATS["full"])))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    if not debug:
        logging.getLogger("grpc").setLevel(logging.WARNING)


def load(paths, modules):
    """Imports the operator's files and modules (kopf run's arguments), registering their
    handlers in the default registry."""
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise SystemExit(f"capstan: cannot load {path!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        directory = os.path.dirname(os.path.abspath(path))
        if directory not in sys.path:
            sys.path.insert(0, directory)
        spec.loader.exec_module(module)
    for name in modules:
        importlib.import_module(name)
