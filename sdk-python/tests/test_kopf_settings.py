"""kopf's `OperatorSettings` under `capstan.kopf`: startup handlers get a `settings` object
with kopf's structure and defaults (compared with real kopf when its venv is there); what they
set is applied by this process (posting, the executor), sent to the controller (the finalizer,
the storages, the watches' timeouts, the worker limit: `ProcessSettings.operator`) or named
once — the controller's flag to set (WARNING) or no meaning with Capstan (INFO) — and never
fails."""

import json
import logging
import os
import subprocess

import pytest

import capstan.kopf as kopf
from capstan import settings as settings_module
from capstan.registry import Registry
from capstan.testing import TestKit
from capstan.v1 import runtime_service_pb2 as rs
from test_kopf_posting import settings_around_startup

_DEFAULT = os.path.expanduser("~/.cache/capstan/kopf-venv/bin/python")
KOPF_PYTHON = os.environ.get("CAPSTAN_KOPF_PYTHON") or (_DEFAULT if os.path.exists(_DEFAULT) else None)


@pytest.fixture(autouse=True)
def fresh_reports():
    settings_module._forget_reported()
    yield
    settings_module._forget_reported()


def _plain(value):
    """A setting's value as both sides can compare it."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict) or type(value).__name__ == "SelectorMapping":
        return {str(k): _plain(v) for k, v in dict(value).items()}
    # Storages and executors: their internals are their own (an executor as its standard class).
    for cls in type(value).__mro__:
        if cls.__module__.startswith("concurrent.futures"):
            return cls.__name__
    return type(value).__name__


def test_every_settings_field_has_a_place():
    paths = [path for path, _ in settings_module.fields(kopf.OperatorSettings())]
    assert sorted(paths) == sorted(settings_module.PLACES)
    assert {place for place, _ in settings_module.PLACES.values()} == {"sdk", "controller", "flag", "none"}


def test_structure_and_defaults_are_kopfs():
    if KOPF_PYTHON is None:
        pytest.skip("real kopf is not installed: run `bash sdk-python/scripts/kopf-venv.sh`")
    probe = f"""
import dataclasses, json, kopf
{_plain_source()}
s = kopf.OperatorSettings()
print(json.dumps({{f"{{a.name}}.{{b.name}}": _plain(getattr(getattr(s, a.name), b.name))
                  for a in dataclasses.fields(s) for b in dataclasses.fields(getattr(s, a.name))}}))
