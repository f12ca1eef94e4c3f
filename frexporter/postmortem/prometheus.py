"""A whole job's RankStates rebuilt from the series every node exporter sent to Prometheus.

Prometheus holds what no single node sees: every rank of every PG. Series carry
no FR entries, only counts and the oldest in-flight start, which the engine accepts
through ``with_oldest_start`` (missing ranks and budgets can be judged; mismatches
cannot, they need entries).

What comes from the server is bounded before it costs anything: each query's whole exchange by one deadline
and the analysis's queries by another, each answer by its bytes and its series, member lists by what they
expand to over all jobs. Series with a label or value no exporter writes are left out and counted
(``JobView.problems``), never guessed at.
"""

from __future__ import annotations

import http.client
import io
import json
import math
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from frexporter import naming as n
from frexporter import safetext
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
from frexporter.spool.limits import MAX_MANIFEST_MEMBERS, MAX_PG_MEMBERS, MAX_RANK

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
# Series one answer may hold: a 131,072-rank world with four PGs on every rank. The bytes alone do not bound
# what an answer parses into: 64 MiB of "{}," is 22 million dicts, 1.6 GB.
MAX_SERIES = 1 << 19
# One query's whole exchange (connect, headers, body); a socket timeout bounds each read only, so a server that
# drips a byte at a time would otherwise hold a query open forever.
QUERY_TIMEOUT_SECONDS = 30.0
# All queries of one analysis (17 of them), so that a server answering each just in time cannot hold
# `frexporter analyze` for 17 times the above.
ANALYZE_TIMEOUT_SECONDS = 120.0
# A heartbeat this old when scraped, on an up rank: its Python is wedged. Above the exporter's poll
# interval (<= 15 s, see frexporter.rules.yml) plus the snapshot interval, which a healthy rank can reach.
STALE_HEARTBEAT_SECONDS = 30.0
MAX_WORLD_SIZE = MAX_PG_MEMBERS  # a world_size label beyond any real job is not expanded into members
# Ranks that worlds expand into over all jobs of a view: each world-spanning PG's member list and each job's
# rank list (the absent ranks of report.from_prometheus). As many as one rank's manifest may list: a
# 131,072-rank job's absent ranks and three PGs that span it. The analysis then costs ~1 KB per member (the
# verdicts' wait-for graph), so a few MB of answers claiming thousands of PGs or jobs of that size, which
# would expand into gigabytes, cost ~200 MB at most.
MAX_EXPANDED_MEMBERS = MAX_MANIFEST_MEMBERS
# Integer labels this module reads; a value that is not one is a series no exporter wrote.
_INT_LABELS = (n.L_RANK, n.L_LOCAL_RANK, n.L_WORLD_SIZE, n.L_SIZE, n.L_PID)
_MAX_SEQ = 2**53  # seqs and counts arrive as float64 values: whole numbers up to here are exact
_READ_BYTES = 1 << 16
_EXAMPLE_CHARS = 64  # of a server's label value quoted in a problem line
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
        return io.BufferedReader(socket.SocketIO(self, "rb"))

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
        super().connect()
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
                            context=self._context)


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
    source = safetext.printable(f"{base_url} ({promql!r})")
    if urllib.parse.urlsplit(base_url).scheme not in ("http", "https"):
        raise PrometheusError(f"{safetext.printable(base_url)}: not an http:// or https:// URL")
    url = base_url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with _opener(deadline).open(url, timeout=timeout) as resp:
            body = _read_body(resp, source)
    except urllib.error.HTTPError as e:
        raise PrometheusError(f"{source}: HTTP {e.code}: {_excerpt(e)}") from e
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            raise PrometheusError(f"{source}: no complete answer within {timeout:g} s") from e
        raise PrometheusError(f"{safetext.printable(base_url)}: {safetext.printable(getattr(e, 'reason', e))}") from e
    return parse_query_response(body, source)


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
        containers += _containers(chunk)
        _check_size(len(body), containers, source)
    return body


def _containers(data: bytes | bytearray) -> int:
    """An upper bound on the objects and arrays ``data`` parses into (brackets in strings count too)."""
    return data.count(b"{") + data.count(b"[")


def _check_size(size: int, containers: int, source: str) -> None:
    if size > MAX_RESPONSE_BYTES:
        raise PrometheusError(f"{source}: response larger than {MAX_RESPONSE_BYTES} bytes")
    # A sample is three containers ({"metric": {...}, "value": [...]}); the document's own are a few more.
    if containers > 3 * MAX_SERIES + 16:
        raise PrometheusError(f"{source}: more than {MAX_SERIES} series (or not a Prometheus answer)")


