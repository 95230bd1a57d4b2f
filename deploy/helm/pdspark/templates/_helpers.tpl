{{- define "pdspark.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdspark.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdspark.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "pdspark.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one role: (dict "ctx" $ "role" "prefill") */}}
{{- define "pdspark.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdspark.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "pdspark.roleLabels" -}}
{{ include "pdspark.labels" .ctx }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "pdspark.servedModelName" -}}
{{- default .Values.model .Values.servedModelName -}}
{{- end -}}

{{/* A role's image; a worker's tag names its accelerator build (accelerator.type: cpu -> <version>, cuda ->
<version>-cuda, ascend -> <version>-ascend; the worker Dockerfiles' build args make them). */}}
{{- define "pdspark.image" -}}
{{- $repo := index .ctx.Values.image.repositories .role -}}
{{- $tag := default .ctx.Chart.AppVersion .ctx.Values.image.tag -}}
{{- $type := .ctx.Values.accelerator.type -}}
{{- if and (ne .role "router") (ne $type "cpu") -}}
{{- $tag = printf "%s-%s" $tag $type -}}
{{- end -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{- define "pdspark.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdspark.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The headless Service of a worker role, as the router resolves it: (dict "ctx" $ "role" "prefill") */}}
{{- define "pdspark.workerDns" -}}
{{- printf "%s-%s.%s.svc.%s:%d" (include "pdspark.fullname" .ctx) .role .ctx.Release.Namespace .ctx.Values.clusterDomain (int (include "pdspark.workerPort" (dict "ctx" .ctx "role" .role "port" "worker"))) -}}
{{- end -}}

{{/* A worker role's port ("worker": gRPC, or "metrics"): ports.* on the pod network; under mooncake.hostNetwork the
role's own host port (mooncake.hostPorts), which must differ from the other role's and from 9100. */}}
{{- define "pdspark.workerPort" -}}
{{- $v := .ctx.Values -}}
{{- if $v.mooncake.hostNetwork -}}
{{- $p := $v.mooncake.hostPorts -}}
{{- /* (as strings: --set and values.yaml give numbers of different types) */ -}}
{{- $all := list (toString $p.prefill.worker) (toString $p.prefill.metrics) (toString $p.decode.worker) (toString $p.decode.metrics) -}}
{{- if ne (len (uniq $all)) 4 -}}
{{- fail (printf "mooncake.hostPorts: under hostNetwork the prefill and decode ports must all differ (a prefill and a decode pod may share a node); got %v" $p) -}}
{{- end -}}
{{- if has "9100" $all -}}
{{- fail "mooncake.hostPorts: 9100 is node-exporter's port on kube-prometheus-stack clusters; choose another" -}}
{{- end -}}
{{- index (index $p .role) .port -}}
{{- else -}}
{{- index $v.ports .port -}}
{{- end -}}
{{- end -}}

{{- define "pdspark.authSecretName" -}}
{{- default (printf "%s-auth" (include "pdspark.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* The Secret with a role's mutual-TLS certificate: tls.secrets.<role>, or under tls.certManager the one its
Certificate fills. (dict "ctx" $ "role" "prefill") */}}
{{- define "pdspark.tlsSecret" -}}
{{- $v := .ctx.Values -}}
{{- $given := index $v.tls.secrets .role -}}
{{- if $given -}}
{{- $given -}}
{{- else if $v.tls.certManager.enabled -}}
{{- printf "%s-%s-tls" (include "pdspark.fullname" .ctx) .role -}}
{{- else -}}
{{- fail (printf "tls.secrets.%s is required with tls.enabled (or tls.certManager.enabled)" .role) -}}
{{- end -}}
{{- end -}}

{{/* The name a worker's certificate must carry (--tls-peer-name), "" for the address dialled: tls.peerName
"service" (the default under tls.certManager) is the pod's name under its headless Service. */}}
{{- define "pdspark.tlsPeerName" -}}
{{- $v := .Values -}}
{{- $name := $v.tls.peerName | default (ternary "service" "" $v.tls.certManager.enabled) -}}
{{- if eq $name "service" -}}
{{- printf "{ip}.%s-{role}.%s.svc" (include "pdspark.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- $name -}}
{{- end -}}
{{- end -}}
