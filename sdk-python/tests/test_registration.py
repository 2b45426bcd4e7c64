"""Registration: kopf's resource forms, options, kwargs checks and loud failures."""

import pytest

import capstan
import capstan.kopf as kopf
from capstan import wire
from capstan.registry import Registry
from capstan.testing import TestKit
from capstan.v1 import registration_pb2 as reg


@pytest.fixture
def registry():
    return Registry()


@pytest.mark.parametrize("args,kw,expected", [
    (("kopf.dev", "v1", "kopfexamples"), {}, ("kopf.dev", "v1", "kopfexamples")),
    ((("kopf.dev", "v1", "kopfexamples"),), {}, ("kopf.dev", "v1", "kopfexamples")),
    (("apps/v1", "deployments"), {}, ("apps", "v1", "deployments")),
    (("v1", "pods"), {}, ("", "v1", "pods")),
    (("", "v1", "pods"), {}, ("", "v1", "pods")),
    (("kopf.dev", "kopfexamples"), {}, ("kopf.dev", "", "kopfexamples")),
    (("kopfexamples.kopf.dev",), {}, ("", "", "kopfexamples.kopf.dev")),
    (("KopfExample",), {}, ("", "", "KopfExample")),
    ((), {"group": "kopf.dev", "version": "v1", "plural": "kopfexamples"}, ("kopf.dev", "v1", "kopfexamples")),
    ((), {"kind": "KopfExample"}, ("", "", "KopfExample")),
])
def test_resources_as_kopf_accepts_them(registry, args, kw, expected):
    @capstan.on.create(*args, registry=registry, **kw)
    def fn(**_):
        pass

    r = registry.handlers[0].resource
    assert (r.group, r.version, r.name) == expected


@pytest.mark.parametrize("args", [("", "pods"), ("kopf.dev", "", "kopfexamples"), ("", "v1", "")])
def test_empty_names_are_refused_but_the_core_group(registry, args):
    with pytest.raises(capstan.RegistrationError, match="non-empty strings"):
        @capstan.on.create(*args, registry=registry)
        def fn(**_):
            pass


def test_options_reach_the_registration(registry):
    @capstan.on.update("examples", id="upd", registry=registry, errors=capstan.ErrorsMode.PERMANENT, retries=3,
                       backoff=5, timeout=30, param={"p": 1}, labels={"a": "b", "c": capstan.PRESENT, "d": capstan.ABSENT},
                       annotations={"x": "y"}, field="spec.size", old=1, new=capstan.PRESENT)
    def fn(**_):
        pass

    msg = wire.registration(registry.handlers[0])
    assert msg.handler_id == "upd" and msg.kind == reg.HANDLER_KIND_UPDATE
    assert msg.resource.name == "examples"
    assert msg.errors_mode == reg.ERRORS_MODE_PERMANENT and msg.retries == 3
    assert msg.backoff.seconds == 5 and msg.timeout.seconds == 30
    assert msg.param.json == b'{"p":1}'
    assert msg.filters.labels["a"].equals == "b"
    assert msg.filters.labels["c"].presence == reg.PRESENCE_PRESENT
    assert msg.filters.labels["d"].presence == reg.PRESENCE_ABSENT
    assert msg.filters.annotations["x"].equals == "y"
    assert msg.filters.field == "spec.size"
    assert msg.filters.old.equals.json == b"1"
    assert msg.filters.new.presence == reg.PRESENCE_PRESENT
    assert not msg.filters.sdk_when


def test_field_handlers_get_kopfs_id_suffix(registry):
    @capstan.on.field("examples", field="spec.field", registry=registry)
    def field_fn(**_):
        pass

    assert registry.handlers[0].id.endswith("field_fn/spec.field")


def test_daemon_timer_delete_resume_options(registry):
    @capstan.daemon("examples", registry=registry, initial_delay=1, cancellation_backoff=2, cancellation_timeout=3)
    async def d(stopped, **_):
        pass

    @capstan.timer("examples", registry=registry, interval=10, initial_delay=1, idle=5, sharp=True)
    def t(**_):
        pass

    @capstan.on.delete("examples", registry=registry, optional=True)
    def dl(**_):
        pass

    @capstan.on.resume("examples", registry=registry, deleted=True)
    def rs(**_):
        pass

    d_, t_, dl_, rs_ = (wire.registration(h) for h in registry.handlers)
    assert d_.daemon.initial_delay.seconds == 1 and d_.daemon.cancellation_backoff.seconds == 2
    assert d_.daemon.cancellation_timeout.seconds == 3
    assert t_.timer.interval.seconds == 10 and t_.timer.idle.seconds == 5 and t_.timer.sharp
    assert dl_.delete.optional and rs_.resume.deleted


def test_callable_filters_are_evaluated_by_the_sdk(registry):
    @capstan.on.create("examples", registry=registry, when=lambda spec, **_: True, labels={"a": lambda v, **_: True})
    def fn(**_):
        pass

    msg = wire.registration(registry.handlers[0])
    assert msg.filters.sdk_when
    assert "a" not in msg.filters.labels


def test_persistent_admission_configurations_are_the_controllers(registry):
    with pytest.raises(capstan.RegistrationError, match=r"fn'.*--webhook-keep-on-exit"):
        @capstan.on.validate("examples", registry=registry, persistent=True)
        def fn(**_):
            pass


