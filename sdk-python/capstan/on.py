"""kopf's decorators: `capstan.on.create(...)`, `capstan.on.field(...)`, `capstan.daemon(...)`,
`capstan.timer(...)`, and the activity handlers. Each returns the function unchanged, so
that handlers remain plain functions for tests.

Unknown options are not lost in `**kwargs`: they fail at decoration with the handler's name.
Options that belong to the controller (for example `persistent=` of admission handlers) fail
at decoration too, saying which flag does their job.
"""

from capstan.errors import RegistrationError
from capstan.invoke import register, subhandler  # noqa: F401 (kopf.on.register, kopf.on.subhandler)
from capstan.registry import _qualname, get_default_registry, parse_resource

# `max_in_flight` is Capstan's own: at most this many calls of the handler at once.
_COMMON = ("id", "errors", "retries", "backoff", "timeout", "param", "max_in_flight")
_FILTERS = ("labels", "annotations", "when", "field", "value")


def _decorator(kind, resource_args, options, *, allowed, kind_options=()):
    registry = options.pop("registry", None) or get_default_registry()
    selector = {k: options.pop(k, None) for k in ("group", "version", "kind", "plural")}

    def decorate(fn):
        name = options.get("id") or _qualname(fn)
        unknown = sorted(set(options) - set(allowed) - set(kind_options))
        if unknown:
            raise RegistrationError(
                f"handler {name!r}: unknown option(s) {', '.join(unknown)} for capstan.{_title(kind)} "
                f"(known: {', '.join(sorted(set(allowed) | set(kind_options) | set(selector)))})"
            )
        resource = None
        if kind not in ("startup", "cleanup", "login", "probe"):
            resource = parse_resource(name, resource_args, **selector)
        elif resource_args or any(v is not None for v in selector.values()):
            raise RegistrationError(f"handler {name!r}: {kind} handlers take no resource")
        plain = {k: v for k, v in options.items() if k not in kind_options}
        extra = {k: v for k, v in options.items() if k in kind_options and v is not None}
        registry.register(kind, fn, resource=resource, options=extra, **plain)
        return fn

    return decorate


def _title(kind):
    return kind if kind in ("daemon", "timer") else f"on.{kind}"


def resume(*resource, **options):
    """kopf's on.resume: objects that existed when the operator started (`deleted=True` also
    resumes objects being deleted)."""
    return _decorator("resume", resource, options, allowed=_COMMON + _FILTERS + ("deleted",))


def create(*resource, **options):
    """kopf's on.create: an object seen for the first time."""
    return _decorator("create", resource, options, allowed=_COMMON + _FILTERS)


def update(*resource, **options):
    """kopf's on.update: the object's essence changed (`old=`/`new=` filter the field)."""
    return _decorator("update", resource, options, allowed=_COMMON + _FILTERS + ("old", "new"))


def delete(*resource, **options):
    """kopf's on.delete: the object is marked for deletion (`optional=True` never blocks it)."""
    return _decorator("delete", resource, options, allowed=_COMMON + _FILTERS + ("optional",))


def field(*resource, **options):
    """kopf's on.field: one field's value changed, for any cause."""
    return _decorator("field", resource, options, allowed=_COMMON + _FILTERS + ("old", "new"))


def event(*resource, **options):
    """kopf's on.event: every watch event; not persisted, not retried by default."""
    return _decorator("event", resource, options, allowed=_COMMON + _FILTERS)


def startup(**options):
    """kopf's on.startup: once before the controller watches."""
    return _decorator("startup", (), options, allowed=_COMMON)


def cleanup(**options):
    """kopf's on.cleanup: once when the controller stops."""
    return _decorator("cleanup", (), options, allowed=_COMMON)


def login(**options):
    """kopf's on.login: returns a `ConnectionInfo` for the controller's API access."""
    return _decorator("login", (), options, allowed=_COMMON)