"""
    out = subprocess.run([KOPF_PYTHON, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    real = json.loads(out.stdout)
    ours = {path: _plain(value) for path, value in settings_module.fields(kopf.OperatorSettings())}
    assert ours == real


def _plain_source():
    import inspect
    return inspect.getsource(_plain)


def test_a_startup_handler_configures_and_is_told_once_what_is_the_controllers(caplog):
    registry = Registry()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_):
        settings.persistence.finalizer = "example.com/finalizer"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="example.com")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="example.com", key="last")
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 120
        settings.networking.request_timeout = 120
        settings.peering.standalone = True
        settings.peering.priority = 100
        settings.admission.server = kopf.WebhookServer(addr="0.0.0.0", port=8443, host="op.example.com")
        settings.admission.managed = "example.com"
        settings.networking.trust_env = True
        settings.execution.max_workers = 3
        with pytest.deprecated_call():
            settings.batching.worker_limit = 50

    kit = TestKit(registry)
    with caplog.at_level(logging.INFO, logger="capstan"):
        out = kit.invoke("configure")
        again = kit.invoke("configure")
    assert out.status == "success" and again.status == "success", out.message
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "settings." in r.getMessage()]
    # Peering, the API timeout and the managed configurations' name are sent to the controller
    # (as the finalizer, the storages and the watches are): only the webhook server is named.
    expected = [
        "--webhook-listen 0.0.0.0:8443 --webhook-cert-names "
        "op.example.com --webhook-url https://op.example.com:8443",
    ]
    for flags in expected:
        assert sum(flags in w for w in warned) == 1, (flags, warned)
    assert len(warned) == len(expected), warned
    assert len(said) == 1 and "settings.networking.trust_env" in said[0], said
    # Applied here: the posting level and the executor's size, never named.
    assert kit.settings.posting.level == logging.WARNING
    assert kit.settings.execution.executor._max_workers == 3
    assert not any("posting.level" in m or "max_workers" in m for m in warned + said)
    # Sent to the controller, never named: the finalizer, the storages, the timeouts, the limit.
    assert not any(f in m for m in warned for f in ("persistence.", "server_timeout", "worker_limit",
                                                     "request_timeout", "admission.managed")), warned


def test_kopfs_defaults_are_not_reported():
    assert settings_module.review(kopf.OperatorSettings()) == []


def test_settings_kwarg_is_for_activity_handlers_only():
    registry = Registry()

    @kopf.on.create("examples", registry=registry)
    def fn(settings, **_):
        pass

    with pytest.raises(kopf.RegistrationError, match="unknown kwarg 'settings'"):
        registry.check()


def test_kopf_run_takes_kopfs_options(monkeypatch, caplog):
    seen = {}
    monkeypatch.setattr(kopf.runner, "run", lambda **kw: seen.update(kw))
    settings = kopf.OperatorSettings()
    with caplog.at_level(logging.INFO, logger="capstan"):
        kopf.run(standalone=True, clusterwide=True, settings=settings, priority=10)
    assert seen["settings"] is settings
    assert any("--standalone" in r.getMessage() and "--priority" in r.getMessage() for r in caplog.records)
    with pytest.raises(TypeError, match="colour"):
        kopf.run(colour="red")


def test_settings_given_to_the_operator_are_reviewed(caplog):
    from capstan.connection import Operator
    settings = kopf.OperatorSettings()
    settings.watching.client_timeout = 10
    registry = Registry()
    kopf.on.create("examples", registry=registry)(lambda **_: None)
    with caplog.at_level(logging.WARNING, logger="capstan"):
        Operator(registry, endpoint="unix:///nonexistent", settings=settings)
    assert any("--api-timeout 10s" in r.getMessage() for r in caplog.records)


def _operator(**sections):
    """`operator_settings` of kopf's settings with `sections` set (`persistence={...}`)."""
    settings = kopf.OperatorSettings()
    for section, values in sections.items():
        for name, value in values.items():
            setattr(getattr(settings, section), name, value)
    return settings_module.operator_settings(settings)


def test_kopfs_defaults_send_nothing_to_the_controller():
    assert settings_module.operator_settings(kopf.OperatorSettings()) == rs.OperatorSettings()
    # Set to kopf's default explicitly: nothing either.
    assert _operator(persistence={"finalizer": "kopf.zalando.org/KopfFinalizerMarker",
                                  "progress_storage": kopf.SmartProgressStorage()},
                     watching={"inactivity_timeout": 70.0}) == rs.OperatorSettings()


@pytest.mark.parametrize("storage,expected", [
    # A prefix is sent with the diff-base's key, which kopf keeps where its storage says.
    (kopf.AnnotationsProgressStorage(prefix="example.com"),
     rs.OperatorSettings(progress_storage=rs.PROGRESS_STORAGE_KIND_ANNOTATIONS, persistence_prefix="example.com",
                         diffbase_key="kopf.zalando.org/last-handled-configuration")),
    (kopf.StatusProgressStorage(name="op"),
     rs.OperatorSettings(progress_storage=rs.PROGRESS_STORAGE_KIND_STATUS, status_field="op")),
    (kopf.StatusProgressStorage(field="status.op.progress"),
     rs.OperatorSettings(progress_storage=rs.PROGRESS_STORAGE_KIND_STATUS, status_field="op")),
    (kopf.SmartProgressStorage(name="op", prefix="example.com"),
     rs.OperatorSettings(progress_storage=rs.PROGRESS_STORAGE_KIND_SMART, persistence_prefix="example.com",
                         diffbase_key="kopf.zalando.org/last-handled-configuration", status_field="op")),
    # No flag says these: nothing is sent (review() names them).
    (kopf.StatusProgressStorage(field="status.op.records"), rs.OperatorSettings()),
    (kopf.MultiProgressStorage([kopf.AnnotationsProgressStorage(), kopf.StatusProgressStorage()]),
     rs.OperatorSettings()),
])
def test_progress_storages_are_sent_as_their_flags_say(storage, expected):
    assert _operator(persistence={"progress_storage": storage}) == expected


