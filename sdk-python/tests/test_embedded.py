"""An operator embedded in an application as kopf's example 12 embeds it: `kopf.operator()` in
a thread of its own with its own event loop, a `threading.Event` to stop it and one that tells
the application it is ready (once connected and its startup handlers succeeded)."""

import asyncio
import concurrent.futures
import threading

import pytest

import capstan
import capstan.kopf as kopf
from capstan import flags
from capstan.registry import Registry
from capstan.v1 import invocation_pb2 as inv
from capstan.v1 import runtime_service_pb2 as rs

from test_connection import T, _next, _registration_status, _serve, socket_path  # noqa: F401 (a fixture)


def test_threading_flags_stop_the_operator_and_tell_it_ready(socket_path, monkeypatch):
    monkeypatch.setenv("CAPSTAN_ENDPOINT", f"unix://{socket_path}")
    registry = Registry()

    @capstan.on.startup(registry=registry, id="start_fn")
    def start_fn(**_):
        pass

    @capstan.on.create("examples", registry=registry)
    def create_fn(**_):
        pass

    seen = []

    async def controller(started, stop_flag, ready_flag):
        server, fake = await _serve(socket_path)
        started.set()
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(registrations=_registration_status(hello))))
            await asyncio.sleep(0.3)
            seen.append(("ready before its startup handler", ready_flag.is_set()))
            await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                invocation_id="s1", handler_id="start_fn", attempt=1,
                activity=inv.ActivityRequest(activity=inv.ACTIVITY_STARTUP))))
            await _next(incoming, "result")
            seen.append(("ready after it", await asyncio.to_thread(ready_flag.wait, T)))
            stop_flag.set()  # from another thread than the operator's
            await _next(incoming, "goodbye")
            await outgoing.put(None)
        finally:
            await server.stop(1)

    ready_flag, stop_flag, started = threading.Event(), threading.Event(), threading.Event()
    server = threading.Thread(target=lambda: asyncio.run(controller(started, stop_flag, ready_flag)), daemon=True)
    server.start()
    assert started.wait(T)

    def kopf_thread():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(kopf.operator(registry=registry, ready_flag=ready_flag, stop_flag=stop_flag))
        finally:
            loop.close()

    operator = threading.Thread(target=kopf_thread, daemon=True)
    operator.start()
    operator.join(T)
    server.join(T)
    assert not operator.is_alive(), "the threading.Event did not stop the operator"
    assert seen == [("ready before its startup handler", False), ("ready after it", True)]


def test_futures_are_flags_too():
    async def main():
        future = concurrent.futures.Future()
        event, following = flags.stop_event(future)
        assert following is None and not event.is_set()
        threading.Thread(target=lambda: future.set_result(None)).start()
        await asyncio.wait_for(event.wait(), T)
        ready = asyncio.get_running_loop().create_future()
        flags.raise_flag(ready)
        flags.raise_flag(ready)  # a future already done stays so
        assert ready.done()

    asyncio.run(main())


def test_other_flags_are_refused():
    with pytest.raises(TypeError, match="ready_flag"):
        flags.raise_flag(object())
