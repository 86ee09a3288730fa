#!/usr/bin/env bash
# The real Argo CD syncing Flotilla's deploy/overlays/production (issue 25,
# item 5), against the RUNNING e2e lab. Never part of the default test run.
#
#   e2e/scripts/argocd-e2e.sh            # up, prove, down
#   e2e/scripts/argocd-e2e.sh up         # start everything, apply the Applications
#   e2e/scripts/argocd-e2e.sh prove      # the checks (needs `up`)
#   e2e/scripts/argocd-e2e.sh down       # stop what `up` started, delete what it created
#
# What runs (all on 127.0.0.1, ports from ARGOCD_E2E_PORT_BASE, default 7430):
# - Argo CD's application-controller and repo-server as local processes (the
#   binary from e2e/scripts/argocd.sh), a Redis, and `git daemon` serving a
#   copy of this repository's deploy/ tree (repository root = deploy/, so the
#   Application's path is the article's `overlays/production`).
# - Argo CD's control plane lives in the lab's HOST cluster: its CRDs, the
#   namespace `argocd`, its ConfigMaps/Secret, the AppProject `default`, cluster
#   Secrets and the Applications.
# - overlays/production is synced to a THROWAWAY kwok cluster started here
#   (flotilla-argocd-dest), not to the host: the overlay carries the MyApp CRD
#   with a conversion webhook to the in-cluster agent Service and the
#   flotilla-system Namespace, both already owned by the lab in the host;
#   applying them there would break the lab's MyApp API (KWOK runs no agent
#   pod to answer the webhook).
# - Optional (ARGOCD_E2E_FEDERATED=1, default): a second Application syncs a
#   FederatedMyApp (placed on cluster1) into the host, where the running hub
#   writes its status: Argo CD must stay Synced while the hub writes.
#
# PROVE_MINUTES (default 3): how long to sample the Applications every 10 s.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
LAB="${FLOTILLA_E2E_STATE:-$ROOT/e2e-state}"
W="${ARGOCD_E2E_DIR:-/tmp/flotilla-argocd-e2e}"
P="${ARGOCD_E2E_PORT_BASE:-7430}"
FED="${ARGOCD_E2E_FEDERATED:-1}"
PROVE_MINUTES="${PROVE_MINUTES:-3}"
HOST_KC="$LAB/kubeconfigs/host.yaml"
C1_KC="$LAB/kubeconfigs/cluster1.yaml"
DEST_KC="$W/dest.kubeconfig"
K8S_BIN="${FLOTILLA_K8S_BIN:-$(ls -d "$HOME"/.cache/flotilla/bin/k8s-v*-kwok-v* 2>/dev/null | sort -V | tail -1)}"
PROM_CRDS="${PROM_CRDS:-$(ls -d "$HOME"/.cache/flotilla/tools/prometheus-operator-crds-v* 2>/dev/null | sort -V | tail -1)}"
FED_NS=flotilla-argocd-e2e
APP=my-operator-app
FED_APP=flotilla-argocd-e2e-federated
REPO_URL="git://127.0.0.1:$((P + 11))/flotilla-deploy.git"
OWNER_LABEL=app.kubernetes.io/managed-by=flotilla-argocd-e2e

log() { echo "argocd-e2e: $(date -u +%H:%M:%S) $*"; }
die() { log "FAIL: $*"; exit 1; }
hk() { kubectl --kubeconfig "$HOST_KC" "$@"; }
dk() { kubectl --kubeconfig "$DEST_KC" "$@"; }

binaries() {
  local out
  out=$("$ROOT/e2e/scripts/argocd.sh" | tail -1)
  BIN=$(sed -n 's/^argocd.sh: Argo CD .* in \(.*\)$/\1/p' <<<"$out")
  [[ -x "$BIN/argocd" ]] || die "no Argo CD binary ($out)"
  SRC="$(dirname "$BIN")/src"
  export PATH="$BIN:$PATH"
  command -v kustomize >/dev/null || die "no kustomize on PATH"
}

