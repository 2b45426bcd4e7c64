"""`capstan.kopf.testing.KopfRunner`: kopf's command line, results and context manager; the
controller it starts when none is named (its flags from kopf's options), and the operator it
runs against a fake controller."""

import asyncio
import os
import sys
import threading
import time

import pytest

from capstan.controller import ControllerError
from capstan.kopf import cli
from capstan.kopf.testing import KopfRunner
from capstan.registry import Registry, get_default_registry, set_default_registry
from capstan.v1 import invocation_pb2 as inv
from capstan.v1 import runtime_service_pb2 as rs
from test_connection import T, _body, _next, _registration_status, _serve


@pytest.fixture(autouse=True)
def default_registry_kept():
    before = get_default_registry()
    yield
    set_default_registry(before)


def test_kopf_run_options_map_to_controller_flags():
    options = cli.parse(["run", "-A", "--verbose", "--standalone", "-n", "a", "--namespace", "b", "-P", "peers",
                         "-p", "100", "-L", "http://0.0.0.0:8081/healthz", "-m", "mod", "example.py"])
    assert options.paths == ["example.py"] and options.modules == ["mod"] and options.verbose
    assert cli.controller_flags(options) == [
        "--all-namespaces", "--namespace", "a", "--namespace", "b", "--standalone", "--peering", "peers",
        "--priority", "100", "--admin-listen", "0.0.0.0:8081"]
    with pytest.raises(cli.UsageError):
        cli.parse(["run", "--colour", "x.py"])


def test_bad_arguments_end_with_exit_code_2_as_kopfs_cli():
    with KopfRunner(["run", "--colour", "x.py"]) as runner:
        pass
    assert runner.exit_code == 2 and "Usage: kopf run" in runner.output


def test_without_a_controller_binary_the_runner_says_what_to_do(monkeypatch):
    monkeypatch.delenv("CAPSTAN_ENDPOINT", raising=False)
    monkeypatch.setenv("CAPSTAN_BINARY", "")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ControllerError, match="CAPSTAN_BINARY"):
        with KopfRunner(["run", "x.py"]):
            pass


def test_the_runner_starts_a_controller_with_kopfs_options_and_stops_it(tmp_path, monkeypatch):
    argv_file = tmp_path / "argv"
    fake = tmp_path / "capstan"
    fake.write_text(f"""#!{sys.executable}
import signal, sys, time
open({str(argv_file)!r}, "w").write(" ".join(sys.argv[1:]))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("capstan started", flush=True)
while True:
    time.sleep(0.1)
""")
    fake.chmod(0o755)
    (tmp_path / "example.py").write_text("import capstan.kopf as kopf\n"
                                        "@kopf.on.create('kopfexamples')\ndef create_fn(**_): pass\n")
    monkeypatch.delenv("CAPSTAN_ENDPOINT", raising=False)
    monkeypatch.setenv("CAPSTAN_BINARY", str(fake))
    with KopfRunner(["run", "-A", "--standalone", "--verbose", str(tmp_path / "example.py")],
                    registry=Registry()) as runner:
        assert runner.controller is not None and runner.controller.endpoint.startswith("unix://")
        time.sleep(0.3)
    argv = argv_file.read_text().split()
    assert argv[:2] == ["run", "--listen"] and "--all-namespaces" in argv and "--standalone" in argv
    assert runner.exit_code == 0 and runner.exception is None
    assert runner.controller._process is None  # stopped


def test_one_operator_file_runs_in_several_runners_of_one_process(tmp_path, monkeypatch):
    fake = tmp_path / "capstan"
    fake.write_text(f"""#!{sys.executable}
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("capstan started", flush=True)
while True:
    time.sleep(0.1)
""")
    fake.chmod(0o755)
    (tmp_path / "twice.py").write_text("import capstan.kopf as kopf\n"
                                      "@kopf.on.create('kopfexamples')\ndef create_fn(**_): pass\n")
    monkeypatch.delenv("CAPSTAN_ENDPOINT", raising=False)
    monkeypatch.setenv("CAPSTAN_BINARY", str(fake))
    set_default_registry(Registry())
    for _ in range(2):
        with KopfRunner(["run", "-A", str(tmp_path / "twice.py")]) as runner:
            time.sleep(0.2)
        assert runner.exit_code == 0 and runner.exception is None, runner.output
    assert len(get_default_registry().handlers) == 1


