"""A Capstan controller started by this process, for development and tests (kopf's `kopf run`
and `KopfRunner` are one process; with Capstan the controller is another): `capstan run`
listening on a private Unix socket, against the current kubeconfig, stopped with SIGTERM.

The binary is `$CAPSTAN_BINARY`, else `capstan` on PATH.
"""

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from typing import List, Optional


class ControllerError(Exception):
    """The controller could not be found or did not start."""


def binary() -> str:
    """The controller's binary: `$CAPSTAN_BINARY`, else `capstan` on PATH."""
    path = os.environ.get("CAPSTAN_BINARY") or shutil.which("capstan")
    if not path:
        raise ControllerError("no controller to start: set CAPSTAN_BINARY to the capstan binary or put capstan on PATH")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalController:
    """`capstan run FLAGS...` on a socket of its own; `endpoint` is what the handler process
    dials. Its output is kept in `output`."""

    def __init__(self, flags: List[str] = (), *, path: Optional[str] = None, timeout: float = 60.0):
        self.flags = list(flags)
        self.path = path
        self.timeout = timeout
        self._dir: Optional[tempfile.TemporaryDirectory] = None
        self._process: Optional[subprocess.Popen] = None
        self._lines: List[str] = []
        self._started = threading.Event()
        self.endpoint = ""

    @property
    def output(self) -> str:
        return "".join(self._lines)

    def start(self):
        path = self.path or binary()
        self._dir = tempfile.TemporaryDirectory(prefix="capstan-")
        sock = os.path.join(self._dir.name, "capstan.sock")
        self.endpoint = f"unix://{sock}"
        args = [path, "run", "--listen", self.endpoint]
        if not any(f == "--admin-listen" or f.startswith("--admin-listen=") for f in self.flags):
            args += ["--admin-listen", f"127.0.0.1:{_free_port()}"]
        env = {**os.environ, "NO_COLOR": "1"}
        try:
            process = subprocess.Popen(args + self.flags, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, env=env)
        except OSError as error:
            raise ControllerError(f"could not start the controller {path!r}: {error}") from None
        self._process = process
        threading.Thread(target=self._read, args=(process,), name="capstan-controller-output", daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while not self._started.wait(0.1):
            if process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ControllerError(f"the controller did not start ({' '.join(args + self.flags)}):\n{self.output}")
        return self

    def _read(self, process):
        for line in process.stdout:
            self._lines.append(line)
            if "capstan started" in line:
                self._started.set()

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        process, self._process = self._process, None
        code = None
        if process is not None:
            if process.poll() is None:
                process.terminate()
            try:
                code = process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
        return code

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False
