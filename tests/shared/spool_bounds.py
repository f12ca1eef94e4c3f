"""What both halves of test_spool_bounds.py use: a manifest written as the recorder writes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from frexporter import spool


def write_manifest(directory: Path, doc: dict[str, Any]) -> None:
    """Compact JSON, as the recorder writes it."""
    path = directory / (spool.rank_stem(doc["job_id"], doc["rank"]) + spool.MANIFEST_SUFFIX)
    data = json.dumps(doc, separators=(",", ":")).encode()
    assert len(data) <= spool.MAX_MANIFEST_BYTES, "under the byte limit: only the parsed-size bounds can stop it"
    path.write_bytes(data)