def test_the_runner_serves_the_operator_and_captures_its_output(tmp_path):
    (tmp_path / "example_runner.py").write_text(
        "import capstan.kopf as kopf\n"
        "@kopf.on.create('kopfexamples', id='create_fn')\n"
        "def create_fn(name, logger, **_):\n"
        "    logger.info(f'And here we are! {name}')\n"
        "    print('printed too')\n")
    socket_path = str(tmp_path / "capstan.sock")
    result = {}

    async def controller(ready, done):
        server, fake = await _serve(socket_path)
        ready.set()
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(
                connection_id="c1", registrations=_registration_status(hello))))
            await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                invocation_id="i1", handler_id="create_fn", attempt=1, body=_body("one", "a"),
                change=inv.ResourceChange(reason=inv.CHANGE_REASON_CREATE))))
            result["outcome"] = (await _next(incoming, "result")).WhichOneof("outcome")
            done.set()
            assert (await _next(incoming, "goodbye")).reason
            await outgoing.put(None)
        finally:
            await server.stop(1)

    ready, done = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(controller(ready, done)), daemon=True)
    thread.start()
    assert ready.wait(T)
    with KopfRunner(["run", "--verbose", str(tmp_path / "example_runner.py")], endpoint=f"unix://{socket_path}",
                    registry=Registry()) as runner:
        assert done.wait(T)
    thread.join(T)
    assert result["outcome"] == "success"
    assert runner.exit_code == 0 and runner.exception is None
    assert "And here we are! one" in runner.output and "printed too" in runner.output
    # kopf's lines: the object before the message, and the handling's own messages.
    assert "[one] And here we are! one" in runner.output
    assert "[one] Creation is in progress: {" in runner.output
    assert "[one] Handler 'create_fn' succeeded." in runner.output


def test_kopfs_invoke_options_are_taken_and_env_applied_while_running(tmp_path, monkeypatch):
    (tmp_path / "env_example.py").write_text(
        "import os\nimport capstan.kopf as kopf\nprint('ENV', os.environ.get('EXAMPLE_SETTING'))\n"
        "@kopf.on.create('kopfexamples')\ndef create_fn(**_): pass\n")
    monkeypatch.delenv("EXAMPLE_SETTING", raising=False)
    with KopfRunner(["run", str(tmp_path / "env_example.py")], endpoint=f"unix://{tmp_path}/none.sock",
                    registry=Registry(), env={"EXAMPLE_SETTING": "on"}, catch_exceptions=False) as runner:
        pass
    assert "ENV on" in runner.output and "EXAMPLE_SETTING" not in os.environ
    with pytest.raises(TypeError, match="colour"):
        KopfRunner(["run", "x.py"], colour=True)


def test_settings_given_to_the_runner_become_its_controllers_flags(tmp_path, monkeypatch):
    import capstan.kopf as kopf
    from capstan import settings as settings_module
    settings_module._forget_reported()
    argv_file = tmp_path / "argv"
    fake = tmp_path / "capstan"
    fake.write_text(f"""#!{sys.executable}
import signal, sys, time
open({str(argv_file)!r}, "w").write(" ".join(sys.argv[1:]))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("capstan started", flush=True)
while True:
    time.sleep(0.1)
""")
    fake.chmod(0o755)
    (tmp_path / "settings_example.py").write_text("import capstan.kopf as kopf\n"
                                                 "@kopf.on.create('kopfexamples')\ndef create_fn(**_): pass\n")
    monkeypatch.delenv("CAPSTAN_ENDPOINT", raising=False)
    monkeypatch.setenv("CAPSTAN_BINARY", str(fake))
    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 10  # kopf's example tests set this
    settings.watching.client_timeout = 15
    settings.networking.request_timeout = 20  # the same flag as client_timeout's: the last wins
    settings.persistence.finalizer = "example.com/finalizer"
    settings.peering.standalone = True
    settings.networking.trust_env = True  # no flag: said once, as from a startup handler
    with KopfRunner(["run", "-A", str(tmp_path / "settings_example.py")], settings=settings,
                    registry=Registry()) as runner:
        time.sleep(0.2)
    argv = argv_file.read_text()
    assert "--api-timeout 20s" in argv and argv.count("--api-timeout") == 1
    assert "--watch-server-timeout 10s" in argv
    assert "--finalizer example.com/finalizer" in argv and "--standalone" in argv
    assert "is the controller's to apply" not in runner.output
    assert "settings.networking.trust_env" in runner.output
    settings_module._forget_reported()
