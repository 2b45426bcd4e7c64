#!/usr/bin/env bash
# Regenerates the protocol code in capstan/v1/ from ../proto with grpcio-tools (the version
# pinned in pyproject.toml's "dev" extra). With --check, fails if the committed code differs
# from what the .proto files generate. PYTHON selects the interpreter (one with grpcio-tools).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python3}
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
