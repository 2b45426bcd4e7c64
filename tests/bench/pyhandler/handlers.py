"""The benchmark's handler process written with the Python SDK (sdk-python), run as
`python -m capstan run --quiet handlers.py`. Like bench-go-handler, BENCH_HANDLERS
(comma-separated presets: create, create3, update, delete, results) picks the handlers it
registers for the example resource, and every call appends "<handler id> <object name>
<attempt>" to BENCH_LOG. Handlers are async: they run on the event loop, as kopf's do."""

import os

import capstan

RESOURCE = "examples.demo.capstan.dev"
_log = open(os.environ["BENCH_LOG"], "a", buffering=1) if os.environ.get("BENCH_LOG") else None


def _record(handler_id, name, retry):
    if _log is not None:
        _log.write(f"{handler_id} {name} {retry + 1}\n")


def _temporary(handler_id, spec, retry):
    limit = int((spec.get("temporary") or {}).get(handler_id, 0))
    if retry < limit:
        raise capstan.TemporaryError(f"temporary failure {retry + 1} of {limit}", delay=1)


def _plain(handler_id):
    async def handler(name, spec, retry, **_):
        _record(handler_id, name, retry)
        _temporary(handler_id, spec, retry)

    return handler


def _labelled(handler_id, value):
    async def handler(name, retry, patch, **_):
        _record(handler_id, name, retry)
        patch.metadata.labels[f"e2e/{value}"] = "1"

    return handler


def _with_result(handler_id):
    async def handler(name, retry, **_):
        _record(handler_id, name, retry)
        return {"message": f"hello {name}", "attempts": retry + 1}

    return handler


for preset in (os.environ.get("BENCH_HANDLERS") or "create").split(","):
    preset = preset.strip()
    if preset == "create":
        capstan.on.create(RESOURCE, id="create_fn")(_plain("create_fn"))
    elif preset == "create3":
        capstan.on.create(RESOURCE, id="create_a")(_labelled("create_a", "a"))
        capstan.on.create(RESOURCE, id="create_b")(_labelled("create_b", "b"))
        capstan.on.create(RESOURCE, id="create_c")(_plain("create_c"))
    elif preset == "results":
        capstan.on.create(RESOURCE, id="create_fn")(_with_result("create_fn"))
    elif preset == "update":
        capstan.on.update(RESOURCE, id="update_fn")(_with_result("update_fn"))
    elif preset == "delete":
        capstan.on.delete(RESOURCE, id="delete_fn")(_plain("delete_fn"))
    elif preset:
        raise SystemExit(f"unknown preset {preset!r}")
