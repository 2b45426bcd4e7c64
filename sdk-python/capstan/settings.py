"""kopf's `OperatorSettings`, with kopf 1.45's structure and defaults, for the startup handlers
that configure an operator (`def configure(settings: kopf.OperatorSettings, **_)`).

With Capstan, most settings are the controller's: it watches, persists, peers and serves
admission. Each field has a place (`PLACES`, the table below and in the README):

- `sdk`: this process applies it (what it asks the controller to post as Events, the executor
  of sync handlers);
- `controller`: the controller's work for the whole operator that kopf operators configure in
  their startup handlers (the finalizer, the storages, the watches' timeouts, the worker limit,
  peering, the API requests' timeout, the managed webhook configurations' name).
  An operator that kept kopf's finalizer or storages but had Capstan's differ would lose track
  of its objects' state, so these are sent to the controller (`ProcessSettings.operator`,
  `operator_settings()`) and applied as their flags would be, unless the flag was given to the
  controller (the flag wins; its Notice is logged as a WARNING). A value that no flag says
  (a `MultiProgressStorage`, a status field of another shape) or that is out of the
  controller's bounds is not sent, and the first time a WARNING says so;
- `flag`: the controller's flag does this job and the controller takes it only as a flag
  (the webhook server, which the deployment's Service and certificates go with, and the
  watches' connection timeouts); a value a handler sets is not carried to the
  controller, so the first time it differs from kopf's default a WARNING names the flag to set;
- `none`: it has no meaning with a controller in the pod (aiohttp sessions, kopf's own queues
  and backoffs); a changed value is accepted with one INFO line.

The flags are the one mapping: `controller` values go into `OperatorSettings` fields named
after their flags, and a controller this process starts itself (KopfRunner) is given the
`flag` and `controller` values as flags (`controller_flags()`). Nothing a handler sets here
fails. `review()` runs after each startup handler.
"""

import concurrent.futures
import dataclasses
import logging
import threading
import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

from google.protobuf import duration_pb2

from capstan.storages import (
    AnnotationsDiffBaseStorage, DiffBaseStorage, ProgressStorage, SmartProgressStorage,
)
from capstan.threads import HandlerThreads
from capstan.v1 import runtime_service_pb2 as rs

log = logging.getLogger("capstan")


@dataclasses.dataclass
class ProcessSettings:
    ultimate_exiting_timeout: Optional[float] = 10 * 60


@dataclasses.dataclass
class PostingSettings:
    enabled: bool = True
    loggers: bool = False
    level: int = logging.INFO
    default_backoffs: Union[float, Iterable[float]] = (1, 1, 2, 3, 5, 8, 13, 21)
    logging_backoffs: Union[float, Iterable[float]] = (1, 1, 2, 3, 5)
    worker_limit: Optional[int] = None
    idle_timeout: float = 1.0
    reporting_component: str = "kopf"
    reporting_instance: str = "dev"
    event_name_prefix: str = "kopf-event-"


@dataclasses.dataclass
class PeeringSettings:
    name: str = "default"
    stealth: bool = False
    priority: int = 0
    lifetime: int = 60
    mandatory: bool = False
    standalone: bool = False
    clusterwide: bool = False

    @property
    def namespaced(self) -> bool:
        return not self.clusterwide

    @namespaced.setter
    def namespaced(self, value: bool) -> None:
        self.clusterwide = not value


