#!/usr/bin/env bash
# What `flotilla-e2e up|test --real-nodes` needs from the machine, installed when missing:
# Debian's containerd, runc, CNI plugins, iptables, conntrack and socat for the nodes,
# musl-tools and Rust's musl target for the images' static binaries. Needs root.
set -euo pipefail
packages=(containerd runc containernetworking-plugins iptables conntrack socat musl-tools)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "real-node prerequisites: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # A stale package list names versions the mirror no longer has: refresh and try again.
  apt-get install -y --no-install-recommends "${missing[@]}" \
    || { apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"; }
fi
rustup target list --installed | grep -qx x86_64-unknown-linux-musl \
  || rustup target add x86_64-unknown-linux-musl
