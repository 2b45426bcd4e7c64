"""kopf's event helpers: `info`, `warn`, `exception` and `event` post a Kubernetes Event on
any object, through the controller (a LogRecord naming the object, always posted).

Inside a handler the Event belongs to the running invocation; outside one, to the process.
Without a connection to the controller the Event cannot be posted, and this is logged.
"""

import collections.abc
import logging

from capstan import invoke

log = logging.getLogger("capstan")

#: Posts Events for the process when no handler is running; set while a session is up.
_process_sink = None


def _set_process_sink(sink):
    global _process_sink
    _process_sink = sink


def reference(obj):
    """The object's identity as an Event needs it (group, version, kind, namespace, name,
    uid)."""
    meta = obj.get("metadata", {}) or {}
    api_version = obj.get("apiVersion", "") or ""
    group, _, version = api_version.rpartition("/")
    return {
        "group": group, "version": version, "kind": obj.get("kind", "") or "",
        "namespace": meta.get("namespace", "") or "", "name": meta.get("name", "") or "", "uid": meta.get("uid", "") or "",
    }


def event(objs, *, type, reason, message=""):
    """Posts an Event of `type` ("Normal", "Warning", "Error") on each object (kopf.event)."""
    targets = [objs] if isinstance(objs, collections.abc.Mapping) else list(objs)
    running = invoke._current.get()
    sink = getattr(running.call, "event_sink", None) if running is not None else None
    sink = sink or _process_sink
    for obj in targets:
        record = {"type": type, "reason": reason, "message": message, "object": reference(obj)}
        if sink is None:
            log.warning("not connected to the controller: the Event %s %r on %s was not posted",
                        type, reason, record["object"]["name"])
            continue
        sink(record)


def info(objs, *, reason, message=""):
    """Posts a Normal Event (kopf.info)."""
    event(objs, type="Normal", reason=reason, message=message)


def warn(objs, *, reason, message=""):
    """Posts a Warning Event (kopf.warn)."""
    event(objs, type="Warning", reason=reason, message=message)


def exception(objs, *, reason="", message="", exc=None):
    """Posts an Error Event describing an exception (kopf.exception)."""
    if exc is not None:
        message = f"{message} {type(exc).__name__}: {exc}".strip()
    event(objs, type="Error", reason=reason, message=message)
