#!/usr/bin/env bash
# The real-node mode of e2e/scripts/olm-e2e.sh (`olm-e2e.sh --real-nodes`, or
# OLM_E2E_NODES=real): OLM v0 installing, upgrading and scoping the MyApp operator from
# images in a registry, everything OLM runs a real Pod (issue 25). As root: it brings up
# the lab's real-node mode (`flotilla-e2e up --real-nodes`: kubelet + containerd).
#
#   e2e/scripts/olm-e2e.sh --real-nodes
#
# Needs, beside what olm-e2e.sh needs (OLM from e2e/scripts/olm.sh, the lab's real-node
# prerequisites: lab/scripts/real-node-prereqs.sh): Debian's `docker-registry`, `skopeo`
# and `busybox-static` (apt-get install -y docker-registry skopeo busybox-static), and
# grpc_health_probe (OLM's catalog Pods probe with it; built here from the Go module
# proxy, `github.com/grpc-ecosystem/grpc-health-probe`, cached in ~/.cache/flotilla/tools).
#
# What runs:
# - a lab of its own (host + 1 member, real nodes, in $OLM_E2E_DIR/lab);
# - Debian's docker-registry on 127.0.0.1:$OLM_E2E_REGISTRY_PORT (default 5000), storage
#   in $OLM_E2E_DIR/registry; a socat forward from the host's bridge address (the real
#   nodes' way to the machine) and a hosts.toml in the host node's containerd registry
#   directory (`config_path`, lab/src/provider/realnode) mapping 127.0.0.1:PORT to it
#   over plain HTTP: the images keep the names they were pushed under;
# - images written by the lab's OCI builder (`cargo run -p flotilla-lab --example
#   oci-image`) and pushed with skopeo: OLM's (olm, catalog, cpb, copy-content, and
#   busybox as /bin/cp, which OLM's unpack Job calls), opm's (opm, grpc_health_probe),
#   the four bundles of deploy/olm (generated with `flotilla-olm --registry`, so the CSVs
#   name the registry's flotilla-agent), the catalog (opm serve /configs), and, copied
#   from the lab's own archives, flotilla-agent (tags 0.1.0 and 0.2.0) and pause (the
#   MyApps' image);
# - OLM's olm and catalog operators as Deployments in `olm` (cluster-admin, as the chart
#   binds them), the catalog operator told to use those images for its unpack Jobs;
# - CoreDNS (the lab's cached binary, as an image) for the catalog operator, which dials
#   catalogs by their Service's name; the real nodes have no cluster DNS otherwise;
# - a CatalogSource of sourceType grpc with `image:` the catalog, polled every
#   $OLM_E2E_POLL (default 20s): the catalog gains a package or a version by a push of
#   the same tag, and OLM's catalog Pod is replaced when the image's digest changes.
# In the host, the real node's taint is removed and the KWOK nodes are tainted, so every
# Pod (OLM's, the catalog's, the unpack Jobs', the operator's, the webhook's, the
# MyApps') runs on the real node.
#
# The checks (the steps of olm-e2e.sh, on real Pods):
# 0. dependency refused: the catalog has flotilla-myapp-operator only: the Subscription
#    says ResolutionFailed, nothing installed;
# 1. dependency resolved: the catalog image is pushed again with flotilla-myapp-api; both
#    CSVs Succeeded, the bundles unpacked by Jobs from the bundle images, the operator
#    and the webhook Deployments Available; the CRD converts through OLM's Service, the
#    apiserver calls the webhook Pod: a v1alpha1 MyApp written and read back as
#    v1beta1 and v1; a MyApp reaches Ready (its pause Pods pulled from the registry);
# 2. automatic upgrade: the catalog image pushed with 0.2.0: both Subscriptions move
#    by themselves; the MyApp stays Ready and its Pods are the same; the CRD's
#    conversion sampled every half second (windows reported); the webhook answers again;
# 3. tenancy: the AllNamespaces operator uninstalled, then subscribed in
#    flotilla-tenant with an OperatorGroup targeting team-a: its Pod's rights are in
#    team-a only; team-a/web gets its ConfigMap, Deployment and Ready, team-b/web nothing;
#    no 403 in the operator Pod's log.
# Everything is taken down at the end: the lab (real nodes included), the registry, the
# forward.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
W="${OLM_E2E_DIR:-/tmp/flotilla-olm-e2e-real}"
BIN="${OLM_BIN_DIR:-$HOME/.cache/flotilla/olm/bin}"
OLM_SRC="${OLM_SRC:-$(ls -d "$HOME"/.cache/flotilla/olm/src/operator-lifecycle-manager-v* 2>/dev/null | sort -V | tail -1)}"
TOOLS="${XDG_CACHE_HOME:-$HOME/.cache}/flotilla/tools"
GHP_VERSION=v0.4.63
GHP="$TOOLS/grpc-health-probe-$GHP_VERSION/grpc-health-probe"
BUSYBOX="${BUSYBOX:-/bin/busybox}"
COREDNS="${COREDNS:-$(ls -d "$HOME"/.cache/flotilla/bin/coredns-v1.12.1/coredns 2>/dev/null)}"
DNS_IP=10.0.0.10 # in the lab's Service range (kube-apiserver's default, 10.0.0.0/24), static band
REG_PORT="${OLM_E2E_REGISTRY_PORT:-5000}"
REG="127.0.0.1:$REG_PORT"
IMG="$REG/flotilla"
POLL="${OLM_E2E_POLL:-20s}"
PACKAGE=flotilla-myapp-operator
API=flotilla-myapp-api
WEBHOOK_SERVICE=flotilla-myapp-webhook-service
NS=flotilla-olm
TENANT=flotilla-tenant
APPS=olm-apps
export FLOTILLA_E2E_DIR="$W/lab"
KC="$FLOTILLA_E2E_DIR/kubeconfigs/host.yaml"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
k() { kubectl --kubeconfig "$KC" "$@"; }
log() { echo "olm-e2e: $*" >&2; }
die() {
  log "FAILED: $*"
  exit 1
}