# start NAME CMD...: run in the background, pid in $W/pids/NAME, log in $W/logs/NAME.log
start() {
  local name=$1; shift
  if [[ -f "$W/pids/$name" ]] && kill -0 "$(cat "$W/pids/$name")" 2>/dev/null; then return; fi
  nohup "$@" >"$W/logs/$name.log" 2>&1 &
  echo $! >"$W/pids/$name"
}

wait_port() {
  for _ in $(seq 1 120); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.5
  done
  die "nothing listens on 127.0.0.1:$1"
}

cluster_secret() { # NAME KUBECONFIG
  python3 - "$1" "$2" <<'EOF'
import json, subprocess, sys, base64
name, kc = sys.argv[1], sys.argv[2]
c = json.loads(subprocess.check_output(
    ["kubectl", "--kubeconfig", kc, "config", "view", "--raw", "--flatten", "--minify", "-o", "json"]))
cl, u = c["clusters"][0]["cluster"], c["users"][0]["user"]
config = {"tlsClientConfig": {"caData": cl["certificate-authority-data"],
                              "certData": u["client-certificate-data"],
                              "keyData": u["client-key-data"]}}
print(json.dumps({
    "apiVersion": "v1", "kind": "Secret",
    "metadata": {"name": "cluster-" + name, "namespace": "argocd",
                 "labels": {"argocd.argoproj.io/secret-type": "cluster",
                            "app.kubernetes.io/managed-by": "flotilla-argocd-e2e"}},
    "stringData": {"name": name, "server": cl["server"], "config": json.dumps(config)}}))
EOF
}

up() {
  [[ -f "$HOST_KC" ]] || die "no running lab ($HOST_KC)"
  hk get --raw /readyz >/dev/null || die "the lab's host cluster does not answer"
  [[ -x "$K8S_BIN/kwokctl" ]] || die "no cached kwok binaries under ~/.cache/flotilla/bin"
  [[ -d "$PROM_CRDS" ]] || die "no Prometheus Operator CRDs under ~/.cache/flotilla/tools"
  command -v redis-server >/dev/null || die "no redis-server (apt-get install -y redis-server)"
  mkdir -p "$W/pids" "$W/logs" "$W/git" "$W/redis"
  binaries
  log "Argo CD $("$BIN/argocd" version --client --short 2>/dev/null | head -1) from $BIN"

  # 1. The destination: a throwaway kwok cluster, one fake node.
  if ! KUBECONFIG="$DEST_KC" kubectl get --raw /readyz >/dev/null 2>&1; then
    cat >"$W/dest.kwokctl.yaml" <<EOF
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokctlConfiguration
options:
  runtime: binary
  kubeBinaryPrefix: $K8S_BIN
  kubectlBinary: $K8S_BIN/kubectl
  etcdBinary: $K8S_BIN/etcd
  kwokControllerBinary: $K8S_BIN/kwok
  bindAddress: 127.0.0.1
  kubeApiserverPort: $((P + 1))
  etcdPort: $((P + 2))
  etcdPeerPort: $((P + 3))
  kwokControllerPort: $((P + 4))
  kubeControllerManagerPort: $((P + 5))
  kubeSchedulerPort: $((P + 6))
EOF
    KWOK_WORKDIR="$W/kwok" "$K8S_BIN/kwokctl" create cluster --name flotilla-argocd-dest \
      -c "$W/dest.kwokctl.yaml" --kubeconfig "$DEST_KC" >"$W/logs/kwokctl.log" 2>&1 ||
      die "kwokctl create cluster (see $W/logs/kwokctl.log)"
  fi
  dk apply -f - >/dev/null <<'EOF'
apiVersion: v1
kind: Node
metadata:
  name: kwok-node-0
  annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}
  labels: {kubernetes.io/hostname: kwok-node-0, kubernetes.io/os: linux, kubernetes.io/arch: amd64, type: kwok}
