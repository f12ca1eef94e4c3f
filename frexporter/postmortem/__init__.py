"""The post-mortem readers behind ``frexporter analyze``: FR dump files on disk (``dumpfiles``) and series
queried from Prometheus (``prometheus``) turned into rank states for the pure verdict engine; ``report``
runs the engine on them and renders the result."""