for b in opm olm catalog cpb copy-content; do
  [[ -x "$BIN/$b" ]] || die "no $BIN/$b: build it with e2e/scripts/olm.sh"
done
[[ -d "$OLM_SRC/deploy/chart/crds" ]] || die "no OLM checkout with deploy/chart/crds (OLM_SRC)"
for tool in docker-registry skopeo socat; do
  command -v "$tool" >/dev/null || die "needs $tool (apt-get install -y docker-registry skopeo socat)"
done
[[ -x $COREDNS ]] || die "no CoreDNS v1.12.1 binary (lab/scripts/kind-prereqs.sh builds it into ~/.cache/flotilla/bin/coredns-v1.12.1; or COREDNS)"
file -L "$BUSYBOX" 2>/dev/null | grep -q 'statically linked' || die "needs a static busybox at $BUSYBOX (apt-get install -y busybox-static)"
[[ $(id -u) == 0 ]] || die "real-node mode needs root"
if [[ ! -x $GHP ]]; then
  log "building grpc_health_probe $GHP_VERSION (Go module proxy)"
  GOBIN=$(dirname "$GHP") CGO_ENABLED=0 GOMAXPROCS=1 nice -n 10 go install -ldflags "-s -w" \
    "github.com/grpc-ecosystem/grpc-health-probe@$GHP_VERSION"
fi

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

wait_for() { # SECONDS WHAT COMMAND...: until COMMAND succeeds
  local seconds=$1 what=$2
  shift 2
  for _ in $(seq "$seconds"); do
    "$@" && return 0
    sleep 1
  done
  die "$what: not within ${seconds}s"
}

all_start=$(date +%s)

# --- the registry ---------------------------------------------------------------------
rm -rf "$W/registry"
mkdir -p "$W/registry"
cat >"$W/registry.yml" <<YAML
version: 0.1
log: {level: warn}
storage:
  filesystem: {rootdirectory: $W/registry}
  delete: {enabled: true}
http: {addr: "$REG"}
YAML
start registry docker-registry serve "$W/registry.yml"
registry_up() { curl -sf "http://$REG/v2/" >/dev/null; }
wait_for 20 "the registry on $REG" registry_up
log "registry on $REG (docker-registry $(dpkg-query -W -f '${Version}' docker-registry))"

