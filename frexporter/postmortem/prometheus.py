"""A whole job's RankStates rebuilt from the series every node exporter sent to Prometheus.

Prometheus holds what no single node sees: every rank of every PG. Series carry
no FR entries, only counts and the oldest in-flight start, which the engine accepts
through ``with_oldest_start`` (missing ranks and budgets can be judged; mismatches
cannot, they need entries).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from functools import partial
from typing import Any

from frexporter import naming as n
from frexporter.analysis.verdicts import with_oldest_start
from frexporter.model import (
    ACTIVITY_BUSY,
    ACTIVITY_STATES,
    ACTIVITY_UNKNOWN,
    BUSY_HOLD_SECONDS,
    RANK_DOWN,
    RANK_OK,
    RANK_UNRESPONSIVE,
    UNKNOWN_ACTIVITY,
    Activity,
    PGState,
    RankState,
)

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
# A heartbeat this old when scraped, on an up rank: its Python is wedged. Above the exporter's poll
# interval (<= 15 s, see frexporter.rules.yml) plus the snapshot interval, which a healthy rank can reach.
STALE_HEARTBEAT_SECONDS = 30.0
MAX_WORLD_SIZE = 1 << 17  # a world_size label beyond any real job is not expanded into members


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
    return parse_query_response(body, f"{base_url} ({promql!r})")


def parse_query_response(body: bytes, source: str = "Prometheus") -> list[dict[str, Any]]:
    """The samples of an instant-vector ``/api/v1/query`` answer; PrometheusError for anything else."""
    if len(body) > MAX_RESPONSE_BYTES:
        raise PrometheusError(f"{source}: response larger than {MAX_RESPONSE_BYTES} bytes")
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise PrometheusError(f"{source}: not a Prometheus API response") from e
    except RecursionError as e:  # nesting deeper than the stack: not something Prometheus writes
        raise PrometheusError(f"{source}: not a Prometheus API response (nested too deeply)") from e
    if not isinstance(doc, dict) or doc.get("status") != "success":
        # Only a string "error" is quoted: str() of an arbitrary document can be huge or recurse too deep.
        error = doc.get("error") if isinstance(doc, dict) else None
        detail = error[:300] if isinstance(error, str) else "no success status"
        raise PrometheusError(f"{source}: query failed: {detail}")
    data = doc.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise PrometheusError(f"{source}: unexpected result shape")
    # Label values are strings in the API; a sample that says otherwise is dropped here, so that the
    # callers can use labels as dict keys and parse them as text.
    return [r for r in data["result"] if isinstance(r, dict) and isinstance(r.get("metric"), dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in r["metric"].items())]


def _value(sample: dict[str, Any]) -> float | None:
    """The sample's value; None also for NaN and infinities, which no seq, count or timestamp can be."""
    try:
        value = float(sample["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _selector(job_id: str | None) -> str:
    if not job_id:
        return "{}"
    # PromQL strings take Go's escapes, of which JSON's are a subset; a job id with a quote or a
    # backslash would otherwise end the string early (a parse error) or select another job.
    return "{" + f"{n.L_JOB_ID}={json.dumps(job_id, ensure_ascii=False)}" + "}"


# Labels frexporter itself puts on rank and PG series. Whatever else a series carries (job, instance,
# pod, ... from the scrape target and relabelling) names the exporter that reported it.
_OWN_LABELS = frozenset({"__name__", *n.RANK_INFO_LABELS, *n.PG_INFO_LABELS, *n.RANK_ACTIVITY_LABELS})
RankKey = tuple[str, int]
Source = tuple[tuple[str, str], ...]
_PG_FIELDS = ((n.PG_LAST_ENQUEUED_SEQ, "enqueued"), (n.PG_LAST_COMPLETED_SEQ, "completed"),
              (n.PG_LAST_STARTED_SEQ, "started"), (n.PG_INFLIGHT_COLLECTIVES, "inflight"),
              (n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, "oldest"),
              (n.PG_LAST_PROGRESS_TIMESTAMP_SECONDS, "progress"))


def _source(labels: dict[str, str]) -> Source:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in _OWN_LABELS))


