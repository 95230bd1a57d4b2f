{{/* Relabelings that give every series the labels the dashboards and alert rules use (as the router's own
service discovery does): job (the operator would set the Service's or the monitor's name: the rules and dashboards
select job="pdspark"), role, model, instance (the pod). */}}
{{- define "pdspark.relabelings" -}}
- targetLabel: job
  replacement: pdspark
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_component]
  targetLabel: role
- targetLabel: model
  replacement: {{ include "pdspark.servedModelName" . | quote }}
- sourceLabels: [__meta_kubernetes_pod_name]
  targetLabel: instance
{{- end -}}

{{- define "pdspark.routerScheme" -}}
{{- if .Values.router.httpsSecret }}
scheme: https
tlsConfig:
  # The router's certificate names its Service, not the pod address Prometheus scrapes.
  insecureSkipVerify: true
{{- end }}
{{- end -}}
