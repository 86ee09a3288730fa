#!/usr/bin/env bash
# Offline checks of every install manifest (CI runs it; exits non-zero on any failure):
#   - every kustomization under deploy/ and the chart's output for each values set below,
#     validated by kubeconform in strict mode against the Kubernetes schemas of the e2e
#     clusters' version and the CRD schemas (Flotilla's and the Prometheus Operator's);
#   - helm lint --strict, and the chart refusing incomplete values;
#   - promtool check rules and promtool test rules for every alert;
#   - the copies that must agree: PrometheusRule objects vs the chart's rules file, the
#     chart's admission policies and flotilla-fleet-admin role vs deploy/hub's;
#   - the OLM bundles under deploy/olm: kubeconform (with OLM's CRD schemas), their sample
#     MyApps against the MyApp CRD, operator-framework/api's bundle validators; and, when
#     lab/scripts/olm-prereqs.sh has built opm from its source, `opm validate` on the
#     catalog and `opm render` of each bundle equal to the catalog's entry.
# Tools it lacks are installed: Debian packages (prometheus for promtool, python3-yaml),
# Go tools through the Go module proxy (helm, kubeconform, controller-gen), cached under
# ~/.cache/flotilla/tools. Server-side dry runs against real apiservers are e2e's.
set -euo pipefail
cd "$(dirname "$0")/.."

K8S_VERSION=v1.34.4 # the e2e clusters' version
HELM_VERSION=v4.3.2
KUBECONFORM_VERSION=v0.7.0
CONTROLLER_GEN_VERSION=v0.23.0
PROMETHEUS_OPERATOR_VERSION=v0.95.2
OPM_VERSION=v1.73.0                    # lab/scripts/olm-prereqs.sh builds it
OPERATOR_FRAMEWORK_API_VERSION=v0.45.0 # the operator-framework/api that opm is built with
CACHE=${FLOTILLA_CACHE:-$HOME/.cache/flotilla}
TOOLS=$CACHE/tools
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

step() { printf '==> %s\n' "$*"; }

