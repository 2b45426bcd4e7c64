#!/usr/bin/env bash
# Lints the capstan.v1 protos with buf and checks them for breaking changes against main.
#
# Usage: proto/lint.sh    (from any directory)
#
# Environment:
#   CAPSTAN_BIN  where buf is installed and looked for (default: $HOME/.cache/capstan/bin)
#   BUF_VERSION  the pinned buf version installed when buf is missing (default: v1.50.0)
#   BUF_AGAINST  the buf input to compare against (default: ../.git#branch=main,subdir=proto);
#                the breaking check is skipped when its git branch, tag or ref does not exist
#
# buf is installed with `go install` from the Go module proxy only when it is not there yet;
# everything else runs offline.
set -euo pipefail

proto_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin_dir="${CAPSTAN_BIN:-$HOME/.cache/capstan/bin}"
buf_version="${BUF_VERSION:-v1.50.0}"
buf="$bin_dir/buf"

if [[ ! -x "$buf" ]]; then
  echo "installing buf $buf_version into $bin_dir" >&2
  mkdir -p "$bin_dir"
  GOTOOLCHAIN=local GOBIN="$bin_dir" go install "github.com/bufbuild/buf/cmd/buf@$buf_version"
fi

cd "$proto_dir"

echo "buf lint ($("$buf" --version))" >&2
"$buf" lint

against="${BUF_AGAINST:-../.git#branch=main,subdir=proto}"

# For a git input (`<path>.git#branch=...`), check that the repository and the ref exist.
git_ref=""
if [[ "$against" == *.git#* || "$against" == *.git ]]; then
  git_dir="${against%%#*}"
  git_ref="HEAD"
  if [[ "$against" == *#* ]]; then
    IFS=',' read -r -a params <<<"${against#*#}"
    for param in "${params[@]}"; do
      case "$param" in
        branch=* | tag=* | ref=*) git_ref="${param#*=}" ;;
      esac
    done
  fi
  if ! git --git-dir="$git_dir" rev-parse --verify --quiet "$git_ref^{commit}" >/dev/null 2>&1; then
    echo "buf breaking skipped: $git_ref does not exist in $git_dir" >&2
    exit 0
  fi
fi

echo "buf breaking --against $against" >&2
"$buf" breaking --against "$against"
echo "ok" >&2
