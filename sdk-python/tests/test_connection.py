"""The stream, against a fake controller served by grpcio on a real Unix socket: hello with
the registrations, pong, an invocation answered with its result and patches, a daemon that
follows ObjectUpdate and stops on Cancel, reconnection after the stream breaks, and goodbye
on stop."""

import asyncio
import time
import json
import os
import tempfile

import grpc
import pytest

import capstan
from capstan.connection import Operator
from capstan.registry import Registry
from capstan.v1 import common_pb2 as common
from capstan.v1 import invocation_pb2 as inv
from capstan.v1 import runtime_service_pb2 as rs
from capstan.v1 import runtime_service_pb2_grpc as rs_grpc

T = 20  # generous bound for every wait


class FakeController(rs_grpc.RuntimeServiceServicer):
    """Records what handler processes send; a test script drives what it answers."""

    def __init__(self):
        self.connections = asyncio.Queue()

    async def Connect(self, request_iterator, context):
        incoming = asyncio.Queue()
        outgoing = asyncio.Queue()
        await self.connections.put((incoming, outgoing, context))

        async def pump():
            async for message in request_iterator:
                await incoming.put(message)
            await incoming.put(None)

        task = asyncio.create_task(pump())
        try:
            while True:
                message = await outgoing.get()
                if message is None:
                    return
                yield message
        finally:
            task.cancel()


async def _next(queue, which):
    """The next message of kind `which` from `queue`, skipping logs and pongs not asked for."""
    while True:
        message = await asyncio.wait_for(queue.get(), T)
        if message is None:
            raise AssertionError(f"the stream ended before a {which}")
        if message.WhichOneof("message") == which:
            return getattr(message, which)


@pytest.fixture
def socket_path():
    with tempfile.TemporaryDirectory() as d:
        yield os.path.join(d, "capstan.sock")


async def _serve(path):
    server = grpc.aio.server()
    fake = FakeController()
    rs_grpc.add_RuntimeServiceServicer_to_server(fake, server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    return server, fake


def _registration_status(hello):
    from capstan.v1 import registration_pb2 as reg
    return [reg.RegistrationStatus(handler_id=h.handler_id, accepted=True) for h in hello.handlers]


def _body(name, field):
    return common.Json(json=json.dumps({"metadata": {"name": name, "uid": "u-" + name}, "spec": {"field": field}}).encode())


def test_the_whole_stream(socket_path):
    registry = Registry()

    @capstan.on.create("examples", registry=registry, id="create_fn")
    def create_fn(name, body, patch, retry, **_):
        capstan.info(body, reason="Seen", message=f"seen {name}")
        patch.status["seen"] = name
        return {"retry": retry}

    @capstan.daemon("examples", registry=registry, id="monitor")
    async def monitor(stopped, spec, logger, **_):
        seen = []
        while not stopped:
            if spec.get("field") not in seen:
                seen.append(spec.get("field"))
                logger.info(f"sees {spec.get('field')}")
            await stopped.wait(0.05)
        return {"seen": seen, "reason": stopped.reason.value}

    async def scenario():
        server, fake = await _serve(socket_path)
        stop = asyncio.Event()
        op = Operator(registry, endpoint=f"unix://{socket_path}", stop=stop)
        runner = asyncio.create_task(op.run())
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            assert [h.handler_id for h in hello.handlers] == ["create_fn", "monitor"]
            assert hello.sdk.language == "python"
            assert rs.CAPABILITY_OBJECT_UPDATES in hello.capabilities
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(
                connection_id="c1", runtime=rs.SoftwareInfo(name="fake"), capabilities=list(hello.capabilities),
                registrations=_registration_status(hello))))

            await outgoing.put(rs.ConnectResponse(ping=rs.Ping(nonce=42)))
            assert (await _next(incoming, "pong")).nonce == 42

            await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                invocation_id="i1", handler_id="create_fn", attempt=2, body=_body("one", "a"),
                change=inv.ResourceChange(reason=inv.CHANGE_REASON_CREATE))))
            event = await _next(incoming, "log")
            assert (event.invocation_id, event.reason, event.message, event.object.name) == ("i1", "Seen", "seen one", "one")
            assert event.posting == rs.EVENT_POSTING_ALWAYS
            result = await _next(incoming, "result")
            assert result.invocation_id == "i1" and result.WhichOneof("outcome") == "success"
            assert json.loads(result.success.result.json) == {"retry": 1}
            assert [(p.target, json.loads(p.body.json)) for p in result.patches] == [
                (common.PATCH_TARGET_STATUS, {"status": {"seen": "one"}})]

            await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                invocation_id="d1", handler_id="monitor", attempt=1, body=_body("one", "a"),
                daemon=inv.DaemonStart())))
            assert "sees a" in (await _next(incoming, "log")).message
            await outgoing.put(rs.ConnectResponse(object_update=rs.ObjectUpdate(invocation_id="d1", body=_body("one", "b"))))
            assert "sees b" in (await _next(incoming, "log")).message
            await outgoing.put(rs.ConnectResponse(cancel=inv.Cancel(
                invocation_id="d1", reason=inv.CANCEL_REASON_RESOURCE_DELETED)))
            result = await _next(incoming, "result")
            assert result.invocation_id == "d1" and result.WhichOneof("outcome") == "success"
            assert json.loads(result.success.result.json) == {"seen": ["a", "b"], "reason": "resource_deleted"}

            # The stream breaks: the process reconnects and says hello again.
            await outgoing.put(None)
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(
                connection_id="c2", registrations=_registration_status(hello))))

            # Stop: goodbye, then the process closes its side and returns.
            stop.set()
            assert (await _next(incoming, "goodbye")).reason
            assert await asyncio.wait_for(incoming.get(), T) is None
            await outgoing.put(None)
            await asyncio.wait_for(runner, T)
        finally:
            runner.cancel()
            await server.stop(0)

    asyncio.run(scenario())


