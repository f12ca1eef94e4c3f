"""What already happened, judged from whole FR dumps (pure): past mismatches and lagging ranks.

The verdict engine judges the frontier, the collective a process group is stuck at. A post-mortem has
more: every collective the ring buffers still hold. Two things there are worth a line of their own, and
neither is a hang:

- a *past mismatch*: a collective that completed although its ranks disagreed on it (a dtype or size
  that the backend did not check, e.g. one buffer of a coalesced broadcast). Its results are suspect.
  Entries are compared position by position at each seq (a coalesced group's entries in record order),
  with the same rules as the frontier (``matching``), only where at least one rank completed the seq.
- a *p2p wait*: a send or recv still in flight whose peer has posted no counterpart (pending sends of a to b
  are paired in order with pending recvs of b from a; what is left over waits for the peer, unless the
  peer already completed a counterpart created after it: then it is completion lag). Unlike the other two
  this is part of a hang: it becomes a finding for the verdict engine, so a rank that skipped a recv and
  went on into a collective is named as the one that went off order.
- a *lagging rank*: peers saw a collective finish (NCCL's ``completed`` state: the watchdog saw the
  kernel end) while this rank still has it in flight. gloo marks work done only by retiring it, a moment
  after the caller wakes; that race is not a lag, so only the ``completed`` state counts as evidence.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from frexporter.analysis.findings import Finding
from frexporter.analysis.matching import Mismatch, find_mismatch, self_problem
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
    # rank -> its send/recv entries in record order; their ``entry.seq`` is the p2p seq
    p2p: Mapping[int, tuple[Recorded, ...]] = field(default_factory=dict)


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


def _signature(e: InflightCollective) -> tuple[object, ...]:
    return e.op, e.input_sizes, e.output_sizes, e.input_dtypes, e.output_dtypes


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
            if len({_signature(e) for e in at.values()}) == 1 and self_problem(next(iter(at.values())), size) is None:
                continue  # the common case, identical and well-formed everywhere: no clustering needed
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


_P2P_OP = re.compile(r"^(send|recv) (\d+)(?:->|<-)(\d+)$")  # "send 0->1", "recv 1<-0" (group ranks)


def _peer(op: str, members: tuple[int, ...]) -> tuple[str, int] | None:
    """("send" or "recv", the peer's global rank); None for a recv from any source or a peer out of range."""
    match = _P2P_OP.match(op)
    if match is None or int(match.group(3)) >= len(members):
        return None
    return match.group(1), members[int(match.group(3))]


def p2p_waits(group: GroupHistory, observed: Iterable[int], now: float, stuck_after: float) -> list[Finding]:
    """One finding per rank whose oldest in-flight send or recv has no counterpart from its peer."""
    members = tuple(sorted(group.members))
    seen = set(observed)
    ops: dict[tuple[int, int, str], list[Recorded]] = {}  # (rank, peer, kind) -> its p2p ops, record order
    for rank, recorded in group.p2p.items():
        for r in recorded:
            peer = _peer(r.entry.op, members)
            if peer is not None:
                ops.setdefault((rank, peer[1], peer[0]), []).append(r)
    out = []
    for rank in sorted(group.p2p):
        for r in group.p2p[rank]:
            peer = _peer(r.entry.op, members)
            if r.done or peer is None:
                continue
            kind, other = peer
            mine = [x for x in ops[(rank, other, kind)] if not x.done]
            theirs = ops.get((other, rank, "recv" if kind == "send" else "send"), [])
            if mine.index(r) < sum(1 for x in theirs if not x.done):
                continue  # the peer posted its counterpart: both wait on the transfer itself
            if any(x.done and x.entry.created >= r.entry.created for x in theirs):
                continue  # the peer already finished one posted after this op: completion lag, not a wait
            e = r.entry
            out.append(Finding(
                job_id=group.job_id, pg=group.name, pg_desc=group.desc, members=members, seq=e.seq, op=e.op,
                since=e.created, timeout_seconds=e.timeout_seconds, stuck=now - e.created >= stuck_after,
                waiting=(rank,), missing=(other,) if other in seen else (), down=(),
                unobserved=() if other in seen else (other,), blockers=(other,), p2p=True))
            break  # a rank waits on its oldest op first
    return out