EOF
  # The overlay's monitoring component renders a ServiceMonitor and a PrometheusRule.
  dk apply --server-side -f "$PROM_CRDS/monitoring.coreos.com_servicemonitors.yaml" \
    -f "$PROM_CRDS/monitoring.coreos.com_prometheusrules.yaml" >/dev/null
  log "destination cluster up: $(dk config view --minify -o jsonpath='{.clusters[0].cluster.server}')"

  # 2. Redis and the git repository (a copy of deploy/, one commit).
  start redis redis-server --bind 127.0.0.1 --port $((P + 10)) --save "" --appendonly no --dir "$W/redis"
  if [[ ! -d "$W/git/flotilla-deploy.git" ]]; then
    git init -q --bare -b main "$W/git/flotilla-deploy.git"
    rm -rf "$W/git/work"; git init -q -b main "$W/git/work"
    cp -r "$ROOT/deploy/." "$W/git/work/"
    if [[ "$FED" == 1 ]]; then
      mkdir -p "$W/git/work/argocd-e2e/federated"
      cat >"$W/git/work/argocd-e2e/federated/federatedmyapp.yaml" <<EOF
apiVersion: core.kubefed.io/v1beta1
kind: FederatedMyApp
metadata:
  name: argocd-e2e-web
  namespace: $FED_NS
spec:
  placement:
    clusters:
    - name: cluster1
  template:
    spec:
      replicas: 1
      image: nginx:1.27
EOF
      # Placed on no registered cluster: the hub reports it Stalled, Argo CD Degraded.
      cat >"$W/git/work/argocd-e2e/federated/stalled.yaml" <<EOF
apiVersion: core.kubefed.io/v1beta1
kind: FederatedMyApp
metadata:
  name: argocd-e2e-stalled
  namespace: $FED_NS
spec:
  placement:
    clusters:
    - name: no-such-cluster
  template:
    spec:
      replicas: 1
      image: nginx:1.27
EOF
    fi
    git -C "$W/git/work" add -A
    git -C "$W/git/work" -c user.name=flotilla-e2e -c user.email=e2e@flotilla.invalid \
      commit -qm "deploy/ from flotilla $(git -C "$ROOT" rev-parse --short HEAD)"
    git -C "$W/git/work" push -q "$W/git/flotilla-deploy.git" main
  fi
  start git-daemon git daemon --export-all --base-path="$W/git" --listen=127.0.0.1 \
    --port=$((P + 11)) --reuseaddr "$W/git"
  wait_port $((P + 10)); wait_port $((P + 11))
  git ls-remote "$REPO_URL" >/dev/null || die "git daemon does not serve $REPO_URL"

  # 3. Argo CD's control plane objects in the host.
  hk apply --server-side -f "$SRC/manifests/crds/application-crd.yaml" \
    -f "$SRC/manifests/crds/appproject-crd.yaml" >/dev/null
  # (kubectl wait fails outright while a new CRD has no status.conditions yet)
  for i in $(seq 1 30); do
    hk wait --for condition=established --timeout=30s crd/applications.argoproj.io \
      crd/appprojects.argoproj.io >/dev/null 2>&1 && break
    ((i < 30)) || die "Argo CD's CRDs not established"
    sleep 1
  done
  hk get ns argocd >/dev/null 2>&1 || { hk create ns argocd >/dev/null; hk label ns argocd $OWNER_LABEL >/dev/null; }
  hk apply -n argocd -k "$SRC/manifests/base/config" >/dev/null
  # Out of cluster there is no in-cluster config: the destinations are cluster Secrets.
  # Poll git every 30 s (no webhook here).
  hk -n argocd patch cm argocd-cm --type merge \
    -p '{"data":{"cluster.inClusterEnabled":"false","timeout.reconciliation":"30s"}}' >/dev/null
  # Flotilla's health check for FederatedMyApps, as README tells users to merge it.
  hk -n argocd patch cm argocd-cm --type merge --patch-file "$ROOT/deploy/argocd/argocd-cm-health.yaml" >/dev/null
  hk apply -f - >/dev/null <<'EOF'
apiVersion: argoproj.io/v1alpha1
kind: AppProject
metadata: {name: default, namespace: argocd}
spec:
  sourceRepos: ['*']
  destinations: [{server: '*', namespace: '*'}]
  clusterResourceWhitelist: [{group: '*', kind: '*'}]
