"""Outputs: views of one NodeSnapshot (Prometheus, OTLP, JSON API, HTML). They compute nothing new."""
