"""`frexporter demo`: a local CPU job with an injected hang, watched by the exporter."""

from frexporter.demo.driver import run_demo

__all__ = ["run_demo"]
