"""Handler registration with kopf's decorators and arguments, checked at decoration time.

Every decorator validates its arguments and the handler's signature at once and raises
`RegistrationError` naming the handler for anything unknown or unsupported, so that a mistake
stops the operator when it starts instead of being ignored. The registry turns each handler
into the `HandlerRegistration` that `Hello` carries.
"""

import asyncio
import dataclasses
import functools
import datetime
import inspect
import json
import re
from typing import Any, Callable, Dict, List, Optional

from capstan.errors import ErrorsMode, RegistrationError
from capstan.structs import ABSENT, PRESENT

#: Kinds the SDK registers with the controller (kopf's names).
CHANGE_KINDS = ("create", "update", "delete", "resume", "field")
RESOURCE_KINDS = CHANGE_KINDS + ("event", "daemon", "timer", "index")
ACTIVITY_KINDS = ("startup", "cleanup", "login", "probe")
#: Admission kinds: answered while the API server waits (kopf's on.validate, on.mutate).
ADMISSION_KINDS = ("validate", "mutate")

_RESOURCE_KWARGS = {
    "body", "spec", "meta", "status", "name", "namespace", "uid", "labels", "annotations",
    "patch", "logger", "resource", "memo", "param", "retry", "started", "runtime",
}
# `settings`: kopf's OperatorSettings, for startup handlers to configure the operator (capstan.settings).
_ACTIVITY_KWARGS = {"logger", "memo", "param", "retry", "started", "runtime", "settings"}
KWARGS = {
    "create": _RESOURCE_KWARGS | {"reason", "diff", "old", "new"},
    "update": _RESOURCE_KWARGS | {"reason", "diff", "old", "new"},
    "delete": _RESOURCE_KWARGS | {"reason", "diff", "old", "new"},
    "resume": _RESOURCE_KWARGS | {"reason", "diff", "old", "new"},
    "field": _RESOURCE_KWARGS | {"reason", "diff", "old", "new", "value"},
    "event": _RESOURCE_KWARGS | {"event", "type"},
    "daemon": _RESOURCE_KWARGS | {"stopped"},
    "timer": _RESOURCE_KWARGS,
    # Index handlers change nothing: what they return is the index.
    "index": _RESOURCE_KWARGS - {"patch"},
    # Admission: the request's parts; only mutating handlers change the object.
    # `sslpeer` is empty: the controller's webhook server passes on the headers only.
    "validate": (_RESOURCE_KWARGS - {"patch"}) | {"warnings", "userinfo", "dryrun", "subresource", "operation", "old", "new",
                                               "headers", "sslpeer"},
    "mutate": _RESOURCE_KWARGS | {"warnings", "userinfo", "dryrun", "subresource", "operation", "old", "new",
                                  "headers", "sslpeer"},
    "startup": _ACTIVITY_KWARGS,
    "cleanup": _ACTIVITY_KWARGS,
    "login": _ACTIVITY_KWARGS,
    "probe": _ACTIVITY_KWARGS,
}
#: kopf kwargs that need parts of kopf this controller does not have, and what to do instead.
_UNSUPPORTED_KWARGS = {
    "indices": "read an index by its name as a kwarg (kopf's way), e.g. def fn(by_label, **_)",
    "indexes": "read an index by its name as a kwarg (kopf's way), e.g. def fn(by_label, **_)",
    "vault": "credentials vaults belong to the controller",
}

_VERSION = re.compile(r"^v\d+(?:(?:alpha|beta)\d+)?$")


@dataclasses.dataclass(frozen=True)
class Resource:
    """A resource as kopf's decorators accept it: group, version and any name the controller
    resolves through discovery (plural, kind, singular, short name, category, or
    `name.group`)."""

    group: str = ""
    version: str = ""
    name: str = ""

    def __str__(self):
        parts = [p for p in (self.name, self.version, self.group) if p]
        return ".".join(parts)

    @property
    def plural(self):
        """The name (the plural, in the `resource` kwarg of an invocation)."""
        return self.name

    @property
    def api_version(self):
        """`group/version`, or `version` for the core group."""
        return f"{self.group}/{self.version}" if self.group else self.version