def test_a_stopping_process_asks_for_its_cleanup_handlers_and_closes_after_the_farewell(socket_path):
    registry = Registry()
    ran = []

    @capstan.on.cleanup(registry=registry, id="cleanup_fn")
    def cleanup_fn(**_):
        ran.append("cleanup")

    async def scenario():
        server, fake = await _serve(socket_path)
        stop = asyncio.Event()
        op = Operator(registry, endpoint=f"unix://{socket_path}", stop=stop)
        runner = asyncio.create_task(op.run())
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            assert rs.CAPABILITY_CLEANUP_ON_GOODBYE in hello.capabilities
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(
                connection_id="c1", capabilities=list(hello.capabilities),
                registrations=_registration_status(hello))))
            await outgoing.put(rs.ConnectResponse(ping=rs.Ping(nonce=1)))
            await _next(incoming, "pong")

            stop.set()
            goodbye = await _next(incoming, "goodbye")
            assert goodbye.cleanup
            # The controller runs the cleanup handler on this stream: it is still answered.
            await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                invocation_id="c1", handler_id="cleanup_fn", attempt=1,
                activity=inv.ActivityRequest(activity=inv.ACTIVITY_CLEANUP))))
            result = await _next(incoming, "result")
            assert result.invocation_id == "c1" and result.WhichOneof("outcome") == "success"
            assert ran == ["cleanup"]
            assert not runner.done(), "the process closed before the farewell"
            await outgoing.put(rs.ConnectResponse(farewell=rs.Farewell(reason="done")))
            assert await asyncio.wait_for(incoming.get(), T) is None
            await outgoing.put(None)
            await asyncio.wait_for(runner, T)
        finally:
            runner.cancel()
            await server.stop(0)

    asyncio.run(scenario())


