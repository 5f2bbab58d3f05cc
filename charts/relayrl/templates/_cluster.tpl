{{/*
What running on a real cluster needs: the run's identity, rendezvous and shutdown timing, the model volume's
access modes, and the pod-level knobs of GPU clusters. relayrl.validateCluster fails the render with a message.
*/}}

{{/* The run's output directory: <trainer.persistence.mountPath>/<run.id>, the same path on trainer and rollout. */}}
{{- define "relayrl.outputDir" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.trainer.persistence.mountPath) .Values.run.id }}
{{- end }}

{{/* The marker file the model-fill Job writes last; inference and trainer wait for it. */}}
{{- define "relayrl.modelReadyMarker" -}}
{{- printf "%s/.relayrl-model-ready" (trimSuffix "/" (toString .Values.config.model.path)) }}
{{- end }}

{{- define "relayrl.validateCluster" -}}
{{- $id := toString .Values.run.id }}
{{- if not $id }}
{{- fail "run.id is required (e.g. --set run.id=arith-001): it names the run's output directory, so a new id starts a new run and the same id resumes it; nothing resumes by accident" }}
{{- end }}
{{- if or (gt (len $id) 40) (not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $id)) }}
{{- fail (printf "run.id %q must be lower-case letters, digits and '-' (not first or last), at most 40 characters" $id) }}
{{- end }}
{{- if hasKey (default dict .Values.config.trainer) "after_finish" }}
{{- fail "config.trainer.after_finish is set by the chart (stay: a StatefulSet restarts a trainer that exits); remove it" }}
{{- end }}
{{- if ne (toString (dig "trainer" "checkpoint" "resume" "never" .Values.config)) "auto" }}
{{- fail "config.trainer.checkpoint.resume must be auto: a trainer pod that restarts (drain, eviction, crash) must continue its run, not start it over in the same directory (a new run is a new run.id)" }}
{{- end }}
{{- $t := .Values.trainer }}
{{- if lt (int $t.rendezvous.readTimeoutSeconds) (int $t.rendezvous.joinTimeoutSeconds) }}
{{- fail (printf "trainer.rendezvous.readTimeoutSeconds (%d) must be at least joinTimeoutSeconds (%d): a store call would give up before the pods are given up on" (int $t.rendezvous.readTimeoutSeconds) (int $t.rendezvous.joinTimeoutSeconds)) }}
{{- end }}
{{- if ge (int $t.shutdownTimeoutSeconds) (int $t.terminationGracePeriodSeconds) }}
{{- fail (printf "trainer.shutdownTimeoutSeconds (%d) must be less than trainer.terminationGracePeriodSeconds (%d): the kubelet would kill the agent before it ends its ranks" (int $t.shutdownTimeoutSeconds) (int $t.terminationGracePeriodSeconds)) }}
{{- end }}
{{- $m := .Values.models }}
{{- if not $m.createTiny }}
{{- $shared := or (has "ReadOnlyMany" $m.accessModes) (has "ReadWriteMany" $m.accessModes) }}
{{- if and (not $shared) (not $m.singleNode) }}
{{- fail (printf "models.accessModes %v: inference and %d trainer pod(s) mount the model volume at once, on any node; it needs ReadOnlyMany or ReadWriteMany (ReadWriteOnce fails with Multi-Attach across nodes), or models.singleNode true when all of them run on one node" $m.accessModes (int $t.nodes)) }}
{{- end }}
{{- if $m.fill.enabled }}
{{- if not (or (has "ReadWriteOnce" $m.accessModes) (has "ReadWriteMany" $m.accessModes)) }}
{{- fail (printf "models.fill writes the model volume: models.accessModes %v needs ReadWriteOnce or ReadWriteMany" $m.accessModes) }}
{{- end }}
{{- if eq (len (compact (list $m.fill.image $m.fill.url))) 1 | not }}
{{- fail "models.fill: set exactly one of models.fill.image and models.fill.url" }}
{{- end }}
{{- if and $m.fill.url (not (regexMatch "^[0-9a-f]{64}$" (toString $m.fill.sha256))) }}
{{- fail "models.fill.url needs models.fill.sha256 (64 hex digits): a download is installed only if it matches" }}
{{- end }}
{{- end }}
{{- else if $m.fill.enabled }}
{{- fail "models.fill needs models.createTiny false and models.volume (the volume to fill)" }}
{{- end }}
{{- end }}

{{/* Pod-level fields every relayrl pod shares, with the GPU-cluster knobs. (list $ svc) */}}
{{- define "relayrl.podCommon" -}}
{{- $ := index . 0 }}{{- $svc := index . 1 -}}
{{- $values := index $.Values $svc -}}
serviceAccountName: {{ include "relayrl.serviceAccountName" $ }}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- include "relayrl.podSecurityContext" $ | nindent 2 }}
terminationGracePeriodSeconds: {{ $values.terminationGracePeriodSeconds }}
{{- with $.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $values.schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- if $values.hostNetwork }}
{{- /* RDMA/NCCL over the host's interfaces; NetworkPolicy does not apply to host-network pods */}}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- with $values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- /* a constraint without a labelSelector spreads this component's pods */}}
  {{- range . }}
  - {{ toYaml (merge (deepCopy .) (dict "labelSelector" (dict "matchLabels" (include "relayrl.componentSelectorLabels" (list $ $svc) | fromYaml)))) | nindent 4 | trim }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Pod template labels: the component's labels, then podLabels (e.g. a Kueue queue). (list $ svc) */}}
{{- define "relayrl.podLabels" -}}
{{- $ := index . 0 }}{{- $svc := index . 1 -}}
{{- include "relayrl.componentLabels" (list $ $svc) }}
{{- with (index $.Values $svc).podLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The restricted container securityContext plus the service's capabilitiesAdd. (list $ svc) */}}
{{- define "relayrl.serviceSecurityContext" -}}
{{- $ := index . 0 }}{{- $svc := index . 1 -}}
{{- $sc := include "relayrl.containerSecurityContext" $ | fromYaml }}
{{- with (index $.Values $svc).capabilitiesAdd }}
{{- $_ := set $sc.capabilities "add" . }}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{/* inference and trainer: with models.fill, wait for the fill Job's marker before starting. */}}
{{- define "relayrl.waitModel" -}}
{{- if .Values.models.fill.enabled }}
- name: wait-model
  image: {{ include "relayrl.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["sh", "-c", "until [ -f \"$0\" ]; do echo waiting for the model-fill Job: $0; sleep 5; done", {{ include "relayrl.modelReadyMarker" . | quote }}]
  securityContext:
    {{- include "relayrl.containerSecurityContext" . | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: {{ .Values.models.mountPath }}
      readOnly: true
{{- end }}
{{- end }}
