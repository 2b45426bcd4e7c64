"""kopf's helpers behave as kopf's: the ownership helpers take the object being handled when
no owner is given, `AdmissionError` without a code answers 500, a `Store` shows as a list."""

import pytest

import capstan.kopf as kopf
from capstan.indexes import Store
from capstan.registry import Registry
from capstan.testing import TestKit

PARENT = {"apiVersion": "kopf.dev/v1", "kind": "KopfExample",
          "metadata": {"name": "parent", "namespace": "ns1", "uid": "u-1", "labels": {"app": "demo"}}}


def test_adopt_and_label_without_an_owner_take_the_object_being_handled():
    registry = Registry()
    made = {}

    @kopf.on.create("kopfexamples", registry=registry)
    def create_fn(**_):
        child = {"metadata": {}, "spec": {"template": {}}}
        kopf.adopt(child)
        other = {}
        kopf.label(other, nested="spec.template")
        kopf.harmonize_naming(other, strict=True)
        kopf.adjust_namespace(other)
        kopf.append_owner_reference(other)
        made.update(child=child, other=other)

    out = TestKit(registry).invoke("create_fn", PARENT)
    assert out.status == "success", out.message
    child = made["child"]["metadata"]
    assert child["generateName"] == "parent-" and child["namespace"] == "ns1"
    assert child["labels"] == {"app": "demo"}
    assert child["ownerReferences"] == [{"apiVersion": "kopf.dev/v1", "kind": "KopfExample", "name": "parent",
                                        "uid": "u-1", "controller": True, "blockOwnerDeletion": True}]
    other = made["other"]
    assert other["metadata"]["labels"] == {"app": "demo"} and other["spec"]["template"]["metadata"]["labels"] == {"app": "demo"}
    assert other["metadata"]["name"] == "parent" and other["metadata"]["namespace"] == "ns1"
    assert other["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_adopt_outside_a_handler_needs_an_owner():
    with pytest.raises(LookupError, match="Owner must be set explicitly"):
        kopf.adopt({})
    child = {}
    kopf.adopt(child, PARENT)
    assert child["metadata"]["ownerReferences"][0]["name"] == "parent"


def test_admission_error_without_a_code_answers_500_as_kopf():
    registry = Registry()

    @kopf.on.validate("kopfexamples", registry=registry)
    def check_fn(**_):
        raise kopf.AdmissionError("no")

    assert kopf.AdmissionError().code == 500
    assert issubclass(kopf.AdmissionError, kopf.PermanentError)
    out = TestKit(registry).invoke("check_fn", PARENT)
    assert out.verdict["allowed"] is False and out.verdict["code"] == 500 and out.verdict["message"] == "no"


def test_store_shows_as_a_list_as_kopfs():
    assert repr(Store(["a", {"b": 1}])) == "['a', {'b': 1}]"


@pytest.mark.parametrize("error,errors,expected", [
    (kopf.TemporaryError("later"), None, "Handler 'fn' failed temporarily: later"),
    (kopf.PermanentError("never"), None, "Handler 'fn' failed permanently: never"),
    (ValueError("oops"), None, "Handler 'fn' failed with an exception and will try again in 60 seconds: ValueError: oops"),
    (ValueError("oops"), kopf.ErrorsMode.IGNORED, "Handler 'fn' failed with an exception and will ignore it: ValueError: oops"),
    (ValueError("oops"), kopf.ErrorsMode.PERMANENT, "Handler 'fn' failed with an exception and will stop now: ValueError: oops"),
])
def test_failures_are_logged_in_kopfs_words(error, errors, expected):
    registry = Registry()

    @kopf.on.create("kopfexamples", registry=registry, id="fn", errors=errors)
    def fn(**_):
        raise error

    out = TestKit(registry).invoke("fn", PARENT)
    assert ("error", expected) in out.logs


def test_an_event_handlers_failure_is_ignored_in_kopfs_words():
    registry = Registry()

    @kopf.on.event("kopfexamples", registry=registry, id="fn")
    def fn(**_):
        raise ValueError("oops")

    out = TestKit(registry).invoke("fn", PARENT, event_type="ADDED")
    assert ("error", "Handler 'fn' failed with an exception and will ignore it: ValueError: oops") in out.logs


def test_everything_fails_saying_why():
    with pytest.raises(kopf.RegistrationError, match="kopf.EVERYTHING is not supported"):
        kopf.on.event(kopf.EVERYTHING, registry=Registry())(lambda **_: None)
