"""kopf's names over Capstan: `import capstan.kopf as kopf` and a kopf operator file runs
unchanged, as long as it uses what the controller supports (see sdk-python/README.md).

Names that belong to the controller in Capstan (`OperatorSettings`, `login_via_client`,
`login_with_service_account`, ...) fail loudly when used: their job is done by the
controller's flags.
"""

from capstan import *  # noqa: F401,F403
from capstan import __all__ as _capstan_all
from capstan.errors import RegistrationError
from capstan.structs import DaemonStopped, SyncDaemonStopped

# kopf's type names for the daemons' flags and kwargs' types.
DaemonStopped = DaemonStopped
SyncDaemonStopperChecker = SyncDaemonStopped
AsyncDaemonStopperChecker = DaemonStopped


class _ControllerOwned:
    """A kopf name whose job the controller does: using it fails with what to do instead."""

    def __init__(self, name, instead):
        self._name = name
        self._instead = instead

    def __call__(self, *args, **kwargs):
        raise RegistrationError(f"kopf.{self._name} is not available with Capstan: {self._instead}")

    def __getattr__(self, attr):
        raise RegistrationError(f"kopf.{self._name} is not available with Capstan: {self._instead}")


OperatorSettings = _ControllerOwned("OperatorSettings", "operator settings are the controller's flags (capstan run --help)")
login_via_client = _ControllerOwned("login_via_client", "the controller logs in to the API itself")
login_via_pykube = _ControllerOwned("login_via_pykube", "the controller logs in to the API itself")
login_with_service_account = _ControllerOwned("login_with_service_account", "the controller logs in to the API itself")
login_with_kubeconfig = _ControllerOwned("login_with_kubeconfig", "the controller logs in to the API itself")
spawn_tasks = _ControllerOwned("spawn_tasks", "use capstan.operator() or capstan.run()")
run_tasks = _ControllerOwned("run_tasks", "use capstan.operator() or capstan.run()")

__all__ = list(_capstan_all) + [
    "SyncDaemonStopperChecker", "AsyncDaemonStopperChecker", "OperatorSettings", "login_via_client",
    "login_via_pykube", "login_with_service_account", "login_with_kubeconfig", "spawn_tasks", "run_tasks",
]
