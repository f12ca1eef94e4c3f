"""JSON status API and the human page: plain views of one NodeSnapshot."""

from __future__ import annotations

import html
from typing import Any

from frexporter import __version__
from frexporter.model import NodeSnapshot, PGState, RankState


def _pg_json(pg: PGState, now: float) -> dict[str, Any]:
    oldest = pg.oldest_inflight
    return {
        "pg": pg.name,
        "pg_desc": pg.desc,
        "ranks": list(pg.ranks),
        "backend": pg.backend,
        "last_enqueued_seq": pg.last_enqueued,
        "last_started_seq": pg.last_started,
        "last_completed_seq": pg.last_completed,
        "inflight_collectives": pg.inflight_count,
        "oldest_inflight": None if oldest is None or pg.inflight_count == 0 else {
            "seq": oldest.seq,
            "op": oldest.op,
            "since": oldest.created,
            "age_seconds": round(max(0.0, now - oldest.created), 3),
            "timeout_seconds": oldest.timeout_seconds,
            "input_sizes": [list(s) for s in oldest.input_sizes],
            "input_dtypes": list(oldest.input_dtypes),
        },
        "timeout_seconds": pg.timeout_seconds,
        "last_progress": pg.last_progress,
        "exact": pg.exact,
        "has_p2p": pg.has_p2p,
    }


def _rank_json(r: RankState, now: float) -> dict[str, Any]:
    return {
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
        "heartbeat": r.heartbeat,
        "heartbeat_age_seconds": None if r.heartbeat_age is None else round(r.heartbeat_age, 3),
        "socket_alive": r.socket_alive,
        "last_deep_read": r.last_deep_read,  # when the exporter last read this rank's FR entries over its socket
        "recorder_errors": dict(r.recorder_errors),
        "message": r.message,
        "process_groups": [_pg_json(pg, now) for pg in r.pgs],
    }


def _process_groups(snap: NodeSnapshot) -> list[dict[str, Any]]:
    """Per (job, PG) across the local ranks: who is where, and the skew between them."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r in snap.ranks:
        for pg in r.pgs:
            g = groups.setdefault((r.job_id, pg.name), {
                "job_id": r.job_id, "pg": pg.name, "pg_desc": pg.desc, "size": pg.size,
                "ranks": list(pg.ranks), "local_ranks": {},
            })
            g["local_ranks"][str(r.rank)] = {
                "last_enqueued_seq": pg.last_enqueued,
                "last_completed_seq": pg.last_completed,
                "inflight_collectives": pg.inflight_count,
            }
    out = []
    for g in groups.values():
        enq = [v["last_enqueued_seq"] for v in g["local_ranks"].values()]
        g["enqueued_skew"] = max(enq) - min(enq) if enq else 0
        out.append(g)
    return sorted(out, key=lambda g: (g["job_id"], g["pg"]))


def status_json(snap: NodeSnapshot) -> dict[str, Any]:
    return {
        "version": __version__,
        "hostname": snap.hostname,
        "time": snap.time,
        "ranks": [_rank_json(r, snap.time) for r in snap.ranks],
        "process_groups": _process_groups(snap),
        "verdicts": [v.to_json() for v in snap.verdicts],
        "sources": [
            {"source": s.name, "up": s.up, "duration_seconds": s.duration_seconds,
             "errors_total": dict(s.errors_total), "last_error": s.last_error}
            for s in snap.sources
        ],
    }


def status_html(snap: NodeSnapshot) -> str:
    e = html.escape
    rows = []
    for r in snap.ranks:
        for pg in r.pgs or (None,):
            cells = [r.job_id, str(r.rank), r.status,
                     "" if r.heartbeat_age is None else f"{r.heartbeat_age:.1f}s"]
            if pg is None:
                cells += ["", "", "", "", "", ""]
            else:
                oldest = pg.oldest_inflight
                age = f"{oldest.op} #{oldest.seq} for {snap.time - oldest.created:.0f}s" if (
                    oldest is not None and pg.inflight_count) else ""
                cells += [pg.name if len(pg.name) <= 12 else pg.name[:10] + "…", pg.desc,
                          str(pg.last_enqueued), str(pg.last_completed), str(pg.inflight_count), age]
            rows.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>")
    verdicts = "".join(f"<li><b>{e(v.kind)}</b>: {e(v.summary)}</li>" for v in snap.verdicts) or (
        "<li>none: no rank is stuck</li>")
    sources = ", ".join(f"{e(s.name)}={'up' if s.up else 'DOWN: ' + e(s.last_error)}" for s in snap.sources)
    head = ["job", "rank", "status", "heartbeat age", "pg", "desc", "enqueued", "completed", "in flight",
            "oldest in flight"]
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>frexporter</title>"
        "<style>body{font-family:sans-serif}td,th{padding:2px 8px;border-bottom:1px solid #ddd}</style>"
        f"</head><body><h1>frexporter on {e(snap.hostname)}</h1><h2>Verdicts</h2><ul>{verdicts}</ul>"
        f"<h2>Ranks</h2><table><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{''.join(rows)}</table>"
        f"<p>Sources: {sources}</p><p><a href='/metrics'>/metrics</a> · "
        "<a href='/api/v1/status'>/api/v1/status</a> · <a href='/healthz'>/healthz</a></p></body></html>"
    )
