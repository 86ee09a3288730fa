#!/usr/bin/env bash
# The real OLM v0 installing and upgrading the MyApp operator's bundle from
# deploy/olm (issue 25, items 3-4). Never part of the default test run: it needs the
# binaries of e2e/scripts/olm.sh (cached in ~/.cache/flotilla/olm/bin).
#
#   e2e/scripts/olm-e2e.sh
#
# What runs: a lab of its own (host + 1 member, in $OLM_E2E_DIR/lab; not beside
# another running lab, whose ports it would take), then OLM's CRDs in the lab's host,
# `olm` and `catalog` as local processes against it, and `opm serve` on loopback
# serving a file-based catalog made from deploy/olm/catalog with each bundle's
# manifests inlined (`image: ""`: OLM reads them from the catalog, so no unpack Job,
# image or registry is needed). The host's MyApp CRD is deleted first: the bundle owns
# it. The operator's pod is KWOK's, so its conversion webhook does not answer; what
# is checked is OLM's side of it.
#
# The checks:
# 1. a Subscription on channel `stable` installs flotilla-myapp-operator.v0.1.0 (the
#    catalog has only it): its CSV Succeeded, its Deployment, and the MyApp CRD with a
#    conversion webhook to the Service OLM made, with OLM's CA bundle;
# 2. automatic upgrade: the catalog gains 0.2.0 (which replaces 0.1.0) and the same
#    Subscription moves to it with no one approving: CSV v0.2.0 Succeeded, v0.1.0 gone.
# Everything is taken down at the end, the lab included.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
W="${OLM_E2E_DIR:-/tmp/flotilla-olm-e2e}"
BIN="${OLM_BIN_DIR:-$HOME/.cache/flotilla/olm/bin}"
OLM_SRC="${OLM_SRC:-$(ls -d "$HOME"/.cache/flotilla/olm/src/operator-lifecycle-manager-v* 2>/dev/null | sort -V | tail -1)}"
PORT="${OLM_E2E_PORT:-50051}"
PACKAGE=flotilla-myapp-operator
NS=flotilla-olm
export FLOTILLA_E2E_DIR="$W/lab"
KC="$FLOTILLA_E2E_DIR/kubeconfigs/host.yaml"
k() { kubectl --kubeconfig "$KC" "$@"; }
log() { echo "olm-e2e: $*" >&2; }
die() { log "FAILED: $*"; exit 1; }

for b in opm olm catalog; do
  [[ -x "$BIN/$b" ]] || die "no $BIN/$b: build it with e2e/scripts/olm.sh"
done
[[ -d "$OLM_SRC/deploy/chart/crds" ]] || die "no OLM checkout with deploy/chart/crds (OLM_SRC)"

