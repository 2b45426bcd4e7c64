"""Testing handlers without a cluster or a controller (kopf.testing's counterpart): invoke a
registered handler with a body and get its outcome, result, patch, sub-handlers and logs.

    from capstan.testing import TestKit

    def test_create():
        kit = TestKit(registry)
        out = kit.invoke("create_fn", {"metadata": {"name": "x"}, "spec": {"field": "a"}})
        assert out.status == "success" and out.patch["status"]["seen"] == "a"

Handlers run through the same code as under the controller; only the wire is missing. Events
posted with `capstan.info/warn/exception/event` are in `Result.events`.
"""

import asyncio
import dataclasses
import datetime
import logging
import threading
from typing import Any, Dict, List, Optional, Tuple

from capstan.indexes import Indexes
from capstan.invoke import Call, Outcome, Running, SubState, run
from capstan.registry import Registry, get_default_registry
from capstan.settings import OperatorSettings
from capstan.structs import DaemonStoppingReason, Diff, DiffItem, DiffOperation, Memo, Reason


@dataclasses.dataclass
class Result:
    """What one invocation produced."""

    outcome: Outcome
    logs: List[Tuple[str, str]]
    events: List[dict] = dataclasses.field(default_factory=list)

    @property
    def status(self):
        return self.outcome.status

    @property
    def result(self):
        return self.outcome.result

    @property
    def patch(self):
        return self.outcome.patch

    @property
    def message(self):
        return self.outcome.message

    @property
    def delay(self):
        return self.outcome.delay

    @property
    def verdict(self):
        """An admission handler's answer: `allowed`, `message`, `code`, `warnings`."""
        return self.outcome.verdict

    @property
    def subhandlers(self) -> Dict[str, Outcome]:
        return {s.id: s.outcome for s in self.outcome.subhandlers}


def diff_of(old, new, path=()):
    """kopf's diff between two essences (dicts compared key by key, other values whole)."""
    if isinstance(old, dict) and isinstance(new, dict):
        items = []
        for key in list(old) + [k for k in new if k not in old]:
            if key not in new:
                items.append(DiffItem(DiffOperation.REMOVE, path + (key,), old[key], None))
            elif key not in old:
                items.append(DiffItem(DiffOperation.ADD, path + (key,), None, new[key]))
            else:
                items.extend(diff_of(old[key], new[key], path + (key,)))
        return Diff(items)
    if old == new:
        return Diff()
    if old is None:
        return Diff([DiffItem(DiffOperation.ADD, path, None, new)])
    if new is None:
        return Diff([DiffItem(DiffOperation.REMOVE, path, old, None)])
    return Diff([DiffItem(DiffOperation.CHANGE, path, old, new)])


class TestKit:
    """Invokes the handlers of a registry as the controller would."""

    __test__ = False  # not a pytest test class

    def __init__(self, registry: Optional[Registry] = None, memo: Optional[Memo] = None, settings=None):
        self.registry = registry or get_default_registry()
        self.registry.check()
        self.memo = memo if memo is not None else Memo()
        #: kopf's settings, as startup handlers get them (and change them).
        self.settings = settings if settings is not None else OperatorSettings()
        #: The indexes, filled by `index()` as the controller would before other handlers run.
        self.indexes = Indexes(self.registry.index_names())

    def handler(self, handler_id):
        for h in self.registry.handlers:
            if h.id == handler_id:
                return h
        # A nested function's id is its qualified name: its plain name finds it too.
        by_name = [h for h in self.registry.handlers if getattr(h.fn, "__name__", None) == handler_id]
        if len(by_name) == 1:
            return by_name[0]
        known = ", ".join(h.id for h in self.registry.handlers) or "none"
        raise KeyError(f"no handler {handler_id!r} is registered (registered: {known})")

    def _call(self, handler_id, body, *, reason=None, old=None, new=None, diff=None, attempt=1, event_type=None,
              subhandlers=None, started=None, logs=None, events=None, deleted=False, admission=None):
        handler = self.handler(handler_id)
        if reason is None and handler.kind in ("create", "update", "delete", "resume"):
            reason = handler.kind
        if handler.kind == "field" and reason is None:
            reason = "update"
        if diff is None:
            diff = diff_of(old, new)
        if reason is not None:
            reason = Reason(reason)
        states = {k: v if isinstance(v, SubState) else SubState(**v) for k, v in (subhandlers or {}).items()}
        level_names = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning", logging.ERROR: "error"}

        def sink(levelno, message):
            logs.append((level_names.get(levelno, "error" if levelno > logging.ERROR else "debug"), message))

        return Call(handler=handler, body=dict(body or {}), attempt=attempt, reason=reason, old=old, new=new,
                    diff=diff, event_type=event_type, memo=self.memo, subhandlers=states, log_sink=sink, settings=self.settings,
                    event_sink=events.append if events is not None else None,
                    started=started or datetime.datetime.now(datetime.timezone.utc), invocation_id="test",
                    indexes=self.indexes, index_deleted=deleted,
                    admission=dict(admission or {"operation": "CREATE"}) if handler.kind in ("validate", "mutate") else None)

    def invoke(self, handler_id, body=None, **call) -> Result:
        """Runs one handler once and returns what it did. `reason`, `old`, `new`, `diff`
        (computed from old/new when not given), `attempt`, `event_type`, `subhandlers`
        (id -> SubState or its fields) and, for admission handlers, `admission` (`operation`,
        `subresource`, `dryrun`, `old`, `userinfo`) shape the invocation."""
        return asyncio.run(self.ainvoke(handler_id, body, **call))

    async def ainvoke(self, handler_id, body=None, **call) -> Result:
        """`invoke()` for tests that already run an event loop."""
        logs, events = [], []
        running = Running(self._call(handler_id, body, logs=logs, events=events, **call))
        outcome = await run(running)
        return Result(outcome, logs, events)

    def index(self, handler_id, body, *, deleted=False) -> Result:
        """Feeds one object to an index handler (`deleted=True`: the object leaves the index,
        without a call), as the controller does for every object; every handler invoked
        afterwards reads the index by its name."""
        return self.invoke(handler_id, body, deleted=deleted)

    def daemon(self, handler_id, body=None) -> "DaemonRun":
        """Starts a daemon in a background loop; `stop()` asks it to stop and returns its
        result."""
        return DaemonRun(self, handler_id, body)


