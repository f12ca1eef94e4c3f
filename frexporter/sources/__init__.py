"""Sources: everything the exporter reads from outside (rank spool files and sockets, NVML)."""
