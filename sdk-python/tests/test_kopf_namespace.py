"""`capstan.kopf` has every public name of real kopf (pinned in scripts/kopf-venv.sh): its
`kopf.__all__` and the rest of `dir(kopf)`, the decorators of `kopf.on`, and
`kopf.testing.KopfRunner`, so that a kopf operator file fails at import on no name. Real kopf
runs in its own venv ($CAPSTAN_KOPF_PYTHON, else the script's default location), asked for its
names in a subprocess: the two packages never share an interpreter."""

import importlib
import json
import os
import subprocess
import typing

import pytest

import capstan.kopf as kopf

_DEFAULT = os.path.expanduser("~/.cache/capstan/kopf-venv/bin/python")
KOPF_PYTHON = os.environ.get("CAPSTAN_KOPF_PYTHON") or (_DEFAULT if os.path.exists(_DEFAULT) else None)

_PROBE = """
import json, kopf
public = lambda m: sorted(n for n in dir(m) if not n.startswith('_'))
names = public(kopf)  # before the submodules below add themselves
import kopf.on, kopf.testing
print(json.dumps({'all': sorted(kopf.__all__), 'dir': names,
                  'on': sorted(n for n in public(kopf.on) if callable(getattr(kopf.on, n))
                               and getattr(getattr(kopf.on, n), '__module__', '') == 'kopf.on'),
                  'testing': sorted(kopf.testing.__all__)}))
"""


@pytest.fixture(scope="module")
def real():
    if KOPF_PYTHON is None:
        pytest.skip("real kopf is not installed: run `bash sdk-python/scripts/kopf-venv.sh` "
                    "(or set CAPSTAN_KOPF_PYTHON to a python with kopf==1.45.2)")
    out = subprocess.run([KOPF_PYTHON, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_name_of_kopfs_all_is_in_capstan_kopf(real):
    assert len(real["all"]) == 108
    missing = [n for n in real["all"] if not hasattr(kopf, n)]
    assert missing == [], f"capstan.kopf lacks {len(missing)} of kopf's {len(real['all'])} names"
    assert set(real["all"]) <= set(kopf.__all__)


def test_every_public_name_of_the_kopf_module_is_in_capstan_kopf(real):
    missing = [n for n in real["dir"] if not hasattr(kopf, n)]
    assert missing == []


def test_every_decorator_of_kopf_on_is_in_capstan_kopf_on(real):
    assert "create" in real["on"] and "subhandler" in real["on"]
    missing = [n for n in real["on"] if not hasattr(kopf.on, n)]
    assert missing == []


def test_kopf_testing_names_are_in_capstan_kopf_testing(real):
    testing = importlib.import_module("capstan.kopf.testing")
    assert [n for n in real["testing"] if not hasattr(testing, n)] == []


def test_type_names_are_real_types_of_what_handlers_receive():
    body = kopf.Body({"metadata": {"name": "x", "labels": {"a": "b"}}, "spec": {"f": 1}, "status": {}})
    assert isinstance(body.spec, kopf.Spec) and body.spec["f"] == 1
    assert isinstance(body.status, kopf.Status)
    assert isinstance(body.meta, kopf.Meta) and body.meta.name == "x"
    assert isinstance(body.meta.labels, typing.get_origin(kopf.Labels))
    assert isinstance(kopf.Patch(), dict)
    assert typing.get_args(kopf.Operation) == ("CREATE", "UPDATE", "DELETE", "CONNECT")
    assert kopf.HandlerId("x") == "x"
    import logging
    assert logging.LoggerAdapter in typing.get_args(kopf.Logger)


def test_a_signature_with_kopfs_type_names_registers():
    registry = kopf.OperatorRegistry()

    @kopf.on.create("examples", registry=registry)
    def create_fn(spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, logger: kopf.Logger,
                  labels: kopf.Labels, annotations: kopf.Annotations, body: kopf.Body, patch: kopf.Patch, **_):
        pass

    @kopf.on.validate("examples", registry=registry)
    def check_fn(userinfo: kopf.UserInfo, warnings: typing.List[str], **_):
        pass

    @kopf.on.event("examples", registry=registry)
    def event_fn(event: kopf.RawEvent, **_):
        pass

    assert [h.id for h in registry.handlers] == ["test_a_signature_with_kopfs_type_names_registers.<locals>.create_fn",
                                                 "test_a_signature_with_kopfs_type_names_registers.<locals>.check_fn",
                                                 "test_a_signature_with_kopfs_type_names_registers.<locals>.event_fn"]


def test_default_registry_can_be_replaced_as_in_kopf():
    before = kopf.get_default_registry()
    mine = kopf.OperatorRegistry()
    try:
        kopf.set_default_registry(mine)

        @kopf.on.create("examples")
        def fn(**_):
            pass

        assert [h.fn for h in mine.handlers] == [fn]
        assert fn not in [h.fn for h in before.handlers]
    finally:
        kopf.set_default_registry(before)


def test_filter_combinators_and_markers():
    assert kopf.not_(lambda **_: False)() is True
    assert kopf.EVERYTHING is not None
    assert issubclass(kopf.LoginError, Exception)


def test_configure_sets_logging_as_kopf_run_does():
    import logging
    kopf.configure(verbose=True, log_format=kopf.LogFormat.PLAIN)
    assert logging.getLogger().level == logging.DEBUG
    kopf.configure()
    assert logging.getLogger().level == logging.INFO
