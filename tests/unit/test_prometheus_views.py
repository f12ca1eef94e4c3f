"""What people read out of Prometheus, with canned query answers instead of a Prometheus: how
``promview.rebuild`` reads series (membership, duplicates, heartbeats, activity) and how ``prometheus.fetch``
quotes the job.

The same views against a real Prometheus scraping a real gloo job are in tests/e2e/test_prometheus_views.py.
"""

from __future__ import annotations

import http.server
import json
import re
import threading
import urllib.parse
from typing import Any
from unittest import mock

import pytest

from frexporter import naming as n
from frexporter.analysis.kinds import MISSING_RANK, RANK_ABSENT
from frexporter.analysis.verdicts import VerdictConfig, evaluate
from frexporter.model import RANK_OK, RANK_UNRESPONSIVE
from frexporter.postmortem import prometheus, promview, report
from frexporter.postmortem.promview import Query

# --- how promview.rebuild reads series (canned answers) -------------------------------------------------------

NOW = 1_700_000_000.0


def _sample(metric: str, value: float, scraped: float, **labels: str) -> dict[str, Any]:
    # "_scraped" is the fake's own: the sample's timestamp, which only timestamp() reveals.
    return {"metric": {"__name__": metric, "job": "frexporter", **labels}, "value": [NOW, repr(value)],
            "_scraped": scraped}


def _pg(metric: str, value: float, rank: int, instance: str = "node0:9400", scraped: float = NOW - 1,
        **extra: str) -> dict[str, Any]:
    return _sample(metric, value, scraped, job_id="j", rank=str(rank), pg="0", pg_desc="default_pg",
                   instance=instance, **extra)


def _pg_static(metric: str, value: float, instance: str = "node0:9400", scraped: float = NOW - 1,
               **extra: str) -> dict[str, Any]:
    """A PG fact the exporter reports once per node, without a rank."""
    return _sample(metric, value, scraped, job_id="j", pg="0", pg_desc="default_pg", instance=instance, **extra)


def _rank(metric: str, value: float, rank: int, instance: str = "node0:9400", scraped: float = NOW - 1,
          **extra: str) -> dict[str, Any]:
    return _sample(metric, value, scraped, job_id="j", rank=str(rank), instance=instance, **extra)


_ACTIVE_SIGNS = (n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, n.PG_WAIT_START_TIMESTAMP_SECONDS,
                 n.RANK_COLLECTIVE_WAIT_SECONDS, n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS)


def _by_pg(found: list[dict[str, Any]], value: Any) -> list[dict[str, Any]]:
    """An aggregation by (job_id, pg, ...) as Prometheus answers it: a sample per group, ``value(samples)``."""
    groups: dict[tuple[str, str], list[float]] = {}
    for s in found:
        groups.setdefault((s["metric"]["job_id"], s["metric"]["pg"]), []).append(float(s["value"][1]))
    return [{"metric": {"job_id": job, "pg": pg}, "value": [NOW, repr(value(values))]}
            for (job, pg), values in groups.items()]


