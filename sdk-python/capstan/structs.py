"""The values handlers receive and return, shaped as kopf's: `Body` (a live, read-only view of
the object), `Patch` (a merge patch with `.spec`/`.status`/`.metadata` sections), `Diff`,
`Memo`, the daemons' `stopped` flags and `ConnectionInfo` for login handlers.

Kept free of the wire types, so that the test kit and the runner build them the same way.
"""

import asyncio
import collections.abc
import copy
import dataclasses
import enum
import threading
from typing import Any, NamedTuple, Optional


class _Marker(enum.Enum):
    PRESENT = "PRESENT"
    ABSENT = "ABSENT"

    def __repr__(self):
        return f"capstan.{self.value}"


#: The label, annotation or field must exist, with any value (kopf.PRESENT).
PRESENT = _Marker.PRESENT
#: The label, annotation or field must not exist (kopf.ABSENT).
ABSENT = _Marker.ABSENT


class _Section(collections.abc.Mapping):
    """A read-only view of one key of a body (`spec`, `status`, `metadata`), looked up on
    every access so that a daemon's view follows the object."""

    def __init__(self, source, *path):
        self._source = source
        self._path = path

    def _resolve(self):
        value = self._source._data
        for key in self._path:
            value = value.get(key) if isinstance(value, dict) else None
        return value if isinstance(value, dict) else {}

    def __getitem__(self, key):
        return self._resolve()[key]

    def __iter__(self):
        return iter(self._resolve())

    def __len__(self):
        return len(self._resolve())

    def __repr__(self):
        return repr(self._resolve())

    def __eq__(self, other):
        if isinstance(other, collections.abc.Mapping):
            return dict(self._resolve()) == dict(other)
        return NotImplemented


class Spec(_Section):
    """The object's `spec` (kopf's `kopf.Spec`)."""


class Status(_Section):
    """The object's `status` (kopf's `kopf.Status`)."""


class Meta(_Section):
    """The object's metadata, with kopf's shortcuts."""

    @property
    def labels(self):
        return _Section(self._source, *self._path, "labels")

    @property
    def annotations(self):
        return _Section(self._source, *self._path, "annotations")

    @property
    def name(self):
        return self._resolve().get("name")

    @property
    def namespace(self):
        return self._resolve().get("namespace")

    @property
    def uid(self):
        return self._resolve().get("uid")

    @property
    def creation_timestamp(self):
        return self._resolve().get("creationTimestamp")

    @property
    def deletion_timestamp(self):
        return self._resolve().get("deletionTimestamp")


class Body(collections.abc.Mapping):
    """The object as the controller saw it (kopf's `body`): read-only. A daemon's body follows
    the object while the daemon runs (kopf's live body)."""

    def __init__(self, data):
        self._data = data if isinstance(data, dict) else {}

    def _replace(self, data):
        self._data = data if isinstance(data, dict) else {}

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)

    def __repr__(self):
        return repr(self._data)

    def __eq__(self, other):
        if isinstance(other, collections.abc.Mapping):
            return self._data == dict(other)
        return NotImplemented

    @property
    def metadata(self):
        return Meta(self, "metadata")

    meta = metadata

    @property
    def spec(self):
        return Spec(self, "spec")

    @property
    def status(self):
        return Status(self, "status")


class Patch(dict):
    """A JSON merge patch that handlers fill (kopf's `patch`): `patch.status['x'] = 1`,
    `patch.metadata.labels['a'] = 'b'`, `patch.spec['k'] = None` (removes a key). It is sent
    with the handler's success, and discarded with any failure."""

    def _section(self, *path):
        node = self
        for key in path:
            child = node.get(key)
            if not isinstance(child, dict):
                child = _PatchSection()
                dict.__setitem__(node, key, child)
            node = child
        return node

    @property
    def spec(self):
        return self._section("spec")

    @property
    def status(self):
        return self._section("status")

    @property
    def metadata(self):
        return self._section("metadata")

    meta = metadata

    def as_documents(self):
        """The patch split as the wire wants it: (object part, status part), each a plain
        dict or None when empty."""
        cleaned = _prune(self)
        status = cleaned.pop("status", None) if isinstance(cleaned, dict) else None
        obj = cleaned or None
        return obj, ({"status": status} if status else None)


class _PatchSection(dict):
    @property
    def labels(self):
        return Patch._section(self, "labels")

    @property
    def annotations(self):
        return Patch._section(self, "annotations")

    @property
    def finalizers(self):
        return self.setdefault("finalizers", [])


