#!/usr/bin/env bash
# Installs a pinned helm from Go modules (no downloads outside the Go module proxy) if it is
# missing or another version, and prints its path as the last line of stdout. Progress and
# errors go to stderr. The binary lives in ${CAPSTAN_BIN:-$HOME/.cache/capstan/bin}; Go's own
# module and build caches are reused, so only the first install takes minutes.
#
# helm's release builds set the Kubernetes version that `helm template` and `helm lint`
# assume without --kube-version from linker variables; `go install` leaves them at 1.20,
# below the chart's kubeVersion. They are set here, and the build is stamped with them
# (helm.stamp beside the binary), so that a helm built before is rebuilt.
set -euo pipefail

version=v3.21.4
kube_major=1
kube_minor=36
bindir=${CAPSTAN_BIN:-$HOME/.cache/capstan/bin}
helm=$bindir/helm
stamp_file=$bindir/helm.stamp
stamp="$version kubernetes=$kube_major.$kube_minor"

die() {
	echo "scripts/helm.sh: error: $*" >&2
	exit 1
}

installed_version() {
	"$helm" version --template '{{ .Version }}' 2>/dev/null || true
}

current() {
	[[ -x $helm && $(installed_version) == "$version" && $(cat "$stamp_file" 2>/dev/null) == "$stamp" ]]
}

if current; then
	echo "$helm"
	exit 0
fi

command -v go >/dev/null 2>&1 || die "'go' is not on PATH; Go is needed to build helm $version"
mkdir -p "$bindir" || die "cannot create $bindir"
# Serialise concurrent installs (parallel test processes).
if command -v flock >/dev/null 2>&1; then
	exec 9>"$helm.lock"
	flock 9
fi
if current; then
	echo "$helm"
	exit 0
fi

echo "scripts/helm.sh: building helm $version from Go modules (takes a few minutes the first time)" >&2
# helm reports its version from these linker variables; `go install` does not set them.
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$version"
ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
# The Kubernetes version assumed without --kube-version (as helm's own Makefile sets it).
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
	ldflags+=" -X $pkg.k8sVersionMajor=$kube_major -X $pkg.k8sVersionMinor=$kube_minor"
done
rm -f "$stamp_file"
GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN=$bindir \
	go install -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$version" >&2 ||
	die "go install helm.sh/helm/v3/cmd/helm@$version failed"
[[ $(installed_version) == "$version" ]] ||
	die "$helm reports version '$(installed_version)', expected $version"
echo "$stamp" >"$stamp_file"
echo "$helm"
