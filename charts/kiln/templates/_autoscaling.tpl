{{/* The autoscaling rules as a Prometheus rules file: the one source of the PrometheusRule,
the rules ConfigMap and files/kiln-autoscaling.rules.yaml (`make rules`; a test compares).
Nothing in it depends on the release, so every install with default values gets that file. */}}
{{- define "kiln.autoscalingRules" -}}
{{- $r := .Values.autoscaling.rules -}}
{{- $gpu := $r.gpuUtilizationMetric -}}
{{- $c := $r.containerConcurrency -}}
# Kiln's autoscaling rules (a Prometheus rules file), rendered from the kiln chart's
# templates/_autoscaling.tpl. The alerts go to Kiln's receiver (docs/operations.md).
groups:
  - name: kiln-autoscaling
    {{- with $r.interval }}
    interval: {{ . }}
    {{- end }}
    rules:
      # A model's utilization (0..1) averaged over its pods over rateWindow: the GPU's, or a CPU
      # pod's bottleneck (engine, front ends or CPU limit), or its concurrency
      # (kiln.utilizationExpr says which).
      - record: kiln:utilization:ratio
        expr: |
          {{- include "kiln.utilizationExpr" (dict "gpu" $gpu "window" $r.rateWindow "concurrency" $c) | nindent 10 }}
      # The same over the short surgeWindow, for KilnUtilizationSurge alone.
      - record: kiln:utilization_short:ratio
        expr: |
          {{- include "kiln.utilizationExpr" (dict "gpu" $gpu "window" $r.surgeWindow "concurrency" $c) | nindent 10 }}
      # The target exists only for models with autoscaling enabled, so the others never fire.
      # `max by` keeps one target per model if the operator is scraped twice.
      - alert: KilnUtilizationHigh
        expr: |
          kiln:utilization:ratio
            > on (namespace, model) max by (namespace, model) (kiln_autoscaling_target_ratio)
        for: {{ $r.highFor }}
        labels:
          kiln_autoscaling: "true"
        annotations:
          summary: {{ `'{{ $labels.namespace }}/{{ $labels.model }}: utilization {{ $value | humanizePercentage }} is above its target'` }}
          description: {{ printf "'Utilization stayed above spec.autoscaling.targetGPUUtilization for %s; Kiln scales the model up within its bounds.'" $r.highFor }}
          value: {{ `'{{ $value }}'` }}
      # Far above the target on the short window (over surgeFactor x the target, or over
      # surgeCeiling where that is lower: a target of 70% cannot double) fires after surgeFor,
      # at once by default: Knative's panic mode. A load step reaches a new replica in seconds,
      # not after highFor; the operator scales up on it as on High, within the same cooldown.
      - alert: KilnUtilizationSurge
        expr: |
          kiln:utilization_short:ratio
            > on (namespace, model) clamp_max({{ $r.surgeFactor }} * max by (namespace, model) (kiln_autoscaling_target_ratio), {{ $r.surgeCeiling }})
          and on (namespace, model)
          kiln:utilization_short:ratio
            > on (namespace, model) max by (namespace, model) (kiln_autoscaling_target_ratio)
        for: {{ $r.surgeFor }}
        labels:
          kiln_autoscaling: "true"
        annotations:
          summary: {{ `'{{ $labels.namespace }}/{{ $labels.model }}: utilization {{ $value | humanizePercentage }} is far above its target'` }}
          description: {{ printf "'Utilization over the last %s is above %v x spec.autoscaling.targetGPUUtilization (or %v where that is lower); Kiln scales the model up within its bounds now.'" $r.surgeWindow $r.surgeFactor $r.surgeCeiling }}
          value: {{ `'{{ $value }}'` }}
      - alert: KilnUtilizationLow
        expr: |
          kiln:utilization:ratio
            < on (namespace, model) ({{ $r.lowFraction }} * max by (namespace, model) (kiln_autoscaling_target_ratio))
        for: {{ $r.lowFor }}
        labels:
          kiln_autoscaling: "true"
        annotations:
          summary: {{ `'{{ $labels.namespace }}/{{ $labels.model }}: utilization {{ $value | humanizePercentage }} is well below its target'` }}
          description: {{ printf "'Utilization stayed below %v x spec.autoscaling.targetGPUUtilization for %s; Kiln scales the model down after its stabilization window.'" $r.lowFraction $r.lowFor }}
          value: {{ `'{{ $value }}'` }}
      # No utilization for a model that autoscales (its pods are not scraped, or are gone):
      # Kiln holds its size, so a monitoring gap never reads as zero load.
      - alert: KilnUtilizationMissing
        expr: |
          max by (namespace, model) (kiln_autoscaling_target_ratio)
            unless on (namespace, model) kiln:utilization:ratio
        for: {{ $r.missingFor }}
        labels:
          kiln_autoscaling: "true"
        annotations:
          summary: {{ `'{{ $labels.namespace }}/{{ $labels.model }}: no utilization data'` }}
          description: {{ printf "'No utilization for %s (the value is the target); Kiln holds the model at its current size.'" $r.missingFor }}
          value: {{ `'{{ $value }}'` }}
{{- end -}}

