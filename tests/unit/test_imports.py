"""The package reads top-down: no module imports, even lazily inside a function, one that
imports it back (directly or through others)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.same_on_every_python

ROOT = Path(__file__).resolve().parents[2]
# The runtime (outbox-relay) and the bench (outbox-relay-bench, in benchmarks/): one graph.
PACKAGES = (ROOT / "outbox", ROOT / "benchmarks" / "outbox_bench")


def _module_name(path: Path) -> str:
    package = next(p for p in PACKAGES if p in path.parents)
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for package in PACKAGES for p in package.rglob("*.py")}
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
    assert "outbox_bench.runner" in graph["outbox_bench.cli"]  # imported inside cmd_perf


def test_the_runtime_never_imports_the_bench() -> None:
    """Not even lazily: the bench is another distribution, built on the runtime. The command line
    finds `outbox bench` through an entry point (outbox.cli.PLUGINS)."""
    graph = _graph()
    upward = {(m, t) for m, targets in graph.items() if m.startswith("outbox.") for t in targets}
    assert {(m, t) for m, t in upward if t.startswith("outbox_bench")} == set()
    assert any(t.startswith("outbox.") for t in graph["outbox_bench.cli"])  # the graph holds both


def test_no_import_circles_in_the_package() -> None:
    # A package's __init__ importing its own submodules (outbox -> outbox.writer -> outbox)
    # is how a public API is re-exported: only circles among other modules count.
    graph = _graph()
    for name, targets in graph.items():
        graph[name] = {t for t in targets if not name.startswith(t + ".")}
    assert _cycles(graph) == []


# What runs in production: the relay, the console, the writers, the inbox, migrate, and the
# command line of each of them. None of it may load the bench or the harness (test tooling, peers'
# clients, embedded servers): the relay's image need not carry them, and a bug there is not its.
RUNTIME = (
    "outbox", "outbox.relay.relay", "outbox.fleet.fleet", "outbox.console.web", "outbox.console.fleet",
    "outbox.write.writer", "outbox.inbox", "outbox.store.migrate", "outbox.testing", "outbox.contrib.alembic",
)  # fmt: skip
COMMANDS = (
    ["relay", "--kafka-bootstrap", "k:1"],
    ["migrate"],
    ["status"],
    ["console"],
    ["dead", "list", "--all"],
)


def test_the_runtime_imports_nothing_of_the_bench_or_the_harness() -> None:
    """Measured in a fresh interpreter: every runtime module imported, and each command's line
    parsed (the parser of `outbox bench` is built only for `outbox bench`)."""
    import subprocess
    import sys

    probe = (
        "import importlib, sys\n"
        f"for m in {RUNTIME!r}: importlib.import_module(m)\n"
        "from outbox.cli import build_parser\n"
        f"for argv in {COMMANDS!r}: build_parser(bench=False).parse_args(argv)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('outbox_bench', 'outbox.harness'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("argv", [["status", "--help"], ["migrate", "--help"], ["dead", "list", "--help"]])
def test_a_command_that_moves_no_event_imports_neither_the_relay_nor_the_console(argv: list[str]) -> None:
    """Each command's parser is built alone (cli.GROUPS): `outbox status` in a cron job or a probe
    does not pay for importing the relay, its sinks or the console (about 80 ms a call)."""
    import subprocess
    import sys

    probe = (
        "import runpy, sys\n"
        f"sys.argv = ['outbox', *{argv!r}]\n"
        "try:\n    runpy.run_module('outbox', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith(('outbox.relay.relay', 'outbox.console', "
        "'outbox.sinks.kafka', 'outbox.cli.relay', 'outbox.cli.console', 'outbox.cli.demo'))), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert "usage: outbox" in out.stdout and out.stderr.strip() == "[]", out.stderr


# The one import that runs upward between packages: the command line registers `outbox bench`,
# whose package stands above it (the bench drives relays through the command line's options).
UPWARD = {("outbox.cli", "outbox_bench")}


def test_the_packages_stand_in_layers_with_one_import_upward() -> None:
    """Modules collapsed to their top package (outbox.relay, outbox.store, ...): without the
    imports in UPWARD the packages' graph has no circle, so an order of the packages exists in
    which every other import runs downward."""
    graph: dict[str, set[str]] = {}
    for name, targets in _graph().items():
        package = ".".join(name.split(".")[:2])
        graph.setdefault(package, set())
        for target in targets:
            other = ".".join(target.split(".")[:2])
            if other not in (package, "outbox") and (package, other) not in UPWARD:
                graph[package].add(other)
    graph = {p: {t for t in targets if t in graph} for p, targets in graph.items()}
    assert _cycles(graph) == []
    assert len(graph) >= 15  # the packages by concept, not one flat room
