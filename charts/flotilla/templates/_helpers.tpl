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
