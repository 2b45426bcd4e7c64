"""The example operator for `examples.demo.capstan.dev`, written as a kopf operator and run
by Capstan: `python -m capstan run examples/operator.py`.

It labels and greets new objects, follows `spec.field`, retries while `spec.fail_times` says
so, fails for good on `spec.reject`, sets up each of `spec.items` in a sub-handler of its own,
runs a daemon and a timer for objects annotated `demo.capstan.dev/watch`, says goodbye on
deletion, and reports how many objects it created to the controller's liveness probe.
"""

import threading

import capstan.kopf as kopf

RESOURCE = ("demo.capstan.dev", "v1", "examples")
_lock = threading.Lock()
_created = {"count": 0}


@kopf.on.startup()
def startup_fn(logger, **_):
    logger.info("example operator startup done")


@kopf.on.cleanup()
async def cleanup_fn(logger, **_):
    logger.info("example operator cleanup done")


@kopf.on.probe(id="created")
def created(**_):
    with _lock:
        return _created["count"]


@kopf.on.create(*RESOURCE)
def create_fn(name, spec, patch, retry, logger, **_):
    if spec.get("reject"):
        raise kopf.PermanentError(f"{name} is rejected by its spec")
    if retry < spec.get("fail_times", 0):
        raise kopf.TemporaryError(f"not ready yet (attempt {retry + 1} of {spec['fail_times']} failing)", delay=1)
    patch.metadata.labels["demo.capstan.dev/handled-by"] = "python"
    logger.info(f"creating {name} after {retry} retries")
    with _lock:
        _created["count"] += 1
    return {"message": f"hello {name} from python", "retries": retry}


@kopf.on.create(*RESOURCE)
def setup(spec, **_):
    for item in spec.get("items", []):

        @kopf.subhandler(id=f"item-{item}")
        def setup_item(patch, retry, item=item, **_):
            if item.startswith("slow") and retry < 1:
                raise kopf.TemporaryError(f"{item} is not ready yet", delay=1)
            patch.metadata.annotations[f"demo.capstan.dev/{item}"] = f"ready after {retry} retries"


@kopf.on.update(*RESOURCE)
def update_fn(name, diff, patch, **_):
    patch.status["changed"] = [".".join(item.field) for item in diff]
    return {"message": f"updated {name} from python"}


@kopf.on.field(*RESOURCE, field="spec.field")
def field_fn(old, new, patch, **_):
    patch.metadata.annotations["demo.capstan.dev/field"] = f"{old or 'none'}->{new}"


@kopf.daemon(*RESOURCE, cancellation_timeout=10, annotations={"demo.capstan.dev/watch": kopf.PRESENT})
async def monitor(stopped, spec, name, logger, **_):
    seen = None
    while not stopped:
        if spec.get("field") != seen:
            seen = spec.get("field")
            logger.info(f"monitor of {name} sees {seen}")
        await stopped.wait(0.2)
    logger.info(f"monitor of {name} stopped: {stopped.reason.value}")


@kopf.timer(*RESOURCE, interval=1, annotations={"demo.capstan.dev/watch": kopf.PRESENT})
def tick(status, patch, **_):
    patch.status["ticks"] = (status.get("ticks") or 0) + 1


@kopf.on.delete(*RESOURCE)
def delete_fn(name, logger, **_):
    logger.info(f"deleting {name}")
