#!/usr/bin/env bash
# Proves what kind-prereqs.sh sets up: two kind clusters at once from the node image built here,
# each with a Ready node and every Pod of kube-system and local-path-storage Ready, and in each a
# Pod of the node's own busybox image that finds a Service through CoreDNS, reaches it through
# kube-proxy and writes to a local-path volume. Then it deletes them and checks that no container,
# volume, network or iptables rule of theirs is left. Needs root.
#
# Usage: bash lab/scripts/kind-smoke.sh
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
eval "$(bash "$here/kind-prereqs.sh")"
kubectl=$(bash "$here/build-binaries.sh")/kubectl
clusters=(flotilla-smoke-1 flotilla-smoke-2)
work=$(mktemp -d)
log() { echo "kind-smoke: $*" >&2; }
fail() { log "FAILED: $*"; exit 1; }
network_before=unknown
cleanup() {
  for c in "${clusters[@]}"; do "$KIND" delete cluster --name "$c" >/dev/null 2>&1 || true; done
  # kind keeps its network for the next cluster: it goes with the last one this made it for.
  if [ -z "$network_before" ] && [ -z "$(docker ps -aq -f network=kind)" ]; then
    docker network rm kind >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# The rules, without their counters.
iptables_rules() { iptables-save | grep -v '^#' | sed 's/ \[[0-9:]*\]$//'; }

# probe CLUSTER: the Pods, DNS, Service and volume checks in CLUSTER.
probe() {
  local k=("$kubectl" --kubeconfig "$work/$1") busybox out
  "${k[@]}" wait --for=condition=Ready node --all --timeout=120s >/dev/null
  "${k[@]}" wait --for=condition=Ready pod --all -n kube-system --timeout=180s >/dev/null
  "${k[@]}" wait --for=condition=Ready pod --all -n local-path-storage --timeout=180s >/dev/null
  busybox=$(docker exec "$1-control-plane" crictl images -o json \
    | jq -r '.images[].repoTags[]' | grep '^flotilla.local/busybox:')
  "${k[@]}" apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: web, labels: {app: web}}
spec:
  containers:
  - {name: web, image: $busybox, command: [sh, -c, 'mkdir /www && echo served-by-web >/www/index.html && exec httpd -f -p 8080 -h /www']}
---
apiVersion: v1
kind: Service
metadata: {name: web}
spec: {selector: {app: web}, ports: [{port: 80, targetPort: 8080}]}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data}
spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 1Mi}}}
---
apiVersion: v1
kind: Pod
metadata: {name: probe}
spec:
  restartPolicy: Never
  containers:
  - name: probe
    image: $busybox
    command: [sh, -c, 'nslookup web.default.svc.cluster.local && wget -q -O- http://web.default.svc.cluster.local:80/ && echo written >/data/f && cat /data/f']
    volumeMounts: [{name: data, mountPath: /data}]
  volumes: [{name: data, persistentVolumeClaim: {claimName: data}}]
EOF
  "${k[@]}" wait --for=condition=Ready pod/web --timeout=120s >/dev/null
  "${k[@]}" wait --for=jsonpath='{.status.phase}'=Succeeded pod/probe --timeout=120s >/dev/null \
    || fail "$1: pod probe: $("${k[@]}" logs probe 2>&1)"
  out=$("${k[@]}" logs probe)
  grep -q served-by-web <<<"$out" || fail "$1: the Service did not answer: $out"
  grep -qx written <<<"$out" || fail "$1: the volume did not take a write: $out"
  log "$1: node Ready, system Pods Ready, DNS, Service and volume work"
}

network_before=$(docker network ls -q -f name='^kind$')
volumes_before=$(docker volume ls -q)
rules_before=$(iptables_rules)
start=$SECONDS
for c in "${clusters[@]}"; do
  "$KIND" create cluster --image "$FLOTILLA_KIND_IMAGE" --name "$c" --kubeconfig "$work/$c" --wait 300s
  log "$c created at $((SECONDS - start)) s"
done
for c in "${clusters[@]}"; do probe "$c"; done
cleanup
left=$(docker ps -aq -f label=io.x-k8s.kind.cluster)
[ -z "$left" ] || fail "kind containers left: $left"
[ "$(docker volume ls -q)" = "$volumes_before" ] || fail "volumes left: $(docker volume ls -q)"
[ -n "$network_before" ] || [ -z "$(docker network ls -q -f name='^kind$')" ] || fail "network kind left"
[ "$(iptables_rules)" = "$rules_before" ] || fail "iptables differs: $(diff <(echo "$rules_before") <(iptables_rules))"
log "both clusters worked and left nothing behind, in $((SECONDS - start)) s"
echo "kind-smoke: ${#clusters[@]} passed, 0 failed"
