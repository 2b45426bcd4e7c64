"""A daemon's `patch` is applied after every attempt, as kopf applies it — a failed attempt's
too (kopf's example daemon counts its failures in the status this way): the handler process
sends it as a progress update before the failed result."""

import asyncio
import json
import os
import tempfile

import capstan.kopf as kopf
from capstan.connection import Operator
from capstan.registry import Registry
from capstan.testing import TestKit
from capstan.v1 import invocation_pb2 as inv
from capstan.v1 import runtime_service_pb2 as rs
from test_connection import T, _body, _next, _registration_status, _serve


def _registry():
    registry = Registry()

    @kopf.daemon("kopfexamples", registry=registry, id="monitor")
    def monitor(patch, retry, **_):
        patch.status["failures"] = f"Failed {retry + 1} times"
        raise kopf.TemporaryError("not yet", delay=1)

    return registry


def test_the_patch_of_a_failed_daemon_attempt_is_kept():
    out = TestKit(_registry()).invoke("monitor", {"metadata": {"name": "x"}})
    assert out.status == "temporary"
    assert out.patch == {"status": {"failures": "Failed 1 times"}}


def test_the_patch_of_a_failed_daemon_attempt_is_sent_before_its_result():
    async def scenario(socket_path):
        server, fake = await _serve(socket_path)
        stop = asyncio.Event()
        runner = asyncio.create_task(Operator(_registry(), endpoint=f"unix://{socket_path}", stop=stop).run())
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            assert rs.CAPABILITY_INVOCATION_UPDATES in hello.capabilities
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(
                connection_id="c1", registrations=_registration_status(hello))))
            await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                invocation_id="d1", handler_id="monitor", attempt=2, body=_body("one", "a"), daemon=inv.DaemonStart())))
            update = await _next(incoming, "update")
            assert update.invocation_id == "d1"
            assert [json.loads(p.body.json) for p in update.patches] == [{"status": {"failures": "Failed 2 times"}}]
            result = await _next(incoming, "result")
            assert result.WhichOneof("outcome") == "temporary_error" and not result.patches
            stop.set()
            await asyncio.wait_for(runner, T)
        finally:
            runner.cancel()
            await server.stop(0)

    with tempfile.TemporaryDirectory() as d:
        asyncio.run(scenario(os.path.join(d, "capstan.sock")))
