"""What both halves of test_security.py use: a bcrypt password, web config files, HTTP requests that
report a status or a refused connection, and the ``frexporter`` command."""

from __future__ import annotations

import base64
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO, require_module

bcrypt = require_module("bcrypt", "bcrypt (the auth extra)")

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
PASSWORD = "correct horse"
# htpasswd writes $2y$; the Python bcrypt package writes $2b$. Both must work, as in exporter-toolkit.
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode().replace("$2b$", "$2y$", 1)


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "web.yml"
    path.write_text(text)
    return path


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def get(url: str, ctx: ssl.SSLContext | None = None, auth: str | None = None) -> tuple[int, str, Any]:
    request = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=ctx) as resp:
            return resp.status, resp.read().decode(), resp.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers


def refused(url: str, ctx: ssl.SSLContext | None = None) -> OSError:
    """The connection fails below HTTP: no status code at all."""
    try:
        with urllib.request.urlopen(url, timeout=10, context=ctx) as resp:
            pytest.fail(f"{url} answered {resp.status}")
    except urllib.error.HTTPError as e:
        pytest.fail(f"{url} answered HTTP {e.code}; the handshake should have failed")
    except OSError as e:  # URLError, ssl.SSLError, a reset or a closed connection
        return e
    raise AssertionError("unreachable")


def frexporter(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "frexporter", *args], capture_output=True, text=True, timeout=60,
                          env=ENV)
