#!/usr/bin/env bash
# Builds the benchmark's TypeScript SDK handler: the SDK (sdk-typescript/scripts/build.sh,
# idempotent), then handlers.ts with the SDK's pinned TypeScript into OUT_DIR (default
# ~/.cache/capstan/bench-bin/tshandler), where `@capstan/sdk` resolves to sdk-typescript through
# OUT_DIR/node_modules. Prints the absolute path of the built entry (for `node <path>`);
# everything else goes to standard error.
#
#   bash tests/bench/tshandler/build.sh [OUT_DIR]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../.." && pwd)
out=${1:-$HOME/.cache/capstan/bench-bin/tshandler}
sdk=$root/sdk-typescript
bash "$sdk/scripts/build.sh" >/dev/null
mkdir -p "$out/node_modules/@capstan"
ln -sfn "$sdk" "$out/node_modules/@capstan/sdk"
"$sdk/node_modules/.bin/tsc" -p "$here/tsconfig.json" --outDir "$out" >&2
test -f "$out/handlers.js"
echo "$out/handlers.js"