def _rank_key(labels: dict[str, str]) -> RankKey | None:
    job, rank = labels.get(n.L_JOB_ID), _int(labels.get(n.L_RANK))
    return None if job is None or rank < 0 else (job, rank)


def _by_source(samples: list[dict[str, Any]]) -> dict[RankKey, dict[Source, dict[str, Any]]]:
    """Rank key -> reporting exporter -> sample."""
    out: dict[RankKey, dict[Source, dict[str, Any]]] = defaultdict(dict)
    for s in samples:
        key = _rank_key(s["metric"])
        if key is not None:
            out[key][_source(s["metric"])] = s
    return out


def _newest_state(samples: list[dict[str, Any]]) -> dict[RankKey, dict[Source, dict[str, Any]]]:
    """Like _by_source for the activity series, which carry the state as a label: one exporter exports one
    state per rank, but a state it left can linger in a query for a scrape; the newest begun is current."""
    out: dict[RankKey, dict[Source, dict[str, Any]]] = defaultdict(dict)
    for s in samples:
        key, since = _rank_key(s["metric"]), _value(s)
        if key is None or since is None:
            continue
        source = _source(s["metric"])
        held = out[key].get(source)
        if held is None or since > (_value(held) or -math.inf):
            out[key][source] = s
    return out


def rank_states(base_url: str, job_id: str | None, now: float,
                stale_after: float = STALE_HEARTBEAT_SECONDS) -> tuple[RankState, ...]:
    """Every rank of the job (all jobs when ``job_id`` is None) as of the latest scrapes.

    A rank several exporters report (a sidecar and a node exporter, or two replicas) is read from the
    one with the freshest heartbeat only: mixing their series could combine one's seqs with the other's
    in-flight start. A rank is unresponsive when its heartbeat was ``stale_after`` old already when
    Prometheus last scraped it: judged at the query time instead, every healthy rank would look stale
    whenever the scrape interval is longer than that.
    """
    sel = _selector(job_id)
    up = _by_source(query(base_url, n.RANK_UP + sel))
    heartbeat = _by_source(query(base_url, n.RANK_HEARTBEAT_TIMESTAMP_SECONDS + sel))
    scraped = _by_source(query(base_url, f"timestamp({n.RANK_HEARTBEAT_TIMESTAMP_SECONDS}{sel})"))
    info = _by_source(query(base_url, n.RANK_INFO + sel))
    pg_info = query(base_url, n.PG_INFO + sel)
    timeouts = _pg_timeouts(query(base_url, n.PG_TIMEOUT_SECONDS + sel))
    # The exporters' learned stuck thresholds (absent from older ones: the caller's fixed one applies).
    thresholds = _pg_timeouts(query(base_url, n.PG_STUCK_THRESHOLD_SECONDS + sel))
    # And their ceilings (--stuck-after), the threshold of a wait on busy culprits (absent from older ones too).
    ceilings = _pg_timeouts(query(base_url, n.PG_STUCK_CEILING_SECONDS + sel))
    pg_samples = [(field, s) for metric, field in _PG_FIELDS for s in query(base_url, metric + sel)]
    culprits = _culprit_activities(query(base_url, n.VERDICT + sel))
    activity = _newest_state(query(base_url, n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS + sel))
    # Busy at any time within the hold, as FrexporterCollectiveDesync asks it (model.BUSY_HOLD_SECONDS).
    busy_lately = {key for s in query(base_url, f"max_over_time({n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS}"
                                                f"{sel}[{BUSY_HOLD_SECONDS:.0f}s])")
                   if s["metric"].get(n.L_STATE) == ACTIVITY_BUSY and (key := _rank_key(s["metric"])) is not None}

    sources: dict[RankKey, set[Source]] = defaultdict(set)
    for table in (up, heartbeat, info):
        for key, by_source in table.items():
            sources[key].update(by_source)
    for _, s in pg_samples:
        key = _rank_key(s["metric"])
        if key is not None:
            sources[key].add(_source(s["metric"]))

    def freshness(key: RankKey, source: Source) -> tuple[float, Source]:
        beat = _value(heartbeat[key][source]) if source in heartbeat.get(key, {}) else None
        return (-math.inf if beat is None else beat, source)

    chosen = {key: max(found, key=partial(freshness, key)) for key, found in sources.items()}

    def pick(table: dict[RankKey, dict[Source, dict[str, Any]]], key: RankKey) -> dict[str, Any] | None:
        return table.get(key, {}).get(chosen[key])

    pg_series: dict[tuple[str, int, str], dict[str, Any]] = defaultdict(dict)
    for field, s in pg_samples:
        labels = s["metric"]
        key = _rank_key(labels)
        if key is None or n.L_PG not in labels or _source(labels) != chosen[key]:
            continue
        pg_series[(*key, labels[n.L_PG])][field] = _value(s)
        pg_series[(*key, labels[n.L_PG])]["desc"] = labels.get(n.L_PG_DESC, "")
    members = _members(pg_series, pg_info, {key: pick(info, key) for key in chosen})

    by_rank: dict[RankKey, list[PGState]] = defaultdict(list)
    for (job, rank, pg), v in sorted(pg_series.items()):
        if v.get("enqueued") is None or v.get("completed") is None:
            continue
        enq, done = int(v["enqueued"]), int(v["completed"])
        inflight = v.get("inflight")
        state = PGState(
            name=pg, desc=str(v.get("desc", "")), ranks=members[(job, pg)], backend="",
            last_enqueued=enq, last_started=int(v["started"]) if v.get("started") is not None else -1,
            last_completed=done, inflight=(),
            # A reported 0 is an answer, not a gap to fill from the seqs.
            inflight_count=max(0, enq - done) if inflight is None else max(0, int(inflight)),
            timeout_seconds=timeouts.get((job, pg)), last_progress=v.get("progress"), exact=True, has_p2p=False,
            stuck_threshold_seconds=thresholds.get((job, pg)), stuck_ceiling_seconds=ceilings.get((job, pg)),
        )
        by_rank[(job, rank)].append(with_oldest_start(state, v.get("oldest")))
    keys = set(by_rank) | {key for key in chosen if pick(up, key) is not None}
    out = []
    for key in sorted(keys):
        job, rank = key
        info_sample = pick(info, key)
        labels = info_sample["metric"] if info_sample is not None else {}
        hb_sample, at_sample, up_sample = pick(heartbeat, key), pick(scraped, key), pick(up, key)
        hb = None if hb_sample is None else _value(hb_sample)
        at = None if at_sample is None else _value(at_sample)
        stale = None if hb is None else (now if at is None else at) - hb
        status = RANK_OK
        if up_sample is not None and _value(up_sample) == 0:
            status = RANK_DOWN
        elif stale is not None and stale > stale_after:
            status = RANK_UNRESPONSIVE
        # A wedged rank has not beaten since its heartbeat; a healthy one was that fresh at its scrape.
        age = None if hb is None or stale is None else max(0.0, now - hb if status == RANK_UNRESPONSIVE else stale)
        out.append(RankState(
            job_id=job, rank=rank, local_rank=_int(labels.get(n.L_LOCAL_RANK)),
            world_size=_int(labels.get(n.L_WORLD_SIZE)), hostname=labels.get(n.L_HOSTNAME, ""),
            pid=_int(labels.get(n.L_PID)), torch_version=labels.get(n.L_TORCH_VERSION, ""),
            gpu_uuid=labels.get(n.L_GPU_UUID, ""), status=status, heartbeat=hb, heartbeat_age=age,
            socket_alive=None, pgs=tuple(by_rank.get(key, ())),
            activity=_activity(pick(activity, key), culprits.get(key), now if key in busy_lately else None),
        ))
    return tuple(out)