EOF
  cluster_secret flotilla-argocd-dest "$DEST_KC" | hk apply -f - >/dev/null
  cluster_secret flotilla-host "$HOST_KC" | hk apply -f - >/dev/null

  # 4. Argo CD itself.
  # timeout.reconciliation reaches both as ARGOCD_RECONCILIATION_TIMEOUT in an install.
  start repo-server env ARGOCD_GPG_ENABLED=false ARGOCD_RECONCILIATION_TIMEOUT=30s HOME="$W" PATH="$PATH" \
    "$BIN/argocd-repo-server" --address 127.0.0.1 --port $((P + 12)) \
    --metrics-address 127.0.0.1 --metrics-port $((P + 13)) \
    --redis 127.0.0.1:$((P + 10)) --logformat text \
    --disable-tls --client-ca-path= # v3.6.2 refuses --disable-tls beside its default client-ca-path
  wait_port $((P + 12))
  start application-controller env ARGOCD_RECONCILIATION_TIMEOUT=30s HOME="$W" "$BIN/argocd-application-controller" \
    --kubeconfig "$HOST_KC" --namespace argocd \
    --repo-server 127.0.0.1:$((P + 12)) --repo-server-plaintext \
    --redis 127.0.0.1:$((P + 10)) --metrics-port $((P + 14)) \
    --persist-resource-health --logformat text # each resource's health in the Application, read below
  wait_port $((P + 14))
  log "repo-server :$((P + 12)), application-controller (metrics :$((P + 14))), redis :$((P + 10)), git $REPO_URL"

  # 5. The article's Application (../shared/fixtures/seed/argocd-application.yaml),
  # repoURL and destination server changed for this lab.
  hk apply -f - >/dev/null <<EOF
apiVersion: argoproj.io/v1alpha1
kind: Application
metadata:
  name: $APP
  namespace: argocd
  labels: {app.kubernetes.io/managed-by: flotilla-argocd-e2e}
spec:
  project: default
  destination:
    namespace: production
    server: $(dk config view --minify -o jsonpath='{.clusters[0].cluster.server}')
  source:
    repoURL: $REPO_URL
    path: overlays/production
    targetRevision: HEAD
  syncPolicy:
    automated:
      prune: true
      selfHeal: true
EOF
  if [[ "$FED" == 1 ]]; then
    # The hub's member cluster1 gets the namespace the MyApp lands in.
    kubectl --kubeconfig "$C1_KC" get ns $FED_NS >/dev/null 2>&1 ||
      { kubectl --kubeconfig "$C1_KC" create ns $FED_NS >/dev/null; kubectl --kubeconfig "$C1_KC" label ns $FED_NS $OWNER_LABEL >/dev/null; }
    hk apply -f - >/dev/null <<EOF
apiVersion: argoproj.io/v1alpha1
kind: Application
metadata:
  name: $FED_APP
  namespace: argocd
  labels: {app.kubernetes.io/managed-by: flotilla-argocd-e2e}
spec:
  project: default
  destination:
    namespace: $FED_NS
    server: $(hk config view --minify -o jsonpath='{.clusters[0].cluster.server}')
  source:
    repoURL: $REPO_URL
    path: argocd-e2e/federated
    targetRevision: HEAD
  syncPolicy:
    automated:
      prune: true
      selfHeal: true
    syncOptions: [CreateNamespace=true]
EOF
  fi
  log "Applications applied"
}

app_line() { # NAME -> "sync health revision opPhase historyLen"
  hk -n argocd get application "$1" -o \
    jsonpath='{.status.sync.status} {.status.health.status} {.status.sync.revision} {.status.operationState.phase} {.status.operationState.startedAt}{" history="}{.status.history[*].id}' 2>/dev/null || true
}

wait_synced() { # NAME TIMEOUT_S [REVISION]
  local line
  for _ in $(seq 1 $(($2 / 5))); do
    line=$(app_line "$1")
    if [[ "$line" == "Synced "* && ( -z "${3:-}" || "$line" == *" $3 "* ) ]]; then
      log "$1: $line"; return 0
    fi
    sleep 5
  done
  log "$1: $line"
  hk -n argocd get application "$1" -o jsonpath='{.status.conditions}{"\n"}{.status.operationState.message}{"\n"}' || true
  die "$1 not Synced${3:+ at $3} within $2 s"
}

