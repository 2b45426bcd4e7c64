"""kopf's names over Capstan: `import capstan.kopf as kopf` and a kopf operator file runs
unchanged. Every public name of kopf 1.45 is here (tests/test_kopf_namespace.py compares with
real kopf): each works as in kopf, or — where its job is the controller's (settings, webhook
servers, storages, login helpers) — is accepted and mapped, as sdk-python/README.md tells.
"""

import asyncio
import enum
import logging

from capstan import *  # noqa: F401,F403
from capstan import __all__ as _capstan_all
from capstan import lifecycles, runner
from capstan.filters import not_
from capstan.invoke import LocalObjectLogger, ObjectLogger, execute
from capstan.lifecycles import get_default_lifecycle, set_default_lifecycle
from capstan.logins import (
    LoginError, login_via_async_client, login_via_client, login_via_pykube, login_with_kubeconfig,
    login_with_service_account,
)
from capstan.registry import Registry as OperatorRegistry
from capstan.registry import get_default_registry, set_default_registry
from capstan.settings import (  # noqa: F401 (the sections too: kopf's classes of OperatorSettings' fields)
    AdmissionSettings, BackgroundSettings, ExecutionSettings, NetworkingSettings, OperatorSettings,
    PeeringSettings, PersistenceSettings, PostingSettings, ProcessSettings, QueueingSettings, ScanningSettings,
    WatchingSettings,
)
from capstan.signatures import (
    Annotations, BodyEssence, FieldPath, FieldSpec, HandlerId, Headers, Labels, Logger, ObjectReference, Operation,
    OwnerReference, PatchFn, RawBody, RawEvent, RawEventType, SSLPeer, UserInfo, WebhookClientConfig,
    WebhookClientConfigService, WebhookFn, WebhookServerProtocol, build_object_reference,
)
from capstan.storages import (
    AnnotationsDiffBaseStorage, AnnotationsProgressStorage, DiffBaseStorage, MultiDiffBaseStorage,
    MultiProgressStorage, ProgressStorage, SmartProgressStorage, StatusDiffBaseStorage, StatusProgressStorage,
)
from capstan.structs import ConnectionInfo, DaemonStopped, Spec, Status, SyncDaemonStopped
from capstan.webhooks import (
    WebhookAutoServer, WebhookAutoTunnel, WebhookDockerDesktopServer, WebhookK3dServer, WebhookMinikubeServer,
    WebhookNgrokTunnel, WebhookServer,
)

log = logging.getLogger("capstan")

# kopf's type names for the daemons' flags.
DaemonStopped = DaemonStopped
SyncDaemonStopperChecker = SyncDaemonStopped
AsyncDaemonStopperChecker = DaemonStopped


class _Marker(enum.Enum):
    EVERYTHING = 1


#: kopf's marker for "every resource" (`kopf.on.event(kopf.EVERYTHING)`); the controller
#: serves named resources only, so a decorator given it fails, saying so.
EVERYTHING = _Marker.EVERYTHING


class ProgressRecord(dict):
    """One handler's progress record, as kopf's storages keep it (the controller keeps them
    with Capstan)."""


class AiohttpSession(ConnectionInfo):
    """kopf's credentials as an aiohttp session; the controller makes every API request."""


class LogFormat(enum.Enum):
    """kopf's log formats (`kopf run --log-format`)."""

    PLAIN = "%(message)s"
    FULL = "[%(asctime)s] %(name)-20.20s [%(levelname)-8.8s] %(message)s"
    JSON = "-json-"


def configure(debug=None, verbose=None, quiet=None, log_format=LogFormat.FULL, log_prefix=False, log_refkey=None):
    """kopf's `kopf.configure()`: the process's logging, as `python -m capstan run` sets it."""
    fmt = {LogFormat.PLAIN: "plain", LogFormat.FULL: "full", LogFormat.JSON: "json"}.get(log_format, "full")
    runner.configure_logging(verbose=bool(verbose), debug=bool(debug), quiet=bool(quiet), log_format=fmt)