# --- the images -------------------------------------------------------------------------
(cd "$ROOT" && nice -n 10 cargo build -q -p flotilla-lab --example oci-image)
OCI="$TARGET/debug/examples/oci-image"
push() { # ARCHIVE REF
  skopeo copy -q --dest-tls-verify=false "oci-archive:$1" "docker://$2" >/dev/null
}
image() { # REF ARGS...: written by the lab's OCI builder and pushed
  local ref=$1 archive
  shift
  archive="$W/images/$(echo "${ref#"$IMG/"}" | tr ':/' '__').tar"
  "$OCI" --name "$ref" --out "$archive" "$@" >/dev/null
  push "$archive" "$ref"
}
mkdir -p "$W/images"
rm -rf "$W/tree"
(cd "$ROOT" && cargo run -q -p flotilla-olm -- --out "$W/tree" --registry "$IMG") >/dev/null
real() { realpath "$1"; }
image "$IMG/olm:v0.46.0" --add "$(real "$BIN/olm"):/bin/olm" --add "$(real "$BIN/catalog"):/bin/catalog" \
  --add "$(real "$BIN/cpb"):/bin/cpb" --add "$(real "$BIN/copy-content"):/bin/copy-content" \
  --add "$BUSYBOX:/bin/cp" --env PATH=/bin --entrypoint /bin/olm
opm_files=(--add "$(real "$BIN/opm"):/bin/opm" --add "$GHP:/bin/grpc_health_probe" --env PATH=/bin)
image "$IMG/opm:v1.73.0" "${opm_files[@]}" --entrypoint /bin/opm
image "$IMG/coredns:v1.12.1" --add "$COREDNS:/coredns" --entrypoint /coredns
for package in "$API" "$PACKAGE"; do
  labels=()
  while read -r label; do labels+=(--label "$label"); done < <(sed -n 's/^LABEL //p' "$W/tree/bundles/$package/bundle.Dockerfile")
  for version in 0.1.0 0.2.0; do
    dir="$W/tree/bundles/$package/$version"
    image "$IMG/$package-bundle:v$version" --user "" "${labels[@]}" \
      --add "$dir/manifests:/manifests" --add "$dir/metadata:/metadata"
  done
done
# The catalog image: opm serving /configs, as deploy/olm/catalog.Dockerfile builds it.
# One tag, pushed again when the catalog gains something (what OLM polls).
catalog() { # DIR: the catalog image with DIR as /configs, pushed as flotilla-catalog:latest
  "$BIN/opm" validate "$1"
  # The serve cache, pre-populated as the Dockerfile's builder stage does (opm serve
  # with --cache-dir refuses to start without one that matches /configs), owned by the
  # image's user (opm opens it read-write: it creates a lock file in it).
  rm -rf "$1.cache"
  "$BIN/opm" serve "$1" --cache-dir="$1.cache" --cache-only 2>"$W/opm-cache.log"
  image "$IMG/flotilla-catalog:latest" "${opm_files[@]}" --add "$1:/configs" --add "$1.cache:/tmp/cache:65532:65532" \
    --label operators.operatorframework.io.index.configs.v1=/configs \
    --entrypoint /bin/opm --entrypoint serve --entrypoint /configs --entrypoint --cache-dir=/tmp/cache
  log "pushed $IMG/flotilla-catalog:latest with $(basename "$1"): $(skopeo inspect --tls-verify=false --format '{{.Digest}}' "docker://$IMG/flotilla-catalog:latest")"
}
# Three catalogs from the generated one (bundles by image: OLM unpacks them): `noapi`
# has the operator's 0.1.0 and not the API it requires, `first` both packages' 0.1.0,
# `second` all of them.
python3 - "$W" "$PACKAGE" "$API" <<'EOF'
import copy, os, shutil, sys, yaml
w, *packages = sys.argv[1:]
full = {p: [d for d in yaml.safe_load_all(open(f"{w}/tree/catalog/{p}/catalog.yaml")) if d] for p in packages}
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
catalog "$W/noapi"
log "images built and pushed in $(($(date +%s) - all_start))s: $(curl -s "http://$REG/v2/_catalog")"

# --- the lab, real nodes ---------------------------------------------------------------
lab_start=$(date +%s)
log "lab up (real nodes) in $FLOTILLA_E2E_DIR"
(cd "$ROOT" && cargo run -q -p flotilla-e2e -- up --real-nodes --members 1)
for a in flotilla-agent pause; do
  archive="$FLOTILLA_E2E_DIR/nodes/images/$a.tar"
  case $a in
    flotilla-agent) push "$archive" "$IMG/flotilla-agent:0.1.0" && push "$archive" "$IMG/flotilla-agent:0.2.0" ;;
    pause) push "$archive" "$IMG/pause:3.10" ;;
  esac
done
bridge_ip=$(python3 -c 'import json,sys; n=json.load(open(sys.argv[1])); print("10.213.{}.1".format(n["third"]))' "$FLOTILLA_E2E_DIR/nodes/network.json")
start registry-forward socat "TCP-LISTEN:$REG_PORT,bind=$bridge_ip,fork,reuseaddr" "TCP:$REG"
hosts="$FLOTILLA_E2E_DIR/nodes/host/certs.d/$REG"
mkdir -p "$hosts"
cat >"$hosts/hosts.toml" <<TOML
# Written by e2e/scripts/olm-e2e-real.sh: the loopback registry, as the node reaches it.
server = "http://$bridge_ip:$REG_PORT"
[host."http://$bridge_ip:$REG_PORT"]
  capabilities = ["pull", "resolve"]
