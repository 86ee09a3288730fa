#!/usr/bin/env bash
# What `flotilla-e2e up|test --provider kind` needs, from sources this machine reaches (Debian's
# packages, the Go module proxy), cached in ~/.cache/flotilla and keyed by version:
# - Docker from Debian; its daemon is started when none answers, and left running;
# - kind, built from the Go module proxy;
# - a kind node image for the e2e's Kubernetes version, built without a registry: a Debian root
#   filesystem (debootstrap) in the layout of kind's own base image (its files, from the kind
#   module), Debian's containerd, runc and CNI plugins, kubeadm/kubelet/kubectl from
#   build-binaries.sh, and every image kind's kubeadm and manifests run, written here from the
#   binaries and preloaded into the node's containerd (kind's node image build does the same).
# What it changes on the machine is listed in e2e/README.md ("kind"). Needs root.
#
# Usage: eval "$(bash lab/scripts/kind-prereqs.sh)"   prints `export KIND=...` and
#        `export FLOTILLA_KIND_IMAGE=...` on stdout, its log on stderr
# Env:   FLOTILLA_K8S_VERSION, FLOTILLA_KIND_VERSION, FLOTILLA_DEBIAN_MIRROR, XDG_CACHE_HOME
set -euo pipefail

k8s=${FLOTILLA_K8S_VERSION:-1.34.4}
kind_version=${FLOTILLA_KIND_VERSION:-0.33.0}
# What kubeadm v1.34 deploys (`kubeadm config images list`), checked against kubeadm below.
etcd=3.6.5
coredns=1.12.1
pause=3.10.1
crictl=1.34.0
local_path=0.0.30
suite=bookworm
mirror=${FLOTILLA_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# kind's base image packages (images/base/Dockerfile) less the storage and fuse ones, plus
# Debian's containerd, runc and CNI plugins (kind builds its own) and a static busybox for the
# small images.
node_packages=(systemd conntrack iptables nftables iproute2 ethtool util-linux mount kmod
  libseccomp2 pigz e2fsprogs bash ca-certificates curl jq procps
  containerd runc containernetworking-plugins busybox-static)

here=$(cd "$(dirname "$0")" && pwd)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/flotilla
kind_bin=$cache/bin/kind-v$kind_version/kind
image=flotilla.local/kind-node:v$k8s
# The image is rebuilt when this recipe or a version in it changes.
recipe=$(sha256sum <"$0" | cut -c1-16)
log() { echo "kind-prereqs: $*" >&2; }

print_env() {
  echo "export KIND=$kind_bin"
  echo "export FLOTILLA_KIND_IMAGE=$image"
}

# The packages, when missing (a stale package list is refreshed once).
ensure_packages() {
  local missing=() p
  for p in docker.io debootstrap jq; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${missing[@]}" >&2 \
    || { apt-get update >&2 && apt-get install -y --no-install-recommends "${missing[@]}" >&2; }
}

# Whether this process's capability bounding set lacks some of the kernel's capabilities (this
# machine's lacks CAP_SYS_RESOURCE): then dockerd runs its containers with runc-bounded.sh.
caps_bounded() {
  local bnd last
  bnd=$((16#$(awk '/^CapBnd/ {print $2}' /proc/self/status)))
  last=$(cat /proc/sys/kernel/cap_last_cap)
  ((bnd != (1 << (last + 1)) - 1))
}

# A Docker daemon that answers; started (with its own containerd) when none does.
ensure_dockerd() {
  local args=()
  if caps_bounded; then
    cmp -s "$here/runc-bounded.sh" "$cache/docker/runc-bounded" \
      || install -D -m 0755 "$here/runc-bounded.sh" "$cache/docker/runc-bounded"
    args=(--add-runtime "flotilla-runc=$cache/docker/runc-bounded" --default-runtime flotilla-runc)
  fi
  if ! docker info >/dev/null 2>&1; then
    mkdir -p "$cache/docker"
    log "starting dockerd ${args[*]} (log: $cache/docker/dockerd.log)"
    # Docker sets the FORWARD policy to DROP when it is the one that turns forwarding on: turn it
    # on first (Docker would, for its containers), so that Docker leaves the policy alone.
    sysctl -qw net.ipv4.ip_forward=1
    (cd / && exec setsid dockerd "${args[@]}" >>"$cache/docker/dockerd.log" 2>&1 </dev/null &)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { log "dockerd did not answer in 60 s: $cache/docker/dockerd.log"; exit 1; }
  elif [ ${#args[@]} -gt 0 ] && [ "$(docker info -f '{{.DefaultRuntime}}')" != flotilla-runc ]; then
    log "this host's capability bounding set lacks some capabilities, and the dockerd running"
    log "here does not use runc-bounded.sh: kind's privileged nodes would fail. Stop it, run again."
    exit 1
  fi
  # Real-node mode forwards between its nodes over a bridge of its own: DROP would cut it.
  if iptables -S FORWARD | grep -qx -- '-P FORWARD DROP'; then
    log "FORWARD policy DROP (set by Docker): setting it back to ACCEPT for real-node mode"
    iptables -P FORWARD ACCEPT
  fi
}

# kind's documented limits for several clusters on one host (kind's known issues: inotify).
ensure_sysctls() {
  local kv k v
  for kv in fs.inotify.max_user_watches=524288 fs.inotify.max_user_instances=512; do
    k=${kv%=*} v=${kv#*=}
    if [ "$(sysctl -n "$k")" -lt "$v" ]; then
      log "raising $k from $(sysctl -n "$k") to $v"
      sysctl -qw "$k=$v"
    fi
  done
}

# go_install NAME VERSION PACKAGE: PACKAGE@vVERSION built into $cache/bin/NAME-vVERSION/;
# prints the binary's path.
go_install() {
  local dir=$cache/bin/$1-v$2 pkg=$3
  local file
  file=$dir/$(basename "$pkg")
  if [ ! -x "$file" ]; then
    log "building $pkg@v$2"
    CGO_ENABLED=0 GOFLAGS=-buildvcs=false GOBIN=$dir \
      nice -n 19 go install -trimpath -ldflags "-s -w" "$pkg@v$2" >&2
  fi
  echo "$file"
}

# The Debian root filesystem, cached as a tar keyed by suite and package list.
debian_rootfs() {
  local key tar tmp
  key=$(echo "$suite ${node_packages[*]}" | sha256sum | cut -c1-12)
  tar=$cache/kind/rootfs-$suite-$key.tar
  if [ ! -f "$tar" ]; then
    log "debootstrap $suite into a root filesystem (cold: minutes)"
    mkdir -p "$cache/kind"
    tmp=$(mktemp -d "$cache/kind/rootfs.XXXXXX")
    debootstrap --variant=minbase --include="$(IFS=,; echo "${node_packages[*]}")" \
      "$suite" "$tmp" "$mirror" >&2
    # As kind's clean-install does: no package lists, caches, logs or docs in the image.
    rm -rf "$tmp"/var/cache/apt/archives/*.deb "$tmp"/var/lib/apt/lists/* "$tmp"/var/cache/debconf/* \
      "$tmp"/var/log/* "$tmp"/tmp/* "$tmp"/var/tmp/* "$tmp"/usr/share/doc/* "$tmp"/usr/share/man/* \
      "$tmp"/usr/share/locale/*
    tar -C "$tmp" -cf "$tar.tmp" .
    rm -rf "$tmp"
    mv "$tar.tmp" "$tar"
  fi
  echo "$tar"
}

# go_const FILE NAME: the Go raw string constant NAME of FILE (kind's manifests).
go_const() {
  awk -v start="const $2 = \`" '$0 == start { on = 1; next } on && /^`/ { exit } on { print }' "$1"
}

# kind's node layout on the root filesystem ROOT (images/base/Dockerfile, and what
# pkg/build/nodeimage adds: binaries, /kind/version, manifests).
node_layout() {
  local root=$1 bin=$2 kind_src=$3 f mode
  local files=$kind_src/images/base/files
  (cd "$files" && find etc kind usr -type f) | while read -r f; do
    case $f in *fuse-overlayfs*) continue ;; esac # no fuse-overlayfs snapshotter here
    mode=0644
    case $f in kind/bin/* | usr/local/bin/*) mode=0755 ;; esac
    install -D -m "$mode" "$files/$f" "$root/$f"
  done
  chmod 0755 "$root/kind" "$root/kind/bin"
  # Debian's containerd, where kind's unit and its node image build look for it; Debian's CNI
  # plugins, where containerd looks for them.
  ln -sf /usr/bin/containerd "$root/usr/local/bin/containerd"
  mkdir -p "$root/opt/cni"
  ln -sfn /usr/lib/cni "$root/opt/cni/bin"
  # containerd 1.6: no fuse-overlayfs proxy plugin; the sandbox image kubeadm names; Pods'
  # oom_score_adj no lower than containerd's own (what kind does in a user namespace: lowering it
  # needs CAP_SYS_RESOURCE, which a node may lack, see runc-bounded.sh).
  sed -i -e '/^\[proxy_plugins/,/^  address/d' \
    -e "s#sandbox_image = .*#sandbox_image = \"registry.k8s.io/pause:$pause\"#" \
    -e 's#restrict_oom_score_adj = false#restrict_oom_score_adj = true#' \
    "$root/etc/containerd/config.toml"
  chroot "$root" sh -c 'ctr oci spec | jq ".hooks.createContainer[.hooks.createContainer | length] |= . + {\"path\": \"/kind/bin/mount-product-files.sh\"}" | jq "del(.process.rlimits)" > /etc/containerd/cri-base.json'
  # The systemd setup of kind's Dockerfile.
  find "$root/lib/systemd/system/sysinit.target.wants/" -name systemd-tmpfiles-setup.service -delete
  rm -f "$root"/lib/systemd/system/multi-user.target.wants/* "$root"/etc/systemd/system/*.wants/* \
    "$root"/lib/systemd/system/local-fs.target.wants/* "$root"/lib/systemd/system/sockets.target.wants/*udev* \
    "$root"/lib/systemd/system/sockets.target.wants/*initctl* "$root"/lib/systemd/system/basic.target.wants/*
  echo "ReadKMsg=no" >>"$root/etc/systemd/journald.conf"
  # A privileged node's systemd-sysctl would write these host-wide (fs.protected_*, and pid_max
  # on kernels before 6.14): the node leaves the host's kernel settings alone.
  rm -f "$root/usr/lib/sysctl.d/50-pid-max.conf" "$root/usr/lib/sysctl.d/99-protect-links.conf"
  ln -sf /usr/lib/systemd/systemd "$root/sbin/init"
  chroot "$root" systemctl enable kubelet.service containerd.service undo-mount-hacks.service >&2
  chroot "$root" systemctl mask systemd-binfmt.service >&2
  mkdir -p "$root/etc/kubernetes/manifests"
  # What kind's node image build adds.
  for f in kubeadm kubelet kubectl; do install -m 0755 "$bin/$f" "$root/usr/bin/$f"; done
  install -m 0755 "$crictl_bin" "$root/usr/local/bin/crictl"
  printf 'v%s' "$k8s" >"$root/kind/version"
  mkdir -p "$root/kind/manifests"
  go_const "$kind_src/pkg/build/nodeimage/const_cni.go" defaultCNIManifest \
    | sed "s#\` + kindnetdImage + \`#$cni_image#" >"$root/kind/manifests/default-cni.yaml"
  go_const "$kind_src/pkg/build/nodeimage/const_storage.go" defaultStorageManifest \
    | sed -e "s#\` + storageProvisionerImage + \`#$local_path_image#" \
      -e "s#\` + storageHelperImage + \`#$busybox_image#" >"$root/kind/manifests/default-storage.yaml"
  if grep -q '` +' "$root"/kind/manifests/*.yaml || ! grep -q "$cni_image" "$root/kind/manifests/default-cni.yaml"; then
    log "kind v$kind_version's manifests are not the ones this script knows (pkg/build/nodeimage/const_*.go)"
    exit 1
  fi
}

# new_image DIR: an empty image tree in DIR, with /tmp.
new_image() { rm -rf "$1" && mkdir -p "$1/tmp" && chmod 1777 "$1/tmp"; }

# docker_import NAME DIR [docker import --change ...]: the image NAME made of the tree DIR.
docker_import() {
  local name=$1 dir=$2
  shift 2
  tar -C "$dir" -c . | docker import "$@" - "$name" >/dev/null
}

# busybox_tree ROOT DIR: Debian's static busybox (from ROOT) with a link per applet, in DIR.
busybox_tree() {
  local root=$1 dir=$2 a
  install -D -m 0755 "$root/bin/busybox" "$dir/bin/busybox"
  for a in $(chroot "$root" /bin/busybox --list-full); do
    [ -e "$dir/$a" ] || { mkdir -p "$dir/$(dirname "$a")" && ln -s /bin/busybox "$dir/$a"; }
  done
}

# copy_with_libs ROOT DIR FILE...: FILE (a path in ROOT) and the libraries it loads, into DIR.
copy_with_libs() {
  local root=$1 dir=$2 f lib
  shift 2
  for f in "$@"; do
    for lib in "$f" $(chroot "$root" ldd "$f" | grep -o '/[^ ]*'); do
      [ -e "$dir$lib" ] || install -D -m 0755 "$root$lib" "$dir$lib"
    done
  done
}

# The kindnetd stand-in: kindnetd (a module of its own in kind's repository) is not on the Go
# module proxy. On a one-node cluster all it has to do is write the CNI configuration for the pod
# subnet (ptp, host-local, masquerade); it does not route between nodes.
cni_script() {
  cat <<'SH'
#!/bin/sh
# flotilla's stand-in for kindnetd (kind-prereqs.sh): one node's CNI configuration, then idle.
set -eu
subnet=${POD_SUBNET%%,*}
conf=/etc/cni/net.d/10-kindnet.conflist
cat >"$conf.tmp" <<EOF
{"cniVersion": "0.4.0", "name": "kindnet", "plugins": [
  {"type": "ptp", "ipMasq": true, "ipam": {"type": "host-local", "dataDir": "/run/cni-ipam-state",
    "routes": [{"dst": "0.0.0.0/0"}], "ranges": [[{"subnet": "$subnet"}]]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
mv "$conf.tmp" "$conf"
echo "wrote $conf for $subnet"
trap 'exit 0' TERM INT
while :; do sleep 3600 & wait $!; done
SH
}

# Every image the node runs, written from the binaries into one `docker save` archive.
write_images() {
  local root=$1 bin=$2 work=$3 archive=$4 c d
  local path='--change=ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
  for c in kube-apiserver kube-controller-manager kube-scheduler kube-proxy; do
    d=$work/img-$c
    new_image "$d"
    install -D -m 0755 "$bin/$c" "$d/usr/local/bin/$c"
    if [ "$c" = kube-proxy ]; then
      # kube-proxy runs iptables (nft, as kind's entrypoint picks here) and conntrack.
      mkdir -p "$d/usr/lib" "$d/usr/lib64" "$d/usr/sbin"
      ln -s usr/lib "$d/lib" && ln -s usr/lib64 "$d/lib64" && ln -s usr/sbin "$d/sbin"
      local ext=("$root"/usr/lib/x86_64-linux-gnu/xtables/*.so)
      copy_with_libs "$root" "$d" /usr/sbin/xtables-nft-multi /usr/sbin/conntrack "${ext[@]#"$root"}"
      for f in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
        ln -s xtables-nft-multi "$d/usr/sbin/$f"
      done
    fi
    docker_import "registry.k8s.io/$c:v$k8s" "$d" "$path"
  done
  d=$work/img-etcd
  new_image "$d"
  install -D -m 0755 "$bin/etcd-v$etcd" "$d/usr/local/bin/etcd"
  docker_import "registry.k8s.io/etcd:$etcd-0" "$d" "$path"
  d=$work/img-coredns
  new_image "$d"
  install -D -m 0755 "$coredns_bin" "$d/coredns"
  docker_import "registry.k8s.io/coredns/coredns:v$coredns" "$d" '--change=ENTRYPOINT ["/coredns"]'
  d=$work/img-pause
  new_image "$d"
  install -D -m 0755 "$bin/pause" "$d/pause"
  docker_import "registry.k8s.io/pause:$pause" "$d" '--change=ENTRYPOINT ["/pause"]'
  # The tag kind's own containerd config and the e2e suite's Deployments name.
  docker tag "registry.k8s.io/pause:$pause" registry.k8s.io/pause:3.10
  d=$work/img-busybox
  new_image "$d"
  busybox_tree "$root" "$d"
  docker_import "$busybox_image" "$d" "$path"
  cni_script | install -D -m 0755 /dev/stdin "$d/usr/local/bin/flotilla-kindnet"
  docker_import "$cni_image" "$d" "$path" '--change=ENTRYPOINT ["/usr/local/bin/flotilla-kindnet"]'
  d=$work/img-local-path
  new_image "$d"
  install -D -m 0755 "$local_path_bin" "$d/usr/local/bin/local-path-provisioner"
  docker_import "$local_path_image" "$d" "$path"
  local images=("registry.k8s.io/kube-apiserver:v$k8s" "registry.k8s.io/kube-controller-manager:v$k8s"
    "registry.k8s.io/kube-scheduler:v$k8s" "registry.k8s.io/kube-proxy:v$k8s" "registry.k8s.io/etcd:$etcd-0"
    "registry.k8s.io/coredns/coredns:v$coredns" "registry.k8s.io/pause:$pause" registry.k8s.io/pause:3.10
    "$busybox_image" "$cni_image" "$local_path_image")
  docker save -o "$archive" "${images[@]}"
  # They live in the node image only: Docker's own store keeps none of them.
  docker rmi "${images[@]}" >/dev/null
}

# The images kubeadm will run must be the ones written here (it pulls nothing: no registry).
check_kubeadm_images() {
  local want got
  want=$(printf '%s\n' "registry.k8s.io/kube-apiserver:v$k8s" "registry.k8s.io/kube-controller-manager:v$k8s" \
    "registry.k8s.io/kube-scheduler:v$k8s" "registry.k8s.io/kube-proxy:v$k8s" \
    "registry.k8s.io/coredns/coredns:v$coredns" "registry.k8s.io/pause:$pause" \
    "registry.k8s.io/etcd:$etcd-0" | sort)
  got=$("$1/kubeadm" config images list --kubernetes-version "v$k8s" 2>/dev/null | sort)
  if [ "$want" != "$got" ]; then
    log "kubeadm v$k8s runs other images than this script writes:"
    diff <(echo "$want") <(echo "$got") >&2 || true
    exit 1
  fi
}

# The node image: the root filesystem with kind's layout, imported, then the images loaded into
# its containerd in a build container and committed (kind's pkg/build/nodeimage).
build_node_image() {
  local bin=$1 kind_src=$2 rootfs_tar work root base cid
  rootfs_tar=$(debian_rootfs)
  work=$(mktemp -d "$cache/kind/build.XXXXXX")
  root=$work/root
  mkdir "$root"
  tar -C "$root" -xf "$rootfs_tar"
  node_layout "$root" "$bin" "$kind_src"
  log "writing the images"
  write_images "$root" "$bin" "$work" "$work/images.tar"
  base=flotilla.local/kind-base:v$k8s
  docker_import "$base" "$root" '--change=ENV container=docker'
  rm -rf "$root"
  log "loading the images into the node's containerd"
  cid=$(docker run -d --entrypoint=sleep --security-opt seccomp=unconfined "$base" infinity)
  # shellcheck disable=SC2064
  trap "docker rm -f -v $cid >/dev/null 2>&1 || true; rm -rf '$work'" EXIT
  docker exec -d "$cid" containerd
  for _ in $(seq 60); do docker exec "$cid" ctr version >/dev/null 2>&1 && break; sleep 1; done
  docker exec -i "$cid" ctr --namespace=k8s.io images import --all-platforms --no-unpack --digests - \
    <"$work/images.tar" >&2
  docker exec "$cid" pkill -x containerd
  for _ in $(seq 30); do docker exec "$cid" pgrep -x containerd >/dev/null || break; sleep 1; done
  docker commit "$cid" "$base" >/dev/null
  docker rm -f -v "$cid" >/dev/null
  rm -rf "$work"
  trap - EXIT
  # What `docker import` and `docker commit` cannot set (STOPSIGNAL: systemd stops on it).
  local out
  out=$(printf '%s\n' "FROM $base" 'STOPSIGNAL SIGRTMIN+3' 'CMD []' \
    'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' "LABEL io.flotilla.kind-node.recipe=$recipe" \
    | docker build -q -t "$image" - 2>&1) || { log "docker build failed: $out"; exit 1; }
  docker rmi "$base" >/dev/null
}

image_current() {
  [ "$(docker image inspect -f '{{ index .Config.Labels "io.flotilla.kind-node.recipe" }}' "$image" 2>/dev/null)" = "$recipe" ]
}

[ "$(id -u)" = 0 ] || { log "needs root (apt-get, dockerd, debootstrap, chroot)"; exit 1; }
ensure_packages
ensure_dockerd
ensure_sysctls
if [ -x "$kind_bin" ] && image_current; then print_env; exit 0; fi

# One at a time: two environments started at once build once.
mkdir -p "$cache/kind"
exec 9>"$cache/kind.lock"
flock 9
go_install kind "$kind_version" sigs.k8s.io/kind >/dev/null
if ! image_current; then
  log "building the kind node image $image (cold: tens of minutes on 2 cores)"
  old=$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)
  bin=$(FLOTILLA_KIND=1 FLOTILLA_KIND_ETCD_VERSION=$etcd nice -n 19 bash "$here/build-binaries.sh")
  check_kubeadm_images "$bin"
  crictl_bin=$(go_install cri-tools "$crictl" sigs.k8s.io/cri-tools/cmd/crictl)
  coredns_bin=$(go_install coredns "$coredns" github.com/coredns/coredns)
  local_path_bin=$(go_install local-path-provisioner "$local_path" github.com/rancher/local-path-provisioner)
  cni_image=flotilla.local/kind-cni:$recipe
  local_path_image=flotilla.local/local-path-provisioner:v$local_path
  busybox_image=flotilla.local/busybox:$recipe
  kind_src=$(go mod download -json "sigs.k8s.io/kind@v$kind_version" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  build_node_image "$bin" "$kind_src"
  log "built $image"
  # The image it replaces, unless a cluster still runs it.
  if [ -n "$old" ]; then docker rmi "$old" >/dev/null 2>&1 || true; fi
fi
print_env