wait_limit() { # LIMIT WHAT: wait up to 120 s for the agent's memory limit to be LIMIT, or die "WHAT"
  local lim
  for _ in $(seq 1 60); do
    lim=$(dk -n flotilla-system get deploy flotilla-agent -o jsonpath='{.spec.template.spec.containers[0].resources.limits.memory}')
    [[ "$lim" == "$1" ]] && return 0
    sleep 2
  done
  die "$2 (limit $lim)"
}

prove() {
  binaries >/dev/null
  local rev rev2
  rev=$(git -C "$W/git/work" rev-parse HEAD)
  wait_synced $APP 300 "$rev"
  log "$APP resources, all Synced: $(hk -n argocd get application $APP -o jsonpath='{range .status.resources[*]}{.kind}/{.name}={.status} {end}')"
  dk -n flotilla-system get deploy,sa,svc,servicemonitor,prometheusrule -o name | sed 's/^/  dest: /'
  dk get crd myapps.app.example.com -o jsonpath='  dest: crd/myapps.app.example.com conversion={.spec.conversion.strategy}{"\n"}'
  log "$APP health: $(hk -n argocd get application $APP -o jsonpath='{.status.health.status}') (KWOK marks the agent Pod Running without running it: health is not asserted, Synced is)"

  # A commit to the repository reaches the cluster.
  sed -i 's/memory: 256Mi/memory: 320Mi/' "$W/git/work/overlays/production/resources.yaml"
  [[ "$FED" == 1 ]] && sed -i 's/replicas: 1$/replicas: 2/' "$W/git/work/argocd-e2e/federated/federatedmyapp.yaml"
  git -C "$W/git/work" -c user.name=flotilla-e2e -c user.email=e2e@flotilla.invalid \
    commit -qam "production: agent memory limit 320Mi; FederatedMyApp 2 replicas"
  git -C "$W/git/work" push -q "$W/git/flotilla-deploy.git" main
  rev2=$(git -C "$W/git/work" rev-parse HEAD)
  log "pushed $rev2 (memory limit 256Mi -> 320Mi)"
  local t0=$SECONDS
  wait_synced $APP 300 "$rev2"
  wait_limit 320Mi "the commit did not reach the cluster"
  log "commit reached the destination in $((SECONDS - t0)) s: flotilla-agent memory limit 320Mi"

  if [[ "$FED" == 1 ]]; then
    wait_synced $FED_APP 300 "$rev2"
    for _ in $(seq 1 30); do
      hk -n $FED_NS get federatedmyapp argocd-e2e-web -o jsonpath='{.status}' 2>/dev/null | grep -q . && break
      sleep 2
    done
    for _ in $(seq 1 30); do
      [[ "$(hk -n $FED_NS get federatedmyapp argocd-e2e-web -o jsonpath='{.status.clusters[0].replicas}')" == 2 ]] && break
      sleep 2
    done
    log "FederatedMyApp status (written by the hub): $(hk -n $FED_NS get federatedmyapp argocd-e2e-web -o jsonpath='{.status}' | cut -c1-400)"
    log "cluster1 MyApp: $(kubectl --kubeconfig "$C1_KC" -n $FED_NS get myapps -o jsonpath='{range .items[*]}{.metadata.name} replicas={.spec.replicas} image={.spec.image}{end}')"
    # deploy/argocd/argocd-cm-health.yaml: Healthy once Ready for the current
    # generation, Degraded when Stalled (without it Argo CD shows both Healthy).
    local health want="argocd-e2e-stalled=Degraded argocd-e2e-web=Healthy"
    for _ in $(seq 1 30); do
      health=$(hk -n argocd get application $FED_APP -o jsonpath='{range .status.resources[?(@.kind=="FederatedMyApp")]}{.name}={.health.status} {end}')
      [[ "${health% }" == "$want" ]] && break
      sleep 2
    done
    [[ "${health% }" == "$want" ]] || die "FederatedMyApp health in Argo CD: $health, want $want"
    log "FederatedMyApp health in Argo CD: $health ($(hk -n argocd get application $FED_APP -o jsonpath='{.status.resources[?(@.name=="argocd-e2e-stalled")].health.message}'))"
  fi

  # Stays Synced, no sync loop: no new sync operation while sampling.
  local apps=($APP) a line first=() n=0 bad=0
  [[ "$FED" == 1 ]] && apps+=($FED_APP)
  for a in "${apps[@]}"; do first+=("$(app_line "$a" | cut -d' ' -f5-)"); done
  log "sampling every 10 s for $PROVE_MINUTES min"
  while ((n < PROVE_MINUTES * 6)); do
    for i in "${!apps[@]}"; do
      a=${apps[$i]}
      line=$(app_line "$a")
      echo "  $(date -u +%H:%M:%S) $a: $line"
      [[ "$a" == "$FED_APP" ]] && echo "    FederatedMyApp $(hk -n $FED_NS get federatedmyapp argocd-e2e-web -o jsonpath='resourceVersion={.metadata.resourceVersion} generation={.metadata.generation} status.clusters[0]: replicas={.status.clusters[0].replicas} ready={.status.clusters[0].ready} readyReplicas={.status.clusters[0].readyReplicas}')"
      [[ "$line" == "Synced "* ]] || bad=1
      [[ "$(cut -d' ' -f5- <<<"$line")" == "${first[$i]}" ]] || { echo "  ^ a new sync operation"; bad=1; }
    done
    n=$((n + 1)); sleep 10
  done
  ((bad == 0)) || die "an Application left Synced or synced again while sampling"
  log "Synced throughout, no new sync operation in $PROVE_MINUTES min"

  # selfHeal: a hand edit in the destination is reverted.
  dk -n flotilla-system patch deploy flotilla-agent --type json \
    -p '[{"op":"replace","path":"/spec/template/spec/containers/0/resources/limits/memory","value":"999Mi"}]' >/dev/null
  t0=$SECONDS
  wait_limit 320Mi "selfHeal did not revert a hand edit"
  log "selfHeal reverted a hand edit (999Mi -> 320Mi) in $((SECONDS - t0)) s"
  wait_synced $APP 120 "$rev2"
  log "PASS"
}

