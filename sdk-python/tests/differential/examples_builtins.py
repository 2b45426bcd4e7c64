"""The built-in resources and indexes operator of the kopf examples' differential test
(tests/tests/python_kopf_builtins_indexes.rs), on the lines of kopf's examples 10-builtins and
16-indexing: run once by real kopf (`kopf run`) and once by Capstan (`python -m capstan run`,
with CAPSTAN_DIFFERENTIAL=capstan selecting `capstan.kopf`).

Pods are the built-in resource: one function decorated for both resuming and creating starts
a task of its own per Pod (kept in a module-level map, as the example keeps it), which a delete
handler cancels. Two indexes over the Pods are read by a timer of an Example, which puts what
it saw into the Example's status. Handler calls go to $DIFFERENTIAL_LOG, the timer's ticks to
$DIFFERENTIAL_SIDE_LOG, one JSON line each."""

import asyncio
import json
import os
import time

if os.environ.get("CAPSTAN_DIFFERENTIAL") == "capstan":
    import capstan.kopf as kopf
else:
    import kopf

tasks = {}  # {namespace: {name: asyncio.Task}}


def record(handler, name, log="DIFFERENTIAL_LOG", **fields):
    with open(os.environ[log], "a") as out:
        out.write(json.dumps({"handler": handler, "name": name, "at": time.time(), **fields}, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------
# Built-in resources (10-builtins).

@kopf.on.resume("", "v1", "pods")
@kopf.on.create("", "v1", "pods")
async def pod_in_sight(namespace, name, reason, logger, **_):
    # The task outlives the handler: it runs in the operator's event loop until it ends or
    # the Pod's delete handler cancels it.
    record("pod_in_sight", name, reason=str(getattr(reason, "value", reason)))
    task = asyncio.create_task(pod_watcher(namespace, name, logger))
    tasks.setdefault(namespace, {})[name] = task


@kopf.on.delete("", "v1", "pods")
async def pod_deleted(namespace, name, reason, **_):
    record("pod_deleted", name, reason=str(getattr(reason, "value", reason)))
    task = tasks.get(namespace, {}).get(name)
    if task is not None:
        task.cancel()


async def pod_watcher(namespace, name, logger, timeout=300):
    try:
        record("pod_watcher", name, event="start")
        logger.info(f"=== Pod {name} is watched for {timeout}s.")
        await asyncio.sleep(timeout)
        record("pod_watcher", name, event="expired")
    except asyncio.CancelledError:
        record("pod_watcher", name, event="cancelled")
    finally:
        tasks.get(namespace, {}).pop(name, None)


# ---------------------------------------------------------------------------------------------
# Indexes (16-indexing).

@kopf.index("pods")
def is_running(namespace, name, status: kopf.Status, **_):
    return {(namespace, name): status.get("phase") == "Running"}


@kopf.index("pods")
def by_label(labels: kopf.Labels, name, **_):
    return {(label, value): name for label, value in labels.items()}


@kopf.timer("demo.capstan.dev", "v1", "examples", interval=0.3)
def indexed(name, is_running: kopf.Index, by_label: kopf.Index, patch: kopf.Patch, **_):
    running = sorted(f"{ns}::{pod}" for (ns, pod), flags in is_running.items() if all(flags))
    labels = {f"{label}={value}": sorted(names) for (label, value), names in by_label.items()}
    keys = sorted(f"{ns}::{pod}" for ns, pod in is_running)
    record("indexed", name, log="DIFFERENTIAL_SIDE_LOG", running=running, labels=labels, keys=keys,
           lengths=[len(is_running), len(by_label)],
           missing=("default", "nobody") in is_running,
           store_types=sorted({type(store).__name__ for store in is_running.values()}))
    patch.status["running-pods"] = running
