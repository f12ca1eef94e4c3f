"""Who waits for whom across process groups, and which findings are root causes (pure).

A bipartite wait-for graph: a live rank points to each finding it waits in
(only where that finding blocks: it has blockers, or it is stuck with everyone
joined), and a finding points to each of its blockers. Root causes are:

- a rank with no way out that someone waits for: it never joined (or its
  process is down) and it waits on nobody itself. A wedged rank that waits in a
  blocked collective is a link, not an end: its Python is stuck in that wait;
- a finding with no way out (all joined and stuck: ``stalled``), or the
  mismatch node hanging off a finding (its ranks joined different collectives);
- a cycle: ranks waiting in collectives each other never joined (a desync in
  collective order). Cycles never resolve, so one is a root even when a way out
  exists besides it.

Everything that reaches a root transitively is reported with it (waiting ranks,
blocked PGs) instead of as a verdict of its own: rank 2 blamed on WORLD while it
waits on rank 3 in a subgroup becomes "rank 3, waited on by 0, 1, 2".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from frexporter.analysis.findings import Finding

RANK, PG, MISMATCH = "rank", "pg", "mismatch"


@dataclass(frozen=True, order=True)
class Node:
    kind: str  # RANK, PG or MISMATCH
    job_id: str
    key: int  # the global rank, or the finding's index


@dataclass(frozen=True)
class Cause:
    """One root cause, before it is phrased as a verdict."""

    kind: str  # RANK (culprit ranks), PG (stalled), MISMATCH, or "cycle"
    job_id: str
    culprits: tuple[int, ...]
    anchor: int | None  # index of the finding the verdict names (PG, seq, op); None for a lone rank
    upstream: tuple[int, ...]  # indexes of the findings that wait on this cause, anchor excluded
    waiting: tuple[int, ...]  # ranks blocked by it, directly or transitively
    cycle: tuple[int, ...] = ()  # indexes of the findings that form a deadlock


class WaitGraph:
    def __init__(self) -> None:
        self.succ: dict[Node, set[Node]] = {}
        self.pred: dict[Node, set[Node]] = {}

    def add(self, src: Node, dst: Node) -> None:
        self.succ.setdefault(src, set()).add(dst)
        self.succ.setdefault(dst, set())
        self.pred.setdefault(dst, set()).add(src)
        self.pred.setdefault(src, set())

    def ancestors(self, starts: Iterable[Node]) -> set[Node]:
        seen: set[Node] = set()
        todo = list(starts)
        while todo:
            for parent in self.pred.get(todo.pop(), ()):
                if parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
        return seen


def build(findings: Sequence[Finding], live: Mapping[tuple[str, int], bool]) -> WaitGraph:
    """``live``: whether a rank can be waiting at all (down and exited ranks are ends, never links)."""
    graph = WaitGraph()
    for i, f in enumerate(findings):
        node = Node(PG, f.job_id, i)
        # A mismatch explains an all-joined stuck PG better than "stalled": don't offer both.
        blocks = bool(f.blockers) or (f.stuck and f.mismatch is None)
        for r in f.waiting:
            if not live.get((f.job_id, r), False):
                continue
            if blocks:
                graph.add(Node(RANK, f.job_id, r), node)
            if f.mismatch is not None:
                graph.add(Node(RANK, f.job_id, r), Node(MISMATCH, f.job_id, i))
        for r in f.blockers:
            graph.add(node, Node(RANK, f.job_id, r))
    return graph


def cycles(succ: Mapping[Node, Iterable[Node]]) -> list[tuple[Node, ...]]:
    """Strongly connected components with more than one node (iterative Tarjan, deterministic order)."""
    index: dict[Node, int] = {}
    low: dict[Node, int] = {}
    stack: list[Node] = []
    on_stack: set[Node] = set()
    found: list[tuple[Node, ...]] = []

    def visit(node: Node) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)

    for start in sorted(succ):
        if start in index:
            continue
        visit(start)
        work = [(start, iter(sorted(succ[start])))]
        while work:
            node, children = work[-1]
            child = next((c for c in children if c not in index or c in on_stack), None)
            if child is not None:
                if child in index:
                    low[node] = min(low[node], index[child])
                else:
                    visit(child)
                    work.append((child, iter(sorted(succ[child]))))
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(tuple(sorted(component)))
    return found


class _Resolver:
    def __init__(self, graph: WaitGraph, findings: Sequence[Finding], individual: set[tuple[str, int]]) -> None:
        self.graph = graph
        self.findings = findings
        self.individual = individual  # ranks reported one verdict each (down, wedged)
        self._anc: dict[Node, set[Node]] = {}

    def ancestors_of(self, node: Node) -> set[Node]:
        if node not in self._anc:
            self._anc[node] = self.graph.ancestors([node])
        return self._anc[node]

    def _anchor(self, parents: Iterable[Node]) -> Node:
        # The PG that explains the most waiting ranks; then a stuck one, the oldest, the smallest, by name.
        def key(n: Node) -> tuple[int, bool, float, int, str]:
            f = self.findings[n.key]
            through = sum(1 for a in self.ancestors_of(n) if a.kind == RANK)
            return (-through, not f.stuck, f.since if f.since is not None else float("inf"), len(f.members), f.pg)

        return min(parents, key=key)

    def _cause(self, kind: str, job_id: str, culprits: Iterable[int], anchor: int | None,
               around: set[Node], cycle: tuple[int, ...] = ()) -> Cause:
        culprit_set = set(culprits)
        upstream = sorted({n.key for n in around if n.kind == PG} - {anchor})
        waiting = sorted({n.key for n in around if n.kind == RANK} - culprit_set)
        return Cause(kind, job_id, tuple(sorted(culprit_set)), anchor, tuple(upstream), tuple(waiting), cycle)

    def rank_causes(self) -> list[Cause]:
        grouped: dict[Node, tuple[set[int], set[Node]]] = {}
        out = []
        for node in sorted(self.graph.succ):
            if node.kind != RANK or self.graph.succ[node] or not self.graph.pred[node]:
                continue
            parents = self.graph.pred[node]
            around = set(parents).union(*(self.ancestors_of(p) for p in parents))
            anchor = self._anchor(parents)
            if (node.job_id, node.key) in self.individual:
                out.append(self._cause(RANK, node.job_id, [node.key], anchor.key, around))
                continue
            culprits, seen = grouped.setdefault(anchor, (set(), set()))
            culprits.add(node.key)
            seen |= around
        for anchor, (culprits, around) in sorted(grouped.items()):
            out.append(self._cause(RANK, anchor.job_id, culprits, anchor.key, around))
        return out

    def terminal_causes(self) -> list[Cause]:
        out = []
        for node in sorted(self.graph.succ):
            if node.kind == RANK or self.graph.succ[node]:
                continue
            f = self.findings[node.key]
            around = self.ancestors_of(node) | {node}
            if node.kind == MISMATCH:
                assert f.mismatch is not None
                around.add(Node(PG, node.job_id, node.key))
                out.append(self._cause(MISMATCH, node.job_id, f.mismatch.culprits, node.key, around))
            else:
                # Unobserved members are only blockers in a complete view; in a node view each node names its
                # own ranks, which also keeps one node from exporting a verdict series per rank of the job.
                unobserved = set(f.unobserved)  # a tuple would make this quadratic in a WORLD of 100,000 ranks
                seen = [r for r in f.members if r not in unobserved]
                out.append(self._cause(PG, node.job_id, seen, node.key, around))
        return out

    def cycle_causes(self) -> list[Cause]:
        out = []
        for component in cycles(self.graph.succ):
            ranks = {n.key for n in component if n.kind == RANK}
            pgs = [n.key for n in component if n.kind == PG]

            # The PG holding most of the deadlocked ranks (then the smallest, by name) names the verdict.
            def key(i: int, ranks: set[int] = ranks) -> tuple[int, int, str]:
                f = self.findings[i]
                return (-len(ranks & set(f.members)), len(f.members), f.pg)

            rep = min(pgs, key=key)
            culprits = ranks & set(self.findings[rep].members)
            # Break the tie by time: the collective waited on longest is the original block, and the ranks
            # missing from it are the ones that went off order (rank 3 skipped the pair all_reduce and only
            # then entered WORLD's next one). FR order alone cannot tell; equal start times name them all.
            timed = [i for i in pgs if self.findings[i].since is not None]
            if len(timed) == len(pgs):
                oldest = min(timed, key=lambda i: (self.findings[i].since, key(i)))
                starts = sorted(self.findings[i].since or 0.0 for i in pgs)
                first_missing = ranks & set(self.findings[oldest].blockers)
                if starts[0] < starts[1] and first_missing:
                    rep, culprits = oldest, first_missing
            around = self.graph.ancestors(component) | set(component)
            out.append(self._cause("cycle", component[0].job_id, culprits, rep, around, tuple(sorted(pgs))))
        return out


def resolve(graph: WaitGraph, findings: Sequence[Finding], individual: set[tuple[str, int]]) -> list[Cause]:
    """Every root cause in the graph; ``individual`` ranks (down, wedged) get one cause each."""
    resolver = _Resolver(graph, findings, individual)
    return resolver.rank_causes() + resolver.terminal_causes() + resolver.cycle_causes()
