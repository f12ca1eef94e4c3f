#!/usr/bin/env python3
"""Run torch's Flight Recorder analyzer (fr_trace) over many dump directories in one process.

    python scripts/fr_trace_batch.py JOBS.json      # prints {"torch": version, "answers": [one per job]}

``JOBS.json`` is a list of ``{"id", "dir", "order"}``; ``order`` names the dump files in the order fr_trace
should see them (null: as read). Importing torch costs seconds; one process for every case keeps the
comparison fast. For each directory this makes the calls ``python -m torch.distributed.flight_recorder.fr_trace
DIR`` makes (``JobConfig().parse_args``, ``read_dir``, ``build_db``), with default flags, then reorders nothing
but the files: fr_trace reads them in ``os.walk`` order, which is the filesystem's, and its verdicts depend on
which rank's file comes first.

Each answer lists what fr_trace flagged: collectives with missing ranks, and collectives whose entries
failed its match, with the culprit ranks it named and its MatchState per rank (send and recv by their p2p
seq, collectives by their collective seq); or the exception that
aborted the run. Collectives it could not decide after an earlier mismatch of the same PG (no errors, no
missing ranks: fr_trace logs "No errors found") are not listed.

Needs torch. fr_trace formats log tables with ``tabulate`` when present and has no fallback for p2p
groups; a stand-in that only formats is installed when it is missing, so its absence cannot change an answer.
"""

from __future__ import annotations

import json
import logging
import sys
import types
from typing import Any


def _tabulate_stand_in() -> None:
    try:
        import tabulate  # noqa: F401
    except ModuleNotFoundError:
        module = types.ModuleType("tabulate")

        def tabulate_(rows: Any, headers: Any = None) -> str:
            return "\n".join(" | ".join(map(str, row)) for row in ([headers] if headers else []) + list(rows))

        module.tabulate = tabulate_  # type: ignore[attr-defined]
        sys.modules["tabulate"] = module


def _answer(db: Any) -> list[dict[str, Any]]:
    flagged = []
    for c in db.collectives:
        missing = sorted(int(r) for r in (c.missing_ranks or ()))
        errors = {int(r): m.type_of_mismatch.state.name
                  for r, m in (c.mismatch_collectives or {}).items() if m.type_of_mismatch is not None}
        if missing or errors:
            # A p2p op is known by its p2p seq; its collective seq is the last collective's.
            p2p = str(c.collective_name).rsplit(":", 1)[-1].startswith(("send", "recv"))
            seq = int(c.p2p_seq_id if p2p else c.collective_seq_id)
            flagged.append({"pg": str(c.group_id), "seq": seq, "op": str(c.collective_name),
                            "missing": missing, "errors": {str(r): s for r, s in sorted(errors.items())}})
    return flagged


def run(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    _tabulate_stand_in()
    import torch
    from torch.distributed.flight_recorder.components.builder import build_db
    from torch.distributed.flight_recorder.components.config_manager import JobConfig
    from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger
    from torch.distributed.flight_recorder.components.loader import read_dir

    FlightRecorderLogger().set_log_level(logging.CRITICAL)  # its report is the database, read below
    answers = []
    for job in jobs:
        try:
            args = JobConfig().parse_args([job["dir"]])
            details, version = read_dir(args)
            if job.get("order"):
                details = {name: details[name] for name in job["order"] if name in details} | details
            db = build_db(details, args, version)
            answers.append({"id": job["id"], "aborted": None, "flagged": _answer(db)})
        except Exception as e:  # fr_trace signals bad input with AssertionError, KeyError, ValueError...
            answers.append({"id": job["id"], "aborted": f"{type(e).__name__}: {e}"[:200], "flagged": []})
    return {"torch": torch.__version__.split("+")[0], "answers": answers}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        jobs = json.load(f)
    json.dump(run(jobs), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
