#!/usr/bin/env bash
# Runs every check and test of Capstan: formatting, lints (Rust and protobuf), unit tests,
# protocol tests over a real Unix socket, and end-to-end tests against a real kube-apiserver
# (built from Go modules on first use). Needs Rust (cargo, rustfmt, clippy), Go, Node 20 with
# npm, kubectl and Python 3 (venvs with a pinned grpcio are created once, for the interoperability tests and
# the Python SDK, and one with real kopf pinned, which the SDK's kopf tests compare against).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/capstan/target}
export GOTOOLCHAIN=local

step() { printf '\n==> %s\n' "$*"; }

step "rustfmt"
cargo fmt --all -- --check

step "clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "protobuf lint and breaking-change check"
bash proto/lint.sh

step "Go SDK: vet, staticcheck, unit tests, generated code up to date"
# staticcheck pinned, installed once from the Go module proxy into a cached GOBIN.
staticcheck_version=v0.8.2
gobin=$HOME/.cache/capstan/gobin
if [[ "$("$gobin/staticcheck" -version 2>/dev/null)" != *"(${staticcheck_version#v})"* ]]; then
	GOBIN=$gobin go install "honnef.co/go/tools/cmd/staticcheck@$staticcheck_version"
fi
(cd sdk-go-example && go vet ./... && "$gobin/staticcheck" ./... && go test ./... && ./generate.sh --check)

step "real API server (tests/testenv)"
CAPSTAN_TESTENV_BIN=$(bash tests/testenv/build.sh | tail -n1)
export CAPSTAN_TESTENV_BIN

step "stock grpcio client for the interoperability tests (tests/interop)"
CAPSTAN_INTEROP_PYTHON=$(bash tests/interop/setup.sh | tail -n1)
export CAPSTAN_INTEROP_PYTHON

step "Python SDK: pinned venv, pytest (with the generated-code and Python 3.9 checks)"
CAPSTAN_PYTHON_SDK_PYTHON=$(bash sdk-python/scripts/venv.sh | tail -n1)
export CAPSTAN_PYTHON_SDK_PYTHON
# Real kopf, pinned with its dependencies, that the kopf-compatibility tests compare against.
CAPSTAN_KOPF_PYTHON=$(bash sdk-python/scripts/kopf-venv.sh | tail -n1)
export CAPSTAN_KOPF_PYTHON
(cd sdk-python && "$CAPSTAN_PYTHON_SDK_PYTHON" -m pytest -q tests)

step "TypeScript SDK: pinned npm install, build (stubs generated from proto/), unit tests"
bash sdk-typescript/scripts/build.sh >/dev/null
(cd sdk-typescript && node --test dist/test/)

step "cargo test"
cargo build --workspace --all-targets --locked
# The end-to-end tests run this build's binary instead of building their own.
export CAPSTAN_TEST_BINARY="$CARGO_TARGET_DIR/debug/capstan"
cargo test --workspace --locked

step "conformance kit: every SDK (Rust, Go, Python, TypeScript) and a raw grpcio handler (tests/conformance)"
"$CARGO_TARGET_DIR/debug/capstan-conformance" --all --report "$CARGO_TARGET_DIR/conformance-report.json"