down() {
  local f
  for f in application-controller repo-server git-daemon redis; do
    if [[ -f "$W/pids/$f" ]]; then kill "$(cat "$W/pids/$f")" 2>/dev/null || true; rm -f "$W/pids/$f"; fi
  done
  if [[ -f "$HOST_KC" ]] && hk get --raw /readyz >/dev/null 2>&1; then
    hk -n argocd delete application $APP $FED_APP --ignore-not-found --wait=false >/dev/null 2>&1 || true
    hk -n argocd patch application $APP $FED_APP --type merge -p '{"metadata":{"finalizers":null}}' >/dev/null 2>&1 || true
    hk delete ns $FED_NS --ignore-not-found --timeout=90s >/dev/null 2>&1 || log "namespace $FED_NS still terminating"
    hk get ns argocd -o jsonpath='{.metadata.labels.app\.kubernetes\.io/managed-by}' 2>/dev/null | grep -q flotilla-argocd-e2e &&
      hk delete ns argocd --timeout=90s >/dev/null
    hk delete crd applications.argoproj.io appprojects.argoproj.io applicationsets.argoproj.io --ignore-not-found >/dev/null
    kubectl --kubeconfig "$C1_KC" get ns $FED_NS -o jsonpath='{.metadata.labels.app\.kubernetes\.io/managed-by}' 2>/dev/null |
      grep -q flotilla-argocd-e2e && kubectl --kubeconfig "$C1_KC" delete ns $FED_NS --timeout=90s >/dev/null
  fi
  if [[ -d "$W/kwok/clusters/flotilla-argocd-dest" ]]; then
    KWOK_WORKDIR="$W/kwok" "$K8S_BIN/kwokctl" delete cluster --name flotilla-argocd-dest >/dev/null 2>&1 || true
  fi
  rm -rf "$W"
  log "down"
}

case "${1:-all}" in
  up) up ;;
  prove) prove ;;
  down) down ;;
  all) trap down EXIT; up; prove ;;
  *) echo "usage: $0 [up|prove|down|all]" >&2; exit 2 ;;
esac
