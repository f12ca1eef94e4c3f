"""What both halves of test_snapshot_map.py use: a mapped snapshot document, and a writer of it."""

from __future__ import annotations

import json
from pathlib import Path

from frexporter import spool
from tests import spoolgen


def doc(counter: int = 1, **extra: object) -> dict[str, object]:
    return spoolgen.as_mapped(spoolgen.snapshot(100000, counter=counter, **extra))


def write(path: Path, document: dict[str, object]) -> spool.SnapshotMap:
    writer = spool.SnapshotMap(str(path))
    writer.write(json.dumps(document).encode())
    return writer