def test_without_the_capability_a_goodbye_asks_for_no_cleanup(socket_path):
    registry = Registry()
    capstan.on.cleanup(registry=registry, id="cleanup_fn")(lambda **_: None)

    async def scenario():
        server, fake = await _serve(socket_path)
        stop = asyncio.Event()
        op = Operator(registry, endpoint=f"unix://{socket_path}", stop=stop)
        runner = asyncio.create_task(op.run())
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(
                connection_id="c1", registrations=_registration_status(hello))))
            await outgoing.put(rs.ConnectResponse(ping=rs.Ping(nonce=1)))
            await _next(incoming, "pong")
            stop.set()
            assert not (await _next(incoming, "goodbye")).cleanup
            assert await asyncio.wait_for(incoming.get(), T) is None
            await outgoing.put(None)
            await asyncio.wait_for(runner, T)
        finally:
            runner.cancel()
            await server.stop(0)

    asyncio.run(scenario())


def test_no_accepted_handler_is_fatal(socket_path):
    registry = Registry()
    capstan.on.create("examples", registry=registry)(lambda **_: None)

    class Refusing(rs_grpc.RuntimeServiceServicer):
        async def Connect(self, request_iterator, context):
            async for _ in request_iterator:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no registration was accepted")

    async def scenario():
        server = grpc.aio.server()
        rs_grpc.add_RuntimeServiceServicer_to_server(Refusing(), server)
        server.add_insecure_port(f"unix://{socket_path}")
        await server.start()
        try:
            with pytest.raises(capstan.errors.ConnectionFatal, match="accepted none"):
                await asyncio.wait_for(Operator(registry, endpoint=f"unix://{socket_path}").run(), T)
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_losing_the_controller_mid_invocation_stops_the_daemon_and_reconnects(socket_path):
    registry = Registry()
    stopped_with = []

    @capstan.daemon("examples", registry=registry, id="monitor")
    def monitor(stopped, **_):
        stopped.wait(T)
        stopped_with.append(stopped.reason.value)

    async def scenario():
        server, fake = await _serve(socket_path)
        stop = asyncio.Event()
        runner = asyncio.create_task(Operator(registry, endpoint=f"unix://{socket_path}", stop=stop).run())
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(registrations=_registration_status(hello))))
            await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                invocation_id="d1", handler_id="monitor", attempt=1, body=_body("one", "a"), daemon=inv.DaemonStart())))
            await outgoing.put(rs.ConnectResponse(ping=rs.Ping(nonce=1)))
            await _next(incoming, "pong")
            await outgoing.put(None)  # the stream breaks while the daemon runs
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            await _next(incoming, "hello")
            for _ in range(int(T / 0.05)):
                if stopped_with:
                    break
                await asyncio.sleep(0.05)
            assert stopped_with == ["connection_lost"]
            stop.set()
            await _next(incoming, "goodbye")
            await outgoing.put(None)
            await asyncio.wait_for(runner, T)
        finally:
            runner.cancel()
            await server.stop(0)

    asyncio.run(scenario())


def test_operator_runner_serves_until_the_block_ends(socket_path):
    from capstan.testing import OperatorRunner

    registry = Registry()
    capstan.on.create("examples", registry=registry, id="create_fn")(lambda name, **_: {"hello": name})

    async def serve_and_drive(started, finished):
        server, fake = await _serve(socket_path)
        started.set()
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(registrations=_registration_status(hello))))
            await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                invocation_id="i1", handler_id="create_fn", attempt=1, body=_body("one", "a"),
                change=inv.ResourceChange(reason=inv.CHANGE_REASON_CREATE))))
            result = await _next(incoming, "result")
            finished.append(json.loads(result.success.result.json))
            await _next(incoming, "goodbye")
            await outgoing.put(None)
        finally:
            await server.stop(1)

    import threading

    started, finished = threading.Event(), []
    server_thread = threading.Thread(target=lambda: asyncio.run(serve_and_drive(started, finished)))
    server_thread.start()
    assert started.wait(T)
    with OperatorRunner(registry=registry, endpoint=f"unix://{socket_path}") as runner:
        for _ in range(int(T / 0.05)):
            if finished:
                break
            time.sleep(0.05)
    server_thread.join(T)
    assert runner.exception is None
    assert finished == [{"hello": "one"}]


