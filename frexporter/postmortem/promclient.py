"""Prometheus's instant-query API over HTTP, every exchange bounded before it costs anything.

The project's one HTTP client: each query's whole exchange (connect, TLS, headers, body) by one deadline, not
a timeout per read; each answer by its bytes and by the series it can parse into; its text parsed strictly
(an instant vector of string labels, lone surrogates repaired). Nothing here knows what the series mean.
"""

from __future__ import annotations

import http.client
import io
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from functools import partial
from typing import Any

from frexporter import safetext
from frexporter.fr.trace import json_containers

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
# Series one answer may hold: a 131,072-rank world with four PGs on every rank. The bytes alone do not bound
# what an answer parses into: 64 MiB of "{}," is 22 million dicts, 1.6 GB.
MAX_SERIES = 1 << 19
# One query's whole exchange (connect, headers, body); a socket timeout bounds each read only, so a server that
# drips a byte at a time would otherwise hold a query open forever.
QUERY_TIMEOUT_SECONDS = 30.0
_READ_BYTES = 1 << 16
# A query longer than this (URL-encoded) is sent in a POST body, which the query API takes as well: a proxy in
# front of Prometheus may refuse a long URL (nginx's header buffers are 8 KiB).
MAX_GET_QUERY_CHARS = 4096
# Of a query quoted in an error message.
_QUOTED_QUERY_CHARS = 200
# One answer parsed at a time in this process, however many queries are in flight: the parse is what costs memory
# (a dict per container: a 5 MB flood of "{}" is 150 MB), and it holds the GIL anyway.
_PARSING = threading.Lock()
# A lone surrogate spelled as a JSON escape (``\\udc80``); one encoded in UTF-8 is in the decoded text already.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class PrometheusError(Exception):
    pass


def _left(deadline: float) -> float:
    """Seconds left before ``deadline`` (time.monotonic); TimeoutError when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


class _DeadlineSocket:
    """A connected socket whose every send and receive waits only for what is left of one deadline.

    http.client reads the status line, headers and body through ``makefile``, one receive at a time; a socket
    timeout would restart with each byte a server drips. Closing is counted like socket.socket's: urllib closes
    the connection once the headers are in, and the response goes on reading through its file.
    """

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline
        self._io_refs, self._closed = 0, False

    def __getattr__(self, name: str) -> Any:  # setsockopt, fileno, ...: as the socket has them
        return getattr(self._sock, name)

    def recv_into(self, buffer: Any, *args: Any) -> int:
        self._sock.settimeout(_left(self._deadline))
        return self._sock.recv_into(buffer, *args)

    def sendall(self, data: Any, *args: Any) -> None:
        self._sock.settimeout(_left(self._deadline))  # sendall's timeout bounds the whole send
        self._sock.sendall(data, *args)

    def makefile(self, mode: str = "rb", *_args: Any, **_kwargs: Any) -> io.BufferedReader:
        self._io_refs += 1
        # SocketIO only calls recv_into and _decref_socketios, which this wrapper has.
        return io.BufferedReader(socket.SocketIO(self, "rb"))  # type: ignore[arg-type]

    def _decref_socketios(self) -> None:
        self._io_refs -= 1
        if self._closed:
            self.close()

    def close(self) -> None:
        self._closed = True
        if self._io_refs <= 0:
            self._sock.close()


class _DeadlineConnection:
    """Mixed into http.client's connections: connect within what is left, then hand out a _DeadlineSocket. The
    TLS handshake (in HTTPSConnection.connect) is bounded in all by the socket timeout set at connect."""

    sock: Any  # http.client's connection attribute, set by its connect()

    def __init__(self, *args: Any, deadline: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline = deadline
        self._create_connection = self._connect_within

    def _connect_within(self, address: tuple[str, int], _timeout: float | None,
                        source_address: tuple[str, int] | None = None) -> socket.socket:
        # Each address the name resolves to may take what is left; the handshake then gets what is left after.
        sock = socket.create_connection(address, _left(self._deadline), source_address)
        sock.settimeout(_left(self._deadline))
        return sock

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]  # the http.client connection this is mixed into
        self.sock = _DeadlineSocket(self.sock, self._deadline)


class _HTTPConnection(_DeadlineConnection, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: float) -> None:
        super().__init__()
        self._deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(partial(_HTTPConnection, deadline=self._deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: float) -> None:
        super().__init__()
        self._deadline = deadline

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(partial(_HTTPSConnection, deadline=self._deadline), req,
                            context=self._context)  # type: ignore[attr-defined]  # urllib's own


def _opener(deadline: float) -> urllib.request.OpenerDirector:
    """urlopen's handlers with connections bound to ``deadline``, and no FTP or file handler: a redirect to
    ftp:// would leave the deadline behind."""
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.ProxyHandler(), urllib.request.UnknownHandler(), _HTTPHandler(deadline),
                    _HTTPSHandler(deadline), urllib.request.HTTPDefaultErrorHandler(),
                    urllib.request.HTTPRedirectHandler(), urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


