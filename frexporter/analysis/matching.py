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

Two differences, both to avoid blaming a healthy rank: numel is summed over all
tensors (list-form all_gather records one output per peer), and coalesced groups
(several entries under one seq) are compared by their op sequence only.
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


def _coalesced_view(entries: Mapping[int, Sequence[InflightCollective]]) -> dict[int, InflightCollective] | None:
    """Collapse coalesced groups to one op-sequence entry per rank; None when nothing is coalesced."""
    coalesced = any(len(group) > 1 or "coalesced" in group[0].op for group in entries.values())
    if not coalesced:
        return None
    return {rank: InflightCollective(seq=group[0].seq, op="+".join(e.op for e in group), created=group[0].created,
                                     timeout_seconds=group[0].timeout_seconds)
            for rank, group in entries.items()}


def _clusters(entries: Mapping[int, InflightCollective]) -> list[list[int]]:
    """Greedy clustering by compatibility with each cluster's first (lowest) rank."""
    clusters: list[list[int]] = []
    for rank in sorted(entries):
        home = next((c for c in clusters if difference(entries[c[0]], entries[rank]) is None), None)
        if home is None:
            clusters.append([rank])
        else:
            home.append(rank)
    return clusters


def find_mismatch(entries: Mapping[int, Sequence[InflightCollective]], group_size: int | None) -> Mismatch | None:
    """The minority that disagrees at one seq; ties go to the cluster holding the lowest rank.

    ``entries`` maps each joined rank to its entries at that seq (several for a coalesced group).
    Entries with an unknown op (``""``, synthesized from metrics) or p2p ops are not judged.
    """
    usable = {r: tuple(g) for r, g in entries.items() if g and all(e.op and not is_p2p(e.op) for e in g)}
    if not usable:
        return None
    collapsed = _coalesced_view(usable)
    single = collapsed if collapsed is not None else {r: g[0] for r, g in usable.items()}
    clusters = _clusters(single)
    majority = max(clusters, key=len)  # max() keeps the first of equal sizes: the lowest rank's cluster
    ref = single[majority[0]]
    outliers = sorted(r for c in clusters if c is not majority for r in c)
    malformed = [] if collapsed is not None else sorted(
        r for r in majority if self_problem(single[r], group_size) is not None)
    culprits = tuple(sorted(set(outliers) | set(malformed)))
    if not culprits:
        return None
    first = culprits[0]
    if first in outliers:
        diff = difference(ref, single[first])
        assert diff is not None  # an outlier differs from the majority's reference by construction
        what, expected, found = diff
    else:
        problem = self_problem(single[first], group_size)
        assert problem is not None
        what, (expected, found) = "syntax", problem
    return Mismatch(culprits=culprits, majority=tuple(r for r in majority if r not in culprits), what=what,
                    expected=expected, found=found, op=ref.op, found_op=single[first].op)
