{{/*
Templates for YOUR training pods. Add this chart as a dependency of your chart and
include them with the dependency's context, .Subcharts.frexporter (docs/kubernetes.md,
examples/pytorchjob):

  metadata:
    labels:
      {{- include "frexporter.podLabels" .Subcharts.frexporter | nindent 6 }}
  spec:
    initContainers:
      {{- include "frexporter.sidecar" .Subcharts.frexporter | nindent 6 }}
    containers:
      - name: pytorch
        command: ["frexporter", "run", "--", "torchrun", ...]
        env:
          {{- include "frexporter.trainingEnv" .Subcharts.frexporter | nindent 10 }}
        volumeMounts:
          {{- include "frexporter.spoolVolumeMount" .Subcharts.frexporter | nindent 10 }}
    volumes:
      {{- include "frexporter.spoolVolume" .Subcharts.frexporter | nindent 6 }}

Each renders YAML list items (or map entries for podLabels) at column 0.
*/}}

{{/* The exporter as a native sidecar: one item for the pod's initContainers (sidecar mode only). */}}
{{- define "frexporter.sidecar" -}}
{{- if ne .Values.mode "sidecar" }}
{{- fail "frexporter.sidecar: set mode: sidecar in the frexporter values (in daemonset mode the node's DaemonSet already reads the training pods)" }}
{{- end }}
{{- include "frexporter.container" (dict "ctx" . "sidecar" true) }}
{{- end }}

{{/* Labels for the training pod: the Service and the PodMonitor select sidecar pods by them. */}}
{{- define "frexporter.podLabels" -}}
{{- if eq .Values.mode "sidecar" }}
{{- toYaml .Values.sidecar.podLabels }}
{{- end }}
{{- end }}

{{/* The spool volume: one item for the pod's volumes. emptyDir for a sidecar, the node's hostPath for a DaemonSet. */}}
{{- define "frexporter.spoolVolume" -}}
- name: {{ .Values.spool.volumeName }}
{{- if eq .Values.mode "sidecar" }}
  emptyDir:
    {{- with .Values.spool.emptyDir.medium }}
    medium: {{ . }}
    {{- end }}
    {{- with .Values.spool.emptyDir.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- else }}
  hostPath:
    path: {{ .Values.spool.hostPath | quote }}
    type: DirectoryOrCreate
{{- end }}
{{- if and .Values.evidence.enabled (eq .Values.mode "sidecar") }}
{{ include "frexporter.evidenceVolume" . }}
{{- end }}
{{- end }}

{{/* Evidence bundles: written by the exporter, whose spool mount is read-only. */}}
{{- define "frexporter.evidenceVolume" -}}
{{- if .Values.evidence.enabled }}
- name: {{ .Values.evidence.volumeName }}
  emptyDir:
    {{- with .Values.evidence.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}
{{- end }}

{{/* The spool mount: one item for the training container's volumeMounts (read-write: the recorder writes there). */}}
{{- define "frexporter.spoolVolumeMount" -}}
- name: {{ .Values.spool.volumeName }}
  mountPath: {{ .Values.spool.mountPath | quote }}
{{- end }}

{{/* The recorder's environment: items for the training container's env. */}}
{{- define "frexporter.trainingEnv" -}}
- name: FREXPORTER_DIR
  value: {{ include "frexporter.spoolDir" . | quote }}
{{- if .Values.spool.groupMode }}
{{ include "frexporter.spoolGroupEnv" . }}
{{- end }}
- name: FREXPORTER_SNAPSHOT_INTERVAL
  value: {{ toString .Values.recorder.snapshotInterval | quote }}
{{- if .Values.recorder.jobIdAnnotation }}
- name: FREXPORTER_JOB_ID
  valueFrom:
    fieldRef:
      fieldPath: {{ printf "metadata.annotations['%s']" .Values.recorder.jobIdAnnotation | quote }}
{{- else if .Values.recorder.jobIdLabel }}
- name: FREXPORTER_JOB_ID
  valueFrom:
    fieldRef:
      fieldPath: {{ printf "metadata.labels['%s']" .Values.recorder.jobIdLabel | quote }}
{{- end }}
{{ include "frexporter.podIdentityEnv" . }}
{{- end }}
