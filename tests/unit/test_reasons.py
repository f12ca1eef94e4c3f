"""The ``reason`` label's values and the ranks' lifecycle states are each spelled once, checked from the source text.

``reason`` (of ``frexporter_source_errors_total`` and ``frexporter_rank_recorder_errors_total``) is a bounded
label: its values are the constants of ``frexporter/reasons.py``. A literal in their place is how the set drifts
(a typo is a new series nobody alerts on), so every module under frexporter/ is parsed with ``ast``, never
imported, as tests/unit/test_layering.py does, and a string literal where a reason goes fails here, naming the line:

- the first argument (or ``reason=``) of ``FrexporterError`` and every class in the package derived from it
  (``SpoolError``, ``SourceError``, ``GpuBackendError``, ``EvidenceRefused``, ...);
- the first item of a ``(reason, message)`` tuple appended to a list named ``*errors`` or ``*problems``;
- the reason of the counting calls (``note``, ``count_error``, ``as_source_error``, a ``Problems``' ``add`` and
  ``count``), a value assigned to a variable named ``reason``, and one compared with ``<x>.reason``.

The lifecycle states a rank's recorder writes (``model.STATE_*``) are held to the same in the recorder, the spool,
the FR parser, the sources and the postmortem reader. Every reason is also listed in SECURITY.md's table.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from frexporter import model, reasons
from tests.harness import REPO

ROOT = REPO
PACKAGE = ROOT / "frexporter"
REASONS_MODULE = PACKAGE / "reasons.py"
SECURITY = ROOT / "SECURITY.md"
REASONS_SECTION = "## Reasons counted"

ERROR_BASE = "FrexporterError"
# Calls whose argument at this index is a reason, whatever they are called on.
REASON_ARGUMENT = {"note": 0, "count_error": 0, "_count_error": 0, "as_source_error": 1}
# Methods whose first argument is a reason when called on something named like this (ranks' ``Problems``).
PROBLEM_METHODS = frozenset({"add", "count"})
PROBLEM_HOLDERS = re.compile(r"problems$")
PROBLEM_LISTS = re.compile(r"(errors|problems)$")

STATE_PACKAGES = ("spool", "fr", "sources", "recorder", "postmortem")
STATES = {value for name, value in vars(model).items() if name.startswith("STATE_") and isinstance(value, str)}


def _reason_constants() -> dict[str, str]:
    return {name: value for name, value in vars(reasons).items()
            if name.isupper() and isinstance(value, str)}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != REASONS_MODULE)


def _literals(node: ast.AST | None) -> Iterator[ast.Constant]:
    """The string literals in ``node``, f-strings' text left out (a message, never a reason)."""
    if node is None:
        return
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if node.value:  # "": no reason at all (not a failure), never a label value
            yield node
    elif not isinstance(node, ast.JoinedStr):
        for child in ast.iter_child_nodes(node):
            yield from _literals(child)


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _own_init_without_reason(node: ast.ClassDef) -> bool:
    """The class fixes its reason itself (``FieldNotSupported(message)``): its first argument is no reason."""
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            params = item.args.args[1:2]
            return not params or params[0].arg != "reason"
    return False


def error_classes(trees: list[ast.Module]) -> set[str]:
    """FrexporterError and every class the package derives from it, by name, less those whose own __init__
    takes no reason."""
    classes = [node for tree in trees for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    bases = {node.name: {_name(b) for b in node.bases} for node in classes}
    found = {ERROR_BASE}
    while True:
        more = {name for name, parents in bases.items() if parents & found} - found
        if not more:
            break
        found |= more
    return found - {node.name for node in classes if _own_init_without_reason(node)}


class ReasonLiterals(ast.NodeVisitor):
    """Each string literal in a place where a reason goes: (line, the literal, where)."""

    def __init__(self, errors: set[str]) -> None:
        self.errors = errors
        self.found: list[tuple[int, str, str]] = []

    def _flag(self, node: ast.AST | None, where: str) -> None:
        self.found.extend((c.lineno, str(c.value), where) for c in _literals(node))

    def visit_Call(self, node: ast.Call) -> None:
        func, name = node.func, _name(node.func)
        if name in self.errors:
            self._flag(node.args[0] if node.args else None, f"the reason of {name}()")
            for kw in node.keywords:
                if kw.arg == "reason":
                    self._flag(kw.value, f"the reason of {name}()")
        elif name in REASON_ARGUMENT and len(node.args) > REASON_ARGUMENT[name]:
            self._flag(node.args[REASON_ARGUMENT[name]], f"the reason of {name}()")
        elif (name in PROBLEM_METHODS and isinstance(func, ast.Attribute) and node.args
              and PROBLEM_HOLDERS.search(_name(func.value))):
            self._flag(node.args[0], f"the reason of {_name(func.value)}.{name}()")
        elif (name == "append" and isinstance(func, ast.Attribute) and PROBLEM_LISTS.search(_name(func.value))
              and node.args and isinstance(node.args[0], ast.Tuple) and node.args[0].elts):
            self._flag(node.args[0].elts[0], f"the reason of a problem appended to {_name(func.value)}")
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if any(isinstance(t, ast.Name) and t.id == "reason" for t in node.targets):
            self._flag(node.value, "a value of `reason`")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        sides = [node.left, *node.comparators]
        if any(isinstance(s, ast.Attribute) and s.attr == "reason" for s in sides):
            for side in sides:
                self._flag(side, "a value compared with `.reason`")
        self.generic_visit(node)


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring nodes: prose may name a state."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _parsed() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(encoding="utf-8"), filename=str(p))) for p in _modules()]


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


# ---------------------------------------------------------------- the set itself


def test_each_reason_is_named_after_its_value() -> None:
    constants = _reason_constants()
    assert len(constants) > 40, "found too few reasons: the scan is broken"
    wrong = {name: value for name, value in constants.items() if value != name.lower()}
    assert not wrong, f"name each reason after its value (LIMIT_TEXT = 'limit_text'): {wrong}"
    assert set(reasons.LIMIT_REASONS) <= set(constants.values())


def test_each_reason_says_what_it_counts() -> None:
    lines = REASONS_MODULE.read_text(encoding="utf-8").splitlines()
    silent = []
    for node in ast.parse("\n".join(lines)).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str) and "#" not in lines[node.lineno - 1]):
            silent.append(f"frexporter/reasons.py:{node.lineno}")
    assert not silent, "a reason without a comment on its line saying what it counts: " + ", ".join(silent)


