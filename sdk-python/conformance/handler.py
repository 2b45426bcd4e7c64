"""The Python SDK's conformance handler (tests/conformance/README.md, "The conformance handler").

Dials `$CAPSTAN_ENDPOINT`, registers the fixed handlers of the features named in
`$CAPSTAN_CONFORMANCE_FEATURES` (comma-separated; all the features this SDK supports when
unset), and serves them with `kopf.run()` until SIGTERM. Every resource handler runs the script
in its body's `spec.script`. It logs to standard error only.

Written with the SDK's kopf-compatible API (`capstan.kopf`), as a kopf operator would be.
"""

import asyncio
import logging
import os
import sys

# The SDK from this checkout (sdk-python/capstan), unless it is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import capstan  # noqa: E402
import capstan.kopf as kopf  # noqa: E402

log = logging.getLogger("conformance")

RESOURCE = ("conformance.capstan.dev", "v1", "widgets")

#: The features this SDK's conformance handler registers handlers for, and which.
FEATURE_HANDLERS = {
    "change": ("create", "update", "delete", "resume"),
    "field": ("field",),
    "event": ("event",),
    "daemon": ("daemon",),
    "timer": ("timer",),
    "index": ("index",),
    "admission": ("validate", "mutate"),
    "sdk_filters": ("when",),
    "activities": ("startup", "cleanup", "login"),
    "probe": ("probe",),
}
#: Features that register no handlers of their own (capabilities and transport).
OTHER_FEATURES = ("subhandlers", "object_updates", "result_ack", "cleanup_on_goodbye", "tcp", "flow_control", "message_limit",
                  "process_settings", "deferred_subhandlers")

CHANGE_KINDS = ("create", "update", "delete", "resume", "field")
ADMISSION_KINDS = ("validate", "mutate")
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


# --- the script -------------------------------------------------------------------------------

class Ended(Exception):
    """Raised by an action that ends the handler in success, with its result."""

    def __init__(self, result):
        super().__init__("ended")
        self.result = result


def _plain(value):
    """A JSON value from the SDK's views (Spec, Body, str enums) as plain Python data."""
    if isinstance(value, str):
        return str(value.value) if hasattr(value, "value") else value  # kopf's str enums: their value
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _merge(target, source):
    """Merges `source` into the dict `target`, deep for nested objects."""
    for key, value in source.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        elif isinstance(value, dict):
            target[key] = {}
            _merge(target[key], value)
        else:
            target[key] = value


def echo(kind, kw):
    """The echo of what the handler was given (the spec's table; `null` for what it was not)."""
    body = kw["body"]
    meta = body.get("metadata") or {}
    change = kind in CHANGE_KINDS
    admission = kind in ADMISSION_KINDS
    return {
        "name": meta.get("name"),
        "namespace": meta.get("namespace") or None,
        "uid": meta.get("uid"),
        "spec": _plain(kw["spec"]),
        "labels": _plain(meta.get("labels") or {}),
        "retry": kw["retry"],
        "param": _plain(kw["param"]),
        "reason": _plain(kw.get("reason")) if change else None,
        "old": _plain(kw.get("old")) if change else None,
        "new": _plain(kw.get("new")) if change else None,
        "diff": [[_plain(op), list(path), _plain(old), _plain(new)] for op, path, old, new in kw["diff"]]
                 if change else None,
        "event_type": kw.get("type") if kind == "event" else None,
        "operation": kw.get("operation") if admission else None,
        "dry_run": kw.get("dryrun") if admission else None,
        "subresource": kw.get("subresource") or None if admission else None,
    }


async def _hang(kind, kw):
    """Waits until cancelled. A daemon is asked to stop through `stopped` (kopf's way): it
    waits for that too, and then ends (a controller's cancel also cancels its task)."""
    stopped = kw.get("stopped") if kind == "daemon" else None
    if stopped is not None:
        await stopped.wait()
        raise Ended(None)
    await asyncio.get_running_loop().create_future()


async def _hang_ignoring_cancel(seconds):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + float(seconds)
    while True:
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            await asyncio.sleep(left)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):
                task.uncancel()
            log.info("cancel ignored: waiting %.2fs more", max(deadline - loop.time(), 0))
    raise Ended({"ignored_cancel": True})


def _subhandlers(kind, specs):
    for spec in specs:
        # Each sub-handler runs its own script (kopf's `register`: `@kopf.subhandler`).
        kopf.register(make_handler(kind, spec.get("script")), id=spec["id"])


async def run_action(kind, kw, name, arg):
    logger = kw["logger"]
    if name == "log":
        logger.log(LEVELS[arg.get("level", "info")], "%s", arg.get("message", ""))
    elif name == "event":
        kopf.event(kw["body"], type=arg.get("type", "Normal"), reason=arg.get("reason", ""),
                   message=arg.get("message", ""))
    elif name == "patch":
        patch = kw.get("patch")
        if patch is not None:  # validating and index handlers have no patch
            _merge(patch, arg)
    elif name == "return":
        raise Ended(arg)
    elif name == "echo":
        raise Ended(echo(kind, kw))
    elif name == "temporary":
        if arg.get("delay") is None:
            raise kopf.TemporaryError(arg.get("message", ""))
        raise kopf.TemporaryError(arg.get("message", ""), delay=float(arg["delay"]))
    elif name == "permanent":
        raise kopf.PermanentError(arg.get("message", ""))
    elif name == "crash":
        raise RuntimeError(arg.get("message", ""))
    elif name == "sleep":
        await asyncio.sleep(float(arg))  # a cancel raises CancelledError here: the SDK answers `cancelled`
    elif name == "hang":
        await _hang(kind, kw)
    elif name == "hang_ignoring_cancel":
        await _hang_ignoring_cancel(arg)
    elif name == "subhandlers":
        _subhandlers(kind, arg)
    elif name == "deny":
        if arg.get("code") is None:
            raise kopf.AdmissionError(arg.get("message", ""))
        raise kopf.AdmissionError(arg.get("message", ""), code=int(arg["code"]))
    elif name == "warn":
        warnings = kw.get("warnings")
        if warnings is not None:  # admission handlers only
            warnings.append(arg)
    elif name == "flow":
        capstan.set_max_in_flight(int(arg.get("max_in_flight", 0)), arg.get("handler") or None)
    else:
        raise RuntimeError(f"unknown script action {name!r}")


