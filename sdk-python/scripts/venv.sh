#!/usr/bin/env bash
# Creates (once) the virtual environment that runs the Python SDK's tests and its end-to-end
# test operator, with pinned versions within sdk-python/pyproject.toml's ranges (the newest
# grpcio and protobuf; the end-to-end test of a fresh install takes the oldest), and prints its
# python. The protocol code generator has a venv of its own (sdk-python/generate.sh).
# Idempotent: an environment with these pins is reused. The SDK itself is used from the source
# tree (PYTHONPATH=sdk-python), so one environment serves every checkout.
# Location: $CAPSTAN_PYTHON_SDK_VENV, or ~/.cache/capstan/python-sdk-venv.
set -euo pipefail

pins=(grpcio==1.85.1 protobuf==7.36.2 pyyaml==6.0.4 pytest==9.2.0 vermin==1.9.2)
venv=${CAPSTAN_PYTHON_SDK_VENV:-$HOME/.cache/capstan/python-sdk-venv}
python=${PYTHON:-python3}
stamp="$venv/.pins-$(printf '%s ' "${pins[@]}" | sha256sum | cut -c1-16)"

if [[ ! -f "$stamp" ]]; then
	rm -rf "$venv"
	"$python" -m venv "$venv" >&2
	"$venv/bin/pip" install --quiet --disable-pip-version-check "${pins[@]}" >&2
	touch "$stamp"
fi
echo "$venv/bin/python"
