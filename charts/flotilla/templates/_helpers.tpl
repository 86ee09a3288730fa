{{- define "flotilla.labels" -}}
app.kubernetes.io/part-of: flotilla
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "flotilla.hubImage" -}}
{{ .Values.hub.image.repository }}:{{ .Values.hub.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "flotilla.agentImage" -}}
{{ .Values.agent.image.repository }}:{{ .Values.agent.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The same pod and container security as deploy/: numeric non-root user 65532. */}}
{{- define "flotilla.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "flotilla.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* One CRD document of files/flotilla-crds.yaml, by name. */}}
{{- define "flotilla.crd" -}}
{{- $name := .name -}}
{{- range (.root.Files.Get "files/flotilla-crds.yaml" | splitList "\n---\n") -}}
{{- if contains (printf "name: %s\n" $name) . }}
---
{{ . | trim }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Whether the agent's rights on MyApps and their children are narrowed to
agent.allowedNamespaces (mode run with the list set): "true", or empty. */}}
{{- define "flotilla.agentNarrowed" -}}
{{- if and (eq .Values.agent.mode "run") .Values.agent.allowedNamespaces }}true{{ end }}
{{- end }}

{{/* The agent's rights on MyApps and their children, in a ClusterRole or a Role. */}}
{{- define "flotilla.agentNamespacedRules" }}
- apiGroups: ["app.example.com"]
  resources: ["myapps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["app.example.com"]
  resources: ["myapps/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Autoscalers that scale a MyApp or its Deployment own those replicas: the agent and
# the operator leave them alone while one exists. The agent sets their minReplicas and
# maxReplicas to the bounds the hub assigns (through KEDA's ScaledObject when KEDA owns
# the HPA); nothing else of them.
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}