async def run_script(kind, script, kw):
    """Runs the actions in order; the result of the action that ended the handler, or None."""
    try:
        for action in script or ():
            if not isinstance(action, dict) or len(action) != 1:
                raise RuntimeError(f"a script action must be an object with one key, got {action!r}")
            (name, arg), = action.items()
            await run_action(kind, kw, name, arg)
    except Ended as ended:
        return ended.result
    return None


def make_handler(kind, script=None):
    """A handler of `kind` that runs `script` (a sub-handler's), or its body's `spec.script`."""

    async def handler(**kw):
        # Read once, at the start: a daemon's live body changes what `echo` sees, not the script.
        steps = script if script is not None else _plain((kw.get("spec") or {}).get("script"))
        return await run_script(kind, steps, kw)

    handler.__qualname__ = handler.__name__ = f"conformance_{kind}"
    return handler


# --- the activities and the probe -----------------------------------------------------------

async def startup(retry, logger, settings, **_):
    if retry == 0:
        raise kopf.TemporaryError("not yet", delay=0.25)
    # The kit's settings (feature `process_settings`): what a kopf operator's startup sets.
    settings.posting.level = logging.WARNING
    settings.persistence.finalizer = "conformance.capstan.dev/finalizer"
    logger.info("startup")


async def cleanup(logger, **_):
    logger.info("cleanup")


async def login(**_):
    return kopf.ConnectionInfo(server="https://conformance.invalid:6443", token="conformance-token",
                               default_namespace="conformance")


async def probe(**_):
    return {"probe": "ok"}


def allowed(spec, **_):
    """The `when` handler's SDK-side filter."""
    return spec.get("allowed") is True


# --- registration -----------------------------------------------------------------------------

def register(handler_id):
    on = kopf.on
    if handler_id == "create":
        on.create(*RESOURCE, id="create", param={"p": 1})(make_handler("create"))
    elif handler_id == "update":
        on.update(*RESOURCE, id="update", retries=3, backoff=2, timeout=30)(make_handler("update"))
    elif handler_id == "delete":
        on.delete(*RESOURCE, id="delete")(make_handler("delete"))
    elif handler_id == "resume":
        on.resume(*RESOURCE, id="resume")(make_handler("resume"))
    elif handler_id == "field":
        # kopf names it `<id>/<field>`: "field/spec.watched", the kit's id.
        on.field(*RESOURCE, id="field", field="spec.watched")(make_handler("field"))
    elif handler_id == "event":
        on.event(*RESOURCE, id="event")(make_handler("event"))
    elif handler_id == "daemon":
        kopf.daemon(*RESOURCE, id="daemon")(make_handler("daemon"))
    elif handler_id == "timer":
        kopf.timer(*RESOURCE, id="timer", interval=3600)(make_handler("timer"))
    elif handler_id == "index":
        kopf.index(*RESOURCE, id="index")(make_handler("index"))
    elif handler_id == "validate":
        on.validate(*RESOURCE, id="validate")(make_handler("validate"))
    elif handler_id == "mutate":
        on.mutate(*RESOURCE, id="mutate")(make_handler("mutate"))
    elif handler_id == "when":
        on.create(*RESOURCE, id="when", when=allowed)(make_handler("create"))
    elif handler_id == "startup":
        on.startup(id="startup")(startup)
    elif handler_id == "cleanup":
        on.cleanup(id="cleanup")(cleanup)
    elif handler_id == "login":
        on.login(id="login")(login)
    elif handler_id == "probe":
        on.probe(id="probe")(probe)
    else:
        raise AssertionError(handler_id)


def features():
    value = os.environ.get("CAPSTAN_CONFORMANCE_FEATURES")
    if value is None:
        return list(FEATURE_HANDLERS) + list(OTHER_FEATURES)
    names = [f.strip() for f in value.split(",") if f.strip()]
    for name in names:
        if name not in FEATURE_HANDLERS and name not in OTHER_FEATURES:
            log.warning("unknown feature %r: ignored", name)
    return names


def main():
    kopf.configure(verbose=bool(os.environ.get("CAPSTAN_CONFORMANCE_VERBOSE")))  # a stderr handler
    wanted = features()
    for feature, handler_ids in FEATURE_HANDLERS.items():
        if feature in wanted:
            for handler_id in handler_ids:
                register(handler_id)
    log.info("features %s: handlers %s", ",".join(wanted),
             ",".join(h.id for h in kopf.get_default_registry().handlers))
    kopf.run()


if __name__ == "__main__":
    main()
