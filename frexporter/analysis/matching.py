"""Do the entries that ranks recorded for one collective seq agree? (pure)

The rules follow torch's Flight Recorder analyzer (``Op.match`` and
``Op.dtype_mismatch`` in ``torch/distributed/flight_recorder/components/types.py``)
so that a live verdict and a post-mortem ``fr_trace`` run blame the same rank:

- the op must be the same on every rank;
- input sizes must be equal except for all_to_all and scatter (and the uneven
  ``*_v`` variants), output sizes except for all_to_all and gather;
- all_reduce: input sizes == output sizes; all_gather: output numel == input
  numel x group size; reduce_scatter: input numel == output numel x group size;
- dtypes: input dtypes equal across ranks (scatter, broadcast exempt), output
  dtypes equal (gather exempt), input == output dtypes on one rank (scatter,
  gather, broadcast exempt); only where both sides carry data.

Differences, all to avoid blaming a healthy rank: numel is summed over all
tensors (list-form all_gather records one output per peer); a coalesced group
(several entries under one seq) must hold the same ops on every rank and is then
compared entry by entry; the reference is the largest group of agreeing ranks
(never simply the first file read), and a rank whose own entry breaks its op's
rule is named even when it stands alone against a well-formed peer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from frexporter.model import InflightCollective

_ALL_TO_ALL = frozenset({"all_to_all", "all_to_all_single", "all_to_all_v_single", "alltoall_base", "alltoall"})
_SKIP_INPUT_SIZES = _ALL_TO_ALL | {"scatter", "all_gather_v"}
_SKIP_OUTPUT_SIZES = _ALL_TO_ALL | {"gather", "reduce_scatter_v"}
_SKIP_INPUT_DTYPES = frozenset({"scatter", "broadcast"})
_SKIP_OUTPUT_DTYPES = frozenset({"gather"})
_SKIP_SELF_DTYPES = frozenset({"scatter", "gather", "broadcast"})
_ALL_REDUCE = frozenset({"all_reduce", "allreduce_coalesced"})
_ALL_GATHER = frozenset({"all_gather", "all_gather_base", "_all_gather_base", "all_gather_into_tensor",
                         "all_gather_into_tensor_coalesced"})
_REDUCE_SCATTER = frozenset({"reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor",
                             "reduce_scatter_tensor_coalesced"})

Sizes = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Mismatch:
    """Ranks whose entry at one seq disagrees with the majority's (or is malformed on its own)."""

    culprits: tuple[int, ...]
    majority: tuple[int, ...]  # ranks whose entries agree with each other, the reference
    what: str  # "op", "input sizes", "output sizes", "input dtypes", "output dtypes" or "syntax"
    expected: str  # the majority's value (for "syntax": what the rule wanted)
    found: str  # the first culprit's value
    op: str  # the majority's op (the collective the group meant to run)
    found_op: str  # the first culprit's op
    where: str = ""  # which op of a coalesced group differs, as text ("" for a lone collective)
    no_majority: bool = False  # equally many ranks on each side: the lowest rank's side was taken as reference


def is_p2p(op: str) -> bool:
    return op.startswith(("send", "recv"))


def _has_data(sizes: Sizes) -> bool:
    # The analyzer only compares dtypes where the first tensor has a shape (non-root gather/scatter have none).
    return bool(sizes) and bool(sizes[0])


def _numel(sizes: Sizes) -> int:
    return sum(math.prod(shape) for shape in sizes)


def _sizes_text(sizes: Sizes) -> str:
    return json.dumps([list(shape) for shape in sizes])


def _dtypes_text(dtypes: Sequence[str]) -> str:
    return ",".join(sorted(set(dtypes))) or "none"


def self_problem(entry: InflightCollective, group_size: int | None) -> tuple[str, str] | None:
    """(expected, found) when one rank's entry breaks its op's own size or dtype rule."""
    op, ins, outs = entry.op, entry.input_sizes, entry.output_sizes
    if op in _ALL_REDUCE and ins != outs:
        return f"output sizes equal to input sizes {_sizes_text(ins)}", f"output sizes {_sizes_text(outs)}"
    both = _has_data(ins) and _has_data(outs)
    if group_size and both and op in _ALL_GATHER and _numel(outs) != _numel(ins) * group_size:
        return (f"output numel {_numel(ins) * group_size} = input numel {_numel(ins)} x {group_size} ranks",
                f"output numel {_numel(outs)}")
    if group_size and both and op in _REDUCE_SCATTER and _numel(ins) != _numel(outs) * group_size:
        return (f"input numel {_numel(outs) * group_size} = output numel {_numel(outs)} x {group_size} ranks",
                f"input numel {_numel(ins)}")
    if op not in _SKIP_SELF_DTYPES and both and set(entry.input_dtypes) != set(entry.output_dtypes):
        return (f"output dtypes equal to input dtypes {_dtypes_text(entry.input_dtypes)}",
                f"output dtypes {_dtypes_text(entry.output_dtypes)}")
    return None


