"""A simulated fleet of frexporter nodes, live, and real Prometheus servers in either rule layout.

``FakeFleet`` serves ``/metrics/node-XXXX`` for N nodes from one thread on one loopback port. Every node's text is
one real node's ``/metrics`` (benchmarks/scale.py's ``real_exposition``: 8 ranks, 8 fake GPUs) with its ranks'
process groups replaced by a realistic layout of 4 PGs per rank: WORLD (``pg="0"``), the node's tensor-parallel
group (``tp<node>``), a pipeline group (``pp<i>``: the ranks of one local rank, one per stage node) and a
data-parallel group (``dp<i>``: the ranks of one local rank on the nodes of one stage). Global rank =
node * 8 + local rank. Healthy, every PG runs 10 collectives per 15 s step (times ``scale``) in lock step, each in
flight for the first half of its slot, so a scrape catches ranks in flight as it does a real job; heartbeats and the
poll time are the time of the request. ``desync`` hangs the job the way FrexporterCollectiveDesync describes;
``straggle`` slows one rank down the way FrexporterStraggler describes. A fault's waits (``frexporter_pg_wait_*``)
appear as the exporter writes them, once they have lasted half the stuck threshold.

``PromLayout`` runs Prometheus on that fleet: ``single`` (one Prometheus, the canonical rules) or ``tiered`` (K
shards, each scraping its ``hashmod`` share of the nodes with the shard tier of the rules and the external label
``shard``, and one global Prometheus federating their exports with the global tier; docs/scale.md, "Tiers"; the
federation job as docs/kubernetes.md writes it but for ``honor_timestamps: false``, see FEDERATE_HONOR_TIMESTAMPS).
Rules and the fleet's stuck thresholds are scaled alike by ``scale`` (tests/rulefile.py), so the tests run the
shipped logic tenfold faster. The module also holds the helpers that read a Prometheus: queries, rule groups,
alerts, its own metrics, its CPU and its RSS.

Used by tests/e2e/test_tiers_live.py and benchmarks/scale_live.py.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Collection, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import yaml

from benchmarks.scale import Series, parse_exposition, real_exposition
from frexporter import naming as n
from frexporter.defaults import IDLE_CANDIDATES_PER_NODE, WAIT_REPORT_SHARE
from scripts import rule_tiers
from tests.harness import free_port, metrics, wait_for
from tests.promstack import get_json, instant_query
from tests.rulefile import render_rules

RANKS_PER_NODE = 8
JOB_ID = "fleet"
# The rules select exporters by a scrape job whose name contains "frexporter" (FrexporterExporterDown).
SCRAPE_JOB = "frexporter-fleet"
FEDERATE_JOB = "federate"
STEP_S = 15.0  # a training step at scale 1; every PG runs COLLECTIVES_PER_STEP collectives in it
COLLECTIVES_PER_STEP = 10
INFLIGHT_SHARE = 0.5  # the part of each collective's slot it is in flight
SEQ0 = 1000
HEALTHY_STATE = "gpu_wait"  # a GPU-bound rank between collectives: never "held" as a busy culprit
# The template's PGs that become the 4 PG kinds; its other PGs are dropped.
TEMPLATE_PG_KINDS = {"0": "world", "1": "tp", "2": "pp", "3": "dp"}
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
HTTP_TIMEOUT_S = 30.0

# Families whose values move with the fleet's state (the rest keep the template's values).
ENQUEUED = "frexporter_pg_last_enqueued_seq"
COMPLETED = "frexporter_pg_last_completed_seq"
INFLIGHT = "frexporter_pg_inflight_collectives"
PROGRESS = "frexporter_pg_last_progress_timestamp_seconds"
OLDEST = "frexporter_pg_oldest_inflight_start_timestamp_seconds"
THRESHOLD = "frexporter_pg_stuck_threshold_seconds"
CEILING = "frexporter_pg_stuck_ceiling_seconds"
TIMEOUT = "frexporter_pg_timeout_seconds"
WAIT_FAMILIES = (n.PG_WAIT_START_TIMESTAMP_SECONDS, n.PG_WAIT_SEQ, n.PG_WAIT_LIMIT_SECONDS, n.PG_WAIT_GROUP_SIZE)
ACTIVITY = "frexporter_rank_activity_since_timestamp_seconds"
NOW_FAMILIES = frozenset({"frexporter_poll_timestamp_seconds", "frexporter_rank_heartbeat_timestamp_seconds",
                          "frexporter_source_last_success_timestamp_seconds"})
WORLD_SIZE = "frexporter_job_world_size"
WAIT = "frexporter_rank_collective_wait_seconds"  # not in the template (no --collective-waits): Straggler adds it
WAIT_S = 0.05  # a healthy rank's mean wait inside a collective (Straggler)
WAIT_STEP_S = 0.002


# ---------------------------------------------------------------------------------------- topology


@dataclass(frozen=True)
class Pg:
    name: str
    desc: str
    size: int
    kind: str


@dataclass(frozen=True)
class Topology:
    """Which PGs each rank is in. ``pp`` pipeline stages (default min(8, nodes)), so nodes // pp data-parallel
    replicas: node = stage * replicas + replica."""

    nodes: int
    pp: int = 0

    def __post_init__(self) -> None:
        if self.pp == 0:
            object.__setattr__(self, "pp", min(8, self.nodes))
        if self.nodes < 1 or self.pp < 1 or self.nodes % self.pp:
            raise ValueError(f"{self.nodes} nodes do not split into {self.pp} pipeline stages")

    @property
    def replicas(self) -> int:
        """Data-parallel degree: the size of a DP group."""
        return self.nodes // self.pp

    @property
    def world(self) -> int:
        return self.nodes * RANKS_PER_NODE

    def pg(self, node: int, local: int, kind: str) -> Pg:
        if kind == "world":
            return Pg("0", "default_pg", self.world, kind)
        if kind == "tp":
            return Pg(f"tp{node}", "tp", RANKS_PER_NODE, kind)
        if kind == "pp":  # one pipeline per (replica, local rank): its stages are nodes `replicas` apart
            return Pg(f"pp{(node % self.replicas) * RANKS_PER_NODE + local}", "pp", self.pp, kind)
        if kind == "dp":  # one DP group per (stage, local rank): the stage's consecutive nodes
            return Pg(f"dp{(node // self.replicas) * RANKS_PER_NODE + local}", "dp", self.replicas, kind)
        raise ValueError(kind)

    @property
    def pg_count(self) -> int:
        """Distinct PGs of the job: WORLD, one tensor-parallel group per node, one pipeline per (replica, local
        rank), one data-parallel group per (stage, local rank)."""
        return 1 + self.nodes + (self.replicas + self.pp) * RANKS_PER_NODE

    def pgs(self, rank: int) -> list[Pg]:
        node, local = divmod(rank, RANKS_PER_NODE)
        return [self.pg(node, local, kind) for kind in TEMPLATE_PG_KINDS.values()]

    def members(self, pg: str) -> list[int]:
        """Global ranks of the PG named ``pg``, ascending (from its name: no scan over the world)."""
        if pg == "0":
            return list(range(self.world))
        prefix = pg.rstrip("0123456789")
        number = int(pg[len(prefix):] or -1)
        local: int | None
        if prefix == "tp" and 0 <= number < self.nodes:
            nodes, local = [number], None
        elif prefix == "pp" and number < self.replicas * RANKS_PER_NODE:
            replica, local = divmod(number, RANKS_PER_NODE)
            nodes = [stage * self.replicas + replica for stage in range(self.pp)]
        elif prefix == "dp" and number < self.pp * RANKS_PER_NODE:
            stage, local = divmod(number, RANKS_PER_NODE)
            nodes = [stage * self.replicas + replica for replica in range(self.replicas)]
        else:
            raise KeyError(f"no PG {pg!r} in {self}")
        locals_ = range(RANKS_PER_NODE) if local is None else [local]
        return sorted(node * RANKS_PER_NODE + lr for node in nodes for lr in locals_)

    @staticmethod
    def node_of(rank: int) -> int:
        return rank // RANKS_PER_NODE


def node_path(node: int) -> str:
    return f"/metrics/node-{node:04d}"


def node_instance(node: int) -> str:
    return f"node-{node:04d}:9464"


def shard_of(node: int, shards: int) -> int:
    """The shard whose ``hashmod`` relabeling keeps the node: Prometheus' own arithmetic (md5 of the source label
    value, its last 8 bytes big-endian, modulo ``shards``) over the node's metrics path."""
    digest = hashlib.md5(node_path(node).encode()).digest()  # Prometheus' hashmod, not security
    return int.from_bytes(digest[8:], "big") % shards


