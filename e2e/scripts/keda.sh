#!/usr/bin/env bash
# Build KEDA's operator and metrics adapter from the Go module proxy and
# (optionally) install KEDA's CRDs into a cluster.
#
#   e2e/scripts/keda.sh                      # build (cached) only
#   e2e/scripts/keda.sh KUBECONFIG_FILE      # build, then install the CRDs
#
# Binaries land in ~/.cache/flotilla/keda/<version>/bin/{keda,keda-adapter}
# and the CRDs in ~/.cache/flotilla/keda/<version>/crd/. A second run with
# the binaries present does nothing but (re)apply the CRDs.
set -euo pipefail

KEDA_VERSION="${KEDA_VERSION:-v2.21.1}"
GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
CACHE="${FLOTILLA_KEDA_DIR:-$HOME/.cache/flotilla/keda/$KEDA_VERSION}"
MOD="github.com/kedacore/keda/v2"
# shellcheck source=lib/gomod.sh
source "$(dirname "$0")/lib/gomod.sh"

mkdir -p "$CACHE/bin" "$CACHE/crd"
export GOFLAGS=-mod=mod CGO_ENABLED=0

if [[ ! -x "$CACHE/bin/keda" || ! -x "$CACHE/bin/keda-adapter" ]]; then
  start=$(date +%s)
  src="$CACHE/src"
  go_module_source "$MOD" "$KEDA_VERSION" "$src"
  cd "$src"
  ldflags="-s -w -X github.com/kedacore/keda/v2/version.Version=${KEDA_VERSION#v}"
  [[ -x "$CACHE/bin/keda" ]] ||
    "$GO" build -trimpath -ldflags "$ldflags" -o "$CACHE/bin/keda" ./cmd/operator
  [[ -x "$CACHE/bin/keda-adapter" ]] ||
    "$GO" build -trimpath -ldflags "$ldflags" -o "$CACHE/bin/keda-adapter" ./cmd/adapter
  cp config/crd/bases/*.yaml "$CACHE/crd/"
  echo "keda.sh: built KEDA $KEDA_VERSION in $(( $(date +%s) - start ))s" | tee "$CACHE/build-time.txt"
fi

if [[ $# -ge 1 ]]; then
  kubectl --kubeconfig "$1" apply --server-side -f "$CACHE/crd/" >/dev/null
  for crd in scaledobjects.keda.sh scaledjobs.keda.sh triggerauthentications.keda.sh \
    clustertriggerauthentications.keda.sh; do
    # (`kubectl wait` fails at once on a CRD with no conditions yet.)
    for _ in $(seq 60); do
      [[ $(kubectl --kubeconfig "$1" get "crd/$crd" \
        -o jsonpath='{.status.conditions[?(@.type=="Established")].status}') == True ]] && break
      sleep 1
    done
    kubectl --kubeconfig "$1" wait --for condition=established --timeout=10s "crd/$crd" >/dev/null
  done
  echo "keda.sh: KEDA $KEDA_VERSION CRDs installed via $1"
fi
