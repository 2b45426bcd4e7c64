#!/usr/bin/env bash
# Capstan's benchmarks side by side with a null controller and kopf (tests/bench/README.md).
#
#   bash scripts/bench.sh            full run: N = 100, 1,000, 10,000 (tens of minutes on 2 cores)
#   bash scripts/bench.sh --smoke    small N, short settles (a few minutes); for CI: exits
#                                    non-zero when any workload fails to complete (includes
#                                    the fleet simulation with 1 and 3 nodes, and sharding
#                                    with 40 objects: 1 and 2 members, one graceful hand-over)
#   bash scripts/bench.sh --large    B2 and B5 at 100,000 objects, the null controller beside
#                                    capstan+rust, with the API server's own memory and CPU;
#                                    writes tests/bench/results/large.{md,json} (about an hour
#                                    on 2 cores; not part of CI, which runs --smoke)
#   bash scripts/bench.sh --fleet    only the fleet simulation of per-node operators: 1, 10,
#                                    30 and 100 node operators (BENCH_FLEET_NODES), writes
#                                    tests/bench/results/fleet.{md,json,svg}
#   bash scripts/bench.sh --sharding only the sharding benchmark (capstan run --sharding): hand-
#                                    over on leave/join/crash with 1,000 objects, throughput at
#                                    1-4 members, per-member watch cost on the 1.35 server and
#                                    on the 1.36 one with ShardedListAndWatch (built with
#                                    CAPSTAN_TESTENV_KUBE=1.36; skipped when it does not build),
#                                    writes tests/bench/results/sharding.{md,json,svg} (~5 min
#                                    once built)
#
# Builds what it needs: the API server (tests/testenv), `capstan` and the Rust SDK handler
# (cargo, release), the Go SDK handler and the benchmark driver (Go, GOTOOLCHAIN=local), the
# Python SDK's venv (sdk-python/scripts/venv.sh) for its handler, the TypeScript SDK and its
# handler (tests/bench/tshandler/build.sh, which runs sdk-typescript/scripts/build.sh; needs
# Node 20), and a Python venv with the pinned kopf (tests/bench/requirements.txt). Writes
# tests/bench/results/latest.md and latest.json, and admission.md and admission.json for the
# admission round trip (--smoke: tests/bench/results/smoke/, not
# committed; override either with BENCH_OUT=DIR). Every process it
# starts is stopped on exit.
#
# Environment: CARGO_TARGET_DIR (default ~/.cache/capstan/target), BENCH_PROFILE (cargo profile of
# capstan and the Rust handler; default release, dev with --smoke), BENCH_CAPSTAN_DIR (use the
# `capstan` and `capstan-e2e-handler` binaries in this directory instead of building them; set
# BENCH_PROFILE to the profile they were built with), BENCH_VENV (default
# ~/.cache/capstan/bench-venv), BENCH_OUT, BENCH_ARGS (extra flags for the driver, e.g.
# "--sizes 100,1000 --kopf-max 1000").
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/capstan/target}
export GOTOOLCHAIN=local
venv=${BENCH_VENV:-$HOME/.cache/capstan/bench-venv}
out=${BENCH_OUT:-$root/tests/bench/results}
bin=$HOME/.cache/capstan/bench-bin

smoke=false
large=false
fleet_only=false
sharding_only=false
case "${1:-}" in
"") ;;
--smoke) smoke=true ;;
--large) large=true ;;
--fleet) fleet_only=true ;;
--sharding) sharding_only=true ;;
*)
	echo "usage: $0 [--smoke|--large|--fleet|--sharding]" >&2
	exit 2
	;;
esac

step() { printf '\n==> %s\n' "$*" >&2; }
started=$SECONDS

