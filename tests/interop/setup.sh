#!/usr/bin/env bash
# Creates (once) the Python virtual environment with the stock grpcio client that the
# interoperability tests drive (and Prometheus' Python client, whose parser reads /metrics),
# and prints its python. Idempotent: an environment with the pinned versions is reused. Location: $CAPSTAN_INTEROP_VENV, or ~/.cache/capstan/interop-venv.
set -euo pipefail

GRPCIO_VERSION=1.85.1
# Prometheus' own Python client: its text-format parser reads the controller's /metrics page.
PROMETHEUS_CLIENT_VERSION=0.23.1
venv=${CAPSTAN_INTEROP_VENV:-$HOME/.cache/capstan/interop-venv}
python=${PYTHON:-python3}
stamp="$venv/.grpcio-$GRPCIO_VERSION-prometheus-client-$PROMETHEUS_CLIENT_VERSION"

if [[ ! -f "$stamp" ]]; then
	rm -rf "$venv"
	"$python" -m venv "$venv" >&2
	"$venv/bin/pip" install --quiet --disable-pip-version-check \
		"grpcio==$GRPCIO_VERSION" "grpcio-tools==$GRPCIO_VERSION" \
		"prometheus-client==$PROMETHEUS_CLIENT_VERSION" >&2
	touch "$stamp"
fi
echo "$venv/bin/python"