def _answers(samples: list[dict[str, Any]], pgs: str | None = None) -> dict[Query, list[dict[str, Any]]]:
    """What prometheus.fetch returns for samples of one job: each query's, those of its metric (of the PGs the
    regular expression ``pgs`` matches, when given), aggregated as its PromQL says; timestamp()'s carry when the
    sample was scraped, and a sample marked ``_past`` was seen in the window (max_over_time) only, not now."""
    out: dict[Query, list[dict[str, Any]]] = {}
    for q in Query:
        found = [s for s in samples if s["metric"]["__name__"] == q.metric
                 and (q is Query.BUSY_LATELY or not s.get("_past"))
                 and (pgs is None or re.fullmatch(pgs, s["metric"].get("pg", "")))]
        if q is Query.PG_ACTIVE:  # every PG: its signs of activity, else its members in flight
            signs = _by_pg([s for s in samples if s["metric"]["__name__"] in _ACTIVE_SIGNS], len)
            marked = {(s["metric"]["job_id"], s["metric"]["pg"]) for s in signs}
            out[q] = signs + [s for s in _by_pg(found, lambda values: sum(v > 0 for v in values))
                              if (s["metric"]["job_id"], s["metric"]["pg"]) not in marked]
        elif q is Query.JOB_STUCK_CEILING:  # max by (job_id) (min by (job_id, pg) (x > 0))
            shortest = _by_pg([s for s in found if float(s["value"][1]) > 0], min)
            out[q] = [{"metric": {"job_id": "j"}, "value": [NOW, repr(max(float(s["value"][1]) for s in shortest))]}
                      ] if shortest else []
        elif q is Query.PG_INFO:  # group by (job_id, pg, size)
            sizes = {(s["metric"]["job_id"], s["metric"]["pg"], s["metric"].get("size")) for s in found}
            out[q] = [{"metric": {"job_id": job, "pg": pg, **({"size": size} if size is not None else {})},
                       "value": [NOW, "1"]} for job, pg, size in sizes]
        elif q in (Query.PG_TIMEOUT, Query.PG_STUCK_THRESHOLD, Query.PG_STUCK_CEILING):  # min by (...) (x > 0)
            out[q] = _by_pg([s for s in found if float(s["value"][1]) > 0], min)
        elif q is Query.SCRAPED:  # like Prometheus: the name is dropped, the value is when the sample was scraped
            out[q] = [{"metric": {k: v for k, v in s["metric"].items() if k != "__name__"},
                       "value": [NOW, repr(s["_scraped"])]} for s in found]
        elif q is Query.NODE_NOW:  # the node's clock at the poll, plus Prometheus' time since its scrape
            out[q] = [{"metric": {k: v for k, v in s["metric"].items() if k != "__name__"},
                       "value": [NOW, repr(float(s["value"][1]) + NOW - s["_scraped"])]} for s in found]
        else:
            out[q] = [{"metric": s["metric"], "value": s["value"]} for s in found]
    return out


def _served(samples: list[dict[str, Any]]) -> Any:
    """prometheus.fetch standing in for the server, for report.from_prometheus."""
    return mock.patch.object(prometheus, "fetch", lambda *_a, **_k: _answers(samples))


def _rank_series(rank: int, enq: int, done: int, world: int = 3, instance: str = "node0:9400",
                 heartbeat: float = NOW - 1.5, oldest: float | None = None) -> list[dict[str, Any]]:
    """What one exporter reports for one rank of a job whose only PG is WORLD."""
    out = [
        _rank(n.RANK_UP, 1, rank, instance),
        _rank(n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, heartbeat, rank, instance),
        _rank(n.RANK_INFO, 1, rank, instance, world_size=str(world), local_rank=str(rank)),
        _pg_static(n.PG_INFO, 1, instance, size=str(world), backend="nccl"),
        _pg(n.PG_LAST_ENQUEUED_SEQ, enq, rank, instance),
        _pg(n.PG_LAST_COMPLETED_SEQ, done, rank, instance),
        _pg(n.PG_INFLIGHT_COLLECTIVES, enq - done, rank, instance),
        _pg_static(n.PG_TIMEOUT_SECONDS, 600, instance),
    ]
    if oldest is not None:
        out.append(_pg(n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, oldest, rank, instance))
    return out


def _states(samples: list[dict[str, Any]]) -> tuple[Any, ...]:
    return promview.rebuild(_answers(samples), NOW).ranks


def test_a_rank_without_series_is_still_a_member_of_the_world_pg() -> None:
    # Rank 2's node exporter is gone: ranks 0 and 1 wait in collective 8, which rank 2 never reported.
    samples = [*_rank_series(0, 8, 7, oldest=NOW - 100), *_rank_series(1, 8, 7, oldest=NOW - 100)]
    states = _states(samples)
    assert [pg.ranks for r in states for pg in r.pgs] == [(0, 1, 2), (0, 1, 2)]
    verdicts = evaluate(states, NOW, VerdictConfig(stuck_after=30, complete_view=True))
    assert [(v.kind, v.ranks) for v in verdicts] == [(MISSING_RANK, (2,))], verdicts


def test_a_rank_reported_by_two_exporters_is_read_from_the_fresher() -> None:
    # A sidecar and a node exporter both read rank 1, and "b" is 20 s behind. Series come back sorted by
    # labels, so reading "the last one" takes b's seqs, and a's in-flight start on top of them.
    samples = [
        *_rank_series(0, 9, 8, oldest=NOW - 100),
        *_rank_series(1, 9, 8, instance="a:9400", heartbeat=NOW - 1.2, oldest=NOW - 100),
        *_rank_series(1, 8, 8, instance="b:9400", heartbeat=NOW - 20),
    ]
    rank1 = next(r for r in _states(samples) if r.rank == 1)
    assert [(pg.last_enqueued, pg.last_completed, pg.inflight_count) for pg in rank1.pgs] == [(9, 8, 1)]
    assert rank1.pgs[0].inflight[0].created == NOW - 100
    assert rank1.heartbeat == NOW - 1.2