def parse_query_response(body: bytes | bytearray, source: str = "Prometheus") -> list[dict[str, Any]]:
    """The samples of an instant-vector ``/api/v1/query`` answer; PrometheusError for anything else.

    Label values that hold lone surrogates come back repaired (U+FFFD), so that they can be encoded and
    printed."""
    _check_size(len(body), _containers(body), source)
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
    # callers can use labels as dict keys and parse them as text.
    samples = [r for r in data["result"] if isinstance(r, dict) and isinstance(r.get("metric"), dict)
               and all(isinstance(k, str) and isinstance(v, str) for k, v in r["metric"].items())]
    if safetext.is_valid(text) and not _SURROGATE_ESCAPE.search(text):
        return samples  # the common case: no string of the answer can hold a lone surrogate
    return [{**s, "metric": {safetext.repair(k): safetext.repair(v) for k, v in s["metric"].items()}}
            for s in samples]


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


def _label_int(value: str) -> int | None:
    """A rank, size or pid label as an exporter writes it (str() of a C int): ASCII digits, no sign, no leading
    zero, at most MAX_RANK. int() takes far more ("٣", " 1", "1_0", "+2"), and would merge series that
    Prometheus keeps apart."""
    if not (value.isascii() and value.isdigit()) or len(value) > 10 or (value[0] == "0" and len(value) > 1):
        return None
    number = int(value)
    return number if number <= MAX_RANK else None


def _int(value: str | None) -> int:
    """A screened integer label (see _screened), -1 when absent."""
    number = None if value is None else _label_int(value)
    return -1 if number is None else number


def _count(value: float | None) -> bool:
    """Whether a seq or count value is one (a whole number from -1 up, exact in a float64)."""
    return value is None or (value.is_integer() and -1 <= value <= _MAX_SEQ)