{{/* A model's utilization (0..1) averaged over its pods, rates over .window. With
.concurrency > 0 (Knative's container concurrency): the requests in flight per pod over it.
Else the GPU's where its engine runs on a GPU (kiln_model_info's target is not cpu; a CPU model
never takes a GPU series, even one an older runtime exported because its pod could see a GPU);
else, per pod, its bottleneck: the highest of the engine's busy fraction, the front ends' (their
event loops parse HTTP and decode tensors) and the pod's CPU over its limit, on CPU engines
(the engine's alone on a GPU engine without a GPU metric, and from a runtime without them). */}}
{{- define "kiln.utilizationExpr" -}}
{{- if gt (float64 .concurrency) 0.0 -}}
avg by (namespace, model) (
  sum by (namespace, pod, model) (avg_over_time(kiln_inflight_requests[{{ .window }}]))
) / {{ .concurrency }}
{{- else -}}
{{- if eq .gpu "kiln_gpu_utilization_ratio" -}}
avg by (namespace, model) (kiln_gpu_utilization_ratio and on (namespace, pod) kiln_model_info{target!="cpu"})
{{- else -}}
avg by (namespace, model) (
  {{ .gpu }}{{ if eq .gpu "DCGM_FI_DEV_GPU_UTIL" }} / 100{{ end }}
  * on (namespace, pod) group_left (model) max by (namespace, pod, model) (kiln_model_info{target!="cpu"})
)
{{- end }}
or
avg by (namespace, model) (clamp_max(max by (namespace, pod, model) (
  label_replace(rate(kiln_engine_busy_seconds_total[{{ .window }}]), "signal", "engine", "", "")
  or
  label_replace(max by (namespace, pod) (rate(kiln_pod_front_end_busy_seconds_total[{{ .window }}]))
    * on (namespace, pod) group_left (model) max by (namespace, pod, model) (kiln_model_info{target="cpu"}), "signal", "front_end", "", "")
  or
  label_replace(max by (namespace, pod) (rate(kiln_pod_cpu_seconds_total[{{ .window }}]))
    / on (namespace, pod) max by (namespace, pod) (kiln_pod_cpu_limit_cores > 0)
    * on (namespace, pod) group_left (model) max by (namespace, pod, model) (kiln_model_info{target="cpu"}), "signal", "cpu", "", "")
), 1))
{{- end }}
{{- end -}}

{{/* The Secret with the receiver's bearer token (key `token`). */}}
{{- define "kiln.alertTokenSecret" -}}
{{- default (printf "%s-alert-token" (include "kiln.fullname" .)) .Values.autoscaling.receiver.existingSecret -}}
{{- end -}}
