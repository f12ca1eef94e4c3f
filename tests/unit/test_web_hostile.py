"""Hostile HTTP clients and web configs: name[] floods, rate limits, inline TLS material, TLS versions, headers.

Each test states a bound from the security review (SECURITY.md): a poll's /metrics renderings are shared by
every client asking for the same name[] selection; selections past the cache's bounds render one at a time; a
client cannot starve the poll loop; web config values that could not be honoured are refused at load time.

Its e2e tests (a process started, or longer than about 1 s) are in tests/e2e/test_web_hostile.py.
"""

from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from frexporter.outputs import exposition
from frexporter.outputs.snapshot_metrics import SnapshotCollector
from frexporter.web import server, webconfig
from frexporter.web.webconfig import RateLimit, WebConfig, WebConfigError
from tests.shared.web_hostile import SELECTION, get, query, settled, write_web_config


def _sample_names(body: bytes) -> set[str]:
    return {s.name for family in text_string_to_metric_families(body.decode()) for s in family.samples}


class Counter:
    """Calls to a wrapped function, and how many ran at once at most."""

    def __init__(self) -> None:
        self.calls = 0
        self.running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls += 1
                self.running += 1
                self.most_at_once = max(self.most_at_once, self.running)
            try:
                return real(*args, **kwargs)
            finally:
                with self._lock:
                    self.running -= 1
        return counted


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> tuple[Counter, Counter]:
    """(text renderings, snapshot collections) from here on."""
    renders, collects = Counter(), Counter()
    monkeypatch.setattr(exposition, "encode", renders.wrap(exposition.encode))
    monkeypatch.setattr(SnapshotCollector, "collect", collects.wrap(SnapshotCollector.collect))
    return renders, collects


