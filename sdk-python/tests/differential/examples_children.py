"""The children operator of the kopf examples' differential test
(tests/tests/python_kopf_children_filters.rs), on the lines of kopf's example 02-children: run
once by real kopf (`kopf run`) and once by Capstan (`python -m capstan run`, with
CAPSTAN_DIFFERENTIAL=capstan selecting `capstan.kopf`).

On the creation of an Example, the create handler builds a ConfigMap, makes it the Example's
child with `kopf.adopt` (no owner given: the object being handled) and `kopf.label`, creates it
with kubectl (neither virtualenv has a Kubernetes client library; $KUBECONFIG points at the API
server) and returns the child's uid, which lands in the Example's status. Each call is appended
to $DIFFERENTIAL_LOG as one JSON line: the handler id, the object's name, and the child as the
helpers left it before it was created."""

import json
import os
import subprocess

if os.environ.get("CAPSTAN_DIFFERENTIAL") == "capstan":
    import capstan.kopf as kopf
else:
    import kopf

RESOURCE = ("demo.capstan.dev", "v1", "examples")


def record(handler, name, child):
    with open(os.environ["DIFFERENTIAL_LOG"], "a") as log:
        log.write(json.dumps({"handler": handler, "name": name, "child": child}, sort_keys=True) + "\n")


@kopf.on.create(*RESOURCE)
def create_fn(name, spec, **_):
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        # A label of its own, which the parent's labels copied by adopt() must not overwrite.
        "metadata": {"labels": {"app": "child"}},
        "data": {"field": spec.get("field", "default-value")},
    }

    # Make it our child: owner reference, name after the parent, namespace, parent's labels.
    kopf.adopt(child)
    kopf.label(child, {"from": "parent"})
    record("create_fn", name, child)

    created = subprocess.run(
        ["kubectl", "create", "-o", "json", "-f", "-"],
        input=json.dumps(child), capture_output=True, text=True, check=True, timeout=30,
    )
    uid = json.loads(created.stdout)["metadata"]["uid"]
    return {"children": [uid]}
