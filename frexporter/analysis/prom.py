"""A whole job's RankStates rebuilt from the series every node exporter sent to Prometheus.

Prometheus holds what no single node sees: every rank of every PG. Series carry
no FR entries, only counts and the oldest in-flight start, which the engine accepts
through ``with_oldest_start`` (missing ranks and budgets can be judged; mismatches
cannot, they need entries).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from typing import Any

from frexporter import naming as n
from frexporter.analysis.verdicts import with_oldest_start
from frexporter.model import RANK_DOWN, RANK_OK, RANK_UNRESPONSIVE, PGState, RankState

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
STALE_HEARTBEAT_SECONDS = 30.0  # a heartbeat this old on an up rank: its Python is wedged


class PrometheusError(Exception):
    pass


def query(base_url: str, promql: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    url = base_url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read(MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as e:
        raise PrometheusError(f"{base_url}: HTTP {e.code} for {promql!r}: {e.read(300)!r}") from e
    except (urllib.error.URLError, OSError) as e:
        raise PrometheusError(f"{base_url}: {getattr(e, 'reason', e)}") from e
    if len(body) > MAX_RESPONSE_BYTES:
        raise PrometheusError(f"{base_url}: response larger than {MAX_RESPONSE_BYTES} bytes")
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise PrometheusError(f"{base_url}: not a Prometheus API response") from e
    if not isinstance(doc, dict) or doc.get("status") != "success":
        raise PrometheusError(f"{base_url}: query failed: {str(doc)[:300]}")
    data = doc.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise PrometheusError(f"{base_url}: unexpected result shape for {promql!r}")
    return [r for r in data["result"] if isinstance(r, dict) and isinstance(r.get("metric"), dict)]


def _value(sample: dict[str, Any]) -> float | None:
    try:
        return float(sample["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _selector(job_id: str | None) -> str:
    return "{" + (f'{n.L_JOB_ID}="{job_id}"' if job_id else "") + "}"


def rank_states(base_url: str, job_id: str | None, now: float) -> tuple[RankState, ...]:
    sel = _selector(job_id)
    pg_series: dict[tuple[str, int, str], dict[str, Any]] = defaultdict(dict)
    for metric, field in ((n.PG_LAST_ENQUEUED_SEQ, "enqueued"), (n.PG_LAST_COMPLETED_SEQ, "completed"),
                          (n.PG_LAST_STARTED_SEQ, "started"), (n.PG_INFLIGHT_COLLECTIVES, "inflight"),
                          (n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, "oldest"),
                          (n.PG_TIMEOUT_SECONDS, "timeout"), (n.PG_LAST_PROGRESS_TIMESTAMP_SECONDS, "progress")):
        for s in query(base_url, metric + sel):
            labels = s["metric"]
            try:
                key = (labels[n.L_JOB_ID], int(labels[n.L_RANK]), labels[n.L_PG])
            except (KeyError, ValueError):
                continue
            pg_series[key][field] = _value(s)
            pg_series[key]["desc"] = labels.get(n.L_PG_DESC, "")
    ranks_of: dict[tuple[str, str], set[int]] = defaultdict(set)
    for job, rank, pg in pg_series:
        ranks_of[(job, pg)].add(rank)
    up = {(s["metric"].get(n.L_JOB_ID, ""), s["metric"].get(n.L_RANK, "")): _value(s)
          for s in query(base_url, n.RANK_UP + sel)}
    heartbeat = {(s["metric"].get(n.L_JOB_ID, ""), s["metric"].get(n.L_RANK, "")): _value(s)
                 for s in query(base_url, n.RANK_HEARTBEAT_TIMESTAMP_SECONDS + sel)}
    info = {(s["metric"].get(n.L_JOB_ID, ""), s["metric"].get(n.L_RANK, "")): s["metric"]
            for s in query(base_url, n.RANK_INFO + sel)}

    by_rank: dict[tuple[str, int], list[PGState]] = defaultdict(list)
    for (job, rank, pg), v in sorted(pg_series.items()):
        if v.get("enqueued") is None or v.get("completed") is None:
            continue
        enq, done = int(v["enqueued"]), int(v["completed"])
        state = PGState(
            name=pg, desc=str(v.get("desc", "")), ranks=tuple(sorted(ranks_of[(job, pg)])), backend="",
            last_enqueued=enq, last_started=int(v["started"]) if v.get("started") is not None else -1,
            last_completed=done, inflight=(), inflight_count=int(v.get("inflight") or max(0, enq - done)),
            timeout_seconds=v.get("timeout"), last_progress=v.get("progress"), exact=True, has_p2p=False,
        )
        by_rank[(job, rank)].append(with_oldest_start(state, v.get("oldest")))
    keys = set(by_rank) | {(j, int(r)) for j, r in up if r.isdigit()}
    out = []
    for job, rank in sorted(keys):
        labels = info.get((job, str(rank)), {})
        hb = heartbeat.get((job, str(rank)))
        is_up = up.get((job, str(rank)))
        status = RANK_OK
        if is_up == 0:
            status = RANK_DOWN
        elif hb is not None and now - hb > STALE_HEARTBEAT_SECONDS:
            status = RANK_UNRESPONSIVE
        out.append(RankState(
            job_id=job, rank=rank, local_rank=_int(labels.get(n.L_LOCAL_RANK)),
            world_size=_int(labels.get(n.L_WORLD_SIZE)), hostname=labels.get(n.L_HOSTNAME, ""),
            pid=_int(labels.get(n.L_PID)), torch_version=labels.get(n.L_TORCH_VERSION, ""),
            gpu_uuid=labels.get(n.L_GPU_UUID, ""), status=status, heartbeat=hb,
            heartbeat_age=None if hb is None else max(0.0, now - hb), socket_alive=None,
            pgs=tuple(by_rank.get((job, rank), ())),
        ))
    return tuple(out)


def _int(value: str | None) -> int:
    try:
        return int(value or "")
    except ValueError:
        return -1
