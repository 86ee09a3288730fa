#!/usr/bin/env bash
# The real KEDA scaling a federated MyApp through the agent's external scaler, against
# the running lab (`cargo run -p flotilla-e2e -- up --members N`). Not part of
# `cargo test -p flotilla-e2e`: it needs KEDA's binaries, which e2e/scripts/keda.sh builds
# from the Go module proxy (20 minutes and more, cold).
#
#   e2e/scripts/keda.sh && e2e/scripts/keda-e2e.sh [MEMBER [OTHER]]   # cluster1 cluster2
#
# It runs KEDA's operator and metrics adapter as local processes with the member's
# kubeconfig, registers v1beta1.external.metrics.k8s.io (an ExternalName Service: the
# lab's apiservers run without kube-proxy), places a MyApp on the member through a
# FederatedMyApp on the host, and applies the seed's ScaledObject (external trigger,
# scalerAddress = the member agent's --scaler-addr). The MyApp's pods are fake (KWOK), so
# a held pod labelled as its pods, Ready at 127.0.0.x, is where a small HTTP server serves
# `custom_metric_queue_length`. The queue goes 50 -> 350 -> (FederatedMyApp re-applied)
# -> 50; the MyApp's replicas are sampled every 2 s and must go 1 -> 4 -> 1, never
# leaving a phase's value once reached, and the re-apply must leave them alone.
#
# Then federated bounds (README "Federated bounds"): a FederatedMyApp with
# `autoscaling: {minReplicas: 2, maxReplicas: 12}` on MEMBER and OTHER (Weighted, equal
# weights: 1..6 each, metric share 6/12), KEDA on MEMBER only, its ScaledObject at
# 1..3 with `metricScope: federation` and `aggregation: max`. The agent must write 1..6
# into the ScaledObject (field manager flotilla-bounds) and KEDA's HPA follow; the queue
# at 800 must read 400 on MEMBER's scaler and give 4 replicas (not 8), back at 50 1;
# OTHER's MyApp, with no autoscaler, stays at its minimum, 1, throughout.
# KEDA_E2E_SCENARIOS="scale bounds" (the default) picks either or both.
# Everything it creates is deleted at the end, KEDA's CRDs too if it installed them.
set -euo pipefail

MEMBER="${1:-cluster1}"
OTHER="${2:-$([[ $MEMBER == cluster2 ]] && echo cluster1 || echo cluster2)}"
SCENARIOS="${KEDA_E2E_SCENARIOS:-scale bounds}"
APP="${KEDA_E2E_APP:-keda-e2e}"
BAPP="$APP-bounds"
NS=default
STATE="${FLOTILLA_E2E_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/e2e-state}"
KEDA_VERSION="${KEDA_VERSION:-v2.21.1}"
KEDA_BIN="${FLOTILLA_KEDA_DIR:-$HOME/.cache/flotilla/keda/$KEDA_VERSION}/bin"
MEMBER_KC="$STATE/kubeconfigs/$MEMBER.yaml"
HOST_KC="$STATE/kubeconfigs/host.yaml"
OTHER_KC="$STATE/kubeconfigs/$OTHER.yaml"
METRIC_IP="${KEDA_E2E_METRIC_IP:-127.0.0.77}"
PHASE_TIMEOUT="${KEDA_E2E_PHASE_TIMEOUT:-180}"

die() { echo "keda-e2e: $*" >&2; exit 1; }
[[ -x "$KEDA_BIN/keda" && -x "$KEDA_BIN/keda-adapter" ]] ||
  die "no KEDA binaries in $KEDA_BIN: run e2e/scripts/keda.sh first (builds KEDA $KEDA_VERSION from the Go module proxy)"
[[ -f "$MEMBER_KC" && -f "$HOST_KC" && -f "$OTHER_KC" ]] || die "no lab at $STATE: run cargo run -p flotilla-e2e -- up"
km() { kubectl --kubeconfig "$MEMBER_KC" "$@"; }
kh() { kubectl --kubeconfig "$HOST_KC" "$@"; }
ko() { kubectl --kubeconfig "$OTHER_KC" "$@"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

SCALER=$(python3 - "$STATE/federation.json" "$MEMBER" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))["components"]["flotilla-agent-" + sys.argv[2]]
print(next(a.split("=", 1)[1] for a in c["args"] if a.startswith("--scaler-addr=")))
PY
) || die "the lab's agent of $MEMBER serves no external scaler"

