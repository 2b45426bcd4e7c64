"""The handlers operator of the kopf examples' differential test (tests/tests/python_kopf_examples.rs),
on the lines of kopf's examples 05-handlers and 08-events: run once by real kopf (`kopf run`)
and once by Capstan (`python -m capstan run`, with CAPSTAN_DIFFERENTIAL=capstan selecting
`capstan.kopf`).

Resume, create and delete handlers, two of each, declared interleaved; each call is appended to
$DIFFERENTIAL_LOG as one JSON line (handler id, object name, the cause's reason, retry). The
event handlers append to $DIFFERENTIAL_SIDE_LOG what they saw (the watch event's type), the
first one raising after it has recorded."""

import json
import os

if os.environ.get("CAPSTAN_DIFFERENTIAL") == "capstan":
    import capstan.kopf as kopf
else:
    import kopf

RESOURCE = ("demo.capstan.dev", "v1", "examples")


def record(handler, name, reason, retry):
    with open(os.environ["DIFFERENTIAL_LOG"], "a") as log:
        log.write(json.dumps({"handler": handler, "name": name, "retry": retry,
                              "reason": str(getattr(reason, "value", reason))}, sort_keys=True) + "\n")


def side(handler, name, type):
    with open(os.environ["DIFFERENTIAL_SIDE_LOG"], "a") as log:
        log.write(json.dumps({"handler": handler, "name": name, "type": type}, sort_keys=True) + "\n")


@kopf.on.resume(*RESOURCE)
def resume_fn_1(name, reason, retry, **_):
    record("resume_fn_1", name, reason, retry)


@kopf.on.create(*RESOURCE)
def create_fn_1(name, reason, retry, **_):
    record("create_fn_1", name, reason, retry)


@kopf.on.resume(*RESOURCE)
def resume_fn_2(name, reason, retry, **_):
    record("resume_fn_2", name, reason, retry)


@kopf.on.create(*RESOURCE)
def create_fn_2(name, reason, retry, **_):
    record("create_fn_2", name, reason, retry)


@kopf.on.delete(*RESOURCE)
def delete_fn_1(name, reason, retry, **_):
    record("delete_fn_1", name, reason, retry)


@kopf.on.delete(*RESOURCE)
def delete_fn_2(name, reason, retry, **_):
    record("delete_fn_2", name, reason, retry)


@kopf.on.event(*RESOURCE)
def event_raising_fn(name, type, **_):
    # An event handler that fails: its error is logged and ignored, the next one still runs.
    side("event_raising_fn", name, type)
    raise ValueError(f"an event handler failing on {type} of {name}")


@kopf.on.event(*RESOURCE)
def event_fn(name, type, **_):
    side("event_fn", name, type)
