"""Invocation: kwargs, error mapping, patches, sub-handlers and daemons' `stopped`, through
the test kit (which runs the same code as the connection)."""

import asyncio
import time

import pytest

import capstan
from capstan.registry import Registry
from capstan.structs import DaemonStoppingReason
from capstan.testing import TestKit

BODY = {"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
        "metadata": {"name": "one", "namespace": "default", "uid": "u-1", "labels": {"a": "b"},
                     "annotations": {"x": "y"}},
        "spec": {"field": "a"}, "status": {"s": 1}}


@pytest.fixture
def registry():
    return Registry()


def test_change_kwargs(registry):
    seen = {}

    @capstan.on.update("examples", registry=registry)
    def fn(body, spec, meta, status, name, namespace, uid, labels, annotations, patch, logger, diff, old, new,
           reason, retry, started, runtime, param, memo, resource):
        seen.update(locals())

    out = TestKit(registry).invoke("fn", BODY, old={"spec": {"field": "a"}}, new={"spec": {"field": "b"}}, attempt=3)
    assert out.status == "success", out.message
    assert seen["name"] == "one" and seen["namespace"] == "default" and seen["uid"] == "u-1"
    assert seen["spec"]["field"] == "a" and seen["status"] == {"s": 1}
    assert seen["labels"] == {"a": "b"} and seen["annotations"] == {"x": "y"}
    assert seen["meta"].name == "one" and seen["body"].spec == {"field": "a"}
    assert seen["reason"] == "update" and seen["retry"] == 2
    assert list(seen["diff"]) == [("change", ("spec", "field"), "a", "b")]
    assert seen["old"] == {"spec": {"field": "a"}} and seen["new"] == {"spec": {"field": "b"}}
    assert seen["runtime"].total_seconds() >= 0


def test_event_kwargs(registry):
    seen = {}

    @capstan.on.event("examples", registry=registry)
    def fn(event, type, **_):
        seen.update(event=event, type=type)

    TestKit(registry).invoke("fn", BODY, event_type="MODIFIED")
    assert seen["type"] == "MODIFIED" and seen["event"]["object"]["metadata"]["name"] == "one"


def test_results_and_patches(registry):
    @capstan.on.create("examples", registry=registry)
    def fn(patch, **_):
        patch.status["phase"] = "ready"
        patch.metadata.labels["l"] = "v"
        patch.spec["gone"] = None
        patch.metadata.annotations  # touched but empty: not sent
        return {"message": "hi"}

    out = TestKit(registry).invoke("fn", BODY)
    assert out.result == {"message": "hi"}
    assert out.outcome.object_patch == {"metadata": {"labels": {"l": "v"}}, "spec": {"gone": None}}
    assert out.outcome.status_patch == {"status": {"phase": "ready"}}


@pytest.mark.parametrize("error,status", [
    (capstan.TemporaryError("later", delay=7), "temporary"),
    (capstan.PermanentError("never"), "permanent"),
    (capstan.HandlerTimeoutError("slow"), "permanent"),
    (ValueError("oops"), "unclassified"),
])
@pytest.mark.parametrize("is_async", [False, True])
def test_errors_map_to_outcomes(registry, error, status, is_async):
    if is_async:
        async def fn(**_):
            raise error
    else:
        def fn(**_):
            raise error
    capstan.on.create("examples", registry=registry)(fn)
    out = TestKit(registry).invoke("fn", BODY)
    assert out.status == status
    assert out.patch == {}
    if status == "temporary":
        assert out.delay == 7
    if status == "unclassified":
        assert out.message == "ValueError: oops" and out.outcome.error_type == "ValueError"
    assert any("failed" in message for _, message in out.logs)


def test_unserialisable_result_is_a_permanent_error_naming_the_handler(registry):
    @capstan.on.create("examples", registry=registry)
    def fn(**_):
        return object()

    out = TestKit(registry).invoke("fn", BODY)
    assert out.status == "permanent" and "fn'" in out.message and "JSON" in out.message


def test_when_filter_skips(registry):
    @capstan.on.create("examples", registry=registry, when=lambda spec, **_: spec.get("field") == "b")
    def fn(**_):
        return 1

    kit = TestKit(registry)
    assert kit.invoke("fn", BODY).status == "skipped"
    assert kit.invoke("fn", {**BODY, "spec": {"field": "b"}}).status == "success"


def test_sync_handlers_run_off_the_loop_and_async_on_it(registry):
    threads = {}

    @capstan.on.create("examples", registry=registry, id="s")
    def sync(**_):
        import threading
        threads["sync"] = threading.current_thread().name

    @capstan.on.create("examples", registry=registry, id="a")
    async def async_(**_):
        import threading
        threads["async"] = threading.current_thread().name

    kit = TestKit(registry)
    kit.invoke("s", BODY)
    kit.invoke("a", BODY)
    assert threads["sync"] != threads["async"]


