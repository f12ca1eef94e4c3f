"""Pure: parsed dumps -> what the verdicts read: each rank's PG states, each group's history, and ``now``.

Which global ranks make up each rank's group of a given name (``memberships``), every collective each rank
recorded per cross-rank group (``histories``), each rank's PG states with a completion one rank saw settled
on the others (``rank_states``), and when the dumps were written (``dump_time``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

from frexporter.analysis import history
from frexporter.fr import trace
from frexporter.fr.domain import inflight_collective, translate
from frexporter.model import RANK_OK, PGState, RankList, RankState
from frexporter.postmortem.dumpfiles.decoding import RankDump
from frexporter.spool import MAX_RANK

Membership = dict[tuple[int, str], tuple[int, ...]]  # (rank, PG name) -> the PG's global ranks


# pg_config's "ranks" as torch writes it (``str`` of a list of ints). Matched rather than json.loads'ed: the text
# is the dump's (up to trace.MAX_CONFIG_CHARS), and nested brackets would recurse past the stack.
_RANK_LIST = re.compile(r"\[\s*[0-9]{1,10}(?:\s*,\s*[0-9]{1,10})*\s*\]")


def _declared(cfg: object) -> tuple[int, ...] | None:
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("ranks")
    if not isinstance(text, str) or _RANK_LIST.fullmatch(text) is None:
        return None
    ranks = {int(r) for r in text[1:-1].split(",")}
    return tuple(sorted(ranks)) if max(ranks) <= MAX_RANK else None


def memberships(dumps: Iterable[RankDump]) -> Membership:
    """Each rank's view of each PG name it recorded: the global ranks of *its* group of that name.

    A name alone does not identify a group: ``split_group`` (and any layout of disjoint groups created in the
    same order) gives several groups one name, so the identity is the name plus the ranks. A rank's own
    ``pg_config`` says which; without one (gloo's is broken in torch 2.8-2.13: one ``''`` key), the one set
    another rank declares for that name with this rank in it; else every rank that recorded the name (WORLD:
    every rank), less those declared in a same-named group without this rank. With no ``pg_config`` at all,
    same-named groups cannot be told apart.
    """
    dumps = list(dumps)
    declared: dict[tuple[int, str], tuple[int, ...]] = {}
    by_name: dict[str, set[tuple[int, ...]]] = {}
    for d in dumps:
        for name, cfg in d.dump.pg_config.items():
            ranks = _declared(cfg) if name else None
            if ranks is not None:
                declared[(d.rank, str(name))] = ranks
                by_name.setdefault(str(name), set()).add(ranks)
    seen: dict[str, set[int]] = {}
    for d in dumps:
        for entry in d.dump.entries:
            seen.setdefault(entry.pg_name, set()).add(d.rank)
    all_ranks = tuple(sorted(d.rank for d in dumps))
    out: Membership = {}
    for name, recorded_by in seen.items():
        for rank in recorded_by:
            own = declared.get((rank, name))
            if own is None:
                sets = by_name.get(name, set())
                holding = [r for r in sets if rank in r]
                # Ranks declared in a same-named group without this rank are not in this one.
                elsewhere = {r for ranks in sets if rank not in ranks for r in ranks}
                own = (
                    holding[0]
                    if len(holding) == 1
                    else all_ranks
                    if name == "0" and not sets
                    else tuple(sorted(recorded_by - elsewhere))
                )
            out[(rank, name)] = own
    return out


def with_pg_ids(dump: trace.FrDump) -> trace.FrDump:
    """Entries without a ``pg_id`` (torch before 2.5, hand-made dumps) grouped by their PG name instead:
    one id per name, negative so that it never collides with a real id (those count up from 0)."""
    if all(e.pg_id >= 0 for e in dump.entries):
        return dump
    ids: dict[str, int] = {}
    entries = tuple(
        e if e.pg_id >= 0 else replace(e, pg_id=ids.setdefault(e.pg_name, -2 - len(ids))) for e in dump.entries
    )
    return replace(dump, entries=entries)


def histories(dumps: list[RankDump], job_id: str = "dump") -> list[history.GroupHistory]:
    """Every collective each rank recorded, per cross-rank group, for judging what already happened."""
    members = memberships(dumps)
    Recorded = dict[int, list[history.Recorded]]
    groups: dict[tuple[str, tuple[int, ...]], tuple[str, Recorded, Recorded]] = {}  # desc, collectives, p2p
    for d in sorted(dumps, key=lambda d: d.rank):
        by_pg: dict[int, list[trace.FrEntry]] = {}
        for entry in with_pg_ids(d.dump).entries:
            by_pg.setdefault(entry.pg_id, []).append(entry)
        for entries in by_pg.values():
            entries.sort(key=lambda e: e.record_id)
            name = entries[-1].pg_name
            key = (name, members.get((d.rank, name), (d.rank,)))
            ranks = groups.setdefault(key, (entries[-1].pg_desc, {}, {}))
            ranks[1][d.rank] = [
                history.Recorded(inflight_collective(e), e.done, e.state == "completed")
                for e in entries if not e.is_p2p
            ]
            ranks[2][d.rank] = [
                history.Recorded(replace(inflight_collective(e), seq=e.p2p_seq_id), e.done, e.state == "completed")
                for e in entries
                if e.is_p2p
            ]
    return [
        history.GroupHistory(
            job_id=job_id,
            name=name,
            desc=desc,
            members=ranks_of,
            entries={r: tuple(v) for r, v in per_rank.items()},
            p2p={r: tuple(v) for r, v in p2p.items() if v},
        )
        for (name, ranks_of), (desc, per_rank, p2p) in sorted(groups.items())
    ]


def rank_states(dumps: list[RankDump], job_id: str = "dump") -> tuple[RankState, ...]:
    members = memberships(dumps)
    states = []
    for d in sorted(dumps, key=lambda d: d.rank):
        pgs = []
        for view in translate(with_pg_ids(d.dump)).values():
            if not view.name:
                continue  # pg_status of a group whose entries all left the ring: no name to give it
            pgs.append(
                PGState(
                    name=view.name,
                    desc=view.desc,
                    ranks=members.get((d.rank, view.name), ()),
                    backend="",
                    last_enqueued=view.enqueued,
                    last_started=view.started,
                    last_completed=view.completed,
                    inflight=view.inflight,
                    inflight_count=max(0, view.enqueued - view.completed),
                    timeout_seconds=view.timeout_seconds,
                    last_progress=None,
                    exact=view.known,
                    has_p2p=view.has_p2p,
                )
            )
        states.append(
            RankState(
                job_id=job_id,
                rank=d.rank,
                local_rank=-1,
                world_size=len(dumps),
                hostname="",
                pid=0,
                torch_version="",
                gpu_uuid="",
                status=RANK_OK,
                heartbeat=None,
                heartbeat_age=None,
                socket_alive=None,
                pgs=tuple(sorted(pgs, key=lambda p: p.name)),
                message=d.path,
            )
        )
    return settle_completion_lag(tuple(states))


def settle_completion_lag(states: tuple[RankState, ...]) -> tuple[RankState, ...]:
    """A collective any rank completed is complete on every rank that enqueued it.

    gloo wakes the caller before its worker thread marks the work completed and retired, so a dump taken
    right after a blocking collective can show it still in flight on some ranks while a peer shows it done.
    A collective completes nowhere until every rank has joined it, so one rank's completion proves that no
    one is stuck on it. Left alone, the lagging ranks' frontier would be a collective that is over, hiding
    the real hang behind it (with two lagging ranks of three, "every other rank" would not be enough).
    A rank that truly lags (NCCL: peers saw the kernel finish, it did not) is reported by ``history``.
    """
    done: dict[tuple[str, RankList], list[int]] = {}
    for state in states:
        for pg in state.pgs:
            done.setdefault((pg.name, pg.ranks), []).append(pg.last_completed)
    out = []
    for state in states:
        pgs = []
        for pg in state.pgs:
            settled = min(max(done[(pg.name, pg.ranks)]), pg.last_enqueued)
            if settled > pg.last_completed:
                inflight = tuple(e for e in pg.inflight if e.seq > settled)
                pg = replace(
                    pg, last_completed=settled, inflight=inflight, inflight_count=max(0, pg.last_enqueued - settled)
                )
            pgs.append(pg)
        out.append(replace(state, pgs=tuple(pgs)))
    return tuple(out)


def dump_time(dumps: list[RankDump]) -> float:
    """'Now' for a post-mortem: when the dumps were written (the newest file, or newest entry if later).

    File times come from a coarse kernel clock (a few ms behind), so a dump written right after its last
    collective can carry an mtime older than that collective's creation; the entries bound it from below.
    """
    newest_entry = max((e.time_created_ns / 1e9 for d in dumps for e in d.dump.entries), default=0.0)
    return max([d.mtime for d in dumps] + [newest_entry], default=0.0)
