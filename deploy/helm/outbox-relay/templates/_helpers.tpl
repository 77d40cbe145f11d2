{{- define "outbox-relay.name" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "outbox-relay.kafkaConfig" -}}
{{- $items := list -}}
{{- range $k, $v := .Values.kafka.config -}}
{{- $items = append $items (printf "%s=%v" $k $v) -}}
{{- end -}}
{{- join "," $items -}}
{{- end -}}

{{/* Where events go, for the relays and for outbox verify: Kafka and the routes (from Secrets). */}}
{{- define "outbox-relay.sinkEnv" -}}
- name: OUTBOX_KAFKA_BOOTSTRAP
  value: {{ .Values.kafka.bootstrap | quote }}
{{- if .Values.kafka.configSecret.name }}
- name: OUTBOX_KAFKA_CONFIG
  valueFrom:
    secretKeyRef:
      name: {{ .Values.kafka.configSecret.name }}
      key: {{ .Values.kafka.configSecret.key }}
{{- else if .Values.kafka.config }}
- name: OUTBOX_KAFKA_CONFIG
  value: {{ include "outbox-relay.kafkaConfig" . | quote }}
{{- end }}
{{- if .Values.routesSecret.name }}
- name: OUTBOX_ROUTES
  valueFrom:
    secretKeyRef:
      name: {{ .Values.routesSecret.name }}
      key: {{ .Values.routesSecret.key }}
{{- end }}
{{- end -}}
