"""Reading a web config file: bounded in size, UTF-8, YAML (or JSON where PyYAML is missing), validated by
``config_parse``, and its TLS context built once so that a bad key or certificate fails at start-up.
"""

from __future__ import annotations

import json
import os
from typing import Any

from frexporter.web.config_model import WebConfig, WebConfigError
from frexporter.web.config_parse import parse

MAX_FILE_BYTES = 1024 * 1024


def load_web_config(path: str) -> WebConfig:
    """Read and validate a web config file; every problem is a WebConfigError naming ``path``."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise WebConfigError(f"web config {path}: {e.strerror or e}") from e
    if len(data) > MAX_FILE_BYTES:
        raise WebConfigError(f"web config {path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise WebConfigError(f"web config {path}: not UTF-8 text") from e
    config = parse(_load_yaml(text, path), base_dir=os.path.dirname(os.path.abspath(path)), path=path)
    if config.tls is not None:
        try:
            config.tls.build_context()  # a bad key or certificate fails now, not at the first scrape
        except WebConfigError as e:
            raise WebConfigError(f"web config {path}: {e}") from e
    return config


def _load_yaml(text: str, path: str) -> Any:
    try:
        import yaml
    except ImportError:
        try:
            return json.loads(text) if text.strip() else None
        except ValueError as e:
            raise WebConfigError(
                f"web config {path}: PyYAML is not installed, and the file is not JSON ({e}); "
                "pip install 'frexporter[auth]' or write the file as JSON"
            ) from e
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise WebConfigError(f"web config {path}: not valid YAML: {' '.join(str(e).split())}") from e
    except (ValueError, RecursionError) as e:  # e.g. an int of 5000 digits, or nesting thousands deep
        raise WebConfigError(f"web config {path}: cannot be read: {type(e).__name__}: {str(e)[:200]}") from e
