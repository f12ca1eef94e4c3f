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
from collections.abc import Sequence
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
    MAX_EXPANDED_MEMBERS,
    MAX_WORLD_SIZE,
    STALE_HEARTBEAT_SECONDS,
    JobView,
    Query,
    rebuild,
)

__all__ = [
    "ANALYZE_TIMEOUT_SECONDS",
    "MAX_EXPANDED_MEMBERS",
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

# All queries of one analysis (22 of them, on every server), so that a server answering each just in time cannot
# hold `frexporter analyze` for 22 times QUERY_TIMEOUT_SECONDS.
ANALYZE_TIMEOUT_SECONDS = 120.0
# Queries in flight at once, over all servers: while one answer is parsed here, a server computes the next (at
# 8,192 ranks the servers' part is about half of the time). A few: each holds up to MAX_RESPONSE_BYTES until it
# is parsed (one at a time, promclient), and a Prometheus busy with its rules is not crowded.
QUERIES_IN_FLIGHT = 4


def _selector(job_id: str | None) -> str:
    if not job_id:
        return "{}"
    # PromQL strings take Go's escapes, of which JSON's are a subset; a job id with a quote or a
    # backslash would otherwise end the string early (a parse error) or select another job.
    return "{" + f"{n.L_JOB_ID}={json.dumps(job_id, ensure_ascii=False)}" + "}"


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


def fetch(base_urls: str | Sequence[str], job_id: str | None, timeout: float | None = None,
          ) -> dict[Query, list[Sample]]:
    """The answer to every query of ``Query`` about the job (all jobs when ``job_id`` is None), as the servers
    sent it (parsed, bounded, not yet screened): each query's answers from every server of ``base_urls``, one
    after another in their order (a rank that two servers hold is two exporters' series, as one server with two
    exporters of it: the rebuild picks one); a query of ASKED_ONLY_WITH only where its prerequisite answered
    (else none). Up to QUERIES_IN_FLIGHT queries at once. All queries together take at most ``timeout``
    seconds (None: ANALYZE_TIMEOUT_SECONDS), each at most QUERY_TIMEOUT_SECONDS; PrometheusError past
    either, or from the first server that fails."""
    urls = servers(base_urls)
    ask = _Asker(ANALYZE_TIMEOUT_SECONDS if timeout is None else timeout)
    sel = _selector(job_id)
    pool = ThreadPoolExecutor(max_workers=QUERIES_IN_FLIGHT, thread_name_prefix="frexporter-analyze")

    def answers(queries: list[Query]) -> dict[Query, list[Sample]]:
        asked = {(q, url): pool.submit(ask, url, q.promql(sel)) for q in queries for url in urls}
        return {q: [s for url in urls for s in asked[(q, url)].result()] for q in queries}

    try:
        got = answers([q for q in Query if q not in ASKED_ONLY_WITH])
        got.update(answers([q for q, needed in ASKED_ONLY_WITH.items() if got[needed]]))
        return {q: got.get(q, []) for q in Query}
    finally:
        # On a failure the queries not yet sent are dropped; those in flight end by the deadline.
        pool.shutdown(wait=True, cancel_futures=True)


def job_view(base_urls: str | Sequence[str], job_id: str | None, now: float,
             stale_after: float = STALE_HEARTBEAT_SECONDS, timeout: float | None = None) -> JobView:
    """Every rank of the job (all jobs when ``job_id`` is None) as of the latest scrapes: fetch, then
    promview.rebuild (which says how ranks and staleness are judged)."""
    return rebuild(fetch(base_urls, job_id, timeout), now, stale_after)


def rank_states(base_urls: str | Sequence[str], job_id: str | None, now: float,
                stale_after: float = STALE_HEARTBEAT_SECONDS) -> tuple[RankState, ...]:
    """The ranks of job_view, without what was left out."""
    return job_view(base_urls, job_id, now, stale_after).ranks
