{{/* The request-outcome rules as a Prometheus rules file: the one source of the PrometheusRule
<fullname>-requests, its ConfigMap and files/kiln-requests.rules.yaml (`make rules`; a test
compares). Nothing in it depends on the release, so every install with default values gets
that file. */}}
{{- define "kiln.requestRules" -}}
{{- $r := .Values.monitoring.requestRules -}}
# Kiln's request-outcome rules (a Prometheus rules file), rendered from the kiln chart's
# templates/_requests.tpl (values monitoring.requestRules). The alert carries kiln_autoscaling:
# it goes to Kiln's receiver, and the operator reports it on the model (Degraded, reason
# RequestsRefused); it scales and rolls back nothing. docs/operations.md, "Requests refused".
groups:
  - name: kiln-requests
    rules:
      # The share of a model's requests (every pod, over {{ $r.window }}) that were refused:
      # malformed on arrival (bad_request) or well formed but refused by the engine
      # (refused); only while the model gets at least {{ $r.minRate }} requests a second,
      # so a trickle of bad requests fires nothing. The value is the share.
      - alert: KilnRequestsRefused
        expr: |
          (
              sum by (namespace, model) (increase(kiln_requests_total{outcome=~"bad_request|refused"}[{{ $r.window }}]))
            /
              sum by (namespace, model) (increase(kiln_requests_total[{{ $r.window }}]))
          ) > {{ $r.refusedRatio }}
          and on (namespace, model)
          sum by (namespace, model) (rate(kiln_requests_total[{{ $r.window }}])) >= {{ $r.minRate }}
        for: {{ $r.refusedFor }}
        labels:
          kiln_autoscaling: "true"
        annotations:
          summary: {{ `'{{ $labels.namespace }}/{{ $labels.model }}: {{ $value | humanizePercentage }} of requests refused'` }}
          description: {{ printf "'The share of the model''s requests refused in the last %s (outcome bad_request or refused) stayed above %v for %s: the clients'' inputs do not fit the model, or this version refuses them. Kiln reports it on the InferenceModel (condition Degraded, reason RequestsRefused).'" $r.window $r.refusedRatio $r.refusedFor }}
          value: {{ `'{{ $value }}'` }}
{{- end -}}
