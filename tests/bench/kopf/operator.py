"""The kopf baseline of the benchmark: the same handlers as the Capstan handler processes.

BENCH_HANDLERS (comma-separated presets: create, create3, update, delete, results) picks the
handlers registered for the example resource, and every call appends
"<handler id> <object name> <attempt>" to BENCH_LOG. Run with `kopf run --standalone -A`.
"""

import os

import kopf

GROUP, VERSION, PLURAL = "demo.capstan.dev", "v1", "examples"
PRESETS = {p.strip() for p in os.environ.get("BENCH_HANDLERS", "create").split(",")}
LOG = os.environ.get("BENCH_LOG")
_log = open(LOG, "a", buffering=1) if LOG else None


def log_call(handler_id, name, retry):
    if _log is not None:
        _log.write(f"{handler_id} {name} {retry + 1}\n")


def temporary(handler_id, spec, retry):
    limit = (spec.get("temporary") or {}).get(handler_id)
    if limit is not None and retry < int(limit):
        raise kopf.TemporaryError(f"temporary failure {retry + 1} of {limit}", delay=1)


if "create" in PRESETS:

    @kopf.on.create(GROUP, VERSION, PLURAL, id="create_fn")
    async def create_fn(name, spec, retry, **_):
        log_call("create_fn", name, retry)
        temporary("create_fn", spec, retry)


if "create3" in PRESETS:

    @kopf.on.create(GROUP, VERSION, PLURAL, id="create_a")
    async def create_a(name, retry, patch, **_):
        log_call("create_a", name, retry)
        patch.metadata.labels["e2e/a"] = "1"

    @kopf.on.create(GROUP, VERSION, PLURAL, id="create_b")
    async def create_b(name, retry, patch, **_):
        log_call("create_b", name, retry)
        patch.metadata.labels["e2e/b"] = "1"

    @kopf.on.create(GROUP, VERSION, PLURAL, id="create_c")
    async def create_c(name, spec, retry, **_):
        log_call("create_c", name, retry)
        temporary("create_c", spec, retry)


if "results" in PRESETS:

    @kopf.on.create(GROUP, VERSION, PLURAL, id="create_fn")
    async def create_result(name, retry, **_):
        log_call("create_fn", name, retry)
        return {"message": f"hello {name}", "attempts": retry + 1}


if "update" in PRESETS:

    @kopf.on.update(GROUP, VERSION, PLURAL, id="update_fn")
    async def update_fn(name, retry, **_):
        log_call("update_fn", name, retry)
        return {"message": f"hello {name}", "attempts": retry + 1}


if "delete" in PRESETS:

    @kopf.on.delete(GROUP, VERSION, PLURAL, id="delete_fn")
    async def delete_fn(name, retry, **_):
        log_call("delete_fn", name, retry)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    # Defaults throughout, as the benchmark compares against kopf as shipped; only the peering
    # scan is off (standalone) and the watch reconnects promptly.
    settings.peering.standalone = True


# Admission (the admission workload of `bench admission`): the same handlers as the Rust SDK
# handler's `validate` and `mutate` presets, served by kopf's own webhook server on loopback
# with the certificate in BENCH_WEBHOOK_CERT / BENCH_WEBHOOK_KEY.
if "validate" in PRESETS:

    @kopf.on.validate(GROUP, VERSION, PLURAL, id="check_size")
    async def check_size(spec, warnings, **_):
        warnings.append("checked by check_size")
        size = spec.get("size")
        if size is not None and size > 10:
            raise kopf.AdmissionError(f"size {size} is too large", code=422)


if "mutate" in PRESETS:

    @kopf.on.mutate(GROUP, VERSION, PLURAL, id="add_defaults")
    async def add_defaults(patch, warnings, **_):
        warnings.append("checked by add_defaults")
        patch.setdefault("metadata", {}).setdefault("labels", {})["e2e/mutated"] = "yes"
        patch.setdefault("spec", {})["defaulted"] = True


if PRESETS & {"validate", "mutate"}:

    @kopf.on.startup()
    async def configure_admission(settings: kopf.OperatorSettings, **_):
        cert = os.environ["BENCH_WEBHOOK_CERT"]
        settings.admission.server = kopf.WebhookServer(
            addr="127.0.0.1",
            port=int(os.environ["BENCH_WEBHOOK_PORT"]),
            host="127.0.0.1",
            certfile=cert,
            pkeyfile=os.environ["BENCH_WEBHOOK_KEY"],
            cafile=cert,
        )
        settings.admission.managed = "bench.kopf.dev"