down() {
  for p in "$W"/*.pid; do
    [[ -f $p ]] && kill "$(cat "$p")" 2>/dev/null || true
    rm -f "$p"
  done
  (cd "$ROOT" && cargo run -q -p flotilla-e2e -- down) >/dev/null 2>&1 || true
}
trap down EXIT
mkdir -p "$W"

start() { # NAME COMMAND...: a local process, logged to $W/NAME.log
  local name=$1
  shift
  "$@" >"$W/$name.log" 2>&1 &
  echo $! >"$W/$name.pid"
}

serve_catalog() { # DIR
  [[ -f $W/opm.pid ]] && { kill "$(cat "$W/opm.pid")" 2>/dev/null || true; sleep 1; }
  "$BIN/opm" validate "$1"
  start opm "$BIN/opm" serve "$1" -p "$PORT"
  sleep 3
}

wait_for() { # SECONDS WHAT COMMAND...: until COMMAND succeeds
  local seconds=$1 what=$2
  shift 2
  for _ in $(seq "$seconds"); do
    "$@" && return 0
    sleep 1
  done
  die "$what: not within ${seconds}s"
}

# Two catalogs from deploy/olm's, bundles inlined: the first has 0.1.0 only.
python3 - "$ROOT" "$W" "$BIN/opm" "$PACKAGE" <<'PYEOF'
import copy, os, subprocess, sys, yaml
root, w, opm, package = sys.argv[1:]
docs = [d for d in yaml.safe_load_all(open(f"{root}/deploy/olm/catalog/{package}/catalog.yaml")) if d]
full = []
for d in docs:
    if d["schema"] == "olm.bundle":
        version = d["name"].rsplit(".v", 1)[1]
        out = subprocess.run([opm, "render", f"{root}/deploy/olm/bundles/{package}/{version}", "-o", "yaml"],
                             capture_output=True, text=True, check=True).stdout
        d = next(b for b in yaml.safe_load_all(out) if b)
        d["image"] = ""
    full.append(d)
first = []
for d in copy.deepcopy(full):
    if d["schema"] == "olm.bundle" and not d["name"].endswith(".v0.1.0"):
        continue
    if d["schema"] == "olm.channel":
        d["entries"] = [{"name": e["name"]} for e in d["entries"] if e["name"].endswith(".v0.1.0")]
    first.append(d)
for name, content in (("first", first), ("second", full)):
    os.makedirs(f"{w}/{name}/{package}", exist_ok=True)
    with open(f"{w}/{name}/{package}/catalog.yaml", "w") as f:
        yaml.safe_dump_all(content, f)
PYEOF

log "lab up in $FLOTILLA_E2E_DIR"
(cd "$ROOT" && cargo run -q -p flotilla-e2e -- up --members 1)
k delete crd myapps.app.example.com --ignore-not-found --wait=true >/dev/null
k apply --server-side -f "$OLM_SRC/deploy/chart/crds/" >/dev/null
for crd in catalogsources clusterserviceversions installplans operatorgroups subscriptions; do
  k wait --for condition=established --timeout=60s "crd/$crd.operators.coreos.com" >/dev/null
done
k create namespace olm >/dev/null
k create namespace "$NS" >/dev/null
serve_catalog "$W/first"
start olm env KUBECONFIG="$KC" OPERATOR_NAMESPACE=olm OPERATOR_NAME=olm-operator \
  "$BIN/olm" --namespace olm --writeStatusName "" --writePackageServerStatusName ""
start catalog env OPERATOR_NAMESPACE=olm \
  "$BIN/catalog" --kubeconfig "$KC" --namespace olm --writeStatusName ""
k apply -f - >/dev/null <<YAML
apiVersion: operators.coreos.com/v1alpha1
kind: CatalogSource
metadata: {name: flotilla, namespace: olm}
spec: {sourceType: grpc, address: "127.0.0.1:$PORT", displayName: Flotilla (loopback)}
---
apiVersion: operators.coreos.com/v1
kind: OperatorGroup
metadata: {name: flotilla, namespace: $NS}
spec: {}
---
apiVersion: operators.coreos.com/v1alpha1
kind: Subscription
metadata: {name: $PACKAGE, namespace: $NS}
spec: {channel: stable, name: $PACKAGE, source: flotilla, sourceNamespace: olm, installPlanApproval: Automatic}
YAML

phase() { k get csv -n "$NS" "$PACKAGE.v$1" -o jsonpath='{.status.phase}' 2>/dev/null; }
succeeded() { [[ $(phase "$1") == Succeeded ]]; }
start_s=$(date +%s)
wait_for 180 "CSV v0.1.0 Succeeded" succeeded 0.1.0
log "1. installed: $PACKAGE.v0.1.0 Succeeded in $(($(date +%s) - start_s))s"
k get deployment -n "$NS" flotilla-agent >/dev/null || die "no Deployment flotilla-agent"
# The bundle's CRD names deploy/'s Service; OLM points it at its own, with its CA.
conversion() {
  k get crd myapps.app.example.com -o jsonpath='{.spec.conversion.strategy} {.spec.conversion.webhook.clientConfig.service.namespace}/{.spec.conversion.webhook.clientConfig.service.name}'
}
olms_webhook() {
  [[ $(conversion) == "Webhook $NS/flotilla-agent-service" ]] &&
    [[ -n $(k get crd myapps.app.example.com -o jsonpath='{.spec.conversion.webhook.clientConfig.caBundle}') ]]
}
wait_for 60 "the MyApp CRD converting through OLM's Service" olms_webhook
log "1. the MyApp CRD converts through Webhook $NS/flotilla-agent-service, with OLM's CA bundle"
# From here on, what the CRD's conversion is, every half second: the catalog operator
# writes the bundle's CRD as it is (deploy/'s Service, no CA) at each InstallPlan, until
# OLM writes its own again (deploy/olm/README.md). The windows are reported at the end.
sample() {
  while true; do
    echo "$(date +%s.%N) $(conversion 2>/dev/null | tr ' ' _)"
    sleep 0.5
  done
}
sample >"$W/conversion.log" &
echo $! >"$W/sampler.pid"

serve_catalog "$W/second"
# The catalog operator looks at a CatalogSource again when it changes.
k annotate catalogsource -n olm flotilla "flotilla.io/catalog=second" --overwrite >/dev/null
start_s=$(date +%s)
upgraded() { succeeded 0.2.0 && ! k get csv -n "$NS" "$PACKAGE.v0.1.0" >/dev/null 2>&1; }
wait_for 300 "the upgrade to v0.2.0" upgraded
installed=$(k get subscription -n "$NS" "$PACKAGE" -o jsonpath='{.status.installedCSV}')
[[ $installed == "$PACKAGE.v0.2.0" ]] || die "the Subscription's installedCSV is $installed"
log "2. upgraded by itself: $installed Succeeded, v0.1.0 gone, $(($(date +%s) - start_s))s after the catalog gained it"
k get installplans -n "$NS" -o custom-columns=PLAN:.metadata.name,CSV:.spec.clusterServiceVersionNames,APPROVED:.spec.approved
sleep 10
kill "$(cat "$W/sampler.pid")"
rm -f "$W/sampler.pid"
# Windows in which the CRD did not convert through OLM's Service.
awk -v want="Webhook_$NS/flotilla-agent-service" '
  $2 != want && !start { start = $1; what = $2 }
  $2 == want && start { n++; total += $1 - start; printf "olm-e2e: the CRD converted through %s for %.1fs\n", what, $1 - start; start = 0 }
  END {
    if (start) { print "olm-e2e: FAILED: the CRD still converts through " what; exit 1 }
    printf "olm-e2e: 3. the conversion was not OLM'"'"'s in %d window(s), %.1fs in all, over %d samples\n", n, total, NR
  }' "$W/conversion.log" >&2
olms_webhook || die "the MyApp CRD's conversion is $(conversion) at the end"
log "passed"
