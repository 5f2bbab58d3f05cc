{{/*
Names. The full name is at most 40 characters, so that "<fullname>-trainer-headless" (a Service) and the
StatefulSets' pod names stay within Kubernetes' limits.
*/}}
{{- define "relayrl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "relayrl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<component>": the name of a component's workload and Service. Call with (list $ "inference"). */}}
{{- define "relayrl.componentName" -}}
{{- printf "%s-%s" (include "relayrl.fullname" (index . 0)) (index . 1) }}
{{- end }}

{{- define "relayrl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "relayrl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "relayrl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "relayrl.labels" -}}
helm.sh/chart: {{ include "relayrl.chart" . }}
{{ include "relayrl.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: relayrl
{{- end }}

{{/* Selector labels of one component. Call with (list $ "inference"). */}}
{{- define "relayrl.componentSelectorLabels" -}}
{{ include "relayrl.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "relayrl.componentLabels" -}}
{{ include "relayrl.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "relayrl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "relayrl.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "relayrl.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* repository:tag, or repository@digest when a digest is given. Call with an image block. */}}
{{- define "relayrl.pinnedImage" -}}
{{- if .digest }}{{ printf "%s@%s" .repository .digest }}{{ else }}{{ printf "%s:%s" .repository .tag }}{{ end }}
{{- end }}

{{/* The trainer's world size: one rank per process, nprocPerNode processes on each of nodes pods. */}}
{{- define "relayrl.worldSize" -}}
{{- mul (int .Values.trainer.nodes) (int .Values.trainer.nprocPerNode) }}
{{- end }}

{{- define "relayrl.redisExternal" -}}
{{- if or .Values.redis.external.url .Values.redis.external.existingSecret }}true{{ end }}
{{- end }}

{{/* The gRPC address of a service as the other pods reach it: its Service name and port (reward: its headless
Service, whose name resolves to every ready pod, for the reward client's round robin). (list $ "reward") */}}
{{- define "relayrl.address" -}}
{{- $ := index . 0 }}{{- $svc := index . 1 -}}
{{- printf "%s%s:%d" (include "relayrl.componentName" (list $ $svc)) (ternary "-pods" "" (eq $svc "reward")) (int (index $.Values $svc).port) }}
{{- end }}

{{/*
Refuse values that would contradict each other or what the chart sets itself; `helm install` fails with the
message instead of pods crash-looping on a config error.
*/}}
{{- define "relayrl.validate" -}}
{{- include "relayrl.validateCluster" . }}
{{- $cfg := .Values.config }}
{{- range $key := list "output_dir" }}
{{- if hasKey $cfg $key }}
{{- fail (printf "config.%s is set by the chart (trainer.persistence.mountPath); remove it" $key) }}
{{- end }}
{{- end }}
{{- if hasKey (default dict $cfg.redis) "url" }}
{{- fail "config.redis.url is set by the chart (the Redis StatefulSet, or redis.external.url / redis.external.existingSecret); remove it" }}
{{- end }}
{{- range $svc := list "inference" "reward" "rollout" "trainer" }}
{{- $server := dig $svc "server" dict $cfg }}
{{- range $key := list "host" "port" "address" }}
{{- if hasKey $server $key }}
{{- fail (printf "config.%s.server.%s is set by the chart (%s.port and the Service name); remove it" $svc $key $svc) }}
{{- end }}
{{- end }}
{{- end }}
{{- $world := int (include "relayrl.worldSize" .) }}
{{- $trainerCfg := default dict $cfg.trainer }}
{{- if or (hasKey $trainerCfg "world_size") (hasKey (default dict $trainerCfg.distributed) "world_size") }}
{{- fail (printf "config.trainer.distributed.world_size is set by the chart to trainer.nodes x trainer.nprocPerNode (%d); remove it" $world) }}
{{- end }}
{{- $groups := int (dig "trainer" "groups_per_step" 8 $cfg) }}
{{- if mod $groups $world }}
{{- fail (printf "config.trainer.groups_per_step (%d) must be divisible by the trainer's world size trainer.nodes x trainer.nprocPerNode (%d)" $groups $world) }}
{{- end }}
{{- $shard := int (dig "trainer" "distributed" "dp_shard" 1 $cfg) }}
{{- $p := .Values.trainer.persistence }}
{{- if and (gt $shard 1) (gt (int .Values.trainer.nodes) 1) (not $p.existingClaim) (not (and $p.enabled $p.shared)) }}
{{- fail (printf "config.trainer.distributed.dp_shard (%d) > 1 on trainer.nodes (%d) > 1: every rank writes its checkpoint shards into one folder and reads the others' on a resume, but each trainer pod has a volume of its own; set trainer.persistence.shared=true (one ReadWriteMany claim) or trainer.persistence.existingClaim (a claim every trainer pod can mount)" $shard (int .Values.trainer.nodes)) }}
{{- end }}
{{- $cuda := hasPrefix "cuda" (toString (dig "model" "device" "cpu" $cfg)) }}
{{- range $svc := list "inference" "trainer" }}
{{- if and $cuda (not (index $.Values $svc).gpu) }}
{{- fail (printf "config.model.device is cuda but %s.gpu is false: the pod would see no GPU" $svc) }}
{{- end }}
{{- if and (not $cuda) (index $.Values $svc).gpu }}
{{- fail (printf "%s.gpu is true but config.model.device is cpu: the GPU would sit idle" $svc) }}
{{- end }}
{{- end }}
{{- if and .Values.trainer.gpu (ne (toString (dig "model" "device" "cpu" $cfg)) "cuda") }}
{{- fail "with trainer.gpu, config.model.device must be cuda (each rank uses the GPU of its local rank), not cuda:N" }}
{{- end }}
{{- if and (not .Values.models.createTiny) (not .Values.models.volume) }}
{{- fail "models.createTiny is false, so models.volume must hold the model directory (config.model.path)" }}
{{- end }}
{{- if and .Values.redis.external.url .Values.redis.external.existingSecret }}
{{- fail "set one of redis.external.url and redis.external.existingSecret" }}
{{- end }}
{{- if regexMatch "^[a-z]+://[^/@]*@" .Values.redis.external.url }}
{{- fail "redis.external.url holds credentials, which would be written into the ConfigMap: put the URL in a Secret (redis.external.existingSecret) or the password alone (redis.external.existingSecretPasswordKey)" }}
{{- end }}
{{- if has (int .Values.inference.weightsPort) (list (int .Values.inference.port) (int .Values.inference.httpPort)) }}
{{- fail "inference.weightsPort must differ from inference.port and inference.httpPort (the NetworkPolicy admits only the trainer on it)" }}
{{- end }}
{{- range $key := list "replicas" "endpoints" }}
{{- if hasKey (default dict $cfg.inference) $key }}
{{- fail (printf "config.inference.%s is set by the chart (inference.replicas, and each replica's pod name); remove it" $key) }}
{{- end }}
{{- end }}
{{- $wsrv := dig "inference" "weights_server" dict $cfg }}
{{- range $key := list "host" "port" "address" }}
{{- if hasKey $wsrv $key }}
{{- fail (printf "config.inference.weights_server.%s is set by the chart (inference.weightsPort and the Service name); remove it" $key) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The run config the services load: values' `config` plus what the chart owns (output_dir, the Redis URL, each
server's bind address, port and Service address, the trainer's world size). Floats that Go prints in exponent
form without a decimal point ("1e-07") are rewritten as "1.0e-07", which YAML 1.1 (PyYAML) reads as a float.
*/}}
{{- define "relayrl.runConfig" -}}
{{- include "relayrl.validate" . }}
{{- $cfg := deepCopy .Values.config }}
{{- $_ := set $cfg "output_dir" (include "relayrl.outputDir" .) }}
{{- /* the run's name keys its Redis state (relayrl:<run.id>:...): a new run.id starts clean on a shared Redis */}}
{{- /* a config.name of older values files is replaced (deprecated: NOTES.txt says so) */}}
{{- $_ := set $cfg "name" (toString .Values.run.id) }}
{{- $redis := default dict $cfg.redis }}
{{- if .Values.redis.external.url }}
{{- $_ := set $redis "url" .Values.redis.external.url }}
{{- else if not .Values.redis.external.existingSecret }}
{{- $_ := set $redis "url" (printf "redis://%s:%d/0" (include "relayrl.componentName" (list . "redis")) (int .Values.redis.port)) }}
{{- end }}
{{- $_ := set $cfg "redis" $redis }}
{{- range $svc := list "inference" "reward" "rollout" "trainer" }}
{{- $section := default dict (index $cfg $svc) }}
{{- $server := default dict $section.server }}
{{- $_ := set $server "host" "0.0.0.0" }}
{{- $_ := set $server "port" (int (index $.Values $svc).port) }}
{{- $_ := set $server "address" (include "relayrl.address" (list $ $svc)) }}
{{- $_ := set $section "server" $server }}
{{- with (index $.Values $svc).httpPort }}
{{- $http := default dict $section.http }}
{{- $_ := set $http "host" "0.0.0.0" }}
{{- $_ := set $http "port" (int .) }}
{{- /* Host names the REST API answers (DNS rebinding guard): the configured ones (default localhost) and the
       Service's names; IP addresses (probes, Prometheus scraping pods) are always answered */}}
{{- $svcName := include "relayrl.componentName" (list $ $svc) }}
{{- $names := list $svcName (printf "%s.%s" $svcName $.Release.Namespace) (printf "%s.%s.svc" $svcName $.Release.Namespace) (printf "%s.%s.svc.cluster.local" $svcName $.Release.Namespace) }}
{{- $_ := set $http "allowed_hosts" (concat (default (list "localhost") $http.allowed_hosts) $names | uniq) }}
{{- $_ := set $section "http" $http }}
{{- end }}
{{- if eq $svc "inference" }}
{{- /* the port that accepts weight updates (UpdateWeights): only trainer pods may reach it (networkpolicy.yaml) */}}
{{- $wsrv := default dict $section.weights_server }}
{{- $_ := set $wsrv "host" "0.0.0.0" }}
{{- $_ := set $wsrv "port" (int $.Values.inference.weightsPort) }}
{{- $_ := set $wsrv "address" (printf "%s:%d" (include "relayrl.componentName" (list $ "inference")) (int $.Values.inference.weightsPort)) }}
{{- $_ := set $section "weights_server" $wsrv }}
{{- $replicas := int $.Values.inference.replicas }}
{{- if gt $replicas 1 }}
{{- /* each replica by its StatefulSet pod's stable name (inference.yaml's headless Service) */}}
{{- $name := include "relayrl.componentName" (list $ "inference") }}
{{- $endpoints := list }}
{{- range $i := until $replicas }}
{{- $host := printf "%s-%d.%s-pods" $name $i $name }}
{{- $endpoints = append $endpoints (dict "address" (printf "%s:%d" $host (int $.Values.inference.port)) "weights_address" (printf "%s:%d" $host (int $.Values.inference.weightsPort))) }}
{{- end }}
{{- $_ := set $section "endpoints" $endpoints }}
{{- end }}
{{- end }}
{{- $_ := set $cfg $svc $section }}
{{- end }}
{{- /* values written for the flat trainer keys of schema 1 keep working: such a key replaces the nested default
       of this chart's values.yaml (the loader moves it to its new place, with a warning naming that) */}}
{{- range $old, $new := dict "lr" (list "optimizer" "lr") "checkpoint_every" (list "checkpoint" "every") "resume" (list "checkpoint" "resume") }}
{{- if and (hasKey $cfg.trainer $old) (hasKey $cfg.trainer (first $new)) }}
{{- $_ := unset (index $cfg.trainer (first $new)) (last $new) }}
{{- end }}
{{- end }}
{{- $distributed := default dict $cfg.trainer.distributed }}
{{- $_ := set $distributed "world_size" (int (include "relayrl.worldSize" .)) }}
{{- $_ := set $cfg.trainer "distributed" $distributed }}
{{- /* a StatefulSet restarts whatever exits: a finished trainer stays up, idle, answering `finished` */}}
{{- $_ := set $cfg.trainer "after_finish" "stay" }}
{{- regexReplaceAll "(?m)^(\\s*[A-Za-z0-9_]+: |\\s*- )(-?[0-9]+)e([-+][0-9]+)$" (toYaml $cfg) "${1}${2}.0e${3}" }}
{{- end }}

{{- define "relayrl.configChecksum" -}}
{{- include "relayrl.runConfig" . | sha256sum }}
{{- end }}

{{/* Restricted container securityContext (Pod Security Standards "restricted"). */}}
{{- define "relayrl.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "relayrl.podSecurityContext" -}}
runAsNonRoot: true
{{- toYaml .Values.podSecurityContext | nindent 0 }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Environment of every relayrl container. (list $ component) */}}
{{- define "relayrl.env" -}}
{{- $ := index . 0 }}{{- $svc := index . 1 -}}
- name: HOME
  value: /tmp
- name: PYTHONUNBUFFERED
  value: "1"
- name: MPLCONFIGDIR
  value: /tmp/matplotlib
- name: HF_HUB_OFFLINE
  value: "1"
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- /* the config this pod was created for: `relayrl serve` refuses a mounted config that changed since */}}
- name: RELAYRL_CONFIG_SHA256
  value: {{ include "relayrl.configChecksum" $ | quote }}
{{- $creds := default (printf "%s-credentials" (include "relayrl.fullname" $)) $.Values.credentials.existingSecret }}
{{- if has $svc (list "rollout" "trainer") }}
- name: RELAYRL_CONTROL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $creds }}
      key: control-token
{{- end }}
{{- if has $svc (list "inference" "trainer") }}
- name: RELAYRL_WEIGHTS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $creds }}
      key: weights-token
{{- end }}
{{- /* RunCode (reward's sandbox for the python tool's programs): rollout calls it, reward checks it. A Secret of
       one's own may lack the key (made for an older chart): then RunCode is refused, as without a token. */}}
{{- if has $svc (list "reward" "rollout") }}
- name: RELAYRL_CODE_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $creds }}
      key: code-token
      {{- if $.Values.credentials.existingSecret }}
      optional: true
      {{- end }}
{{- end }}
{{- /* Redis: only rollout and trainer use it. The URL (no password) is in the ConfigMap, or, from an external
       Secret, in RELAYRL_REDIS_URL; the password in RELAYRL_REDIS_PASSWORD (redis.url_env / redis.password_env):
       environment only, never an argument. */}}
{{- if has $svc (list "rollout" "trainer") }}
{{- $ext := $.Values.redis.external }}
{{- if $ext.existingSecret }}
- name: RELAYRL_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $ext.existingSecret }}
      key: {{ $ext.existingSecretKey }}
{{- end }}
{{- if not (include "relayrl.redisExternal" $) }}
- name: RELAYRL_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $creds }}
      key: redis-password
{{- else if and $ext.existingSecret $ext.existingSecretPasswordKey }}
- name: RELAYRL_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $ext.existingSecret }}
      key: {{ $ext.existingSecretPasswordKey }}
{{- end }}
{{- end }}
{{- with (index $.Values $svc).extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Arguments after `relayrl`: serve <svc> <config>. No secret ever goes here (`ps` shows arguments, also
     after kubelet's $(VAR) expansion): credentials travel in the environment. (list $ svc) */}}
{{- define "relayrl.serveArgs" -}}
{{- $ := index . 0 }}{{- $svc := index . 1 -}}
{{- toJson (list "serve" $svc "/config/relayrl.yaml") }}
{{- end }}

{{/* Native gRPC probes of a service on its port, health service name relayrl.v1.<Name>Service. (list $ svc) */}}
{{- define "relayrl.grpcProbes" -}}
{{- $ := index . 0 }}{{- $svc := index . 1 -}}
{{- $values := index $.Values $svc }}
{{- $grpc := dict "grpc" (dict "port" (int $values.port) "service" (printf "relayrl.v1.%sService" (title $svc))) -}}
startupProbe:
  {{- toYaml (merge (deepCopy $grpc) $values.startupProbe) | nindent 2 }}
livenessProbe:
  {{- toYaml (merge (deepCopy $grpc) $values.livenessProbe) | nindent 2 }}
readinessProbe:
  {{- toYaml (merge (deepCopy $grpc) $values.readinessProbe) | nindent 2 }}
{{- end }}

{{/* Volumes every relayrl pod has: the config, /tmp. (list $ svc) */}}
{{- define "relayrl.commonVolumes" -}}
{{- $ := index . 0 -}}
- name: config
  configMap:
    name: {{ include "relayrl.componentName" (list $ "config") }}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "relayrl.commonVolumeMounts" -}}
- name: config
  mountPath: /config
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* The model volume and, for the demo model, the init container that creates it. */}}
{{- define "relayrl.modelVolume" -}}
- name: models
{{- if .Values.models.createTiny }}
  emptyDir: {}
{{- else }}
  {{- toYaml .Values.models.volume | nindent 2 }}
{{- end }}
{{- end }}

