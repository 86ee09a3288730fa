#!/usr/bin/env bash
# Build the real Operator Lifecycle Manager for the e2e run of deploy/olm (issue 25):
# opm (operator-registry) and OLM v0 (olm, catalog, package-server, copy-content, cpb),
# and, when its checkout is given, OLM v1 (operator-controller, catalogd).
#
#   e2e/scripts/olm.sh [--operator-registry DIR] [--olm DIR]
#                      [--operator-controller DIR --boxcutter DIR]
#
# The Go module proxy refuses operator-framework's modules and CI cannot fetch from
# GitHub, so the sources are checkouts, at the tags lab/scripts/olm-prereqs.sh pins
# (opm v1.73.0, OLM v0.46.0, operator-controller v1.11.0, which needs boxcutter
# v0.14.0 from github.com/package-operator/boxcutter, also refused by the proxy).
# Each DIR also comes from the environment (OLM_REGISTRY_SRC, OLM_V0_SRC,
# OLM_V1_SRC, OLM_BOXCUTTER_SRC) and defaults to ~/.cache/flotilla/olm/src/<repo>-<tag>;
# a component whose checkout is absent is skipped (opm is required). A checkout is a
# clone at the tag (`git clone -b v1.73.0 https://github.com/operator-framework/operator-registry`);
# OLM's may lack the blob of vendor/github.com/mattn/go-sqlite3/sqlite3-binding.c
# (olm-prereqs.sh restores it from the Go module proxy; a static build ignores it).
#
# lab/scripts/olm-prereqs.sh does the building (static, CGO_ENABLED=0, cached in
# ~/.cache/flotilla/tools/<name>-<tag>/, where deploy/verify.sh finds opm); this script
# runs it on one core (GOMAXPROCS=1, so `go build -p 1`) and links every binary into
# ~/.cache/flotilla/olm/bin/. A second run finds them all and only relinks.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
prereqs="$here/../../lab/scripts/olm-prereqs.sh"
pin() { sed -n "s/^$1=//p" "$prereqs"; }
OPM_VERSION=$(pin OPM_VERSION)
OLM_VERSION=$(pin OLM_VERSION)
OPERATOR_CONTROLLER_VERSION=$(pin OPERATOR_CONTROLLER_VERSION)
BOXCUTTER_VERSION="${BOXCUTTER_VERSION:-v0.14.0}" # operator-controller v1.11.0's go.mod
CACHE="${FLOTILLA_OLM_DIR:-$HOME/.cache/flotilla/olm}"
SRC="$CACHE/src"

registry_src="${OLM_REGISTRY_SRC:-$SRC/operator-registry-$OPM_VERSION}"
olm_src="${OLM_V0_SRC:-$SRC/operator-lifecycle-manager-$OLM_VERSION}"
controller_src="${OLM_V1_SRC:-$SRC/operator-controller-$OPERATOR_CONTROLLER_VERSION}"
boxcutter_src="${OLM_BOXCUTTER_SRC:-$SRC/boxcutter-$BOXCUTTER_VERSION}"
while (($#)); do
  case $1 in
    --operator-registry) registry_src=$2; shift 2 ;;
    --olm) olm_src=$2; shift 2 ;;
    --operator-controller) controller_src=$2; shift 2 ;;
    --boxcutter) boxcutter_src=$2; shift 2 ;;
    *) echo "olm.sh: unknown argument $1 (see the head of $0)" >&2; exit 1 ;;
  esac
done
[[ -f "$registry_src/go.mod" ]] || {
  echo "olm.sh: no checkout of operator-framework/operator-registry at $OPM_VERSION in $registry_src" >&2
  exit 1
}

args=(--operator-registry "$registry_src")
if [[ -f "$olm_src/go.mod" ]]; then
  args+=(--olm "$olm_src")
else
  echo "olm.sh: skipping OLM v0: no checkout in $olm_src" >&2
fi
if [[ -f "$controller_src/go.mod" && -f "$boxcutter_src/go.mod" ]]; then
  # The same operator-registry and operator-framework modules as the v1.11.0 release; the
  # proxy serves operator-framework/api, helm-operator-plugins and operator-lib here.
  args+=(--operator-controller "$controller_src"
    --replace "github.com/operator-framework/operator-registry=$registry_src"
    --replace "pkg.package-operator.run/boxcutter=$boxcutter_src")
else
  echo "olm.sh: skipping OLM v1: no checkouts in $controller_src and $boxcutter_src" >&2
fi

mkdir -p "$CACHE/bin"
start=$(date +%s)
dirs=$(GOMAXPROCS=1 bash "$prereqs" "${args[@]}" 2> >(tee -a "$CACHE/build.log" >&2))
for dir in $dirs; do
  for bin in "$dir"/*; do
    if [[ -x "$bin" ]]; then ln -sf "$bin" "$CACHE/bin/"; fi
  done
done
took=$(($(date +%s) - start))
if ((took > 60)); then # something was built: keep the time
  echo "olm.sh: $(date -u +%FT%TZ) built in ${took}s: $(ls "$CACHE/bin" | tr '\n' ' ')" >>"$CACHE/build-time.txt"
fi
echo "olm.sh: $(ls "$CACHE/bin" | wc -l) binaries in $CACHE/bin (${took}s)"
