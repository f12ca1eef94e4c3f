"""Optional dependencies ("extras"): the base install is the recorder and the CLI, standard library only.

The daemon's dependencies come with ``frexporter[serve]`` and OTLP's with ``frexporter[otlp]`` (see
pyproject.toml). A feature whose extra is missing raises :class:`MissingExtraError` before anything imports
the missing package, with the pip command that fixes it; the CLI prints that line and exits 2.
"""

from __future__ import annotations

import importlib.util

SERVE = "serve"
OTLP = "otlp"

# What each extra must make importable (import names, not distribution names).
MODULES: dict[str, tuple[str, ...]] = {
    SERVE: ("prometheus_client",),
    OTLP: ("opentelemetry.sdk",),
}


class MissingExtraError(ImportError):
    """A feature's optional dependency is not installed; the message names the pip command."""


def pip_command(extra: str) -> str:
    return f"pip install 'frexporter[{extra}]'"


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (only its parent packages)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def require(extra: str, feature: str) -> None:
    """Raise MissingExtraError unless everything ``feature`` needs from ``extra`` is installed."""
    missing = [m for m in MODULES[extra] if not installed(m)]
    if missing:
        raise MissingExtraError(f"{feature} needs the '{extra}' extra ({', '.join(missing)} is not installed): "
                                f"{pip_command(extra)}")