apt_updated=
need_deb() { # need_deb COMMAND-OR-CHECK PACKAGE
  if ! eval "$1" >/dev/null 2>&1; then
    step "installing Debian package $2"
    [ -n "$apt_updated" ] || { apt-get update -qq; apt_updated=1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >/dev/null
  fi
}

go_tool() { # go_tool NAME MODULE/PATH VERSION -> prints the binary's path
  local dir=$TOOLS/$1-$3
  if [ ! -x "$dir/$1" ]; then
    step "building $1 $3 (go install $2@$3)" >&2
    GOBIN=$dir GOFLAGS=-mod=mod go install "$2@$3" >&2
  fi
  echo "$dir/$1"
}

need_deb 'command -v promtool' prometheus
need_deb 'python3 -c "import yaml"' python3-yaml
command -v go >/dev/null || { echo "verify.sh needs Go (the e2e environment builds with it too)" >&2; exit 1; }
HELM=$(go_tool helm helm.sh/helm/v4/cmd/helm "$HELM_VERSION")
KUBECONFORM=$(go_tool kubeconform github.com/yannh/kubeconform/cmd/kubeconform "$KUBECONFORM_VERSION")
CONTROLLER_GEN=$(go_tool controller-gen sigs.k8s.io/controller-tools/cmd/controller-gen "$CONTROLLER_GEN_VERSION")
OPERATOR_VERIFY=$(go_tool operator-verify github.com/operator-framework/api/cmd/operator-verify "$OPERATOR_FRAMEWORK_API_VERSION")
if command -v kubectl >/dev/null; then
  kustomize() { kubectl kustomize "$@"; }
else
  KUSTOMIZE=$(go_tool kustomize sigs.k8s.io/kustomize/kustomize/v5 v5.7.1)
  kustomize() { "$KUSTOMIZE" build "$@"; }
fi

# --- schemas -------------------------------------------------------------------------
# The Prometheus Operator CRDs, generated from its Go API types by controller-gen.
PROM_CRDS=$TOOLS/prometheus-operator-crds-$PROMETHEUS_OPERATOR_VERSION
if [ ! -s "$PROM_CRDS/monitoring.coreos.com_servicemonitors.yaml" ]; then
  step "generating the Prometheus Operator CRDs $PROMETHEUS_OPERATOR_VERSION"
  mod=$WORK/promcrds
  mkdir -p "$mod"
  printf 'module flotilla.local/promcrds\n\ngo 1.24\n' >"$mod/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"\n' >"$mod/tools.go"
  (cd "$mod" && GOFLAGS=-mod=mod go get "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring@$PROMETHEUS_OPERATOR_VERSION" >/dev/null 2>&1 \
    && GOFLAGS=-mod=mod go mod tidy >/dev/null 2>&1 \
    && "$CONTROLLER_GEN" crd:maxDescLen=0 paths=github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1 output:crd:dir="$WORK/promcrds-out")
  mkdir -p "$PROM_CRDS"
  cp "$WORK"/promcrds-out/*.yaml "$PROM_CRDS/"
fi
module_dir() { go mod download -json "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])'; }
K8S_DIR=$(module_dir "k8s.io/kubernetes@$K8S_VERSION")
# OLM's CRDs (ClusterServiceVersion, ...), as operator-framework/api ships them.
OLM_API_DIR=$(module_dir "github.com/operator-framework/api@$OPERATOR_FRAMEWORK_API_VERSION")
SCHEMAS=$WORK/schemas
python3 deploy/kubeconform-schemas.py "$SCHEMAS" "$K8S_DIR/api/openapi-spec/swagger.json" \
  crds/flotilla-crds.yaml "$PROM_CRDS"/*.yaml "$OLM_API_DIR"/crds/operators.coreos.com_*.yaml
validate() { # validate NAME < manifests
  "$KUBECONFORM" -strict -summary -output text \
    -schema-location "$SCHEMAS/{{ .ResourceKind }}_{{ .Group }}_{{ .ResourceAPIVersion }}.json" - \
    | sed "s|^|$1: |"
}

# --- kustomize -----------------------------------------------------------------------
kustomizations=$(grep -l '^kind: Kustomization' $(find deploy -name kustomization.yaml) | xargs -n1 dirname | sort)
for k in $kustomizations; do
  step "kubeconform $k"
  kustomize "$k" >"$WORK/out.yaml"
  validate "$k" <"$WORK/out.yaml"
done
# Every component is used by some kustomization, so that the loop above checks it.
for c in $(find deploy/components -mindepth 1 -maxdepth 1 -type d | sort); do
  grep -rqs -- "- ../../components/$(basename "$c")\$" deploy --include=kustomization.yaml \
    || { echo "$c: no kustomization uses this component, so nothing validates it" >&2; exit 1; }
done
# deploy/base applies on a cluster without the Prometheus Operator.
if kustomize deploy/base | grep -q 'monitoring.coreos.com'; then
  echo "deploy/base must not need the Prometheus Operator CRDs" >&2
  exit 1
fi

# --- Helm ----------------------------------------------------------------------------
CHART=charts/flotilla
declare -A VALUES=(
  [hub]=""
  [hub-nodeport-monitoring]="--set hub.service.type=NodePort --set hub.service.nodePort=30743 --set monitoring.enabled=true --set monitoring.labels.release=kube-prometheus-stack"
  [hub-without-election]="--set hub.replicas=1 --set hub.leaderElection.enabled=false --set hub.service.type=LoadBalancer"
  [member]="--set hub.enabled=false --set agent.enabled=true --set agent.cluster=paris --set agent.hub.address=hub.example.com:7443 --set monitoring.enabled=true --set agent.allowedNamespaces={shop,team}"
  [member-with-secret]="--set hub.enabled=false --set agent.enabled=true --set agent.cluster=paris --set agent.hub.address=10.0.0.1:30743 --set agent.hub.serverName=flotilla-hub.flotilla-system.svc --set agent.hub.token=paris.x --set agent.hub.caCrt=pem"
  [operator]="--set hub.enabled=false --set agent.enabled=true --set agent.mode=operator"
  [host-and-member]="--set agent.enabled=true --set agent.cluster=host --set agent.hub.address=flotilla-hub.flotilla-system.svc:7443 --set monitoring.enabled=true --set tenancy.forbiddenNamespaces={vault,argocd}"
)
for name in $(printf '%s\n' "${!VALUES[@]}" | sort); do
  step "helm lint and kubeconform: $CHART ($name)"
  # shellcheck disable=SC2086
  "$HELM" lint --strict --quiet "$CHART" ${VALUES[$name]}
  # shellcheck disable=SC2086
  "$HELM" template flotilla "$CHART" --namespace flotilla-system ${VALUES[$name]} >"$WORK/out.yaml"
  validate "helm $name" <"$WORK/out.yaml"
done
step "the chart's admission policies and fleet-admin role are deploy/hub's"
# Rendered as release "flotilla" in namespace "team-hub": the names carry the release's
# prefix and the hub's username that namespace; everything else must be the same.
"$HELM" template flotilla "$CHART" --namespace team-hub >"$WORK/chart.yaml"
kustomize deploy/hub >"$WORK/hub.yaml"
python3 - "$WORK/chart.yaml" "$WORK/hub.yaml" <<'EOF'
import sys, yaml
KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "ClusterRole")
def walk(v, rename):
    if isinstance(v, dict):
        return {k: walk(x, rename) for k, x in v.items()}
    if isinstance(v, list):
        return [walk(x, rename) for x in v]
    return rename(v) if isinstance(v, str) else v
def picked(path, rename):
    out = {}
    for d in yaml.safe_load_all(open(path)):
        if not d or d["kind"] not in KINDS:
            continue
        d["metadata"].pop("labels", None)
        d = walk(d, rename)
        if d["kind"] != "ClusterRole" or d["metadata"]["name"] == "flotilla-fleet-admin":
            out[(d["kind"], d["metadata"]["name"])] = d
    return out
chart = picked(sys.argv[1], lambda t: t.replace("flotilla-flotilla-", "flotilla-")
               .replace("system:serviceaccount:team-hub:", "system:serviceaccount:flotilla-system:"))
hub = picked(sys.argv[2], lambda t: t)
if sorted(chart) != sorted(hub):
    sys.exit(f"the chart has {sorted(chart)}, deploy/hub {sorted(hub)}")
for key in sorted(hub):
    if chart[key] != hub[key]:
        sys.exit(f"{key[0]} {key[1]}: the chart's differs from deploy/hub's")
    print(f"  {key[0]} {key[1]}: the same")
EOF
step "helm template refuses incomplete values"
for bad in "--set agent.enabled=true --set agent.cluster=" "--set agent.enabled=true --set agent.cluster=x --set agent.mode=both" \
  "--set agent.enabled=true --set agent.cluster=x --set agent.hub.address=h:1 --set agent.hub.token=t"; do
  # shellcheck disable=SC2086
  if "$HELM" template flotilla "$CHART" $bad >/dev/null 2>"$WORK/err"; then
    echo "helm template accepted: $bad" >&2
    exit 1
  fi
  grep -m1 "Error" "$WORK/err" | sed 's/^/  refused as expected: /'
done

# --- alerts --------------------------------------------------------------------------
RULES=$CHART/files/flotilla.rules.yaml
step "promtool check rules, test rules"
promtool check rules "$RULES"
promtool test rules deploy/monitoring-tests/*_test.yaml
step "PrometheusRule objects carry the chart's rules"
python3 - "$RULES" deploy/components/monitoring-*/prometheusrule.yaml <<'EOF'
import sys, yaml
rules = yaml.safe_load(open(sys.argv[1]))
for path in sys.argv[2:]:
    spec = yaml.safe_load(open(path))["spec"]
    if spec != rules:
        sys.exit(f"{path}: spec differs from {sys.argv[1]}")
    print(f"  {path}: same rules")
EOF
# --- OLM -----------------------------------------------------------------------------
# deploy/olm is generated from deploy/ (`cargo test -p flotilla-olm` fails on drift).
for bundle in deploy/olm/bundles/*/*/; do
  bundle=${bundle%/}
  step "kubeconform and operator-verify $bundle"
  for f in "$bundle"/manifests/*.yaml; do echo ---; cat "$f"; done | validate "$bundle"
  python3 - "$bundle"/manifests/*.clusterserviceversion.yaml >"$WORK/examples.yaml" <<'EOF'
import json, sys, yaml
csv = yaml.safe_load(open(sys.argv[1]))
print(yaml.safe_dump_all(json.loads(csv["metadata"]["annotations"]["alm-examples"])))
EOF
  validate "$bundle alm-examples" <"$WORK/examples.yaml"
  # operator-verify reports through its log and exits 0: any error or warning fails here.
  "$OPERATOR_VERIFY" manifests "$bundle" --object_validate >"$WORK/verify.log" 2>&1
  if grep -E 'level=(error|warning|fatal)' "$WORK/verify.log"; then exit 1; fi
done
OPM=$TOOLS/opm-$OPM_VERSION/opm
if [ -x "$OPM" ]; then
  step "opm validate deploy/olm/catalog; opm render of each bundle equals its catalog entry"
  "$OPM" validate deploy/olm/catalog
  for bundle in deploy/olm/bundles/*/*/; do
    "$OPM" render "${bundle%/}" --migrate-level bundle-object-to-csv-metadata -o yaml \
      --alpha-image-ref-template 'ghcr.io/flotilla/{{.Package}}-bundle:v{{.Version}}'
  done >"$WORK/rendered.yaml"
  python3 - "$WORK/rendered.yaml" deploy/olm/catalog/*/catalog.yaml <<'EOF'
import sys, yaml
rendered = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
catalog = {d["name"]: d for f in sys.argv[2:] for d in yaml.safe_load_all(open(f)) if d and d["schema"] == "olm.bundle"}
if sorted(b["name"] for b in rendered) != sorted(catalog):
    sys.exit(f"the catalog's bundles {sorted(catalog)} are not the bundle directories' {sorted(b['name'] for b in rendered)}")
for bundle in rendered:
    if bundle != catalog[bundle["name"]]:
        sys.exit(f"{bundle['name']}: opm renders the bundle directory differently from the catalog's entry")
    print(f"  {bundle['name']}: as opm renders it")
EOF
  step "opm generate dockerfile: deploy/olm/catalog.Dockerfile"
  cp -r deploy/olm/catalog "$WORK/catalog"
  "$OPM" generate dockerfile "$WORK/catalog" -i "quay.io/operator-framework/opm:$OPM_VERSION" -b "quay.io/operator-framework/opm:$OPM_VERSION"
  grep -v '^# Generated from' deploy/olm/catalog.Dockerfile | diff - "$WORK/catalog.Dockerfile"
else
  step "skipping opm validate and render: no $OPM (build it: bash lab/scripts/olm-prereqs.sh --operator-registry DIR, DIR a checkout of operator-framework/operator-registry at $OPM_VERSION)"
fi
step "deploy/verify.sh: all checks passed"
