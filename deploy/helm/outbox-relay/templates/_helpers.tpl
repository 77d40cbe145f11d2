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
