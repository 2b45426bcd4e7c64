"""Results for invocations of handlers this process does not have (`UNKNOWN_HANDLER`) are sent
like every other result: they wait for room in the outgoing queue, never dropped when it is
full; a stream that takes nothing for `STALL_TIMEOUT` ends with `StreamStalled`, and the
process connects again."""

import asyncio
import logging

import pytest

import capstan
from capstan import connection
from capstan.connection import Operator
from capstan.errors import StreamStalled
from capstan.registry import Registry
from capstan.v1 import invocation_pb2 as inv
from capstan.v1 import runtime_service_pb2 as rs

from test_connection import T, _body, _next, _registration_status, _serve, socket_path  # noqa: F401


def _held_writer(gates):
    """A writer that holds every result of the n-th session until gates[n] is set (a stream
    whose peer reads nothing); other messages pass."""
    sessions = []

    async def writer(self, session):
        sessions.append(session)
        gate = gates[len(sessions) - 1] if len(sessions) <= len(gates) else None
        while True:
            message = await session.queue.get()
            if message is None:
                await session.call.done_writing()
                return
            if gate is not None and message.WhichOneof("message") == "result":
                await gate.wait()
            await session.call.write(message)

    return writer


def _registry():
    registry = Registry()
    capstan.on.create("examples", registry=registry, id="known")(lambda **_: None)
    return registry


def _unknown(i):
    return rs.ConnectResponse(invocation=inv.Invocation(
        invocation_id=f"u{i}", handler_id="gone", attempt=1, body=_body("one", "a"),
        change=inv.ResourceChange(reason=inv.CHANGE_REASON_CREATE)))


def test_unknown_handler_results_wait_for_room_in_a_full_queue(socket_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(connection, "QUEUE_BOUND", 2)

    async def scenario():
        gate = asyncio.Event()
        monkeypatch.setattr(Operator, "_writer", _held_writer([gate]))
        server, fake = await _serve(socket_path)
        stop = asyncio.Event()
        runner = asyncio.create_task(Operator(_registry(), endpoint=f"unix://{socket_path}", stop=stop).run())
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(registrations=_registration_status(hello))))
            for i in range(20):
                await outgoing.put(_unknown(i))
            await asyncio.sleep(0.5)  # the queue is full long before the last one
            gate.set()
            results = [await _next(incoming, "result") for _ in range(20)]
            assert [r.invocation_id for r in results] == [f"u{i}" for i in range(20)]
            assert {r.permanent_error.diagnostics[0].reason for r in results} == {"UNKNOWN_HANDLER"}
            stop.set()
            await outgoing.put(None)
            await asyncio.wait_for(runner, T)
        finally:
            runner.cancel()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_stream_that_stays_stalled_ends_with_stream_stalled_and_reconnects(socket_path, monkeypatch, caplog):  # noqa: F811
    monkeypatch.setattr(connection, "QUEUE_BOUND", 2)
    monkeypatch.setattr(connection, "STALL_TIMEOUT", 0.3)
    caplog.set_level(logging.WARNING, logger="capstan")

    async def scenario():
        never = asyncio.Event()
        monkeypatch.setattr(Operator, "_writer", _held_writer([never]))
        server, fake = await _serve(socket_path)
        stop = asyncio.Event()
        runner = asyncio.create_task(Operator(_registry(), endpoint=f"unix://{socket_path}", stop=stop).run())
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(registrations=_registration_status(hello))))
            for i in range(10):
                await outgoing.put(_unknown(i))
            # The stalled stream is closed, and the process says hello on a new one.
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), 5)
            await _next(incoming, "hello")
            stop.set()
            await outgoing.put(None)
            await asyncio.wait_for(runner, T)
        finally:
            runner.cancel()
            await server.stop(0)

    asyncio.run(scenario())
    assert any("StreamStalled" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_stream_stalled_is_a_connection_error():
    assert issubclass(StreamStalled, ConnectionError)
    with pytest.raises(ConnectionError):
        raise StreamStalled("no room")
