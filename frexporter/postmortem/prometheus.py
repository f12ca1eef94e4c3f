"""A whole job's RankStates as Prometheus holds them: every query asked (fetch), then the ranks rebuilt from the
answers (promview.rebuild, pure).

What comes from the server is bounded before it costs anything: each query's whole exchange by one deadline
and the analysis's queries by another (here), each answer by its bytes and its series (promclient), member
lists by what they expand to over all jobs (promview). Series with a label or value no exporter writes are
left out and counted (``JobView.problems``), never guessed at.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from frexporter import naming as n
from frexporter import safetext
from frexporter.model import RankState
from frexporter.postmortem.promclient import (
    MAX_RESPONSE_BYTES,
    MAX_SERIES,
    QUERY_TIMEOUT_SECONDS,
    PrometheusError,
    parse_query_response,
    query,
)
from frexporter.postmortem.promseries import Sample
from frexporter.postmortem.promview import (
    ASKED_ONLY_WITH,
    LATER,
    MAX_EXPANDED_MEMBERS,
    MAX_WORLD_SIZE,
    OF_ACTIVE_PGS,
    STALE_HEARTBEAT_SECONDS,
    JobView,
    Query,
    pg_keys,
    rebuild,
    scrape_times_needed,
)

__all__ = [
    "ANALYZE_TIMEOUT_SECONDS",
    "MAX_EXPANDED_MEMBERS",
    "MAX_NAMED_PGS",
    "MAX_RESPONSE_BYTES",
    "MAX_SERIES",
    "MAX_WORLD_SIZE",
    "QUERIES_IN_FLIGHT",
    "QUERY_TIMEOUT_SECONDS",
    "STALE_HEARTBEAT_SECONDS",
    "JobView",
    "PrometheusError",
    "Query",
    "fetch",
    "job_view",
    "parse_query_response",
    "query",
    "rank_states",
    "rebuild",
    "servers",
]

# All queries of one analysis (up to 24 of them, on every server), so that a server answering each just in time
# cannot hold `frexporter analyze` for 24 times QUERY_TIMEOUT_SECONDS.
ANALYZE_TIMEOUT_SECONDS = 120.0
# Queries in flight at once, over all servers: while one answer is parsed here, a server computes the next (at
# 8,192 ranks the servers' part is about half of the time). A few: each holds up to MAX_RESPONSE_BYTES until it
# is parsed (one at a time, promclient), and a Prometheus busy with its rules is not crowded.
QUERIES_IN_FLIGHT = 4


# The most active PGs whose series are asked by name (a regular expression of their names in each query of
# OF_ACTIVE_PGS), and the longest that expression may be: past either, every PG's are asked. Prometheus matches an
# alternation of plain names as a set (4,096 names over a 32,768-rank job's 8,257 PGs: 0.3 s, as a plain
# selector); the bound keeps a hostile answer's millions of names out of the queries.
MAX_NAMED_PGS = 16384
MAX_NAMED_PG_CHARS = 256 << 10
_RE2_SPECIAL = frozenset("\\.+*?()|[]{}^$")


def _selector(job_id: str | None, pgs: Collection[str] = ()) -> str:
    """The job's series (all jobs' when ``job_id`` is None), of the PGs ``pgs`` names when it names any."""
    # PromQL strings take Go's escapes, of which JSON's are a subset; a job id with a quote or a
    # backslash would otherwise end the string early (a parse error) or select another job.
    matchers = [f"{n.L_JOB_ID}={json.dumps(job_id, ensure_ascii=False)}"] if job_id else []
    if pgs:
        matchers.append(f"{n.L_PG}=~{json.dumps(_alternatives(pgs), ensure_ascii=False)}")
    return "{" + ", ".join(matchers) + "}"


def _alternatives(names: Collection[str]) -> str:
    """A regular expression (RE2, anchored by Prometheus) that matches exactly ``names``."""
    return "|".join("".join("\\" + c if c in _RE2_SPECIAL else c for c in name) for name in sorted(names))


def _named_pgs(active: set[tuple[str, str]]) -> list[str] | None:
    """The names the per-rank queries select, or None for every PG (too many, or too long to name)."""
    names = sorted({pg for _, pg in active})
    if len(names) > MAX_NAMED_PGS or len(_alternatives(names)) > MAX_NAMED_PG_CHARS:
        return None
    return names


@dataclass
class _Asker:
    """Queries of one analysis, all within one deadline."""

    timeout: float
    deadline: float = 0.0

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.timeout

    def __call__(self, base_url: str, promql: str) -> list[Sample]:
        spent = f"{safetext.printable(base_url)}: the analysis's queries took more than {self.timeout:g} s"
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PrometheusError(spent)
        try:
            # Looked up here at each call, so that a test or the fuzzer can stand in for the server.
            return query(base_url, promql, timeout=min(QUERY_TIMEOUT_SECONDS, left))
        except PrometheusError as e:
            error = str(e)
        # Raised anew, outside the handler: the error waits in its future until the analysis ends, and the
        # original's traceback (or a context holding it) would keep the failed parse's whole document alive
        # (a flood of {} is 150 MB).
        raise PrometheusError(f"{spent} ({error})" if time.monotonic() >= self.deadline else error)


def servers(base_urls: str | Sequence[str]) -> tuple[str, ...]:
    """One URL or several (the shards of a tiered layout, each holding some nodes' series) as a tuple."""
    return (base_urls,) if isinstance(base_urls, str) else tuple(base_urls)


def fetch(base_urls: str | Sequence[str], job_id: str | None, timeout: float | None = None, narrow: bool = True,
          ) -> dict[Query, list[Sample]]:
    """The answer to every query of ``Query`` about the job (all jobs when ``job_id`` is None), as the servers
    sent it (parsed, bounded, not yet screened): each query's answers from every server of ``base_urls``, one
    after another in their order (a rank that two servers hold is two exporters' series, as one server with two
    exporters of it: the rebuild picks one); a query of ASKED_ONLY_WITH only where its prerequisite answered
    (else none). The queries of OF_ACTIVE_PGS are asked after the others, of the PGs that Query.PG_ACTIVE finds
    active (none when it finds none; every PG past MAX_NAMED_PGS), or of every PG when ``narrow`` is False;
    Query.SCRAPED only when an exporter reports no poll time. Up to QUERIES_IN_FLIGHT queries at once. All
    queries together take at most ``timeout`` seconds (None: ANALYZE_TIMEOUT_SECONDS), each at most
    QUERY_TIMEOUT_SECONDS; PrometheusError past either, or from the first server that fails."""
    urls = servers(base_urls)
    ask = _Asker(ANALYZE_TIMEOUT_SECONDS if timeout is None else timeout)
    pool = ThreadPoolExecutor(max_workers=QUERIES_IN_FLIGHT, thread_name_prefix="frexporter-analyze")

    def answers(queries: dict[Query, str]) -> dict[Query, list[Sample]]:
        asked = {(q, url): pool.submit(ask, url, q.promql(sel)) for q, sel in queries.items() for url in urls}
        return {q: [s for url in urls for s in asked[(q, url)].result()] for q in queries}

    try:
        # The ranks and nodes first, and which PGs are active; then the series of those PGs only.
        everything = _selector(job_id)
        got = answers(dict.fromkeys((q for q in Query if q not in LATER), everything))
        active = pg_keys(got[Query.PG_ACTIVE], active=True)
        later = dict.fromkeys([Query.SCRAPED] if scrape_times_needed(got) else [], everything)
        if active or not narrow:
            named = _named_pgs(active) if narrow else None
            later.update(dict.fromkeys(OF_ACTIVE_PGS - ASKED_ONLY_WITH.keys(), _selector(job_id, named or ())))
        got.update(answers(later))
        got.update(answers({q: later[needed] for q, needed in ASKED_ONLY_WITH.items() if got.get(needed)}))
        return {q: got.get(q, []) for q in Query}
    finally:
        # On a failure the queries not yet sent are dropped; those in flight end by the deadline.
        pool.shutdown(wait=True, cancel_futures=True)


def job_view(base_urls: str | Sequence[str], job_id: str | None, now: float,
             stale_after: float = STALE_HEARTBEAT_SECONDS, timeout: float | None = None, narrow: bool = True,
             ) -> JobView:
    """Every rank of the job (all jobs when ``job_id`` is None) as of the latest scrapes: fetch, then
    promview.rebuild (which says how ranks and staleness are judged)."""
    return rebuild(fetch(base_urls, job_id, timeout, narrow), now, stale_after)


def rank_states(base_urls: str | Sequence[str], job_id: str | None, now: float,
                stale_after: float = STALE_HEARTBEAT_SECONDS) -> tuple[RankState, ...]:
    """The ranks of job_view, without what was left out."""
    return job_view(base_urls, job_id, now, stale_after).ranks
