#!/usr/bin/env bash
# The real OLM v0 installing, upgrading and scoping the MyApp operator's bundles from
# deploy/olm (issue 25, items 3-4). Never part of the default test run: it needs the
# binaries of e2e/scripts/olm.sh (cached in ~/.cache/flotilla/olm/bin) and the debug
# builds of the lab (`cargo build -p flotilla-agent -p flotilla-hub`).
#
#   e2e/scripts/olm-e2e.sh
#   e2e/scripts/olm-e2e.sh --real-nodes     (or OLM_E2E_NODES=real; as root)
#
# --real-nodes runs the same steps on the lab's real nodes, every image from a loopback
# registry and everything OLM deploys a real Pod: e2e/scripts/olm-e2e-real.sh, which
# says what it needs. What follows is the default mode, on KWOK nodes.
#
# What runs: a lab of its own (host + 1 member, in $OLM_E2E_DIR/lab; not beside
# another running lab, whose ports it would take), then OLM's CRDs in the lab's host,
# `olm` and `catalog` as local processes against it, and `opm serve` on loopback
# serving a file-based catalog made from deploy/olm/catalog with each bundle's
# manifests inlined (`image: ""`: OLM reads them from the catalog, so no unpack Job,
# image or registry is needed). The host's MyApp CRD is deleted first: the bundle owns
# it. The lab's pods are KWOK's and run nothing, so the webhook does not answer (what
# is checked is OLM's side of it) and the scoped operator is run as a local process
# with its ServiceAccount's token and the arguments OLM put on its Deployment.
#
# The checks:
# 0. dependency refused: the catalog has flotilla-myapp-operator only; a Subscription
#    to it (OperatorGroup AllNamespaces, namespace flotilla-olm) is not resolved, and
#    its condition ResolutionFailed says why (nothing provides MyApp v1);
# 1. dependency resolved: the catalog gains flotilla-myapp-api (the MyApp CRD and its
#    conversion webhook); the same Subscription installs both: two CSVs Succeeded, a
#    Subscription OLM made for flotilla-myapp-api, and the CRD converting through the
#    Service OLM made for the webhook, with OLM's CA bundle; `flotilla-agent webhook`
#    with the Deployment's args and OLM's certificate converts a v1alpha1 MyApp;
# 2. automatic upgrade: the catalog gains 0.2.0 of both (each replaces its 0.1.0):
#    both move to 0.2.0 with no one approving, 0.1.0 gone; the CRD's conversion is
#    sampled every half second and each window in which it is not OLM's is reported;
# 3. tenancy: the AllNamespaces operator uninstalled (the API stays), an OperatorGroup
#    in flotilla-tenant targeting team-a and a Subscription to the operator there; the
#    InstallPlan OLM makes is printed; `kubectl auth can-i --list` as the operator's
#    ServiceAccount in team-a and team-b; the operator run with the Deployment's
#    arguments and environment (the downward API resolved by this script,
#    `olm.targetNamespaces` from the pod template) and a token of its ServiceAccount:
#    a MyApp in team-a gets its ConfigMap, Deployment and status, one in team-b
#    nothing, and the operator's log holds no refused (403) request; then how long the
#    CRD's conversion took to be OLM's again after the tenant's InstallPlan.
# Everything is taken down at the end, the lab included.
set -euo pipefail

if [[ ${1:-} == --real-nodes || ${OLM_E2E_NODES:-} == real ]]; then
  exec bash "$(dirname "$0")/olm-e2e-real.sh"
