#!/usr/bin/env bash
# Builds the Operator Lifecycle Manager tools from their public sources, which the Go
# module proxy does not serve: pass checkouts of the operator-framework repositories at
# the pinned tags below (none of their code enters this repository). Binaries are static
# (CGO_ENABLED=0), built under `nice -n 19`, cached under ~/.cache/flotilla/tools/NAME-TAG;
# a second run finds them and only prints the directories.
#
#   --operator-registry DIR     opm                         -> tools/opm-$OPM_VERSION/
#   --olm DIR                   OLM v0: olm, catalog, package-server, copy-content, cpb
#                                                           -> tools/olm-$OLM_VERSION/
#   --operator-controller DIR   OLM v1: operator-controller, catalogd
#                                                           -> tools/operator-controller-$OPERATOR_CONTROLLER_VERSION/
#     --replace MODULE=DIR      (repeatable) for v1's modules the proxy refuses, e.g.
#                               github.com/operator-framework/operator-registry=DIR,
#                               .../helm-operator-plugins, .../operator-lib,
#                               pkg.package-operator.run/boxcutter (through a go.work
#                               outside the checkouts: nothing in them is edited)
#
# deploy/verify.sh runs `opm validate` and `opm render` on deploy/olm/ when the opm above
# is cached. Env: XDG_CACHE_HOME.
set -euo pipefail

OPM_VERSION=v1.73.0
OLM_VERSION=v0.46.0
OPERATOR_CONTROLLER_VERSION=v1.11.0

cache=${XDG_CACHE_HOME:-$HOME/.cache}/flotilla
tools=$cache/tools
log() { echo "olm-prereqs: $*" >&2; }
die() { log "$*"; exit 1; }

registry_src='' olm_src='' controller_src=''
replaces=()
while (($#)); do
  case $1 in
    --operator-registry) registry_src=$(realpath "$2"); shift 2 ;;
    --olm) olm_src=$(realpath "$2"); shift 2 ;;
    --operator-controller) controller_src=$(realpath "$2"); shift 2 ;;
    --replace) replaces+=("${2%%=*}=$(realpath "${2#*=}")"); shift 2 ;;
    *) die "unknown argument $1 (see the head of $0)" ;;
  esac
done
[ -n "$registry_src$olm_src$controller_src" ] || die "nothing to build (see the head of $0)"
command -v go >/dev/null || die "needs Go"

# at_tag DIR TAG: DIR is a clean checkout of TAG.
at_tag() {
  local tag
  tag=$(git -C "$1" describe --tags --exact-match 2>/dev/null) || die "$1: not a git checkout at a tag"
  [ "$tag" = "$2" ] || die "$1: at $tag, expected $2 (git -C $1 checkout $2)"
  [ -z "$(git -C "$1" status --porcelain --untracked-files=no)" ] || die "$1: has local changes"
}

# restore_vendor DIR: vendored files missing from the checkout (a copy of the history
# without some large blobs) are taken from the Go module proxy's copy of their module.
restore_vendor() {
  local dir=$1 file module version src
  git -C "$dir" ls-files --deleted -- vendor | while read -r file; do
    read -r module version < <(awk -v f="${file#vendor/}" '
      /^# / { m = $2; v = $3 }
      /^# / && index(f, m "/") == 1 && length(m) > length(best) { best = m; bv = v }
      END { print best, bv }' "$dir/vendor/modules.txt")
    [ -n "$module" ] || die "$dir/$file: missing, and no vendored module holds it"
    src=$(go mod download -json "$module@$version" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
    log "restoring $file from $module@$version"
    install -m 0644 "$src/${file#vendor/"$module"/}" "$dir/$file"
  done
  [ -z "$(git -C "$dir" ls-files --deleted -- vendor)" ] || die "$dir: vendored files still missing"
}

# build NAME TAG SRC GO-BUILD-ARGS...: builds into $tools/NAME-TAG unless it is there.
build() {
  local name=$1 tag=$2 src=$3 out=$tools/$1-$2; shift 3
  if [ ! -f "$out/.complete" ]; then
    mkdir -p "$out.tmp"
    log "building $name $tag from $src (about 15 minutes on 2 busy cores)"
    local start=$SECONDS
    (cd "$src" && CGO_ENABLED=0 GOFLAGS=-buildvcs=false nice -n 19 go build -o "$out.tmp/" "$@")
    touch "$out.tmp/.complete"
    rm -rf "$out" && mv "$out.tmp" "$out"
    log "built $name $tag in $((SECONDS - start)) s"
  fi
  echo "$out"
}

mkdir -p "$tools"
exec 9>"$cache/olm-build.lock"
flock 9

if [ -n "$registry_src" ]; then
  at_tag "$registry_src" "$OPM_VERSION"
  pkg=github.com/operator-framework/operator-registry/cmd/opm/version
  build opm "$OPM_VERSION" "$registry_src" -tags json1,containers_image_openpgp \
    -ldflags "-X $pkg.opmVersion=$OPM_VERSION -X $pkg.gitCommit=$(git -C "$registry_src" rev-parse HEAD)" ./cmd/opm
fi

if [ -n "$olm_src" ]; then
  restore_vendor "$olm_src"
  at_tag "$olm_src" "$OLM_VERSION"
  pkg=github.com/operator-framework/operator-lifecycle-manager/pkg/version
  build olm "$OLM_VERSION" "$olm_src" -mod=vendor -tags json1 \
    -ldflags "-s -w -X $pkg.OLMVersion=$OLM_VERSION -X $pkg.GitCommit=$(git -C "$olm_src" rev-parse HEAD)" \
    ./cmd/olm ./cmd/catalog ./cmd/package-server ./cmd/copy-content ./util/cpb
fi

if [ -n "$controller_src" ]; then
  at_tag "$controller_src" "$OPERATOR_CONTROLLER_VERSION"
  work=$cache/src/operator-controller-$OPERATOR_CONTROLLER_VERSION
  mkdir -p "$work"
  rm -f "$work/go.work" "$work/go.work.sum"
  (cd "$work" && go work init "$controller_src" && for r in "${replaces[@]}"; do go work edit "-replace=$r"; done)
  GOWORK=$work/go.work build operator-controller "$OPERATOR_CONTROLLER_VERSION" "$controller_src" \
    -tags containers_image_openpgp \
    -ldflags "-s -w -X github.com/operator-framework/operator-controller/internal/shared/version.version=$OPERATOR_CONTROLLER_VERSION" \
    ./cmd/operator-controller ./cmd/catalogd
fi
