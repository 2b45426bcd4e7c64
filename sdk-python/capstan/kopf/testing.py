"""kopf's test kit under kopf's names: `kopf.testing.KopfRunner`, which runs an operator in a
background thread for a test, given kopf's command line:

    with KopfRunner(['run', '-A', '--verbose', 'example.py']) as runner:
        ...  # create objects, wait for the handlers' effects
    assert runner.exit_code == 0 and runner.exception is None
    assert 'created' in runner.output

kopf's operator is one process; Capstan's is two. Unless `endpoint=` (or `$CAPSTAN_ENDPOINT`)
names a running controller, the runner starts one (`$CAPSTAN_BINARY`, else `capstan` on PATH)
against the current kubeconfig, with kopf's options as its flags (`capstan.kopf.cli`), and
stops it after the operator. `output` is what the operator logged and printed (the
controller's is in `controller_output`).
"""

import io
import logging
import os
import sys
import threading
from typing import Optional

from capstan import runner as runner_module
from capstan import settings as settings_module
from capstan.controller import LocalController
from capstan.kopf import cli
from capstan.registry import set_default_registry
from capstan.testing import OperatorRunner

__all__ = ["KopfRunner"]


class _Capture(io.TextIOBase):
    """A text stream that keeps everything written to it, from any thread."""

    def __init__(self):
        self._parts = []
        self._lock = threading.Lock()

    def writable(self):
        return True

    def write(self, text):
        with self._lock:
            self._parts.append(text)
        return len(text)

    def getvalue(self):
        with self._lock:
            return "".join(self._parts)


class KopfRunner:
    """kopf's `KopfRunner`: the same arguments (`args` is kopf's argv; `reraise`, `timeout`,
    `registry`, `settings`), the same context manager and results (`output`, `stdout`,
    `stderr`, `exit_code`, `exception`)."""

    def __init__(self, args, *, reraise: bool = True, timeout: Optional[float] = None, registry=None, settings=None,
                 endpoint: Optional[str] = None, controller_flags=(), env=None, **invoke_options):
        # kopf passes the rest to click's CliRunner.invoke(): `env` is applied to the process's
        # environment while the operator runs; `input`, `color`, `catch_exceptions` mean
        # nothing without click.
        unknown = sorted(set(invoke_options) - {"input", "color", "catch_exceptions"})
        if unknown:
            raise TypeError(f"KopfRunner got unexpected keyword argument(s) {', '.join(unknown)}")
        self.env = dict(env or {})
        self._saved_env = {}
        self.args = list(args)
        self.reraise = reraise
        self.timeout = timeout
        self.registry = registry
        self.settings = settings
        self.endpoint = endpoint if endpoint is not None else os.environ.get("CAPSTAN_ENDPOINT")
        self.extra_flags = list(controller_flags)
        self.controller: Optional[LocalController] = None
        self._capture = _Capture()
        self._operator: Optional[OperatorRunner] = None
        self._exception: Optional[BaseException] = None
        self._done = False
        self._saved = None

    def __enter__(self):
        try:
            options = cli.parse(self.args)
        except cli.UsageError as error:
            self._exception = SystemExit(2)
            self._capture.write(f"Usage: kopf run [OPTIONS] [PATHS]...\nError: {error}\n")
            self._done = True
            return self
        self._start_output(options)
        for key, value in self.env.items():
            self._saved_env[key] = os.environ.get(key)
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self.endpoint is None and "CAPSTAN_ENDPOINT" in self.env:
            self.endpoint = self.env["CAPSTAN_ENDPOINT"]
        if self.registry is not None:
            # As kopf's CLI: the files and modules register into the given registry.
            set_default_registry(self.registry)
        try:
            endpoint = self.endpoint
            if not endpoint:
                flags = cli.controller_flags(options)
                if self.settings is not None:
                    # The controller is this runner's: the settings it was given become flags.
                    applied, paths = settings_module.controller_flags(self.settings)
                    settings_module.mark_applied(paths)
                    if applied:
                        logging.getLogger("capstan").info("settings given as the controller's flags: %s",
                                                          " ".join(applied))
                    flags += applied
                self.controller = LocalController(flags + self.extra_flags).start()
                endpoint = self.controller.endpoint
            self._operator = OperatorRunner(options.paths, modules=options.modules, registry=self.registry,
                                            endpoint=endpoint, settings=self.settings,
                                            timeout=self.timeout if self.timeout is not None else 30.0)
            self._operator.__enter__()
        except BaseException:
            self._finish()
            raise
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self._finish()
        if self._exception is not None and self.reraise and not isinstance(self._exception, SystemExit):
            if exc_val is None:
                raise self._exception
            raise self._exception from exc_val
        return False

    def _start_output(self, options):
        """kopf's CLI logs to the captured output, with its options' level and format."""
        root = logging.getLogger()
        self._saved = (sys.stdout, sys.stderr, list(root.handlers), root.level)
        sys.stdout = sys.stderr = self._capture
        runner_module.configure_logging(options.verbose, options.debug, options.quiet, options.log_format)

    def _finish(self):
        if self._done:
            return
        self._done = True
        try:
            if self._operator is not None:
                try:
                    self._operator.__exit__(None, None, None)
                finally:
                    self._exception = self._operator.exception
        finally:
            if self.controller is not None:
                self.controller.stop()
            for key, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if self._saved is not None:
                stdout, stderr, handlers, level = self._saved
                sys.stdout, sys.stderr = stdout, stderr
                root = logging.getLogger()
                root.handlers[:] = handlers
                root.setLevel(level)

    @property
    def output(self) -> str:
        return self._capture.getvalue()

    stdout = output

    @property
    def stderr(self) -> str:
        return ""

    @property
    def controller_output(self) -> str:
        return self.controller.output if self.controller is not None else ""

    @property
    def exit_code(self) -> int:
        error = self._exception
        if error is None:
            return 0
        if isinstance(error, SystemExit):
            return error.code if isinstance(error.code, int) else 1
        return 1

    @property
    def exception(self) -> Optional[BaseException]:
        return self._exception