WORK=$(mktemp -d /tmp/flotilla-keda-e2e.XXXXXX)
PIDS=()
CRDS_INSTALLED=
cleanup() {
  set +e
  for a in "$APP" "$BAPP"; do
    km delete scaledobject "$a" -n "$NS" --ignore-not-found --wait=false >/dev/null
    km delete pod "$a-metrics" -n "$NS" --ignore-not-found --grace-period=0 --wait=false >/dev/null
    kh delete federatedmyapp "$a" -n "$NS" --ignore-not-found >/dev/null
  done
  km delete apiservice v1beta1.external.metrics.k8s.io --ignore-not-found >/dev/null
  km delete namespace keda --ignore-not-found --wait=false >/dev/null
  [[ -n "$CRDS_INSTALLED" ]] && km delete --ignore-not-found -f "$KEDA_BIN/../crd/" >/dev/null
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  wait 2>/dev/null
  echo "keda-e2e: cleaned up; logs in $WORK"
}
trap cleanup EXIT

# Certificates for the operator's gRPC (mutual TLS with the adapter) and the adapter's
# HTTPS: one CA, one pair for both, as KEDA's own cert rotation would make.
certs="$WORK/certs"
mkdir -p "$certs"
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=keda-e2e-ca \
  -keyout "$certs/ca.key" -out "$certs/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj /CN=keda-operator -keyout "$certs/tls.key" \
  -out "$certs/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,DNS:keda-operator.keda.svc,DNS:keda-metrics-apiserver.keda.svc,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' >"$certs/ext"
openssl x509 -req -in "$certs/tls.csr" -CA "$certs/ca.crt" -CAkey "$certs/ca.key" -CAcreateserial \
  -days 2 -extfile "$certs/ext" -out "$certs/tls.crt" 2>/dev/null

km get crd scaledobjects.keda.sh >/dev/null 2>&1 || CRDS_INSTALLED=1
"$(dirname "$0")/keda.sh" "$MEMBER_KC"
km create namespace keda --dry-run=client -o yaml | km apply -f - >/dev/null

GRPC=$(free_port); SECURE=$(free_port); ADAPTER_METRICS=$(free_port)
export WATCH_NAMESPACE="" POD_NAMESPACE=keda KEDA_CLUSTER_OBJECT_NAMESPACE=keda KUBECONFIG="$MEMBER_KC"
"$KEDA_BIN/keda" --cert-dir="$certs" --ca-dir="$certs" --metrics-bind-address=0 \
  --health-probe-bind-address=0 --metrics-service-bind-address="127.0.0.1:$GRPC" \
  --zap-log-level=info >"$WORK/operator.log" 2>&1 &
PIDS+=($!)
"$KEDA_BIN/keda-adapter" --cert-dir="$certs" --tls-cert-file="$certs/tls.crt" \
  --tls-private-key-file="$certs/tls.key" --bind-address=127.0.0.1 --secure-port="$SECURE" \
  --port="$ADAPTER_METRICS" --metrics-service-address="127.0.0.1:$GRPC" \
  --lister-kubeconfig="$MEMBER_KC" --authentication-kubeconfig="$MEMBER_KC" \
  --authorization-kubeconfig="$MEMBER_KC" --zap-log-level=info >"$WORK/adapter.log" 2>&1 &
PIDS+=($!)
unset KUBECONFIG

# The aggregator resolves an ExternalName Service to its name: the adapter on loopback.
km apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Service
metadata: {name: keda-metrics-apiserver, namespace: keda}
spec:
  type: ExternalName
  externalName: 127.0.0.1
  ports: [{name: https, port: $SECURE, targetPort: $SECURE}]
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {name: v1beta1.external.metrics.k8s.io}
spec:
  group: external.metrics.k8s.io
  version: v1beta1
  groupPriorityMinimum: 100
  versionPriority: 100
  insecureSkipTLSVerify: true
  service: {name: keda-metrics-apiserver, namespace: keda, port: $SECURE}
YAML
km wait --for condition=Available --timeout=120s apiservice/v1beta1.external.metrics.k8s.io >/dev/null ||
  { km get apiservice v1beta1.external.metrics.k8s.io -o yaml; tail -20 "$WORK/adapter.log"; die "the external metrics API is not Available"; }
echo "keda-e2e: KEDA operator and adapter up; v1beta1.external.metrics.k8s.io Available"

