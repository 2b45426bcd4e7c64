#!/usr/bin/env bash
# Regenerates the protocol code in capstan/v1/ from ../proto with grpcio-tools 1.80.1 (pinned
# in pyproject.toml's "dev" extra). The generated code checks at import that the installed
# grpcio and protobuf are at least the generator's (grpcio 1.80.1, protobuf 6.31.1): this
# generator keeps those the oldest releases the package admits, ones that still publish wheels
# for Python 3.9. With --check, fails if the committed code differs from what the .proto files
# generate. The generator runs in a venv of its own (its protobuf is older than the test venv's),
# created once: $CAPSTAN_PYTHON_SDK_PROTOC_VENV, or ~/.cache/capstan/python-sdk-protoc-venv, made
# with $PYTHON (default python3).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
pins=(grpcio-tools==1.80.1 grpcio==1.80.1 protobuf==6.33.6)
venv=${CAPSTAN_PYTHON_SDK_PROTOC_VENV:-$HOME/.cache/capstan/python-sdk-protoc-venv}
stamp="$venv/.pins-$(printf '%s ' "${pins[@]}" | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
	rm -rf "$venv"
	"${PYTHON:-python3}" -m venv "$venv" >&2
	"$venv/bin/pip" install --quiet --disable-pip-version-check "${pins[@]}" >&2
	touch "$stamp"
fi
python=$venv/bin/python
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

well_known=$("$python" -c 'import importlib.resources as r; print(r.files("grpc_tools") / "_proto")')
(cd "$here/../proto" && "$python" -m grpc_tools.protoc -I. -I"$well_known" \
	--python_out="$out" --grpc_python_out="$out" capstan/v1/*.proto)
touch "$out/capstan/v1/__init__.py"
printf '"""Generated from proto/capstan/v1 by sdk-python/generate.sh: do not edit."""\n' >"$out/capstan/v1/__init__.py"

if [[ "${1:-}" == "--check" ]]; then
	if ! diff -r "$out/capstan/v1" "$here/capstan/v1" >&2; then
		echo "sdk-python/capstan/v1 is stale: run sdk-python/generate.sh" >&2
		exit 1
	fi
	exit 0
fi
rm -f "$here"/capstan/v1/*.py
cp "$out"/capstan/v1/*.py "$here/capstan/v1/"
