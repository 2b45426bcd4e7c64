"""SIGTERM stops the process within its grace period even when a sync handler never returns:
running handlers get the grace period, then the process exits without waiting for the
threads of those that ignored it (Python cannot stop a thread, and would otherwise wait for it
at exit, forever)."""

import asyncio
import os
import signal
import sys
import textwrap
import time

from capstan.v1 import invocation_pb2 as inv
from capstan.v1 import runtime_service_pb2 as rs

from test_connection import T, _body, _next, _registration_status, _serve, socket_path  # noqa: F401

GRACE = 1.0
SDK = os.path.join(os.path.dirname(__file__), "..")

PROCESS = textwrap.dedent("""
    import sys, time
    import capstan
    from capstan import connection

    connection.STOP_GRACE = float(sys.argv[2])
    registry = capstan.Registry()

    @capstan.on.create("examples", registry=registry, id="hang")
    def hang(logger, **_):
        logger.info("hanging")
        time.sleep(3600)

    settings = None
    if sys.argv[3] == "plain":
        # An executor of the operator's own (as a startup handler may set): a plain pool,
        # whose threads the interpreter waits for at exit.
        import concurrent.futures
        from capstan.settings import OperatorSettings
        settings = OperatorSettings()
        settings.execution.executor = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    capstan.run(registry=registry, endpoint=sys.argv[1], settings=settings)
""")


def test_a_hung_sync_handler_does_not_hold_the_process_past_its_grace_period(socket_path, tmp_path):  # noqa: F811
    _hung_handler_stops_within_its_grace_period(socket_path, tmp_path, "capstan")


def test_a_hung_sync_handler_in_a_plain_thread_pool_does_not_hold_the_process_either(socket_path, tmp_path):  # noqa: F811
    _hung_handler_stops_within_its_grace_period(socket_path, tmp_path, "plain")


def _hung_handler_stops_within_its_grace_period(socket_path, tmp_path, executor):  # noqa: F811
    script = tmp_path / "hung_handler_process.py"
    script.write_text(PROCESS)

    async def scenario():
        server, fake = await _serve(socket_path)
        env = dict(os.environ, PYTHONPATH=SDK)
        proc = await asyncio.create_subprocess_exec(sys.executable, str(script), f"unix://{socket_path}", str(GRACE),
                                                    executor, env=env)
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(registrations=_registration_status(hello))))
            await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                invocation_id="i1", handler_id="hang", attempt=1, body=_body("one", "a"),
                change=inv.ResourceChange(reason=inv.CHANGE_REASON_CREATE))))
            assert "hanging" in (await _next(incoming, "log")).message

            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await _next(incoming, "goodbye")
            # After the grace period the process closes its side; the controller ends the stream.
            while await asyncio.wait_for(incoming.get(), T) is not None:
                pass
            await outgoing.put(None)
            try:
                code = await asyncio.wait_for(proc.wait(), GRACE + 5)
            except asyncio.TimeoutError:
                raise AssertionError(f"still running {time.monotonic() - signalled:.1f}s after SIGTERM "
                                     f"(grace period {GRACE}s)") from None
            assert code == 0
            assert time.monotonic() - signalled < GRACE + 5
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await server.stop(0)

    asyncio.run(scenario())
