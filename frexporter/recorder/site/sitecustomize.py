"""Installed on PYTHONPATH by `frexporter run`: every Python process of the job starts the recorder.

The recorder stays idle (no torch import) unless the process initializes a process group.
A sitecustomize that was already on the path is chained, so `frexporter run` never hides it.
"""

import os
import sys


def _frexporter_start() -> None:
    try:
        from frexporter.recorder import install

        install()
    except Exception as e:  # a launcher helper must never break the user's interpreter
        sys.stderr.write(f"frexporter: recorder not started: {e}\n")


def _chain_previous() -> None:
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_frexporter_chained_sitecustomize", candidate)
            if spec and spec.loader:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_frexporter_start()
_chain_previous()