def test_job_id_is_quoted_in_promql() -> None:
    asked: list[str] = []

    def record(_url: str, promql: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        asked.append(promql)
        return []

    with mock.patch.object(prometheus, "query", record):
        assert prometheus.rank_states("http://prometheus", 'a"b\\c', NOW) == ()
    # No PG is active: none of their series is asked, and no heartbeat needs its scrape time.
    assert len(asked) == len(Query) - len(promview.LATER)
    per_node = {Query.POLL.promql("{}"), Query.NODE_NOW.promql("{}")}  # every exporter's, none has a job id
    assert all('{job_id="a\\"b\\\\c"' in q for q in asked if q not in per_node), asked


def test_heartbeat_staleness_is_judged_at_the_scrape() -> None:
    # Prometheus scrapes every 60 s: at query time a healthy rank's heartbeat is up to 60 s old, but it
    # was fresh when scraped. Rank 1's was already 40 s stale at its scrape: wedged.
    scraped = NOW - 55
    samples = [
        _rank(n.RANK_UP, 1, 0, scraped=scraped),
        _rank(n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, scraped - 1, 0, scraped=scraped),
        _rank(n.RANK_UP, 1, 1, scraped=scraped),
        _rank(n.RANK_HEARTBEAT_TIMESTAMP_SECONDS, scraped - 40, 1, scraped=scraped),
    ]
    status = {r.rank: r.status for r in _states(samples)}
    assert status == {0: RANK_OK, 1: RANK_UNRESPONSIVE}


def _clock(instance: str, offset: float, scraped: float = NOW - 1) -> dict[str, Any]:
    """An exporter's frexporter_poll_timestamp_seconds: its node's clock, ``offset`` ahead of Prometheus' and the
    caller's, at a poll just before the scrape."""
    return _sample(n.POLL_TIMESTAMP_SECONDS, scraped + offset, scraped, instance=instance)


def test_analyze_prometheus_ages_each_node_s_timestamps_on_its_own_clock() -> None:
    # node-a's clock is 120 s behind, node-b's 120 s ahead, and so is every timestamp each exports. Ranks 0 and
    # 1 (node-b) wait in collective 8 since 40 s on node-b's clock; rank 2 (node-a) never enqueued it. Every
    # heartbeat was half a second old at its poll. Taken against one clock, node-a's healthy rank was 120 s
    # stale (unresponsive) and node-b's wait began in the future (no hang).
    a, b = "node-a:9400", "node-b:9400"
    samples = [_clock(a, -120), _clock(b, 120),
               *_rank_series(0, 8, 7, instance=b, heartbeat=NOW + 120 - 1.5, oldest=NOW + 120 - 40),
               *_rank_series(1, 8, 7, instance=b, heartbeat=NOW + 120 - 1.5, oldest=NOW + 120 - 40),
               *_rank_series(2, 7, 7, instance=a, heartbeat=NOW - 120 - 1.5)]
    with _served(samples), mock.patch("time.time", return_value=NOW):
        found = report.from_prometheus("http://prometheus", "j", stuck_after=30)
    ranks = {r.rank: r for r in found.ranks}
    assert {rank: (r.status, r.heartbeat, r.heartbeat_age) for rank, r in ranks.items()} == dict.fromkeys(
        (0, 1, 2), (RANK_OK, NOW - 1.5, 0.5))
    assert ranks[0].pgs[0].inflight[0].created == NOW - 40  # on the caller's clock
    assert [(v.kind, v.ranks) for v in found.verdicts] == [(MISSING_RANK, (2,))], found.verdicts
    # A rank wedged on node-a: its heartbeat stopped 45 s before the poll, on node-a's clock.
    wedged = [*samples[:-len(_rank_series(2, 7, 7))], *_rank_series(2, 7, 7, instance=a, heartbeat=NOW - 120 - 46)]
    state = next(r for r in _states(wedged) if r.rank == 2)
    assert (state.status, state.heartbeat_age) == (RANK_UNRESPONSIVE, 46)


def test_analyze_prometheus_names_the_absent_ranks() -> None:
    # A world of 4: ranks 0 and 1 report and wait in collective 8; ranks 2 and 3 never reported anything.
    samples = [*_rank_series(0, 8, 7, world=4, oldest=NOW - 100), *_rank_series(1, 8, 7, world=4, oldest=NOW - 100)]
    with _served(samples), mock.patch("time.time", return_value=NOW):
        found = report.from_prometheus("http://prometheus", "j", stuck_after=30)
    absent = [v for v in found.verdicts if v.kind == RANK_ABSENT]
    assert [(v.ranks, v.waiting_ranks) for v in absent] == [((2, 3), (0, 1))], found.verdicts
    assert "rank_absent: job j, culprit rank(s) 2,3" in report.render_text(found)
    # All of the world reporting: nothing absent.
    full = [*samples, *_rank_series(2, 8, 8, world=4), *_rank_series(3, 8, 8, world=4)]
    with _served(full):
        assert not [v for v in report.from_prometheus("http://prometheus", "j", 30).verdicts if v.kind == RANK_ABSENT]


def test_analyze_prometheus_says_what_the_culprit_is_doing() -> None:
    # Rank 2 never joined collective 8; its node's exporter saw it busy in save_checkpoint. A bad label value
    # (not a state) is ignored, not trusted.
    samples = [*_rank_series(0, 8, 7, oldest=NOW - 100), *_rank_series(1, 8, 7, oldest=NOW - 100),
               *_rank_series(2, 7, 7),
               _rank(n.VERDICT, 1, 2, kind=MISSING_RANK, pg="0", culprit_state="busy",
                     culprit_function="save_checkpoint"),
               _rank(n.VERDICT, 1, 1, kind=MISSING_RANK, pg="0", culprit_state="<script>", culprit_function="x")]
    states = {r.rank: r for r in _states(samples)}
    assert states[2].activity.state == "busy" and states[2].activity.headline() == ("save_checkpoint", "", 0)
    assert states[1].activity.state == "unknown"
    (v,) = evaluate(states.values(), NOW, VerdictConfig(stuck_after=30, complete_view=True))
    assert v.ranks == (2,) and v.activity["2"].state == "busy"
    assert v.summary.endswith("Rank 2 has been busy in save_checkpoint.")


def test_analyze_prometheus_reads_the_waits_where_the_alerting_recipe_dropped_the_seqs_it_reads() -> None:
    """docs/scale.md's alerting recipe drops the completed seqs, in-flight counts and starts: the exporters' waits
    (written for ranks that waited half their PG's threshold) say who waits on what since when."""
    dropped = {n.PG_LAST_COMPLETED_SEQ, n.PG_INFLIGHT_COLLECTIVES, n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS}
    full = [*_rank_series(0, 8, 7, oldest=NOW - 100), *_rank_series(1, 8, 7, oldest=NOW - 100),
            *_rank_series(2, 7, 7), _pg_static(n.PG_STUCK_THRESHOLD_SECONDS, 10)]
    waits = [m for r in (0, 1)
             for m in (_pg(n.PG_WAIT_SEQ, 8, r), _pg(n.PG_WAIT_START_TIMESTAMP_SECONDS, NOW - 100, r))]
    kept = [s for s in full if s["metric"]["__name__"] not in dropped]
    assert len(kept) < len(full)

    def analyze(samples: list[dict[str, Any]]) -> report.Report:
        with _served(samples), mock.patch("time.time", return_value=NOW):
            return report.from_prometheus("http://prometheus", "j", stuck_after=60)

    found = {name: analyze(samples).verdicts for name, samples in
             (("all", [*full, *waits]), ("recipe", [*kept, *waits]), ("recipe, no waits", kept))}
    assert [(v.kind, v.ranks, v.seq) for v in found["all"]] == [(MISSING_RANK, (2,), 8)], found
    assert [(v.kind, v.ranks, v.seq, round(v.age_seconds)) for v in found["recipe"]] == [
        (v.kind, v.ranks, v.seq, round(v.age_seconds)) for v in found["all"]]
    assert found["recipe, no waits"] == ()  # nothing says anyone waits


def test_analyze_prometheus_uses_the_learned_threshold_and_shows_a_wait_below_it() -> None:
    # Ranks 0 and 1 wait in collective 8 since 20 s; rank 2 never enqueued it.
    samples = [*_rank_series(0, 8, 7, oldest=NOW - 20), *_rank_series(1, 8, 7, oldest=NOW - 20),
               *_rank_series(2, 7, 7)]

    def analyze(extra: list[dict[str, Any]]) -> report.Report:
        with _served([*samples, *extra]), mock.patch("time.time", return_value=NOW):
            return report.from_prometheus("http://prometheus", "j", stuck_after=60)

    # The exporters learned 10 s (node1's 25 s loses to the shortest): blamed now, as the alert does.
    learned = analyze([_pg_static(n.PG_STUCK_THRESHOLD_SECONDS, 10, "node0:9400"),
                       _pg_static(n.PG_STUCK_THRESHOLD_SECONDS, 25, "node1:9400")])
    assert [(v.kind, v.ranks) for v in learned.verdicts] == [(MISSING_RANK, (2,))], learned.verdicts
    # Without the series (an older exporter): --stuck-after; the wait is shown, never "nothing found".
    for extra, threshold in (([], 60), ([_pg_static(n.PG_STUCK_THRESHOLD_SECONDS, 30, "node0:9400")], 30)):
        found = analyze(extra)
        assert found.verdicts == ()
        text = report.render_text(found)
        assert "no stuck collective found" not in text
        assert (f"waiting: job j, PG 0 (default_pg), collective #8: ranks 0,1 wait on rank(s) 2 for 20s "
                f"(threshold {threshold}s)") in text, text


def test_analyze_prometheus_gives_a_busy_culprit_the_ceiling_and_an_idle_one_the_learned_threshold() -> None:
    # As FrexporterCollectiveDesync does: ranks 0 and 1 wait in collective 8 for rank 2, which never enqueued
    # it. The exporters learned 10 s for the PG and the shortest --stuck-after among them (the ceiling) is 30 s;
    # what rank 2 is doing (its activity series) decides which of the two the wait is judged against.
    pg = [_pg_static(n.PG_STUCK_THRESHOLD_SECONDS, 10), _pg_static(n.PG_STUCK_CEILING_SECONDS, 30),
          _pg_static(n.PG_STUCK_CEILING_SECONDS, 300, instance="node1:9400")]

    def analyze(waited: float, *extra: dict[str, Any], stuck_after: float | None = None) -> report.Report:
        samples = [*_rank_series(0, 8, 7, oldest=NOW - waited), *_rank_series(1, 8, 7, oldest=NOW - waited),
                   *_rank_series(2, 7, 7), *pg, *extra]
        with _served(samples), mock.patch("time.time", return_value=NOW):
            return report.from_prometheus("http://prometheus", "j", stuck_after)

    def doing(state: str, since: float = NOW - 40) -> dict[str, Any]:
        return _rank(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, since, 2, state=state)

    # Busy for 20 s of wait: above the learned 10 s, below the 30 s ceiling: a wait, not a hang.
    busy = analyze(20, doing("busy"))
    assert busy.verdicts == (), busy.verdicts
    text = report.render_text(busy)
    assert ("waiting: job j, PG 0 (default_pg), collective #8: ranks 0,1 wait on rank(s) 2 (busy) for 20s "
            "(threshold 30s)") in text, text
    assert next(r for r in busy.ranks if r.rank == 2).activity.since == NOW - 40
    # Past the ceiling, busy or not, it is a hang; also where analyze is given a longer --stuck-after.
    assert [(v.kind, v.ranks) for v in analyze(31, doing("busy")).verdicts] == [(MISSING_RANK, (2,))]
    assert [(v.kind, v.ranks) for v in analyze(31, doing("busy"), stuck_after=60).verdicts] == [
        (MISSING_RANK, (2,))]
    # Idle (or wedged, gone, unknown, blocked in another collective): the learned threshold.
    for state in ("idle", "wedged", "unknown", "in_collective"):
        hung = analyze(20, doing(state))
        assert [(v.kind, v.ranks, v.seq, v.pg) for v in hung.verdicts] == [(MISSING_RANK, (2,), 8, "0")], state
        if state != "unknown":
            assert f"missing_rank: job j, PG 0 (default_pg), collective #8, culprit rank(s) 2 ({state})" in (
                report.render_text(hung)), report.render_text(hung)
    # The state a rank left can linger a scrape next to its new one: the newest begun is current.
    assert analyze(20, doing("idle", NOW - 60), doing("busy", NOW - 25)).verdicts == ()
    # Idle now, busy within the last minute (CPU use at the busy line): still held, as the alert holds it.
    flipped = analyze(20, doing("idle", NOW - 5), {**doing("busy", NOW - 40), "_past": True})
    assert flipped.verdicts == (), flipped.verdicts
    assert "wait on rank(s) 2 (idle) for 20s (threshold 30s)" in report.render_text(flipped)
    # The exporters' ceiling holds when it is above analyze's default --stuck-after (60 s); a --stuck-after
    # given to analyze caps it.
    pg[1] = _pg_static(n.PG_STUCK_CEILING_SECONDS, 300)
    assert analyze(90, doing("busy")).verdicts == ()
    assert [v.ranks for v in analyze(90, doing("busy"), stuck_after=60).verdicts] == [(2,)]


def test_analyze_prometheus_without_activity_series_judges_as_before() -> None:
    # An older exporter exports neither the activity series nor the ceiling: the culprit's state comes from
    # the exporter's own verdict (culprit_state), and a busy culprit gets analyze's --stuck-after.
    samples = [*_rank_series(0, 8, 7, oldest=NOW - 20), *_rank_series(1, 8, 7, oldest=NOW - 20),
               *_rank_series(2, 7, 7), _pg_static(n.PG_STUCK_THRESHOLD_SECONDS, 10)]
    verdict = _rank(n.VERDICT, 1, 2, kind=MISSING_RANK, pg="0", culprit_state="busy", culprit_function="save")

    def analyze(*extra: dict[str, Any]) -> report.Report:
        with _served([*samples, *extra]), mock.patch("time.time", return_value=NOW):
            return report.from_prometheus("http://prometheus", "j")

    assert [v.ranks for v in analyze().verdicts] == [(2,)]  # nothing known of rank 2: the learned 10 s
    held = analyze(verdict)
    assert held.verdicts == ()
    assert "wait on rank(s) 2 (busy) for 20s (threshold 60s)" in report.render_text(held)
    # Where both say something, the activity series' state wins and the verdict's function goes with it
    # only when the two agree.
    current = analyze(verdict, _rank(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, NOW - 30, 2, state="busy"))
    activity = next(r for r in current.ranks if r.rank == 2).activity
    assert (activity.state, activity.headline(), activity.since) == ("busy", ("save", "", 0), NOW - 30)
    changed = analyze(verdict, _rank(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS, NOW - 3, 2, state="idle"))
    assert next(r for r in changed.ranks if r.rank == 2).activity.frames == ()
    assert [v.ranks for v in changed.verdicts] == [(2,)]


# --- several servers (the shards of a tiered layout) ------------------------------------------------------------


def _servers(held: dict[str, list[dict[str, Any]]], asked: list[tuple[str, str]]) -> Any:
    """prometheus.query standing in for several servers: each answers from the samples it holds (``held``, by
    URL), as _answers reads them, and every (URL, PromQL) asked is recorded in ``asked``."""
    by_promql = {q.promql('{job_id="j"}'): q for q in Query}

    def query(url: str, promql: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        asked.append((url, promql))
        if url not in held:
            raise prometheus.PrometheusError(f"{url}: connection refused")
        pgs = re.search(r'pg=~("(?:[^"\\]|\\.)*")', promql)
        general = re.sub(r', pg=~"(?:[^"\\]|\\.)*"', "", promql)
        return _answers(held[url], json.loads(pgs.group(1)) if pgs else None)[by_promql[general]]

    return mock.patch.object(prometheus, "query", query)


def test_analyze_prometheus_judges_a_job_over_every_shard() -> None:
    # Ranks 0 and 1 (node0, on shard a) wait in collective 8; rank 2 (node1, on shard b) never enqueued it.
    held = {"http://a": [*_rank_series(0, 8, 7, oldest=NOW - 100), *_rank_series(1, 8, 7, oldest=NOW - 100)],
            "http://b": _rank_series(2, 7, 7, instance="node1:9400")}
    asked: list[tuple[str, str]] = []
    with _servers(held, asked), mock.patch("time.time", return_value=NOW):
        found = report.from_prometheus(["http://a", "http://b"], "j", stuck_after=30)
        one = report.from_prometheus("http://a", "j", stuck_after=30)
    assert [(v.kind, v.ranks) for v in found.verdicts] == [(MISSING_RANK, (2,))], found.verdicts
    assert sorted(r.rank for r in found.ranks) == [0, 1, 2] and found.source == "http://a, http://b"
    # Every query (but the rates: no arrivals) went to both servers, the same ones.
    both = asked[:2 * (len(Query) - 1)]
    assert sorted(p for u, p in both if u == "http://a") == sorted(p for u, p in both if u == "http://b")
    assert len({p for _, p in both}) == len(Query) - 1
    # Shard a alone holds no series of rank 2: it reports nothing there.
    assert sorted(r.rank for r in one.ranks) == [0, 1]
    assert (RANK_ABSENT, (2,)) in [(v.kind, v.ranks) for v in one.verdicts], one.verdicts


def test_analyze_prometheus_fails_clearly_when_one_shard_does_not_answer() -> None:
    held = {"http://a": _rank_series(0, 8, 7, oldest=NOW - 100)}
    with _servers(held, []), pytest.raises(prometheus.PrometheusError, match="http://gone: connection refused"):
        report.from_prometheus(["http://a", "http://gone"], "j", stuck_after=30)


def test_rates_are_asked_only_when_some_rank_reports_arrivals() -> None:
    samples = _rank_series(0, 8, 7, oldest=NOW - 100)  # in flight: its PG is active
    rate = Query.PG_RATE.promql('{job_id="j", pg=~"0"}')
    asked: list[tuple[str, str]] = []
    with _servers({"http://a": samples}, asked):
        prometheus.fetch("http://a", "j")
    assert rate not in {promql for _, promql in asked} and len(asked) == len(Query) - 1
    asked.clear()
    arrivals = [_pg(n.RANK_COLLECTIVE_ARRIVAL_TIMESTAMP_SECONDS, NOW - 3, 0)]
    with _servers({"http://a": [*samples, *arrivals]}, asked):
        got = prometheus.fetch("http://a", "j")
    assert [promql for _, promql in asked].count(rate) == 1 and len(asked) == len(Query)
    assert got[Query.PG_ARRIVAL] and set(got) == set(Query)


# --- the ranks' series of the active PGs only ---------------------------------------------------------------------


def _in_pg(pg: str, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``samples`` with every PG label set to ``pg``."""
    return [{**s, "metric": {**s["metric"], "pg": pg}} if "pg" in s["metric"] else s for s in samples]


def _job_with_an_idle_pg(idle: str = "idle") -> list[dict[str, Any]]:
    """Ranks 0 and 1 wait in collective 8 of PG "0" on rank 2, which never enqueued it; all three also share a PG
    with nothing in flight (at different seqs: only the in-flight collective says what is active)."""
    waiting = [*_rank_series(0, 8, 7, oldest=NOW - 100), *_rank_series(1, 8, 7, oldest=NOW - 100),
               *_rank_series(2, 7, 7, instance="node1:9400")]
    ranks = {s["metric"].get("rank") for s in waiting}
    seqs = {"0": (5, 5, 0), "1": (5, 5, 0), "2": (4, 4, 0)}  # enqueued, completed, in flight
    idle_pg = _in_pg(idle, [_pg(metric, seqs[r][i], int(r), instance="node1:9400" if r == "2" else "node0:9400")
                            for r in sorted(r for r in ranks if r is not None)
                            for i, metric in enumerate((n.PG_LAST_ENQUEUED_SEQ, n.PG_LAST_COMPLETED_SEQ,
                                                        n.PG_INFLIGHT_COLLECTIVES))])
    statics = _in_pg(idle, [s for s in waiting if s["metric"]["__name__"] in (n.PG_INFO, n.PG_TIMEOUT_SECONDS)])
    return [*waiting, *idle_pg, *statics]


def test_only_the_active_pgs_ranks_series_are_read_and_the_verdicts_are_those_of_reading_all() -> None:
    samples = _job_with_an_idle_pg('i.d|le"')  # a name with regex and string specials, selected exactly
    asked: list[tuple[str, str]] = []
    everything: list[tuple[str, str]] = []
    with _servers({"http://a": samples}, asked), mock.patch("time.time", return_value=NOW):
        narrowed = report.from_prometheus("http://a", "j", stuck_after=30)
    with _servers({"http://a": samples}, everything), mock.patch("time.time", return_value=NOW):
        every = report.from_prometheus("http://a", "j", stuck_after=30, narrow=False)
    of_pgs = {q.promql("{}").split("{")[0] for q in promview.OF_ACTIVE_PGS}
    narrowed_pg_queries = [p for _, p in asked if p.split("{")[0] in of_pgs]
    # Every query of a PG's series but the rates (no arrivals), each of the active PG only.
    assert len(narrowed_pg_queries) == len(promview.OF_ACTIVE_PGS) - 1
    assert all('{job_id="j", pg=~"0"}' in p for p in narrowed_pg_queries), narrowed_pg_queries
    assert not [p for _, p in everything if "pg=~" in p] and len(everything) == len(asked)
    assert [v.to_json() for v in narrowed.verdicts] == [v.to_json() for v in every.verdicts]
    assert [(v.kind, v.pg, v.ranks) for v in narrowed.verdicts] == [(MISSING_RANK, "0", (2,))]
    assert {pg.name for r in narrowed.ranks for pg in r.pgs} == {"0"}
    assert {pg.name for r in every.ranks for pg in r.pgs} == {"0", 'i.d|le"'}
    assert narrowed.unread_pgs == 1 and every.unread_pgs == 0
    assert report.render_text(narrowed).splitlines()[0] == (
        "http://a: 3 ranks, 2 process groups (1 idle: nothing in flight, not read rank by rank)")
    assert report.render_text(every).splitlines()[0] == "http://a: 3 ranks, 2 process groups"


def test_a_job_with_nothing_in_flight_reads_no_series_per_rank_and_pg() -> None:
    samples = [*_rank_series(0, 8, 8, world=2), *_rank_series(1, 8, 8, world=2)]
    asked: list[tuple[str, str]] = []
    with _servers({"http://a": samples}, asked), mock.patch("time.time", return_value=NOW):
        found = report.from_prometheus("http://a", "j", stuck_after=30)
    per_rank = {q.promql("{}").split("{")[0] for q in promview.OF_ACTIVE_PGS}
    assert not [p for _, p in asked if p.split("{")[0] in per_rank]
    assert sorted(r.rank for r in found.ranks) == [0, 1] and found.verdicts == () and found.unread_pgs == 1


def test_past_the_named_pgs_bound_every_pg_is_read() -> None:
    samples = _job_with_an_idle_pg()
    many = [s for k in range(3) for s in _in_pg(f"busy{k}", [x for x in samples if x["metric"].get("pg") == "0"])]
    asked: list[tuple[str, str]] = []
    with _servers({"http://a": [*samples, *many]}, asked), mock.patch.object(prometheus, "MAX_NAMED_PGS", 3):
        prometheus.fetch("http://a", "j")
    enqueued = [p for _, p in asked if p.startswith(n.PG_LAST_ENQUEUED_SEQ)]
    assert enqueued == [Query.PG_ENQUEUED.promql('{job_id="j"}')]  # 4 active PGs: all of them, unnamed


def test_pg_names_become_an_exact_regular_expression() -> None:
    names = ["0", "a.b", "x|y", "(p)", "q*", "[r]", "{s}", "t^$", "u\\v", "w+?", 'z"']
    pattern = prometheus._alternatives(names)
    assert all(re.fullmatch(pattern, name) for name in names)
    assert not any(re.fullmatch(pattern, other) for other in ("axb", "x", "y", "p", "qq", "r", "", "u\\\\v"))


def test_a_long_query_is_sent_in_a_post_body_and_a_short_one_in_the_url() -> None:
    got: list[tuple[str, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, form: str) -> None:
            got.append((self.command, urllib.parse.parse_qs(form)["query"][0]))
            body = b'{"status": "success", "data": {"resultType": "vector", "result": []}}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._answer(urllib.parse.urlsplit(self.path).query)

        def do_POST(self) -> None:
            assert self.headers["Content-Type"] == "application/x-www-form-urlencoded"
            self._answer(self.rfile.read(int(self.headers["Content-Length"])).decode())

        def log_message(self, *_args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        long = Query.PG_ENQUEUED.promql(prometheus._selector("j", [f"tp{i}" for i in range(4096)]))
        assert prometheus.query(url, "up") == [] and prometheus.query(url, long) == []
    finally:
        server.shutdown()
        server.server_close()
    assert got == [("GET", "up"), ("POST", long)]
