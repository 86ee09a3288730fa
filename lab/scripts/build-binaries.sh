#!/usr/bin/env bash
# Builds the real control-plane binaries the e2e environment runs (kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, etcd, kwok, kwokctl) from the Go module proxy
# and caches them outside the clone, keyed by version. A second run finds them and exits.
# With FLOTILLA_REAL_NODES=1 it also builds what a real node runs (kubelet, kube-proxy, and
# the pod sandbox's pause from the Kubernetes source, with gcc -static), into the same dir.
# With FLOTILLA_KIND=1 (kind-prereqs.sh, for the kind node image) it builds those too, and kubeadm,
# and etcd at kubeadm's default version (etcd-v$FLOTILLA_KIND_ETCD_VERSION).
#
# Usage: build-binaries.sh            prints the directory holding the binaries
# Env:   FLOTILLA_K8S_VERSION, FLOTILLA_ETCD_VERSION, FLOTILLA_KWOK_VERSION, XDG_CACHE_HOME,
#        FLOTILLA_REAL_NODES, FLOTILLA_KIND, FLOTILLA_KIND_ETCD_VERSION
set -euo pipefail

k8s=${FLOTILLA_K8S_VERSION:-1.34.4}
etcd=${FLOTILLA_ETCD_VERSION:-3.6.4}
kwok=${FLOTILLA_KWOK_VERSION:-0.7.0}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/flotilla
out=$cache/bin/k8s-v$k8s-etcd-v$etcd-kwok-v$kwok
# kubectl too: kwokctl shells out to it (health checks) and would otherwise download one.
k8s_cmds=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
want=("${k8s_cmds[@]}" etcd kwok kwokctl)
# Real-node mode and the kind node image only: the default mode never builds (nor waits for) these.
node_cmds=(kubelet kube-proxy)
# The etcd kind's kubeadm runs (its `kubeadm config images list`; kind-prereqs.sh sets it).
kind_etcd=${FLOTILLA_KIND_ETCD_VERSION:-3.6.5}
if [ "${FLOTILLA_KIND:-}" = 1 ]; then node_cmds+=(kubeadm); want+=("etcd-v$kind_etcd"); fi
nodes=
if [ "${FLOTILLA_REAL_NODES:-}" = 1 ] || [ "${FLOTILLA_KIND:-}" = 1 ]; then nodes=1; fi
if [ -n "$nodes" ]; then want+=("${node_cmds[@]}" pause); fi

have_all() { for b in "${want[@]}"; do [ -x "$out/$b" ] || return 1; done; }
if have_all; then echo "$out"; exit 0; fi

log() { echo "build-binaries: $*" >&2; }
mkdir -p "$out" "$cache/src"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false

# One lock so that two environments started at once do not build twice.
exec 9>"$cache/build.lock"
flock 9
if have_all; then echo "$out"; exit 0; fi

minor=${k8s#*.}; minor=${minor%%.*}

# build_k8s SRC-DIR MODULE CMD...: builds k8s.io/kubernetes/cmd/CMD for each CMD not yet in
# $out, in a throwaway module of its own at SRC-DIR (cached, so a rebuild resolves nothing).
build_k8s() {
  local src=$1 module=$2; shift 2
  local missing=() m
  for m in "$@"; do [ -x "$out/$m" ] || missing+=("k8s.io/kubernetes/cmd/$m"); done
  [ ${#missing[@]} -gt 0 ] || return 0
  mkdir -p "$src"
  cd "$src"
  log "building Kubernetes v$k8s $* in $src (cold: tens of minutes on 2 cores)"
  [ -f go.mod ] || go mod init "$module" >/dev/null 2>&1
  # k8s.io/kubernetes requires every staging module at v0.0.0, which the proxy does not serve:
  # replace each with the release's own tag, listed from the release's go.mod.
  local gomod staging args=()
  gomod=$(go mod download -json "k8s.io/kubernetes@v$k8s" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  staging=$(grep -oE '^\s*k8s\.io/[a-z0-9-]+ => \./staging' "$gomod" | awk '{print $1}' | sort -u)
  [ -n "$staging" ] || { log "no staging modules found in $gomod"; exit 1; }
  for m in $staging; do args+=("-replace=$m=$m@v0.$minor.${k8s##*.}"); done
  go mod edit "${args[@]}" "-require=k8s.io/kubernetes@v$k8s"
  {
    printf '//go:build tools\n\npackage tools\n\nimport (\n'
    for m in "${missing[@]}"; do printf '\t_ "%s"\n' "$m"; done
    printf ')\n'
  } > tools.go
  go mod tidy -e >&2 2>&1 || true
  go mod tidy >&2
  local date ld="-s -w" p
  date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $p.gitVersion=v$k8s -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean -X $p.buildDate=$date"
  done
  go build -trimpath -tags selinux,notest -ldflags "$ld" -o "$out/" "${missing[@]}" >&2
}

build_k8s "$cache/src/kubernetes-v$k8s" flotilla.local/k8s-build "${k8s_cmds[@]}"
if [ -n "$nodes" ]; then
  # Its own module, so that the control plane's is left as it is.
  build_k8s "$cache/src/kubernetes-node-v$k8s" flotilla.local/k8s-node-build "${node_cmds[@]}"
fi

if [ -n "$nodes" ] && [ ! -x "$out/pause" ]; then
  # The pod sandbox's process, from the same Kubernetes release's source (its module zip
  # carries build/pause); static, so that it runs in an image holding nothing else.
  dir=$(go mod download -json "k8s.io/kubernetes@v$k8s" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  log "building pause from $dir/build/pause/linux/pause.c"
  gcc -Os -Wall -Werror -static -DVERSION="v$k8s-flotilla" -o "$out/pause.tmp" "$dir/build/pause/linux/pause.c" >&2
  mv "$out/pause.tmp" "$out/pause"
fi

# build_etcd VERSION FILE: etcd VERSION, built into FILE unless there.
build_etcd() {
  local version=$1 file=$2
  [ -x "$file" ] && return 0
  local src=$cache/src/etcd-v$version
  mkdir -p "$src"
  cd "$src"
  log "building etcd v$version"
  [ -f go.mod ] || go mod init flotilla.local/etcd-build >/dev/null 2>&1
  # go install refuses etcd (its go.mod has replace directives): a wrapper main calls etcdmain.
  cat > main.go <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  go get "go.etcd.io/etcd/server/v3@v$version" >&2
  go mod tidy >&2
  go build -trimpath -ldflags "-s -w" -o "$file" . >&2
}
build_etcd "$etcd" "$out/etcd"
if [ "${FLOTILLA_KIND:-}" = 1 ]; then build_etcd "$kind_etcd" "$out/etcd-v$kind_etcd"; fi

if [ ! -x "$out/kwok" ] || [ ! -x "$out/kwokctl" ]; then
  log "building kwok and kwokctl v$kwok"
  GOBIN=$out go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@v$kwok" "sigs.k8s.io/kwok/cmd/kwokctl@v$kwok" >&2
fi

have_all || { log "missing binaries in $out"; exit 1; }
echo "$out"