def query(base_url: str, promql: str, timeout: float = QUERY_TIMEOUT_SECONDS) -> list[dict[str, Any]]:
    """The samples of ``promql``; PrometheusError when the whole exchange takes more than ``timeout`` seconds,
    or its answer is too large, or not a Prometheus answer."""
    deadline = time.monotonic() + timeout
    quoted = promql if len(promql) <= _QUOTED_QUERY_CHARS else promql[:_QUOTED_QUERY_CHARS] + "..."
    source = safetext.printable(f"{base_url} ({quoted!r})")
    if urllib.parse.urlsplit(base_url).scheme not in ("http", "https"):
        raise PrometheusError(f"{safetext.printable(base_url)}: not an http:// or https:// URL")
    endpoint, form = base_url.rstrip("/") + "/api/v1/query", urllib.parse.urlencode({"query": promql})
    request = urllib.request.Request(endpoint + "?" + form) if len(form) <= MAX_GET_QUERY_CHARS else \
        urllib.request.Request(endpoint, data=form.encode(), method="POST")  # urlencoded, as urllib labels it
    try:
        with _opener(deadline).open(request, timeout=timeout) as resp:
            body = _read_body(resp, source)
    except urllib.error.HTTPError as e:
        raise PrometheusError(f"{source}: HTTP {e.code}: {_excerpt(e)}") from e
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            raise PrometheusError(f"{source}: no complete answer within {timeout:g} s") from e
        raise PrometheusError(f"{safetext.printable(base_url)}: {safetext.printable(getattr(e, 'reason', e))}") from e
    with _PARSING:
        try:
            return parse_query_response(body, source)
        except PrometheusError as e:
            # Dropped before the next parse begins: its traceback holds this one's document.
            error = str(e)
    raise PrometheusError(error)


def _excerpt(error: urllib.error.HTTPError) -> str:
    """The head of an error answer, escaped (repr of bytes), or a word for one that cannot be read in time."""
    try:
        return repr(error.read(300))
    except (http.client.HTTPException, OSError, ValueError):
        return "(unreadable)"


def _read_body(resp: http.client.HTTPResponse, source: str) -> bytearray:
    """The answer's bytes, refused as soon as they pass MAX_RESPONSE_BYTES or hold more containers than
    MAX_SERIES series can: a flood of ``{}`` costs what was read before the count passed, not its parse."""
    if resp.length is not None and resp.length > MAX_RESPONSE_BYTES:
        raise PrometheusError(f"{source}: response larger than {MAX_RESPONSE_BYTES} bytes "
                              f"(Content-Length {resp.length})")
    body, containers = bytearray(), 0
    while chunk := resp.read(_READ_BYTES):
        body += chunk
        containers += json_containers(chunk)
        _check_size(len(body), containers, source)
    return body


def _check_size(size: int, containers: int, source: str) -> None:
    if size > MAX_RESPONSE_BYTES:
        raise PrometheusError(f"{source}: response larger than {MAX_RESPONSE_BYTES} bytes")
    # A sample is three containers ({"metric": {...}, "value": [...]}); the document's own are a few more.
    if containers > 3 * MAX_SERIES + 16:
        raise PrometheusError(f"{source}: more than {MAX_SERIES} series (or not a Prometheus answer)")


def _all_strings(values: Any) -> bool:
    """Whether every value is a string: join checks them in C, a third of the parse at 8,192 ranks otherwise."""
    try:
        "".join(values)
    except TypeError:
        return False
    return True


def parse_query_response(body: bytes | bytearray, source: str = "Prometheus") -> list[dict[str, Any]]:
    """The samples of an instant-vector ``/api/v1/query`` answer; PrometheusError for anything else.

    Label values that hold lone surrogates come back repaired (U+FFFD), so that they can be encoded and
    printed."""
    _check_size(len(body), json_containers(body), source)
    try:
        text = body.decode("utf-8", "surrogatepass")  # as json.loads decodes bytes: surrogates are repaired below
        doc = json.loads(text)
    except ValueError as e:
        raise PrometheusError(f"{source}: not a Prometheus API response") from e
    except RecursionError as e:  # nesting deeper than the stack: not something Prometheus writes
        raise PrometheusError(f"{source}: not a Prometheus API response (nested too deeply)") from e
    if not isinstance(doc, dict) or doc.get("status") != "success":
        # Only a string "error" is quoted: str() of an arbitrary document can be huge or recurse too deep.
        error = doc.get("error") if isinstance(doc, dict) else None
        detail = safetext.printable(error[:300]) if isinstance(error, str) else "no success status"
        raise PrometheusError(f"{source}: query failed: {detail}")
    data = doc.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise PrometheusError(f"{source}: unexpected result shape")
    if len(data["result"]) > MAX_SERIES:
        raise PrometheusError(f"{source}: more than {MAX_SERIES} series")
    # Label values are strings in the API; a sample that says otherwise is dropped here, so that the
    # callers can use labels as dict keys and parse them as text (JSON's keys are strings always).
    samples = [r for r in data["result"] if type(r) is dict and type(r.get("metric")) is dict
               and _all_strings(r["metric"].values())]
    if safetext.is_valid(text) and not _SURROGATE_ESCAPE.search(text):
        return samples  # the common case: no string of the answer can hold a lone surrogate
    return [{**s, "metric": {safetext.repair(k): safetext.repair(v) for k, v in s["metric"].items()}}
            for s in samples]