fi
[[ $# == 0 ]] || { echo "olm-e2e: unknown argument $1 (see the head of $0)" >&2; exit 1; }

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
W="${OLM_E2E_DIR:-/tmp/flotilla-olm-e2e}"
BIN="${OLM_BIN_DIR:-$HOME/.cache/flotilla/olm/bin}"
OLM_SRC="${OLM_SRC:-$(ls -d "$HOME"/.cache/flotilla/olm/src/operator-lifecycle-manager-v* 2>/dev/null | sort -V | tail -1)}"
AGENT="${FLOTILLA_AGENT_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/debug/flotilla-agent}"
PORT="${OLM_E2E_PORT:-50051}"
PACKAGE=flotilla-myapp-operator
API=flotilla-myapp-api
# OLM serves a conversion webhook through the Service <deployment>-service.
WEBHOOK_SERVICE=flotilla-myapp-webhook-service
NS=flotilla-olm
TENANT=flotilla-tenant
export FLOTILLA_E2E_DIR="$W/lab"
KC="$FLOTILLA_E2E_DIR/kubeconfigs/host.yaml"
k() { kubectl --kubeconfig "$KC" "$@"; }
log() { echo "olm-e2e: $*" >&2; }
die() {
  log "FAILED: $*"
  exit 1
}

for b in opm olm catalog; do
  [[ -x "$BIN/$b" ]] || die "no $BIN/$b: build it with e2e/scripts/olm.sh"
done
[[ -x $AGENT ]] || die "no $AGENT: cargo build -p flotilla-agent (or FLOTILLA_AGENT_BIN)"
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
rm -f "$W"/*.log

start() { # NAME COMMAND...: a local process, logged to $W/NAME.log
  local name=$1
  shift
  "$@" >"$W/$name.log" 2>&1 &
  echo $! >"$W/$name.pid"
}

serve_catalog() { # DIR
  [[ -f $W/opm.pid ]] && {
    kill "$(cat "$W/opm.pid")" 2>/dev/null || true
    sleep 1
  }
  "$BIN/opm" validate "$1"
  start opm "$BIN/opm" serve "$1" -p "$PORT"
  sleep 3
  # The catalog operator looks at a CatalogSource again when it changes.
  if k get catalogsource -n olm flotilla >/dev/null 2>&1; then
    k annotate catalogsource -n olm flotilla "flotilla.io/catalog=$(basename "$1")" --overwrite >/dev/null
  fi
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

# Three catalogs from deploy/olm's, bundles inlined: `noapi` has the operator's 0.1.0
# and not the API it requires, `first` both packages' 0.1.0, `second` all of them.
python3 - "$ROOT" "$W" "$BIN/opm" "$PACKAGE" "$API" <<'EOF'
import copy, os, shutil, subprocess, sys, yaml
root, w, opm, *packages = sys.argv[1:]
full = {}
for package in packages:
    docs = [d for d in yaml.safe_load_all(open(f"{root}/deploy/olm/catalog/{package}/catalog.yaml")) if d]
    out = []
    for d in docs:
        if d["schema"] == "olm.bundle":
            version = d["name"].rsplit(".v", 1)[1]
            rendered = subprocess.run([opm, "render", f"{root}/deploy/olm/bundles/{package}/{version}", "-o", "yaml"],
                                      capture_output=True, text=True, check=True).stdout
            d = next(b for b in yaml.safe_load_all(rendered) if b)
            d["image"] = ""
        out.append(d)
    full[package] = out

def first_only(docs):
    out = []
    for d in copy.deepcopy(docs):
        if d["schema"] == "olm.bundle" and not d["name"].endswith(".v0.1.0"):
            continue
        if d["schema"] == "olm.channel":
            d["entries"] = [{"name": e["name"]} for e in d["entries"] if e["name"].endswith(".v0.1.0")]
        out.append(d)
    return out

catalogs = {
    "noapi": {packages[0]: first_only(full[packages[0]])},
    "first": {p: first_only(full[p]) for p in packages},
    "second": full,
}
for name, content in catalogs.items():
    shutil.rmtree(f"{w}/{name}", ignore_errors=True)
    for package, docs in content.items():
        os.makedirs(f"{w}/{name}/{package}", exist_ok=True)
        with open(f"{w}/{name}/{package}/catalog.yaml", "w") as f:
            yaml.safe_dump_all(docs, f)
EOF

all_start=$(date +%s)
log "lab up in $FLOTILLA_E2E_DIR"
(cd "$ROOT" && cargo run -q -p flotilla-e2e -- up --members 1)
k delete crd myapps.app.example.com --ignore-not-found --wait=true >/dev/null
k apply --server-side -f "$OLM_SRC/deploy/chart/crds/" >/dev/null
for crd in catalogsources clusterserviceversions installplans operatorgroups subscriptions; do
  k wait --for condition=established --timeout=60s "crd/$crd.operators.coreos.com" >/dev/null
done
for ns in olm "$NS" "$TENANT" team-a team-b; do k create namespace "$ns" >/dev/null; done
log "lab and OLM's CRDs ready in $(($(date +%s) - all_start))s"
serve_catalog "$W/noapi"
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

# --- 0. the dependency refused ------------------------------------------------------
condition() { # NAMESPACE SUBSCRIPTION TYPE FIELD
  k get subscription -n "$1" "$2" -o jsonpath="{.status.conditions[?(@.type==\"$3\")].$4}" 2>/dev/null
}
refused() { [[ $(condition "$NS" "$PACKAGE" ResolutionFailed status) == True ]]; }
start_s=$(date +%s)
wait_for 120 "the Subscription refused without the MyApp API" refused
log "0. refused without $API in the catalog ($(($(date +%s) - start_s))s): ResolutionFailed=True," \
  "reason $(condition "$NS" "$PACKAGE" ResolutionFailed reason): $(condition "$NS" "$PACKAGE" ResolutionFailed message)"
[[ -z $(k get csv -n "$NS" -o name) ]] || die "a CSV was installed: $(k get csv -n "$NS" -o name)"
if k get crd myapps.app.example.com >/dev/null 2>&1; then die "the MyApp CRD exists"; fi

# --- 1. the dependency resolved -----------------------------------------------------
phase() { k get csv -n "${3:-$NS}" "$1.v$2" -o jsonpath='{.status.phase}' 2>/dev/null; }
succeeded() { [[ $(phase "$@") == Succeeded ]]; }
both_succeeded() { succeeded "$PACKAGE" "$1" && succeeded "$API" "$1"; }
serve_catalog "$W/first"
start_s=$(date +%s)
wait_for 180 "CSVs v0.1.0 of $PACKAGE and $API Succeeded" both_succeeded 0.1.0
log "1. resolved: $PACKAGE.v0.1.0 and $API.v0.1.0 Succeeded $(($(date +%s) - start_s))s after the catalog gained $API"
k get csv -n "$NS" -o custom-columns=CSV:.metadata.name,PHASE:.status.phase,REQUIRED:.spec.customresourcedefinitions.required[*].name,OWNED:.spec.customresourcedefinitions.owned[*].name >&2
k get subscriptions -n "$NS" -o custom-columns=SUBSCRIPTION:.metadata.name,PACKAGE:.spec.name,INSTALLED:.status.installedCSV >&2
[[ -n $(k get subscriptions -n "$NS" -o jsonpath="{.items[?(@.spec.name==\"$API\")].metadata.name}") ]] ||
  die "no Subscription to $API made by OLM"
[[ $(condition "$NS" "$PACKAGE" ResolutionFailed status) != True ]] || die "the Subscription still says ResolutionFailed"
k get deployment -n "$NS" flotilla-agent flotilla-myapp-webhook >/dev/null || die "missing Deployments"
# The bundle's CRD names deploy/'s Service; OLM points it at its own, with its CA.
conversion() {
  k get crd myapps.app.example.com -o jsonpath='{.spec.conversion.strategy} {.spec.conversion.webhook.clientConfig.service.namespace}/{.spec.conversion.webhook.clientConfig.service.name}'
}
olms_webhook() {
  [[ $(conversion) == "Webhook $NS/$WEBHOOK_SERVICE" ]] &&
    [[ -n $(k get crd myapps.app.example.com -o jsonpath='{.spec.conversion.webhook.clientConfig.caBundle}') ]]
}
# From here on, what the CRD's conversion is, every half second: the catalog operator
# writes the bundle's CRD as it is (deploy/'s Service, no CA) at each InstallPlan step,
# until the olm operator writes its own again (deploy/olm/README.md); a write that
# lands after the API's CSV Succeeded waits for the olm operator's next wake-up (every
# 5 min by default). The windows are reported at step 2.
sample() {
  while true; do
    echo "$(date +%s.%N) $(conversion 2>/dev/null | tr ' ' _)"
    sleep 0.5
  done
}
sample >"$W/conversion.log" &
echo $! >"$W/sampler.pid"
start_s=$(date +%s)
wait_for 330 "the MyApp CRD converting through OLM's Service" olms_webhook
log "1. the MyApp CRD converts through Webhook $NS/$WEBHOOK_SERVICE, with OLM's CA bundle ($(($(date +%s) - start_s))s after both CSVs Succeeded)"
log "1. the webhook's Deployment runs flotilla-agent $(k get deployment -n "$NS" flotilla-myapp-webhook -o jsonpath='{.spec.template.spec.containers[0].args}')"

# The webhook as its Deployment runs it (the args OLM put there), with the certificate
# OLM issued (the Secret <service>-cert) and checked against the CA bundle OLM wrote
# into the CRD: a v1alpha1 MyApp converted to v1. The apiserver cannot call it here
# (the Service's pods are KWOK's), so the request is curl's, to the local process.
k get secret -n "$NS" "$WEBHOOK_SERVICE-cert" -o jsonpath='{.data.tls\.crt}' | base64 -d >"$W/webhook.crt"
k get secret -n "$NS" "$WEBHOOK_SERVICE-cert" -o jsonpath='{.data.tls\.key}' | base64 -d >"$W/webhook.key"
k get crd myapps.app.example.com -o jsonpath='{.spec.conversion.webhook.clientConfig.caBundle}' | base64 -d >"$W/webhook-ca.crt"
mapfile -t webhook_args < <(k get deployment -n "$NS" flotilla-myapp-webhook -o json | python3 -c '
import json, sys
local = {"--http-addr": "127.0.0.1:18581", "--webhook-addr": "127.0.0.1:18582",
         "--webhook-cert": sys.argv[1] + "/webhook.crt", "--webhook-key": sys.argv[1] + "/webhook.key"}
for arg in json.load(sys.stdin)["spec"]["template"]["spec"]["containers"][0]["args"]:
    name = arg.split("=", 1)[0]
    print(f"{name}={local[name]}" if name in local else arg)' "$W")
start webhook "$AGENT" --kubeconfig "$KC" "${webhook_args[@]}"
review='{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{"uid":"olm-e2e","desiredAPIVersion":"app.example.com/v1","objects":[{"apiVersion":"app.example.com/v1alpha1","kind":"MyApp","metadata":{"name":"web","namespace":"team-a"},"spec":{"size":3,"image":"nginx:1.27"}}]}}'
host="$WEBHOOK_SERVICE.$NS.svc"
convert() {
  curl -sf --cacert "$W/webhook-ca.crt" --resolve "$host:18582:127.0.0.1" -H 'Content-Type: application/json' \
    -d "$review" "https://$host:18582/convert" >"$W/converted.json"
}
wait_for 30 "flotilla-agent webhook answering with OLM's certificate" convert
python3 -c '
import json, sys
response = json.load(open(sys.argv[1]))["response"]
assert response["result"]["status"] == "Success", response
[o] = response["convertedObjects"]
assert o["apiVersion"] == "app.example.com/v1" and o["spec"] == {"replicas": 3, "image": "nginx:1.27"}, o' "$W/converted.json" ||
  die "the conversion: $(cat "$W/converted.json")"
kill "$(cat "$W/webhook.pid")"
rm -f "$W/webhook.pid"
log "1. flotilla-agent ${webhook_args[0]}, with OLM's certificate for $host (verified against the CRD's caBundle): v1alpha1 size 3 converted to v1 replicas 3"

# --- 2. the automatic upgrade -------------------------------------------------------
serve_catalog "$W/second"
start_s=$(date +%s)
upgraded() {
  both_succeeded 0.2.0 && ! k get csv -n "$NS" "$PACKAGE.v0.1.0" >/dev/null 2>&1 &&
    ! k get csv -n "$NS" "$API.v0.1.0" >/dev/null 2>&1
}
wait_for 300 "the upgrade to v0.2.0" upgraded
for package in "$PACKAGE" "$API"; do
  installed=$(k get subscriptions -n "$NS" -o jsonpath="{.items[?(@.spec.name==\"$package\")].status.installedCSV}")
  [[ $installed == "$package.v0.2.0" ]] || die "the Subscription to $package installed $installed"
done
log "2. upgraded by themselves: $PACKAGE.v0.2.0 and $API.v0.2.0 Succeeded, v0.1.0 gone, $(($(date +%s) - start_s))s after the catalog gained them"
k get installplans -n "$NS" -o custom-columns=PLAN:.metadata.name,CSV:.spec.clusterServiceVersionNames,APPROVED:.spec.approved >&2
start_s=$(date +%s)
wait_for 330 "the MyApp CRD converting through OLM's Service after the upgrade" olms_webhook
log "2. the MyApp CRD converts through OLM's Service again $(($(date +%s) - start_s))s after the upgrade"
sleep 10
kill "$(cat "$W/sampler.pid")"
rm -f "$W/sampler.pid"
# Windows in which the CRD did not convert through OLM's Service.
awk -v want="Webhook_$NS/$WEBHOOK_SERVICE" '
  $2 != want && !start { start = $1; what = $2 }
  $2 == want && start { n++; total += $1 - start; printf "olm-e2e: the CRD converted through %s for %.1fs\n", what, $1 - start; start = 0 }
  END {
    if (start) { print "olm-e2e: FAILED: the CRD still converts through " what; exit 1 }
    printf "olm-e2e: 2. the conversion was not OLM'"'"'s in %d window(s), %.1fs in all, over %d samples\n", n, total, NR
  }' "$W/conversion.log" >&2
olms_webhook || die "the MyApp CRD's conversion is $(conversion) at the end"

# --- 3. tenancy ---------------------------------------------------------------------
# The AllNamespaces operator of steps 1-2 goes (its CSV is copied into, and it
# watches, every namespace); flotilla-myapp-api stays, AllNamespaces in $NS. Then a
# Subscription to the operator in $TENANT, whose OperatorGroup targets team-a. OLM v0
# resolves a Subscription's dependencies in its own namespace only (CSVs there, copies
# excluded, and the catalogs), so the InstallPlan it makes there names
# flotilla-myapp-api too: its CSV step finds the copy of the AllNamespaces one and
# installs nothing, its CRD step writes the bundle's CRD over the cluster's (the
# conversion is deploy/'s until the olm operator writes its own again; measured here).
k delete subscription -n "$NS" "$PACKAGE" >/dev/null
k delete csv -n "$NS" "$PACKAGE.v0.2.0" >/dev/null
gone() { ! k get csv -n team-b "$PACKAGE.v0.2.0" >/dev/null 2>&1 && ! k get deployment -n "$NS" flotilla-agent >/dev/null 2>&1; }
wait_for 120 "the AllNamespaces operator uninstalled" gone
k apply -f - >/dev/null <<YAML
apiVersion: operators.coreos.com/v1
kind: OperatorGroup
metadata: {name: team-a, namespace: $TENANT}
spec: {targetNamespaces: [team-a]}
---
apiVersion: operators.coreos.com/v1alpha1
kind: Subscription
metadata: {name: $PACKAGE, namespace: $TENANT}
spec: {channel: stable, name: $PACKAGE, source: flotilla, sourceNamespace: olm, installPlanApproval: Automatic}
YAML
start_s=$(date +%s)
installed_here() { succeeded "$PACKAGE" 0.2.0 "$TENANT" && [[ $(k get csv -n "$TENANT" "$PACKAGE.v0.2.0" -o jsonpath='{.status.reason}') != Copied ]]; }
wait_for 180 "CSV $PACKAGE.v0.2.0 Succeeded in $TENANT" installed_here
log "3. $PACKAGE.v0.2.0 Succeeded in $TENANT (OperatorGroup targeting team-a) $(($(date +%s) - start_s))s after its Subscription"
installed_at=$(date +%s)
log "3. the InstallPlan OLM made in $TENANT: $(k get installplans -n "$TENANT" -o jsonpath='{range .items[*]}{.spec.clusterServiceVersionNames} {.status.phase}{end}')"
k get csv -A -o custom-columns=NAMESPACE:.metadata.namespace,CSV:.metadata.name,PHASE:.status.phase,REASON:.status.reason |
  grep -E "^(NAMESPACE|$NS|$TENANT|team-a|team-b) " >&2
targets=$(k get deployment -n "$TENANT" flotilla-agent -o jsonpath='{.spec.template.metadata.annotations.olm\.targetNamespaces}')
[[ $targets == team-a ]] || die "the Deployment's pod template says olm.targetNamespaces=$targets"
log "3. the Deployment's pod template: olm.targetNamespaces=$targets"
log "3. Roles OLM made: $(k get roles -A -l "olm.owner=$PACKAGE.v0.2.0" -o jsonpath='{range .items[*]}{.metadata.namespace}/{.metadata.name} {end}')"

# The operator's rights, as OLM granted them (Roles copied into each target namespace).
SA=flotilla-agent
rights() { # NAMESPACE
  k auth can-i --list -n "$1" --as="system:serviceaccount:$TENANT:$SA" |
    grep -E '^(myapps|configmaps|deployments|events|horizontalpodautoscalers|leases|pods)[ .]' || true
}
for ns in team-a team-b; do
  log "3. kubectl auth can-i --list -n $ns --as=system:serviceaccount:$TENANT:$SA (the operator's resources):"
  rights "$ns" | sed 's/^/    /' >&2
done
can() { k auth can-i "$1" "$2" -n "$3" --as="system:serviceaccount:$TENANT:$SA" >/dev/null 2>&1; }
for what in "list myapps.app.example.com" "patch myapps.app.example.com" "create configmaps" "create deployments.apps" "create events.events.k8s.io"; do
  read -r verb resource <<<"$what"
  can "$verb" "$resource" team-a || die "the operator may not $verb $resource in team-a"
  if can "$verb" "$resource" team-b; then die "the operator may $verb $resource in team-b"; fi
  if k auth can-i "$verb" "$resource" --all-namespaces --as="system:serviceaccount:$TENANT:$SA" >/dev/null 2>&1; then
    die "the operator may $verb $resource cluster-wide"
  fi
done
log "3. in team-a it may list and patch MyApps and create ConfigMaps, Deployments and Events; in team-b none of it, nor cluster-wide"

# The operator as OLM would run it: the Deployment's args and env, the downward API
# resolved here, a token of its ServiceAccount; its listeners moved to free loopback
# ports (the lab's own processes hold others).
token=$(k create token -n "$TENANT" "$SA" --duration=1h)
k config view --raw --minify --flatten -o json | python3 -c '
import json, sys
config = json.load(sys.stdin)
config["users"] = [{"name": "operator", "user": {"token": sys.argv[1]}}]
config["contexts"][0]["context"]["user"] = "operator"
json.dump(config, open(sys.argv[2], "w"))' "$token" "$W/operator.kubeconfig"
k get deployment -n "$TENANT" flotilla-agent -o json >"$W/operator-deployment.json"
python3 - "$W/operator-deployment.json" "$TENANT" >"$W/operator.env" <<'EOF'
import json, re, shlex, sys
deployment, namespace = json.load(open(sys.argv[1])), sys.argv[2]
template = deployment["spec"]["template"]
container = template["spec"]["containers"][0]
pod = {"metadata": {"name": "flotilla-agent-local", "namespace": namespace,
                    "annotations": template["metadata"].get("annotations", {})}}
def field(path):
    m = re.fullmatch(r"metadata\.annotations\['(.+)'\]", path)
    if m:
        return pod["metadata"]["annotations"].get(m.group(1), "")
    return pod["metadata"][path.split(".", 1)[1]]
for env in container.get("env", []):
    if "value" in env:
        value = env["value"]
    else:
        value = field(env["valueFrom"]["fieldRef"]["fieldPath"])
    print(f"export {env['name']}={shlex.quote(value)}")
ports = {"--http-addr": "127.0.0.1:18480", "--scaler-addr": "127.0.0.1:18490", "--webhook-addr": "127.0.0.1:18443"}
args = []
for arg in container["args"]:
    name = arg.split("=", 1)[0]
    args.append(f"{name}={ports[name]}" if name in ports else arg)
print("ARGS=(" + " ".join(shlex.quote(a) for a in args) + ")")
EOF
log "3. the operator's environment and arguments, from the Deployment OLM made:"
sed 's/^/    /' "$W/operator.env" >&2
# shellcheck disable=SC1091
(source "$W/operator.env" && exec "$AGENT" --kubeconfig "$W/operator.kubeconfig" "${ARGS[@]}") >"$W/operator.log" 2>&1 &
echo $! >"$W/operator.pid"
k apply -f - >/dev/null <<YAML
apiVersion: app.example.com/v1
kind: MyApp
metadata: {name: web, namespace: team-a}
spec: {replicas: 2, image: "nginx:1.27"}
---
apiVersion: app.example.com/v1
kind: MyApp
metadata: {name: web, namespace: team-b}
spec: {replicas: 2, image: "nginx:1.27"}
YAML
start_s=$(date +%s)
reconciled() { k get configmap -n team-a web-config >/dev/null 2>&1 && k get deployment -n team-a web-deploy >/dev/null 2>&1; }
wait_for 120 "the MyApp in team-a reconciled" reconciled
log "3. team-a/web: ConfigMap web-config and Deployment web-deploy in $(($(date +%s) - start_s))s"
has_status() { [[ -n $(k get myapp -n team-a web -o jsonpath='{.status.conditions}') ]]; }
wait_for 60 "team-a/web's status" has_status
log "3. team-a/web's status: $(k get myapp -n team-a web -o jsonpath='{range .status.conditions[*]}{.type}={.status}/{.reason} {end}')"
sleep 15
kill "$(cat "$W/operator.pid")" 2>/dev/null || true
rm -f "$W/operator.pid"
if k get configmap -n team-b web-config >/dev/null 2>&1; then die "team-b/web got a ConfigMap"; fi
if k get deployment -n team-b web-deploy >/dev/null 2>&1; then die "team-b/web got a Deployment"; fi
[[ -z $(k get myapp -n team-b web -o jsonpath='{.status}') ]] || die "team-b/web has a status: $(k get myapp -n team-b web -o jsonpath='{.status}')"
log "3. team-b/web, 15s later: no ConfigMap, no Deployment, no status"
lines=$(wc -l <"$W/operator.log")
if grep -nE '\b403\b|[Ff]orbidden' "$W/operator.log" >&2; then die "the operator was refused (above)"; fi
log "3. the operator's log: $lines lines, no 403 and no Forbidden"
log "3. the CRD converts through $(conversion) at the end of the operator's run"
# The tenant's InstallPlan wrote the bundle's CRD after flotilla-myapp-api's CSV had
# Succeeded: the olm operator writes its conversion again at its next look at that CSV
# (its wake-up, 5 min by default).
wait_for 330 "the MyApp CRD converting through OLM's Service after the tenant's install" olms_webhook
log "3. the MyApp CRD converts through OLM's Service again, $(($(date +%s) - installed_at))s after the tenant's install"
log "passed in $(($(date +%s) - all_start))s"