{{- define "relayrl.initModel" -}}
{{- if .Values.models.createTiny -}}
initContainers:
  - name: init-model
    image: {{ include "relayrl.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    args: ["init-model", "--out", {{ .Values.config.model.path | quote }}]
    env:
      - name: HOME
        value: /tmp
    securityContext:
      {{- include "relayrl.containerSecurityContext" . | nindent 6 }}
    volumeMounts:
      - name: models
        mountPath: {{ .Values.models.mountPath }}
      - name: tmp
        mountPath: /tmp
{{- else if .Values.models.fill.enabled -}}
initContainers:
  {{- include "relayrl.waitModel" . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod template annotations: the config checksum (pods roll when the run config changes) + podAnnotations. */}}
{{- define "relayrl.podAnnotations" -}}
{{- $ := index . 0 }}{{- $svc := index . 1 -}}
checksum/config: {{ include "relayrl.configChecksum" $ }}
{{- with (index $.Values $svc).podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Resources, with the GPU request when asked for. (list $ svc count) */}}
{{- define "relayrl.resources" -}}
{{- $ := index . 0 }}{{- $svc := index . 1 }}{{- $gpus := index . 2 -}}
{{- $res := deepCopy (default dict (index $.Values $svc).resources) }}
{{- if gt (int $gpus) 0 }}
{{- $limits := default dict $res.limits }}
{{- $_ := set $limits $.Values.gpuResourceName (int $gpus) }}
{{- $_ := set $res "limits" $limits }}
{{- $requests := default dict $res.requests }}
{{- $_ := set $requests $.Values.gpuResourceName (int $gpus) }}
{{- $_ := set $res "requests" $requests }}
{{- end }}
{{- toYaml $res }}
{{- end }}
