"""The package reads top-down: no module imports, even lazily inside a function, one that
imports it back (directly or through others)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "outbox"


def _module_name(path: Path) -> str:
    parts = ["outbox", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - node.level + 1], base])
                # `from package import module` depends on the module; `from module import name`
                # on the module.
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            for target in targets:
                target = target.rstrip(".")
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_lazy_imports() -> None:
    graph = _graph()
    assert "outbox.bench.runner" in graph["outbox.bench.cli"]  # imported inside cmd_perf


def test_no_import_circles_in_the_package() -> None:
    # A package's __init__ importing its own submodules (outbox -> outbox.writer -> outbox)
    # is how a public API is re-exported: only circles among other modules count.
    graph = _graph()
    for name, targets in graph.items():
        graph[name] = {t for t in targets if not name.startswith(t + ".")}
    assert _cycles(graph) == []
