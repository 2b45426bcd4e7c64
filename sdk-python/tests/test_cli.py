"""`python -m capstan run`: registration errors stop the process with a message naming the
handler; files and modules are loaded; SIGTERM stops it cleanly while it reconnects."""

import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SDK = os.path.dirname(HERE)


def _run(args, tmp_path, **kw):
    env = {**os.environ, "PYTHONPATH": SDK, "CAPSTAN_ENDPOINT": f"unix://{tmp_path}/none.sock"}
    return subprocess.Popen([sys.executable, "-m", "capstan", "run", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.mark.parametrize("source,message", [
    ("@capstan.on.create('examples')\ndef fn(bodyy): pass\n", "handler 'fn': unknown kwarg 'bodyy'"),
    ("@capstan.on.validate('examples', persistent=True)\ndef fn(**_): pass\n", "--webhook-keep-on-exit"),
    ("@capstan.timer('examples', interval=1, colour='red')\ndef fn(**_): pass\n", "unknown option(s) colour"),
])
def test_registration_errors_exit_with_the_handlers_name(tmp_path, source, message):
    (tmp_path / "handlers.py").write_text("import capstan\n" + source)
    proc = _run(["handlers.py"], tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert message in out


def test_sigterm_stops_cleanly_while_reconnecting(tmp_path):
    (tmp_path / "mod_handlers.py").write_text("import capstan\n@capstan.on.create('examples')\ndef fn(**_): pass\n")
    proc = _run(["-m", "mod_handlers", "--log-format", "json"], tmp_path)
    deadline = time.monotonic() + 60
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "reconnecting" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(lines) + out
    assert '"message": "stopped"' in out