TOML
# Every Pod of the host on its real node.
k taint nodes real-node flotilla.io/real-node- >/dev/null
k taint nodes -l type=kwok flotilla.io/olm-e2e=kwok:NoSchedule --overwrite >/dev/null
k delete crd myapps.app.example.com --ignore-not-found --wait=true >/dev/null
k apply --server-side -f "$OLM_SRC/deploy/chart/crds/" >/dev/null
for crd in catalogsources clusterserviceversions installplans operatorgroups subscriptions; do
  k wait --for condition=established --timeout=60s "crd/$crd.operators.coreos.com" >/dev/null
done
for ns in olm "$NS" "$TENANT" "$APPS" team-a team-b; do k create namespace "$ns" >/dev/null; done
log "lab with real nodes, the agent and pause images in the registry, OLM's CRDs: $(($(date +%s) - lab_start))s"

# --- cluster DNS ---------------------------------------------------------------------------
# The catalog operator dials a catalog at its Service's name (flotilla.olm.svc:50051).
# The lab's real nodes have no cluster DNS (the kubelet has no clusterDNS; Pods get the
# machine's resolv.conf), so CoreDNS runs here as a Pod (its kubernetes plugin, Service
# kube-dns at $DNS_IP) and the catalog operator's Pod names it in its dnsConfig, as the
# kubelet would with clusterDNS set.
dns_start=$(date +%s)
k apply -f - >/dev/null <<YAML
apiVersion: v1
kind: ServiceAccount
metadata: {name: coredns, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: olm-e2e-coredns}
rules:
- {apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: olm-e2e-coredns}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: olm-e2e-coredns}
subjects: [{kind: ServiceAccount, name: coredns, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: coredns, namespace: kube-system}
data:
  Corefile: |
    .:1053 {
        errors
        ready :8181
        kubernetes cluster.local in-addr.arpa ip6.arpa {
            pods insecure
            fallthrough in-addr.arpa ip6.arpa
        }
        cache 5
    }
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: coredns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  selector: {matchLabels: {k8s-app: kube-dns}}
  template:
    metadata: {labels: {k8s-app: kube-dns}}
    spec:
      serviceAccountName: coredns
      dnsPolicy: Default
      securityContext: {runAsNonRoot: true}
      volumes: [{name: config, configMap: {name: coredns}}]
      containers:
      - name: coredns
        image: $IMG/coredns:v1.12.1
        args: [-conf, /etc/coredns/Corefile]
        ports: [{containerPort: 1053, protocol: UDP, name: dns}, {containerPort: 1053, protocol: TCP, name: dns-tcp}]
        readinessProbe: {httpGet: {path: /ready, port: 8181}}
        volumeMounts: [{name: config, mountPath: /etc/coredns}]
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system}
spec:
  clusterIP: $DNS_IP
  selector: {k8s-app: kube-dns}
  ports:
  - {name: dns, port: 53, targetPort: 1053, protocol: UDP}
  - {name: dns-tcp, port: 53, targetPort: 1053, protocol: TCP}
YAML
k rollout status -n kube-system deployment/coredns --timeout=120s >/dev/null || die "coredns: $(k describe pods -n kube-system -l k8s-app=kube-dns | tail -20)"
log "CoreDNS Ready, Service kube-dns $DNS_IP, $(($(date +%s) - dns_start))s after its apply"

# --- OLM as Pods -------------------------------------------------------------------------
olm_start=$(date +%s)
k apply -f - >/dev/null <<YAML
apiVersion: v1
kind: ServiceAccount
metadata: {name: olm-operator-serviceaccount, namespace: olm}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: olm-operator-binding-olm}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: cluster-admin}
subjects: [{kind: ServiceAccount, name: olm-operator-serviceaccount, namespace: olm}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: olm-operator, namespace: olm, labels: {app: olm-operator}}
spec:
  strategy: {type: Recreate}
  selector: {matchLabels: {app: olm-operator}}
  template:
    metadata: {labels: {app: olm-operator}}
    spec:
      serviceAccountName: olm-operator-serviceaccount
      securityContext: {runAsNonRoot: true, seccompProfile: {type: RuntimeDefault}}
      volumes: [{name: tmpfs, emptyDir: {}}]
      containers:
      - name: olm-operator
        image: $IMG/olm:v0.46.0
        command: [/bin/olm]
        args: [--namespace, \$(OPERATOR_NAMESPACE), --writeStatusName, "", --writePackageServerStatusName, ""]
        env:
        - {name: OPERATOR_NAMESPACE, valueFrom: {fieldRef: {fieldPath: metadata.namespace}}}
        - {name: OPERATOR_NAME, value: olm-operator}
        ports: [{containerPort: 8080, name: metrics}]
        readinessProbe: {httpGet: {path: /healthz, port: 8080}}
        resources: {requests: {cpu: 10m, memory: 160Mi}}
        securityContext: {allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, capabilities: {drop: [ALL]}}
        volumeMounts: [{name: tmpfs, mountPath: /tmp}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: catalog-operator, namespace: olm, labels: {app: catalog-operator}}