def test_peering_settings_are_sent_under_their_own_names():
    lifetime = rs.OperatorSettings().peering_lifetime.__class__(seconds=30)
    assert _operator(peering={"name": "mine", "priority": 100, "lifetime": 30, "mandatory": True}) == rs.OperatorSettings(
        peering_name="mine", peering_priority=100, peering_lifetime=lifetime, peering_mandatory=True)
    assert _operator(peering={"standalone": True}) == rs.OperatorSettings(peering_standalone=True)
    # Beyond the controller's bounds: not sent.
    assert _operator(peering={"priority": 2 ** 40}) == rs.OperatorSettings()


@pytest.mark.parametrize("storage,expected", [
    (kopf.AnnotationsDiffBaseStorage(prefix="example.com", key="last"),
     rs.OperatorSettings(diffbase_storage=rs.DIFF_BASE_STORAGE_KIND_ANNOTATIONS, diffbase_key="example.com/last")),
    (kopf.AnnotationsDiffBaseStorage(prefix="", key="last"),
     rs.OperatorSettings(diffbase_storage=rs.DIFF_BASE_STORAGE_KIND_ANNOTATIONS, diffbase_key="last")),
    (kopf.StatusDiffBaseStorage(name="op"),
     rs.OperatorSettings(diffbase_storage=rs.DIFF_BASE_STORAGE_KIND_STATUS, status_field="op")),
    (kopf.AnnotationsDiffBaseStorage(ignored_fields=["spec.x"]), rs.OperatorSettings()),
    (kopf.StatusDiffBaseStorage(field="status.op.diff"), rs.OperatorSettings()),
    (kopf.MultiDiffBaseStorage([kopf.AnnotationsDiffBaseStorage()]), rs.OperatorSettings()),
])
def test_diffbase_storages_are_sent_as_their_flags_say(storage, expected):
    assert _operator(persistence={"diffbase_storage": storage}) == expected


def test_the_diffbase_storages_status_field_wins_as_the_last_flag_does():
    progress, diffbase = kopf.StatusProgressStorage(name="progress"), kopf.StatusDiffBaseStorage(name="diffbase")
    sent = _operator(persistence={"progress_storage": progress, "diffbase_storage": diffbase})
    assert sent.status_field == "diffbase"
    settings = kopf.OperatorSettings()
    settings.persistence.progress_storage, settings.persistence.diffbase_storage = progress, diffbase
    args, _ = settings_module.controller_flags(settings)
    assert args[args.index("--status-field") + 1] == "diffbase" and args.count("--status-field") == 1


def test_the_finalizer_timeouts_and_worker_limit_are_sent():
    sent = _operator(persistence={"finalizer": "example.com/finalizer"},
                     watching={"inactivity_timeout": 12.5, "server_timeout": 29.6}, queueing={"worker_limit": 8})
    assert sent.finalizer == "example.com/finalizer" and sent.worker_limit == 8
    assert sent.watch_inactivity_timeout.ToTimedelta().total_seconds() == 12.5
    assert sent.watch_server_timeout.seconds == 30 and sent.watch_server_timeout.nanos == 0
    # The API server's timeout is whole seconds, at least one.
    assert _operator(watching={"server_timeout": 0.2}).watch_server_timeout.seconds == 1


