"""Events as kopf 1.45 posts them: only the explicitly posted ones (`kopf.event/info/warn/
exception`), as `settings.posting` says; handlers' log records are forwarded to the controller
marked never to be posted, unless `settings.posting.loggers` is set. On the wire, against a
fake controller, and through the test kit."""

import asyncio
import logging

import pytest

import capstan.kopf as kopf
from capstan.connection import Operator
from capstan.registry import Registry
from capstan.testing import TestKit
from capstan.v1 import invocation_pb2 as inv
from capstan.v1 import runtime_service_pb2 as rs
from test_connection import T, _body, _next, _registration_status, _serve

BODY = {"apiVersion": "kopf.dev/v1", "kind": "KopfExample", "metadata": {"name": "one", "namespace": "ns", "uid": "u1"}}


def _registry():
    registry = Registry()

    @kopf.on.create("kopfexamples", registry=registry, id="create_fn")
    def create_fn(body, logger, **_):
        logger.info("info record")
        logger.warning("warning record")
        kopf.event(body, type="SomeType", reason="SomeReason", message="some message")
        kopf.info(body, reason="Info", message="an info")
        kopf.warn(body, reason="Warn", message="a warning")
        try:
            raise ValueError("boom")
        except ValueError:
            kopf.exception(body, message="failed:")

    return registry


def _records(settings):
    """The log records the handler process sends for one call of create_fn."""
    async def scenario(socket_path):
        server, fake = await _serve(socket_path)
        stop = asyncio.Event()
        op = Operator(_registry(), endpoint=f"unix://{socket_path}", stop=stop, settings=settings)
        runner = asyncio.create_task(op.run())
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(
                connection_id="c1", registrations=_registration_status(hello))))
            await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                invocation_id="i1", handler_id="create_fn", attempt=1, body=_body("one", "a"),
                change=inv.ResourceChange(reason=inv.CHANGE_REASON_CREATE))))
            records = []
            while True:
                message = await asyncio.wait_for(incoming.get(), T)
                which = message.WhichOneof("message")
                if which == "log":
                    records.append(message.log)
                elif which == "result":
                    break
            stop.set()
            await asyncio.wait_for(runner, T)
            return records
        finally:
            runner.cancel()
            await server.stop(0)

    import tempfile, os
    with tempfile.TemporaryDirectory() as d:
        return asyncio.run(scenario(os.path.join(d, "capstan.sock")))


def _posted(records):
    return [(r.level, r.reason, r.message) for r in records if r.posting == rs.EVENT_POSTING_ALWAYS]


def test_only_explicit_events_are_posted_by_default_with_their_own_types():
    records = _records(kopf.OperatorSettings())
    assert _posted(records) == [
        (rs.LOG_LEVEL_INFO, "SomeReason", "some message"),
        (rs.LOG_LEVEL_INFO, "Info", "an info"),
        (rs.LOG_LEVEL_WARNING, "Warn", "a warning"),
        (rs.LOG_LEVEL_ERROR, "ValueError", "failed: boom"),
    ]
    types = [r.event_type for r in records if r.posting == rs.EVENT_POSTING_ALWAYS]
    assert types == ["SomeType", "Normal", "Warning", "Error"]
    logged = {r.message: r.posting for r in records if not r.reason}
    assert logged == {"info record": rs.EVENT_POSTING_NEVER, "warning record": rs.EVENT_POSTING_NEVER}


def test_loggers_are_posted_from_the_level_with_posting_loggers():
    settings = kopf.OperatorSettings()
    settings.posting.loggers = True
    settings.posting.level = logging.WARNING
    records = _records(settings)
    logged = {r.message: r.posting for r in records if not r.reason}
    assert logged == {"info record": rs.EVENT_POSTING_NEVER, "warning record": rs.EVENT_POSTING_ALWAYS}
    # kopf's level applies to the explicit ones too: no info.
    assert [reason for _, reason, _ in _posted(records) if reason] == ["SomeReason", "Warn", "ValueError"]


@pytest.mark.parametrize("enabled,level,expected", [
    (True, logging.INFO, ["SomeType", "Normal", "Warning", "Error"]),
    (True, logging.ERROR, ["SomeType", "Error"]),
    # kopf's warn() checks the level only: it posts with posting disabled.
    (False, logging.INFO, ["Warning"]),
])
def test_explicit_events_follow_kopfs_posting_rules(enabled, level, expected):
    kit = TestKit(_registry())
    kit.settings.posting.enabled = enabled
    kit.settings.posting.level = level
    out = kit.invoke("create_fn", BODY)
    assert out.status == "success", out.message
    assert [e["type"] for e in out.events] == expected


def test_exception_events_are_kopfs():
    out = TestKit(_registry()).invoke("create_fn", BODY)
    error = [e for e in out.events if e["type"] == "Error"]
    assert [(e["reason"], e["message"]) for e in error] == [("ValueError", "failed: boom")]
    assert error[0]["object"]["name"] == "one"


def settings_around_startup(configure, settings=None, capabilities=True):
    """Runs the startup handler `configure` against a fake controller (one that takes process
    settings, unless `capabilities` is false): the kinds of the messages the process sends
    from its hello to the handler's result, in order, and the `ProcessSettings` among them."""
    registry = Registry()
    kopf.on.startup(registry=registry, id="configure")(configure)

    async def scenario(socket_path):
        server, fake = await _serve(socket_path)
        stop = asyncio.Event()
        op = Operator(registry, endpoint=f"unix://{socket_path}", stop=stop,
                      settings=settings if settings is not None else kopf.OperatorSettings())
        runner = asyncio.create_task(op.run())
        try:
            incoming, outgoing, _ = await asyncio.wait_for(fake.connections.get(), T)
            hello = await _next(incoming, "hello")
            assert rs.CAPABILITY_PROCESS_SETTINGS in hello.capabilities
            await outgoing.put(rs.ConnectResponse(welcome=rs.Welcome(
                connection_id="c1", capabilities=list(hello.capabilities) if capabilities else [],
                registrations=_registration_status(hello))))
            await outgoing.put(rs.ConnectResponse(invocation=inv.Invocation(
                invocation_id="s1", handler_id="configure", attempt=1,
                activity=inv.ActivityRequest(activity=inv.ACTIVITY_STARTUP))))
            order, sent = [], []
            while "result" not in order:
                message = await asyncio.wait_for(incoming.get(), T)
                order.append(message.WhichOneof("message"))
                if order[-1] == "settings":
                    sent.append(message.settings)
            stop.set()
            await asyncio.wait_for(runner, T)
            return order, sent
        finally:
            runner.cancel()
            await server.stop(0)

    import tempfile, os
    with tempfile.TemporaryDirectory() as d:
        return asyncio.run(scenario(os.path.join(d, "capstan.sock")))


def test_the_controller_is_told_to_post_outcomes_as_settings_posting_says_before_watching_starts():
    """kopf's messages about the handling ("Handler 'x' failed temporarily", "Creation is
    processed") are the controller's: the process sends `ProcessSettings` after the welcome
    (never posted: kopf 1.45's default) and again, before the startup handler's result, when
    the handler changed `settings.posting`."""
    def configure(settings, **_):
        settings.posting.loggers = True
        settings.posting.level = logging.WARNING

    order, (first, changed) = settings_around_startup(configure)
    assert order.index("settings") < order.index("result") and order.count("settings") == 2, order
    assert first.outcome_events == rs.EVENT_POSTING_NEVER
    assert (changed.outcome_events, changed.outcome_level) == (rs.EVENT_POSTING_ALWAYS, rs.LOG_LEVEL_WARNING)
