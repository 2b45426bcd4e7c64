"""kopf's event helpers: `info`, `warn`, `exception` and `event` post a Kubernetes Event on
any object, through the controller (a LogRecord naming the object, always posted), as
`settings.posting` says (kopf 1.45's rules, `capstan.settings.posts_event`). These are the
only Events the handler process asks for: its handlers' log records are not posted unless
`settings.posting.loggers` is set.

Inside a handler the Event belongs to the running invocation; outside one, to the process.
Without a connection to the controller the Event cannot be posted, and this is logged.
"""

import collections.abc
import logging
import sys

from capstan import invoke
from capstan import settings as settings_module

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


def _post(kind, objs, *, type, reason, message):
    running = invoke._current.get()
    settings = getattr(running.call, "settings", None) if running is not None else None
    if not settings_module.posts_event(settings if settings is not None else settings_module.active(), kind):
        return
    targets = [objs] if isinstance(objs, collections.abc.Mapping) else list(objs)
    sink = getattr(running.call, "event_sink", None) if running is not None else None
    sink = sink or _process_sink
    for obj in targets:
        record = {"type": type, "reason": reason, "message": message, "object": reference(obj)}
        if sink is None:
            log.warning("not connected to the controller: the Event %s %r on %s was not posted",
                        type, reason, record["object"]["name"])
            continue
        sink(record)


def event(objs, *, type, reason, message="", backoffs=None):
    """Posts an Event of `type` on each object (kopf.event); `backoffs` are the controller's
    (it retries Events itself)."""
    _post("event", objs, type=type, reason=reason, message=message)


def info(objs, *, reason, message="", backoffs=None):
    """Posts a Normal Event (kopf.info)."""
    _post("info", objs, type="Normal", reason=reason, message=message)


def warn(objs, *, reason, message="", backoffs=None):
    """Posts a Warning Event (kopf.warn)."""
    _post("warn", objs, type="Warning", reason=reason, message=message)


def exception(objs, *, reason="", message="", exc=None, backoffs=None):
    """Posts an Error Event describing an exception (kopf.exception): by default the one being
    handled, its type as the reason, `message` followed by its text."""
    if exc is None:
        _, exc, _ = sys.exc_info()
    reason = reason if reason else type(exc).__name__
    message = f"{message} {exc}" if message and exc else f"{exc}" if exc else f"{message}"
    _post("exception", objs, type="Error", reason=reason, message=message)
