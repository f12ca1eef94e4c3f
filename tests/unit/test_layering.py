"""The package's layers (docs/architecture.md), checked from the source text: every module under frexporter/ is
parsed with ``ast``, never imported, and every import it makes, at module level, inside a function or under
``TYPE_CHECKING``, must point down or sideways, never up.

Bottom to top (a layer may import itself and the layers listed before it):

    base        frexporter (the version), frexporter.naming, frexporter.model, frexporter.defaults,
                frexporter.errors, frexporter.reasons, frexporter.extras, frexporter.safetext,
                frexporter.ratelimit: names, types, defaults, the error shape and its reasons, extras, text
                made safe, rate-limited log lines
    spool       frexporter.spool (a module or a package): the on-disk contract between recorder and exporter
    fr          frexporter.fr: Flight Recorder dumps and the sequence domain
    sources     frexporter.sources: spool, sockets and NVML to model objects
    analysis    frexporter.analysis: the pure verdict engine; it may import base only
    exporter    frexporter.exporter: the poll loop
    postmortem  frexporter.postmortem: dump files and Prometheus for `frexporter analyze`
    outputs     frexporter.outputs: renderings of a snapshot (Prometheus, OTLP, JSON, evidence)
    web         frexporter.web: the HTTP server and its TLS/auth configuration
    app         frexporter.app: wiring of one exporter process
    demo        frexporter.demo
    cli         frexporter.cli, frexporter.__main__: the only modules that exit the process

The recorder runs inside training ranks, apart from that stack: ``frexporter.recorder`` imports base, spool
and fr only, and only the recorder itself, demo and cli import it. torch is imported in the recorder and in
the demo's rank script only, and only inside functions, so that importing frexporter never imports torch.
The analysis layer does no I/O: no file, socket, process, clock or logging module, and no ``open()`` or
``print()``.

Module names are matched by prefix, so ``frexporter/spool.py`` and a ``frexporter/spool/`` package are the
same layer.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import REPO
from tests.shared.layering import IMPURE_MODULES

PACKAGE = REPO / "frexporter"

ORDER: tuple[tuple[str, tuple[str, ...]], ...] = (
    # and the bare package (ROOT)
    ("base", ("frexporter.naming", "frexporter.model", "frexporter.defaults", "frexporter.errors",
              "frexporter.reasons", "frexporter.extras", "frexporter.safetext", "frexporter.ratelimit")),
    ("spool", ("frexporter.spool",)),
    ("fr", ("frexporter.fr",)),
    ("sources", ("frexporter.sources",)),
    ("analysis", ("frexporter.analysis",)),
    ("exporter", ("frexporter.exporter",)),
    ("postmortem", ("frexporter.postmortem",)),
    ("outputs", ("frexporter.outputs",)),
    ("web", ("frexporter.web",)),
    ("app", ("frexporter.app",)),
    ("demo", ("frexporter.demo",)),
    ("cli", ("frexporter.cli", "frexporter.__main__")),
)
ROOT = "frexporter"
RECORDER = "recorder"
RECORDER_PREFIXES = ("frexporter.recorder",)
RANK = {name: i for i, (name, _) in enumerate(ORDER)}

# Layers whose imports are narrower than "everything below".
ONLY_IMPORTS = {
    "analysis": {"base", "analysis"},
    RECORDER: {"base", "spool", "fr", RECORDER},
}
RECORDER_IMPORTED_BY = {RECORDER, "demo", "cli"}
EXITING = {"cli"}

TORCH_MODULES = ("frexporter.recorder", "frexporter.demo.rank")
IMPURE_CALLS = frozenset({"open", "print", "input", "breakpoint", "__import__", "exec", "eval"})


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    line: int
    target: str  # the imported module, dotted (``from a import b`` -> ``a.b`` when that is a module)
    in_function: bool


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _modules() -> list[tuple[str, Path]]:
    return sorted((_module_name(p), p) for p in PACKAGE.rglob("*.py"))


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.depth = 0
        self.imports: list[Import] = []
        self.calls: list[tuple[int, str]] = []
        self.exits: list[tuple[int, str]] = []

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.imports.append(Import(self.module, node.lineno, alias.name, self.depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            target = f"{base}.{alias.name}"
            if not (base.startswith(ROOT) and _is_module(target)):
                target = base
            self.imports.append(Import(self.module, node.lineno, target, self.depth > 0))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name):
            self.calls.append((node.lineno, func.id))
            if func.id in {"exit", "quit"}:
                self.exits.append((node.lineno, f"{func.id}()"))
        elif (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
              and (func.value.id, func.attr) in {("sys", "exit"), ("os", "_exit"), ("os", "abort")}):
            self.exits.append((node.lineno, f"{func.value.id}.{func.attr}()"))
        self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise) -> None:
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if isinstance(exc, ast.Name) and exc.id == "SystemExit":
            self.exits.append((node.lineno, "raise SystemExit"))
        self.generic_visit(node)


def _parse(module: str, path: Path) -> _Visitor:
    visitor = _Visitor(module, path.name == "__init__.py")
    visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return visitor


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> str | None:
    """The layer of a frexporter module; None for a module outside the package."""
    if module == ROOT:
        return "base"
    if any(_matches(module, p) for p in RECORDER_PREFIXES):
        return RECORDER
    for name, prefixes in ORDER:
        if any(_matches(module, p) for p in prefixes):
            return name
    if _matches(module, ROOT):
        raise AssertionError(f"{module} belongs to no layer: add it to ORDER in tests/unit/test_layering.py and to "
                             "docs/architecture.md")
    return None


def may_import(importer: str, imported: str) -> bool:
    if imported == RECORDER and importer not in RECORDER_IMPORTED_BY:
        return False
    if importer in ONLY_IMPORTS:
        return imported in ONLY_IMPORTS[importer]
    if imported == RECORDER:
        return True
    return RANK[imported] <= RANK[importer]


def _all_imports() -> Iterator[tuple[_Visitor, Import]]:
    for module, path in _modules():
        visitor = _parse(module, path)
        for imp in visitor.imports:
            yield visitor, imp


def _where(imp: Import) -> str:
    return f"{imp.module} (line {imp.line}) imports {imp.target}"


# ---------------------------------------------------------------- the rules


def test_every_module_has_a_layer() -> None:
    modules = [m for m, _ in _modules()]
    assert len(modules) > 40, "found too few modules: the scan is broken"
    for module in modules:
        assert layer_of(module) is not None, module


def test_imports_point_down_the_layers() -> None:
    violations = []
    for visitor, imp in _all_imports():
        imported = layer_of(imp.target)
        importer = layer_of(visitor.module)
        if imported is None or importer is None or may_import(importer, imported):
            continue
        allowed = sorted(ONLY_IMPORTS.get(importer, {n for n, r in RANK.items() if r <= RANK.get(importer, -1)}))
        violations.append(f"{_where(imp)}: layer {importer!r} may not import layer {imported!r} "
                          f"(it may import {', '.join(allowed)})")
    assert not violations, "imports against the layer order (docs/architecture.md):\n" + "\n".join(violations)


def test_analysis_does_no_io() -> None:
    violations = []
    for module, path in _modules():
        if layer_of(module) != "analysis":
            continue
        visitor = _parse(module, path)
        for imp in visitor.imports:
            if imp.target.split(".")[0] in IMPURE_MODULES:
                violations.append(f"{_where(imp)}: the analysis layer is pure (no files, sockets, processes, "
                                  "threads, clocks or logging); take the value as an argument instead")
        for line, name in visitor.calls:
            if name in IMPURE_CALLS:
                violations.append(f"{module} (line {line}) calls {name}(): the analysis layer does no I/O")
    assert not violations, "\n".join(violations)


def test_torch_only_in_ranks_and_only_lazily() -> None:
    violations = []
    for visitor, imp in _all_imports():
        if not _matches(imp.target, "torch"):
            continue
        if not any(_matches(visitor.module, p) for p in TORCH_MODULES):
            violations.append(f"{_where(imp)}: only code that runs inside a training rank may import torch "
                              f"({', '.join(TORCH_MODULES)})")
        elif not imp.in_function:
            violations.append(f"{_where(imp)} at module level: import it inside the function that needs it, so "
                              "that importing frexporter never imports torch")
    assert not violations, "\n".join(violations)


def test_only_the_cli_exits() -> None:
    violations = []
    for module, path in _modules():
        if layer_of(module) in EXITING:
            continue
        for line, how in _parse(module, path).exits:
            violations.append(f"{module} (line {line}): {how}; raise an exception and let frexporter.cli decide "
                              "the exit status")
    assert not violations, "\n".join(violations)


# ---------------------------------------------------------------- the checker itself


@pytest.mark.parametrize(("module", "layer"), [
    ("frexporter", "base"),
    ("frexporter.naming", "base"),
    ("frexporter.spool", "spool"),
    ("frexporter.spool.layout", "spool"),  # spool/ as a package
    ("frexporter.fr.trace", "fr"),
    ("frexporter.recorder.torch_fr", RECORDER),  # not the fr layer
    ("frexporter.sources.ranks", "sources"),
    ("frexporter.sources.ranks.liveness", "sources"),  # sources/ranks/ as a package
    ("frexporter.ratelimit", "base"),
    ("frexporter.reasons", "base"),
    ("frexporter.analysis", "analysis"),
    ("frexporter.exporter", "exporter"),
    ("frexporter.outputs.otlp", "outputs"),
    ("frexporter.__main__", "cli"),
    ("json", None),
    ("torch.distributed", None),
])
def test_layer_of(module: str, layer: str | None) -> None:
    assert layer_of(module) == layer


def test_an_unknown_module_is_named() -> None:
    with pytest.raises(AssertionError, match=r"frexporter\.newthing belongs to no layer"):
        layer_of("frexporter.newthing")


@pytest.mark.parametrize(("importer", "imported", "allowed"), [
    ("sources", "spool", True),
    ("sources", "analysis", False),
    ("analysis", "base", True),
    ("analysis", "spool", False),
    ("analysis", "sources", False),
    ("outputs", "analysis", True),
    ("web", "exporter", True),
    ("exporter", "web", False),
    ("spool", "fr", False),
    (RECORDER, "spool", True),
    (RECORDER, "sources", False),
    ("sources", RECORDER, False),
    ("app", RECORDER, False),
    ("cli", RECORDER, True),
])
def test_may_import(importer: str, imported: str, allowed: bool) -> None:
    assert may_import(importer, imported) is allowed


def test_visitor_resolves_imports() -> None:
    source = (
        "from __future__ import annotations\n"
        "import os.path\n"
        "from frexporter import naming as n, __version__\n"
        "from frexporter.sources.base import SourceError\n"
        "from . import text\n"
        "def f():\n"
        "    import torch\n"
        "    print(open('x'))\n"
        "    raise SystemExit(2)\n"
    )
    visitor = _Visitor("frexporter.analysis.mod", is_package=False)
    visitor.visit(ast.parse(source))
    assert [(i.target, i.in_function) for i in visitor.imports] == [
        ("__future__", False), ("os.path", False), ("frexporter.naming", False), ("frexporter", False),
        ("frexporter.sources.base", False), ("frexporter.analysis.text", False), ("torch", True)]
    assert [name for _, name in visitor.calls] == ["print", "open", "SystemExit"]
    assert visitor.exits == [(9, "raise SystemExit")]
