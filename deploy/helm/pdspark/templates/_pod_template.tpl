{{/* A pod template of one role: (dict "ctx" $ "role" "prefill" "node" "") for a Deployment; "node" "leader" or
"worker" for the pods of a group across pods (a LeaderWorkerSet): the leader is the worker and rank 0, the others
run only their ranks (no port, no probe: a group fails and restarts as a unit). */}}
{{- define "pdspark.podTemplate" -}}
{{- $root := .ctx }}
{{- $v := $root.Values }}
{{- $role := .role }}
{{- $node := .node }}
{{- $r := index $v $role }}
{{- $worker := ne $role "router" }}
{{- $fullname := include "pdspark.fullname" $root -}}
metadata:
  labels:
    {{- include "pdspark.selectorLabels" (dict "ctx" $root "role" (ternary (printf "%s-ranks" $role) $role (eq $node "worker"))) | nindent 4 }}
    {{- range $k, $val := $r.podLabels }}
    {{- if hasPrefix "app.kubernetes.io/" $k }}
    {{- fail (printf "%s.podLabels.%s: app.kubernetes.io/ labels are the chart's (its selectors use them)" $role $k) }}
    {{- end }}
    {{ $k }}: {{ $val | quote }}
    {{- end }}
  annotations:
    checksum/config: {{ include "pdspark.settings" (dict "ctx" $root "role" $role) | sha256sum }}
    {{- with $r.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "pdspark.serviceAccountName" $root }}
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  automountServiceAccountToken: false
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if and $worker $v.mooncake.hostNetwork }}
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  {{- with $r.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $r.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with $r.initContainers }}
  initContainers:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ $role }}
      image: {{ include "pdspark.image" (dict "ctx" $root "role" $role) }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- if and (not $worker) $v.router.dnsDiscovery }}
      args:
        - --prefill-dns
        - {{ include "pdspark.workerDns" (dict "ctx" $root "role" "prefill") }}
        - --decode-dns
        - {{ include "pdspark.workerDns" (dict "ctx" $root "role" "decode") }}
      {{- end }}
      {{- if and $worker (ne $node "worker") }}
      lifecycle:
        # Stop taking new work first (SIGUSR1: NOT_SERVING, the routers' health checks send nothing new), give the
        # routers time to notice, then SIGTERM: running calls get --drain-timeout-s to finish or migrate.
        preStop:
          exec:
            command: ["/bin/sh", "-c", "kill -USR1 1; sleep {{ $v.drain.preStopSeconds }}"]
      {{- end }}
      envFrom:
        - configMapRef:
            name: {{ $fullname }}-{{ $role }}
      env:
        - name: PDSPARK_CACHE_DIR
          value: /home/pdspark/.cache/pdspark
        {{- if $worker }}
        # The address peers and the transfer engine reach this worker at.
        - name: PDSPARK_ADVERTISE_HOST
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- else }}
        # Each router replica names itself and its own address in its Prometheus service discovery.
        - name: PDSPARK_INSTANCE_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: PDSPARK_ADVERTISE_HOST
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- end }}
        {{- if $node }}
        # This pod's place in its group (a LeaderWorkerSet): the worker index LWS labels it with, and the group's
        # leader, where the ranks meet (LWS_LEADER_ADDRESS: set by LWS's webhook, ahead of these).
        - name: PDSPARK_NODE_RANK
          {{- if eq $node "leader" }}
          value: "0"
          {{- else }}
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']
          {{- end }}
        - name: PDSPARK_DIST_INIT_ADDR
          value: "$(LWS_LEADER_ADDRESS):{{ $v.ports.groupRendezvous }}"
        - name: PDSPARK_DIST_SECRET_FILE
          value: /etc/pdspark/group/secret
        {{- end }}
        {{- if $v.tls.enabled }}
        - name: PDSPARK_TLS_CERT
          value: /etc/pdspark/tls/tls.crt
        - name: PDSPARK_TLS_KEY
          value: /etc/pdspark/tls/tls.key
        - name: PDSPARK_TLS_CA
          value: /etc/pdspark/tls/ca.crt
        {{- with include "pdspark.tlsPeerName" $root }}
        - name: PDSPARK_TLS_PEER_NAME
          value: {{ . | quote }}
        {{- end }}
        {{- end }}
        {{- if not $worker }}
        {{- if $v.auth.enabled }}
        - name: PDSPARK_API_KEY_FILE
          value: /etc/pdspark/auth/api-keys
        {{- if $v.auth.adminKey }}
        - name: PDSPARK_ADMIN_API_KEY_FILE
          value: /etc/pdspark/auth/admin-api-keys
        {{- end }}
        {{- end }}
        {{- if $v.router.httpsSecret }}
        - name: PDSPARK_SSL_CERTFILE
          value: /etc/pdspark/https/tls.crt
        - name: PDSPARK_SSL_KEYFILE
          value: /etc/pdspark/https/tls.key
        {{- end }}
        {{- end }}
        {{- with $r.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if ne $node "worker" }}
      ports:
        {{- if eq $node "leader" }}
        # The group's rendezvous (torch.distributed) and rank 0's control channel (the port after it).
        - name: group
          containerPort: {{ $v.ports.groupRendezvous }}
          protocol: TCP
        - name: group-control
          containerPort: {{ add $v.ports.groupRendezvous 1 }}
          protocol: TCP
        {{- end }}
        {{- if $worker }}
        - name: grpc
          containerPort: {{ include "pdspark.workerPort" (dict "ctx" $root "role" $role "port" "worker") }}
          protocol: TCP
        - name: metrics
          containerPort: {{ include "pdspark.workerPort" (dict "ctx" $root "role" $role "port" "metrics") }}
          protocol: TCP
        {{- else }}
        - name: http
          containerPort: {{ $v.ports.http }}
          protocol: TCP
        - name: grpc
          containerPort: {{ $v.ports.grpc }}
          protocol: TCP
        {{- end }}
      {{- /* Readiness asks whether the process takes work (/health); startup and liveness only whether it runs
      (/live): a router whose workers are still loading, or a worker between requests of a drain, is alive. The
      workers answer on their plain metrics port, whatever the gRPC port's mutual TLS (a kubelet has no client
      certificate). */}}
      {{- range $kind := list "startup" "readiness" "liveness" }}
      {{ $kind }}Probe:
        httpGet:
          path: {{ ternary "/health" "/live" (eq $kind "readiness") }}
          {{- if not $worker }}
          port: http
          scheme: {{ ternary "HTTPS" "HTTP" (ne $v.router.httpsSecret "") }}
          {{- else }}
          port: metrics
          scheme: HTTP
          {{- end }}
        {{- $timing := deepCopy (index $v.probes $kind) }}
        {{- if and $worker (eq $kind "startup") }}
        {{- /* (the budget for loading the weights: periodSeconds x this) */}}
        {{- $_ := set $timing "failureThreshold" $v.probes.workerStartupFailureThreshold }}
        {{- end }}
        {{- toYaml $timing | nindent 8 }}
      {{- end }}
      {{- end }}
      resources:
        {{- $extra := dict }}
        {{- if $worker }}
        {{- /* accelerators are per rank of the worker's group */}}
        {{- $perPod := dict }}
        {{- range $k, $n := $r.accelerators }}
        {{- $_ := set $perPod $k (mul $n (div ($r.epSize | default 1) ($r.nnodes | default 1))) }}
        {{- end }}
        {{- $extra = merge (dict) $perPod $v.mooncake.rdmaResources }}
        {{- end }}
        requests:
          {{- toYaml (merge (dict) $extra ($r.resources.requests | default dict)) | nindent 10 }}
        limits:
          {{- toYaml (merge (dict) $extra ($r.resources.limits | default dict)) | nindent 10 }}
      securityContext:
        {{- $sc := deepCopy $v.securityContext }}
        {{- if and $worker $v.mooncake.ipcLock }}
        {{- $_ := set $sc "capabilities" (dict "drop" (list "ALL") "add" (list "IPC_LOCK")) }}
        {{- end }}
        {{- toYaml $sc | nindent 8 }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        - name: cache
          mountPath: /home/pdspark/.cache
        {{- if $worker }}
        - name: shm
          mountPath: /dev/shm
        {{- end }}
        {{- if $v.tls.enabled }}
        - name: tls
          mountPath: /etc/pdspark/tls
          readOnly: true
        {{- end }}
        {{- if and (not $worker) $v.auth.enabled }}
        - name: auth
          mountPath: /etc/pdspark/auth
          readOnly: true
        {{- end }}
        {{- if and (not $worker) $v.router.httpsSecret }}
        - name: https
          mountPath: /etc/pdspark/https
          readOnly: true
        {{- end }}
        {{- if $node }}
        - name: group-secret
          mountPath: /etc/pdspark/group
          readOnly: true
        {{- end }}
        {{- with $r.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: tmp
      emptyDir: {}
    - name: cache
      emptyDir: {}
    {{- if $worker }}
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.mooncake.shmSize }}
    {{- end }}
    {{- if $node }}
    - name: group-secret
      secret:
        secretName: {{ $r.groupSecret }}
        defaultMode: 0440
        items:
          - key: secret
            path: secret
    {{- end }}
    {{- if $v.tls.enabled }}
    - name: tls
      secret:
        secretName: {{ include "pdspark.tlsSecret" (dict "ctx" $root "role" $role) }}
        defaultMode: 0440
    {{- end }}
    {{- if and (not $worker) $v.auth.enabled }}
    - name: auth
      secret:
        secretName: {{ include "pdspark.authSecretName" $root }}
        defaultMode: 0440
        items:
          - key: api-keys
            path: api-keys
          {{- if $v.auth.adminKey }}
          - key: admin-api-keys
            path: admin-api-keys
          {{- end }}
    {{- end }}
    {{- if and (not $worker) $v.router.httpsSecret }}
    - name: https
      secret:
        secretName: {{ $v.router.httpsSecret }}
        defaultMode: 0440
    {{- end }}
    {{- with $r.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $r.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $r.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $r.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $r.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* A worker resource's RDMA opt-ins, each acknowledged to the policy linter on the resource that has it (empty
without them). */}}
{{- define "pdspark.rdmaOptIns" -}}
{{- if or .Values.mooncake.hostNetwork .Values.mooncake.ipcLock -}}
annotations:
  {{- if .Values.mooncake.hostNetwork }}
  checkov.io/skip1: CKV_K8S_19=mooncake.hostNetwork is on (RDMA NICs outside the pod network)
  {{- end }}
  {{- if .Values.mooncake.ipcLock }}
  checkov.io/skip2: CKV_K8S_25=mooncake.ipcLock adds IPC_LOCK (RDMA memory registration pins pages)
  {{- end }}
{{- end -}}
{{- end -}}
