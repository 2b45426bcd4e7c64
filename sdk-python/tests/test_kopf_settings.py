"""kopf's `OperatorSettings` under `capstan.kopf`: startup handlers get a `settings` object
with kopf's structure and defaults (compared with real kopf when its venv is there); what they
set is applied by this process (posting, the executor) or named once — the controller's flag
to set (WARNING) or no meaning with Capstan (INFO) — and never fails."""

import json
import logging
import os
import subprocess

import pytest

import capstan.kopf as kopf
from capstan import settings as settings_module
from capstan.registry import Registry
from capstan.testing import TestKit

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
    assert {place for place, _ in settings_module.PLACES.values()} == {"sdk", "flag", "none"}


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
    expected = [
        "--finalizer example.com/finalizer", "--progress-storage annotations --persistence-prefix example.com",
        "--diffbase-storage annotations --diffbase-key example.com/last", "--api-timeout 120s", "--standalone",
        "--priority 100", "--webhook-listen 0.0.0.0:8443 --webhook-cert-names op.example.com "
        "--webhook-url https://op.example.com:8443", "--webhook-managed example.com", "--worker-limit 50",
    ]
    for flags in expected:
        assert sum(flags in w for w in warned) == 1, (flags, warned)
    assert len(warned) == len(expected), warned
    assert len(said) == 1 and "settings.networking.trust_env" in said[0], said
    # Applied here: the posting level and the executor's size, never named.
    assert kit.settings.posting.level == logging.WARNING
    assert kit.settings.execution.executor._max_workers == 3
    assert not any("posting.level" in m or "max_workers" in m for m in warned + said)


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
    settings.watching.server_timeout = 10
    registry = Registry()
    kopf.on.create("examples", registry=registry)(lambda **_: None)
    with caplog.at_level(logging.WARNING, logger="capstan"):
        Operator(registry, endpoint="unix:///nonexistent", settings=settings)
    assert any("--api-timeout 10s" in r.getMessage() for r in caplog.records)