@pytest.mark.parametrize("section,name,value", [
    ("queueing", "worker_limit", 0), ("queueing", "worker_limit", 100_001), ("queueing", "worker_limit", 2.5),
    ("watching", "inactivity_timeout", 0.5), ("watching", "inactivity_timeout", 86401),
    ("watching", "server_timeout", -1), ("watching", "server_timeout", 10 ** 6),
])
def test_values_out_of_the_controllers_bounds_are_not_sent_and_warned_once(section, name, value, caplog):
    settings = kopf.OperatorSettings()
    setattr(getattr(settings, section), name, value)
    assert settings_module.operator_settings(settings) == rs.OperatorSettings()
    with caplog.at_level(logging.WARNING, logger="capstan"):
        settings_module.review(settings)
        settings_module.review(settings)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"settings.{section}.{name}" in warned[0] and "not sent" in warned[0], warned


def test_what_is_sent_is_not_named_and_what_cannot_be_still_warns(caplog):
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = "example.com/finalizer"
    settings.persistence.progress_storage = kopf.MultiProgressStorage([kopf.AnnotationsProgressStorage()])
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(field="status.op.diff")
    with caplog.at_level(logging.INFO, logger="capstan"):
        reported = settings_module.review(settings)
    assert sorted(reported) == ["persistence.diffbase_storage", "persistence.progress_storage"]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and all("is the controller's to apply" in m for m in warned), warned
    assert "--progress-storage, --persistence-prefix, --status-field" in warned[0]
    # A controller that takes no settings: the finalizer's flag is named too, once.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="capstan"):
        assert settings_module.review(settings, carried=False) == ["persistence.finalizer"]
        assert settings_module.review(settings, carried=False) == []
    assert ["--finalizer example.com/finalizer" in r.getMessage() for r in caplog.records] == [True]


def test_the_runner_gives_its_controller_the_same_settings_as_flags():
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = "example.com/finalizer"
    settings.persistence.progress_storage = kopf.SmartProgressStorage(name="op", prefix="example.com")
    settings.watching.server_timeout = 29.6
    settings.watching.inactivity_timeout = 12.5
    settings.queueing.worker_limit = 8
    args, paths = settings_module.controller_flags(settings)
    assert " ".join(args) == (
        "--watch-server-timeout 30s --watch-inactivity-timeout 12.5s --worker-limit 8 "
        "--finalizer example.com/finalizer --progress-storage smart --persistence-prefix example.com "
        "--status-field op")
    assert len(paths) == 5


def test_a_startup_handlers_operator_settings_are_sent_before_its_result(caplog):
    """The controller applies `ProcessSettings.operator` before the first watch when it comes
    before the startup handler's result: kopf's defaults send an empty one after the welcome,
    the handler's finalizer comes before its result, and nothing about it is warned."""
    def configure(settings, **_):
        settings.persistence.finalizer = "example.com/finalizer"
        settings.queueing.worker_limit = 0  # out of the controller's bounds: not sent

    with caplog.at_level(logging.WARNING, logger="capstan"):
        order, (first, changed) = settings_around_startup(configure)
    assert order.index("settings") < order.index("result") and order.count("settings") == 2, order
    assert first.operator == rs.OperatorSettings()
    assert changed.operator == rs.OperatorSettings(finalizer="example.com/finalizer")
    # Only the SDK's own records: the fake controller's gRPC server may log its teardown.
    warned = [r.getMessage() for r in caplog.records if r.name == "capstan"]
    assert len(warned) == 1 and "settings.queueing.worker_limit = 0 is not sent" in warned[0], warned


def test_a_controller_that_takes_no_settings_gets_none_and_its_flags_are_named(caplog):
    def configure(settings, **_):
        settings.persistence.finalizer = "example.com/finalizer"

    with caplog.at_level(logging.WARNING, logger="capstan"):
        order, sent = settings_around_startup(configure, capabilities=False)
    assert sent == [] and "result" in order
    assert sum("--finalizer example.com/finalizer" in r.getMessage() for r in caplog.records) == 1
