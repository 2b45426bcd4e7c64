"""The threads that run sync handlers.

Python cannot stop a thread: a sync handler that ignores its stop request keeps its thread, and
the interpreter waits for every pool thread at exit, so one hung handler would hold a stopping
process forever, far beyond its grace period. The pool counts the calls running in it, so that
a process that stops can wait for them up to its grace period and then exit without them.
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
