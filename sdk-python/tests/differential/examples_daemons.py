"""The daemons and timers operator of the kopf examples' differential test
(tests/tests/python_kopf_daemons_timers.rs), on the lines of kopf's examples 14-daemons and
15-timers: run once by real kopf (`kopf run`) and once by Capstan (`python -m capstan run`, with
CAPSTAN_DIFFERENTIAL=capstan selecting `capstan.kopf`).

Every handler keeps to the objects of one scenario (its `when` filter names them) and appends
what it saw to $DIFFERENTIAL_LOG as one JSON line (handler id, object name, what happened)."""

import asyncio
import enum
import json
import os
import time

if os.environ.get("CAPSTAN_DIFFERENTIAL") == "capstan":
    import capstan.kopf as kopf
else:
    import kopf

RESOURCE = ("demo.capstan.dev", "v1", "examples")


def record(handler, name, **fields):
    with open(os.environ["DIFFERENTIAL_LOG"], "a") as log:
        log.write(json.dumps({"handler": handler, "name": name, "at": time.time(), **fields}, sort_keys=True) + "\n")


def reason_names(reason):
    """The names of the reasons a daemon is stopped for: kopf's `DaemonStoppingReason` is a
    flag that gathers reasons as the stopping goes on, capstan.kopf's is one reason."""
    if reason is None:
        return []
    if isinstance(reason, enum.Flag):
        return sorted(member.name for member in type(reason) if member.value and member in reason)
    return [reason.name]


# ---------------------------------------------------------------------------------------------
# Daemons (14-daemons).

@kopf.daemon(*RESOURCE, when=lambda name, **_: name == "retrying")
def retrying_daemon(name, retry, patch, **_):
    # A sync daemon failing temporarily twice, then returning: every attempt's patch is
    # applied, a failed one's too, and the result goes to the status as a handler's does.
    record("retrying_daemon", name, event="start", retry=retry)
    patch.status["attempts"] = {str(retry): "failed" if retry < 2 else "succeeded"}
    if retry < 2:
        raise kopf.TemporaryError(f"not ready at retry {retry}", delay=0.3)
    record("retrying_daemon", name, event="exit", retry=retry)
    return {"finished_at": retry}


@kopf.daemon(*RESOURCE, cancellation_timeout=1.0, when=lambda name, **_: name == "pinging")
async def pinging_daemon(name, stopped, **_):
    # An async daemon that never looks at `stopped`: it is cancelled when its object is deleted.
    record("pinging_daemon", name, event="start")
    stop = {}

    async def note_stop():
        await stopped.wait()
        stop["at"] = time.monotonic()

    noting = asyncio.create_task(note_stop())
    pings = 0
    try:
        while True:
            pings += 1
            if pings == 3:
                record("pinging_daemon", name, event="ping")
            await asyncio.sleep(0.1)
    except asyncio.CancelledError:
        since_stop = round(time.monotonic() - stop["at"], 2) if "at" in stop else None
        record("pinging_daemon", name, event="cancelled", reason=reason_names(stopped.reason),
               since_stop=since_stop)
        raise
    finally:
        noting.cancel()


@kopf.daemon(*RESOURCE, cancellation_timeout=1.0, when=lambda name, **_: name == "pinging")
def waiting_daemon(name, stopped, **_):
    # A sync daemon that waits on `stopped`: it returns once its object is deleted.
    record("waiting_daemon", name, event="start")
    while not stopped:
        stopped.wait(0.1)
    record("waiting_daemon", name, event="exit", reason=reason_names(stopped.reason))


# ---------------------------------------------------------------------------------------------
# Timers (15-timers).

@kopf.timer(*RESOURCE, interval=0.5, idle=1.5, when=lambda name, **_: name == "idling")
def idle_timer(name, **_):
    # Ticks only once the object has not changed for 1.5 s, then every 0.5 s.
    record("idle_timer", name, event="tick")


@kopf.timer(*RESOURCE, interval=0.3, when=lambda name, **_: name == "ticking")
def sync_timer(name, spec, **_):
    record("sync_timer", name, event="tick", field=spec.get("field"))
    return {"field": spec.get("field")}


@kopf.timer(*RESOURCE, interval=0.3, when=lambda name, **_: name == "ticking")
async def async_timer(name, body, **_):
    record("async_timer", name, event="tick", field=body["spec"].get("field"))
    return {"field": body["spec"].get("field")}


@kopf.on.event(*RESOURCE, when=lambda name, **_: name == "idling")
def idling_seen(name, type, **_):
    # Tells the test that the operator watches the object, before it starts changing it.
    record("idling_seen", name, event=str(type))