def cross_shard_desync(topo: Topology, shards: int) -> tuple[int, str]:
    """A (culprit rank, DP group) where the culprit's shard holds fewer of the group's other members than the
    other shards do together (all of them when it can): only the global tier sees both the culprit and most of
    its waiters. With one shard: rank 0's DP group."""
    best: tuple[int, int, str] | None = None
    if topo.replicas < 2:
        raise ValueError(f"the DP groups of {topo} have one rank: use more nodes or a smaller --pp")
    for stage in range(topo.pp):
        pg = topo.pg(stage * topo.replicas, 0, "dp")
        members = topo.members(pg.name)
        homes = {m: shard_of(topo.node_of(m), shards) for m in members}
        for rank in members:
            same = sum(homes[m] == homes[rank] for m in members) - 1
            if shards > 1 and same * 2 >= len(members) - 1:
                continue  # most waiters would share the culprit's shard
            if best is None or same < best[0]:
                best = (same, rank, pg.name)
            if same == 0 or shards == 1:
                return rank, pg.name
    if best is None:
        raise ValueError(f"no DP group of {topo} spans {shards} shards with its culprit apart; try another --pp")
    return best[1], best[2]


# ---------------------------------------------------------------------------------------- the template


@dataclass
class Family:
    name: str
    header: str  # its HELP and TYPE lines
    samples: list[Series] = field(default_factory=list)


def template_families(text: str) -> list[Family]:
    """A node's exposition, family by family in its order (a sample belongs to the family declared above it)."""
    families: list[Family] = []
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            name = line.split()[2]
            if not families or families[-1].name != name:
                families.append(Family(name, ""))
            families[-1].header += line + "\n"
        elif line and not line.startswith("#"):
            families[-1].samples.extend(parse_exposition(line))
    return families


def _escape(text: str) -> str:
    """Literal text inside a %-format string."""
    return text.replace("%", "%%")


def _line(name: str, labels: dict[str, str], value: str) -> str:
    """One sample line of a node's format string; ``value`` is a literal number or a ``%(slot)s``."""
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{_escape('{' + body + '}') if labels else ''} {value}\n"


def _num(value: float) -> str:
    return f"{value:.17g}" if value != int(value) or abs(value) >= 1e15 else str(int(value))


