"""An operator embedded in an application as kopf's example 12 embeds it: `kopf.operator()` in
a thread of its own with its own event loop, a `threading.Event` to stop it and one that tells
the application it is ready (once the controller accepted its handlers)."""

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
            seen.append(("ready before the welcome", ready_flag.is_set()))
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(registrations=_registration_status(hello))))
            seen.append(("ready after it", await asyncio.to_thread(ready_flag.wait, T)))
            await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                invocation_id="s1", handler_id="start_fn", attempt=1,
                activity=inv.ActivityRequest(activity=inv.ACTIVITY_STARTUP))))
            await _next(incoming, "result")
            stop_flag.set()  # from another thread than the operator's
            await _next(incoming, "goodbye")
            seen.append(("stopped", True))
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
    try:
        operator.join(T)
        server.join(T)
    finally:
        stop_flag.set()  # whatever failed, the operator does not outlive the test
    assert not operator.is_alive(), "the threading.Event did not stop the operator"
    assert seen == [("ready before the welcome", False), ("ready after it", True), ("stopped", True)]


def test_asyncio_flags_of_another_loop_are_raised_and_followed_through_their_loop():
    """The application's loop runs in one thread, the operator's in another."""
    app_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=app_loop.run_forever, daemon=True)
    thread.start()
    try:
        async def make():
            ready = asyncio.Event()
            waiting = asyncio.ensure_future(ready.wait())  # binds the Event to this loop
            await asyncio.sleep(0)
            return ready, waiting, asyncio.get_running_loop().create_future()

        ready, waiting, stop = asyncio.run_coroutine_threadsafe(make(), app_loop).result(T)

        async def operator_side():
            event, unfollow = flags.stop_event(stop)
            flags.raise_flag(ready)
            app_loop.call_soon_threadsafe(stop.set_result, None)
            await asyncio.wait_for(event.wait(), T)
            unfollow()

        asyncio.run(operator_side())
        asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(waiting), T), app_loop).result(T)
        assert ready.is_set()
    finally:
        app_loop.call_soon_threadsafe(app_loop.stop)
        thread.join(T)


def test_futures_are_flags_too():
    async def main():
        future = concurrent.futures.Future()
        event, unfollow = flags.stop_event(future)
        assert not event.is_set()
        threading.Thread(target=lambda: future.set_result(None)).start()
        await asyncio.wait_for(event.wait(), T)
        unfollow()
        ready = asyncio.get_running_loop().create_future()
        flags.raise_flag(ready)
        flags.raise_flag(ready)  # a future already done stays so
        assert ready.done()

    asyncio.run(main())


def test_other_flags_are_refused_before_anything_starts():
    with pytest.raises(TypeError, match="ready_flag"):
        asyncio.run(kopf.operator(registry=Registry(), ready_flag=object()))
    with pytest.raises(TypeError, match="stop_flag"):
        asyncio.run(kopf.operator(registry=Registry(), stop_flag="stop"))
