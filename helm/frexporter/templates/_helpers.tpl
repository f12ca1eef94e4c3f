{{/*
Names, labels and the pieces shared by the DaemonSet and the sidecar.
Every template here takes the chart's own context: "." inside this chart, and
".Subcharts.frexporter" from a chart that depends on this one.
*/}}

{{- define "frexporter.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "frexporter.fullname" -}}
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

{{- define "frexporter.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "frexporter.selectorLabels" -}}
app.kubernetes.io/name: {{ include "frexporter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "frexporter.labels" -}}
helm.sh/chart: {{ include "frexporter.chart" . }}
{{ include "frexporter.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: frexporter
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of the pods that run an exporter: the DaemonSet's, or the training pods' in sidecar mode. */}}
{{- define "frexporter.exporterPodSelector" -}}
{{- if eq .Values.mode "sidecar" }}
{{- toYaml .Values.sidecar.podLabels }}
{{- else }}
{{- include "frexporter.selectorLabels" . }}
{{- end }}
{{- end }}

{{- define "frexporter.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "frexporter.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "frexporter.image" -}}
{{- $v := .Values.image }}
{{- if $v.digest }}
{{- printf "%s@%s" $v.repository $v.digest }}
{{- else }}
{{- printf "%s:%s" $v.repository (default .Chart.AppVersion $v.tag) }}
{{- end }}
{{- end }}

{{- define "frexporter.nvmlEnabled" -}}
{{- if kindIs "bool" .Values.exporter.nvml }}
{{- .Values.exporter.nvml }}
{{- else }}
{{- eq .Values.mode "daemonset" }}
{{- end }}
{{- end }}

{{/* The user id the exporter runs as; the hostPath spool is handed to it. 0 is a valid answer. */}}
{{- define "frexporter.runAsUser" -}}
{{- if hasKey .Values.securityContext "runAsUser" }}
{{- .Values.securityContext.runAsUser | int64 }}
{{- else }}
{{- 65532 }}
{{- end }}
{{- end }}

{{- define "frexporter.runAsGroup" -}}
{{- if hasKey .Values.securityContext "runAsGroup" }}
{{- .Values.securityContext.runAsGroup | int64 }}
{{- else }}
{{- include "frexporter.runAsUser" . }}
{{- end }}
{{- end }}

{{/* The group that shares the spool in group mode: spool.gid, else the exporter's group. */}}
{{- define "frexporter.spoolGid" -}}
{{- if kindIs "invalid" .Values.spool.gid }}
{{- include "frexporter.runAsGroup" . }}
{{- else }}
{{- .Values.spool.gid | int64 }}
{{- end }}
{{- end }}

{{/*
The spool directory (FREXPORTER_DIR). In sidecar mode a directory the recorder creates inside the
emptyDir: kubelet makes an emptyDir's root world-writable (2777 with an fsGroup), which the exporter's
permission check rightly reports; the recorder's own directory is 2770 (or 0700).
*/}}
{{- define "frexporter.spoolDir" -}}
{{- if eq .Values.mode "sidecar" }}
{{- printf "%s/spool" (trimSuffix "/" .Values.spool.mountPath) }}
{{- else }}
{{- .Values.spool.mountPath }}
{{- end }}
{{- end }}

{{/* FREXPORTER_SPOOL_GROUP for the recorder and the exporter alike: both sides must agree on the modes. */}}
{{- define "frexporter.spoolGroupEnv" -}}
- name: FREXPORTER_SPOOL_GROUP
  value: "1"
{{- end }}

{{/* Pod identity from the downward API, for the exporter and the training containers. */}}
{{- define "frexporter.podIdentityEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end }}

{{/*
The exporter container. Takes (dict "ctx" <chart context> "sidecar" <bool>); a sidecar is
a Kubernetes native sidecar (an init container with restartPolicy Always, 1.29+).
*/}}
{{- define "frexporter.container" -}}
{{- $ := .ctx }}
{{- $v := $.Values -}}
- name: frexporter
  image: {{ include "frexporter.image" $ | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- if .sidecar }}
  restartPolicy: Always
  {{- end }}
  args:
    - serve
    - --dir
    - {{ include "frexporter.spoolDir" $ | quote }}
    - --listen
    - {{ printf ":%d" (int $v.exporter.port) | quote }}
    - --poll-interval
    - {{ toString $v.exporter.pollInterval | quote }}
    - --stuck-after
    - {{ toString $v.exporter.stuckAfter | quote }}
    - --stuck-floor
    - {{ toString $v.exporter.stuckFloor | quote }}
    - --stuck-multiple
    - {{ toString $v.exporter.stuckMultiple | quote }}
    - --rank-timeout
    - {{ toString $v.exporter.rankTimeout | quote }}
    - --deep-interval
    - {{ toString $v.exporter.deepInterval | quote }}
    {{- if ne (include "frexporter.nvmlEnabled" $) "true" }}
    - --no-nvml
    {{- end }}
    - --evidence-dir
    - {{ if $v.evidence.enabled }}{{ $v.evidence.mountPath | quote }}{{ else }}""{{ end }}
    {{- range $v.exporter.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: FREXPORTER_DIR
      value: {{ include "frexporter.spoolDir" $ | quote }}
    {{- if $v.spool.groupMode }}
    {{- include "frexporter.spoolGroupEnv" $ | nindent 4 }}
    {{- end }}
    - name: FREXPORTER_LOG_LEVEL
      value: {{ $v.exporter.logLevel | quote }}
    {{- include "frexporter.podIdentityEnv" $ | nindent 4 }}
    {{- if and (not .sidecar) (eq (include "frexporter.nvmlEnabled" $) "true") }}
    # NVML for every GPU of the node through the NVIDIA container runtime; no privileges.
    - name: NVIDIA_VISIBLE_DEVICES
      value: all
    - name: NVIDIA_DRIVER_CAPABILITIES
      value: utility
    {{- end }}
    {{- with $v.exporter.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: metrics
      containerPort: {{ $v.exporter.port }}
      protocol: TCP
  {{- with $v.livenessProbe }}
  livenessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.readinessProbe }}
  readinessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $v.resources }}
  resources:
    {{- toYaml $v.resources | nindent 4 }}
  {{- else }}
  resources: {}
  {{- end }}
  {{- with $v.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: {{ $v.spool.volumeName }}
      mountPath: {{ $v.spool.mountPath | quote }}
      readOnly: true
    {{- if $v.evidence.enabled }}
    - name: {{ $v.evidence.volumeName }}
      mountPath: {{ $v.evidence.mountPath | quote }}
    {{- end }}
{{- end }}

{{/*
Relabelings shared by the ServiceMonitor and the PodMonitor: the pod, namespace and node
the exporter runs on become target labels (the operator adds pod and namespace itself;
node only comes from here), and the job label is fixed so FrexporterExporterDown finds it.
*/}}
{{- define "frexporter.relabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_name]
  targetLabel: pod
- sourceLabels: [__meta_kubernetes_namespace]
  targetLabel: namespace
- sourceLabels: [__meta_kubernetes_pod_node_name]
  targetLabel: node
- targetLabel: job
  replacement: {{ .Values.scrape.jobName }}
{{- with .Values.scrape.relabelings }}
{{ toYaml . }}
{{- end }}
{{- end }}