# ---------------------------------------------------------------------------------------- states


@dataclass(frozen=True)
class PgValues:
    """One rank's series of one PG: literal numbers or %-format slots."""

    enqueued: str
    completed: str
    inflight: str
    progress: str
    oldest: str | None  # the oldest in-flight start, None when nothing is in flight (the series is absent)


class Healthy:
    """Every PG runs its collectives in lock step, each in flight for the first INFLIGHT_SHARE of its slot.

    Each node's text is one %-format string; the slots are the few values the clock moves (the same for every rank
    and PG), and ``inflight``, the node's in-flight lines while a collective is in flight."""

    def __init__(self, t0: float, scale: float) -> None:
        self.t0 = t0
        self.slot_s = STEP_S * scale / COLLECTIVES_PER_STEP

    def pg(self, rank: int, pg: Pg) -> PgValues:
        return PgValues("%(enq)s", "%(comp)s", "%(infl)s", "%(prog)s", "%(start)s")

    def activity(self, rank: int) -> tuple[str, str]:
        return HEALTHY_STATE, _num(self.t0)

    def at(self, now: float) -> dict[str, Any]:
        """The slots' values at ``now``: seq k is enqueued at t0 + k * slot and completes half a slot later."""
        k, frac = divmod((now - self.t0) / self.slot_s, 1.0)
        start = self.t0 + k * self.slot_s
        flying = frac < INFLIGHT_SHARE
        enq = SEQ0 + int(k)
        last_done = start - self.slot_s * (1 - INFLIGHT_SHARE) if flying else start + self.slot_s * INFLIGHT_SHARE
        return {"enq": str(enq), "comp": str(enq - 1 if flying else enq), "infl": "1" if flying else "0",
                "prog": f"{last_done:.3f}", "start": f"{start:.3f}", "flying": flying}


class Desync:
    """A hung job: from ``at`` on, every member of ``pg`` but ``culprit`` has enqueued seq S + 1 (completed S,
    its oldest in-flight collective began at ``at``, state in_collective), the culprit is at S with nothing in
    flight (state idle), and every other PG of every rank stopped at S with nothing in flight (a rank blocked in
    the desynced PG enqueues nothing else; no PG stalls with all ranks in it, which would be another alert).

    ``cascade``: the hang spreads a step further, as it does on a real job: the other ranks of each waiter's node
    enqueued their tensor-parallel collective S + 1 and wait in it for the waiter (blocked in the desynced PG), so
    every tensor-parallel group with a waiter has a collective in flight too."""

    def __init__(self, healthy: Healthy, at: float, culprit: int, pg: str, members: list[int],
                 cascade: bool = False) -> None:
        self.t0 = healthy.t0
        self.at = at
        self.culprit = culprit
        self.pg_name = pg
        self.waiters = frozenset(members) - {culprit}
        self.seq = int(healthy.at(at)["enq"])  # S: what every rank completed (an in-flight one finishes)
        self.tp_waiting_nodes = frozenset(Topology.node_of(w) for w in self.waiters) if cascade else frozenset()

    def _tp_waiter(self, rank: int) -> bool:
        return rank not in self.waiters and Topology.node_of(rank) in self.tp_waiting_nodes

    def pg(self, rank: int, pg: Pg) -> PgValues:
        s, at = str(self.seq), f"{self.at:.3f}"
        if (pg.name == self.pg_name and rank in self.waiters) or (pg.kind == "tp" and self._tp_waiter(rank)):
            return PgValues(str(self.seq + 1), s, "1", at, at)
        return PgValues(s, s, "0", at, None)

    def activity(self, rank: int) -> tuple[str, str]:
        if rank == self.culprit:
            return "idle", f"{self.at:.3f}"
        if rank in self.waiters or self._tp_waiter(rank):
            return "in_collective", f"{self.at:.3f}"
        return HEALTHY_STATE, _num(self.t0)


class Skew:
    """A healthy job frozen as scrapes at slightly different instants see it: at ``at`` the even nodes' ranks have
    enqueued seq k (in flight since ``at``), the odd nodes' ranks have completed k - 1 and not yet enqueued k. Lasts
    until the next state: a reproducer holds it for a scrape or two, so that a Prometheus' last samples are these."""

    def __init__(self, healthy: Healthy, at: float) -> None:
        self.t0 = healthy.t0
        self.at = at
        self.seq = int(healthy.at(at)["enq"])

    def pg(self, rank: int, pg: Pg) -> PgValues:
        k, at = self.seq, f"{self.at:.3f}"
        if Topology.node_of(rank) % 2 == 0:
            return PgValues(str(k), str(k - 1), "1", at, at)
        return PgValues(str(k - 1), str(k - 1), "0", at, None)

    def activity(self, rank: int) -> tuple[str, str]:
        return HEALTHY_STATE, _num(self.t0)


class Straggler(Healthy):
    """The healthy job with one slow rank: it arrives ``lag`` seconds late at every collective, so every peer in each
    of its PGs waits that much longer in each (``frexporter_rank_collective_wait_seconds``, the NCCL straggler
    signal of ``serve --collective-waits``); the rank itself waits what everyone waits in a healthy PG. Waits differ
    by rank by up to 8 ms (2 ms steps), a spread that names nobody: the alert needs a lag of 5 ms and 4 MADs."""

    def __init__(self, healthy: Healthy, rank: int, lag: float, topo: Topology) -> None:
        self.t0, self.slot_s = healthy.t0, healthy.slot_s
        self.rank = rank
        self.lag = lag
        self.pgs = frozenset(pg.name for pg in topo.pgs(rank))

    def wait(self, rank: int, pg: Pg) -> str:
        late = self.lag if pg.name in self.pgs and rank != self.rank else 0.0
        return _num(round(WAIT_S + WAIT_STEP_S * (rank % 5) + late, 6))


