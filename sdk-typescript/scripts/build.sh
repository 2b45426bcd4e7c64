#!/usr/bin/env bash
# Builds the TypeScript SDK (sdk-typescript): installs the pinned dependencies with `npm ci`
# (cache under $HOME/.cache/capstan/npm) when package-lock.json changed since the last install,
# generates the protocol code from ../proto and compiles everything with `npm run build`, and
# prints the absolute path of the built conformance handler's entry (for `node <path>`).
# Idempotent. Everything but that path goes to standard error.
set -euo pipefail
cd "$(dirname "$0")/.."
here=$(pwd)
cache=${CAPSTAN_NPM_CACHE:-$HOME/.cache/capstan/npm}
mkdir -p "$cache"
stamp=node_modules/.capstan-lock-$(sha256sum package-lock.json | cut -c1-16)
if [[ ! -f "$stamp" ]]; then
	npm ci --cache "$cache" --prefer-offline --no-audit --no-fund >&2
	touch "$stamp"
fi
npm run --silent build >&2
entry="$here/dist/conformance/handler.js"
test -f "$entry"
echo "$entry"
