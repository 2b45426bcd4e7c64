#!/usr/bin/env bash
# Hand-run smoke check of capstan-testenv: build (cached), start, exercise the
# server with kubectl, stop, and print timings. Needs kubectl on PATH.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin=$(bash "$here/build.sh" | tail -n1)
work=$(mktemp -d)
dir=$work/instance
pid=
cleanup() {
	[[ -n $pid ]] && kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
	rm -rf "$work"
}
trap cleanup EXIT
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fs", b - a }'; }

t0=$(now)
"$bin" start --dir "$dir" --audit-log "$work/audit.log" >"$work/stdout" 2>"$work/stderr" &
pid=$!
until [[ -s $work/stdout ]]; do
	kill -0 "$pid" 2>/dev/null || { tail -20 "$work/stderr" >&2; echo "smoke: server exited early" >&2; exit 1; }
	sleep 0.05
done
t1=$(now)
read -r word kubeconfig <"$work/stdout"
[[ $word == ready && -f $dir/ready ]] || { echo "smoke: unexpected stdout: $(cat "$work/stdout")" >&2; exit 1; }

k() { kubectl --kubeconfig "$kubeconfig" "$@"; }
k version 2>/dev/null | grep 'Server Version'
k get --raw /version | grep '"gitVersion"'
k apply -f - <<'EOF'
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.smoke.capstan.dev
spec:
  group: smoke.capstan.dev
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    subresources: {status: {}}
    schema:
      openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
EOF
k wait --for=condition=Established crd/widgets.smoke.capstan.dev --timeout=30s
k create namespace smoke
if k auth can-i --as=system:serviceaccount:default:x list pods; then
	echo "smoke: FAIL, a ServiceAccount without RBAC may list pods" >&2
	exit 1
fi
t2=$(now)

kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
pid=
t3=$(now)
[[ $rc == 0 ]] || { echo "smoke: FAIL, exit code $rc after SIGTERM" >&2; exit 1; }
[[ ! -e $dir ]] || { echo "smoke: FAIL, $dir not cleaned up" >&2; exit 1; }
echo "smoke: OK; startup $(secs "$t0" "$t1"), kubectl checks $(secs "$t1" "$t2"), stop $(secs "$t2" "$t3"), $(wc -l <"$work/audit.log") audit events"
