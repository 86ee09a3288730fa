#!/usr/bin/env bash
# Build Argo CD's single binary (and kustomize, if none is on PATH) from the
# Go module proxy. Idempotent: a second run with the binaries present does
# nothing but print where they are.
#
#   e2e/scripts/argocd.sh
#
# Binaries land in ~/.cache/flotilla/argocd/<version>/bin/: `argocd` plus
# symlinks argocd-application-controller, argocd-repo-server, ... (Argo CD's
# one binary picks its component by argv[0]), and `kustomize`. The CRDs are
# copied to ~/.cache/flotilla/argocd/<version>/crds/.
set -euo pipefail

GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
MOD="github.com/argoproj/argo-cd/v3"
# shellcheck source=lib/gomod.sh
source "$(dirname "$0")/lib/gomod.sh"
export GOFLAGS=-mod=mod CGO_ENABLED=0
if [[ -z "${ARGOCD_VERSION:-}" ]]; then
  # The newest v3.x release the proxy lists (pre-releases skipped).
  ARGOCD_VERSION=$(cd /tmp && "$GO" list -m -versions "$MOD" | tr ' ' '\n' |
    grep -E '^v3\.[0-9]+\.[0-9]+$' | sort -V | tail -1)
fi
CACHE="${FLOTILLA_ARGOCD_DIR:-$HOME/.cache/flotilla/argocd/$ARGOCD_VERSION}"
mkdir -p "$CACHE/bin" "$CACHE/crds"
# One build at a time per version (a second caller waits, then finds the binary).
exec 9>"$CACHE/.lock"
flock 9

if [[ ! -x "$CACHE/bin/argocd" ]]; then
  start=$(date +%s)
  src="$CACHE/src"
  go_module_source "$MOD" "$ARGOCD_VERSION" "$src"
  # Since v3.6 go.mod replaces the gitops-engine with the nested module
  # ./gitops-engine, which the module zip leaves out: it is its own module on
  # the proxy (tagged gitops-engine/vX.Y.Z), so put that copy where the replace points.
  if grep -q '=> ./gitops-engine' "$src/go.mod" && [[ ! -f "$src/gitops-engine/go.mod" ]]; then
    ge=$("$GO" mod download -json "github.com/argoproj/argo-cd/gitops-engine/v3@$ARGOCD_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
    [[ -d "$ge" ]] || { echo "argocd.sh: no gitops-engine module for $ARGOCD_VERSION" >&2; exit 1; }
    rm -rf "$src/gitops-engine"
    cp -r "$ge" "$src/gitops-engine"
    chmod -R u+w "$src/gitops-engine"
  fi
  cd "$src"
  # The UI is embedded (go:embed ui/dist/app); the module has no built UI.
  mkdir -p ui/dist/app
  [[ -n "$(ls -A ui/dist/app)" ]] || echo '<html><body>no UI in this build</body></html>' > ui/dist/app/index.html
  ldflags="-s -w -X $MOD/common.version=${ARGOCD_VERSION#v}"
  "$GO" build -trimpath -ldflags "$ldflags" -o "$CACHE/bin/argocd.tmp" ./cmd
  mv "$CACHE/bin/argocd.tmp" "$CACHE/bin/argocd"
  echo "argocd.sh: built Argo CD $ARGOCD_VERSION in $(( $(date +%s) - start ))s" | tee -a "$CACHE/build-time.txt"
fi
for c in argocd-application-controller argocd-repo-server argocd-server \
  argocd-applicationset-controller argocd-cmp-server argocd-commit-server \
  argocd-dex argocd-notifications argocd-git-ask-pass argocd-k8s-auth; do
  ln -sf argocd "$CACHE/bin/$c"
done
# The repo-server runs these two scripts by name (the image puts them in
# /usr/local/bin); v3.6 runs git-verify-wrapper.sh on every manifest generation.
install -m 0755 "$CACHE/src/hack/git-verify-wrapper.sh" "$CACHE/src/hack/gpg-wrapper.sh" "$CACHE/bin/"
if [[ -d "$CACHE/src/manifests/crds" ]]; then
  cp "$CACHE/src/manifests/crds/"*-crd.yaml "$CACHE/crds/"
fi

# The repo-server runs `kustomize build`; use one on PATH or build one.
if ! command -v kustomize >/dev/null && [[ ! -x "$CACHE/bin/kustomize" ]]; then
  start=$(date +%s)
  # Argo CD v3.6.2's image ships kustomize 5.8.3 (hack/tool-versions.sh), but
  # `go install` of v5.8.3 fails here: the proxy answers 403 for the kube-openapi
  # pseudo-version it requires. v5.8.0 builds.
  KUSTOMIZE_VERSION="${KUSTOMIZE_VERSION:-v5.8.0}"
  GOBIN="$CACHE/bin" GOTOOLCHAIN=auto "$GO" install "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION"
  echo "argocd.sh: built kustomize $KUSTOMIZE_VERSION in $(( $(date +%s) - start ))s" | tee -a "$CACHE/build-time.txt"
fi
echo "argocd.sh: Argo CD $ARGOCD_VERSION in $CACHE/bin"
