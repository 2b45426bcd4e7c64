#!/usr/bin/env bash
# Runs Capstan's fault-injection suite: protocol fuzzing (conversion layer, connection state
# machine), kill loops of the controller and of the handler process, API faults (a frozen API
# server; refused, reset, delayed, half-closed, hung connections), floods, hostile peers of
# the admin port, and random ring changes of sharded replicas (joins, SIGTERMs, SIGKILLs; on
# Kubernetes 1.35, and on 1.36 with the server's shard filter).
# `scripts/test.sh` runs the same tests in their CI sizes as part of `cargo test`; this script
# runs only them, and with --long in their full sizes:
#
#   scripts/faults.sh            CI sizes (20 kills of each, 256 fuzz cases per property, ...)
#   scripts/faults.sh --long     100 kills of each, 2,000 objects, 100,000 fuzz cases, 100
#                                ring changes, ...
#
# A failing run prints its CAPSTAN_FAULTS_SEED (CAPSTAN_SHARDING_SEED for ring changes); set it
# to repeat the run. Failing fuzz inputs are added to the *.proptest-regressions files next to
# the tests: commit them.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

long=0
for arg in "$@"; do
	case $arg in
	--long) long=1 ;;
	-h | --help)
		sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
		exit 0
		;;
	*)
		echo "scripts/faults.sh: unknown argument $arg (see --help)" >&2
		exit 64
		;;
	esac
done

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/capstan/target}
export GOTOOLCHAIN=local
if ((long)); then
	export CAPSTAN_FAULTS_LONG=1
	export PROPTEST_CASES=${PROPTEST_CASES:-100000}
	export CAPSTAN_SHARDING_CHURN_ROUNDS=${CAPSTAN_SHARDING_CHURN_ROUNDS:-100}
fi

CAPSTAN_TESTENV_BIN=$(bash tests/testenv/build.sh | tail -n1)
export CAPSTAN_TESTENV_BIN
cargo build --workspace --all-targets --locked
export CAPSTAN_TEST_BINARY="$CARGO_TARGET_DIR/debug/capstan"

started=$SECONDS
cargo test --locked -p capstan --test fuzz_convert -- --nocapture
# One test at a time: the kill loops and floods measure timing and memory.
cargo test --locked --no-fail-fast -p capstan-tests --test 'faults_*' -- --nocapture --test-threads 1
# Both servers' ring changes (1.35 filtering on arrival, 1.36 with the shard filter), one
# after the other.
cargo test --locked -p capstan-tests --test sharding random_ring_changes -- --nocapture --test-threads 1
echo "scripts/faults.sh: done in $((SECONDS - started)) s"