def test_subhandlers_run_after_their_parent_and_report_each(registry):
    @capstan.on.create("examples", registry=registry)
    def parent(spec, **_):
        for item in ("x", "y"):
            @capstan.subhandler(id=f"item-{item}")
            def sub(patch, retry, item=item, **_):
                if item == "y" and retry == 0:
                    raise capstan.TemporaryError("y later", delay=1)
                patch.status[item] = retry

    kit = TestKit(registry)
    out = kit.invoke("parent", BODY)
    assert out.status == "success"
    assert out.subhandlers["item-x"].status == "success"
    assert out.subhandlers["item-y"].status == "temporary"
    assert out.patch == {"status": {"x": 0}}
    # The next attempt: x is done, y runs again with its own retry count.
    out = kit.invoke("parent", BODY, attempt=2, subhandlers={"item-x": {"success": True}, "item-y": {"retries": 1}})
    assert set(out.subhandlers) == {"item-y"} and out.subhandlers["item-y"].status == "success"
    assert out.patch == {"status": {"y": 1}}


def _deferring_call(kit, handler_id, **call):
    """A call as from a controller that takes deferred sub-handlers."""
    from capstan.invoke import Running, run
    c = kit._call(handler_id, BODY, logs=[], events=[], **call)
    c.defers = True
    return asyncio.run(run(Running(c)))


def test_a_deferring_controller_gets_one_sub_handler_per_call_the_fewest_retries_first(registry):
    ran = []

    @capstan.on.create("examples", registry=registry)
    def parent(**_):
        for item in ("x", "y", "z"):
            @capstan.subhandler(id=f"item-{item}")
            def sub(item=item, **_):
                ran.append(item)

    kit = TestKit(registry)
    out = _deferring_call(kit, "parent")
    assert ran == ["x"]
    assert [(s.id, s.outcome.status) for s in out.subhandlers] == [
        ("item-y", "deferred"), ("item-z", "deferred"), ("item-x", "success")]
    # kopf's asap: y failed once, so z (no retries) goes first.
    ran.clear()
    out = _deferring_call(kit, "parent", attempt=2,
                          subhandlers={"item-x": {"success": True}, "item-y": {"retries": 1}})
    assert ran == ["z"]
    assert {s.id: s.outcome.status for s in out.subhandlers} == {"item-y": "deferred", "item-z": "success"}
    # The wire carries a deferred one as `deferred`.
    from capstan import wire
    msg = wire.result("inv", "parent", out, 0.1)
    assert [s.WhichOneof("outcome") for s in msg.subhandlers] == ["deferred", "success"]


def test_a_lifecycle_picks_the_sub_handlers_and_a_failing_one_falls_back_to_the_first(registry):
    import capstan.kopf as kopf
    ran = []

    @capstan.on.create("examples", registry=registry)
    async def parent(**_):
        def one(**_):
            ran.append("one")

        def two(**_):
            ran.append("two")

        await kopf.execute(fns={"one": one, "two": two}, lifecycle=kopf.lifecycles.all_at_once)

    @capstan.on.create("examples", registry=registry)
    async def broken(**_):
        def first(**_):
            ran.append("first")

        def second(**_):
            ran.append("second")

        def lifecycle(handlers, **_):
            raise RuntimeError("a bug")

        await kopf.execute(fns={"first": first, "second": second}, lifecycle=lifecycle)

    kit = TestKit(registry)
    _deferring_call(kit, "parent")
    assert ran == ["one", "two"]
    ran.clear()
    out = _deferring_call(kit, "broken")
    assert ran == ["first"]
    assert {s.id: s.outcome.status for s in out.subhandlers} == {"first": "success", "second": "deferred"}


def test_a_sub_handler_its_filter_rejects_is_not_picked_and_holds_no_other_back(registry):
    ran = []

    @capstan.on.create("examples", registry=registry)
    def parent(**_):
        @capstan.subhandler(id="never", when=lambda **_: False)
        def never(**_):
            ran.append("never")

        @capstan.subhandler(id="then")
        def then(**_):
            ran.append("then")

    out = _deferring_call(TestKit(registry), "parent")
    assert ran == ["then"]
    assert {s.id: s.outcome.status for s in out.subhandlers} == {"then": "success"}