State = Healthy | Desync | Skew | Straggler


# ---------------------------------------------------------------------------------------- rendering


class NodeRenderer:
    """Turns the template into one node's %-format string for a state (rendered once per state change)."""

    def __init__(self, families: list[Family], topo: Topology, scale: float, quiet: frozenset[str] = frozenset(),
                 quiet_since: float = 0.0) -> None:
        self.families = families
        self.topo = topo
        self.scale = scale
        # PG kinds that run no collective (a pipeline group that only sends and receives): their seqs stand still
        # and every node writes their idle ranks in every state, as the exporter does once they stood half a
        # threshold.
        self.quiet = quiet
        at = f"{quiet_since:.3f}"
        self._quiet_values = PgValues(str(SEQ0), str(SEQ0), "0", at, None)

    def _values(self, state: State, rank: int, pg: Pg) -> PgValues:
        return self._quiet_values if pg.kind in self.quiet else state.pg(rank, pg)

    def render(self, node: int, state: State) -> tuple[str, str]:
        """The node's text, and (healthy) its in-flight lines, which the text takes in its ``%(inflight)s`` slot
        while a collective is in flight."""
        out: list[str] = []
        flying: list[str] = []
        for fam in self.families:
            if fam.name in WAIT_FAMILIES or fam.name == n.PG_IDLE_SEQ:
                continue  # none in the template's steady state; a fault's come whole (_pg_waits, _idle)
            out.append(_escape(fam.header))
            if fam.name == OLDEST:
                lines = self._oldest(node, state)
                if isinstance(state, Healthy):
                    flying, lines = lines, ["%(inflight)s"]
                out.extend(lines)
                continue
            for s in fam.samples:
                out.extend(self._sample(node, s, state))
        if isinstance(state, Straggler):
            out.extend(self._waits(node, state))
        if self.quiet:
            out.append(self._idle(node, state, quiet=True))
        if isinstance(state, Desync | Skew):
            # (Right after the quiet PGs' idle ranks, if any, which carry the family's header: one family, whole.)
            # The exporter's waits (frexporter_pg_wait_*) and idle ranks (frexporter_pg_idle_seq): every wait of
            # these states began at state.at, and every rank with nothing in flight completed its last collective
            # then, so they show together, once that is WAIT_REPORT_SHARE of the stuck threshold ago
            # (FakeFleet.render). A healthy job, all of whose PGs run, has neither.
            out.append("%(inflight)s")
            flying = [self._idle(node, state, quiet=False, header=not self.quiet), *self._pg_waits(node, state)]
        return "".join(out), "".join(flying)

    def _limit(self, name: str) -> float:
        family = next(f for f in self.families if f.name == name)
        return family.samples[0].value * (self.scale if name in (THRESHOLD, CEILING) else 1.0)

    def _pg_waits(self, node: int, state: Desync | Skew) -> list[str]:
        limits = {n.WAIT_LIMIT_STUCK: self._limit(THRESHOLD), n.WAIT_LIMIT_CEILING: self._limit(CEILING),
                  n.WAIT_LIMIT_TIMEOUT: self._limit(TIMEOUT)}
        fams: dict[str, list[str]] = {name: [] for name in WAIT_FAMILIES}
        for local in range(RANKS_PER_NODE):
            rank = node * RANKS_PER_NODE + local
            for pg in self.topo.pgs(rank):
                values = self._values(state, rank, pg)
                if values.oldest is None:
                    continue
                labels = {"job_id": JOB_ID, "pg": pg.name, "pg_desc": pg.desc, "rank": str(rank)}
                fams[n.PG_WAIT_START_TIMESTAMP_SECONDS].append(_line(n.PG_WAIT_START_TIMESTAMP_SECONDS, labels,
                                                                     values.oldest))
                fams[n.PG_WAIT_SEQ].append(_line(n.PG_WAIT_SEQ, labels, str(int(values.completed) + 1)))
                fams[n.PG_WAIT_GROUP_SIZE].append(_line(n.PG_WAIT_GROUP_SIZE, labels, str(pg.size)))
                for limit, seconds in limits.items():
                    fams[n.PG_WAIT_LIMIT_SECONDS].append(_line(n.PG_WAIT_LIMIT_SECONDS,
                                                               {**labels, n.L_LIMIT: limit}, _num(seconds)))
        return [_escape(f"# TYPE {name} gauge\n") + "".join(lines) for name, lines in fams.items()]

    def _idle(self, node: int, state: State, quiet: bool, header: bool = True) -> str:
        """The node's idle ranks as the exporter writes them: per PG, the IDLE_CANDIDATES_PER_NODE ranks of the
        lowest (seq, rank) among those with nothing in flight in it; of the quiet PG kinds, or of the others."""
        by_pg: dict[Pg, list[tuple[int, int]]] = {}
        for local in range(RANKS_PER_NODE):
            rank = node * RANKS_PER_NODE + local
            for pg in self.topo.pgs(rank):
                if (pg.kind in self.quiet) != quiet:
                    continue
                values = self._values(state, rank, pg)
                if values.oldest is None:
                    by_pg.setdefault(pg, []).append((int(values.enqueued), rank))
        lines = [_escape(f"# TYPE {n.PG_IDLE_SEQ} gauge\n")] if header else []
        for pg, found in by_pg.items():
            for seq, rank in sorted(found)[:IDLE_CANDIDATES_PER_NODE]:
                labels = {"job_id": JOB_ID, "pg": pg.name, "pg_desc": pg.desc, "rank": str(rank),
                          "hostname": f"node-{node:04d}"}
                lines.append(_line(n.PG_IDLE_SEQ, labels, str(seq)))
        return "".join(lines)

    def _waits(self, node: int, state: Straggler) -> list[str]:
        lines = [f"# HELP {WAIT} Seconds the rank waits inside this PG's collectives.\n# TYPE {WAIT} gauge\n"]
        for local in range(RANKS_PER_NODE):
            rank = node * RANKS_PER_NODE + local
            for pg in self.topo.pgs(rank):
                labels = {"job_id": JOB_ID, "pg": pg.name, "pg_desc": pg.desc, "rank": str(rank)}
                lines.append(_line(WAIT, labels, state.wait(rank, pg)))
        return lines

    def _sample(self, node: int, s: Series, state: State) -> list[str]:
        labels = dict(s.labels)
        if "pg" in labels:
            kind = TEMPLATE_PG_KINDS.get(labels["pg"])
            if kind is None:
                return []  # a template PG beyond the 4 kinds
            if "rank" in labels:
                return [self._rank_pg(node, s, kind, state)]
            return self._node_pg(node, s, kind)
        if "rank" in labels:
            return [self._rank(node, s, state)]
        if "gpu_uuid" in labels:
            labels["gpu_uuid"] = f"GPU-{node:04d}-{labels.get('gpu', '0')}"
        if s.name in NOW_FAMILIES:
            return [_line(s.name, labels, "%(now)s")]
        if s.name == WORLD_SIZE:
            return [_line(s.name, {**labels, "job_id": JOB_ID}, str(self.topo.world))]
        return [_line(s.name, labels, _num(s.value))]

    def _rank_labels(self, node: int, labels: dict[str, str]) -> tuple[int, dict[str, str]]:
        local = int(labels["rank"])
        rank = node * RANKS_PER_NODE + local
        out = {**labels, "job_id": JOB_ID, "rank": str(rank)}
        for key, value in (("local_rank", str(local)), ("hostname", f"node-{node:04d}"), ("pid", str(100000 + rank)),
                           ("world_size", str(self.topo.world)), ("gpu_uuid", f"GPU-{node:04d}-{local}")):
            if key in out:
                out[key] = value
        return rank, out

    def _rank(self, node: int, s: Series, state: State) -> str:
        rank, labels = self._rank_labels(node, dict(s.labels))
        if s.name in NOW_FAMILIES:
            return _line(s.name, labels, "%(now)s")
        if s.name == ACTIVITY:
            activity, since = state.activity(rank)
            return _line(s.name, {**labels, "state": activity}, since)
        return _line(s.name, labels, _num(s.value))

    def _rank_pg(self, node: int, s: Series, kind: str, state: State) -> str:
        rank, labels = self._rank_labels(node, dict(s.labels))
        pg = self.topo.pg(node, rank % RANKS_PER_NODE, kind)
        labels.update(pg=pg.name, pg_desc=pg.desc)
        values = self._values(state, rank, pg)
        value = {ENQUEUED: values.enqueued, COMPLETED: values.completed, INFLIGHT: values.inflight,
                 PROGRESS: values.progress}.get(s.name, _num(s.value))
        return _line(s.name, labels, value)

    def _node_pg(self, node: int, s: Series, kind: str) -> list[str]:
        """A per-node series of a template PG, once per PG of that kind among the node's ranks."""
        # The template's threshold and ceiling (60 s: an exporter without 20 polls of history reports its ceiling),
        # scaled with the rules. Not the 10 s floor a steady job learns: that is below the 15 s scrape interval, and
        # a rank caught in flight by a scrape reads as waiting for as long as that scrape is old (the rules' age
        # adds the time since it), so lock-step PGs caught in flight would look stuck in a healthy run.
        # The watchdog timeouts stay the job's: FrexporterWatchdogBudget is out of reach of a short run.
        value = s.value * self.scale if s.name in (THRESHOLD, CEILING) else s.value
        out = {}
        for local in range(RANKS_PER_NODE):
            pg = self.topo.pg(node, local, kind)
            labels = {**dict(s.labels), "job_id": JOB_ID, "pg": pg.name, "pg_desc": pg.desc}
            if "size" in labels:
                labels["size"] = str(pg.size)
            out[pg.name] = _line(s.name, labels, _num(value))
        return list(out.values())

    def _oldest(self, node: int, state: State) -> list[str]:
        lines = []
        for local in range(RANKS_PER_NODE):
            rank = node * RANKS_PER_NODE + local
            for pg in self.topo.pgs(rank):
                oldest = self._values(state, rank, pg).oldest
                if oldest is not None:
                    labels = {"job_id": JOB_ID, "pg": pg.name, "pg_desc": pg.desc, "rank": str(rank)}
                    lines.append(_line(OLDEST, labels, oldest))
        return lines


