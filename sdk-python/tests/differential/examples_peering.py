"""The peering operator of the kopf examples' differential test
(tests/tests/python_kopf_peering.rs), on the lines of kopf's example 06-peering: one create
handler, run by two operators of different priorities in one peering, once under real kopf
(`kopf run --peering --priority`) and once under Capstan (the controller's `--peering
--priority`, CAPSTAN_DIFFERENTIAL=capstan selecting `capstan.kopf`). Each call goes to
$DIFFERENTIAL_LOG with the operator's name ($OPERATOR_NAME)."""

import json
import os
import time

if os.environ.get("CAPSTAN_DIFFERENTIAL") == "capstan":
    import capstan.kopf as kopf
else:
    import kopf


@kopf.on.create("demo.capstan.dev", "v1", "examples")
def create_fn(name, **_):
    with open(os.environ["DIFFERENTIAL_LOG"], "a") as out:
        out.write(json.dumps({"handler": "create_fn", "name": name, "operator": os.environ["OPERATOR_NAME"],
                              "at": time.time()}) + "\n")
