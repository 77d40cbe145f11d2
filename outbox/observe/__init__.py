"""What the relay and the commands say about themselves: outages as a few log lines
(``conditions``), Prometheus metric types and their text format, OpenTelemetry spans
(``tracing``), and progress bars for long commands. Imports nothing of the project but its
errors, settings and events."""
