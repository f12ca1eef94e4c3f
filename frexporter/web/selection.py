"""The ``name[]`` selection of /metrics, as prometheus_client has it: a request's query to the sorted, distinct
sample names it asks for (bounded), and those names applied to already collected metric families. Pure.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from urllib.parse import parse_qs

from prometheus_client.metrics_core import Metric

# Distinct ``name[]`` values one request may ask for; more is answered 400. Every family has one to a few sample
# names, so a real selection needs far fewer; the whole exposition is there without ``name[]``.
MAX_NAMES_PER_REQUEST = 64
# Query fields parsed at most (repeated names included): parse_qs's own bound on a request line of up to 64 KiB.
MAX_QUERY_FIELDS = 1024

# A name[] selection: its sorted, distinct sample names; None for the whole exposition.
Names = tuple[str, ...] | None


def names_from_query(query: str) -> tuple[Names, str]:
    """The request's ``name[]`` selection (None: everything), or why it is refused."""
    try:
        values = parse_qs(query, max_num_fields=MAX_QUERY_FIELDS).get("name[]")
    except ValueError:
        return None, f"more than {MAX_QUERY_FIELDS} query parameters\n"
    if not values:
        return None, ""
    names = tuple(sorted(set(values)))
    if len(names) > MAX_NAMES_PER_REQUEST:
        return None, (
            f"{len(names)} distinct name[] values: at most {MAX_NAMES_PER_REQUEST} per request "
            "(leave name[] out for every series)\n"
        )
    return names, ""


def select_samples(families: list[Metric], names: frozenset[str]) -> Iterator[Metric]:
    """prometheus_client's restricted_registry over collected families: only the samples named."""
    for family in families:
        samples = [s for s in family.samples if s.name in names]
        if samples:
            selected = copy.copy(family)  # the cached family is shared by every rendering of this poll
            selected.samples = samples
            yield selected
