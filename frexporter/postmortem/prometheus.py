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
    MAX_EXPANDED_MEMBERS,
    MAX_WORLD_SIZE,
    STALE_HEARTBEAT_SECONDS,
    JobView,
    Query,
    rebuild,
)

__all__ = [
    "ANALYZE_TIMEOUT_SECONDS", "MAX_EXPANDED_MEMBERS", "MAX_RESPONSE_BYTES", "MAX_SERIES", "MAX_WORLD_SIZE",
    "QUERY_TIMEOUT_SECONDS", "STALE_HEARTBEAT_SECONDS", "JobView", "PrometheusError", "Query", "fetch",
    "job_view", "parse_query_response", "query", "rank_states", "rebuild",
]

# All queries of one analysis (20 of them), so that a server answering each just in time cannot hold
# `frexporter analyze` for 20 times QUERY_TIMEOUT_SECONDS.
ANALYZE_TIMEOUT_SECONDS = 120.0


def _selector(job_id: str | None) -> str:
    if not job_id:
        return "{}"
    # PromQL strings take Go's escapes, of which JSON's are a subset; a job id with a quote or a
    # backslash would otherwise end the string early (a parse error) or select another job.
    return "{" + f"{n.L_JOB_ID}={json.dumps(job_id, ensure_ascii=False)}" + "}"


@dataclass
class _Asker:
    """Queries of one analysis, all within one deadline."""

    base_url: str
    timeout: float
    deadline: float = 0.0

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.timeout

    def __call__(self, promql: str) -> list[Sample]:
        spent = f"{safetext.printable(self.base_url)}: the analysis's queries took more than {self.timeout:g} s"
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PrometheusError(spent)
        try:
            # Looked up here at each call, so that a test or the fuzzer can stand in for the server.
            return query(self.base_url, promql, timeout=min(QUERY_TIMEOUT_SECONDS, left))
        except PrometheusError as e:
            if time.monotonic() >= self.deadline:
                raise PrometheusError(f"{spent} ({e})") from e
            raise


def fetch(base_url: str, job_id: str | None, timeout: float | None = None) -> dict[Query, list[Sample]]:
    """The answer to every query of ``Query`` about the job (all jobs when ``job_id`` is None), as the server
    sent it (parsed, bounded, not yet screened). All queries together take at most ``timeout`` seconds (None:
    ANALYZE_TIMEOUT_SECONDS), each at most QUERY_TIMEOUT_SECONDS; PrometheusError past either."""
    ask = _Asker(base_url, ANALYZE_TIMEOUT_SECONDS if timeout is None else timeout)
    sel = _selector(job_id)
    return {q: ask(q.promql(sel)) for q in Query}


def job_view(base_url: str, job_id: str | None, now: float, stale_after: float = STALE_HEARTBEAT_SECONDS,
             timeout: float | None = None) -> JobView:
    """Every rank of the job (all jobs when ``job_id`` is None) as of the latest scrapes: fetch, then
    promview.rebuild (which says how ranks and staleness are judged)."""
    return rebuild(fetch(base_url, job_id, timeout), now, stale_after)


def rank_states(base_url: str, job_id: str | None, now: float,
                stale_after: float = STALE_HEARTBEAT_SECONDS) -> tuple[RankState, ...]:
    """The ranks of job_view, without what was left out."""
    return job_view(base_url, job_id, now, stale_after).ranks
