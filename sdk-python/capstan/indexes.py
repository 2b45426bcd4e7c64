"""kopf's indexes (`@capstan.index`), kept in this process and read by every handler.

The controller calls an index handler for every object of its resource, again on every change,
and says when an object leaves the index (deleted, or no longer matching the handler's
filters); no other handler of this process runs before every index has been built from its
initial listing, and a new connection starts from empty indexes that the controller fills
again first. Each result is folded in as kopf does:

- a dict result gives keys and values: each key holds the value under it;
- any other result other than None is stored under the key None;
- None changes nothing: what the object had stays;
- a failure drops the object's entries, except an unclassified error under the IGNORED errors
  mode (the default of index handlers), which keeps the stale ones, as kopf does.

Handlers read an index by its name as a kwarg (kopf's way): an `Index` maps keys to `Store`s;
a store is the collection of the values every object put under that key; empty stores do not
exist. An `Index` is a live view; a `Store` is a snapshot of one key.
"""

import json
import threading
from collections.abc import Collection, Mapping


class Store(Collection):
    """The values that objects put under one key of an index (kopf's `kopf.Store`)."""

    def __init__(self, values):
        self._values = list(values)

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __contains__(self, value):
        return value in self._values

    def __repr__(self):
        # kopf's Store shows as the list of its values.
        return repr(self._values)


class Index(Mapping):
    """One index: keys to their `Store`s (kopf's `kopf.Index`), read live."""

    def __init__(self, data, lock):
        self._data = data
        self._lock = lock

    def __getitem__(self, key):
        with self._lock:
            objects = self._data.get(key)
            if not objects:
                raise KeyError(key)
            # kopf's order: the objects in the order they were first indexed under the key.
            return Store(objects.values())

    def __iter__(self):
        with self._lock:
            keys = [k for k, objects in self._data.items() if objects]
        return iter(keys)

    def __len__(self):
        with self._lock:
            return sum(1 for objects in self._data.values() if objects)

    def __repr__(self):
        return f"Index({dict(self)!r})"


KEEP = object()
REMOVE = object()


def _plain(value):
    """The SDK's read-only views (`spec`, `labels`, `meta`, ...) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def change_of(handler_id, value):
    """What a result does to the object's entries: KEEP, or the (key, value) pairs that
    replace them. Values are kept as plain data (the SDK's views are copied); a value that is
    not JSON-serialisable, or a key that cannot be a dict key, is the handler's error."""
    if value is None:
        return KEEP
    pairs = list(value.items()) if isinstance(value, Mapping) else [(None, value)]
    out = []
    for key, item in pairs:
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"index handler {handler_id!r} returned the unhashable key {key!r}") from None
        item = _plain(item)
        try:
            json.dumps(item)
        except (TypeError, ValueError) as error:
            raise TypeError(f"index handler {handler_id!r} returned a value that is not JSON-serialisable: {error}") from None
        out.append((key, item))
    return out


class Indexes:
    """The indexes of one stream (or one test harness), by handler id."""

    def __init__(self, names=()):
        self._lock = threading.Lock()
        self._data = {name: {} for name in names}  # name -> key -> object -> value
        self._keys = {name: {} for name in names}  # name -> uid -> (object, its keys)

    def views(self):
        """Every index by name, as kwargs."""
        return {name: Index(data, self._lock) for name, data in self._data.items()}

    def apply(self, name, obj, change):
        """Folds a change of object `obj` ((namespace, name, uid)) into index `name`. The uid
        alone finds an object's entries (the controller removes objects it saw vanish by uid)."""
        if change is KEEP or name not in self._data:
            return
        data, keys = self._data[name], self._keys[name]
        uid = obj[2]
        with self._lock:
            old, held = keys.pop(uid, (None, ()))
            new = [] if change is REMOVE else [key for key, _ in change]
            # As kopf's index: an object's value keeps its place in a key it stays under; it
            # leaves the keys it no longer yields (an emptied key goes).
            for key in held:
                objects = data.get(key)
                if objects is None or (key in new and old == obj):
                    continue
                objects.pop(old, None)
                if not objects:
                    del data[key]
            if change is REMOVE:
                return
            for key, value in change:
                data.setdefault(key, {})[obj] = value
            keys[uid] = (obj, new)

    def clear(self):
        """Empties every index (a new connection: the controller feeds every object again)."""
        with self._lock:
            for name in self._data:
                self._data[name].clear()
                self._keys[name].clear()
