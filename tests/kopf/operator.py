"""A small kopf operator for the migration tests (`tests/tests/kopf_migration.rs`).

It handles the example resource of the tests with the same handler ids as the tests' SDK
handler process (`create_fn`, `update_fn`), so that Capstan in kopf-compatible mode and this
operator can take objects over from each other. Every call appends `<handler> <name>` to the
file named by `KOPF_E2E_LOG`. Like the SDK handler process, `spec.temporary.<handler>: N` makes
the handler fail with a temporary error (1 s delay) on its first N attempts.

Run with: kopf run --standalone -A tests/kopf/operator.py
"""

import os

import kopf

RESOURCE = ("demo.capstan.dev", "v1", "examples")


def _log(handler: str, name: str) -> None:
    path = os.environ.get("KOPF_E2E_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{handler} {name}\n")


def _behave(handler: str, name: str, spec: kopf.Spec, retry: int) -> None:
    _log(handler, name)
    failures = spec.get("temporary", {}).get(handler, 0)
    if retry < failures:
        raise kopf.TemporaryError(f"temporary failure {retry + 1} of {failures}", delay=1)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    # No Kubernetes Events: the test's API server has no use for them.
    settings.posting.enabled = False


@kopf.on.create(*RESOURCE)
def create_fn(name: str, spec: kopf.Spec, retry: int, **_) -> None:
    _behave("create_fn", name, spec, retry)


@kopf.on.update(*RESOURCE)
def update_fn(name: str, spec: kopf.Spec, retry: int, **_) -> None:
    _behave("update_fn", name, spec, retry)