def parse_resource(fn_name, args, group=None, version=None, kind=None, plural=None):
    """kopf's ways to name a resource: `('kopf.dev', 'v1', 'kopfexamples')` (`('', 'v1',
    'pods')` for the core API), a tuple of
    those, `('apps/v1', 'deployments')`, `('v1', 'pods')`, `('kopf.dev', 'kopfexamples')`,
    `'kopfexamples.kopf.dev'`, `'KopfExample'`, or keywords."""
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])
    for position, arg in enumerate(args):
        if getattr(arg, "name", None) == "EVERYTHING":
            raise RegistrationError(f"handler {fn_name!r}: kopf.EVERYTHING is not supported: the controller serves "
                                    "named resources (name each one, e.g. ('apps', 'v1', 'deployments'))")
        # The core API's group is the empty string: ('', 'v1', 'pods').
        core_group = len(args) == 3 and position == 0 and arg == ""
        if not isinstance(arg, str) or not (arg or core_group):
            raise RegistrationError(f"handler {fn_name!r}: a resource is named by non-empty strings, got {arg!r}")
    name = plural or kind
    if plural and kind:
        raise RegistrationError(f"handler {fn_name!r}: give either kind= or plural=, not both")
    if len(args) == 3:
        g, v, n = args
    elif len(args) == 2:
        first, n = args
        if "/" in first:
            g, v = first.split("/", 1)
        elif _VERSION.match(first):
            g, v = "", first
        else:
            g, v = first, ""
    elif len(args) == 1:
        g, v, n = "", "", args[0]
    elif not args:
        g, v, n = "", "", None
    else:
        raise RegistrationError(f"handler {fn_name!r}: too many resource arguments {args!r}")
    if n is not None and name is not None:
        raise RegistrationError(f"handler {fn_name!r}: the resource is named twice ({n!r} and {name!r})")
    n = n if n is not None else name
    if group is not None:
        g = group
    if version is not None:
        v = version
    if not n:
        raise RegistrationError(f"handler {fn_name!r}: no resource given (e.g. 'kopfexamples.kopf.dev')")
    return Resource(group=g or "", version=v or "", name=n)


@dataclasses.dataclass
class Handler:
    """One registered handler with its options, as kopf keeps it."""

    fn: Callable
    kind: str
    id: str
    resource: Optional[Resource] = None
    errors: Optional[ErrorsMode] = None
    retries: Optional[int] = None
    backoff: Optional[float] = None
    timeout: Optional[float] = None
    param: Any = None
    max_in_flight: Optional[int] = None
    labels: Optional[Dict[str, Any]] = None
    annotations: Optional[Dict[str, Any]] = None
    field: Optional[str] = None
    value: Any = None
    old: Any = None
    new: Any = None
    when: Optional[Callable] = None
    optional: bool = False
    deleted: bool = False
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    is_async: bool = False
    takes: Optional[frozenset] = None  # None: the handler takes **kwargs
    # Kwargs the handler names that are no kwarg of its kind: they must be index names, which
    # are known only once every handler is registered (`Registry.check`).
    wants: frozenset = frozenset()

    @functools.cached_property
    def sdk_filters(self):
        """Filters that only the SDK can evaluate: `when=` and callable conditions."""
        checks = []
        if self.when is not None:
            checks.append(("when", self.when))
        for what, conditions in (("labels", self.labels), ("annotations", self.annotations)):
            for key, cond in (conditions or {}).items():
                if callable(cond):
                    checks.append((f"{what}[{key!r}]", (what, key, cond)))
        for what in ("value", "old", "new"):
            cond = getattr(self, what)
            if callable(cond):
                checks.append((what, (what, None, cond)))
        return checks


def _seconds(fn_name, option, value):
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise RegistrationError(f"handler {fn_name!r}: {option}= must be a non-negative number of seconds, got {value!r}")
    return float(value)


def _check_json(fn_name, option, value):
    if value is None or callable(value) or value in (PRESENT, ABSENT):
        return
    try:
        json.dumps(value)
    except (TypeError, ValueError) as error:
        raise RegistrationError(f"handler {fn_name!r}: {option}= is not JSON-serialisable: {error}") from None


