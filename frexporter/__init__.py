"""frexporter: which rank of which process group is stuck on which collective, before the watchdog fires."""

from __future__ import annotations

__version__ = "0.1.0"
