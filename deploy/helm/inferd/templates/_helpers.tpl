{{/*
Names and labels. app.kubernetes.io/name is always "inferd" and component one of control,
gateway, replica, postgresql, redis: the replica pods the control creates carry the same
name/instance/component labels (managed-by: inferd), so the NetworkPolicies here select
them too. Never put managed-by or version in a selector.
*/}}
{{- define "inferd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains "inferd" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-inferd" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "inferd.selectorLabels" -}}
app.kubernetes.io/name: inferd
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "inferd.labels" -}}
{{ include "inferd.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "inferd.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "inferd.controlAddress" -}}
{{- printf "%s-control:%v" (include "inferd.fullname" .) .Values.control.port -}}
{{- end -}}

{{/* The gateways' URL for the job runner (https with TLS). */}}
{{- define "inferd.gatewayURL" -}}
{{- printf "%s://%s-gateway:%v" (ternary "https" "http" .Values.tls.enabled) (include "inferd.fullname" .) .Values.gateway.httpPort -}}
{{- end -}}

{{/* Secrets whose keys are the environment of every inferd pod, the chart's first. */}}
{{- define "inferd.envSecrets" -}}
{{- $names := list (printf "%s-env" (include "inferd.fullname" .)) -}}
{{- if .Values.existingSecret -}}{{- $names = append $names .Values.existingSecret -}}{{- end -}}
{{- toJson $names -}}
{{- end -}}

{{/* The Secrets replica pods get (kubernetes.env_from_secrets): no database or Redis
credentials, since replicas run users' model code. */}}
{{- define "inferd.replicaEnvSecrets" -}}
{{- $names := list (printf "%s-replica-env" (include "inferd.fullname" .)) -}}
{{- if .Values.replicas.existingSecret -}}{{- $names = append $names .Values.replicas.existingSecret -}}{{- end -}}
{{- toJson $names -}}
{{- end -}}

{{- define "inferd.envFrom" -}}
- configMapRef:
    name: {{ include "inferd.fullname" . }}-env
{{- range (include "inferd.envSecrets" . | fromJsonArray) }}
- secretRef:
    name: {{ . }}
{{- end }}
{{- end -}}

{{/* Volumes every inferd pod has: /data and /tmp (the root filesystem is read-only),
the settings file, and the TLS Secret on gateways. Argument: dict root, dataSizeLimit, tls. */}}
{{- define "inferd.volumes" -}}
- name: data
  emptyDir:
    sizeLimit: {{ .dataSizeLimit }}
- name: tmp
  emptyDir: {}
- name: config
  configMap:
    name: {{ include "inferd.fullname" .root }}-config
{{- if .tls }}
- name: tls
  secret:
    secretName: {{ .root.Values.tls.secretName }}
{{- end }}
{{- end -}}

{{- define "inferd.volumeMounts" -}}
- name: data
  mountPath: /data
- name: tmp
  mountPath: /tmp
- name: config
  mountPath: /etc/inferd/config.yaml
  subPath: config.yaml
  readOnly: true
{{- if .tls }}
- name: tls
  mountPath: /etc/inferd/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* Refuse values that cannot run, with the reason (helm install stops here). */}}
{{- define "inferd.validate" -}}
{{- if and (not .Values.postgresql.enabled) (not .Values.externalDatabase.url) (not .Values.existingSecret) -}}
{{- fail "inferd needs PostgreSQL on Kubernetes (its pods cannot share a SQLite file): set postgresql.enabled=true, or externalDatabase.url, or INFERD_DATABASE_URL in existingSecret" -}}
{{- end -}}
{{- if and (not .Values.redis.enabled) (not .Values.externalRedis.url) (not .Values.existingSecret) -}}
{{- fail "inferd needs Redis on Kubernetes (the job queue, cache and rate limits its pods share): set redis.enabled=true, or externalRedis.url, or INFERD_REDIS_URL and INFERD_QUEUE_URL in existingSecret" -}}
{{- end -}}
{{- if not (hasPrefix "s3://" .Values.artifactStore.url) -}}
{{- fail "inferd needs an S3-compatible artifact store on Kubernetes (replica pods fetch versions' files from it): set artifactStore.url=s3://bucket/prefix" -}}
{{- end -}}
{{- if and .Values.clusterToken (lt (len .Values.clusterToken) 16) -}}
{{- fail "clusterToken must have 16 characters or more" -}}
{{- end -}}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) -}}
{{- fail "tls.enabled needs tls.secretName (a kubernetes.io/tls Secret)" -}}
{{- end -}}
{{- if gt (len .Release.Name) 32 -}}
{{- fail "the release name must have 32 characters or less (it labels every replica pod: kubernetes.instance)" -}}
{{- end -}}
{{- end -}}

{{/* A generated secret that survives upgrades: the value in the live Secret if there
is one (lookup; `helm template` finds none), else random. Argument: dict root, secret, key, length. */}}
{{- define "inferd.keptRandom" -}}
{{- $live := lookup "v1" "Secret" .root.Release.Namespace .secret -}}
{{- if and $live $live.data (hasKey $live.data .key) -}}
{{- index $live.data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum .length -}}
{{- end -}}
{{- end -}}

{{/* NetworkPolicy parts: one role's pods, all inferd pods of the release, the egress rules. */}}
{{- define "inferd.peer" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: inferd
      app.kubernetes.io/instance: {{ .root.Release.Name }}
      app.kubernetes.io/component: {{ .component }}
{{- end -}}
{{- define "inferd.inferdPods" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: inferd
      app.kubernetes.io/instance: {{ .Release.Name }}
    matchExpressions:
      - key: app.kubernetes.io/component
        operator: In
        values: [control, gateway, replica]
{{- end -}}
{{- define "inferd.egress" -}}
egress:
  - ports:
      - {port: 53, protocol: UDP}
      - {port: 53, protocol: TCP}
  - to:
      - podSelector:
          matchLabels:
            app.kubernetes.io/name: inferd
            app.kubernetes.io/instance: {{ .Release.Name }}
  {{- with .Values.networkPolicy.egress.to }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}
