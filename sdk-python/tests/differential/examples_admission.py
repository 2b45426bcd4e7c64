"""The admission operator of the kopf examples' differential test
(tests/tests/python_kopf_admission.rs), on the lines of kopf's example 17-admission: run once by
real kopf (`kopf run`) and once by Capstan (`python -m capstan run`, with
CAPSTAN_DIFFERENTIAL=capstan selecting `capstan.kopf`).

The startup handler configures kopf's own webhook server (a local endpoint with the test's
certificate, $WEBHOOK_PORT) and the name of the configurations kopf manages; under Capstan the
controller serves the webhooks (its --webhook-listen and --webhook-managed flags), and the same
settings are accepted and named as those flags. Validating handlers warn (with the request's
User-Agent header, and whether the API server presented a certificate), deny with kopf's
default code and with a code of their own, and skip dry runs; a mutating handler patches
labelled objects."""

import os

if os.environ.get("CAPSTAN_DIFFERENTIAL") == "capstan":
    import capstan.kopf as kopf
else:
    import kopf

RESOURCE = ("demo.capstan.dev", "v1", "examples")


@kopf.on.startup()
def config(settings: kopf.OperatorSettings, **_):
    settings.admission.server = kopf.WebhookServer(
        addr="127.0.0.1", host="127.0.0.1", port=int(os.environ["WEBHOOK_PORT"]),
        certfile=os.environ["WEBHOOK_CERT"], pkeyfile=os.environ["WEBHOOK_KEY"])
    settings.admission.managed = "auto.kopf.dev"
    settings.networking.request_timeout = 45


@kopf.on.validate(*RESOURCE)
def authhook(name, operation, headers: kopf.Headers, sslpeer: kopf.SSLPeer, warnings: list, **_):
    warnings.append(f"{operation} of {name} as user-agent: {headers.get('User-Agent', '(unidentified)')}")
    peer = "SSL peer is not identified." if not sslpeer.get("subject") else "SSL peer is identified."
    warnings.append(f"{operation} of {name}: {peer}")


@kopf.on.validate(*RESOURCE)
def validate1(spec, dryrun, **_):
    if not dryrun and spec.get("field") == "wrong":
        raise kopf.AdmissionError("Meh! I don't like it. Change the field.")


@kopf.on.validate(*RESOURCE, field="spec.field", value="not-allowed")
def validate2(**_):
    raise kopf.AdmissionError("I'm too lazy anyway. Go away!", code=555)


@kopf.on.validate(*RESOURCE, field="spec.field", value="no-code")
def validate3(**_):
    raise kopf.AdmissionError("Denied without a code.")


@kopf.on.mutate(*RESOURCE, labels={"somelabel": "somevalue"})
def mutate1(patch: kopf.Patch, **_):
    patch.spec["injected"] = 123
