"""Scriptable stand-ins for the hardware, processes and data the exporter reads: GPUs, worker servers, nodes of
ranks, rank states, snapshots and clocks."""