driver_pid=''
cleanup() {
	local status=$?
	if [[ -n $driver_pid ]] && kill -0 "$driver_pid" 2>/dev/null; then
		kill -TERM "$driver_pid" 2>/dev/null || true
		for ((i = 0; i < 600; i++)); do
			kill -0 "$driver_pid" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$driver_pid" 2>/dev/null || true
	fi
	exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step "real API server (tests/testenv)"
testenv=$(bash tests/testenv/build.sh | tail -n1)

# The full run measures release builds. The smoke run only proves that every workload completes,
# so it uses the dev profile by default: CI has built that already for the tests.
profile=${BENCH_PROFILE:-$($smoke && echo dev || echo release)}
profile_dir=$([[ $profile == dev ]] && echo debug || echo "$profile")
if [[ -n ${BENCH_CAPSTAN_DIR:-} ]]; then
	rust_bin=$BENCH_CAPSTAN_DIR
else
	step "capstan and the Rust SDK handler (cargo build --profile $profile)"
	cargo build --profile "$profile" --locked -p capstan -p capstan-tests --bin capstan --bin capstan-e2e-handler
	rust_bin=$CARGO_TARGET_DIR/$profile_dir
fi

step "benchmark driver and Go SDK handler (go build)"
mkdir -p "$bin"
(cd tests/bench && go build -trimpath -o "$bin/bench" ./cmd/bench)
go_handler=''
if (cd tests/bench/gohandler && go build -trimpath -o "$bin/bench-go-handler" . && go build -trimpath -o "$bin/bench-hop" ./hop); then
	go_handler="$bin/bench-go-handler"
else
	echo "bench: the Go SDK handler does not build; running without it" >&2
fi

# The fleet simulation: per-node operators at scale (tests/bench/cmd/bench/fleet.go).
fleet() {
	"$bin/bench" fleet --out "$1" --testenv "$testenv" --capstan "$rust_bin/capstan" \
		--rust-handler "$rust_bin/capstan-e2e-handler" --crd "$root/examples/crd.yaml" --profile "$profile" "${@:2}" &
	driver_pid=$!
	local status=0
	wait "$driver_pid" || status=$?
	driver_pid=''
	return "$status"
}
if $fleet_only; then
	step "fleet simulation"
	fleet "$out" --nodes "${BENCH_FLEET_NODES:-1,10,30,100}"
	echo "bench: fleet finished in $((SECONDS - started)) s; results in $out/fleet.md" >&2
	exit 0
fi

# Sharded replicas: hand-over, throughput, per-member cost (tests/bench/cmd/bench/sharding.go).
sharding() {
	"$bin/bench" sharding --out "$1" --testenv "$testenv" --capstan "$rust_bin/capstan" \
		--rust-handler "$rust_bin/capstan-e2e-handler" --crd "$root/examples/crd.yaml" --profile "$profile" "${@:2}" &
	driver_pid=$!
	local status=0
	wait "$driver_pid" || status=$?
	driver_pid=''
	return "$status"
}
if $sharding_only; then
	# The per-member cost with the server's shard filter needs Kubernetes 1.36 with
	# ShardedListAndWatch; without that build, the rest runs and the report says so.
	step "real API server, Kubernetes 1.36 (CAPSTAN_TESTENV_KUBE=1.36 tests/testenv/build.sh)"
	sharded=()
	if testenv_136=$(CAPSTAN_TESTENV_KUBE=1.36 bash tests/testenv/build.sh | tail -n1) && [[ -x $testenv_136 ]]; then
		sharded=(--testenv-sharded "$testenv_136")
	else
		echo "bench: the 1.36 API server does not build; the per-member cost runs on 1.35 only" >&2
	fi
	step "sharding"
	status=0
	# shellcheck disable=SC2206 # BENCH_ARGS is split on purpose
	sharding "$out" "${sharded[@]}" ${BENCH_ARGS:-} || status=$?
	echo "bench: sharding finished in $((SECONDS - started)) s (exit $status); results in $out/sharding.md" >&2
	exit "$status"
fi

step "Python SDK handler (sdk-python/scripts/venv.sh)"
py_handler=''
if sdk_python=$(bash sdk-python/scripts/venv.sh | tail -n1); then
	py_handler="$bin/bench-python-handler"
	cat >"$py_handler" <<-EOF
		#!/bin/sh
		PYTHONPATH='$root/sdk-python' exec '$sdk_python' -m capstan run --quiet '$root/tests/bench/pyhandler/handlers.py'
	EOF
	chmod +x "$py_handler"
else
	echo "bench: the Python SDK venv could not be set up; running without it" >&2
fi

step "TypeScript SDK handler (tests/bench/tshandler/build.sh)"
ts_handler=''
if ts_entry=$(bash tests/bench/tshandler/build.sh "$bin/tshandler" | tail -n1) && node=$(command -v node); then
	ts_handler="$bin/bench-typescript-handler"
	cat >"$ts_handler" <<-EOF
		#!/bin/sh
		exec '$node' '$ts_entry'
	EOF
	chmod +x "$ts_handler"
elif $smoke; then
	# The smoke run is what keeps every handler process from rotting: a broken build fails it.
	echo "bench: the TypeScript SDK handler does not build" >&2
	exit 1
else
	echo "bench: the TypeScript SDK handler does not build; running without it" >&2
fi

step "kopf (Python venv)"
python=${BENCH_PYTHON:-$(command -v python3.11 || command -v python3)}
if [[ ! -x $venv/bin/python ]]; then
	"$python" -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check -r tests/bench/requirements.txt

step "benchmark"
args=(
	--out "$out"
	--testenv "$testenv"
	--capstan "$rust_bin/capstan"
	--rust-handler "$rust_bin/capstan-e2e-handler"
	--profile "$profile"
	--kopf "$venv/bin/kopf"
	--kopf-operator "$root/tests/bench/kopf/operator.py"
	--crd "$root/examples/crd.yaml"
)
if [[ -n $go_handler ]]; then
	args+=(--go-handler "$go_handler" --hop "$bin/bench-hop")
fi
if [[ -n $py_handler ]]; then
	args+=(--python-handler "$py_handler")
fi
if [[ -n $ts_handler ]]; then
	args+=(--typescript-handler "$ts_handler")
fi
if $smoke; then
	out=${BENCH_OUT:-$root/tests/bench/results/smoke}
	args[1]=$out
	args+=(--smoke --sizes 20 --b5-objects 20 --serial 5 --settle 1500ms --steady 1s)
fi
if $large; then
	args+=(--large)
fi
# shellcheck disable=SC2206 # BENCH_ARGS is split on purpose
args+=(${BENCH_ARGS:-})
"$bin/bench" run "${args[@]}" &
driver_pid=$!
status=0
wait "$driver_pid" || status=$?
driver_pid=''
if $large; then
	echo "bench: finished in $((SECONDS - started)) s (exit $status); results in $out/large.md" >&2
	exit "$status"
fi

step "admission round trip (capstan's webhook server and kopf's)"
admission=(
	--out "$out"
	--testenv "$testenv"
	--capstan "$rust_bin/capstan"
	--rust-handler "$rust_bin/capstan-e2e-handler"
	--kopf "$venv/bin/kopf"
	--kopf-operator "$root/tests/bench/kopf/operator.py"
	--crd "$root/examples/crd.yaml"
)
if $smoke; then
	admission+=(--requests 20 --warmup 5)
fi
"$bin/bench" admission "${admission[@]}" &
driver_pid=$!
wait "$driver_pid" || status=$?
driver_pid=''
if $smoke; then
	step "fleet simulation (smoke)"
	fleet "$out" --nodes 1,3 --changes 2 --smoke || status=$?
	step "sharding (smoke)"
	sharding "$out" --smoke || status=$?
fi
echo "bench: finished in $((SECONDS - started)) s (exit $status); results in $out/latest.md" >&2
exit "$status"
