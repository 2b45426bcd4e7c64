"""The threads that run sync handlers.

Python cannot stop a thread: a sync handler that ignores its stop request keeps its thread, and
the interpreter waits for every pool thread at exit, so one hung handler would hold a stopping
process forever, far beyond its grace period. The threads running a sync handler's call are
known (`handler_call`), whatever the executor (the SDK's pool, which also counts its calls, or
a plain `ThreadPoolExecutor` a startup handler set), so that a process that stops can wait for
them up to its grace period and then exit without them — and tell them from idle pool threads,
which end at exit by themselves.
"""

import concurrent.futures
import threading


class HandlerThreads(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that knows how many of its calls are running."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._running = 0
        self._changed = threading.Condition()

    def submit(self, fn, /, *args, **kwargs):
        def counted():
            with self._changed:
                self._running += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._changed:
                    self._running -= 1
                    self._changed.notify_all()

        return super().submit(counted)

    def running(self):
        """How many calls are running now."""
        with self._changed:
            return self._running

    def wait_idle(self, timeout):
        """Waits up to `timeout` seconds until no call runs; says whether none does."""
        with self._changed:
            return self._changed.wait_for(lambda: self._running == 0, timeout)


#: The threads running a sync handler's call now, with how many calls each runs.
_calls = {}
_calls_changed = threading.Condition()


def handler_call(fn, /, *args, **kwargs):
    """Runs a sync handler's call (in whatever executor's thread), known meanwhile as a call
    the interpreter would wait for at exit (see `wait_handler_calls`)."""
    thread = threading.current_thread()
    with _calls_changed:
        _calls[thread] = _calls.get(thread, 0) + 1
    try:
        return fn(*args, **kwargs)
    finally:
        with _calls_changed:
            if _calls[thread] == 1:
                del _calls[thread]
            else:
                _calls[thread] -= 1
            _calls_changed.notify_all()


def _holding_exit():
    """The non-daemon threads that run a sync handler's call: the interpreter waits for them."""
    alive = {t for t in threading.enumerate() if not t.daemon and t is not threading.current_thread()}
    return [t for t in _calls if t in alive]


def wait_handler_calls(timeout):
    """Waits up to `timeout` seconds until no non-daemon thread runs a sync handler's call;
    the threads still running one."""
    with _calls_changed:
        _calls_changed.wait_for(lambda: not _holding_exit(), timeout)
        return _holding_exit()
