"""Several operators in one process (several `KopfRunner`s, or `operator()` tasks) built
without settings share the process's settings, and with them the executor of sync handlers:
one that stops must not shut that executor down under the others, whose queued sync calls
would be cancelled."""

import asyncio
import json
import threading

import capstan
from capstan import settings as settings_module
from capstan.connection import Operator
from capstan.registry import Registry
from capstan.v1 import invocation_pb2 as inv
from capstan.v1 import runtime_service_pb2 as rs

from test_connection import T, _body, _next, _registration_status, _serve, socket_path  # noqa: F401


def test_an_operator_that_stops_leaves_the_queued_sync_calls_of_another_running(socket_path):  # noqa: F811
    gate = threading.Event()
    started = threading.Event()

    first = Registry()
    capstan.on.create("examples", registry=first, id="first_fn")(lambda **_: None)
    second = Registry()

    @capstan.on.create("examples", registry=second, id="second_fn")
    def second_fn(name, **_):
        if name == "one":
            started.set()
            gate.wait(T)
        return {"ran": name}

    async def connect(fake):
        incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
        hello = await _next(incoming, "hello")
        await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(registrations=_registration_status(hello))))
        return incoming, outgoing

    async def scenario():
        server, fake = await _serve(socket_path)
        endpoint = f"unix://{socket_path}"
        a = Operator(first, endpoint=endpoint, stop=asyncio.Event())
        b = Operator(second, endpoint=endpoint, stop=asyncio.Event())
        assert a.settings is b.settings, "without settings, both use the process's"
        # One thread: the second call of B waits in the executor's queue.
        a.settings.execution.max_workers = 1
        running_a = asyncio.create_task(a.run())
        incoming_a, outgoing_a = await connect(fake)
        running_b = asyncio.create_task(b.run())
        incoming_b, outgoing_b = await connect(fake)
        try:
            for n, name in enumerate(["one", "two"]):
                await outgoing_b.put(rs.ConnectResponse(invocation=inv.Invocation(
                    invocation_id=f"i{n}", handler_id="second_fn", attempt=1, body=_body(name, "a"),
                    change=inv.ResourceChange(reason=inv.CHANGE_REASON_CREATE))))
            assert await asyncio.get_running_loop().run_in_executor(None, started.wait, T)

            # A stops while B's second call is queued behind its first.
            a.stop.set()
            await _next(incoming_a, "goodbye")
            await outgoing_a.put(None)
            await asyncio.wait_for(running_a, T)

            gate.set()
            results = {}
            while len(results) < 2:
                result = await _next(incoming_b, "result")
                results[result.invocation_id] = result
            assert results["i1"].WhichOneof("outcome") == "success", results["i1"]
            assert json.loads(results["i1"].success.result.json) == {"ran": "two"}

            b.stop.set()
            await _next(incoming_b, "goodbye")
            await outgoing_b.put(None)
            await asyncio.wait_for(running_b, T)
        finally:
            gate.set()
            running_a.cancel()
            running_b.cancel()
            await server.stop(0)

    settings_module.activate(settings_module.OperatorSettings())
    try:
        asyncio.run(scenario())
    finally:
        settings_module.activate(None)
