{{/* One pod template for the master and the workers. */}}
{{- define "example.pod" -}}
{{- $fr := .Subcharts.frexporter -}}
metadata:
  labels:
    {{- include "frexporter.podLabels" $fr | nindent 4 }}
spec:
  securityContext:
    runAsNonRoot: true
    runAsUser: {{ .Values.uid }}
    runAsGroup: {{ .Values.uid }}
    # The spool's group (frexporter's spool.groupMode): the emptyDir belongs to it.
    fsGroup: {{ .Values.spoolGroup }}
  initContainers:
    # Native sidecar (Kubernetes 1.29+): starts before the trainer, stops after it.
    {{- include "frexporter.sidecar" $fr | nindent 4 }}
  containers:
    - name: pytorch
      image: {{ .Values.image }}
      # The recorder in every rank, no code change; torchrun reads PET_* from the operator.
      command: ["frexporter", "run", "--", "torchrun", "/workspace/train.py"]
      env:
        {{- include "frexporter.trainingEnv" $fr | nindent 8 }}
      volumeMounts:
        {{- include "frexporter.spoolVolumeMount" $fr | nindent 8 }}
      resources:
        limits:
          nvidia.com/gpu: {{ .Values.gpusPerNode }}
  volumes:
    {{- include "frexporter.spoolVolume" $fr | nindent 4 }}
{{- end }}