# The MyApp's pod that exports the queue: held (never scheduled), Ready at METRIC_IP.
PORT=$(free_port)
echo 50 >"$WORK/queue"
python3 - "$METRIC_IP" "$PORT" "$WORK/queue" >"$WORK/exporter.log" 2>&1 <<'PY' &
import http.server, sys
ip, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("# TYPE custom_metric_queue_length gauge\ncustom_metric_queue_length %s\n" % open(path).read().strip()).encode()
        self.send_response(200); self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body))); self.end_headers(); self.wfile.write(body)
http.server.ThreadingHTTPServer((ip, port), H).serve_forever()
PY
PIDS+=($!)

# A held pod labelled as MyApp $1's pods, Ready at METRIC_IP: where its queue is read.
metrics_pod() {
  km delete pod "$1-metrics" -n "$NS" --ignore-not-found --grace-period=0 >/dev/null
  km apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata:
  name: $1-metrics
  namespace: $NS
  labels: {app.kubernetes.io/name: myapp, app.kubernetes.io/instance: $1}
spec:
  schedulingGates: [{name: flotilla.io/e2e-held}]
  containers: [{name: app, image: "registry.example/app:1"}]
YAML
  km patch pod "$1-metrics" -n "$NS" --subresource=status --type=merge \
    -p "{\"status\":{\"podIP\":\"$METRIC_IP\",\"podIPs\":[{\"ip\":\"$METRIC_IP\"}],\"conditions\":[{\"type\":\"Ready\",\"status\":\"True\"}]}}" >/dev/null
}

# The seed's ScaledObject on MyApp $1, names mapped (README "The seed's KEDA external
# scaler"), bounds $2..$3, extra trigger metadata lines in $4, and no stabilization
# windows so that the run takes minutes, not the HPA's default five.
scaled_object() {
  km apply -f - >/dev/null <<YAML
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata: {name: $1, namespace: $NS}
spec:
  scaleTargetRef: {apiVersion: app.example.com/v1, kind: MyApp, name: $1}
  minReplicaCount: $2
  maxReplicaCount: $3
  pollingInterval: 5
  advanced:
    horizontalPodAutoscalerConfig:
      behavior:
        scaleDown: {stabilizationWindowSeconds: 0}
        scaleUp: {stabilizationWindowSeconds: 0}
  triggers:
  - type: external
    metadata:
      scalerAddress: "$SCALER"
      metricName: custom_metric_queue_length
      threshold: "100"
      myApp: $1
      metricsPort: "$PORT"
${4:-}
YAML
}

# Wait until SAMPLER's key is WANT, then hold HOLD seconds and check it never left HOLDWANT
# (a pattern; WANT by default).
phase() {
  local sampler=$1 want=$2 hold=$3 holdwant=${4:-$2} deadline=$(($(date +%s) + PHASE_TIMEOUT)) r
  until [[ $($sampler) == "$want" ]]; do
    (($(date +%s) < deadline)) || die "never reached '$want' (queue $(cat "$WORK/queue")); timeline in $TIMELINE"
    sleep 2
  done
  local until=$(($(date +%s) + hold))
  while (($(date +%s) < until)); do
    sleep 2
    r=$($sampler)
    # shellcheck disable=SC2053 # holdwant is a pattern
    [[ $r == $holdwant ]] || die "left '$want' for '$r' while the queue held; timeline in $TIMELINE"
  done
}
event() { printf '%4ds --- %s\n' "$(($(date +%s) - START))" "$*" | tee -a "$TIMELINE" >&2; }
changes() { awk '/---|watched:/ {print; next} {k=$0; sub(/^ *[0-9]+s /, "", k)} k!=last {print; last=k}' "$TIMELINE"; }