# ---------------------------------------------------------------------------------------- the server


def stat_cpu_seconds(stat_path: str) -> float:
    """User + system CPU from a /proc .../stat file (a process's or a thread's)."""
    stat = Path(stat_path).read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, utime 14, stime 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """A process's resident memory in MB, from /proc (0 when it reports none)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class _Server(HTTPServer):
    request_queue_size = 1024  # K Prometheus scrape thousands of paths of one port, one request at a time
    allow_reuse_address = True

    def __init__(self, fleet: FakeFleet) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.fleet = fleet


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.0: one request per connection, so a scraper's idle keep-alive connection never blocks the one thread.
    protocol_version = "HTTP/1.0"
    server: _Server

    def do_GET(self) -> None:
        body = self.server.fleet.render(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # thousands of scrapes a minute


class FakeFleet:
    """N nodes' /metrics from one thread on one loopback port; see the module docstring."""

    def __init__(self, nodes: int, pp: int = 0, scale: float = 1.0, template: str | None = None,
                 quiet: Collection[str] = ()) -> None:
        """``quiet``: PG kinds (of TEMPLATE_PG_KINDS) that run no collective, idle since well before the start."""
        self.topo = Topology(nodes, pp)
        self.scale = scale
        self.t0 = time.time()
        self._healthy = Healthy(self.t0, scale)
        unknown = set(quiet) - set(TEMPLATE_PG_KINDS.values())
        if unknown:
            raise ValueError(f"no PG kind {sorted(unknown)} (kinds: {sorted(TEMPLATE_PG_KINDS.values())})")
        self._renderer = NodeRenderer(template_families(template or real_exposition()), self.topo, scale,
                                      frozenset(quiet), self.t0 - 3600.0)
        self._paths = {node_path(n): n for n in range(nodes)}
        # The state and every node's text for it, swapped as one: a scrape never meets one without the other.
        self._healthy_texts = self._render_all(self._healthy)
        self._current: tuple[State, list[tuple[str, str]]] = (self._healthy, self._healthy_texts)
        self._server = _Server(self)
        self._thread = threading.Thread(target=self._serve, name="fake-fleet", daemon=True)
        self._tid = 0
        self._started = threading.Event()
        self.requests = 0

    @property
    def nodes(self) -> int:
        return self.topo.nodes

    @property
    def stuck_threshold_s(self) -> float:
        """The stuck threshold every node reports for every PG (scaled): a desync's waiters count from then on."""
        family = next(f for f in self._renderer.families if f.name == THRESHOLD)
        return family.samples[0].value * self.scale

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def _render_all(self, state: State) -> list[tuple[str, str]]:
        return [self._renderer.render(n, state) for n in range(self.nodes)]

    def _serve(self) -> None:
        self._tid = threading.get_native_id()
        self._started.set()
        self._server.serve_forever(poll_interval=0.2)

    def start(self) -> FakeFleet:
        self._thread.start()
        self._started.wait(10)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(10)
        self._server.server_close()

    def __enter__(self) -> FakeFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def cpu_seconds(self) -> float:
        """CPU the serving thread has used so far (rendering and HTTP)."""
        return stat_cpu_seconds(f"/proc/self/task/{self._tid}/stat") if self._tid else 0.0

    def render(self, path: str) -> bytes | None:
        node = self._paths.get(path.split("?", 1)[0])
        if node is None:
            return None
        now = time.time()
        state, texts = self._current
        text, flying = texts[node]
        values: dict[str, Any] = state.at(now) if isinstance(state, Healthy) else {}
        values["now"] = f"{now:.3f}"
        if isinstance(state, Healthy):
            values["inflight"] = flying % values if values.get("flying") else ""
        else:  # the waits, once the exporter would write them (NodeRenderer.render)
            due = now - state.at >= WAIT_REPORT_SHARE * self.stuck_threshold_s
            values["inflight"] = flying % values if due else ""
        self.requests += 1
        return (text % values).encode()

    def desync(self, culprit: int, pg: str, cascade: bool = False) -> Desync:
        """From now on the job hangs on ``pg``: every member but ``culprit`` waits in seq S + 1, and with
        ``cascade`` their nodes' other ranks in their tensor-parallel groups (see Desync)."""
        members = self.topo.members(pg)
        if culprit not in members:
            raise ValueError(f"rank {culprit} is not in PG {pg} ({members})")
        fault = Desync(self._healthy, time.time(), culprit, pg, members, cascade)
        self._current = (fault, self._render_all(fault))  # rendered first: every node changes at one instant
        return fault

    def skew(self) -> Skew:
        """From now on, until ``heal``, the frozen snapshot of Skew."""
        skew = Skew(self._healthy, time.time())
        self._current = (skew, self._render_all(skew))
        return skew

    def straggle(self, rank: int, lag: float) -> Straggler:
        """From now on, until ``heal``, the healthy job with ``rank`` ``lag`` seconds late (see Straggler)."""
        slow = Straggler(self._healthy, rank, lag, self.topo)
        self._current = (slow, self._render_all(slow))
        return slow

    def heal(self) -> None:
        """Back to the healthy job (its seqs where the clock has them)."""
        self._current = (self._healthy, self._healthy_texts)

    @property
    def state(self) -> State:
        return self._current[0]


