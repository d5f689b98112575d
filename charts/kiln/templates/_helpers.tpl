{{/* The chart name. */}}
{{- define "kiln.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The full name: <release>-kiln, or the release name when it already contains the chart name. */}}
{{- define "kiln.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object, without a component. */}}
{{- define "kiln.commonLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kiln.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kiln
{{- end -}}

{{/* Labels of the operator's objects. */}}
{{- define "kiln.labels" -}}
{{ include "kiln.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels that select the operator pod. */}}
{{- define "kiln.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kiln.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels of the activator's objects, and those that select its pods. */}}
{{- define "kiln.activatorLabels" -}}
{{ include "kiln.commonLabels" . }}
app.kubernetes.io/component: activator
{{- end -}}

{{- define "kiln.activatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "kiln.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: activator
{{- end -}}

{{/* The activator's Service (and Deployment, ServiceAccount, roles): the operator's --activator-service. */}}
{{- define "kiln.activatorName" -}}
{{- printf "%s-activator" (include "kiln.fullname" .) -}}
{{- end -}}

{{/* The operator's ServiceAccount. */}}
{{- define "kiln.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kiln.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces watched in namespaced mode (the release namespace when none are listed). */}}
{{- define "kiln.watchedNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- toJson .Values.watch.namespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/* RBAC rules for namespaced resources: exactly what the operator calls. */}}
{{- define "kiln.namespacedRules" -}}
- apiGroups: [kiln.dev]
  resources: [inferencemodels]
  verbs: [get, list, watch, patch, update]
- apiGroups: [kiln.dev]
  resources: [inferencemodels/status, inferencemodels/scale]
  verbs: [get, patch, update]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- if .Values.activator.enabled }}
# A model at zero: its Service's EndpointSlice to the activator (operator/activation.py).
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, create, patch, delete]
{{- end }}
{{- if .Values.rbac.gatewayAPI }}
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes, grpcroutes]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end -}}