def test_unknown_option_names_the_handler(registry):
    with pytest.raises(capstan.RegistrationError, match=r"handler '.*fn': unknown option\(s\) colour"):
        @capstan.on.create("examples", registry=registry, colour="red")
        def fn(**_):
            pass


def test_unknown_kwarg_names_the_handler(registry):
    # Index names are kwargs too, so a kwarg is known to be wrong once every handler is
    # registered: when the operator (or the test kit) starts.
    @capstan.on.create("examples", registry=registry)
    def fn(bodyy):
        pass

    with pytest.raises(capstan.RegistrationError, match=r"handler '.*fn': unknown kwarg 'bodyy'"):
        registry.check()


def test_kwarg_of_another_kind_is_unknown(registry):
    @capstan.on.create("examples", registry=registry)
    def fn(stopped):
        pass

    with pytest.raises(capstan.RegistrationError, match=r"unknown kwarg 'stopped' for create handlers"):
        registry.check()


def test_settings_kwarg_is_taken_by_startup_handlers(registry):
    @capstan.on.startup(registry=registry)
    def fn(settings, **_):
        pass

    registry.check()


def test_bad_option_values(registry):
    with pytest.raises(capstan.RegistrationError, match="retries="):
        capstan.on.create("examples", registry=registry, retries=-1)(lambda **_: None)
    with pytest.raises(capstan.RegistrationError, match="not JSON-serialisable"):
        capstan.on.create("examples", registry=registry, param=object())(lambda **_: None)
    with pytest.raises(capstan.RegistrationError, match="needs field="):
        capstan.on.create("examples", registry=registry, value=1)(lambda **_: None)
    with pytest.raises(capstan.RegistrationError, match="needs interval="):
        capstan.timer("examples", registry=registry)(lambda **_: None)
    with pytest.raises(capstan.RegistrationError, match="cancellation_polling"):
        capstan.daemon("examples", registry=registry, cancellation_polling=5)(lambda **_: None)
    with pytest.raises(capstan.RegistrationError, match="no resource given"):
        capstan.on.create(registry=registry)(lambda **_: None)


def test_duplicate_ids_fail(registry):
    capstan.on.create("examples", registry=registry, id="x")(lambda **_: None)
    with pytest.raises(capstan.RegistrationError, match="registered twice"):
        capstan.on.create("examples", registry=registry, id="x")(lambda **_: None)


def test_kopf_module_exposes_kopfs_names():
    for name in ("on", "daemon", "timer", "index", "subhandler", "register", "TemporaryError", "PermanentError",
                 "HandlerTimeoutError", "ErrorsMode", "Diff", "Body", "Patch", "PRESENT", "ABSENT", "adopt",
                 "ConnectionInfo", "Memo", "operator", "run", "DaemonStopped", "info", "warn", "exception",
                 "event", "all_", "any_", "none_", "SyncDaemonStopperChecker"):
        assert hasattr(kopf, name), name



def test_stacked_decorators_register_one_function_under_each_kind(registry):
    # kopf's own example: one function for resuming and creating. The controller takes one id
    # per kind, so the later registration gets `<id>.<kind>`.
    @capstan.on.resume("examples", registry=registry)
    @capstan.on.create("examples", registry=registry)
    @capstan.on.create("others", registry=registry)
    @capstan.on.resume("others", registry=registry)
    def fn(**_):
        pass

    fn_id = fn.__qualname__
    got = sorted((h.kind, h.id, h.resource.name) for h in registry.handlers)
    assert got == [("create", f"{fn_id}.create", "examples"), ("create", f"{fn_id}.create", "others"),
                   ("resume", fn_id, "examples"), ("resume", fn_id, "others")]
    assert len({wire.registration(h).handler_id for h in registry.handlers}) == 2
    out = TestKit(registry).invoke(f"{fn_id}.create", {"metadata": {"name": "x"}})
    assert out.status == "success"


def test_a_function_with_the_same_kind_twice_on_one_resource_still_fails(registry):
    def fn(**_):
        pass

    capstan.on.create("examples", registry=registry)(fn)
    with pytest.raises(capstan.RegistrationError, match="registered twice"):
        capstan.on.create("examples", registry=registry)(fn)


def test_another_function_with_the_same_id_and_another_kind_still_fails(registry):
    capstan.on.create("examples", registry=registry, id="x")(lambda **_: None)
    with pytest.raises(capstan.RegistrationError, match="registered twice"):
        capstan.on.resume("examples", registry=registry, id="x")(lambda **_: None)


def test_a_file_loaded_again_replaces_its_handlers(registry, tmp_path):
    # As a test suite running one operator file in several KopfRunners does.
    source = tmp_path / "op.py"
    source.write_text("import capstan\n@capstan.on.create('examples')\ndef fn(**_): pass\n")
    from capstan.registry import get_default_registry, set_default_registry
    from capstan.runner import load
    before = get_default_registry()
    try:
        set_default_registry(registry)
        load([str(source)], [])
        first = registry.handlers[0].fn
        load([str(source)], [])
        assert len(registry.handlers) == 1 and registry.handlers[0].fn is not first
    finally:
        set_default_registry(before)