# ---------------------------------------------------------------------------------------- Prometheus


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        raise FileNotFoundError("prometheus is not on PATH (Debian: apt-get install prometheus)")
    return path


def _post(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=HTTP_TIMEOUT_S):
        pass


class PromServer:
    """One Prometheus process: its config, rules and TSDB under ``workdir/name``; the lifecycle API is on, so that it
    can be reloaded and stopped, and started again on the same port and data."""

    def __init__(self, name: str, workdir: Path, config: dict[str, Any], rules: str, interval: float) -> None:
        self.name = name
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.interval = interval
        self.rules_path = self.dir / "rules.yml"
        self.rules_path.write_text(rules, encoding="utf-8")
        self.config = config
        self.config_path = self.dir / "prometheus.yml"
        self.proc: subprocess.Popen[bytes] | None = None
        self.write_config(interval)

    def write_config(self, evaluation_interval: float | str) -> None:
        value = evaluation_interval if isinstance(evaluation_interval, str) else f"{evaluation_interval:g}s"
        doc = {**self.config, "rule_files": [str(self.rules_path)]}
        doc["global"] = {**doc["global"], "evaluation_interval": value}
        self.config_path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")

    @property
    def log_path(self) -> Path:
        return self.dir / "prometheus.log"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def start(self) -> PromServer:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([
                prometheus_binary(), f"--config.file={self.config_path}", f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle",
                "--storage.tsdb.retention.time=2h", "--log.level=info",
            ], stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._ready, timeout=START_TIMEOUT_S, interval=0.1, what=f"{self.name} ready")
        return self

    def _ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            # Not an AssertionError: wait_for must not keep polling a process that is gone.
            raise RuntimeError(f"{self.name} exited:\n{self.log()}")
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=5) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Through the lifecycle API (a clean shutdown, as an operator's restart), else SIGTERM, else SIGKILL."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            _post(self.url + "/-/quit")
            proc.wait(timeout=STOP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def reload(self, evaluation_interval: float | str | None = None) -> None:
        """Reloads its config, with another evaluation interval if given (``"1d"`` pauses its rules)."""
        self.write_config(self.interval if evaluation_interval is None else evaluation_interval)
        _post(self.url + "/-/reload")

    # ---------------------------------------------------------------- reading it

    def query(self, promql: str, **params: str) -> list[dict[str, Any]]:
        return instant_query(self.url, promql, **params)

    def value(self, promql: str) -> float | None:
        """The single value of an instant query, None when it returns nothing."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def rule_groups(self) -> list[dict[str, Any]]:
        """/api/v1/rules: per group its name, evaluationTime (seconds), lastEvaluation and rules."""
        groups: list[dict[str, Any]] = get_json(f"{self.url}/api/v1/rules")["data"]["groups"]
        return groups

    def alerts(self, **labels: str) -> list[dict[str, Any]]:
        """Pending and firing alerts whose labels include ``labels``."""
        found: list[dict[str, Any]] = get_json(f"{self.url}/api/v1/alerts")["data"]["alerts"]
        return [a for a in found if all(a["labels"].get(k) == v for k, v in labels.items())]

    def own_metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """Its own /metrics (it does not scrape itself), parsed."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=HTTP_TIMEOUT_S) as resp:
            return metrics(resp.read().decode())

    def head_series(self) -> int:
        return int(self.own_metrics()["prometheus_tsdb_head_series"][0][1])

    def iterations_missed(self) -> dict[str, float]:
        """prometheus_rule_group_iterations_missed_total per rule group (by group name)."""
        out = {}
        for labels, value in self.own_metrics().get("prometheus_rule_group_iterations_missed_total", []):
            out[labels.get("rule_group", "").rsplit(";", 1)[-1]] = value
        return out

    def cpu_seconds(self) -> float:
        """User + system CPU the process has used so far (0 when it is not running)."""
        if not self.running or self.proc is None:
            return 0.0
        return stat_cpu_seconds(f"/proc/{self.proc.pid}/stat")

    def rss_mb(self) -> float:
        return 0.0 if not self.running or self.proc is None else rss_mb(self.proc.pid)


def _global_config(interval: float, external: dict[str, str] | None = None) -> dict[str, Any]:
    # scrape_timeout at the interval: a slow fleet server at scale answers late rather than not at all.
    doc: dict[str, Any] = {"global": {"scrape_interval": f"{interval:g}s", "scrape_timeout": f"{interval:g}s"}}
    if external:
        doc["global"]["external_labels"] = external
    return doc


def fleet_job(fleet: FakeFleet, shard: int | None = None, shards: int = 1) -> dict[str, Any]:
    """The exporters' scrape job: one target per node path on the fleet's port, each with its own instance (the
    rules join a node's series on job and instance). A shard keeps its hashmod share: hashed on the path, which
    tells the nodes apart here as the address does in a real cluster (every fake node shares one address)."""
    job: dict[str, Any] = {
        "job_name": SCRAPE_JOB,
        "static_configs": [{"targets": [fleet.address],
                            "labels": {"__metrics_path__": node_path(n), "instance": node_instance(n)}}
                           for n in range(fleet.nodes)],
    }
    if shard is not None:
        job["relabel_configs"] = [
            {"source_labels": ["__metrics_path__"], "modulus": shards, "target_label": "__tmp_hash",
             "action": "hashmod"},
            {"source_labels": ["__tmp_hash"], "regex": str(shard), "action": "keep"},
        ]
    return job


# The federation job's honor_timestamps (scripts/rule_tiers.py says why it is false); None leaves Prometheus' default.
FEDERATE_HONOR_TIMESTAMPS: bool | None = rule_tiers.FEDERATE_HONOR_TIMESTAMPS


def _federate_job(shards: list[PromServer], honor_timestamps: bool | None) -> dict[str, Any]:
    """The global's federation job as docs/kubernetes.md writes it, plus ``honor_timestamps`` unless None."""
    job = {"job_name": FEDERATE_JOB, "honor_labels": True, "metrics_path": "/federate",
           "params": {"match[]": list(rule_tiers.FEDERATE_MATCH)},
           "static_configs": [{"targets": [s.url.split("//", 1)[1] for s in shards]}]}
    if honor_timestamps is not None:
        job["honor_timestamps"] = honor_timestamps
    return job


def shard_name(i: int) -> str:
    return f"shard-{i}"


class PromLayout:
    """Prometheus servers on a fleet, in one of the two layouts; a context manager that stops them all."""

    def __init__(self, fleet: FakeFleet, workdir: Path, kind: str, servers: list[PromServer],
                 shards: list[PromServer], alerting: PromServer) -> None:
        self.fleet = fleet
        self.workdir = workdir
        self.kind = kind
        self.servers = servers
        self.shards = shards
        self.alerting = alerting  # the one that fires the cross-node alerts: the single or the global Prometheus

    @classmethod
    def single(cls, fleet: FakeFleet, workdir: Path, interval: float = 15.0, scale: float = 1.0) -> PromLayout:
        config = {**_global_config(interval), "scrape_configs": [fleet_job(fleet)]}
        server = PromServer("single", workdir, config, render_rules(scale), interval)
        return cls(fleet, workdir, "single", [server], [], server)

    @classmethod
    def tiered(cls, fleet: FakeFleet, workdir: Path, shards: int = 2, interval: float = 15.0,
               scale: float = 1.0, honor_timestamps: bool | None = FEDERATE_HONOR_TIMESTAMPS) -> PromLayout:
        doc = yaml.safe_load(render_rules(scale))
        shard_rules = rule_tiers.render(doc, rule_tiers.SHARD)
        servers = [
            PromServer(shard_name(i), workdir,
                       {**_global_config(interval, {rule_tiers.SHARD_LABEL: shard_name(i)}),
                        "scrape_configs": [fleet_job(fleet, i, shards)]}, shard_rules, interval)
            for i in range(shards)
        ]
        top = PromServer("global", workdir,
                         {**_global_config(interval), "scrape_configs": [_federate_job(servers, honor_timestamps)]},
                         rule_tiers.render(doc, rule_tiers.GLOBAL), interval)
        return cls(fleet, workdir, "tiered", [*servers, top], servers, top)

    @property
    def global_(self) -> PromServer | None:
        return self.alerting if self.kind == "tiered" else None

    def start(self) -> PromLayout:
        for server in self.servers:
            server.start()
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> PromLayout:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop_shard(self, i: int) -> None:
        self.shards[i].stop()

    def start_shard(self, i: int) -> None:
        self.shards[i].start()

    def nodes_of(self, server: PromServer) -> list[int]:
        """The nodes a server scrapes (none for the global)."""
        if server in self.shards:
            i = self.shards.index(server)
            return [n for n in range(self.fleet.nodes) if shard_of(n, len(self.shards)) == i]
        return [] if server is self.global_ else list(range(self.fleet.nodes))

    def complete(self) -> bool:
        """Whether the alerting server's rules have run on every rank's series (through every shard, on the tiered
        layout): the ranks group counts every rank, and the dashboards group has recorded every PG."""
        ranks = self.alerting.value(f'sum(job_id_shard:frexporter_rank_info:count{{job_id="{JOB_ID}"}})')
        pgs = self.alerting.value(f'count(job_id_pg:frexporter_pg_last_enqueued_seq:max{{job_id="{JOB_ID}"}})')
        return ranks == self.fleet.topo.world and pgs == self.fleet.topo.pg_count

    def wait_complete(self, timeout: float) -> None:
        wait_for(self._complete_or_dead, timeout=timeout, interval=0.2,
                 what=f"the {self.kind} layout's rules to see all {self.fleet.topo.world} ranks")

    def _complete_or_dead(self) -> bool:
        for server in self.servers:
            if server.proc is not None and not server.running:
                raise RuntimeError(f"{server.name} exited:\n{server.log()}")
        return self.complete()


@contextmanager
def running(fleet: FakeFleet, *layouts: Callable[[], PromLayout]) -> Iterator[list[PromLayout]]:
    """The fleet serving and every layout started for the ``with`` block; all stopped after it, also on failure."""
    with ExitStack() as stack:
        stack.enter_context(fleet)
        yield [stack.enter_context(make()) for make in layouts]


def layout_factory(kind: str, fleet: FakeFleet, workdir: Path, shards: int = 2, interval: float = 15.0,
                   scale: float = 1.0) -> Callable[[], PromLayout]:
    if kind == "single":
        return functools.partial(PromLayout.single, fleet, workdir, interval, scale)
    if kind == "tiered":
        return functools.partial(PromLayout.tiered, fleet, workdir, shards, interval, scale)
    raise ValueError(f"no layout {kind!r}")


def desync_alerts(server: PromServer, state: str | None = None) -> list[dict[str, Any]]:
    """The server's FrexporterCollectiveDesync alerts of the fleet's job (pending and firing, or ``state``)."""
    found = server.alerts(alertname="FrexporterCollectiveDesync", job_id=JOB_ID)
    return [a for a in found if state is None or a["state"] == state]


def ever_alerted(server: PromServer, alertname: str, since: float) -> list[dict[str, str]]:
    """Label sets of every ``alertname`` the server had pending or firing since unix time ``since``, from its ALERTS
    series (every evaluation, so nothing between two polls escapes)."""
    window = max(1, int(time.time() - since) + 1)
    found = server.query(f'count_over_time(ALERTS{{alertname="{alertname}"}}[{window}s])')
    return [s["metric"] for s in found]