def _together(count: int, work: Callable[[int], Any]) -> list[Any]:
    """``work(i)`` in ``count`` threads released at once; their results in order."""
    results: list[Any] = [None] * count
    start = threading.Barrier(count)

    def run(i: int) -> None:
        start.wait(timeout=30)
        results[i] = work(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return results


# ---------------------------------------------------------------- name[] renderings per poll


def test_identical_selections_render_once_per_poll(tmp_path: Path, exporter_factory: Any,
                                                   counted: tuple[Counter, Counter]) -> None:
    exp = settled(tmp_path, exporter_factory)
    renders, collects = counted
    renders.calls = collects.calls = 0
    # The same selection in different orders and with repeats is one cache entry: sorted and de-duplicated.
    spellings = [list(SELECTION), list(reversed(SELECTION)), [*SELECTION, SELECTION[0], SELECTION[1]]]
    answers = _together(24, lambda i: get(exp.app.port, query(spellings[i % 3])))
    assert {status for status, _, _ in answers} == {200}
    assert len({body for _, _, body in answers}) == 1
    assert _sample_names(answers[0][2]) == set(SELECTION)
    assert renders.calls == 1 and collects.calls == 1
    # Gzip is the cached body compressed; the whole exposition renders from the same collected families.
    assert get(exp.app.port, query(SELECTION), **{"Accept-Encoding": "gzip"})[1]["content-encoding"] == "gzip"
    assert renders.calls == 1
    assert get(exp.app.port, "/metrics")[0] == 200
    assert renders.calls == 2 and collects.calls == 1
    # A new poll is new data: rendered again, once.
    exp.app.exporter.poll_once()
    _together(8, lambda i: get(exp.app.port, query(SELECTION)))
    assert renders.calls == 3 and collects.calls == 2


def test_selections_past_the_cache_bound_answer_one_at_a_time(tmp_path: Path, exporter_factory: Any,
                                                              counted: tuple[Counter, Counter]) -> None:
    exp = settled(tmp_path, exporter_factory)
    renders, collects = counted
    names = sorted(_sample_names(get(exp.app.port, "/metrics")[2]))
    selections = list(itertools.combinations(names, 2))[:server.MAX_CACHED_NAME_SETS + 16]
    assert len(selections) == server.MAX_CACHED_NAME_SETS + 16, "too few sample names for the test"
    renders.calls = 0
    answers = _together(len(selections), lambda i: get(exp.app.port, query(selections[i])))
    for selection, (status, _, body) in zip(selections, answers, strict=True):
        assert status == 200 and _sample_names(body) == set(selection), selection
    assert renders.calls == len(selections)
    assert renders.most_at_once == 1  # renderings are serialized: one thread's worth of CPU at most
    assert collects.calls == 1  # every selection filters the poll's one collection
    cached = {names for names, _, _ in exp.app.server.httpd.renders._poll.bodies}
    assert len(cached - {None}) == server.MAX_CACHED_NAME_SETS
    # A cached selection costs nothing more; one past the bound is rendered again for each request.
    kept = next(iter(cached - {None}))
    uncached = next(s for s in selections if s not in cached)
    before = renders.calls
    for _ in range(3):
        assert _sample_names(get(exp.app.port, query(kept))[2]) == set(kept)
        assert _sample_names(get(exp.app.port, query(uncached))[2]) == set(uncached)
    assert renders.calls == before + 3


def test_too_many_names_are_refused(tmp_path: Path, exporter_factory: Any, counted: tuple[Counter, Counter]) -> None:
    exp = settled(tmp_path, exporter_factory, ranks=1)
    renders, _ = counted
    renders.calls = 0
    limit = server.MAX_NAMES_PER_REQUEST
    status, headers, body = get(exp.app.port, query([f"m{i}" for i in range(limit + 1)]))
    assert status == 400 and headers["content-type"].startswith("text/plain")
    assert body.decode() == (f"{limit + 1} distinct name[] values: at most {limit} per request "
                             "(leave name[] out for every series)\n")
    # Repeats do not count: the limit is on distinct names.
    assert get(exp.app.port, query([f"m{i}" for i in range(limit)] * 4))[0] == 200
    fields = "&".join(["x=1"] * (server.MAX_QUERY_FIELDS + 1))
    status, _, body = get(exp.app.port, f"/metrics?{fields}")
    assert (status, body) == (400, f"more than {server.MAX_QUERY_FIELDS} query parameters\n".encode())
    assert renders.calls == 1  # only the accepted one rendered


# ---------------------------------------------------------------- rate_limit


def test_rate_limit_is_parsed_as_exporter_toolkit_does(tmp_path: Path) -> None:
    def load(text: str) -> RateLimit | None:
        path = tmp_path / "web.yml"
        path.write_text(text)
        return webconfig.load_web_config(str(path)).rate_limit

    assert load("rate_limit:\n  interval: 1m30s\n  burst: 5\n") == RateLimit(interval=90.0, burst=5)
    assert load("rate_limit:\n  interval: 250ms\n  burst: 1\n") == RateLimit(interval=0.25, burst=1)
    assert load("rate_limit:\n  interval: 0\n  burst: 0\n") is None  # exporter-toolkit: 0 turns it off
    assert load("rate_limit:\n  interval: 0s\n  burst: 3\n") is None
    for text, message in [
        ("rate_limit:\n  interval: 1s\n  burst: 0\n", "rate_limit.burst 0 with interval 1s would refuse every request"),
        ("rate_limit:\n  interval: 5\n  burst: 1\n", "rate_limit.interval must be a duration such as 1s"),
        ("rate_limit:\n  interval: -1s\n  burst: 1\n", "rate_limit.interval must be a duration such as 1s"),
        ("rate_limit:\n  interval: 1s junk\n  burst: 1\n", "rate_limit.interval must be a duration such as 1s"),
        ("rate_limit:\n  interval: 1s\n  burst: -1\n", "rate_limit.burst must be a whole number"),
        ("rate_limit:\n  interval: 1s\n  burst: 1\n  per_ip: true\n", "unknown key 'rate_limit.per_ip'"),
    ]:
        with pytest.raises(WebConfigError, match=message.replace("[", r"\[")):
            load(text)


def test_token_bucket_refills_one_request_per_interval() -> None:
    now = [100.0]
    bucket = server._TokenBucket(RateLimit(interval=2.0, burst=3), monotonic=lambda: now[0])
    assert [bucket.allow() for _ in range(4)] == [0.0, 0.0, 0.0, 2.0]
    now[0] += 1.0
    assert bucket.allow() == pytest.approx(1.0)
    now[0] += 1.0
    assert bucket.allow() == 0.0 and bucket.allow() == pytest.approx(2.0)
    now[0] += 3600.0  # refills to the burst, no further
    assert [bucket.allow() for _ in range(4)] == [0.0, 0.0, 0.0, 2.0]


def test_rate_limited_requests_get_429_with_the_configured_headers(tmp_path: Path, exporter_factory: Any) -> None:
    config = WebConfig(path="test", rate_limit=RateLimit(interval=3600.0, burst=2),
                       headers={"X-Frame-Options": "deny"})
    exp = settled(tmp_path, exporter_factory, ranks=1, web_config=config)
    assert get(exp.app.port, "/metrics")[0] == 200
    assert get(exp.app.port, "/healthz")[0] == 200
    for path in ("/metrics", "/healthz", "/nope"):  # every request counts, as in exporter-toolkit
        status, headers, body = get(exp.app.port, path)
        assert (status, body) == (429, b"Too Many Requests\n"), path
        assert headers["x-frame-options"] == "deny" and 1 <= int(headers["retry-after"]) <= 3600


# ---------------------------------------------------------------- http_server_config.headers


@pytest.mark.parametrize(("headers", "message"), [
    ("Content-Type: text/html", "'Content-Type' cannot be set"),
    ("WWW-Authenticate: Basic", "'WWW-Authenticate' cannot be set"),
    ("Authorization: Basic eA==", "'Authorization' cannot be set"),
    ("Server: nginx", "'Server' cannot be set"),
    ("X-Frame-Options: allow-from https://x", "X-Frame-Options: 'allow-from https://x' is not one of deny, sameorigin"),
    ("X-Content-Type-Options: sniff", "X-Content-Type-Options: 'sniff' is not one of nosniff"),
    ('Content-Security-Policy: "a\\r\\nSet-Cookie: x=1"', "Content-Security-Policy contains a line break"),
    ('Strict-Transport-Security: "max-age=1\\0"', "contains the character '\\x00'"),
    ('X-XSS-Protection: "1\\e"', "contains the character '\\x1b'"),
    ("Content-Security-Policy: default-src 'self' café", "contains the character 'é'"),
    ("Content-Security-Policy: " + "a" * 9000, "is longer than 8192 characters"),
    ("X-XSS-Protection: true", "must be a string, got bool"),
])
def test_bad_headers_are_refused(tmp_path: Path, headers: str, message: str) -> None:
    path = write_web_config(tmp_path, f"http_server_config:\n  headers:\n    {headers}\n")
    with pytest.raises(WebConfigError) as err:
        webconfig.load_web_config(str(path))
    assert message in str(err.value)


def test_good_headers_are_sent_as_exporter_toolkit_sends_them(tmp_path: Path, exporter_factory: Any) -> None:
    # exporter-toolkit's own web_config_headers.good.yml, plus a blank one ("unset if blank").
    path = write_web_config(tmp_path, "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
                            "    Strict-Transport-Security: max-age=31536000; includeSubDomains\n"
                            "    X-Content-Type-Options: nosniff\n    X-XSS-Protection: 1\n"
                            "    Content-Security-Policy: \"default-src 'self' *.test.example.net\"\n")
    config = webconfig.load_web_config(str(path))
    assert config.headers["X-XSS-Protection"] == "1"
    exp = settled(tmp_path / "spool", exporter_factory, ranks=1, web_config=config)
    headers = get(exp.app.port, "/healthz")[1]
    assert headers["content-security-policy"] == "default-src 'self' *.test.example.net"
    assert headers["x-frame-options"] == "deny" and headers["x-xss-protection"] == "1"
    blank = write_web_config(tmp_path, "http_server_config:\n  headers:\n    X-XSS-Protection: ''\n")
    assert dict(webconfig.load_web_config(str(blank)).headers) == {}


# ---------------------------------------------------------------- Server header


def _raw_answer(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return data.split(b"\r\n\r\n", 1)[0]


def test_no_answer_reveals_the_server_software_version(tmp_path: Path, exporter_factory: Any) -> None:
    exp = settled(tmp_path, exporter_factory, ranks=1)
    requests = [b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n",
                b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
                b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",  # 501, from http.server itself
                b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n",  # 431 from http.server's send_error
                b"GET /\r\n"]  # HTTP/0.9: 400 from send_error
    for request in requests:
        head = _raw_answer(exp.app.port, request)
        assert head.startswith(b"HTTP/1."), (request, head)
        servers = [line for line in head.split(b"\r\n") if line.lower().startswith(b"server:")]
        assert servers == [b"Server: frexporter"], (request, head)
        assert b"Python" not in head and b"BaseHTTP" not in head


# ---------------------------------------------------------------- a failing endpoint


def test_a_failing_render_logs_one_traceback_not_one_per_request(tmp_path: Path, exporter_factory: Any,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A render that fails fails for every request alike: 500 each time, one traceback per interval (500
    anonymous requests once wrote 642 KB of tracebacks in 5 s)."""
    exp = settled(tmp_path, exporter_factory)

    def broken(*_args: Any) -> bytes:
        raise UnicodeEncodeError("utf-8", "\udc80", 0, 1, "surrogates not allowed")

    monkeypatch.setattr(exposition, "encode", broken)
    caplog.set_level("ERROR", logger="frexporter.web.server")
    codes = {get(exp.app.port, "/metrics")[0] for _ in range(50)}
    assert codes == {500}
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1, len(tracebacks)