# 1. The seed's ScaledObject scales a MyApp on MEMBER: 50 -> 350 -> 50 gives 1 -> 4 -> 1.
fma() {
  kh apply --server-side --force-conflicts --field-manager=keda-e2e -f - >/dev/null <<YAML
apiVersion: core.kubefed.io/v1beta1
kind: FederatedMyApp
metadata: {name: $APP, namespace: $NS}
spec:
  placement: {clusters: [{name: $MEMBER}]}
  template: {spec: {replicas: 2, image: "nginx:1.27"}}
YAML
}
sample() {
  local r d h
  r=$(km get myapp "$APP" -n "$NS" -o jsonpath='{.spec.replicas}' 2>/dev/null || echo '?')
  d=$(km get deploy "$APP-deploy" -n "$NS" -o jsonpath='{.spec.replicas}' 2>/dev/null || echo '?')
  h=$(km get hpa "keda-hpa-$APP" -n "$NS" -o jsonpath='{.status.desiredReplicas}' 2>/dev/null || echo '-')
  printf '%4ds queue=%-4s myapp=%-3s deploy=%-3s keda-hpa.desired=%s\n' "$(($(date +%s) - START))" \
    "$(cat "$WORK/queue")" "$r" "$d" "$h" | tee -a "$TIMELINE" >&2
  echo "$r"
}
scale_scenario() {
  echo 50 >"$WORK/queue"
  fma
  for _ in $(seq 240); do km get myapp "$APP" -n "$NS" >/dev/null 2>&1 && break; sleep 1; done
  km get myapp "$APP" -n "$NS" >/dev/null || die "the MyApp never reached $MEMBER"
  metrics_pod "$APP"
  scaled_object "$APP" 1 10
  START=$(date +%s)
  TIMELINE="$WORK/timeline"
  echo "keda-e2e: ScaledObject $NS/$APP -> scaler $SCALER; sampling every 2 s" >&2
  phase sample 1 20
  event "queue 50 -> 350"
  echo 350 >"$WORK/queue"
  phase sample 4 20
  event "FederatedMyApp re-applied unchanged (template replicas 2)"
  fma
  phase sample 4 30
  event "queue 350 -> 50"
  echo 50 >"$WORK/queue"
  phase sample 1 20
  local status hpa
  status=$(kh get federatedmyapp "$APP" -n "$NS" -o jsonpath='{.status.currentReplicas} {.status.clusters[0].autoscaler}' 2>/dev/null || true)
  echo "keda-e2e: the hub's status: currentReplicas, autoscaler: $status"
  echo "keda-e2e: the timeline, changes only:"
  changes
  hpa=$(km get hpa "keda-hpa-$APP" -n "$NS" -o jsonpath='{.spec.scaleTargetRef.kind}/{.spec.scaleTargetRef.name}')
  echo "keda-e2e: PASS (scale): KEDA's HPA ($hpa) scaled the MyApp 1 -> 4 -> 1 through the agent's scaler; the re-apply left 4"
  # Out of the way of the next scenario: KEDA deletes its HPA, the agent the MyApp.
  km delete scaledobject "$APP" -n "$NS" --ignore-not-found >/dev/null
  km delete pod "$APP-metrics" -n "$NS" --ignore-not-found --grace-period=0 >/dev/null
  kh delete federatedmyapp "$APP" -n "$NS" --ignore-not-found >/dev/null
}

