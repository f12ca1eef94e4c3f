"""Outputs: views of one NodeSnapshot (Prometheus, OTLP, JSON API, HTML) and what the exporter does when a
verdict appears (a log line, an evidence bundle). They compute nothing the analysis already knows."""