@dataclasses.dataclass
class WatchingSettings:
    server_timeout: Optional[float] = None
    client_timeout: Optional[float] = None
    connect_timeout: Optional[float] = None
    reconnect_backoff: float = 0.1
    inactivity_timeout: float = 70.0
    chunk_size: Optional[int] = None
    initial_streaming: bool = False
    label_selectors: Dict[Any, str] = dataclasses.field(default_factory=dict)
    field_selectors: Dict[Any, str] = dataclasses.field(default_factory=dict)
    shard_selectors: Dict[Any, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class QueueingSettings:
    worker_limit: Optional[int] = None
    idle_timeout: float = 5.0
    exit_timeout: float = 2.0
    error_delays: Iterable[float] = (1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610)
    _batch_window: float = 0.1

    @property
    def batch_window(self) -> float:
        return self._batch_window

    @batch_window.setter
    def batch_window(self, value: float) -> None:
        self._batch_window = value


@dataclasses.dataclass
class ScanningSettings:
    disabled: bool = False


@dataclasses.dataclass
class AdmissionSettings:
    server: Any = None
    managed: Optional[str] = None


def _executor():
    return HandlerThreads(thread_name_prefix="capstan-handler")


@dataclasses.dataclass
class ExecutionSettings:
    default_backoff: float = 60
    executor: concurrent.futures.Executor = dataclasses.field(default_factory=_executor)
    _max_workers: Optional[int] = None

    @property
    def max_workers(self) -> Optional[int]:
        return self._max_workers

    @max_workers.setter
    def max_workers(self, value: int) -> None:
        if value < 1:
            raise ValueError("Can't set thread pool limit lower than 1.")
        self._max_workers = value
        if hasattr(self.executor, "_max_workers"):
            self.executor._max_workers = value
        else:
            raise TypeError("Current executor does not support `max_workers`.")


@dataclasses.dataclass
class BackgroundSettings:
    cancellation_polling: float = 60
    instant_exit_timeout: Optional[float] = None
    instant_exit_zero_time_cycles: Optional[int] = 10


@dataclasses.dataclass
class NetworkingSettings:
    request_timeout: Optional[float] = 5 * 60
    connect_timeout: Optional[float] = None
    error_backoffs: Union[float, Iterable[float]] = (1, 1, 2, 3, 5, 8, 13, 21)
    enforce_retry_after: bool = False
    trust_env: bool = False


@dataclasses.dataclass
class PersistenceSettings:
    finalizer: str = "kopf.zalando.org/KopfFinalizerMarker"
    progress_storage: ProgressStorage = dataclasses.field(default_factory=SmartProgressStorage)
    diffbase_storage: DiffBaseStorage = dataclasses.field(default_factory=AnnotationsDiffBaseStorage)
    consistency_timeout: float = 5.0


@dataclasses.dataclass
class OperatorSettings:
    """kopf's `kopf.OperatorSettings`: the same sections, fields and defaults."""

    process: ProcessSettings = dataclasses.field(default_factory=ProcessSettings)
    posting: PostingSettings = dataclasses.field(default_factory=PostingSettings)
    peering: PeeringSettings = dataclasses.field(default_factory=PeeringSettings)
    watching: WatchingSettings = dataclasses.field(default_factory=WatchingSettings)
    queueing: QueueingSettings = dataclasses.field(default_factory=QueueingSettings)
    scanning: ScanningSettings = dataclasses.field(default_factory=ScanningSettings)
    admission: AdmissionSettings = dataclasses.field(default_factory=AdmissionSettings)
    execution: ExecutionSettings = dataclasses.field(default_factory=ExecutionSettings)
    background: BackgroundSettings = dataclasses.field(default_factory=BackgroundSettings)
    networking: NetworkingSettings = dataclasses.field(default_factory=NetworkingSettings)
    persistence: PersistenceSettings = dataclasses.field(default_factory=PersistenceSettings)

    @property
    def batching(self) -> QueueingSettings:
        warnings.warn("Batching settings are now queueing settings. "
                      "Please rename `settings.batching` -> `settings.queueing`", DeprecationWarning)
        return self.queueing


_AIOHTTP = "the controller makes every API request"
_QUEUES = "the controller queues and processes objects itself"
_EVENTS = "the controller posts and retries Events itself"

#: Where each setting's job is done with Capstan: (`sdk` | `controller` | `flag` | `none`, what
#: does it). For `controller` and `flag`, the flags; the storages' and webhook servers' flags
#: follow from their parameters.
PLACES: Dict[str, Tuple[str, str]] = {
    "process.ultimate_exiting_timeout": ("none", "the pod's terminationGracePeriodSeconds ends the process"),
    "posting.enabled": ("sdk", "this process posts explicit Events (kopf.event/info/warn/exception) only if set"),
    "posting.loggers": ("sdk", "this process asks the controller to post its handlers' log records and their outcome messages as Events"),
    "posting.level": ("sdk", "the lowest level of explicit Events and log records this process posts"),
    "posting.default_backoffs": ("none", _EVENTS),
    "posting.logging_backoffs": ("none", _EVENTS),
    "posting.worker_limit": ("none", _EVENTS),
    "posting.idle_timeout": ("none", _EVENTS),
    "posting.reporting_component": ("none", "the controller reports Events as itself"),
    "posting.reporting_instance": ("none", "the controller reports Events as itself"),
    "posting.event_name_prefix": ("none", "the controller names its Events"),
    "peering.name": ("controller", "--peering"),
    "peering.stealth": ("none", "the controller logs keep-alives at debug level"),
    "peering.priority": ("controller", "--priority"),
    "peering.lifetime": ("controller", "--peering-lifetime"),
    "peering.mandatory": ("controller", "--peering (given, peering is required)"),
    "peering.standalone": ("controller", "--standalone"),
    "peering.clusterwide": ("none", "the controller's peering follows its namespaces (-n/-A)"),
    "watching.server_timeout": ("controller", "--watch-server-timeout"),
    "watching.client_timeout": ("flag", "--api-timeout"),
    "watching.connect_timeout": ("flag", "--api-timeout"),
    "watching.reconnect_backoff": ("none", "the controller's watches back off with jitter"),
    "watching.inactivity_timeout": ("controller", "--watch-inactivity-timeout"),
    "watching.chunk_size": ("none", "the controller lists in pages of its own"),
    "watching.initial_streaming": ("none", "the controller lists, then watches"),
    "watching.label_selectors": ("none", "filter with the handlers' labels="),
    "watching.field_selectors": ("none", "filter with the handlers' when= or field="),
    "watching.shard_selectors": ("none", "shard with -n patterns or per-node mode (--node-name)"),
    "queueing.worker_limit": ("controller", "--worker-limit"),
    "queueing.idle_timeout": ("none", _QUEUES),
    "queueing.exit_timeout": ("flag", "--shutdown-grace"),
    "queueing.error_delays": ("none", _QUEUES),
    "queueing._batch_window": ("none", _QUEUES),
    "scanning.disabled": ("flag", "--no-crd-watch"),
    "admission.server": ("flag", "--webhook-listen, --webhook-cert-dir, --webhook-cert-names, --webhook-url"),
    "admission.managed": ("controller", "--webhook-managed"),
    "execution.default_backoff": ("none", "give the handlers backoff= (the controller's default is kopf's 60 s)"),
    "execution.executor": ("sdk", "runs this process's sync handlers"),
    "execution._max_workers": ("sdk", "the size of this process's thread pool for sync handlers"),
    "background.cancellation_polling": ("none", "a sync daemon is never killed; it returns once stopped is set"),
    "background.instant_exit_timeout": ("none", "the controller stops daemons with their cancellation_timeout"),
    "background.instant_exit_zero_time_cycles": ("none", "the controller stops daemons with their cancellation_timeout"),
    "networking.request_timeout": ("controller", "--api-timeout"),
    "networking.connect_timeout": ("flag", "--api-timeout"),
    "networking.error_backoffs": ("none", _AIOHTTP),
    "networking.enforce_retry_after": ("none", _AIOHTTP),
    "networking.trust_env": ("none", _AIOHTTP),
    "persistence.finalizer": ("controller", "--finalizer"),
    "persistence.progress_storage": ("controller", "--progress-storage, --persistence-prefix, --status-field"),
    "persistence.diffbase_storage": ("controller", "--diffbase-storage, --diffbase-key, --status-field"),
    "persistence.consistency_timeout": ("none", "the controller waits for its own writes' echoes"),
}


def fields(settings: OperatorSettings):
    """Every field as (`section.field`, value)."""
    for section in dataclasses.fields(settings):
        group = getattr(settings, section.name)
        for field in dataclasses.fields(group):
            yield f"{section.name}.{field.name}", getattr(group, field.name)


def _changed(settings: OperatorSettings, places):
    """(path, value) of the fields in `places` that differ from kopf's default."""
    defaults = dict(fields(OperatorSettings()))
    for path, value in fields(settings):
        if PLACES.get(path, ("none",))[0] in places and value != defaults.get(path):
            yield path, value


def _pairs(args) -> List[Tuple[str, Any]]:
    """Flag arguments (`["--a", "x", "--b"]`) as (flag, its value or None) pairs."""
    pairs, i = [], 0
    while i < len(args):
        if i + 1 < len(args) and not str(args[i + 1]).startswith("--"):
            pairs.append((args[i], args[i + 1]))
            i += 2
        else:
            pairs.append((args[i], None))
            i += 1
    return pairs


def _flag_values(path, value) -> List[Tuple[str, Any]]:
    """The controller flags that do what `value` of `path` asks, each with its value (None for
    a switch) not yet formatted; empty when no flag says it exactly. Both ways of carrying a
    setting start here: as command-line flags (`flag_args`) and as `OperatorSettings`
    (`_operator_fields`)."""
    to_flags = getattr(value, "flags", None)
    if callable(to_flags):
        return _pairs(list(to_flags()))
    flag = PLACES[path][1]
    if " " in flag or "," in flag or not flag.startswith("--") or value is None or value is False:
        return []
    if value is True:
        return [(flag, None)]
    if path in _WHOLE_SECONDS and isinstance(value, (int, float)) and 0 < value < float("inf"):
        value = max(1, round(value))
    return [(flag, value)]


def flag_args(path, value) -> Optional[List[str]]:
    """The controller's command-line arguments that do what `value` of `path` asks; None when
    no flag says it exactly."""
    args = []
    for flag, arg in _flag_values(path, value):
        args.append(flag)
        if arg is not None:
            args.append(f"{arg:g}s" if path in _DURATIONS and isinstance(arg, (int, float)) else str(arg))
    return args or None


def _flags(path, value):
    """`flag_args` as text, else the flags' names from the table."""
    args = flag_args(path, value)
    if args:
        return " ".join(args)
    flag = PLACES[path][1]
    if isinstance(value, bool) and not value:
        return None
    return flag if flag.startswith("--") else None


def controller_flags(settings: OperatorSettings) -> Tuple[List[str], List[str]]:
    """The controller flags for every setting that is the controller's (`flag` and
    `controller`) and differs from kopf's default, for a controller this process starts
    (KopfRunner): the arguments (a flag given by several settings once, the last one winning),
    and the settings' paths they carry."""
    chosen: Dict[str, List[str]] = {}
    paths = []
    for path, value in _changed(settings, ("flag", "controller")):
        args = flag_args(path, value)
        if not args:
            continue
        paths.append(path)
        for flag, arg in _pairs(args):
            chosen[flag] = [flag] if arg is None else [flag, arg]
    return [arg for pair in chosen.values() for arg in pair], paths


def mark_applied(paths):
    """Settings that a controller started by this process took as flags: not reported."""
    with _reported_lock:
        _reported.update(paths)


#: Settings in seconds whose flags take durations.
_DURATIONS = {
    "peering.lifetime", "watching.server_timeout", "watching.client_timeout", "watching.connect_timeout",
    "watching.inactivity_timeout", "queueing.exit_timeout", "networking.request_timeout", "networking.connect_timeout",
}
#: Durations in whole seconds, at least one: the API server takes a watch's timeout so.
_WHOLE_SECONDS = {"watching.server_timeout"}
#: The numbers the controller takes in `OperatorSettings` (the proto's comments): it refuses
#: others with a Notice, so they are not sent.
_BOUNDS = {"watch_inactivity_timeout": (1, 24 * 3600), "watch_server_timeout": (1, 24 * 3600),
           "worker_limit": (1, 100_000), "peering_lifetime": (1, 24 * 3600),
           "peering_priority": (-(2 ** 31), 2 ** 31), "api_timeout": (1, 24 * 3600)}
#: `OperatorSettings` fields not named after their flag.
_OPERATOR_NAMES = {"peering": "peering_name", "priority": "peering_priority", "standalone": "peering_standalone"}


def _operator_value(name, arg):
    """A flag's value as the `OperatorSettings` field `name` takes it; ValueError saying the
    bounds when it is out of them."""
    field = rs.OperatorSettings.DESCRIPTOR.fields_by_name[name]
    if field.type == field.TYPE_BOOL:
        return True  # a switch (`--standalone`)
    if field.enum_type is not None:
        # The kinds are named as the flag's values: PROGRESS_STORAGE_KIND_SMART is `smart`.
        kinds = {v.name.rsplit("_KIND_", 1)[-1].lower(): v.number for v in field.enum_type.values}
        return kinds[arg]
    if name not in _BOUNDS:
        return str(arg)
    low, high = _BOUNDS[name]
    duration = field.message_type is not None
    kind = (int, float) if duration else int
    if isinstance(arg, bool) or not isinstance(arg, kind) or not low <= arg <= high:
        raise ValueError(f"{low} to {high}" + (" seconds" if duration else ""))
    if not duration:
        return arg
    value = duration_pb2.Duration()
    value.FromNanoseconds(round(arg * 1e9))
    return value


def _operator_fields(path, value) -> rs.OperatorSettings:
    """What `value` of the `controller` setting `path` sets in `OperatorSettings`, whose fields
    are named after the flags (`--diffbase-key` is `diffbase_key`); empty when no flag says the
    same; ValueError when a value is out of the controller's bounds."""
    if path == "peering.mandatory":
        # No flag of its own (a given --peering makes peering required).
        return rs.OperatorSettings(peering_mandatory=bool(value))
    wanted = {}
    for flag, arg in _flag_values(path, value):
        name = flag[2:].replace("-", "_")
        name = _OPERATOR_NAMES.get(name, name)
        wanted[name] = _operator_value(name, arg)
    return rs.OperatorSettings(**wanted)


def operator_settings(settings: OperatorSettings) -> rs.OperatorSettings:
    """The `controller` settings that differ from kopf's default, as `ProcessSettings.operator`
    (kopf's defaults: an empty message, the controller's flags apply). The same values as
    `controller_flags` gives, decided the same way: when both storages name a status field,
    the last one (the diff-base storage's) wins, as a flag given twice does. A value the
    controller would refuse is left out (`review` says so once)."""
    message = rs.OperatorSettings()
    for path, value in _changed(settings, ("controller",)):
        try:
            message.MergeFrom(_operator_fields(path, value))
        except ValueError:
            continue
    if message.persistence_prefix and not message.diffbase_key:
        # kopf keeps the diff-base under its storage's own key, whatever the progress prefix;
        # the controller would derive it from the prefix.
        try:
            message.diffbase_key = _operator_fields("persistence.diffbase_storage",
                                                    settings.persistence.diffbase_storage).diffbase_key
        except ValueError:
            pass
    return message


_reported = set()
_reported_lock = threading.Lock()


def review(settings: OperatorSettings, logger: logging.Logger = log, carried: bool = True):
    """Says, once per field and process, what became of each setting a handler changed from
    kopf's default: applied here (`sdk`) or sent to the controller (`controller`), nothing
    said; the controller's flag to set (`flag`, and a `controller` value that is not sent: no
    flag says it, or the controller takes no settings, `carried=False`), a WARNING, as for a
    value out of the controller's bounds; no meaning with Capstan (`none`), an INFO line.
    Returns the paths it reported."""
    defaults = dict(fields(OperatorSettings()))
    reported = []
    for path, value in fields(settings):
        place, what = PLACES.get(path, ("none", "unknown to Capstan"))
        if place == "sdk" or value == defaults.get(path):
            continue
        bounds = None
        if place == "controller" and carried:
            try:
                if _operator_fields(path, value).ByteSize():
                    # Sent. Not counted as reported: a controller that takes no settings
                    # (`carried=False`) still gets its flag named.
                    continue
            except ValueError as error:
                bounds = str(error)
        with _reported_lock:
            if path in _reported:
                continue
            _reported.add(path)
        name = path.replace("._", ".")
        if bounds:
            logger.warning("settings.%s = %r is not sent to the controller, which takes %s; its own is used",
                           name, value, bounds)
        elif place in ("flag", "controller"):
            flags = _flags(path, value)
            if flags:
                logger.warning("settings.%s = %r is the controller's to apply: start it with %s "
                               "(this process does not change the controller)", name, value, flags)
            else:
                logger.warning("settings.%s = %r has no controller flag that does the same (%s); "
                               "the controller's own is used", name, value, what)
        else:
            logger.info("settings.%s = %r has no effect with Capstan: %s", name, value, what)
        reported.append(path)
    return reported


def _forget_reported():
    """For tests: report every field again."""
    with _reported_lock:
        _reported.clear()


#: How many running operators use each settings object (by id), and so its executor: operators
#: built without settings share the process's.
_users = {}
_users_lock = threading.Lock()


def use_executor(settings: OperatorSettings):
    """Counts a starting operator among the users of `settings` (see `retire_executor`)."""
    with _users_lock:
        _users[id(settings)] = _users.get(id(settings), 0) + 1


def retire_executor(settings: OperatorSettings):
    """Shuts down the executor of a stopping operator, leaving a fresh one of the same size
    for an operator started later in the process; returns the old one (its calls may still run).
    While other running operators use the same settings the executor is theirs too: it is left
    running (their queued calls would be cancelled) and None is returned."""
    with _users_lock:
        left = _users.get(id(settings), 1) - 1
        if left > 0:
            _users[id(settings)] = left
            return None
        _users.pop(id(settings), None)
    execution = settings.execution
    old = execution.executor
    execution.executor = _executor()
    if execution._max_workers is not None:
        execution.executor._max_workers = execution._max_workers
    old.shutdown(wait=False, cancel_futures=True)
    return old


_active: Optional[OperatorSettings] = None
_active_lock = threading.Lock()


def active() -> OperatorSettings:
    """The settings of this process's operator (one is made on first use)."""
    global _active
    with _active_lock:
        if _active is None:
            _active = OperatorSettings()
        return _active


def activate(settings: OperatorSettings):
    """Makes `settings` this process's (the running operator's)."""
    global _active
    with _active_lock:
        _active = settings


#: kopf's Event types and the lowest `posting.level` that posts them (other types as Normal).
_TYPE_LEVELS = {"Normal": logging.INFO, "Warning": logging.WARNING, "Error": logging.ERROR}


def posts_event(settings: OperatorSettings, kind: str) -> bool:
    """Whether kopf posts an explicit Event: `event` (any type) when posting is enabled;
    `info` and `exception` also need the level; `warn` needs only the level (as kopf)."""
    posting = settings.posting
    if kind == "event":
        return posting.enabled
    if kind == "warn":
        return posting.level <= logging.WARNING
    return posting.enabled and posting.level <= _TYPE_LEVELS["Error" if kind == "exception" else "Normal"]


def posts_log(settings: OperatorSettings, levelno: int) -> bool:
    """Whether a handler's log record becomes an Event: only with `posting.loggers` (kopf
    1.45's default is off), posting enabled, and at least `posting.level`."""
    posting = settings.posting
    return bool(posting.enabled and posting.loggers and levelno >= posting.level)