@dataclass
class _Skipped:
    """What was left out of the view, counted by reason with the first example: a hostile answer can hold half a
    million bad series, and a line each would bury the verdicts."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)
    series: int = 0  # of the counts, those that are series

    def add(self, reason: str, example: str, series: bool = True) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.examples.setdefault(reason, example)
        self.series += series

    def lines(self) -> list[str]:
        return [f"{count} {reason}, first: {safetext.printable(self.examples[reason])}"
                for reason, count in self.counts.items()]


def _quoted(labels: dict[str, str], name: str) -> str:
    """``name="value" of metric``, cut: for a problem line (escaped there)."""
    return f'{name}="{labels.get(name, "")[:_EXAMPLE_CHARS]}" of {labels.get("__name__", "?")[:_EXAMPLE_CHARS]}'


def _screened(samples: list[dict[str, Any]], skipped: _Skipped) -> list[dict[str, Any]]:
    """The samples whose integer labels are ones (_label_int); the others are counted in ``skipped``."""
    out = []
    for s in samples:
        labels = s["metric"]
        bad = next((k for k in _INT_LABELS if k in labels and _label_int(labels[k]) is None), None)
        if bad is None:
            out.append(s)
        else:
            skipped.add(f"series with a {bad} label that is not a whole number up to {MAX_RANK}", _quoted(labels, bad))
    return out


@dataclass
class _Asker:
    """Queries of one analysis, all within one deadline, their answers screened."""

    base_url: str
    timeout: float
    skipped: _Skipped
    deadline: float = 0.0

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.timeout

    def __call__(self, promql: str) -> list[dict[str, Any]]:
        spent = f"{safetext.printable(self.base_url)}: the analysis's queries took more than {self.timeout:g} s"
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PrometheusError(spent)
        try:
            samples = query(self.base_url, promql, timeout=min(QUERY_TIMEOUT_SECONDS, left))
        except PrometheusError as e:
            if time.monotonic() >= self.deadline:
                raise PrometheusError(f"{spent} ({e})") from e
            raise
        return _screened(samples, self.skipped)


# Labels frexporter itself puts on rank and PG series. Whatever else a series carries (job, instance,
# pod, ... from the scrape target and relabelling) names the exporter that reported it.
_OWN_LABELS = frozenset({"__name__", *n.RANK_INFO_LABELS, *n.PG_INFO_LABELS, *n.RANK_ACTIVITY_LABELS})
RankKey = tuple[str, int]
Source = tuple[tuple[str, str], ...]
_PG_FIELDS = ((n.PG_LAST_ENQUEUED_SEQ, "enqueued"), (n.PG_LAST_COMPLETED_SEQ, "completed"),
              (n.PG_LAST_STARTED_SEQ, "started"), (n.PG_INFLIGHT_COLLECTIVES, "inflight"),
              (n.PG_OLDEST_INFLIGHT_START_TIMESTAMP_SECONDS, "oldest"),
              (n.PG_LAST_PROGRESS_TIMESTAMP_SECONDS, "progress"))
_COUNT_FIELDS = frozenset({"enqueued", "completed", "started", "inflight"})


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



@dataclass(frozen=True)
class JobView:
    """Every rank of a job as of the latest scrapes, and what was left out of it (one line per reason)."""

    ranks: tuple[RankState, ...]
    problems: list[str]
    skipped_series: int


def rank_states(base_url: str, job_id: str | None, now: float,
                stale_after: float = STALE_HEARTBEAT_SECONDS) -> tuple[RankState, ...]:
    """The ranks of job_view, without what was left out."""
    return job_view(base_url, job_id, now, stale_after).ranks


def job_view(base_url: str, job_id: str | None, now: float, stale_after: float = STALE_HEARTBEAT_SECONDS,
             timeout: float | None = None) -> JobView:
    """Every rank of the job (all jobs when ``job_id`` is None) as of the latest scrapes.

    A rank several exporters report (a sidecar and a node exporter, or two replicas) is read from the
    one with the freshest heartbeat only: mixing their series could combine one's seqs with the other's
    in-flight start. A rank is unresponsive when its heartbeat was ``stale_after`` old already when
    Prometheus last scraped it: judged at the query time instead, every healthy rank would look stale
    whenever the scrape interval is longer than that. All queries together take at most ``timeout``
    seconds (None: ANALYZE_TIMEOUT_SECONDS), each at most QUERY_TIMEOUT_SECONDS.
    """
    skipped = _Skipped()
    ask = _Asker(base_url, ANALYZE_TIMEOUT_SECONDS if timeout is None else timeout, skipped)
    sel = _selector(job_id)
    up = _by_source(ask(n.RANK_UP + sel))
    heartbeat = _by_source(ask(n.RANK_HEARTBEAT_TIMESTAMP_SECONDS + sel))
    scraped = _by_source(ask(f"timestamp({n.RANK_HEARTBEAT_TIMESTAMP_SECONDS}{sel})"))
    info = _by_source(ask(n.RANK_INFO + sel))
    pg_info = ask(n.PG_INFO + sel)
    timeouts = _pg_timeouts(ask(n.PG_TIMEOUT_SECONDS + sel))
    # The exporters' learned stuck thresholds (absent from older ones: the caller's fixed one applies).
    thresholds = _pg_timeouts(ask(n.PG_STUCK_THRESHOLD_SECONDS + sel))
    # And their ceilings (--stuck-after), the threshold of a wait on busy culprits (absent from older ones too).
    ceilings = _pg_timeouts(ask(n.PG_STUCK_CEILING_SECONDS + sel))
    pg_samples = [(kind, s) for metric, kind in _PG_FIELDS for s in ask(metric + sel)]
    culprits = _culprit_activities(ask(n.VERDICT + sel))
    activity = _newest_state(ask(n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS + sel))
    # Busy at any time within the hold, as FrexporterCollectiveDesync asks it (model.BUSY_HOLD_SECONDS).
    busy_lately = {key for s in ask(f"max_over_time({n.RANK_ACTIVITY_SINCE_TIMESTAMP_SECONDS}"
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

    pg_series = _pg_series(pg_samples, chosen, skipped)
    rank_info = {key: pick(info, key) for key in chosen}
    members, unexpanded = _members(pg_series, pg_info, rank_info, skipped)

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
            # A world left unexpanded (past MAX_EXPANDED_MEMBERS) is unknown: its absent ranks are not listed.
            world_size=-1 if job in unexpanded else _int(labels.get(n.L_WORLD_SIZE)),
            hostname=labels.get(n.L_HOSTNAME, ""),
            pid=_int(labels.get(n.L_PID)), torch_version=labels.get(n.L_TORCH_VERSION, ""),
            gpu_uuid=labels.get(n.L_GPU_UUID, ""), status=status, heartbeat=hb, heartbeat_age=age,
            socket_alive=None, pgs=tuple(by_rank.get(key, ())),
            activity=_activity(pick(activity, key), culprits.get(key), now if key in busy_lately else None),
        ))
    return JobView(ranks=tuple(out), problems=skipped.lines(), skipped_series=skipped.series)


def _pg_series(pg_samples: list[tuple[str, dict[str, Any]]], chosen: dict[RankKey, Source], skipped: _Skipped,
               ) -> dict[tuple[str, int, str], dict[str, Any]]:
    """(job, rank, PG) -> field -> value, from the chosen exporter of each rank; a seq or count that is not a
    whole number (7.5, 1e300) is counted in ``skipped``, not cut to one."""
    pg_series: dict[tuple[str, int, str], dict[str, Any]] = defaultdict(dict)
    for field_name, s in pg_samples:
        labels = s["metric"]
        key = _rank_key(labels)
        if key is None or n.L_PG not in labels or _source(labels) != chosen[key]:
            continue
        value = _value(s)
        if field_name in _COUNT_FIELDS and not _count(value):
            skipped.add(f"series whose value is not a whole number from -1 to {_MAX_SEQ}",
                        f"{str(s['value'][1])[:_EXAMPLE_CHARS]} of {labels.get('__name__', '?')[:_EXAMPLE_CHARS]}")
            continue
        pg_series[(*key, labels[n.L_PG])][field_name] = value
        pg_series[(*key, labels[n.L_PG])]["desc"] = labels.get(n.L_PG_DESC, "")
    return pg_series


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
             rank_info: dict[RankKey, dict[str, Any] | None], skipped: _Skipped,
             ) -> tuple[dict[tuple[str, str], tuple[int, ...]], set[str]]:
    """Each PG's ranks: those with series, or every rank of the job when the PG spans the world; and the jobs
    whose world is left unexpanded (see _expansions).

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
    reporting: dict[str, int] = defaultdict(int)
    for (job, _), sample in rank_info.items():
        reporting[job] += 1
        if sample is not None:
            world[job] = max(world[job], _int(sample["metric"].get(n.L_WORLD_SIZE)))
    spanning = {key for key, ranks in seen.items() if size.get(key, -1) == world[key[0]] > len(ranks)}
    expanded, unexpanded = _expansions(world, spanning, reporting, skipped)
    out = {}
    for (job, pg), ranks in seen.items():
        if (job, pg) in expanded:  # every rank below the world size, and any the series name beyond it
            out[(job, pg)] = tuple(range(world[job])) + tuple(sorted(r for r in ranks if r >= world[job]))
        else:
            out[(job, pg)] = tuple(sorted(ranks))
    return out, unexpanded


