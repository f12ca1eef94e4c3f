"""The exporter's HTTP side: the server and its routes (``server``, the entry point), TLS, basic auth and the
rest of an exporter-toolkit web config (``webconfig``, the entry point); each names the modules that hold its
parts."""
