"""Series from a Prometheus answer read as an exporter wrote them, or counted out: integer labels parsed strictly,
values that no seq or timestamp can be refused, and each rank's series grouped by the exporter that sent them.

Pure: samples in (``{"metric": {...}, "value": [t, "v"]}``, as promclient.parse_query_response returns them),
plain data out.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from frexporter import naming as n
from frexporter import safetext
from frexporter.spool.limits import MAX_RANK

Sample = dict[str, Any]
RankKey = tuple[str, int]  # (job id, rank)
Source = tuple[tuple[str, str], ...]  # the labels that name the exporter which sent a series

MAX_SEQ = 2**53  # seqs and counts arrive as float64 values: whole numbers up to here are exact
EXAMPLE_CHARS = 64  # of a server's label value quoted in a problem line
# Integer labels the rebuild reads; a value that is not one is a series no exporter wrote.
_INT_LABELS = (n.L_RANK, n.L_LOCAL_RANK, n.L_WORLD_SIZE, n.L_SIZE, n.L_PID)
# Labels frexporter itself puts on rank and PG series. Whatever else a series carries (job, instance,
# pod, ... from the scrape target and relabelling) names the exporter that reported it.
_OWN_LABELS = frozenset({"__name__", *n.RANK_INFO_LABELS, *n.PG_INFO_LABELS, *n.RANK_ACTIVITY_LABELS})


@dataclass
class Skipped:
    """What was left out of the view, counted by reason with the first example: a hostile answer can hold half a
    million bad series, and a line each would bury the verdicts."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)
    series: int = 0  # of the counts, those that are series

    def add(self, reason: str, example: str, series: bool = True) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.examples.setdefault(reason, example)
        self.series += series

    def lines(self) -> list[str]:
        return [f"{count} {reason}, first: {safetext.printable(self.examples[reason])}"
                for reason, count in self.counts.items()]


def value(sample: Sample) -> float | None:
    """The sample's value; None also for NaN and infinities, which no seq, count or timestamp can be."""
    try:
        number = float(sample["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


@functools.lru_cache(maxsize=1 << 16)  # pure, and called per series with few distinct values (ranks, sizes)
def label_int(text: str) -> int | None:
    """A rank, size or pid label as an exporter writes it (str() of a C int): ASCII digits, no sign, no leading
    zero, at most MAX_RANK. int() takes far more ("٣", " 1", "1_0", "+2"), and would merge series that
    Prometheus keeps apart."""
    if not (text.isascii() and text.isdigit()) or len(text) > 10 or (text[0] == "0" and len(text) > 1):
        return None
    number = int(text)
    return number if number <= MAX_RANK else None


def int_label(text: str | None) -> int:
    """A screened integer label (see screened), -1 when absent."""
    number = None if text is None else label_int(text)
    return -1 if number is None else number


def is_count(number: float | None) -> bool:
    """Whether a seq or count value is one (a whole number from -1 up, exact in a float64)."""
    return number is None or (number.is_integer() and -1 <= number <= MAX_SEQ)


def _quoted(labels: dict[str, str], name: str) -> str:
    """``name="value" of metric``, cut: for a problem line (escaped there)."""
    return f'{name}="{labels.get(name, "")[:EXAMPLE_CHARS]}" of {labels.get("__name__", "?")[:EXAMPLE_CHARS]}'


def screened(samples: list[Sample], skipped: Skipped) -> list[Sample]:
    """The samples whose integer labels are ones (label_int); the others are counted in ``skipped``."""
    out = []
    for s in samples:
        labels = s["metric"]
        for name in _INT_LABELS:
            text = labels.get(name)
            if text is not None and label_int(text) is None:
                skipped.add(f"series with a {name} label that is not a whole number up to {MAX_RANK}",
                            _quoted(labels, name))
                break
        else:
            out.append(s)
    return out


def source(labels: dict[str, str]) -> Source:
    # The set difference first: a series has a few exporter labels among many of its own; zip and map keep the
    # rest in C (called for every series of a rank: 200,000 times at 32,768 ranks).
    names = sorted(labels.keys() - _OWN_LABELS)
    return tuple(zip(names, map(labels.__getitem__, names), strict=True))


def rank_key(labels: dict[str, str]) -> RankKey | None:
    job, rank = labels.get(n.L_JOB_ID), int_label(labels.get(n.L_RANK))
    return None if job is None or rank < 0 else (job, rank)


def by_source(samples: list[Sample]) -> dict[RankKey, dict[Source, Sample]]:
    """Rank key -> reporting exporter -> sample."""
    out: dict[RankKey, dict[Source, Sample]] = defaultdict(dict)
    for s in samples:
        key = rank_key(s["metric"])
        if key is not None:
            out[key][source(s["metric"])] = s
    return out


def newest_state(samples: list[Sample]) -> dict[RankKey, dict[Source, Sample]]:
    """Like by_source for the activity series, which carry the state as a label: one exporter exports one
    state per rank, but a state it left can linger in a query for a scrape; the newest begun is current."""
    out: dict[RankKey, dict[Source, Sample]] = defaultdict(dict)
    for s in samples:
        key, since = rank_key(s["metric"]), value(s)
        if key is None or since is None:
            continue
        exporter = source(s["metric"])
        held = out[key].get(exporter)
        if held is None or since > (value(held) or -math.inf):
            out[key][exporter] = s
    return out
