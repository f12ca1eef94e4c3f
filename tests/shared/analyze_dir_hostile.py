"""What both halves of test_analyze_dir_hostile.py use: dump directories of a job whose rank 2 never
joined all_reduce #3, files written under any name, a verdict.json nested too deeply, and a lone surrogate's
JSON escape."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from tests import fr_cases

SURROGATE_ESCAPE = re.compile(r"\\ud[89a-f][0-9a-f]{2}", re.IGNORECASE)


def missing_rank_dumps(desc: str = "default_pg", world: tuple[int, ...] = (0, 1, 2)) -> dict[int, dict[str, Any]]:
    """Ranks 0 and 1 of ``world`` wait in all_reduce #3, which rank 2 never joined (its dump is not there)."""
    pg = ("0", desc)
    cfg = fr_cases.config([("0", desc, world)])
    entries = [fr_cases.event("all_reduce", s, ((8,),), at=s, pg=pg) for s in (1, 2)]
    entries.append(fr_cases.event("all_reduce", 3, ((8,),), at=40, pg=pg, state="scheduled"))
    return {r: fr_cases.dump(r, entries, cfg) for r in (0, 1)}


def write_file(directory: Path, name: str | bytes, doc: object) -> Path:
    path = Path(os.fsdecode(os.path.join(os.fsencode(directory), os.fsencode(name))))
    path.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    os.utime(path, (fr_cases.DUMP_TIME, fr_cases.DUMP_TIME))
    return path


def dump_dir(directory: Path, desc: str = "default_pg") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, doc in missing_rank_dumps(desc).items():
        write_file(directory, f"trace_{rank}", doc)
    return directory


DEEP = b"[" * 100_000 + b"]" * 100_000