def _prune(value):
    """A deep copy without the sections that were touched but left empty."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if isinstance(item, _PatchSection) and not item:
                continue
            pruned = _prune(item)
            if isinstance(item, _PatchSection) and not pruned:
                continue
            out[key] = pruned
        return out
    return copy.deepcopy(value)


class Reason(str, enum.Enum):
    """Why a change handler is called (kopf's `reason`); compares equal to its string."""

    CREATE = "create"
    UPDATE = "update"
    DELETE = "delete"
    RESUME = "resume"

    def __str__(self):
        return self.value


class DiffOperation(str, enum.Enum):
    """The kind of one difference (kopf's "add", "change", "remove")."""

    ADD = "add"
    CHANGE = "change"
    REMOVE = "remove"


class DiffItem(NamedTuple):
    """One difference, unpackable as kopf's `(op, field, old, new)`."""

    operation: DiffOperation
    field: tuple
    old: Any
    new: Any

    @property
    def op(self):
        return self.operation


class Diff(tuple):
    """The differences between the old and the new essence (kopf's `diff`): a tuple of
    `DiffItem`s."""

    def __new__(cls, items=()):
        return super().__new__(cls, tuple(items))


class Memo(dict):
    """Free-form per-object (or, for activities, per-process) memory shared by the handlers
    of one object, with attribute access (kopf's `memo`)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self[name] = value

    def __delattr__(self, name):
        try:
            del self[name]
        except KeyError:
            raise AttributeError(name) from None


class DaemonStoppingReason(str, enum.Enum):
    """Why a daemon is asked to stop."""

    NONE = "none"
    RESOURCE_DELETED = "resource_deleted"
    FILTERS_MISMATCH = "filters_mismatch"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    SUPERSEDED = "superseded"
    OPERATOR_EXITING = "operator_exiting"
    HANDLER_UNREGISTERED = "handler_unregistered"
    OPERATOR_PAUSING = "operator_pausing"
    CONNECTION_LOST = "connection_lost"


class _Stop:
    """The shared state behind both flavours of `stopped`."""

    def __init__(self):
        self._event = threading.Event()
        self._waiters = []
        self.reason: Optional[DaemonStoppingReason] = None

    def set(self, reason, loop=None):
        if self._event.is_set():
            return
        self.reason = reason
        self._event.set()
        for waiter_loop, future in self._waiters:
            waiter_loop.call_soon_threadsafe(_resolve, future)

    def is_set(self):
        return self._event.is_set()


def _resolve(future):
    if not future.done():
        future.set_result(True)


class _StoppedFlag:
    """What the sync and async `stopped` flags share: truthiness, `is_set()`, `reason`."""

    def __init__(self, stop: _Stop):
        self._stop = stop

    def __bool__(self):
        return self._stop.is_set()

    def is_set(self):
        return self._stop.is_set()

    @property
    def reason(self):
        return self._stop.reason


class DaemonStopped(_StoppedFlag):
    """The `stopped` flag of an async daemon: `if stopped`, `await stopped.wait(timeout)`."""

    async def wait(self, timeout=None):
        """Waits until the daemon is asked to stop or `timeout` seconds pass; returns whether
        it was asked to stop."""
        if self._stop.is_set():
            return True
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        entry = (loop, future)
        self._stop._waiters.append(entry)
        try:
            if self._stop.is_set():
                return True
            await asyncio.wait_for(asyncio.shield(future), timeout)
            return True
        except asyncio.TimeoutError:
            return self._stop.is_set()
        finally:
            self._stop._waiters.remove(entry)


class SyncDaemonStopped(_StoppedFlag):
    """The `stopped` flag of a sync daemon: `if stopped`, `stopped.wait(timeout)`."""

    def wait(self, timeout=None):
        """Blocks until the daemon is asked to stop or `timeout` seconds pass; returns whether
        it was asked to stop."""
        return self._stop._event.wait(timeout)


@dataclasses.dataclass
class ConnectionInfo:
    """API credentials returned by a login handler (kopf.ConnectionInfo)."""

    server: str
    ca_path: Optional[str] = None
    ca_data: Optional[bytes] = None
    insecure: Optional[bool] = None
    username: Optional[str] = None
    password: Optional[str] = None
    scheme: Optional[str] = None
    token: Optional[str] = None
    certificate_path: Optional[str] = None
    certificate_data: Optional[bytes] = None
    private_key_path: Optional[str] = None
    private_key_data: Optional[bytes] = None
    default_namespace: Optional[str] = None
    priority: int = 0
    expiration: Optional[Any] = None
