#!/usr/bin/env bash
# runc for a dockerd on a host whose capability bounding set lacks some of the kernel's
# capabilities (this machine's lacks CAP_SYS_RESOURCE). `docker run --privileged`, as kind runs its
# nodes, asks for every capability the kernel has, which runc cannot grant ("unable to apply caps:
# operation not permitted"): this removes the ones this process lacks from the container's spec
# (create, run: --bundle) or the process's (exec: --process), then runs runc. kind-prereqs.sh makes
# it dockerd's default runtime on such a host only.
set -euo pipefail

# The kernel's capabilities, by number (linux/capability.h).
names=(CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP
  LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE
  SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME
  SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG
  WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF CHECKPOINT_RESTORE)

# The capabilities missing from this process's bounding set, as a JSON array.
missing() {
  local bnd i
  bnd=$((16#$(awk '/^CapBnd/ {print $2}' /proc/self/status)))
  for i in "${!names[@]}"; do
    (((bnd >> i) & 1)) || echo "CAP_${names[i]}"
  done | jq -R . | jq -sc .
}

# strip PATH FILE: removes the missing capabilities from every set under PATH in the JSON FILE.
strip() {
  jq --argjson drop "$(missing)" \
    "$1 |= (if . then with_entries(.value |= map(select(IN(\$drop[]) | not))) else . end)" \
    "$2" >"$2.tmp"
  mv "$2.tmp" "$2"
}

prev=
for a in "$@"; do
  case $prev in
    --bundle | -b) strip .process.capabilities "$a/config.json" ;;
    --process | -p) strip .capabilities "$a" ;;
  esac
  prev=$a
done
exec runc "$@"
