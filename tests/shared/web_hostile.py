"""What both halves of test_web_hostile.py use: raw HTTP requests, /metrics name selections, an exporter
whose snapshot stays the same, and a web config file."""

from __future__ import annotations

import http.client
import ssl
from pathlib import Path
from typing import Any

from frexporter import naming as n
from tests import spoolgen
from tests.harness import wait_for

SELECTION = (n.RANK_UP, n.PG_LAST_COMPLETED_SEQ)


def get(port: int, path: str, method: str = "GET", ctx: ssl.SSLContext | None = None,
         **headers: str) -> tuple[int, dict[str, str], bytes]:
    conn = (http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30) if ctx is not None
            else http.client.HTTPConnection("127.0.0.1", port, timeout=30))
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def query(names: tuple[str, ...] | list[str]) -> str:
    return "/metrics?" + "&".join(f"name[]={name}" for name in names)


def settled(tmp_path: Path, exporter_factory: Any, ranks: int = 4, **kw: Any) -> Any:
    """An exporter whose snapshot stays the same for the whole test (after the poll loop's first poll)."""
    for rank in range(ranks):
        spoolgen.write_rank(tmp_path, "job", rank, pgs=3)
    exp = exporter_factory(tmp_path, poll_interval=3600, **kw)
    wait_for(lambda: exp.app.exporter.polls >= 2, timeout=10, what="the poll loop's first poll")
    return exp


def write_web_config(d: Path, text: str) -> Path:
    path = d / "web.yml"
    path.write_text(text)
    return path
