#!/usr/bin/env bash
# Capstan quick start: runs the demo operator end to end on this machine.
#
#   bash scripts/demo.sh
#
# Needs Rust (cargo) and Go >= 1.25; kubectl is used from PATH, or built from Go modules when
# missing. It builds a local Kubernetes API server (tests/testenv), the `capstan` controller and
# the Rust SDK's demo operator (sdk-rust/examples/demo.rs), starts all three, and walks through
# creating, changing and deleting an `Example` object (examples/crd.yaml, short name `cex`),
# showing what the handlers did. Everything it starts is stopped on exit. It exits 0 only if
# every step had the expected effect.
#
# Environment: CARGO_TARGET_DIR (default ~/.cache/capstan/target), DEMO_TIMEOUT (seconds per
# step, default 60), DEMO_KEEP=1 keeps the temporary directory (logs) after the run.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/capstan/target}
timeout=${DEMO_TIMEOUT:-60}
started=$SECONDS

if [[ -t 1 ]]; then bold=$'\e[1m' green=$'\e[32m' red=$'\e[31m' reset=$'\e[0m'; else bold='' green='' red='' reset=''; fi
header() { printf '\n%s==> %s%s\n' "$bold" "$*" "$reset"; }
say() { printf '    %s\n' "$*"; }
ok() { printf '    %s✓ %s%s\n' "$green" "$*" "$reset"; }
indent() { sed 's/^/    | /'; }

# ---------------------------------------------------------------------------------------------
# Processes, cleanup, failure reporting

tmp=''
testenv_pid='' capstan_pid='' handler_pid=''

