"""`frexporter analyze --prometheus` against a hostile or broken server: every answer is bounded before it costs.

- time: one deadline per query for the whole exchange (a server that drips a byte at a time), one for all the
  queries of an analysis (a server that answers each just in time);
- memory: an answer's bytes and series (a flood of ``{}``), and what world sizes expand into over all PGs and
  jobs (thousands of PGs claiming 131,072 members), measured in a child process under a memory rlimit;
- labels: integer labels parsed strictly, server text escaped in messages and repaired where it is invalid.

The servers are real sockets on loopback; the memory checks run in a child so that its peak RSS is the analysis's.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_analyze_prometheus_hostile.py.
"""

from __future__ import annotations

import json
from unittest import mock

import pytest

from frexporter import naming as n
from frexporter import safetext
from frexporter.postmortem import promclient, prometheus
from tests.shared.analyze_prometheus_hostile import (
    DEADLINE_S,
    JSON_HEAD,
    MARGIN_S,
    NOW,
    analyze_fake,
    answer,
    dripping,
    rank_series,
    sample,
    serving,
    vector,
    within,
)

# ----------------------------------------------------------------------------------------------- time


def test_a_declared_length_past_the_cap_is_refused_before_the_body() -> None:
    head = JSON_HEAD + f"Content-Length: {prometheus.MAX_RESPONSE_BYTES + 1}\r\n\r\n".encode()
    with serving(dripping(head, b" ")) as url:
        error, elapsed = within(DEADLINE_S + MARGIN_S, lambda: prometheus.query(url, "up", timeout=DEADLINE_S))
    assert isinstance(error, prometheus.PrometheusError), error
    assert f"response larger than {prometheus.MAX_RESPONSE_BYTES} bytes" in str(error)
    assert elapsed < DEADLINE_S / 2


def test_a_broken_status_line_or_url_is_a_prometheus_error() -> None:
    with serving(lambda _q, out, _stop: out.write(b"HELLO\r\n\r\n")) as url, \
            pytest.raises(prometheus.PrometheusError):
        prometheus.query(url, "up", timeout=DEADLINE_S)
    for bad in ("prometheus.example", "localhost:9090", "file:///etc/passwd", "ftp://prometheus/"):
        with pytest.raises(prometheus.PrometheusError, match="not an http:// or https:// URL"):
            prometheus.query(bad, "up")


def test_an_answer_with_more_series_than_the_bound_is_refused() -> None:
    samples = [sample(n.RANK_UP, 1, job_id="j", rank=str(r)) for r in range(11)]
    with mock.patch.object(promclient, "MAX_SERIES", 10):
        assert len(prometheus.parse_query_response(vector(samples[:10]))) == 10
        with pytest.raises(prometheus.PrometheusError, match="more than 10 series"):
            prometheus.parse_query_response(vector(samples))


# --------------------------------------------------------------------------------------------- labels

# What int() takes and no exporter writes: each would merge its series into another rank's (or make one up).
BAD_INTS = ["٣", " 1", "1 ", "1\n", "1_0", "+2", "-1", "01", "1.0", "0x1", "", "2147483648", "12345678901234567890"]


@pytest.mark.parametrize("bad", BAD_INTS, ids=ascii)
def test_a_rank_label_that_is_not_a_decimal_rank_is_a_counted_skipped_series(bad: str) -> None:
    hostile = [s for s in rank_series("j", 0, 4) if "rank" in s["metric"]]
    for s in hostile:
        s["metric"]["rank"] = bad
    found = analyze_fake([*rank_series("j", 3, 4), *hostile])
    assert [r.rank for r in found.ranks] == [3]
    # Each answer that holds one counts it: the heartbeat's twice (its value and its timestamp()).
    assert found.skipped_entries == len(hostile) + 1
    assert found.problems == [f"{len(hostile) + 1} series with a rank label that is not a whole number up to "
                              f'{2**31 - 1}, first: rank="{safetext.printable(bad)}" of {n.RANK_UP}']


def test_ranks_at_the_bounds_are_accepted() -> None:
    found = analyze_fake([*rank_series("j", 0, 4), *rank_series("j", 2**31 - 1, 4)])
    assert [r.rank for r in found.ranks] == [0, 2**31 - 1]
    assert found.problems == []


@pytest.mark.parametrize("label", ["local_rank", "world_size", "pid", "size"])
def test_other_integer_labels_are_parsed_as_strictly(label: str) -> None:
    series = rank_series("j", 0, 4)
    hostile = next(s for s in series if label in s["metric"])
    hostile["metric"][label] = "٣"
    found = analyze_fake(series)
    assert found.skipped_entries == 1
    assert found.problems == [f'1 series with a {label} label that is not a whole number up to {2**31 - 1}, '
                              f'first: {label}="٣" of {hostile["metric"]["__name__"]}']


@pytest.mark.parametrize("value", ["7.5", "1e300", "-2"])
def test_a_seq_that_is_not_a_whole_number_is_a_counted_skipped_series(value: str) -> None:
    series = rank_series("j", 0, 4)
    enqueued = next(s for s in series if s["metric"]["__name__"] == n.PG_LAST_ENQUEUED_SEQ)
    enqueued["value"] = [NOW, value]
    found = analyze_fake(series)
    assert [r.pgs for r in found.ranks] == [()]  # without its enqueued seq the PG says nothing
    assert found.problems == [f"1 series whose value is not a whole number from -1 to {2**53}, "
                              f"first: {value} of {n.PG_LAST_ENQUEUED_SEQ}"]


def test_server_text_in_messages_cannot_break_the_terminal() -> None:
    forged = "bad\x1b]0;owned\x07\nfrexporter analyze: all good\u202e"
    body = json.dumps({"status": "error", "error": forged}).encode()
    with serving(answer(body)) as url, pytest.raises(prometheus.PrometheusError) as error:
        prometheus.query(url, "up", timeout=DEADLINE_S)
    assert safetext.printable(forged) in str(error.value)
    series = rank_series("j", 0, 4)
    for s in series:
        if "rank" in s["metric"]:
            s["metric"]["rank"] = forged
    problems = analyze_fake(series).problems
    assert len(problems) == 1 and safetext.printable(forged) in problems[0]
    assert [m for m in (str(error.value), problems[0]) if safetext.printable(m) != m] == []


def test_lone_surrogates_in_labels_are_repaired_where_parsed() -> None:
    # One spelled as a JSON escape, one as the UTF-8 bytes of a surrogate (which json.loads would pass on).
    escaped = vector([sample(n.RANK_UP, 1, job_id="j\udc80", rank="0")])
    raw = vector([sample(n.RANK_UP, 1, job_id="jX", rank="0")]).replace(b"jX", b"j\xed\xb2\x80")
    for body in (escaped, raw):
        samples = prometheus.parse_query_response(body)
        assert [s["metric"]["job_id"] for s in samples] == ["j\ufffd"], body
