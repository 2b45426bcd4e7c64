#!/usr/bin/env bash
# Build capstan-testenv (kube-apiserver + embedded etcd) if it is missing or
# its sources changed. The binary lives outside the repository, in
#   ${CAPSTAN_TESTENV_BIN:-$HOME/.cache/capstan/testenv/capstan-testenv}
# and Go's own module and build caches under $HOME are reused, so a rebuild
# after a small change takes seconds. The last line on stdout is the binary
# path; progress and errors go to stderr.
#
# CAPSTAN_TESTENV_KUBE picks the Kubernetes minor: unset or 1.35 (the default
# server, go.mod), or 1.36 (go.1.36.mod, for tests of 1.36-only features),
# built into
#   ${CAPSTAN_TESTENV_BIN_1_36:-$HOME/.cache/capstan/testenv/capstan-testenv-1.36}
# Both come from the same Go sources; each binary has its own stamp and lock.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() {
	echo "tests/testenv/build.sh: error: $*" >&2
	exit 1
}

# Per minor: the module file, the binary, the lowest Go that release's go.mod
# accepts, and a fixed build date (the release's module date, `Time` of
# `go mod download -json k8s.io/kubernetes@VERSION`), so identical sources
# give identical binaries.
kube=${CAPSTAN_TESTENV_KUBE:-1.35}
case $kube in
1.35)
	modfile=go.mod
	bin=${CAPSTAN_TESTENV_BIN:-$HOME/.cache/capstan/testenv/capstan-testenv}
	min_go=25
	build_date=2026-04-15T18:01:22Z
	;;
1.36)
	modfile=go.1.36.mod
	bin=${CAPSTAN_TESTENV_BIN_1_36:-$HOME/.cache/capstan/testenv/capstan-testenv-1.36}
	min_go=26
	build_date=2026-07-22T18:07:38Z
	;;
*) die "CAPSTAN_TESTENV_KUBE=$kube is not a supported Kubernetes minor; use 1.35 (the default) or 1.36" ;;
esac
sumfile=${modfile%.mod}.sum
# Only other minors name their module file: the default build runs exactly as it always did.
modflag=()
[[ $modfile == go.mod ]] || modflag=(-modfile="$modfile")

command -v go >/dev/null 2>&1 || die "'go' is not on PATH; Go >= 1.$min_go is needed to build kube-apiserver $kube"
# Never download a different toolchain behind our back; fail loudly instead.
export GOTOOLCHAIN=local CGO_ENABLED=0

gover=$(go env GOVERSION 2>/dev/null) || die "'go env GOVERSION' failed; is the Go installation broken?"
minor=$(sed -E 's/^go1\.([0-9]+).*/\1/' <<<"$gover")
[[ $minor =~ ^[0-9]+$ ]] && ((minor >= min_go)) || die "found $gover; kube-apiserver $kube needs Go >= 1.$min_go"

# Versions come from the module file, so /version always matches the compiled source.
k8s=$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v1\./ { print $2; exit }' "$here/$modfile")
[[ $k8s =~ ^v1\.([0-9]+)\.[0-9]+$ ]] || die "cannot read the k8s.io/kubernetes version from $here/$modfile"
k8s_minor=${BASH_REMATCH[1]}
[[ 1.$k8s_minor == "$kube" ]] || die "$here/$modfile pins k8s.io/kubernetes $k8s, not $kube"

ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	ldflags+=" -X $pkg.gitVersion=$k8s -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
	ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date -X $pkg.gitCommit="
done

# Staleness key: every input that changes the binary.
key=$( {
	echo "$gover $ldflags"
	cd "$here" && cat "$modfile" "$sumfile" build.sh ./*.go
} | sha256sum | cut -d' ' -f1)

mkdir -p "$(dirname "$bin")" || die "cannot create $(dirname "$bin")"
# Serialise concurrent builds of the same binary (parallel test runners).
if command -v flock >/dev/null 2>&1; then
	exec 9>"$bin.lock"
	flock 9
fi

if [[ -x $bin && -f $bin.stamp && $(<"$bin.stamp") == "$key" ]]; then
	echo "$bin"
	exit 0
fi

echo "tests/testenv/build.sh: building capstan-testenv (kube-apiserver $k8s, $gover); a cold build takes ~4-6 min on 2 cores, a rebuild seconds" >&2
start=$SECONDS
tmp="$bin.tmp.$$"
trap 'rm -f "$tmp"' EXIT
if ! (cd "$here" && go build "${modflag[@]}" -trimpath -ldflags "$ldflags" -o "$tmp" .); then
	die "'go build' failed (see the compiler output above). If it reports a missing go.sum entry or an unknown revision, the Go module proxy is unreachable or $modfile/$sumfile are out of sync; if it reports a Go version, use Go >= 1.$min_go."
fi
mv -f "$tmp" "$bin"
echo "$key" >"$bin.stamp"
echo "tests/testenv/build.sh: built in $((SECONDS - start))s" >&2
echo "$bin"
