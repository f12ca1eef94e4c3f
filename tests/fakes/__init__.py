"""Scriptable stand-ins for the hardware and processes the exporter reads."""
