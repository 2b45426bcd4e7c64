"""Admission handlers (kopf's on.validate and on.mutate): registration options on the wire,
kwargs, denials with AdmissionError, warnings, and a mutating handler's patch."""

import pytest

import capstan
from capstan import wire
from capstan.registry import Registry
from capstan.testing import TestKit
from capstan.v1 import invocation_pb2 as inv
from capstan.v1 import registration_pb2 as reg


@pytest.fixture
def registry():
    r = Registry()

    @capstan.on.validate("examples", registry=r, id="no_big", operations=["CREATE", "UPDATE"], ignore_failures=True)
    def no_big(spec, operation, dryrun, userinfo, old, warnings, **_):
        if spec.get("size", 0) > 10:
            raise capstan.AdmissionError(f"size {spec['size']} is too big", code=422)
        if spec.get("size", 0) > 5:
            warnings.append("size is large")
        if spec.get("crash"):
            raise RuntimeError("the validator broke")
        return {"seen": [operation, dryrun, (userinfo or {}).get("username"), old]}

    @capstan.on.mutate("examples", registry=r, id="defaults", operation="CREATE", subresource=None)
    def defaults(spec, patch, **_):
        if "size" not in spec:
            patch.spec["size"] = 1

    return r


def test_admission_options_reach_the_registration(registry):
    v, m = (wire.registration(h) for h in registry.handlers)
    assert v.kind == reg.HANDLER_KIND_VALIDATE and m.kind == reg.HANDLER_KIND_MUTATE
    assert list(v.admission.operations) == [reg.OPERATION_CREATE, reg.OPERATION_UPDATE]
    assert v.admission.ignore_failures and not v.admission.side_effects
    assert list(m.admission.operations) == [reg.OPERATION_CREATE]


def test_validation_admits_warns_and_denies(registry):
    kit = TestKit(registry)
    request = {"operation": "UPDATE", "dryrun": True, "userinfo": {"username": "alice"}, "old": {"spec": {"size": 1}}}
    out = kit.invoke("no_big", {"spec": {"size": 2}}, admission=request)
    assert out.status == "success" and out.verdict == {"allowed": True, "warnings": []}
    out = kit.invoke("no_big", {"spec": {"size": 7}})
    assert out.verdict == {"allowed": True, "warnings": ["size is large"]}
    out = kit.invoke("no_big", {"spec": {"size": 70}})
    assert out.verdict["allowed"] is False and out.verdict["code"] == 422 and "too big" in out.verdict["message"]
    out = kit.invoke("no_big", {"spec": {"crash": True}})
    assert out.status == "unclassified", "a broken handler is a failure; the controller applies ignore_failures"


def test_a_mutating_handler_patches_the_object(registry):
    kit = TestKit(registry)
    out = kit.invoke("defaults", {"spec": {}})
    assert out.verdict["allowed"] and out.outcome.object_patch == {"spec": {"size": 1}}
    msg = wire.result("i", "defaults", out.outcome, 0.0)
    assert msg.success.admission.allowed and len(msg.patches) == 1


def test_bad_admission_options_fail_at_decoration():
    r = Registry()
    with pytest.raises(capstan.RegistrationError, match="operations="):
        capstan.on.validate("examples", registry=r, operations=["PATCH"])(lambda **_: None)
    with pytest.raises(capstan.RegistrationError, match="not both"):
        capstan.on.mutate("examples", registry=r, operation="CREATE", operations=["CREATE"])(lambda **_: None)
    with pytest.raises(capstan.RegistrationError, match="unknown option"):
        capstan.on.validate("examples", registry=r, retries=3)(lambda **_: None)


def test_the_requests_headers_are_given_and_sslpeer_is_empty():
    registry = Registry()
    seen = {}

    @capstan.on.validate("examples", registry=registry)
    def authhook(headers, sslpeer, warnings, **_):
        seen.update(headers=headers, sslpeer=sslpeer)
        warnings.append(f"Accessing as user-agent: {headers.get('User-Agent', '(unidentified)')}")

    handler = registry.handlers[0]
    msg = inv.Invocation(invocation_id="i", handler_id="authhook")
    msg.admission.operation = "CREATE"
    msg.admission.headers["User-Agent"] = "kube-apiserver-admission"
    call = wire.call_of(msg, handler)
    assert call.admission["headers"] == {"User-Agent": "kube-apiserver-admission"}

    out = TestKit(registry).invoke("authhook", {"metadata": {"name": "x"}}, admission=call.admission)
    assert seen == {"headers": {"User-Agent": "kube-apiserver-admission"}, "sslpeer": {}}
    assert out.verdict == {"allowed": True, "warnings": ["Accessing as user-agent: kube-apiserver-admission"]}
    TestKit(registry).invoke("authhook", {"metadata": {"name": "x"}})
    assert seen["headers"] == {}, "without a request's headers, an empty dict"
