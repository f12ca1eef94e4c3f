"""Phrasing for verdict summaries: one sentence an on-call engineer can act on (pure)."""

from __future__ import annotations

from collections.abc import Iterable

MAX_LISTED = 16  # rank tokens in a summary before the list is cut short


def seconds(value: float) -> str:
    return f"{max(0, round(value))}s"


def seconds_fine(value: float) -> str:
    """Sub-second precision where it matters: ``0s``, ``40ms``, ``1.5s``, ``12s``."""
    if value >= 10:
        return seconds(value)
    if value >= 0.1:
        return f"{value:.1f}s"
    if value >= 0.0005:
        return f"{round(value * 1000)}ms"
    return "0s"


def rank_list(ranks: Iterable[int]) -> str:
    """``0,1,2`` with runs of four or more folded (``4-7``); long lists end with the total."""
    values = sorted(set(ranks))
    tokens: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        if j - i >= 3:
            tokens.append(f"{values[i]}-{values[j]}")
        else:
            tokens.extend(str(v) for v in values[i:j + 1])
        i = j + 1
    if len(tokens) > MAX_LISTED:
        return ",".join(tokens[:MAX_LISTED]) + f",… ({len(values)} ranks)"
    return ",".join(tokens)


def who(ranks: Iterable[int], capital: bool = True) -> str:
    values = sorted(set(ranks))
    word = "Rank" if len(values) == 1 else "Ranks"
    return f"{word if capital else word.lower()} {rank_list(values)}"


def agree(ranks: Iterable[int], singular: str, plural: str) -> str:
    return singular if len(set(ranks)) == 1 else plural


def short_name(name: str) -> str:
    return name if len(name) <= 8 else name[:4] + "…"


def pg_text(name: str, desc: str) -> str:
    if desc and desc != "undefined":
        return f"PG '{desc}' ({short_name(name)})"
    return f"PG '{short_name(name)}'"


def collective(op: str, seq: int) -> str:
    if op.startswith(("send ", "recv ")):
        return f"{op} (p2p #{seq})"  # p2p ops count in their own sequence
    return f"{op or 'collective'} #{seq}"


def never_joined(op: str, seq: int) -> str:
    """'never joined all_reduce #42'; for a send or recv, the matching op the peer never posted."""
    if op.startswith(("send ", "recv ")):
        return f"never posted the {'recv' if op.startswith('send') else 'send'} matching {collective(op, seq)}"
    return f"never joined {collective(op, seq)}"


def exited_while(rank: int, host: str, waiting: Iterable[int], where: str) -> str:
    """'Rank 1 (host h, pid 7) exited while ranks 0,2 wait in all_reduce #11 on PG 'default_pg' (0)'."""
    values = sorted(set(waiting))
    if not values:
        return f"Rank {rank}{host} exited while its peers wait in {where}"
    return f"Rank {rank}{host} exited while {who(values, capital=False)} {agree(values, 'waits', 'wait')} in {where}"


def waited(ranks: Iterable[int], age: float | None, empty_subject: str | None = None) -> str:
    """'ranks 0,1 have waited 95s'; with no ranks, ``empty_subject`` (e.g. "they") waits instead."""
    values = sorted(set(ranks))
    if not values and empty_subject is None:
        return "nobody waits yet"
    subject = who(values, capital=False) if values else empty_subject
    single = len(values) == 1
    if age is None:
        return f"{subject} {'is' if single else 'are'} waiting"
    return f"{subject} {'has' if single else 'have'} waited {seconds(age)}"


def budget(age: float | None, timeout: float | None) -> str:
    if timeout is None:
        return "watchdog timeout unknown"
    if age is None:
        return f"the watchdog timeout is {seconds(timeout)}"
    left = timeout - age
    if left <= 0:
        return f"{seconds(-left)} past the {seconds(timeout)} watchdog timeout"
    return f"{seconds(left)} left before the {seconds(timeout)} watchdog timeout"


def also_blocking(pgs: Iterable[tuple[str, str]]) -> str:
    listed = [pg_text(name, desc) for name, desc in pgs]
    return f" (also blocking {', '.join(listed)})" if listed else ""


def absent_on_node(absent: Iterable[int], expected: Iterable[int], waiting: Iterable[int], age: float,
                   where: Iterable[str]) -> str:
    """rank_absent on a node: 'Rank 1 of this node never published (or vanished): ...'."""
    return (f"{who(absent)} of this node never published (or vanished): its launcher started "
            f"{who(expected, capital=False)} here; {waited(waiting, age)} in {' and '.join(sorted(where))}.")


def absent_in_world(absent: Iterable[int], job_id: str, reporting: int, world: int, waiting: Iterable[int]) -> str:
    """rank_absent over a whole job (Prometheus): 'Ranks 2,3 of job j report nothing: ...'."""
    absent, waiting = sorted(set(absent)), sorted(set(waiting))
    waiters = f"{who(waiting, capital=False)} {agree(waiting, 'waits', 'wait')}" if waiting else "no rank waits"
    return (f"{who(absent)} of job {job_id} {agree(absent, 'reports', 'report')} nothing: {reporting} of its "
            f"{world} ranks report; {waiters} for the rest.")
