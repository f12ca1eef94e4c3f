"""JSON status API, the human page and /healthz's text: plain views of one NodeSnapshot.

Both are bounded for any spool content (the spool is untrusted): a list past its bound is cut and
flagged, never silently; counts such as a PG's ``size`` stay whole.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from frexporter import __version__
from frexporter.analysis.culprit_activity import where as activity_where
from frexporter.analysis.verdicts import Verdict, budget_left
from frexporter.model import (
    ACTIVITY_UNKNOWN,
    FRAMES_PYSPY,
    STATE_STARTING,
    Activity,
    NodeSnapshot,
    PGState,
    RankState,
)

MAX_LISTED_MEMBERS = 64  # member ranks per process group (its "size" is the whole count)
MAX_LISTED_RANKS = 256  # ranks of the node
MAX_LISTED_RANK_PGS = 256  # process groups per rank
MAX_LISTED_PGS = 1024  # process groups over all ranks, in rank order (the node view sums up the same ones)
MAX_LISTED_VERDICTS = 256
MAX_LISTED_ITEMS = 64  # any list inside a verdict, and entries of a rank's recorder error map
MAX_LISTED_SHAPES = 4  # tensor shapes (and dtypes) of a PG's oldest in-flight collective
# The page reloads itself this often: an on-call engineer leaves it open through an incident.
PAGE_REFRESH_SECONDS = 5
TRUNCATED = "_truncated"  # suffix of the flag that says a list was cut: "ranks" -> "ranks_truncated"


def _cut(out: dict[str, Any], key: str, items: Sequence[Any], limit: int) -> None:
    """``out[key]`` = the first ``limit`` items, and ``out[key + "_truncated"]`` = whether any were left out."""
    out[key] = list(items[:limit])
    out[key + TRUNCATED] = len(items) > limit


def _pg_json(pg: PGState, now: float) -> dict[str, Any]:
    oldest = pg.oldest_inflight
    out: dict[str, Any] = {"pg": pg.name, "pg_desc": pg.desc, "size": pg.size}
    _cut(out, "ranks", pg.ranks, MAX_LISTED_MEMBERS)
    inflight = None
    if oldest is not None and pg.inflight_count != 0:
        inflight = {
            "seq": oldest.seq,
            "op": oldest.op,
            "since": oldest.created,
            "age_seconds": round(max(0.0, now - oldest.created), 3),
            "timeout_seconds": oldest.timeout_seconds,
        }
        _cut(inflight, "input_sizes", [list(s) for s in oldest.input_sizes[:MAX_LISTED_SHAPES + 1]],
             MAX_LISTED_SHAPES)
        _cut(inflight, "input_dtypes", oldest.input_dtypes, MAX_LISTED_SHAPES)
    out.update({
        "backend": pg.backend,
        "last_enqueued_seq": pg.last_enqueued,
        "last_started_seq": pg.last_started,
        "last_completed_seq": pg.last_completed,
        "inflight_collectives": pg.inflight_count,
        "oldest_inflight": inflight,
        "timeout_seconds": pg.timeout_seconds,
        # A wait in progress and the threshold it is judged against, so that a wait below it shows as such.
        "wait_seconds": None if inflight is None else inflight["age_seconds"],
        "stuck_threshold_seconds": pg.stuck_threshold_seconds,
        "last_progress": pg.last_progress,
        "exact": pg.exact,
        "has_p2p": pg.has_p2p,
    })
    return out


def _listed(ranks: Iterable[RankState]) -> Iterable[tuple[RankState, tuple[PGState, ...]]]:
    """Each listed rank with the PGs listed for it: the same choice for the JSON and the HTML page."""
    budget = MAX_LISTED_PGS
    for r in ranks:
        pgs = r.pgs[:min(MAX_LISTED_RANK_PGS, budget)]
        budget -= len(pgs)
        yield r, pgs


def _rank_json(r: RankState, pgs: tuple[PGState, ...], now: float) -> dict[str, Any]:
    out: dict[str, Any] = {
        "job_id": r.job_id,
        "rank": r.rank,
        "local_rank": r.local_rank,
        "world_size": r.world_size,
        "hostname": r.hostname,
        "pid": r.pid,
        "torch_version": r.torch_version,
        "gpu_uuid": r.gpu_uuid,
        "up": r.up,
        "status": r.status,
        # Down after a clean exit: held in view while local peers wait for it in a collective it never completed.
        "exited": r.exited,
        # "starting": blocked in (or before) init_process_group for starting_seconds; "running" once it has a PG.
        "state": r.state,
        "starting_seconds": round(max(0.0, now - r.start_time), 3) if r.state == STATE_STARTING and r.start_time
        else None,
        "node_ranks": list(r.node_ranks[:MAX_LISTED_ITEMS]),
        "heartbeat": r.heartbeat,
        "heartbeat_age_seconds": None if r.heartbeat_age is None else round(r.heartbeat_age, 3),
        "socket_alive": r.socket_alive,
        "last_deep_read": r.last_deep_read,  # when the exporter last read this rank's FR entries over its socket
        "recorder_errors": dict(list(r.recorder_errors.items())[:MAX_LISTED_ITEMS]),
        "message": r.message,
        # What its training thread is doing: state, sampled frames (innermost first), CPU %, since when.
        "activity": r.activity.to_json(),
        "process_groups": [_pg_json(pg, now) for pg in pgs],
        "process_groups_total": len(r.pgs),
    }
    out["process_groups" + TRUNCATED] = len(pgs) < len(r.pgs)
    return out


def _process_groups(snap: NodeSnapshot, listed: list[tuple[RankState, tuple[PGState, ...]]]
                    ) -> tuple[list[dict[str, Any]], bool]:
    """Per (job, PG) across the local ranks: who is where, and the skew between them. Made of the (rank, PG)
    pairs the rank view lists; a pair left out flags its group, or the whole view when its group is not listed."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r, pgs in listed:
        for pg in pgs:
            g = groups.get((r.job_id, pg.name))
            if g is None:
                g = groups[(r.job_id, pg.name)] = {"job_id": r.job_id, "pg": pg.name, "pg_desc": pg.desc,
                                                   "size": pg.size}
                _cut(g, "ranks", pg.ranks, MAX_LISTED_MEMBERS)
                g["local_ranks"] = {}
                g["local_ranks" + TRUNCATED] = False
                g["wait_seconds"] = None
                g["stuck_threshold_seconds"] = None
            oldest = pg.oldest_inflight
            if oldest is not None and pg.inflight_count:
                wait = round(max(0.0, snap.time - oldest.created), 3)
                g["wait_seconds"] = wait if g["wait_seconds"] is None else max(g["wait_seconds"], wait)
            if pg.stuck_threshold_seconds is not None:
                known = g["stuck_threshold_seconds"]
                g["stuck_threshold_seconds"] = min(known, pg.stuck_threshold_seconds) if known is not None else (
                    pg.stuck_threshold_seconds)
            g["local_ranks"][str(r.rank)] = {
                "last_enqueued_seq": pg.last_enqueued,
                "last_completed_seq": pg.last_completed,
                "inflight_collectives": pg.inflight_count,
            }
    shown = {id(r): len(pgs) for r, pgs in listed}
    cut = False
    for r in snap.ranks:
        for pg in r.pgs[shown.get(id(r), 0):]:
            g = groups.get((r.job_id, pg.name))
            if g is None:
                cut = True
            else:
                g["local_ranks" + TRUNCATED] = True
    out = []
    for g in groups.values():
        enq = [v["last_enqueued_seq"] for v in g["local_ranks"].values()]
        g["enqueued_skew"] = max(enq) - min(enq) if enq else 0
        out.append(g)
    return sorted(out, key=lambda g: (g["job_id"], g["pg"])), cut