def probe(**options):
    """kopf's on.probe: a value shown by the controller's liveness endpoint."""
    return _decorator("probe", (), options, allowed=_COMMON)


_ADMISSION_OPTIONS = ("operation", "operations", "subresource", "side_effects", "ignore_failures")
_OPERATIONS = ("CREATE", "UPDATE", "DELETE", "CONNECT")


def _admission(kind, resource, options):
    if options.get("persistent"):
        options.pop("persistent")
        return _reject(options, "persistent= is the controller's: run it with --webhook-keep-on-exit "
                       "to keep the webhook configurations after it exits")
    options.pop("persistent", None)
    operations = options.get("operations")
    if options.get("operation") is not None:
        if operations is not None:
            return _reject(options, "give operation= or operations=, not both")
        operations = [options.pop("operation")]
    else:
        options.pop("operation", None)
    if operations is not None:
        if isinstance(operations, str) or not all(op in _OPERATIONS for op in operations):
            return _reject(options, f"operations= must be a list of {', '.join(_OPERATIONS)}, got {operations!r}")
        options["operations"] = list(operations)
    return _decorator(kind, resource, options, allowed=("id", "param", "max_in_flight") + _FILTERS,
                      kind_options=_ADMISSION_OPTIONS)


def validate(*resource, **options):
    """kopf's on.validate: answers the admission requests for the resource that the
    controller's webhook server receives; raise `AdmissionError` to deny, append to
    `warnings` to warn. Options: `operations` (or kopf's `operation`), `subresource`,
    `side_effects`, `ignore_failures` (admit when the handler cannot answer)."""
    return _admission("validate", resource, options)


def mutate(*resource, **options):
    """kopf's on.mutate: as `validate`, and the handler's `patch` changes the object under
    review (the changes of all mutating handlers are folded into one JSONPatch)."""
    return _admission("mutate", resource, options)


def index(*resource, **options):
    """kopf's index: called for every object of the resource (and on every change); its
    results form an index that every handler of this process reads by the index's name as a
    kwarg. No other handler runs before every index is built."""
    return _decorator("index", resource, options, allowed=_COMMON + _FILTERS)

_DAEMON_OPTIONS = ("initial_delay", "cancellation_backoff", "cancellation_timeout",
                   "cancellation_polling", "requires_finalizer")


def daemon(*resource, **options):
    """kopf's daemon: one long-running call per object for as long as it exists and
    matches; it gets `stopped` (check it, or `wait()` on it) and sees the live body."""
    polling = options.get("cancellation_polling")
    if polling is not None:
        options.pop("cancellation_polling")
        return _reject(options, "cancellation_polling= is not supported: a sync daemon is never killed, it must "
                       "return once `stopped` is set (check it or call stopped.wait())")
    if options.get("requires_finalizer"):
        options.pop("requires_finalizer")
        return _reject(options, "requires_finalizer= is not supported: the controller stops daemons of deleted objects itself")
    options.pop("requires_finalizer", None)
    return _decorator("daemon", resource, options, allowed=_COMMON + _FILTERS, kind_options=_DAEMON_OPTIONS)


def timer(*resource, **options):
    """kopf's timer: a call every `interval` seconds per object (`initial_delay`, `idle`,
    `sharp`)."""
    if options.get("interval") is None:
        return _reject(options, "capstan.timer needs interval=")
    if options.get("requires_finalizer"):
        options.pop("requires_finalizer")
        return _reject(options, "requires_finalizer= is not supported: the controller stops timers of deleted objects itself")
    options.pop("requires_finalizer", None)
    return _decorator("timer", resource, options, allowed=_COMMON + _FILTERS,
                      kind_options=("interval", "initial_delay", "idle", "sharp"))


def _reject(options, message):
    def decorate(fn):
        raise RegistrationError(f"handler {options.get('id') or _qualname(fn)!r}: {message}")

    return decorate