def test_every_reason_is_in_security_md() -> None:
    text = SECURITY.read_text(encoding="utf-8")
    assert REASONS_SECTION in text, f"SECURITY.md lost its {REASONS_SECTION!r} section"
    section = text.split(REASONS_SECTION, 1)[1].split("\n## ", 1)[0]
    listed = set()
    for row in section.splitlines():
        if row.startswith("| `"):
            listed |= set(re.findall(r"`([a-z_]+)`", row.split("|")[1]))
    values = set(_reason_constants().values())
    assert not values - listed, f"reasons missing from SECURITY.md's table: {sorted(values - listed)}"
    assert not listed - values, f"SECURITY.md's table lists reasons frexporter.reasons lacks: {sorted(listed - values)}"


# ---------------------------------------------------------------- no literal in a reason's place


def test_no_reason_is_a_literal() -> None:
    parsed = _parsed()
    assert len(parsed) > 40, "found too few modules: the scan is broken"
    visitor_errors = error_classes([tree for _, tree in parsed])
    assert {"SpoolError", "SourceError", "GpuBackendError", "EvidenceRefused"} <= visitor_errors
    violations = []
    for path, tree in parsed:
        visitor = ReasonLiterals(visitor_errors)
        visitor.visit(tree)
        violations += [f"{_where(path, line)}: {value!r} as {where}; use the constant of frexporter.reasons"
                       for line, value, where in visitor.found]
    assert not violations, "\n".join(violations)


def test_lifecycle_states_are_the_models() -> None:
    assert {"starting", "running", "exiting", "stopped"} == STATES
    violations = []
    for path, tree in _parsed():
        if path.relative_to(PACKAGE).parts[0] not in STATE_PACKAGES:
            continue
        docs = _docstrings(tree)
        violations += [f"{_where(path, c.lineno)}: {c.value!r}; use model.STATE_{c.value.upper()}"
                       for c in _literals(tree) if c.value in STATES and id(c) not in docs]
    assert not violations, "\n".join(violations)


# ---------------------------------------------------------------- the checker itself


def test_checker_finds_literals() -> None:
    source = (
        "class ThingError(SourceError): ...\n"
        "raise SpoolError('invalid', f'{x}: bad')\n"
        "raise ThingError(reasons.INVALID, 'fine')\n"
        "raise SourceError(reason='socket_error')\n"
        "raise SourceError('a' if x else reasons.IO)\n"
        "problems.append(('text_repaired', 'message'))\n"
        "self._problems.add('socket_mismatch', f'{path}')\n"
        "self.note(reasons.IO, 'message')\n"
        "note('deadline', 'message')\n"
        "reason = 'truncated' if x else 'corrupt'\n"
        "if e.reason == 'handler_failed': pass\n"
        "log.info('%s', 'invalid')\n"
        "class Fixed(SourceError):\n"
        "    def __init__(self, message: str) -> None: ...\n"
        "raise Fixed('a message')\n"
    )
    tree = ast.parse(source)
    visitor = ReasonLiterals(error_classes([ast.parse("class SpoolError(FrexporterError): ...\n"
                                                      "class SourceError(FrexporterError): ...\n"), tree]))
    visitor.visit(tree)
    assert [(line, value) for line, value, _ in visitor.found] == [
        (2, "invalid"), (4, "socket_error"), (5, "a"), (6, "text_repaired"), (7, "socket_mismatch"), (9, "deadline"),
        (10, "truncated"), (10, "corrupt"), (11, "handler_failed")]


@pytest.mark.parametrize("source", [
    "raise SpoolError(reasons.INVALID, 'a message')",
    "raise SpoolError(reasons.LIMIT_TEXT, f'{what}: over the bound of {limit}')",
    "errors[reason] = errors.get(reason, 0) + 1",
    "problems.append((reasons.TEXT_REPAIRED, f'{what} is not valid UTF-8'))",
])
def test_checker_passes_constants(source: str) -> None:
    visitor = ReasonLiterals({ERROR_BASE, "SpoolError"})
    visitor.visit(ast.parse(source))
    assert visitor.found == []