def test_flow_control_is_sent_at_once_from_a_handler_and_again_after_a_reconnect(socket_path):
    registry = Registry()

    @capstan.on.create("examples", registry=registry, id="create_fn", max_in_flight=3)
    def create_fn(**_):
        capstan.set_max_in_flight(0, handler="create_fn")  # a sync handler, in its thread

    with pytest.raises(capstan.RegistrationError, match="max_in_flight"):
        capstan.on.update("examples", registry=registry, max_in_flight=-1)(lambda **_: None)

    async def scenario():
        server, fake = await _serve(socket_path)
        stop = asyncio.Event()
        runner = asyncio.create_task(capstan.operator(
            registry=registry, endpoint=f"unix://{socket_path}", stop_flag=stop))
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            assert [(h.handler_id, h.max_in_flight) for h in hello.handlers] == [("create_fn", 3)]
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(
                connection_id="c1", registrations=_registration_status(hello))))
            with pytest.raises(ValueError, match="no handler 'nope'"):
                capstan.set_max_in_flight(1, handler="nope")
            capstan.set_max_in_flight(8)
            flow = await _next(incoming, "flow_control")
            assert (flow.handler_id, flow.max_in_flight) == ("", 8)
            await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                invocation_id="i1", handler_id="create_fn", attempt=1, body=_body("one", "a"),
                change=inv.ResourceChange(reason=inv.CHANGE_REASON_CREATE))))
            flow = await _next(incoming, "flow_control")
            assert (flow.handler_id, flow.max_in_flight) == ("create_fn", 0)
            assert (await _next(incoming, "result")).invocation_id == "i1"

            # A new connection gets the caps again, right after the hello.
            await outgoing.put(None)
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            flows = [await _next(incoming, "flow_control") for _ in range(2)]
            assert sorted((f.handler_id, f.max_in_flight) for f in flows) == [("", 8), ("create_fn", 0)]
            stop.set()
            await outgoing.put(None)
            await asyncio.wait_for(runner, T)
        finally:
            runner.cancel()
            await server.stop(0)

    asyncio.run(scenario())


def test_index_invocations_fill_the_index_and_object_gone_drops_the_memo(socket_path):
    registry = Registry()

    @capstan.index("examples", registry=registry, id="by_field")
    def by_field(spec, **_):
        return {spec.get("field"): True}

    @capstan.on.create("examples", registry=registry, id="reader")
    def reader(by_field, memo, **_):
        memo.seen = memo.get("seen", 0) + 1
        return {"keys": sorted(by_field), "seen": memo.seen}

    async def scenario():
        server, fake = await _serve(socket_path)
        stop = asyncio.Event()
        op = Operator(registry, endpoint=f"unix://{socket_path}", stop=stop)
        runner = asyncio.create_task(op.run())
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            from capstan.v1 import registration_pb2 as reg
            assert [h.kind for h in hello.handlers] == [reg.HANDLER_KIND_INDEX, reg.HANDLER_KIND_CREATE]
            assert rs.CAPABILITY_OBJECT_GONE in hello.capabilities
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(
                connection_id="c1", registrations=_registration_status(hello))))

            async def call(i, handler, body, **payload):
                await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                    invocation_id=i, handler_id=handler, attempt=1, body=body, **payload)))
                return await _next(incoming, "result")

            for i, (name, field) in enumerate([("one", "a"), ("two", "b")]):
                r = await call(f"x{i}", "by_field", _body(name, field), index=inv.IndexRequest())
                assert r.WhichOneof("outcome") == "success"
            r = await call("r1", "reader", _body("one", "a"), change=inv.ResourceChange(reason=inv.CHANGE_REASON_CREATE))
            assert json.loads(r.success.result.json) == {"keys": ["a", "b"], "seen": 1}
            # Leaving the index: no call, the entries go.
            r = await call("x9", "by_field", _body("two", "b"), index=inv.IndexRequest(deleted=True))
            assert r.WhichOneof("outcome") == "success"
            r = await call("r2", "reader", _body("one", "a"), change=inv.ResourceChange(reason=inv.CHANGE_REASON_CREATE))
            assert json.loads(r.success.result.json) == {"keys": ["a"], "seen": 2}
            # The object is gone: its memo goes with it.
            await outgoing.put(rs.ConnectResponse(object_gone=rs.ObjectGone(object=common.ResourceRef(uid="u-one"))))
            r = await call("r3", "reader", _body("one", "a"), change=inv.ResourceChange(reason=inv.CHANGE_REASON_CREATE))
            assert json.loads(r.success.result.json) == {"keys": ["a"], "seen": 1}
            stop.set()
            await outgoing.put(None)
            await asyncio.wait_for(runner, T)
        finally:
            runner.cancel()
            await server.stop(0)

    asyncio.run(scenario())