#: kopf.run()/kopf.operator() options that are the controller's flags, with those flags.
_CONTROLLER_OPTIONS = {
    "standalone": "--standalone", "priority": "--priority", "peering_name": "--peering",
    "liveness_endpoint": "--admin-listen", "clusterwide": "-A/--all-namespaces", "namespaces": "-n/--namespace",
    "namespace": "-n/--namespace", "lifecycle": None, "indexers": None, "memories": None, "vault": None,
    "ready_flag": None, "loop": None, "_command": None,
}


def _operator_options(settings, options):
    unknown = sorted(set(options) - set(_CONTROLLER_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}")
    flags = [f"{k} ({_CONTROLLER_OPTIONS[k]})" for k, v in options.items() if v and _CONTROLLER_OPTIONS.get(k)]
    if flags:
        log.info("the controller's flags do the job of these options: %s", ", ".join(flags))


async def operator(*, registry=None, settings=None, memo=None, stop_flag=None, **options):
    """kopf's `kopf.operator()`: serves the handlers until `stop_flag` is set; kopf's
    options that are the controller's flags are accepted and named once."""
    _operator_options(settings, options)
    await runner.operator(registry=registry, memo=memo, stop_flag=stop_flag, settings=settings,
                          ready_flag=options.get("ready_flag"))


def run(*, registry=None, settings=None, memo=None, stop_flag=None, **options):
    """kopf's `kopf.run()`: serves the handlers until SIGTERM or SIGINT (or `stop_flag`)."""
    _operator_options(settings, options)
    runner.run(registry=registry, memo=memo, settings=settings, stop_flag=stop_flag,
               ready_flag=options.get("ready_flag"))


async def spawn_tasks(*, registry=None, settings=None, memo=None, stop_flag=None, **options):
    """kopf's `kopf.spawn_tasks()`: the operator as a task, for `kopf.run_tasks()`."""
    _operator_options(settings, options)
    return [asyncio.create_task(runner.operator(registry=registry, memo=memo, stop_flag=stop_flag, settings=settings,
                                                ready_flag=options.get("ready_flag")),
                                name="capstan-operator")]


async def run_tasks(root_tasks, *, ignored=frozenset()):
    """kopf's `kopf.run_tasks()`: waits for the tasks; the first failure stops the rest."""
    try:
        done, pending = await asyncio.wait(root_tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in root_tasks:
            if not task.done():
                task.cancel()
    for task in done:
        if task not in ignored and not task.cancelled() and task.exception() is not None:
            raise task.exception()


__all__ = sorted(set(_capstan_all) | {
    "Annotations", "AnnotationsDiffBaseStorage", "AnnotationsProgressStorage", "AiohttpSession", "AsyncDaemonStopperChecker",
    "BodyEssence", "DiffBaseStorage", "EVERYTHING", "FieldPath", "FieldSpec", "HandlerId", "Headers", "Labels",
    "LocalObjectLogger", "LogFormat", "Logger", "LoginError", "MultiDiffBaseStorage", "MultiProgressStorage",
    "ObjectLogger", "ObjectReference", "Operation", "OperatorRegistry", "OperatorSettings", "OwnerReference", "PatchFn",
    "ProgressRecord", "ProgressStorage", "RawBody", "RawEvent", "RawEventType", "SSLPeer", "SmartProgressStorage", "Spec",
    "Status", "StatusDiffBaseStorage", "StatusProgressStorage", "SyncDaemonStopperChecker", "UserInfo",
    "WebhookAutoServer", "WebhookAutoTunnel", "WebhookClientConfig", "WebhookClientConfigService",
    "WebhookDockerDesktopServer", "WebhookFn", "WebhookK3dServer", "WebhookMinikubeServer", "WebhookNgrokTunnel",
    "WebhookServer", "WebhookServerProtocol", "build_object_reference", "configure", "execute",
    "get_default_lifecycle", "get_default_registry", "lifecycles", "login_via_async_client", "login_via_client",
    "login_via_pykube", "login_with_kubeconfig", "login_with_service_account", "not_", "operator", "run", "run_tasks",
    "set_default_lifecycle", "set_default_registry", "spawn_tasks",
} - {"default_registry", "RegistrationError", "SyncDaemonStopped", "configure_logging", "set_max_in_flight"})