def test_without_a_deferring_controller_every_sub_handler_runs_in_one_call(registry):
    ran = []

    @capstan.on.create("examples", registry=registry)
    def parent(**_):
        for item in ("x", "y"):
            @capstan.subhandler(id=f"item-{item}")
            def sub(item=item, **_):
                ran.append(item)

    TestKit(registry).invoke("parent", BODY)
    assert ran == ["x", "y"]


def test_register_outside_a_handler_fails():
    with pytest.raises(capstan.RegistrationError, match="only inside a running handler"):
        capstan.register(lambda **_: None, id="x")


def test_async_daemon_gets_stopped_and_the_live_body(registry):
    @capstan.daemon("examples", registry=registry)
    async def d(stopped, spec, logger, **_):
        seen = []
        while not stopped:
            if spec.get("field") not in seen:
                seen.append(spec.get("field"))
            await stopped.wait(0.05)
        logger.info(f"stopped: {stopped.reason.value}")
        return {"seen": seen}

    run = TestKit(registry).daemon("d", BODY)
    time.sleep(0.3)
    run.update({**BODY, "spec": {"field": "b"}})
    time.sleep(0.3)
    out = run.stop(DaemonStoppingReason.RESOURCE_DELETED)
    assert out.status == "success"
    assert out.result == {"seen": ["a", "b"]}
    assert ("info", "stopped: resource_deleted") in out.logs


def test_sync_daemon_waits_on_stopped(registry):
    @capstan.daemon("examples", registry=registry)
    def d(stopped, **_):
        waited = 0
        while not stopped.wait(0.05):
            waited += 1
        return {"stopped": bool(stopped), "reason": stopped.reason.value}

    run = TestKit(registry).daemon("d", BODY)
    time.sleep(0.2)
    out = run.stop(DaemonStoppingReason.OPERATOR_EXITING)
    assert out.result == {"stopped": True, "reason": "operator_exiting"}


def test_memo_is_shared_between_handlers(registry):
    @capstan.on.create("examples", registry=registry, id="w")
    def write(memo, **_):
        memo.counter = memo.get("counter", 0) + 1

    @capstan.on.create("examples", registry=registry, id="r")
    def read(memo, **_):
        return memo.counter

    kit = TestKit(registry)
    kit.invoke("w", BODY)
    assert kit.invoke("r", BODY).result == 1


def test_adopt_sets_owner_name_namespace_labels():
    child = {"metadata": {}}
    capstan.adopt(child, BODY)
    meta = child["metadata"]
    assert meta["ownerReferences"][0]["uid"] == "u-1" and meta["generateName"] == "one-"
    assert meta["namespace"] == "default" and meta["labels"] == {"a": "b"}


def test_events_on_any_object_are_posted_through_the_invocation(registry):
    other = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default", "uid": "u-p"}}

    @capstan.on.create("examples", registry=registry)
    def fn(body, **_):
        capstan.info(body, reason="Seen", message="seen it")
        capstan.warn([other], reason="Odd", message="odd pod")
        capstan.exception(body, reason="Failed", exc=ValueError("bad"))

    out = TestKit(registry).invoke("fn", BODY)
    assert [(e["type"], e["reason"], e["message"]) for e in out.events] == [
        ("Normal", "Seen", "seen it"), ("Warning", "Odd", "odd pod"), ("Error", "Failed", "bad")]
    assert out.events[0]["object"] == {"group": "demo.capstan.dev", "version": "v1", "kind": "Example",
                                       "namespace": "default", "name": "one", "uid": "u-1"}
    assert out.events[1]["object"]["group"] == "" and out.events[1]["object"]["kind"] == "Pod"


def test_filter_combinators(registry):
    big = lambda spec, **_: spec.get("size", 0) > 5  # noqa: E731
    odd = lambda spec, **_: spec.get("size", 0) % 2 == 1  # noqa: E731

    capstan.on.create("examples", registry=registry, id="all", when=capstan.all_([big, odd]))(lambda **_: 1)
    capstan.on.create("examples", registry=registry, id="any", when=capstan.any_([big, odd]))(lambda **_: 1)
    capstan.on.create("examples", registry=registry, id="none", when=capstan.none_([big, odd]))(lambda **_: 1)
    kit = TestKit(registry)
    body = {**BODY, "spec": {"size": 3}}
    assert [kit.invoke(i, body).status for i in ("all", "any", "none")] == ["skipped", "success", "skipped"]


def test_unserialisable_patch_is_a_permanent_error_naming_the_handler(registry):
    @capstan.on.create("examples", registry=registry, id="patcher")
    def fn(patch, **_):
        patch.status["when"] = object()

    out = TestKit(registry).invoke("patcher", BODY)
    assert out.status == "permanent" and "'patcher'" in out.message and "patch" in out.message
    assert out.patch == {}
