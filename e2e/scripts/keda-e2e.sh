#!/usr/bin/env bash
# The real KEDA scaling a federated MyApp through the agent's external scaler, against
# the running lab (`cargo run -p flotilla-e2e -- up --members N`). Not part of
# `cargo test -p flotilla-e2e`: it needs KEDA's binaries, which e2e/scripts/keda.sh builds
# from the Go module proxy (20 minutes and more, cold).
#
#   e2e/scripts/keda.sh && e2e/scripts/keda-e2e.sh [MEMBER]     # MEMBER: cluster1
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
# Everything it creates is deleted at the end, KEDA's CRDs too if it installed them.
set -euo pipefail

MEMBER="${1:-cluster1}"
APP="${KEDA_E2E_APP:-keda-e2e}"
NS=default
STATE="${FLOTILLA_E2E_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/e2e-state}"
KEDA_VERSION="${KEDA_VERSION:-v2.21.1}"
KEDA_BIN="${FLOTILLA_KEDA_DIR:-$HOME/.cache/flotilla/keda/$KEDA_VERSION}/bin"
MEMBER_KC="$STATE/kubeconfigs/$MEMBER.yaml"
HOST_KC="$STATE/kubeconfigs/host.yaml"
METRIC_IP="${KEDA_E2E_METRIC_IP:-127.0.0.77}"
PHASE_TIMEOUT="${KEDA_E2E_PHASE_TIMEOUT:-180}"

die() { echo "keda-e2e: $*" >&2; exit 1; }
[[ -x "$KEDA_BIN/keda" && -x "$KEDA_BIN/keda-adapter" ]] ||
  die "no KEDA binaries in $KEDA_BIN: run e2e/scripts/keda.sh first (builds KEDA $KEDA_VERSION from the Go module proxy)"
[[ -f "$MEMBER_KC" && -f "$HOST_KC" ]] || die "no lab at $STATE: run cargo run -p flotilla-e2e -- up"
km() { kubectl --kubeconfig "$MEMBER_KC" "$@"; }
kh() { kubectl --kubeconfig "$HOST_KC" "$@"; }
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
  km delete scaledobject "$APP" -n "$NS" --ignore-not-found --wait=false >/dev/null
  km delete pod "$APP-metrics" -n "$NS" --ignore-not-found --grace-period=0 --wait=false >/dev/null
  kh delete federatedmyapp "$APP" -n "$NS" --ignore-not-found >/dev/null
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
fma
for _ in $(seq 240); do km get myapp "$APP" -n "$NS" >/dev/null 2>&1 && break; sleep 1; done
km get myapp "$APP" -n "$NS" >/dev/null || die "the MyApp never reached $MEMBER"

km delete pod "$APP-metrics" -n "$NS" --ignore-not-found --grace-period=0 >/dev/null
km apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata:
  name: $APP-metrics
  namespace: $NS
  labels: {app.kubernetes.io/name: myapp, app.kubernetes.io/instance: $APP}
spec:
  schedulingGates: [{name: flotilla.io/e2e-held}]
  containers: [{name: app, image: "registry.example/app:1"}]
YAML
km patch pod "$APP-metrics" -n "$NS" --subresource=status --type=merge \
  -p "{\"status\":{\"podIP\":\"$METRIC_IP\",\"podIPs\":[{\"ip\":\"$METRIC_IP\"}],\"conditions\":[{\"type\":\"Ready\",\"status\":\"True\"}]}}" >/dev/null

# The seed's ScaledObject, names mapped (README "The seed's KEDA external scaler"), with
# no stabilization windows so that the run takes minutes, not the HPA's default five.
km apply -f - >/dev/null <<YAML
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata: {name: $APP, namespace: $NS}
spec:
  scaleTargetRef: {apiVersion: app.example.com/v1, kind: MyApp, name: $APP}
  minReplicaCount: 1
  maxReplicaCount: 10
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
      myApp: $APP
      metricsPort: "$PORT"
YAML

START=$(date +%s)
TIMELINE="$WORK/timeline"
sample() {
  local r d h
  r=$(km get myapp "$APP" -n "$NS" -o jsonpath='{.spec.replicas}' 2>/dev/null || echo '?')
  d=$(km get deploy "$APP-deploy" -n "$NS" -o jsonpath='{.spec.replicas}' 2>/dev/null || echo '?')
  h=$(km get hpa "keda-hpa-$APP" -n "$NS" -o jsonpath='{.status.desiredReplicas}' 2>/dev/null || echo '-')
  printf '%4ds queue=%-4s myapp=%-3s deploy=%-3s keda-hpa.desired=%s\n' "$(($(date +%s) - START))" \
    "$(cat "$WORK/queue")" "$r" "$d" "$h" | tee -a "$TIMELINE" >&2
  echo "$r"
}
# Wait until the replicas are WANT, then hold HOLD seconds and check they never moved.
phase() {
  local want=$1 hold=$2 deadline=$(($(date +%s) + PHASE_TIMEOUT)) r
  until [[ $(sample) == "$want" ]]; do
    (($(date +%s) < deadline)) || die "replicas never reached $want (queue $(cat "$WORK/queue")); timeline in $TIMELINE"
    sleep 2
  done
  local until=$(($(date +%s) + hold))
  while (($(date +%s) < until)); do
    sleep 2
    r=$(sample)
    [[ $r == "$want" ]] || die "replicas left $want for $r while the queue held; timeline in $TIMELINE"
  done
}

echo "keda-e2e: ScaledObject $NS/$APP -> scaler $SCALER; sampling every 2 s" >&2
event() { printf '%4ds --- %s\n' "$(($(date +%s) - START))" "$*" | tee -a "$TIMELINE" >&2; }
phase 1 20
event "queue 50 -> 350"
echo 350 >"$WORK/queue"
phase 4 20
event "FederatedMyApp re-applied unchanged (template replicas 2)"
fma
phase 4 30
event "queue 350 -> 50"
echo 50 >"$WORK/queue"
phase 1 20
status=$(kh get federatedmyapp "$APP" -n "$NS" -o jsonpath='{.status.currentReplicas} {.status.clusters[0].autoscaler}' 2>/dev/null || true)
echo "keda-e2e: the hub's status: currentReplicas, autoscaler: $status"
echo "keda-e2e: the timeline, changes only:"
awk '/---/ {print; next} {k=$2" "$3" "$4" "$5} k!=last {print; last=k}' "$TIMELINE"
hpa=$(km get hpa "keda-hpa-$APP" -n "$NS" -o jsonpath='{.spec.scaleTargetRef.kind}/{.spec.scaleTargetRef.name}')
echo "keda-e2e: PASS: KEDA's HPA ($hpa) scaled the MyApp 1 -> 4 -> 1 through the agent's scaler; the re-apply left 4"