stop_process() { # name pid: SIGTERM, wait up to 30 s, then SIGKILL
	local name=$1 pid=$2 i
	[[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
	kill -TERM "$pid" 2>/dev/null || true
	for ((i = 0; i < 300; i++)); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	if kill -0 "$pid" 2>/dev/null; then
		echo "demo: $name (pid $pid) did not stop on SIGTERM; killing it" >&2
		kill -KILL "$pid" 2>/dev/null || true
	fi
	wait "$pid" 2>/dev/null || true
}

cleanup() {
	local status=$?
	trap - EXIT INT TERM
	# The handler first (so its disconnect is clean), then the controller, then the API server.
	stop_process "the demo handler" "$handler_pid"
	stop_process "capstan" "$capstan_pid"
	stop_process "the API server" "$testenv_pid"
	if [[ -n $tmp && -d $tmp ]]; then
		if [[ ${DEMO_KEEP:-} == 1 ]]; then
			echo "demo: logs kept in $tmp" >&2
		else
			rm -rf "$tmp"
		fi
	fi
	exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

show_tail() { # title file
	[[ -s $2 ]] || return 0
	printf '\n%s--- %s (last 25 lines) ---%s\n' "$bold" "$1" "$reset" >&2
	tail -n 25 "$2" >&2
}

fail() {
	printf '\n%sdemo: FAILED: %s%s\n' "$red" "$*" "$reset" >&2
	if [[ -n $tmp ]]; then
		show_tail "capstan log" "$tmp/capstan.log"
		show_tail "demo handler log" "$tmp/handler.log"
		show_tail "API server log" "$tmp/apiserver.log"
	fi
	exit 1
}

alive() { # name pid
	kill -0 "$2" 2>/dev/null || fail "$1 exited unexpectedly"
}

# wait_until DESCRIPTION COMMAND...: polls COMMAND (quietly) every 0.2 s for up to $timeout s.
wait_until() {
	local what=$1 deadline=$((SECONDS + timeout))
	shift
	until "$@" >/dev/null 2>&1; do
		((SECONDS < deadline)) || fail "timed out after ${timeout}s waiting until $what"
		[[ -z $capstan_pid ]] || alive capstan "$capstan_pid"
		[[ -z $handler_pid ]] || alive "the demo handler" "$handler_pid"
		[[ -z $testenv_pid ]] || alive "the API server" "$testenv_pid"
		sleep 0.2
	done
}

# Logs. `mark_logs` remembers where the logs end, so each step looks only at its own lines.
mark_capstan=0 mark_handler=0
mark_logs() {
	mark_capstan=$(wc -l <"$tmp/capstan.log")
	mark_handler=$(wc -l <"$tmp/handler.log")
}
# new_lines NAME: the lines of NAME's log since the last mark, without colours.
new_lines() {
	local mark=mark_$1
	[[ -f $tmp/$1.log ]] || return 0
	tail -n "+$((${!mark} + 1))" "$tmp/$1.log" | sed 's/\x1b\[[0-9;]*m//g'
}
log_has() { new_lines "$1" | grep -Eq -- "$2"; }
log_count() { new_lines "$1" | grep -Ec -- "$2" || true; }
# show_log TITLE NAME PATTERN: the matching new lines, shortened (time of day, no span fields).
show_log() {
	local lines
	lines=$(new_lines "$2" | grep -E -- "$3" |
		sed -E 's/^[0-9-]+T([0-9:]+)\.[0-9]+Z/\1/; s/ ([a-z_]+\{[^}]*\}:)+ / /' | cut -c1-200) || true
	say "$1:"
	if [[ -n $lines ]]; then indent <<<"$lines"; else say "  (no matching lines)"; fi
}

# ---------------------------------------------------------------------------------------------
# Prerequisites and builds

header "Checking prerequisites"
command -v cargo >/dev/null 2>&1 || fail "cargo is not on PATH (install Rust: https://rustup.rs)"
command -v go >/dev/null 2>&1 || fail "go is not on PATH (Go >= 1.25 builds the local Kubernetes API server)"
say "cargo: $(cargo --version)"
say "go:    $(go env GOVERSION)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/capstan-demo.XXXXXX")

# kubectl: the one on PATH, or one built from the same Kubernetes release as the API server.
build_kubectl() {
	local k8s kver out dir
	k8s=$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v1\./ { print $2; exit }' "$root/tests/testenv/go.mod")
	[[ $k8s =~ ^v1\.([0-9]+\.[0-9]+)$ ]] || fail "cannot read the Kubernetes version from tests/testenv/go.mod"
	kver=v0.${BASH_REMATCH[1]}
	out=${CAPSTAN_KUBECTL_BIN:-$HOME/.cache/capstan/bin/kubectl-$k8s}
	if [[ ! -x $out ]]; then
		say "kubectl is not on PATH: building kubectl $k8s from Go modules (about a minute) ..."
		dir=$tmp/kubectl-build
		mkdir -p "$dir" "$(dirname "$out")"
		cat >"$dir/main.go" <<-'EOF'
			package main

			import (
				"os"

				_ "k8s.io/client-go/plugin/pkg/client/auth"
				"k8s.io/component-base/cli"
				"k8s.io/component-base/logs"
				"k8s.io/kubectl/pkg/cmd"
				"k8s.io/kubectl/pkg/cmd/util"
			)

			func main() {
				logs.GlogSetter(cmd.GetLogVerbosity(os.Args)) // nolint:errcheck
				if err := cli.RunNoErrOutput(cmd.NewDefaultKubectlCommand()); err != nil {
					util.CheckErr(err)
				}
			}
		EOF
		local ldflags="-s -w"
		for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
			ldflags+=" -X $pkg.gitVersion=$k8s -X $pkg.gitMajor=1 -X $pkg.gitMinor=${BASH_REMATCH[1]%%.*}"
		done
		if ! (cd "$dir" && export GOTOOLCHAIN=local CGO_ENABLED=0 &&
			go mod init capstan.dev/demo-kubectl &&
			go get "k8s.io/kubectl@$kver" "k8s.io/component-base@$kver" "k8s.io/client-go@$kver" &&
			go mod tidy && go build -trimpath -ldflags "$ldflags" -o "$out.tmp" .) >"$tmp/kubectl-build.log" 2>&1; then
			show_tail "kubectl build" "$tmp/kubectl-build.log"
			fail "building kubectl failed; install kubectl (https://kubernetes.io/docs/tasks/tools/) and retry"
		fi
		mv -f "$out.tmp" "$out"
	fi
	kubectl_bin=$out
}
if command -v kubectl >/dev/null 2>&1; then
	kubectl_bin=$(command -v kubectl)
else
	build_kubectl
fi
say "kubectl: $kubectl_bin"

header "Building the local Kubernetes API server (tests/testenv; the first build takes minutes)"
testenv_bin=$(bash "$root/tests/testenv/build.sh" | tail -n1) || fail "building the API server failed (see above)"
[[ -x $testenv_bin ]] || fail "tests/testenv/build.sh printed no binary"
say "$("$testenv_bin" version)"

header "Building capstan and the demo operator (cargo, into $CARGO_TARGET_DIR)"
(cd "$root" && cargo build --quiet -p capstan --bin capstan -p capstan-sdk --example demo) ||
	fail "cargo build failed (see above)"
capstan_bin=$CARGO_TARGET_DIR/debug/capstan
demo_bin=$CARGO_TARGET_DIR/debug/examples/demo
[[ -x $capstan_bin && -x $demo_bin ]] || fail "the build produced no $capstan_bin or $demo_bin"
say "$("$capstan_bin" version | head -n1)"

# ---------------------------------------------------------------------------------------------
# Start the API server, the controller and the handler process

header "Starting a local Kubernetes API server"
"$testenv_bin" start --dir "$tmp/apiserver" >"$tmp/apiserver.out" 2>"$tmp/apiserver.log" &
testenv_pid=$!
wait_until "the API server is ready" test -s "$tmp/apiserver.out"
read -r word kubeconfig <"$tmp/apiserver.out"
[[ $word == ready && -s $kubeconfig ]] || fail "unexpected API server output: $(<"$tmp/apiserver.out")"
export KUBECONFIG=$kubeconfig
kubectl() { "$kubectl_bin" "$@"; }
say "ready at $(<"$tmp/apiserver/ready") (kubeconfig $kubeconfig)"
kubectl version 2>/dev/null | indent || true

header "Installing the Example CRD (examples/crd.yaml)"
kubectl apply -f "$root/examples/crd.yaml" | indent
kubectl wait --for=condition=Established --timeout="${timeout}s" crd/examples.demo.capstan.dev | indent ||
	fail "the CRD was not Established"

header "Starting the controller: capstan run"
free_port() {
	local port
	if port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null); then
		echo "$port"
		return
	fi
	for _ in $(seq 100); do # no python: a random port nothing answers on
		port=$((20000 + RANDOM % 40000))
		if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
			echo "$port"
			return
		fi
	done
	fail "found no free port for the admin endpoint"
}
admin_port=$(free_port)
socket=$tmp/capstan.sock
NO_COLOR=1 "$capstan_bin" run --listen "unix://$socket" --admin-listen "127.0.0.1:$admin_port" \
	>"$tmp/capstan.log" 2>&1 &
capstan_pid=$!
wait_until "capstan has started" log_has capstan "capstan started"
say "listening on unix://$socket, admin endpoint http://127.0.0.1:$admin_port"

header "Starting the demo operator (sdk-rust/examples/demo.rs)"
NO_COLOR=1 CAPSTAN_ENDPOINT="unix://$socket" RUST_LOG=info "$demo_bin" >"$tmp/handler.log" 2>&1 &
handler_pid=$!

readyz() { # prints the HTTP status code of /readyz
	if command -v curl >/dev/null 2>&1; then
		curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$admin_port/readyz"
	else
		( # bash's /dev/tcp: send the request, print the code of the status line
			exec 3<>"/dev/tcp/127.0.0.1/$admin_port" || exit 1
			printf 'GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' >&3
			read -r -t 2 _ code _ <&3 || exit 1
			printf '%s' "$code"
		) 2>/dev/null
	fi
}
ready() { [[ $(readyz) == 200 ]]; }
wait_until "capstan is ready (/readyz answers 200)" ready
ok "/readyz answers 200: the handler process is connected"
show_log "capstan" capstan "handler process connected|registration rejected|watching resource"
say "(the demo also registers a daemon and a timer; a controller without them rejects just those)"

# ---------------------------------------------------------------------------------------------
# The walk-through

jsonpath() { kubectl get cex hello -o "jsonpath=$1"; }

header "1. Create an Example: kubectl apply (spec.field: world, fail_times: 2)"
mark_logs
kubectl apply -f - <<EOF | indent
apiVersion: demo.capstan.dev/v1
kind: Example
metadata:
  name: hello
spec:
  field: world
  fail_times: 2
EOF
created() {
	[[ $(jsonpath '{.status.create_fn.message}') == "hello hello" &&
		$(jsonpath '{.metadata.labels.demo\.capstan\.dev/handled}') == yes &&
		$(jsonpath '{.status.flaky_fn.attempts}') == 3 ]]
}
say "create_fn, field_fn and flaky_fn run; flaky_fn fails twice and is retried after 1 s each time ..."
wait_until "the create handlers have succeeded (status.create_fn, status.flaky_fn, the label)" created
wait_until "capstan logged flaky_fn's success" log_has capstan "handler succeeded handler.id=flaky_fn"
wait_until "the demo operator logged create_fn and field_fn" \
	log_has handler 'spec.field changed: <none> -> "world"'
log_has handler "created hello" || fail "create_fn did not log"
retries=$(log_count capstan "handler will be retried handler.id=flaky_fn")
[[ $retries == 2 ]] || fail "flaky_fn was retried $retries times, not 2"
ok "status.create_fn.message: $(jsonpath '{.status.create_fn.message}')"
ok "status.flaky_fn.attempts: $(jsonpath '{.status.flaky_fn.attempts}') (two temporary failures, then success)"
ok "label demo.capstan.dev/handled: $(jsonpath '{.metadata.labels.demo\.capstan\.dev/handled}')"
say "kubectl get cex hello -o yaml:"
kubectl get cex hello -o yaml | indent
say "kubectl get cex:"
kubectl get cex | indent
show_log "capstan" capstan "finalizer added|handler (succeeded|will be retried)|cause handled"
show_log "demo operator" handler "created hello|spec.field changed"

header "2. Change spec.field: kubectl patch cex hello --type=merge -p '{\"spec\":{\"field\":\"capstan\"}}'"
mark_logs
kubectl patch cex hello --type=merge -p '{"spec":{"field":"capstan"}}' | indent
updated() { [[ $(jsonpath '{.status.update_fn.message}') == updated ]]; }
wait_until "update_fn has run (status.update_fn)" updated
wait_until "field_fn has logged the change" log_has handler 'spec.field changed: "world" -> "capstan"'
wait_until "capstan logged the update" log_has capstan "cause handled cause=update"
ok "status.update_fn.message: $(jsonpath '{.status.update_fn.message}')"
ok "spec.field: $(jsonpath '{.spec.field}')"
show_log "capstan" capstan "handler (succeeded|will be retried)|cause handled"
show_log "demo operator" handler "spec.field changed"
say "kubectl get cex hello -o jsonpath='{.status}':"
indent <<<"$(jsonpath '{.status}')"

header "3. Delete it: kubectl delete cex hello"
mark_logs
kubectl delete cex hello --wait=false | indent
gone() { ! kubectl get cex hello >/dev/null 2>&1; }
wait_until "the object is gone (delete_fn ran and the finalizer was removed)" gone
wait_until "the demo operator logged delete_fn" log_has handler "deleting hello"
deletes=$(log_count handler "deleting hello")
[[ $deletes == 1 ]] || fail "delete_fn ran $deletes times; a succeeded handler must not run again"
ok "delete_fn ran, capstan removed its finalizer, the object is gone"
show_log "capstan" capstan "handler (succeeded|will be retried)|cause handled|finalizer"
show_log "demo operator" handler "deleting hello"
say "kubectl get cex:"
kubectl get cex 2>&1 | indent

header "Done in $((SECONDS - started))s: the demo operator handled the create (with retries), the field change and the delete"
say "stopping the demo operator, capstan and the API server ..."
