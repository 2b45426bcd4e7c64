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


def _run(args, tmp_path, env_extra=None, **kw):
    env = {**os.environ, "PYTHONPATH": SDK, "CAPSTAN_ENDPOINT": f"unix://{tmp_path}/none.sock", **(env_extra or {})}
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


def test_kopf_compat_runs_an_operator_file_that_imports_kopf(tmp_path):
    (tmp_path / "example.py").write_text(
        "import kopf\n"
        "assert kopf.__name__ == 'capstan.kopf', kopf.__name__\n"
        "from kopf.testing import KopfRunner\n"
        "@kopf.on.create('kopfexamples')\n"
        "def create_fn(spec: kopf.Spec, bodyy, **_): pass\n")
    proc = _run(["--kopf-compat", "-A", "--standalone", "example.py"], tmp_path)
    out, _ = proc.communicate(timeout=60)
    # Imported as kopf, registered, and stopped at the check of its (misspelt) kwarg.
    assert proc.returncode == 2, out
    assert "unknown kwarg 'bodyy'" in out
    assert "give them to `capstan run`: --all-namespaces --standalone" in out


def test_without_kopf_compat_import_kopf_is_not_capstans(tmp_path):
    (tmp_path / "example.py").write_text("import sys\nimport kopf\n")
    env_python = sys.executable
    proc = _run(["example.py"], tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "No module named 'kopf'" in out, (env_python, out)


def test_with_controller_starts_it_with_kopfs_options_and_stops_it_first(tmp_path):
    argv_file, stopped_file = tmp_path / "argv", tmp_path / "stopped"
    fake = tmp_path / "capstan"
    fake.write_text(f"""#!{sys.executable}
import signal, sys, time
open({str(argv_file)!r}, "w").write(" ".join(sys.argv[1:]))
def stop(*_):
    open({str(stopped_file)!r}, "w").write("stopped")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("capstan started", flush=True)
while True:
    time.sleep(0.1)
""")
    fake.chmod(0o755)
    (tmp_path / "example.py").write_text("import kopf\n@kopf.on.create('kopfexamples')\ndef fn(**_): pass\n")
    env = {"CAPSTAN_BINARY": str(fake)}
    proc = _run(["--kopf-compat", "--with-controller", "-n", "team-a", "-p", "10", "example.py"], tmp_path, env_extra=env)
    deadline = time.monotonic() + 60
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "controller started" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(lines) + out
    argv = argv_file.read_text().split()
    assert argv[:2] == ["run", "--listen"] and "--namespace team-a" in " ".join(argv) and "--priority 10" in " ".join(argv)
    assert stopped_file.read_text() == "stopped"
