"""The errors operator of the kopf examples' differential test (tests/tests/python_kopf_examples.rs),
on the lines of kopf's example 03-exceptions: run once by real kopf (`kopf run`) and once by
Capstan (`python -m capstan run`, with CAPSTAN_DIFFERENTIAL=capstan selecting `capstan.kopf`).

Every create handler fails in its own way; each call is appended to $DIFFERENTIAL_LOG as one
JSON line with the handler's id, the object's name and the `retry` it was called with, so that
the two runs can be compared handler by handler."""

import json
import os

if os.environ.get("CAPSTAN_DIFFERENTIAL") == "capstan":
    import capstan.kopf as kopf
else:
    import kopf

RESOURCE = ("demo.capstan.dev", "v1", "examples")


def record(handler, name, retry):
    with open(os.environ["DIFFERENTIAL_LOG"], "a") as log:
        log.write(json.dumps({"handler": handler, "name": name, "retry": retry}, sort_keys=True) + "\n")


class MyError(Exception):
    pass


@kopf.on.create(*RESOURCE)
def permanent_fn(name, retry, **_):
    # A permanent error: the handler has failed for good, it is never retried.
    record("permanent_fn", name, retry)
    raise kopf.PermanentError("fails once and for all")


@kopf.on.create(*RESOURCE)
def temporary_fn(name, retry, **_):
    # A temporary error with its own delay: retried until it succeeds, on the third attempt.
    record("temporary_fn", name, retry)
    if retry < 2:
        raise kopf.TemporaryError(f"not ready at retry {retry}", delay=0.3)
    return {"succeeded_at": retry}


@kopf.on.create(*RESOURCE, retries=3, backoff=0.3)
def retries_fn(name, retry, **_):
    # An arbitrary exception is temporary by default: retried after the backoff until the
    # retries are used up, then the handler has failed.
    record("retries_fn", name, retry)
    raise MyError("an error that is supposed to be recoverable")


@kopf.on.create(*RESOURCE, errors=kopf.ErrorsMode.PERMANENT, backoff=0.3)
def errors_permanent_fn(name, retry, **_):
    # An arbitrary exception under errors=PERMANENT: failed at once, never retried.
    record("errors_permanent_fn", name, retry)
    raise MyError("an error that is not retried in this mode")


@kopf.on.create(*RESOURCE, errors=kopf.ErrorsMode.IGNORED, backoff=0.3)
def errors_ignored_fn(name, retry, **_):
    # An arbitrary exception under errors=IGNORED: as if the handler had succeeded.
    record("errors_ignored_fn", name, retry)
    raise MyError("an error that is ignored in this mode")
