"""The canonical Prometheus rules, and the same rules with their timings scaled.

Tests and the end-to-end Prometheus fixture shrink every timing with
``load_rules(scale)`` instead of keeping a second, faster copy, so the logic
they exercise is the logic that ships. Scaled are every group's own
``interval:``, every ``for:`` and every
number literal (seconds) or range window in an ``expr`` that the PromQL comment
``# @scale`` follows on its line, with only closing parentheses, ``]`` and blanks
in between.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import yaml

from scripts import rule_tiers

__all__ = ["DESYNC_CANDIDATES", "E2E_STUCK_AFTER_S", "RULES_PATH", "SCALE_MARKER", "STUCK_WAIT", "alert_for",
           "desync_timing", "find_rule", "load_rules", "parse_duration", "render_rules"]

RULES_PATH = Path(__file__).resolve().parent.parent / "frexporter" / "rules" / "frexporter.rules.yml"
SCALE_MARKER = "@scale"
# The desync's shard-tier records that tests read: the stuck waits and each candidate's activity (held or not).
STUCK_WAIT = "job_id_pg_shard:frexporter_pg_wait_age_seconds:stuck_max"
# The --stuck-after the end-to-end exporters run with, before scaling: their stuck threshold until they learn a
# shorter one, and a busy culprit's ceiling. The rules keep no threshold of their own: they read each waiting
# rank's from its exporter (frexporter_pg_wait_limit_seconds).
E2E_STUCK_AFTER_S = 30.0
# The desync candidates the shard tier exports, each with its activity (label culprit_state).
DESYNC_CANDIDATES = "job_id_pg_rank_shard:frexporter_pg_idle_seq:bottomk"

_UNIT_SECONDS = {
    "ms": 0.001,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    "w": 604800.0,
    "y": 31536000.0,
}
_DURATION_PART = re.compile(r"(\d+)(ms|[smhdwy])")
_DURATION = re.compile(r"(?:\d+(?:ms|[smhdwy]))+")
_SCALED_LITERAL = re.compile(
    r"(?<![\w.])(?P<lit>(?:\d+(?:ms|[smhdwy]))+|\d+(?:\.\d+)?)"
    r"(?P<tail>[\s)\]]*#\s*" + re.escape(SCALE_MARKER) + r"\b)"
)


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration such as ``1m30s`` or ``1500ms``."""
    if not _DURATION.fullmatch(text):
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION_PART.findall(text))


def _format_duration(seconds: float) -> str:
    millis = round(seconds * 1000)
    if seconds > 0:
        # A positive duration must stay positive: "0s" would turn a
        # "for:" into "fire at once" and an empty range into a parse error.
        millis = max(millis, 1)
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"


def _scale_literal(literal: str, scale: float) -> str:
    if literal[-1].isdigit():
        return f"{round(float(literal) * scale, 6):.15g}"
    return _format_duration(parse_duration(literal) * scale)


def _scale_expr(expr: str, scale: float) -> str:
    lines = []
    for line in expr.split("\n"):
        if SCALE_MARKER in line:
            line, count = _SCALED_LITERAL.subn(lambda m: _scale_literal(m["lit"], scale) + m["tail"], line)
            if count != 1:
                raise ValueError(f"{SCALE_MARKER} must follow exactly one literal: {line!r}")
        lines.append(line)
    return "\n".join(lines)


def load_rules(scale: float = 1.0) -> dict[str, Any]:
    """The canonical rule file, parsed, with its timings multiplied by ``scale``."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    rules: dict[str, Any] = yaml.safe_load(RULES_PATH.read_text(encoding="utf-8"))
    for group in rules["groups"]:
        if "interval" in group:  # a group's own interval (the dashboards' minute)
            group["interval"] = _format_duration(parse_duration(group["interval"]) * scale)
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = _format_duration(parse_duration(rule["for"]) * scale)
            rule["expr"] = _scale_expr(rule["expr"], scale)
    return rules


def render_rules(scale: float = 1.0) -> str:
    """``load_rules(scale)`` as a Prometheus rule file."""
    return rule_tiers.dump(load_rules(scale))


def find_rule(name: str, scale: float = 1.0) -> dict[str, Any]:
    """The alerting or recording rule named ``name`` in ``load_rules(scale)``."""
    for group in load_rules(scale)["groups"]:
        for rule in group["rules"]:
            if name in (rule.get("alert"), rule.get("record")):
                return dict(rule)
    raise KeyError(f"no rule {name!r} in {RULES_PATH}")


def alert_for(alert: str, scale: float = 1.0) -> float:
    """Seconds of the alert's ``for:`` at ``scale`` (0 without one)."""
    return parse_duration(find_rule(alert, scale).get("for", "0s"))


def desync_timing(scale: float = 1.0) -> tuple[float, float]:
    """The end-to-end exporters' stuck threshold at ``scale`` (E2E_STUCK_AFTER_S) and FrexporterCollectiveDesync's
    "for" (seconds)."""
    return E2E_STUCK_AFTER_S * scale, alert_for("FrexporterCollectiveDesync", scale)