def _bounded(value: Any) -> Any:
    """JSON with every list cut to MAX_LISTED_ITEMS, flagged next to it where it sits in an object."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if isinstance(item, list) and len(item) > MAX_LISTED_ITEMS:
                out[key + TRUNCATED] = True
            out[key] = _bounded(item)
        return out
    if isinstance(value, list):
        return [_bounded(v) for v in value[:MAX_LISTED_ITEMS]]
    return value


def _precut(value: Any) -> Any:
    """``value`` with every collection cut to one past MAX_LISTED_ITEMS: enough for ``_bounded`` to flag it,
    without turning a verdict's 100,000 unobserved ranks into JSON first."""
    if isinstance(value, Mapping):  # the engine bounds its maps (MAX_DETAIL_RANKS), not its lists
        return {k: _precut(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        value = sorted(value)
    if isinstance(value, (list, tuple)):
        return [_precut(v) for v in value[:MAX_LISTED_ITEMS + 1]]
    return value


def _verdict_json(v: Verdict) -> dict[str, Any]:
    cut = dataclasses.replace(v, ranks=tuple(v.ranks[:MAX_LISTED_ITEMS + 1]),
                              waiting_ranks=tuple(v.waiting_ranks[:MAX_LISTED_ITEMS + 1]), details=_precut(v.details))
    return _bounded(cut.to_json())


def status_json(snap: NodeSnapshot) -> dict[str, Any]:
    listed = list(_listed(snap.ranks[:MAX_LISTED_RANKS]))
    groups, groups_cut = _process_groups(snap, listed)
    return {
        "version": __version__,
        "hostname": snap.hostname,
        "time": snap.time,
        "ranks": [_rank_json(r, pgs, snap.time) for r, pgs in listed],
        "ranks_total": len(snap.ranks),
        "ranks" + TRUNCATED: len(snap.ranks) > MAX_LISTED_RANKS,
        "process_groups": groups,
        "process_groups" + TRUNCATED: groups_cut,
        "verdicts": [_verdict_json(v) for v in snap.verdicts[:MAX_LISTED_VERDICTS]],
        "verdicts_total": len(snap.verdicts),
        "verdicts" + TRUNCATED: len(snap.verdicts) > MAX_LISTED_VERDICTS,
        "sources": [
            {"source": s.name, "up": s.up, "reason": s.reason, "stale": s.stale,
             "last_success": s.last_success, "duration_seconds": s.duration_seconds,
             "errors_total": dict(s.errors_total), "last_error": s.last_error}
            for s in snap.sources
        ],
    }


def health_text(snapshot: NodeSnapshot) -> str:
    """/healthz's body while the poll loop runs: ``ok``, or ``degraded: NAMES`` and one line per source (or
    output) that is down: its reason, and the age of the reading still served of it. Only our own names,
    reasons and numbers: no source's message, which may quote the spool."""
    down = [s for s in snapshot.sources if not s.up]
    if not down:
        return "ok\n"
    lines = [f"degraded: {', '.join(s.name for s in down)}"]
    for s in down:
        line = f"{s.name}: down ({s.reason or 'error'})"
        if s.stale and s.last_success is not None:
            line += f", serving its reading from {max(0.0, snapshot.time - s.last_success):.0f}s ago"
        elif s.last_success is not None:
            line += f", last success {max(0.0, snapshot.time - s.last_success):.0f}s ago"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _budget_text(v: Verdict) -> str:
    left = budget_left(v)
    return "" if left is None else f" [watchdog budget left: {max(0.0, left):.0f}s of {v.timeout_seconds:.0f}s]"


def _activity_text(a: Activity, now: float) -> str:
    """'busy in save_checkpoint (train.py:142) for 95s, 100 % CPU' for the page's activity column."""
    if a.state == ACTIVITY_UNKNOWN:
        return ""
    at = activity_where(a)
    span = f" for {now - a.since:.0f}s" if a.since is not None else ""
    cpu = f", {a.cpu_percent:.0f} % CPU" if a.cpu_percent is not None else ""
    by = " (py-spy)" if a.frames_source == FRAMES_PYSPY else ""
    return f"{a.state}{' in ' + at if at else ''}{by}{span}{cpu}"


def status_html(snap: NodeSnapshot) -> str:
    e = html.escape
    rows = []
    culprits = {(v.job_id, rank) for v in snap.verdicts for rank in v.ranks}
    for r, pgs in _listed(snap.ranks[:MAX_LISTED_RANKS]):
        culprit = (r.job_id, r.rank) in culprits
        for pg in pgs or (None,):
            cells = [r.job_id, str(r.rank), r.status,
                     "" if r.heartbeat_age is None else f"{r.heartbeat_age:.1f}s",
                     _activity_text(r.activity, snap.time)]
            if pg is None:
                cells += ["", "", "", "", "", ""]
            else:
                oldest = pg.oldest_inflight
                age = f"{oldest.op} #{oldest.seq} for {snap.time - oldest.created:.0f}s" if (
                    oldest is not None and pg.inflight_count) else ""
                if age and pg.stuck_threshold_seconds is not None:
                    age += f" (threshold {pg.stuck_threshold_seconds:.0f}s)"
                cells += [pg.name if len(pg.name) <= 12 else pg.name[:10] + "…", pg.desc,
                          str(pg.last_enqueued), str(pg.last_completed), str(pg.inflight_count), age]
            row = "<tr class='culprit'>" if culprit else "<tr>"
            rows.append(row + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>")
        if len(pgs) < len(r.pgs):
            rows.append(f"<tr><td colspan='11'>… {len(r.pgs) - len(pgs)} more process groups of rank {r.rank} "
                        "not listed</td></tr>")
    if len(snap.ranks) > MAX_LISTED_RANKS:
        rows.append(f"<tr><td colspan='11'>… {len(snap.ranks) - MAX_LISTED_RANKS} more ranks not listed</td></tr>")
    verdicts = "".join(f"<li><b>{e(v.kind)}</b>: {e(v.summary)}{e(_budget_text(v))}</li>"
                       for v in snap.verdicts[:MAX_LISTED_VERDICTS]) or "<li>none: no rank is stuck</li>"
    if len(snap.verdicts) > MAX_LISTED_VERDICTS:
        verdicts += f"<li>… {len(snap.verdicts) - MAX_LISTED_VERDICTS} more verdicts not listed</li>"
    sources = ", ".join(f"{e(s.name)}={'up' if s.up else 'DOWN: ' + e(s.last_error)}" for s in snap.sources)
    head = ["job", "rank", "status", "heartbeat age", "activity", "pg", "desc", "enqueued", "completed", "in flight",
            "oldest in flight"]
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>frexporter</title>"
        f"<meta http-equiv='refresh' content='{PAGE_REFRESH_SECONDS}'>"
        "<style>body{font-family:sans-serif}td,th{padding:2px 8px;border-bottom:1px solid #ddd}"
        "tr.culprit{background:#fdd;font-weight:bold}</style>"
        f"</head><body><h1>frexporter on {e(snap.hostname)}</h1><h2>Verdicts</h2><ul>{verdicts}</ul>"
        f"<h2>Ranks</h2><table><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{''.join(rows)}</table>"
        f"<p>Sources: {sources}</p><p><a href='/metrics'>/metrics</a> · "
        "<a href='/api/v1/status'>/api/v1/status</a> · <a href='/healthz'>/healthz</a></p></body></html>"
    )
