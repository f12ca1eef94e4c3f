"""What already happened, judged from whole FR dumps (pure): past mismatches and lagging ranks.

The verdict engine judges the frontier, the collective a process group is stuck at. A post-mortem has
more: every collective the ring buffers still hold. Two things there are worth a line of their own, and
neither is a hang:

- a *past mismatch*: a collective that completed although its ranks disagreed on it (a dtype or size
  that the backend did not check, e.g. one buffer of a coalesced broadcast). Its results are suspect.
  Entries are compared position by position at each seq (a coalesced group's entries in record order),
  with the same rules as the frontier (``matching``), only where at least one rank completed the seq.
- a *lagging rank*: peers saw a collective finish (NCCL's ``completed`` state: the watchdog saw the
  kernel end) while this rank still has it in flight. gloo marks work done only by retiring it, a moment
  after the caller wakes; that race is not a lag, so only the ``completed`` state counts as evidence.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from frexporter.analysis.matching import Mismatch, find_mismatch
from frexporter.model import InflightCollective

# The NCCL watchdog notices completion on its own loop (every 100 ms by default); a dump taken in that
# window shows a rank "behind" that is not. A lag shorter than this is left unsaid.
LAG_MIN_SECONDS = 1.0


@dataclass(frozen=True)
class Recorded:
    """One FR entry as one rank recorded it."""

    entry: InflightCollective
    done: bool  # completed or retired
    completed: bool  # the backend itself saw the work finish (NCCL's "completed" state)


@dataclass(frozen=True)
class GroupHistory:
    """One cross-rank process group (name and ranks) and the non-p2p entries each rank recorded for it."""

    job_id: str
    name: str
    desc: str
    members: tuple[int, ...]
    entries: Mapping[int, tuple[Recorded, ...]]  # rank -> entries in record order


@dataclass(frozen=True)
class PastMismatch:
    group: GroupHistory
    seq: int
    mismatch: Mismatch
    entries: Mapping[int, InflightCollective]  # the compared entry of each rank


@dataclass(frozen=True)
class Lag:
    """Ranks still in flight at collectives that peers of their group saw complete."""

    group: GroupHistory
    seq: int  # the oldest such collective of any lagging rank
    op: str
    since: float  # creation of the oldest lagging entry
    behind: Mapping[int, int]  # lagging rank -> how many collectives peers completed that it has not
    first: Mapping[int, int]  # lagging rank -> its oldest such seq
    ages: Mapping[int, float]  # lagging rank -> seconds its oldest such entry had been in flight at the dump
    peers: tuple[int, ...]  # ranks that completed the oldest one


def _by_seq(recorded: Iterable[Recorded]) -> dict[int, list[Recorded]]:
    out: dict[int, list[Recorded]] = {}
    for r in recorded:
        out.setdefault(r.entry.seq, []).append(r)
    return out


def past_mismatches(group: GroupHistory) -> list[PastMismatch]:
    """Collectives that completed (on some rank) although the ranks' entries disagree, at most one per seq."""
    per_rank = {rank: _by_seq(entries) for rank, entries in group.entries.items()}
    finished = {seq for seqs in per_rank.values() for seq, rs in seqs.items() if all(r.done for r in rs)}
    size = len(group.members) or None
    out = []
    for seq in sorted(finished):
        recorded = {rank: seqs[seq] for rank, seqs in per_rank.items() if seq in seqs}
        for i in range(max(len(rs) for rs in recorded.values())):
            at = {rank: rs[i].entry for rank, rs in recorded.items() if i < len(rs)}
            mismatch = find_mismatch({rank: (e,) for rank, e in at.items()}, size)
            if mismatch is not None:
                out.append(PastMismatch(group, seq, mismatch, at))
                break
    return out


def lagging(group: GroupHistory, now: float) -> Lag | None:
    per_rank = {rank: _by_seq(entries) for rank, entries in group.entries.items()}
    completed_by: dict[int, set[int]] = {}
    for rank, seqs in per_rank.items():
        for seq, rs in seqs.items():
            if all(r.completed for r in rs):
                completed_by.setdefault(seq, set()).add(rank)
    behind: dict[int, int] = {}
    first: dict[int, int] = {}
    ages: dict[int, float] = {}
    oldest: tuple[float, int, str] | None = None
    for rank, seqs in sorted(per_rank.items()):
        late = sorted(seq for seq, rs in seqs.items()
                      if not all(r.done for r in rs) and completed_by.get(seq, set()) - {rank})
        if not late:
            continue
        entry = seqs[late[0]][0].entry
        age = now - entry.created
        if age < LAG_MIN_SECONDS:
            continue
        behind[rank], first[rank], ages[rank] = len(late), late[0], age
        if oldest is None or (late[0], entry.created) < (oldest[1], oldest[0]):
            oldest = (entry.created, late[0], entry.op)
    if oldest is None:
        return None
    since, seq, op = oldest
    return Lag(group=group, seq=seq, op=op, since=since, behind=behind, first=first, ages=ages,
               peers=tuple(sorted(completed_by[seq])))
