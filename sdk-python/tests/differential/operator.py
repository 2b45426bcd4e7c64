"""One kopf operator file for the differential test (tests/tests/python_kopf_differential.rs):
run once by real kopf (`kopf run`) and once by Capstan (`python -m capstan run`, with
CAPSTAN_DIFFERENTIAL=capstan selecting `capstan.kopf`). Every call is appended to
$DIFFERENTIAL_LOG as one JSON line with the kwargs the handler saw, so that the two runs can be
compared call by call."""

import json
import os

if os.environ.get("CAPSTAN_DIFFERENTIAL") == "capstan":
    import capstan.kopf as kopf
else:
    import kopf

RESOURCE = ("demo.capstan.dev", "v1", "examples")


def record(handler, name, **seen):
    with open(os.environ["DIFFERENTIAL_LOG"], "a") as log:
        log.write(json.dumps({"handler": handler, "name": name, **seen}, sort_keys=True) + "\n")


@kopf.on.startup()
def configure(settings, **_):
    # An operator's own settings: under Capstan the controller applies them as if given as its
    # flags (its finalizer is then kopf's name no more, under either).
    settings.persistence.finalizer = "differential.capstan.dev/finalizer"
    settings.watching.server_timeout = 120
    settings.queueing.worker_limit = 16


@kopf.on.create(*RESOURCE)
def create_fn(name, spec, retry, patch, body, logger, **_):
    record("create_fn", name, retry=retry, field=spec.get("field"))
    # Events as kopf posts them: the explicit ones only (the logger's records and kopf's own
    # messages about the handling are not posted by default), each with its own type.
    logger.info(f"a log line about {name}, not posted")
    kopf.event(body, type="SomeType", reason="Custom", message=f"a type of its own for {name}")
    kopf.info(body, reason="Same", message="the same reason and message")
    kopf.warn(body, reason="Same", message="the same reason and message")
    try:
        raise ValueError(f"{name} failed " + "x" * 1500)
    except ValueError:
        kopf.exception(body, reason="Caught", message="while creating:")
    if retry < spec.get("fail_times", 0):
        raise kopf.TemporaryError(f"{name} is not ready yet", delay=1)
    patch.status["created"] = spec.get("field")
    return {"message": f"hello {name}"}


@kopf.on.update(*RESOURCE)
def update_fn(name, old, new, diff, retry, **_):
    record("update_fn", name, retry=retry, old=old.get("spec"), new=new.get("spec"),
           diff=[[op, list(field), o, n] for op, field, o, n in diff])
    return {"message": f"updated {name}"}


@kopf.on.field(*RESOURCE, field="spec.field")
def field_fn(name, old, new, reason, **_):
    record("field_fn", name, old=old, new=new, reason=str(getattr(reason, "value", reason)))


@kopf.on.update(*RESOURCE, field="spec.field", id="update_field_fn")
def update_field_fn(name, old, new, diff, retry, **_):
    record("update_field_fn", name, retry=retry, old=old, new=new,
           diff=[[op, list(field), o, n] for op, field, o, n in diff])


@kopf.on.create(*RESOURCE, id="parent_fn", when=lambda name, **_: name == "subs")
def parent_fn(name, retry, **_):
    # kopf's default lifecycle runs one sub-handler per call of the parent: the parent is
    # called again (its retry counted) for the second.
    record("parent_fn", name, retry=retry)
    for item in ("a", "b"):
        @kopf.subhandler(id=f"sub_{item}")
        def sub_fn(retry, item=item, **_):
            record(f"sub_{item}", name, retry=retry)


@kopf.on.delete(*RESOURCE)
def delete_fn(name, retry, **_):
    record("delete_fn", name, retry=retry)


# Daemons, timers and event handlers run beside the change handlers, so their calls go to a
# second log ($DIFFERENTIAL_SIDE_LOG), compared as sets: what each saw, not when.
_ticked = set()


def side(handler, name, **seen):
    with open(os.environ["DIFFERENTIAL_SIDE_LOG"], "a") as log:
        log.write(json.dumps({"handler": handler, "name": name, **seen}, sort_keys=True) + "\n")


@kopf.daemon(*RESOURCE)
def daemon_fn(name, spec, stopped, **_):
    side("daemon_fn", name, event="start", field=spec.get("field"))
    while not stopped:
        stopped.wait(0.2)
    side("daemon_fn", name, event="stop", reason=stopped.reason.name)


@kopf.timer(*RESOURCE, interval=0.5)
def timer_fn(name, **_):
    if name not in _ticked:
        _ticked.add(name)
        side("timer_fn", name, event="tick")


@kopf.on.event(*RESOURCE)
def event_fn(name, type, body, event, **_):
    # The raw event as the API server sent it: with the object's managedFields.
    managed = bool(event.get("object", {}).get("metadata", {}).get("managedFields"))
    side("event_fn", name, type=type, field=body.get("spec", {}).get("field"), managed=managed)
