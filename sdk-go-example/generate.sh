#!/usr/bin/env bash
# Regenerates the Go code of the capstan.v1 protocol (gen/capstan/v1) from ../proto.
#
# Usage: ./generate.sh            regenerate gen/ in place
#        ./generate.sh --check    fail when gen/ differs from what the protos generate now
#
# The protoc plugins are the versions pinned below (they are not `tool` dependencies in go.mod,
# which would raise the module's `go` directive to 1.24 for every user). buf is the version
# pinned for proto/lint.sh, installed into ${CAPSTAN_BIN} when it is missing.
#
# Environment:
#   CAPSTAN_BIN  where buf is installed and looked for (default: $HOME/.cache/capstan/bin)
#   BUF_VERSION  the pinned buf version installed when buf is missing (default: v1.50.0)
set -euo pipefail

check=false
case "${1:-}" in
  "") ;;
  --check) check=true ;;
  *)
    echo "usage: $0 [--check]" >&2
    exit 2
    ;;
esac

module_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin_dir="${CAPSTAN_BIN:-$HOME/.cache/capstan/bin}"
buf_version="${BUF_VERSION:-v1.50.0}"
buf="$bin_dir/buf"
protoc_gen_go="google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12"
protoc_gen_go_grpc="google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2"
export GOTOOLCHAIN=local

if [[ ! -x "$buf" ]]; then
  echo "installing buf $buf_version into $bin_dir" >&2
  mkdir -p "$bin_dir"
  GOBIN="$bin_dir" go install "github.com/bufbuild/buf/cmd/buf@$buf_version"
fi

cd "$module_dir"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The plugins, built at their pinned versions.
mkdir -p "$work/bin"
GOBIN="$work/bin" go install "$protoc_gen_go"
GOBIN="$work/bin" go install "$protoc_gen_go_grpc"
export PATH="$work/bin:$PATH"

if ! $check; then
  "$buf" generate
  echo "generated gen/capstan/v1" >&2
  exit 0
fi

"$buf" generate --output "$work/out"
if ! diff -ru gen "$work/out/gen"; then
  echo "gen/ is stale: run sdk-go-example/generate.sh and commit the result" >&2
  exit 1
fi
echo "gen/ is up to date" >&2