def _activity(sample: dict[str, Any] | None, culprit: Activity | None, last_busy: float | None) -> Activity:
    """The rank's activity from its exporter's activity series (state and since), with the function a
    verdict of that state names; from the verdict alone where the exporter exports no activity (older).
    ``last_busy``: a time within the busy hold when the series said busy in it."""
    if sample is None or sample["metric"].get(n.L_STATE) not in ACTIVITY_STATES:
        return culprit or UNKNOWN_ACTIVITY
    state: str = sample["metric"][n.L_STATE]
    frames = culprit.frames if culprit is not None and culprit.state == state else ()
    return Activity(state=state, frames=frames, since=_value(sample), last_busy=last_busy)


def _culprit_activities(samples: list[dict[str, Any]]) -> dict[RankKey, Activity]:
    """What each culprit was doing as its node's exporter saw it (frexporter_verdict's culprit_state and
    culprit_function); the function is all of the stack a series carries."""
    out: dict[RankKey, Activity] = {}
    for s in samples:
        labels = s["metric"]
        key, state = _rank_key(labels), labels.get(n.L_CULPRIT_STATE, "")
        if key is None or state not in ACTIVITY_STATES or state == ACTIVITY_UNKNOWN:
            continue
        function = labels.get(n.L_CULPRIT_FUNCTION, "")[:n.MAX_FUNCTION_LABEL_CHARS]
        out[key] = Activity(state=state, frames=((function, "", 0),) if function else ())
    return out


