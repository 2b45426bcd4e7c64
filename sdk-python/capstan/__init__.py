"""Capstan's Python SDK: kopf's programming model for handler processes that the Capstan
controller calls over `capstan.v1`.

    import capstan

    @capstan.on.create("examples.demo.capstan.dev")
    def create_fn(spec, patch, **_):
        patch.status["seen"] = spec.get("field")
        return {"message": "hello"}

Run it with `python -m capstan run handlers.py` beside the controller.
"""

__version__ = "0.1.0"

from capstan import on  # noqa: E402
from capstan.errors import (  # noqa: E402
    AdmissionError, ErrorsMode, HandlerRetriesError, HandlerTimeoutError, PermanentError, RegistrationError, TemporaryError,
)
from capstan.events import event, exception, info, warn  # noqa: E402
from capstan.filters import all_, any_, none_  # noqa: E402
from capstan.indexes import Index, Store  # noqa: E402
from capstan.invoke import register, subhandler  # noqa: E402
from capstan.on import daemon, index, timer  # noqa: E402
from capstan.owners import (  # noqa: E402
    adjust_namespace, adopt, append_owner_reference, build_owner_reference, harmonize_naming, label,
    remove_owner_reference,
)
from capstan.registry import Registry, Resource, default_registry  # noqa: E402
from capstan.runner import configure_logging, operator, run, set_max_in_flight  # noqa: E402
from capstan.structs import (  # noqa: E402
    ABSENT, PRESENT, Body, ConnectionInfo, DaemonStopped, DaemonStoppingReason, Diff, DiffItem, DiffOperation, Memo,
    Meta, Patch, Reason, SyncDaemonStopped,
)

__all__ = [
    "on", "daemon", "timer", "index", "subhandler", "register", "operator", "run", "configure_logging",
    "set_max_in_flight",
    "AdmissionError", "TemporaryError", "PermanentError", "HandlerTimeoutError", "HandlerRetriesError", "ErrorsMode",
    "RegistrationError", "Body", "Meta", "Patch", "Diff", "DiffItem", "DiffOperation", "Memo", "DaemonStopped",
    "SyncDaemonStopped", "DaemonStoppingReason", "ConnectionInfo", "PRESENT", "ABSENT", "Registry", "Resource",
    "default_registry", "adopt", "append_owner_reference", "remove_owner_reference", "build_owner_reference",
    "harmonize_naming", "adjust_namespace", "label", "event", "info", "warn", "exception",
    "all_", "any_", "none_", "Reason", "Index", "Store",
]