class DaemonRun:
    """A daemon running under the test kit."""

    def __init__(self, kit: TestKit, handler_id, body):
        self.logs: List[Tuple[str, str]] = []
        self.events: List[dict] = []
        self._running = Running(kit._call(handler_id, body, logs=self.logs, events=self.events))
        self._result: Optional[Outcome] = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self):
        self._result = self._loop.run_until_complete(run(self._running))
        self._loop.close()

    def update(self, body):
        """Shows the daemon a new body of its object (as the controller's ObjectUpdate)."""
        self._running.body._replace(body)

    def stop(self, reason=DaemonStoppingReason.RESOURCE_DELETED, timeout=10.0) -> Result:
        """Sets `stopped` and waits up to `timeout` seconds for the daemon to return."""
        self._running.stop.set(reason)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"daemon {self._running.call.handler.id!r} did not stop within {timeout}s")
        return Result(self._result, self.logs, self.events)


class OperatorRunner:
    """Runs the operator in a background thread for a test, against a real controller (kopf's
    `KopfRunner`): the handlers of `paths` and `modules` (or of `registry`) are served until
    the `with` block ends, then stopped as on SIGTERM.

        with OperatorRunner(["handlers.py"], endpoint=endpoint) as runner:
            ...  # create objects, wait for the handlers' effects
        assert runner.exception is None
    """

    def __init__(self, paths=(), *, modules=(), registry: Optional[Registry] = None, endpoint: Optional[str] = None,
                 timeout: float = 30.0, settings=None):
        self.paths = list(paths)
        self.settings = settings
        self.modules = list(modules)
        self.registry = registry
        self.endpoint = endpoint
        self.timeout = timeout
        self.exception: Optional[BaseException] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="capstan-operator-runner", daemon=True)

    def _main(self):
        from capstan.runner import _finish_spawned_tasks, load, operator

        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._ready.set()
            before = asyncio.all_tasks()
            try:
                await operator(registry=self.registry, endpoint=self.endpoint, stop_flag=self._stop,
                               settings=self.settings)
            finally:
                # The loop is this runner's: the tasks its handlers left get kopf's grace.
                await _finish_spawned_tasks(before)

        try:
            if self.paths or self.modules:
                load(self.paths, self.modules)
            asyncio.run(main())
        except BaseException as error:  # reported to the test through `exception`
            self.exception = error
        finally:
            self._ready.set()

    def __enter__(self):
        self._thread.start()
        if not self._ready.wait(self.timeout):
            raise TimeoutError(f"the operator did not start within {self.timeout}s")
        if self.exception is not None:
            raise self.exception
        return self

    def __exit__(self, *exc):
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop has already ended
                pass
        self._thread.join(self.timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the operator did not stop within {self.timeout}s")
        return False
