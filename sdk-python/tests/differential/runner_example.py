"""A test written as kopf's own example tests are (test_example_09/10/11: `KopfRunner` around
kubectl's create and delete, then `exception`, `exit_code` and the log lines checked), for
`examples_runner.py`. Run by real kopf (`kopf.testing`) and by Capstan (`capstan.kopf.testing`,
CAPSTAN_DIFFERENTIAL=capstan); prints EXAMPLE TEST PASSED when every check holds."""

import os
import subprocess
import sys
import time

if os.environ.get("CAPSTAN_DIFFERENTIAL") == "capstan":
    import capstan.kopf as kopf
    from capstan.kopf.testing import KopfRunner
else:
    import kopf
    from kopf.testing import KopfRunner

obj_yaml = os.environ["OBJ_FILE"]
example_py = os.environ["OPERATOR_FILE"]

settings = kopf.OperatorSettings()
settings.watching.server_timeout = 10  # as kopf's example tests do
with KopfRunner(["run", "--verbose", "--standalone", "-A", example_py], timeout=60, settings=settings) as runner:
    subprocess.run(["kubectl", "create", "-f", obj_yaml], check=True, timeout=10, capture_output=True)
    # Some time to react: until its handling is stored (kopf's example tests sleep 5 s).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = subprocess.run(["kubectl", "get", "-f", obj_yaml, "-o", "jsonpath={.metadata.annotations}"],
                             timeout=10, capture_output=True, text=True)
        if "last-handled-configuration" in got.stdout:
            break
        time.sleep(0.2)
    subprocess.run(["kubectl", "delete", "-f", obj_yaml], check=True, timeout=60, capture_output=True)
    time.sleep(1)  # give it some time to react

print(runner.output, file=sys.__stdout__)
assert runner.exception is None, runner.exception
assert runner.exit_code == 0, runner.exit_code

prefix = "[default/filtered]"
expected = [
    "Creation is in progress:",
    "The label has the value asked for.",
    "The label is there.",
    "The annotation has the value asked for.",
    "The condition holds.",
    "Handler 'label_present' succeeded.",
    "Deletion is in progress:",
    "Deleting it.",
]
unexpected = ["The label has another value.", "The annotation is missing.", "The condition does not hold."]
for line in expected:
    assert f"{prefix} {line}" in runner.output, f"missing: {prefix} {line}"
for line in unexpected:
    assert f"{prefix} {line}" not in runner.output, f"present: {prefix} {line}"
print("EXAMPLE TEST PASSED", file=sys.__stdout__, flush=True)