def _signature(fn, kind, handler_id):
    """The kwargs the handler accepts (None for **kwargs), and those it needs that are no kwarg
    of its kind (they must be index names: `Registry.check`)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, frozenset()
    takes, wants = set(), set()
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            # **kwargs takes everything; the names before it must still be given.
            return None, frozenset(wants)
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        if p.kind is inspect.Parameter.POSITIONAL_ONLY:
            if p.default is inspect.Parameter.empty:
                raise RegistrationError(f"handler {handler_id!r}: takes the positional-only parameter {p.name!r}; handlers get keyword arguments only")
            continue
        if p.name in _UNSUPPORTED_KWARGS:
            raise RegistrationError(f"handler {handler_id!r}: kwarg {p.name!r} is not supported: {_UNSUPPORTED_KWARGS[p.name]}")
        takes.add(p.name)
        if p.name not in KWARGS[kind] and p.default is inspect.Parameter.empty:
            wants.add(p.name)
    return frozenset(takes), frozenset(wants)


def _reloaded(old, new):
    """Whether `new` is `old`'s code loaded again: another function object from the same
    place of the same file."""
    if old is new:
        return False
    a, b = getattr(old, "__code__", None), getattr(new, "__code__", None)
    return (a is not None and b is not None and a.co_filename == b.co_filename
            and a.co_firstlineno == b.co_firstlineno and _qualname(old) == _qualname(new))


def _qualname(fn):
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


class Registry:
    """The handlers of one operator (kopf's OperatorRegistry)."""

    def __init__(self):
        self.handlers: List[Handler] = []

    def register(self, kind, fn, *, id=None, resource=None, errors=None, retries=None, backoff=None,
                 timeout=None, param=None, labels=None, annotations=None, field=None, value=None,
                 old=None, new=None, when=None, optional=None, deleted=None, options=None, max_in_flight=None):
        handler = build_handler(kind, fn, id=id, resource=resource, errors=errors, retries=retries,
                                backoff=backoff, timeout=timeout, param=param, labels=labels,
                                annotations=annotations, field=field, value=value, old=old, new=new,
                                when=when, optional=optional, deleted=deleted, options=options,
                                max_in_flight=max_in_flight)
        base = handler.id
        while True:
            other = next((o for o in self.handlers if o.id == handler.id
                          and (o.kind != handler.kind or o.resource == handler.resource)), None)
            if other is None:
                break
            if other.kind == handler.kind and other.resource == handler.resource and _reloaded(other.fn, handler.fn):
                # The same code loaded again (a file run once more, as a test runner does):
                # the new function replaces the old one.
                self.handlers[self.handlers.index(other)] = handler
                return handler
            if other.fn is handler.fn and other.kind != handler.kind and handler.id == base:
                # One function under stacked decorators (kopf's `@on.resume` over `@on.create`):
                # kopf gives both the same id; the controller takes one id per kind, so this
                # registration is `<id>.<kind>`.
                handler.id = f"{base}.{handler.kind}"
                continue
            raise RegistrationError(f"handler {handler.id!r} is registered twice for {handler.resource or 'the operator'}; give one of them another id=")
        self.handlers.append(handler)
        return handler

    def index_names(self):
        """The ids of the index handlers: the kwargs that give handlers their indexes."""
        return [h.id for h in self.handlers if h.kind == "index"]

    def check(self):
        """Checks what only the whole registry can tell: every kwarg a handler names that is
        no kwarg of its kind must be an index's name. Raises `RegistrationError`."""
        indexes = set(self.index_names())
        for h in self.handlers:
            unknown = sorted(h.wants - indexes)
            if unknown:
                known = sorted(KWARGS[h.kind] | indexes)
                what = "kwarg" if len(unknown) == 1 else "kwargs"
                raise RegistrationError(
                    f"handler {h.id!r}: unknown {what} {', '.join(map(repr, unknown))} for {h.kind} handlers "
                    f"(known: {', '.join(known)}; indexes are kwargs by their names)"
                )


def build_handler(kind, fn, *, id=None, resource=None, errors=None, retries=None, backoff=None,
                  timeout=None, param=None, labels=None, annotations=None, field=None, value=None,
                  old=None, new=None, when=None, optional=None, deleted=None, options=None, max_in_flight=None):
    """Checks one handler's options and signature and returns its `Handler`."""
    if not callable(fn):
        raise RegistrationError(f"a {kind} handler must be callable, got {fn!r}")
    if id is not None and (not isinstance(id, str) or not id):
        raise RegistrationError(f"handler {_qualname(fn)!r}: id= must be a non-empty string")
    field_path = None
    if field is not None:
        if isinstance(field, (list, tuple)):
            field_path = ".".join(str(p) for p in field)
        elif isinstance(field, str) and field:
            field_path = field
        else:
            raise RegistrationError(f"handler {_qualname(fn)!r}: field= must be a dotted path or a list of keys")
    handler_id = id or _qualname(fn)
    if kind == "field":
        if not field_path:
            raise RegistrationError(f"handler {handler_id!r}: capstan.on.field needs field=")
        handler_id = f"{handler_id}/{field_path}"
    if errors is not None and not isinstance(errors, ErrorsMode):
        raise RegistrationError(f"handler {handler_id!r}: errors= must be an ErrorsMode, got {errors!r}")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
        raise RegistrationError(f"handler {handler_id!r}: retries= must be a non-negative integer, got {retries!r}")
    if max_in_flight is not None and not _count(max_in_flight):
        raise RegistrationError(f"handler {handler_id!r}: max_in_flight= must be a non-negative integer, got {max_in_flight!r}")
    backoff = _seconds(handler_id, "backoff", backoff)
    timeout = _seconds(handler_id, "timeout", timeout)
    _check_json(handler_id, "param", param)
    for what, conditions in (("labels", labels), ("annotations", annotations)):
        if conditions is None:
            continue
        if not isinstance(conditions, dict):
            raise RegistrationError(f"handler {handler_id!r}: {what}= must be a dict")
        for key, cond in conditions.items():
            if not (isinstance(cond, str) or cond in (PRESENT, ABSENT) or callable(cond)):
                raise RegistrationError(f"handler {handler_id!r}: {what}[{key!r}] must be a string, PRESENT, ABSENT or a callable, got {cond!r}")
    for what, cond in (("value", value), ("old", old), ("new", new)):
        if cond is not None and not field_path:
            raise RegistrationError(f"handler {handler_id!r}: {what}= needs field=")
        _check_json(handler_id, what, cond)
    if (old is not None or new is not None) and kind not in ("update", "field"):
        raise RegistrationError(f"handler {handler_id!r}: old= and new= apply to update and field handlers only")
    if when is not None and not callable(when):
        raise RegistrationError(f"handler {handler_id!r}: when= must be callable")
    if optional and kind != "delete":
        raise RegistrationError(f"handler {handler_id!r}: optional= applies to delete handlers only")
    if deleted and kind != "resume":
        raise RegistrationError(f"handler {handler_id!r}: deleted= applies to resume handlers only")
    if kind in ACTIVITY_KINDS and any(x is not None for x in (labels, annotations, field, value, when)):
        raise RegistrationError(f"handler {handler_id!r}: {kind} handlers take no object filters")
    takes, wants = _signature(fn, kind, handler_id)
    return Handler(
        fn=fn, kind=kind, id=handler_id, resource=resource, errors=errors, retries=retries,
        backoff=backoff, timeout=timeout, param=param, max_in_flight=max_in_flight, labels=labels,
        annotations=annotations, field=field_path, value=value, old=old, new=new, when=when, optional=bool(optional),
        deleted=bool(deleted), options=dict(options or {}),
        is_async=asyncio.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn),
        takes=takes, wants=wants,
    )


def _count(value):
    """Whether `value` is a non-negative integer (and not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


#: The operator's default registry as the process started (kopf's default registry); the
#: decorators use whichever `set_default_registry()` made current.
default_registry = Registry()
_default = default_registry


def get_default_registry() -> Registry:
    """The registry that decorators without `registry=` register into (kopf's
    `kopf.get_default_registry()`)."""
    return _default


def set_default_registry(registry: Registry):
    """Makes `registry` the one that decorators without `registry=` register into and that the
    runner serves (kopf's `kopf.set_default_registry()`)."""
    global _default
    if not isinstance(registry, Registry):
        raise TypeError(f"a default registry must be a Registry, got {registry!r}")
    _default = registry