spec:
  strategy: {type: Recreate}
  selector: {matchLabels: {app: catalog-operator}}
  template:
    metadata: {labels: {app: catalog-operator}}
    spec:
      serviceAccountName: olm-operator-serviceaccount
      dnsPolicy: None
      dnsConfig:
        nameservers: [$DNS_IP]
        searches: [olm.svc.cluster.local, svc.cluster.local, cluster.local]
        options: [{name: ndots, value: "5"}]
      securityContext: {runAsNonRoot: true, seccompProfile: {type: RuntimeDefault}}
      volumes: [{name: tmpfs, emptyDir: {}}]
      containers:
      - name: catalog-operator
        image: $IMG/olm:v0.46.0
        command: [/bin/catalog]
        args: [--namespace, olm, --configmapServerImage, $IMG/opm:v1.73.0, --opmImage, $IMG/opm:v1.73.0,
               --util-image, $IMG/olm:v0.46.0, --writeStatusName, ""]
        ports: [{containerPort: 8080, name: metrics}]
        readinessProbe: {httpGet: {path: /healthz, port: 8080}}
        resources: {requests: {cpu: 10m, memory: 80Mi}}
        securityContext: {allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, capabilities: {drop: [ALL]}}
        volumeMounts: [{name: tmpfs, mountPath: /tmp}]
YAML
k rollout status -n olm deployment/olm-operator --timeout=180s >/dev/null || die "olm-operator: $(k describe pods -n olm -l app=olm-operator | tail -20)"
k rollout status -n olm deployment/catalog-operator --timeout=180s >/dev/null || die "catalog-operator: $(k describe pods -n olm -l app=catalog-operator | tail -20)"
log "OLM's olm-operator and catalog-operator Pods Ready on $(k get pods -n olm -l app=olm-operator -o jsonpath='{.items[0].spec.nodeName}') $(($(date +%s) - olm_start))s after their apply"
k apply -f - >/dev/null <<YAML
apiVersion: operators.coreos.com/v1alpha1
kind: CatalogSource
metadata: {name: flotilla, namespace: olm}
spec:
  sourceType: grpc
  image: $IMG/flotilla-catalog:latest
  displayName: Flotilla (loopback registry)
  updateStrategy: {registryPoll: {interval: $POLL}}
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
start_s=$(date +%s)
catalog_ready() { [[ $(k get catalogsource -n olm flotilla -o jsonpath='{.status.connectionState.lastObservedState}') == READY ]]; }
wait_for 180 "the CatalogSource READY" catalog_ready
catalog_pod() { k get pods -n olm -l olm.catalogSource=flotilla -o jsonpath='{range .items[*]}{.metadata.name} {.status.containerStatuses[0].imageID} {.spec.nodeName}{"\n"}{end}'; }
log "the catalog Pod serves (READY $(($(date +%s) - start_s))s after the CatalogSource): $(catalog_pod)"

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
# The unpack Jobs live 5 minutes after they finish (their TTL): recorded as they come.
watch_jobs() {
  while true; do
    k get jobs -n olm -o jsonpath='{range .items[*]}{.metadata.name} {.status.succeeded} {.spec.template.spec.initContainers[1].image}{"\n"}{end}' 2>/dev/null || true
    k get pods -n olm -o jsonpath='{range .items[*]}{.metadata.name} {.spec.nodeName} {.status.phase} {.status.initContainerStatuses[1].imageID}{"\n"}{end}' 2>/dev/null | grep -v '^catalog-operator\|^olm-operator\|^flotilla-' | sed 's/^/pod /' || true
    sleep 2
  done
}
watch_jobs >"$W/jobs.log" 2>&1 &
echo $! >"$W/jobs.pid"
catalog "$W/first"
start_s=$(date +%s)
wait_for 300 "CSVs v0.1.0 of $PACKAGE and $API Succeeded" both_succeeded 0.1.0
log "1. resolved: $PACKAGE.v0.1.0 and $API.v0.1.0 Succeeded $(($(date +%s) - start_s))s after the push of the catalog with $API"
log "1. the catalog Pod now: $(catalog_pod)"
k get csv -n "$NS" -o custom-columns=CSV:.metadata.name,PHASE:.status.phase,REQUIRED:.spec.customresourcedefinitions.required[*].name,OWNED:.spec.customresourcedefinitions.owned[*].name >&2
k get subscriptions -n "$NS" -o custom-columns=SUBSCRIPTION:.metadata.name,PACKAGE:.spec.name,INSTALLED:.status.installedCSV >&2
[[ -n $(k get subscriptions -n "$NS" -o jsonpath="{.items[?(@.spec.name==\"$API\")].metadata.name}") ]] ||
  die "no Subscription to $API made by OLM"
