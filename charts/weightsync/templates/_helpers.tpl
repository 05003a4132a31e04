{{/* vim: set filetype=mustache: */}}

{{- define "weightsync.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: <release>-<chart> unless the release name already contains the chart name.
*/}}
{{- define "weightsync.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "weightsync.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "weightsync.selectorLabels" -}}
app.kubernetes.io/name: {{ include "weightsync.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "weightsync.labels" -}}
helm.sh/chart: {{ include "weightsync.chart" . }}
{{ include "weightsync.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: weightsync
{{- end }}

{{- define "weightsync.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "weightsync.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "weightsync.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "weightsync.agentImage" -}}
{{- printf "%s:%s" .Values.agentImage.repository (default .Chart.AppVersion .Values.agentImage.tag) }}
{{- end }}

{{/*
=====================================================================================================
RBAC: the ONE place that lists what the operator may do. rbac.yaml only decides where the rules go:
  - cluster-wide (watchNamespaces empty): clusterScoped + namespaced rules in one ClusterRole;
  - namespaced: clusterScoped rules in a small ClusterRole, namespaced rules in a Role per namespace.
Least privilege: no wildcards, no `escalate`/`bind`/`impersonate`. tests/chart/test_chart.py compares
these rules as sets, so any change here must be mirrored there (deliberately).
Kubernetes only lets the operator create Roles that grant what it holds itself, so every permission
it hands to the agents' per-group Role (e.g. pods/status patch) must also appear below.
=====================================================================================================
*/}}

{{/* What kopf itself needs outside any one namespace. */}}
{{- define "weightsync.rbac.clusterScopedRules" -}}
# kopf: discovers the CRD (and whether KopfPeering CRDs exist) at startup and watches for changes.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
# kopf: tracks namespaces (needed to resolve --namespace patterns and for cluster-wide watching).
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}

{{/* What the operator needs in every namespace it watches. */}}
{{- define "weightsync.rbac.namespacedRules" -}}
# The operator and kopf post Events (PlanCreated/PlanUpdated, PodFailed, InvalidSpec, handler errors).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# The custom resource: watched by kopf, which keeps its bookkeeping in weightsync.io/* annotations (patch).
- apiGroups: ["weightsync.io"]
  resources: ["weightsyncgroups"]
  verbs: ["list", "watch", "patch"]
# The operator is the only writer of the group's status.
- apiGroups: ["weightsync.io"]
  resources: ["weightsyncgroups/status"]
  verbs: ["patch"]
# Trainer and engine pods are bare pods: listed, created, deleted (surplus or failed) by the operator.
# get/patch are never called by the operator: it holds them only to grant them to the agents' Role.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
# Held only to grant it: agents set their weightsync.io/agent-ready condition on their own pod.
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["get", "patch"]
# The plan ConfigMap (get, create, patch); list/watch held only to grant them to the agents.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
# The headless Service and the agents' ServiceAccount. No delete: they are owned by the group, and the
# garbage collector removes them with it.
- apiGroups: [""]
  resources: ["services", "serviceaccounts"]
  verbs: ["get", "create", "patch"]
# The group's credential (docs/security.md): created once with a random token; afterwards only its labels and
# owner are patched, never its data. No list/watch (the operator reads only its groups' Secrets, by name), no
# delete (the garbage collector removes it with the group).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch"]
# The group's NetworkPolicy <group>-ingress (ingress to its pods); garbage-collected with the group, deleted by
# the operator only when the group turns it off (networkPolicy.enabled: false).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch", "delete"]
# The agents' Role (its resourceNames follow scaling) and RoleBinding; also removed by the garbage collector.
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch"]
{{- end }}

{{/* Checks the schema cannot express (they compare two values). Included by deployment.yaml. */}}
{{- define "weightsync.validate" -}}
{{- if and .Values.metrics.enabled (eq (int .Values.metrics.port) (int .Values.liveness.port)) }}
{{- fail (printf "metrics.port and liveness.port must differ (both are %v)" .Values.metrics.port) }}
{{- end }}
{{- end }}