def test_an_index_handler_of_a_lost_stream_leaves_the_next_streams_index_alone(socket_path):
    registry = Registry()
    released = []

    @capstan.index("examples", registry=registry, id="by_field")
    async def by_field(spec, **_):
        if spec.get("field") == "slow":
            # A handler that ignores its cancellation and answers after its stream was lost.
            try:
                await asyncio.sleep(T)
            except asyncio.CancelledError:
                pass
            while not released:
                await asyncio.sleep(0.01)
            return {"stale": True}
        return {spec.get("field"): True}

    @capstan.on.create("examples", registry=registry, id="reader")
    def reader(by_field, **_):
        return {"keys": sorted(by_field)}

    async def scenario():
        server, fake = await _serve(socket_path)
        stop = asyncio.Event()
        runner = asyncio.create_task(Operator(registry, endpoint=f"unix://{socket_path}", stop=stop).run())
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(registrations=_registration_status(hello))))
            await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                invocation_id="slow", handler_id="by_field", attempt=1, body=_body("old", "slow"),
                index=inv.IndexRequest())))
            await outgoing.put(rs.ConnectResponse(ping=rs.Ping(nonce=1)))
            assert (await _next(incoming, "pong")).in_flight == 1
            await outgoing.put(None)  # the stream breaks while the index handler runs

            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(registrations=_registration_status(hello))))

            async def call(i, handler, body, **payload):
                await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                    invocation_id=i, handler_id=handler, attempt=1, body=body, **payload)))
                return await _next(incoming, "result")

            await call("x1", "by_field", _body("kept", "a"), index=inv.IndexRequest())
            released.append(True)  # the lost stream's handler answers now
            await asyncio.sleep(0.3)
            r = await call("r1", "reader", _body("kept", "a"), change=inv.ResourceChange(reason=inv.CHANGE_REASON_CREATE))
            assert json.loads(r.success.result.json) == {"keys": ["a"]}
            stop.set()
            await outgoing.put(None)
            await asyncio.wait_for(runner, T)
        finally:
            runner.cancel()
            await server.stop(0)

    asyncio.run(scenario())


def test_only_taken_ids_are_dialled_again():
    from capstan.connection import _only_taken
    head = "NO_HANDLERS_ACCEPTED: no handler registration was accepted "
    assert _only_taken(head + "(a: [HANDLER_ID_TAKEN] held; b: [HANDLER_ID_TAKEN] held)")
    assert not _only_taken(head + "(a: [HANDLER_ID_TAKEN] held; b: [BAD_FILTER] x)")
    assert not _only_taken(head + "(a: [HANDLER_ID_TAKEN,BAD_FILTER] x)")
    assert not _only_taken(head.strip())