log "1. unpack Jobs seen (name, succeeded, bundle image):"
awk '!/^pod / && NF >= 3 && !seen[$1]++' "$W/jobs.log" | sed 's/^/    /' >&2
[[ $(awk '!/^pod / && NF >= 3 && $3 ~ /-bundle:v0.1.0$/ { print $3 }' "$W/jobs.log" | sort -u | wc -l) -ge 2 ]] ||
  die "no unpack Job of both 0.1.0 bundle images was seen (see $W/jobs.log)"
unpack_pods() { # the unpack Pods' last state: name, node, phase, the bundle image's digest
  awk '/^pod / && NF >= 5 { last[$2] = $2 " on " $3 " " $4 " " $5 } END { for (p in last) print "    " last[p] }' "$W/jobs.log" | sort
}
log "1. their Pods (name, node, phase, the pulled bundle image):"
unpack_pods >&2
for d in flotilla-agent flotilla-myapp-webhook; do
  k rollout status -n "$NS" "deployment/$d" --timeout=180s >/dev/null || die "$d: $(k describe pods -n "$NS" | tail -30)"
done
log "1. Pods in $NS: $(k get pods -n "$NS" -o jsonpath='{range .items[*]}{.metadata.name} on {.spec.nodeName} {.status.containerStatuses[0].image} ({.status.containerStatuses[0].imageID}) ready={.status.containerStatuses[0].ready}; {end}')"
conversion() {
  k get crd myapps.app.example.com -o jsonpath='{.spec.conversion.strategy} {.spec.conversion.webhook.clientConfig.service.namespace}/{.spec.conversion.webhook.clientConfig.service.name}'
}
olms_webhook() {
  [[ $(conversion) == "Webhook $NS/$WEBHOOK_SERVICE" ]] &&
    [[ -n $(k get crd myapps.app.example.com -o jsonpath='{.spec.conversion.webhook.clientConfig.caBundle}') ]]
}
sample() {
  while true; do
    echo "$(date +%s.%N) $(conversion 2>/dev/null | tr ' ' _ || true)"
    sleep 0.5
  done
}
sample >"$W/conversion.log" &
echo $! >"$W/sampler.pid"
start_s=$(date +%s)
wait_for 330 "the MyApp CRD converting through OLM's Service" olms_webhook
log "1. the MyApp CRD converts through Webhook $NS/$WEBHOOK_SERVICE, with OLM's CA bundle ($(($(date +%s) - start_s))s after both CSVs Succeeded)"