def difference(ref: InflightCollective, other: InflightCollective) -> tuple[str, str, str] | None:
    """(what, expected, found) for the first rule on which ``other`` disagrees with ``ref``."""
    op = ref.op
    if op != other.op:
        return "op", op, other.op
    if op not in _SKIP_INPUT_SIZES and ref.input_sizes != other.input_sizes:
        return "input sizes", _sizes_text(ref.input_sizes), _sizes_text(other.input_sizes)
    if op not in _SKIP_OUTPUT_SIZES and ref.output_sizes != other.output_sizes:
        return "output sizes", _sizes_text(ref.output_sizes), _sizes_text(other.output_sizes)
    if (op not in _SKIP_INPUT_DTYPES and _has_data(ref.input_sizes) and _has_data(other.input_sizes)
            and set(ref.input_dtypes) != set(other.input_dtypes)):
        return "input dtypes", _dtypes_text(ref.input_dtypes), _dtypes_text(other.input_dtypes)
    if (op not in _SKIP_OUTPUT_DTYPES and _has_data(ref.output_sizes) and _has_data(other.output_sizes)
            and set(ref.output_dtypes) != set(other.output_dtypes)):
        return "output dtypes", _dtypes_text(ref.output_dtypes), _dtypes_text(other.output_dtypes)
    return None


def _group_ops(group: Sequence[InflightCollective]) -> str:
    return "+".join(e.op for e in group)


def _position(index: int, size: int) -> str:
    return "" if size == 1 else f" (op {index + 1} of {size} coalesced under this seq)"


def group_difference(ref: Sequence[InflightCollective],
                     other: Sequence[InflightCollective]) -> tuple[str, str, str, int] | None:
    """(what, expected, found, index) for the first rule on which ``other`` disagrees with ``ref``.

    Each side is one rank's entries at one seq: one entry, or a coalesced group. Groups must hold the same
    ops in the same order; then each entry is compared with its counterpart, as a lone collective would be
    (a coalesced all_gather with one wrong buffer is a size mismatch, not a matching op sequence).
    """
    if len(ref) != len(other) or any(a.op != b.op for a, b in zip(ref, other, strict=True)):
        return "op", _group_ops(ref), _group_ops(other), 0
    for i, (a, b) in enumerate(zip(ref, other, strict=True)):
        diff = difference(a, b)
        if diff is not None:
            return (*diff, i)
    return None


def group_self_problem(group: Sequence[InflightCollective],
                       group_size: int | None) -> tuple[str, str, int] | None:
    """(expected, found, index) for the first entry of one rank's group that breaks its own op's rule."""
    for i, e in enumerate(group):
        problem = self_problem(e, group_size)
        if problem is not None:
            return (*problem, i)
    return None


def _clusters(groups: Mapping[int, tuple[InflightCollective, ...]]) -> list[list[int]]:
    """Greedy clustering by compatibility with each cluster's first (lowest) rank."""
    clusters: list[list[int]] = []
    for rank in sorted(groups):
        home = next((c for c in clusters if group_difference(groups[c[0]], groups[rank]) is None), None)
        if home is None:
            clusters.append([rank])
        else:
            home.append(rank)
    return clusters


def find_mismatch(entries: Mapping[int, Sequence[InflightCollective]], group_size: int | None) -> Mismatch | None:
    """The ranks whose entries at one seq are wrong: those that disagree with the majority, and those whose
    own entry breaks its op's rule.

    ``entries`` maps each joined rank to its entries at that seq (several for a coalesced group).
    Entries with an unknown op (``""``, synthesized from metrics) or p2p ops are not judged.
    The majority is the largest cluster of agreeing ranks; between equally large ones a well-formed cluster
    wins over a malformed one (of two ranks, the one whose entry contradicts itself is wrong, not its peer),
    then the one holding the lowest rank. ``no_majority`` says when that last rule decided.
    """
    usable = {r: tuple(g) for r, g in entries.items() if g and all(e.op and not is_p2p(e.op) for e in g)}
    if not usable:
        return None
    clusters = _clusters(usable)
    malformed = {r for r, g in usable.items() if group_self_problem(g, group_size) is not None}

    def rank_of_cluster(c: list[int]) -> tuple[int, bool]:
        return len(c), c[0] not in malformed  # a cluster agrees on everything, so its first entry speaks for it

    majority = max(clusters, key=rank_of_cluster)  # max() keeps the first of equals: the lowest rank's cluster
    no_majority = sum(1 for c in clusters if rank_of_cluster(c) == rank_of_cluster(majority)) > 1
    ref = usable[majority[0]]
    outliers = sorted(r for c in clusters if c is not majority for r in c)
    culprits = tuple(sorted(set(outliers) | (malformed & set(majority))))
    if not culprits:
        return None
    first = culprits[0]
    if first in outliers:
        diff = group_difference(ref, usable[first])
        assert diff is not None  # an outlier differs from the majority's reference by construction
        what, expected, found, index = diff
    else:
        problem = group_self_problem(usable[first], group_size)
        assert problem is not None
        what, (expected, found, index) = "syntax", problem
    if what == "op":
        op, found_op, where = _group_ops(ref), _group_ops(usable[first]), ""
    else:
        op, found_op, where = ref[index].op, usable[first][index].op, _position(index, len(ref))
    return Mismatch(culprits=culprits, majority=tuple(r for r in majority if r not in culprits), what=what,
                    expected=expected, found=found, op=op, found_op=found_op, where=where,
                    no_majority=no_majority and bool(outliers))
