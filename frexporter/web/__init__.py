"""The exporter's HTTP side: the server and its routes (``server``), TLS and basic auth from an
exporter-toolkit web config (``webconfig``)."""