# The apiserver converting through the webhook Pod: a MyApp written as v1alpha1 (size)
# is stored as v1 (replicas) and read back at each version.
converts() {
  converts_once && return 0
  sed 's/^/  /' "$W/convert.err" >>"$W/convert-refusals.log"
  return 1
}
converts_once() {
  k apply -f - >/dev/null 2>"$W/convert.err" <<YAML || return 1
apiVersion: app.example.com/v1alpha1
kind: MyApp
metadata: {name: web, namespace: $APPS}
spec: {size: 2, image: "$IMG/pause:3.10"}
YAML
  [[ $(k get myapps.v1.app.example.com -n "$APPS" web -o jsonpath='{.spec.replicas}' 2>>"$W/convert.err") == 2 ]] &&
    [[ $(k get myapps.v1beta1.app.example.com -n "$APPS" web -o jsonpath='{.apiVersion}' 2>>"$W/convert.err") == app.example.com/v1beta1 ]] &&
    [[ $(k get myapps.v1alpha1.app.example.com -n "$APPS" web -o jsonpath='{.spec.size}' 2>>"$W/convert.err") == 2 ]]
}
# OLM v0's catalog operator may write the bundle's CRD (deploy/'s Service, no CA) after
# the olm operator wrote its own: then the apiserver cannot convert until the olm
# operator's next wake-up (5 min by default; deploy/olm/README.md). Up to 330 s.
start_s=$(date +%s)
wait_for 330 "the apiserver converting MyApps through the webhook Pod (see $W/convert.err)" converts
log "1. the apiserver converts through the webhook Pod: $APPS/web written as v1alpha1 size 2, read as v1 replicas 2, as v1beta1 and as v1alpha1 size 2 ($(($(date +%s) - start_s))s; $(cat "$W/convert-refusals.log" 2>/dev/null | grep -c . || true) error lines before, the last: $(tail -1 "$W/convert-refusals.log" 2>/dev/null))"
my_ready() { # NAMESPACE NAME
  [[ $(k get myapp -n "$1" "$2" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]]
}
start_s=$(date +%s)
wait_for 180 "MyApp $APPS/web Ready" my_ready "$APPS" web
log "1. MyApp $APPS/web Ready=True $(($(date +%s) - start_s))s after its apply; its Pods: $(k get pods -n "$APPS" -o jsonpath='{range .items[*]}{.metadata.name} on {.spec.nodeName} {.status.phase} {.status.containerStatuses[0].imageID}; {end}')"
pods_before=$(k get pods -n "$APPS" -o jsonpath='{range .items[*]}{.metadata.uid} {end}')

# --- 2. the automatic upgrade -------------------------------------------------------
catalog "$W/second"
start_s=$(date +%s)
upgraded() {
  both_succeeded 0.2.0 && ! k get csv -n "$NS" "$PACKAGE.v0.1.0" >/dev/null 2>&1 &&
    ! k get csv -n "$NS" "$API.v0.1.0" >/dev/null 2>&1
}
ready_during=0 notready_during=0
upgraded_sampling() {
  if my_ready "$APPS" web; then ready_during=$((ready_during + 1)); else notready_during=$((notready_during + 1)); fi
  upgraded
}
wait_for 300 "the upgrade to v0.2.0" upgraded_sampling
for package in "$PACKAGE" "$API"; do
  installed=$(k get subscriptions -n "$NS" -o jsonpath="{.items[?(@.spec.name==\"$package\")].status.installedCSV}")
  [[ $installed == "$package.v0.2.0" ]] || die "the Subscription to $package installed $installed"
done
log "2. upgraded by themselves: $PACKAGE.v0.2.0 and $API.v0.2.0 Succeeded, v0.1.0 gone, $(($(date +%s) - start_s))s after the push of the catalog with 0.2.0"
log "2. the catalog Pod now: $(catalog_pod)"
k get installplans -n "$NS" -o custom-columns=PLAN:.metadata.name,CSV:.spec.clusterServiceVersionNames,APPROVED:.spec.approved >&2
log "2. unpack Jobs seen of the 0.2.0 bundles: $(awk '!/^pod / && NF >= 3 && $3 ~ /-bundle:v0.2.0$/ && !seen[$1]++ { printf "%s (%s) ", $1, $3 }' "$W/jobs.log")"
[[ $(awk '!/^pod / && NF >= 3 && $3 ~ /-bundle:v0.2.0$/ { print $3 }' "$W/jobs.log" | sort -u | wc -l) -ge 2 ]] ||
  die "no unpack Job of both 0.2.0 bundle images was seen (see $W/jobs.log)"
log "2. all unpack Pods so far:"
unpack_pods >&2
for d in flotilla-agent flotilla-myapp-webhook; do
  k rollout status -n "$NS" "deployment/$d" --timeout=180s >/dev/null || die "$d after the upgrade"
  image=$(k get deployment -n "$NS" "$d" -o jsonpath='{.spec.template.spec.containers[0].image}')
  [[ $image == "$IMG/flotilla-agent:0.2.0" ]] || die "$d runs $image"
done
log "2. both Deployments roll out $IMG/flotilla-agent:0.2.0"
start_s=$(date +%s)
wait_for 330 "the MyApp CRD converting through OLM's Service after the upgrade" olms_webhook
log "2. the MyApp CRD converts through OLM's Service again $(($(date +%s) - start_s))s after the upgrade"
sleep 10
kill "$(cat "$W/sampler.pid")"
rm -f "$W/sampler.pid"
awk -v want="Webhook_$NS/$WEBHOOK_SERVICE" '
  $2 != want && !start { start = $1; what = $2 }
  $2 == want && start { n++; total += $1 - start; printf "olm-e2e: the CRD converted through %s for %.1fs\n", what, $1 - start; start = 0 }
  END {
    if (start) { print "olm-e2e: FAILED: the CRD still converts through " what; exit 1 }
    printf "olm-e2e: 2. the conversion was not OLM'"'"'s in %d window(s), %.1fs in all, over %d samples\n", n, total, NR
  }' "$W/conversion.log" >&2
olms_webhook || die "the MyApp CRD's conversion is $(conversion) at the end"
start_s=$(date +%s)
rm -f "$W/convert-refusals.log"
wait_for 330 "the apiserver converting MyApps through the 0.2.0 webhook Pod (see $W/convert.err)" converts
log "2. the apiserver converts through the 0.2.0 webhook Pod (v1alpha1 written, read at v1, v1beta1, v1alpha1; $(($(date +%s) - start_s))s, $(cat "$W/convert-refusals.log" 2>/dev/null | grep -c . || true) error lines before)"
my_ready "$APPS" web || die "$APPS/web is not Ready after the upgrade"
pods_after=$(k get pods -n "$APPS" -o jsonpath='{range .items[*]}{.metadata.uid} {end}')
[[ $pods_after == "$pods_before" ]] || die "$APPS/web's Pods changed: $pods_before -> $pods_after"
log "2. $APPS/web Ready in $ready_during of $((ready_during + notready_during)) samples during the upgrade, Ready after it, the same Pods ($pods_after)"

# --- 3. tenancy ---------------------------------------------------------------------
k delete myapp -n "$APPS" web >/dev/null
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
wait_for 300 "CSV $PACKAGE.v0.2.0 Succeeded in $TENANT" installed_here
k rollout status -n "$TENANT" deployment/flotilla-agent --timeout=180s >/dev/null || die "the tenant's operator: $(k describe pods -n "$TENANT" | tail -30)"
log "3. $PACKAGE.v0.2.0 Succeeded in $TENANT (OperatorGroup targeting team-a) and its Pod Ready $(($(date +%s) - start_s))s after its Subscription: $(k get pods -n "$TENANT" -o jsonpath='{range .items[*]}{.metadata.name} on {.spec.nodeName}; {end}')"
installed_at=$(date +%s)
log "3. the InstallPlan OLM made in $TENANT: $(k get installplans -n "$TENANT" -o jsonpath='{range .items[*]}{.spec.clusterServiceVersionNames} {.status.phase}{end}')"
targets=$(k get deployment -n "$TENANT" flotilla-agent -o jsonpath='{.spec.template.metadata.annotations.olm\.targetNamespaces}')
[[ $targets == team-a ]] || die "the Deployment's pod template says olm.targetNamespaces=$targets"
log "3. the Deployment's pod template: olm.targetNamespaces=$targets (the Pod's FLOTILLA_OPERATOR_NAMESPACES, by the downward API)"
SA=flotilla-agent
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
k apply -f - >/dev/null <<YAML
apiVersion: app.example.com/v1
kind: MyApp
metadata: {name: web, namespace: team-a}
spec: {replicas: 2, image: "$IMG/pause:3.10"}
---
apiVersion: app.example.com/v1
kind: MyApp
metadata: {name: web, namespace: team-b}
spec: {replicas: 2, image: "$IMG/pause:3.10"}
YAML
start_s=$(date +%s)
wait_for 180 "MyApp team-a/web Ready" my_ready team-a web
log "3. team-a/web Ready=True $(($(date +%s) - start_s))s after its apply: $(k get configmap,deployment -n team-a -o name | tr '\n' ' ')$(k get pods -n team-a -o jsonpath='{range .items[*]}{.metadata.name} {.status.phase}; {end}')"
sleep 15
if k get configmap -n team-b web-config >/dev/null 2>&1; then die "team-b/web got a ConfigMap"; fi
if k get deployment -n team-b web-deploy >/dev/null 2>&1; then die "team-b/web got a Deployment"; fi
[[ -z $(k get myapp -n team-b web -o jsonpath='{.status}') ]] || die "team-b/web has a status: $(k get myapp -n team-b web -o jsonpath='{.status}')"
log "3. team-b/web, 15s later: no ConfigMap, no Deployment, no status"
k logs -n "$TENANT" deploy/flotilla-agent >"$W/operator.log" 2>&1
if grep -nE '\b403\b|[Ff]orbidden' "$W/operator.log" >&2; then die "the operator was refused (above)"; fi
log "3. the operator Pod's log: $(wc -l <"$W/operator.log") lines, no 403 and no Forbidden"
log "3. the CRD converts through $(conversion) now"
wait_for 330 "the MyApp CRD converting through OLM's Service after the tenant's install" olms_webhook
log "3. the MyApp CRD converts through OLM's Service again, $(($(date +%s) - installed_at))s after the tenant's install"
kill "$(cat "$W/jobs.pid")" 2>/dev/null || true
rm -f "$W/jobs.pid"
log "registry: $(curl -s "http://$REG/v2/_catalog")"
log "passed in $(($(date +%s) - all_start))s"