def _expansions(world: dict[str, int], spanning: set[tuple[str, str]], reporting: dict[str, int],
                skipped: _Skipped) -> tuple[set[tuple[str, str]], set[str]]:
    """The world-spanning PGs expanded into every rank of their world, and the jobs whose world is not expanded
    (into report.from_prometheus's absent ranks), so that all expansions together stay within
    MAX_EXPANDED_MEMBERS. The jobs with the most reporting ranks go first, each its world, then its PGs: a few MB
    of answers claiming thousands of world-sized PGs or jobs cannot crowd out the job that reports."""
    left = MAX_EXPANDED_MEMBERS
    expanded: set[tuple[str, str]] = set()
    unexpanded: set[str] = set()
    by_job: dict[str, list[str]] = defaultdict(list)
    for job, pg in sorted(spanning, key=lambda key: (key[0], len(key[1]), key[1])):  # PG "2" before "10"
        by_job[job].append(pg)
    reason = f"past {MAX_EXPANDED_MEMBERS} members expanded in all"
    for job in sorted(world, key=lambda j: (-reporting[j], j)):
        size = world[job]
        if size > MAX_WORLD_SIZE:
            continue  # beyond any real job: expanded nowhere (verdicts.find_absent_in_world skips it too)
        if size > left:
            unexpanded.add(job)
            skipped.add(f"jobs whose absent ranks are not listed ({reason})", f"job {job[:_EXAMPLE_CHARS]}",
                        series=False)
        else:
            left -= size
        for pg in by_job.get(job, ()):
            if size > left:
                skipped.add(f"world-spanning process groups whose members are only the ranks that report them "
                            f"({reason})", f"job {job[:_EXAMPLE_CHARS]}, PG {pg[:_EXAMPLE_CHARS]}", series=False)
                continue
            left -= size
            expanded.add((job, pg))
    return expanded, unexpanded
