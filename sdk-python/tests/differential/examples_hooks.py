"""The operator hooks' operator of the kopf examples' differential test
(tests/tests/python_kopf_hooks.rs), on the lines of kopf's example 13-hooks: run once by real
kopf (`kopf run`) and once by Capstan (`python -m capstan run`, with
CAPSTAN_DIFFERENTIAL=capstan selecting `capstan.kopf`).

Two startup handlers (one prepares a lock in the operator's event loop, one fails temporarily
until its fourth attempt), a login handler, an event handler on Pods that starts a background
task per Pod under the startup handler's lock, and a cleanup handler that asks those tasks to
stop. Every call goes to $DIFFERENTIAL_LOG as one JSON line."""

import asyncio
import json
import os
import time

if os.environ.get("CAPSTAN_DIFFERENTIAL") == "capstan":
    import capstan.kopf as kopf
else:
    import kopf

LOCK = None  # made by a startup handler, in the operator's event loop
STOPPERS = {}  # {namespace: {name: asyncio.Event}}


def record(handler, **fields):
    with open(os.environ["DIFFERENTIAL_LOG"], "a") as out:
        out.write(json.dumps({"handler": handler, "at": time.time(), **fields}, sort_keys=True) + "\n")


@kopf.on.startup()
async def startup_fn_simple(logger, retry, **_):
    global LOCK
    LOCK = asyncio.Lock()
    record("startup_fn_simple", retry=retry)
    logger.info("The lock is ready.")


@kopf.on.startup()
async def startup_fn_retried(retry, logger, **_):
    record("startup_fn_retried", retry=retry)
    if retry < 3:
        raise kopf.TemporaryError(f"Going to succeed in {3 - retry} attempts", delay=0.5)
    logger.info("Started after retries.")


@kopf.on.cleanup()
async def cleanup_fn(logger, **_):
    record("cleanup_fn", tasks=sorted(f"{ns}/{name}" for ns, names in STOPPERS.items() for name in names))
    for names in STOPPERS.values():
        for flag in names.values():
            flag.set()
    logger.info("All Pod tasks are asked to stop.")


@kopf.on.login(errors=kopf.ErrorsMode.PERMANENT)
async def login_fn(**kwargs):
    await asyncio.sleep(0.5)
    info = kopf.login_with_kubeconfig(**kwargs)
    record("login_fn", server=bool(info and info.server), startup_done=LOCK is not None)
    return info


@kopf.on.event("pods")
async def pod_task(namespace, name, type, **_):
    record("pod_task", name=name, type=type or "", lock_ready=LOCK is not None)
    async with LOCK:
        if name not in STOPPERS.get(namespace, {}):
            flag = asyncio.Event()
            STOPPERS.setdefault(namespace, {})[name] = flag
            asyncio.create_task(serve(name, flag))


async def serve(name, shouldstop):
    record("serve", name=name, event="start")
    while not shouldstop.is_set():
        await asyncio.sleep(0.1)
    record("serve", name=name, event="stopped")