def _pg_timeouts(samples: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """Each PG's watchdog timeout or stuck threshold (exported per node, without a rank): the shortest any
    node reports."""
    out: dict[tuple[str, str], float] = {}
    for s in samples:
        job, pg = s["metric"].get(n.L_JOB_ID), s["metric"].get(n.L_PG)
        value = _value(s)
        if job is None or pg is None or value is None or value <= 0:
            continue
        out[(job, pg)] = min(out.get((job, pg), value), value)
    return out


def _members(pg_series: dict[tuple[str, int, str], dict[str, Any]], pg_info: list[dict[str, Any]],
             rank_info: dict[RankKey, dict[str, Any] | None],
             ) -> dict[tuple[str, str], tuple[int, ...]]:
    """Each PG's ranks: those with series, or every rank of the job when the PG spans the world.

    A rank whose exporter is down or never saw it has no series at all; counted out, it could never be
    blamed for the collective its peers wait on. Only a PG as large as the world says who is missing.
    """
    seen: dict[tuple[str, str], set[int]] = defaultdict(set)
    for job, rank, pg in pg_series:
        seen[(job, pg)].add(rank)
    size: dict[tuple[str, str], int] = {}
    for s in pg_info:  # per node, without a rank: every node that reports the PG agrees on its size
        job, pg = s["metric"].get(n.L_JOB_ID), s["metric"].get(n.L_PG)
        if job is not None and pg is not None:
            size[(job, pg)] = max(size.get((job, pg), 0), _int(s["metric"].get(n.L_SIZE)))
    world: dict[str, int] = defaultdict(int)
    for (job, _), sample in rank_info.items():
        if sample is not None:
            world[job] = max(world[job], _int(sample["metric"].get(n.L_WORLD_SIZE)))
    out = {}
    for (job, pg), ranks in seen.items():
        whole = size.get((job, pg), -1) == world[job] > len(ranks) and world[job] <= MAX_WORLD_SIZE
        out[(job, pg)] = tuple(sorted(ranks | set(range(world[job])))) if whole else tuple(sorted(ranks))
    return out


def _int(value: str | None) -> int:
    try:
        return int(value or "")
    except ValueError:
        return -1
