{{/* The PDSPARK_* variables of a role (ConfigMap data): chart-derived first, then settings.common, settings.<role>. */}}
{{- define "pdspark.settings" -}}
{{- $v := .ctx.Values -}}
{{- $env := dict "PDSPARK_HOST" "0.0.0.0" "PDSPARK_MODEL" $v.model -}}
{{- if eq .role "router" -}}
{{- $_ := set $env "PDSPARK_PORT" (toString $v.ports.http) -}}
{{- $_ := set $env "PDSPARK_GRPC_PORT" (toString $v.ports.grpc) -}}
{{- $_ := set $env "PDSPARK_SERVED_MODEL_NAME" (include "pdspark.servedModelName" .ctx) -}}
{{- $_ := set $env "PDSPARK_PREFILL_POLICY" $v.router.prefillPolicy -}}
{{- $_ := set $env "PDSPARK_DECODE_POLICY" $v.router.decodePolicy -}}
{{- $_ := set $env "PDSPARK_PROCESSES" (toString $v.router.processes) -}}
{{- if $v.router.dnsDiscovery -}}
{{- $_ := set $env "PDSPARK_DNS_INTERVAL_S" (toString $v.router.dnsIntervalSeconds) -}}
{{- end -}}
{{- else -}}
{{- $_ := set $env "PDSPARK_PORT" (include "pdspark.workerPort" (dict "ctx" .ctx "role" .role "port" "worker")) -}}
{{- $_ := set $env "PDSPARK_METRICS_PORT" (include "pdspark.workerPort" (dict "ctx" .ctx "role" .role "port" "metrics")) -}}
{{- $_ := set $env "PDSPARK_TRANSFER_PROTOCOL" $v.mooncake.protocol -}}
{{- /* The drain follows the pod's grace period: what is left of it after the preStop, less a margin for the stop. */ -}}
{{- $_ := set $env "PDSPARK_DRAIN_TIMEOUT_S" (toString (max 1 (sub (sub (int $v.terminationGracePeriodSeconds) (int $v.drain.preStopSeconds)) (int $v.drain.marginSeconds)))) -}}
{{- if $v.mooncake.device -}}
{{- $_ := set $env "PDSPARK_TRANSFER_DEVICE" $v.mooncake.device -}}
{{- end -}}
{{- $_ := set $env "PDSPARK_EP_SIZE" (toString ((index $v .role).epSize | default 1)) -}}
{{- $_ := set $env "PDSPARK_NNODES" (toString ((index $v .role).nnodes | default 1)) -}}
{{- /* A decode group runs DP-attention (each rank owns whole requests); a prefill group runs its batch on every rank. */ -}}
{{- $_ := set $env "PDSPARK_DP_ATTENTION" (toString (and (eq .role "decode") (gt (int ((index $v .role).epSize | default 1)) 1))) -}}
{{- range $k, $val := $v.mooncake.env -}}
{{- $_ := set $env $k (toString $val) -}}
{{- end -}}
{{- end -}}
{{- with $v.tracing.otlpEndpoint -}}
{{- /* every role exports its spans there; the SDK reads its sampler from the standard variables */ -}}
{{- $_ := set $env "PDSPARK_OTLP_ENDPOINT" . -}}
{{- $_ := set $env "OTEL_TRACES_SAMPLER" $v.tracing.sampler -}}
{{- $_ := set $env "OTEL_TRACES_SAMPLER_ARG" (toString $v.tracing.samplerArg) -}}
{{- end -}}
{{- range $k, $val := $v.settings.common -}}
{{- $_ := set $env $k (toString $val) -}}
{{- end -}}
{{- range $k, $val := index $v.settings .role -}}
{{- $_ := set $env $k (toString $val) -}}
{{- end -}}
{{- toYaml $env -}}
{{- end -}}