# 2. Federated bounds: min 2, max 12 over MEMBER and OTHER (1..6 each, share 6/12); KEDA
# on MEMBER only, one global queue read through metricScope: federation.
bfma() {
  kh apply --server-side --force-conflicts --field-manager=keda-e2e -f - >/dev/null <<YAML
apiVersion: core.kubefed.io/v1beta1
kind: FederatedMyApp
metadata: {name: $BAPP, namespace: $NS}
spec:
  placement:
    clusters: [{name: $MEMBER}, {name: $OTHER}]
    replicaScheduling: {mode: Weighted}
  autoscaling: {minReplicas: 2, maxReplicas: 12}
  template: {spec: {image: "nginx:1.27"}}
YAML
}
METRIC_PATH=
# Key: MEMBER's replicas, the ScaledObject's bounds, the HPA's bounds, OTHER's replicas,
# the reading of the external metrics API (what KEDA's HPA gets from the scaler).
bsample() {
  local r so hb hd o m
  r=$(km get myapp "$BAPP" -n "$NS" -o jsonpath='{.spec.replicas}' 2>/dev/null || echo '?')
  so=$(km get scaledobject "$BAPP" -n "$NS" -o jsonpath='{.spec.minReplicaCount}..{.spec.maxReplicaCount}' 2>/dev/null || echo '?')
  hb=$(km get hpa "keda-hpa-$BAPP" -n "$NS" -o jsonpath='{.spec.minReplicas}..{.spec.maxReplicas} {.status.desiredReplicas}' 2>/dev/null || echo '- -')
  o=$(ko get myapp "$BAPP" -n "$NS" -o jsonpath='{.spec.replicas}' 2>/dev/null || echo '?')
  if [[ -z $METRIC_PATH ]]; then
    local name
    name=$(km get hpa "keda-hpa-$BAPP" -n "$NS" -o jsonpath='{.spec.metrics[0].external.metric.name}' 2>/dev/null || true)
    [[ -n $name ]] && METRIC_PATH="/apis/external.metrics.k8s.io/v1beta1/namespaces/$NS/$name?labelSelector=scaledobject.keda.sh%2Fname%3D$BAPP"
  fi
  m=-
  [[ -n $METRIC_PATH ]] && m=$(km get --raw "$METRIC_PATH" 2>/dev/null | jq -r '.items[0].value // "?"' 2>/dev/null || echo '?')
  printf '%4ds queue=%-4s %s: myapp=%-2s scaledobject=%-5s keda-hpa=%-5s desired=%-2s metric=%-4s | %s: myapp=%s\n' \
    "$(($(date +%s) - START))" "$(cat "$WORK/queue")" "$MEMBER" "$r" "$so" "${hb% *}" "${hb#* }" "$m" "$OTHER" "$o" |
    tee -a "$TIMELINE" >&2
  echo "$r so=$so hpa=${hb% *} other=$o metric=$m"
}
bounds_scenario() {
  echo 50 >"$WORK/queue"
  local since
  since=$(date -u +%FT%T)
  bfma
  for _ in $(seq 240); do
    km get myapp "$BAPP" -n "$NS" >/dev/null 2>&1 && ko get myapp "$BAPP" -n "$NS" >/dev/null 2>&1 && break
    sleep 1
  done
  km get myapp "$BAPP" -n "$NS" >/dev/null && ko get myapp "$BAPP" -n "$NS" >/dev/null ||
    die "the MyApp $BAPP never reached both $MEMBER and $OTHER"
  local share=
  for _ in $(seq 60); do
    share=$(km get myapp "$BAPP" -n "$NS" -o jsonpath='{.metadata.annotations.flotilla\.io/autoscaling-metric-share}')
    [[ -n $share ]] && break
    sleep 1
  done
  local ann="{.metadata.annotations.flotilla\.io/autoscaling-min-replicas}..{.metadata.annotations.flotilla\.io/autoscaling-max-replicas} share {.metadata.annotations.flotilla\.io/autoscaling-metric-share}"
  local b1 b2
  b1=$(km get myapp "$BAPP" -n "$NS" -o jsonpath="$ann"); b2=$(ko get myapp "$BAPP" -n "$NS" -o jsonpath="$ann")
  echo "keda-e2e: the hub's bounds on the MyApps: $MEMBER $b1, $OTHER $b2"
  [[ $b1 == "1..6 share 6/12" && $b2 == "1..6 share 6/12" ]] || die "bounds on the MyApps: $MEMBER '$b1', $OTHER '$b2', want '1..6 share 6/12' on both"
  metrics_pod "$BAPP"
  # Every version of the ScaledObject's and the HPA's bounds, from before the apply: the
  # 1..3 the ScaledObject is applied with is gone within a second, before any sample.
  # (kubectl itself in the background, not km: its pid is the one cleanup kills.)
  kubectl --kubeconfig "$MEMBER_KC" get scaledobjects -n "$NS" -w --no-headers \
    -o custom-columns='NAME:.metadata.name,MIN:.spec.minReplicaCount,MAX:.spec.maxReplicaCount' \
    >"$WORK/watch-scaledobjects" 2>&1 &
  PIDS+=($!)
  kubectl --kubeconfig "$MEMBER_KC" get hpa -n "$NS" -w --no-headers \
    -o custom-columns='NAME:.metadata.name,MIN:.spec.minReplicas,MAX:.spec.maxReplicas' \
    >"$WORK/watch-hpa" 2>&1 &
  PIDS+=($!)
  sleep 2
  START=$(date +%s)
  TIMELINE="$WORK/timeline-bounds"
  event "ScaledObject applied: minReplicaCount 1, maxReplicaCount 3"
  scaled_object "$BAPP" 1 3 '      aggregation: max
      metricScope: federation'
  echo "keda-e2e: ScaledObject $NS/$BAPP (1..3, metricScope federation) -> scaler $SCALER; sampling every 2 s" >&2
  # (1) the agent writes 1..6 into the ScaledObject, KEDA's HPA follows; the queue at 50
  # reads 25 on this cluster: 1 replica.
  phase bsample "1 so=1..6 hpa=1..6 other=1 metric=25" 20 "1 so=1..6 hpa=1..6 other=1 metric=*"
  local mf
  mf=$(km get scaledobject "$BAPP" -n "$NS" -o json --show-managed-fields |
    jq -c '[.metadata.managedFields[] | select(.manager == "flotilla-bounds") | {operation, fields: (.fieldsV1["f:spec"] // {} | keys)}]')
  echo "keda-e2e: the ScaledObject's fields of manager flotilla-bounds: $mf"
  [[ $mf == '[{"operation":"Apply","fields":["f:maxReplicaCount","f:minReplicaCount"]}]' ]] ||
    die "the ScaledObject's bounds are not owned by flotilla-bounds (exactly): $mf"
  # The bounds' versions as watched: applied at 1..3, then the agent's 1..6.
  local so_seen hpa_seen
  watched() { awk -v n="$1" '$1 == n { v = $2 ".." $3; if (v != last) { printf "%s%s", sep, v; sep = " -> "; last = v } }' "$WORK/watch-$2"; }
  so_seen=$(watched "$BAPP" scaledobjects); hpa_seen=$(watched "keda-hpa-$BAPP" hpa)
  echo "keda-e2e: watched: ScaledObject $so_seen; HPA keda-hpa-$BAPP $hpa_seen" | tee -a "$TIMELINE"
  [[ $so_seen == "1..3 -> 1..6" ]] || die "the ScaledObject's bounds went '$so_seen', want '1..3 -> 1..6'"
  [[ $hpa_seen == "1..3 -> 1..6" || $hpa_seen == "1..6" ]] || die "KEDA's HPA's bounds went '$hpa_seen', want '1..3 -> 1..6'"
  # (2) one global queue of 800: this cluster's share, 400, gives 4 replicas, not 8.
  event "queue 50 -> 800"
  echo 800 >"$WORK/queue"
  phase bsample "4 so=1..6 hpa=1..6 other=1 metric=400" 20 "4 so=1..6 hpa=1..6 other=1 metric=*"
  # (3) back to 50: 1.
  event "queue 800 -> 50"
  echo 50 >"$WORK/queue"
  phase bsample "1 so=1..6 hpa=1..6 other=1 metric=25" 20 "1 so=1..6 hpa=1..6 other=1 metric=*"
  # Nothing took turns with the agent on the bounds through the whole run.
  so_seen=$(watched "$BAPP" scaledobjects); hpa_seen=$(watched "keda-hpa-$BAPP" hpa)
  echo "keda-e2e: watched to the end: ScaledObject $so_seen; HPA keda-hpa-$BAPP $hpa_seen"
  [[ $so_seen == "1..3 -> 1..6" && ($hpa_seen == "1..3 -> 1..6" || $hpa_seen == "1..6") ]] ||
    die "the bounds moved again: ScaledObject '$so_seen', HPA '$hpa_seen'"
  # OTHER has no autoscaler: the agent there says so, and no HPA targets its MyApp.
  local hpas
  hpas=$(ko get hpa -n "$NS" -o json | jq -r --arg a "$BAPP" '[.items[] | select(.spec.scaleTargetRef.name == $a) | .metadata.name] | join(",")')
  [[ -z $hpas ]] || die "$OTHER has an HPA on $BAPP: $hpas"
  local said
  said=$(sed 's/\x1b\[[0-9;]*m//g' "$STATE/logs/flotilla-agent-$OTHER.log" |
    awk -v t="$since" -v m="MyApp $NS/$BAPP has bounds but no" '$1 >= t && index($0, m)' | tail -1 || true)
  echo "keda-e2e: $OTHER's agent: ${said:-(no line found in its log)}"
  local status
  status=$(kh get federatedmyapp "$BAPP" -n "$NS" -o json |
    jq -c '[.status.clusters[]? | {name, minReplicas, replicas, autoscaler}]' 2>/dev/null || true)
  echo "keda-e2e: the hub's status per cluster: $status"
  echo "keda-e2e: the timeline, changes only:"
  changes
  echo "keda-e2e: PASS (bounds): the agent set KEDA's ScaledObject to 1..6 (flotilla-bounds), its HPA followed; one queue of 800 read 400 on $MEMBER: 4 replicas, back at 50 1; $OTHER stayed at 1"
}

for s in $SCENARIOS; do
  case $s in
    scale) scale_scenario ;;
    bounds) bounds_scenario ;;
    *) die "unknown scenario $s (scale, bounds)" ;;
  esac
done
