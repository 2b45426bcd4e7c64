"""kopf's persistence storages (`settings.persistence.progress_storage`, `.diffbase_storage`):
with Capstan the controller keeps progress records and diff-bases, so these classes hold
kopf's parameters and say which controller flags keep the same records in the same places
(`flags()`). `capstan.settings` sends those to the controller (`ProcessSettings.operator`)
or, for a controller it starts itself, gives them as flags; a storage no flag says is named
in the settings review."""

from typing import Any, Dict, List, Optional


class _Storage:
    """A storage's parameters, compared and shown by value."""

    def _params(self) -> Dict[str, Any]:
        return dict(vars(self))

    def __eq__(self, other):
        return type(self) is type(other) and self._params() == other._params()

    def __hash__(self):
        return hash(type(self))

    def __repr__(self):
        params = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({params})"

    def flags(self) -> List[str]:
        """The controller flags that keep the same records in the same places; empty when no
        flag does."""
        return []


def _field_name(name, field, default):
    """The status stanza of kopf's `field='status.{name}.progress'`, when it has that shape."""
    path = field.split(".") if isinstance(field, str) else list(field or [])
    path = [p.format(name=name) for p in path]
    return path[1] if len(path) == 3 and path[0] == "status" and path[2] == default else None


class ProgressStorage(_Storage):
    """Where handlers' progress records are kept (kopf's `kopf.ProgressStorage`)."""


class AnnotationsProgressStorage(ProgressStorage):
    """Progress in one annotation per handler under `prefix`."""

    def __init__(self, *, prefix: str = "kopf.zalando.org", verbose: bool = False, touch_key: str = "touch-dummy",
                 v1: bool = True):
        self.prefix, self.verbose, self.touch_key, self.v1 = prefix, verbose, touch_key, v1

    def flags(self):
        return ["--progress-storage", "annotations", "--persistence-prefix", self.prefix]


class StatusProgressStorage(ProgressStorage):
    """Progress under `status.<name>.progress`."""

    def __init__(self, *, name: str = "kopf", field: Any = "status.{name}.progress",
                 touch_field: Any = "status.{name}.dummy"):
        self.name, self.field, self.touch_field = name, field, touch_field

    def flags(self):
        stanza = _field_name(self.name, self.field, "progress")
        return ["--progress-storage", "status", "--status-field", stanza] if stanza else []


class SmartProgressStorage(ProgressStorage):
    """Progress in annotations, also read from the status (kopf's default)."""

    def __init__(self, *, name: str = "kopf", field: Any = "status.{name}.progress", touch_key: str = "touch-dummy",
                 touch_field: Any = "status.{name}.dummy", prefix: str = "kopf.zalando.org", v1: bool = True,
                 verbose: bool = False):
        self.name, self.field, self.touch_key, self.touch_field = name, field, touch_key, touch_field
        self.prefix, self.v1, self.verbose = prefix, v1, verbose

    def flags(self):
        stanza = _field_name(self.name, self.field, "progress")
        if not stanza:
            return []
        return ["--progress-storage", "smart", "--persistence-prefix", self.prefix, "--status-field", stanza]


class MultiProgressStorage(ProgressStorage):
    """Several progress storages at once (no controller flag does this; `smart` is the
    nearest)."""

    def __init__(self, storages):
        self.storages = list(storages)


class DiffBaseStorage(_Storage):
    """Where the last handled state is kept (kopf's `kopf.DiffBaseStorage`)."""

    def __init__(self, ignored_fields: Optional[Any] = None):
        self.ignored_fields = ignored_fields


class AnnotationsDiffBaseStorage(DiffBaseStorage):
    """The diff-base in the annotation `<prefix>/<key>` (kopf's default)."""

    def __init__(self, *, prefix: str = "kopf.zalando.org", key: str = "last-handled-configuration",
                 ignored_fields: Optional[Any] = None, v1: bool = True):
        super().__init__(ignored_fields)
        self.prefix, self.key, self.v1 = prefix, key, v1

    def flags(self):
        if self.ignored_fields:
            return []
        full = f"{self.prefix}/{self.key}" if self.prefix else self.key
        return ["--diffbase-storage", "annotations", "--diffbase-key", full]


class StatusDiffBaseStorage(DiffBaseStorage):
    """The diff-base under `status.<name>.last-handled-configuration`."""

    def __init__(self, *, name: str = "kopf", field: Any = "status.{name}.last-handled-configuration",
                 ignored_fields: Optional[Any] = None):
        super().__init__(ignored_fields)
        self.name, self.field = name, field

    def flags(self):
        stanza = _field_name(self.name, self.field, "last-handled-configuration")
        if self.ignored_fields or not stanza:
            return []
        return ["--diffbase-storage", "status", "--status-field", stanza]


class MultiDiffBaseStorage(DiffBaseStorage):
    """Several diff-base storages at once (no controller flag does this)."""

    def __init__(self, storages):
        super().__init__()
        self.storages = list(storages)
