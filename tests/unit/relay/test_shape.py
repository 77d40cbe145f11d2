"""The relay's shape, read from its code: a lane's state has one writer each."""

from __future__ import annotations

import ast
import dataclasses
from collections import defaultdict
from pathlib import Path

import outbox.relay
from outbox.relay.lanes import Lane

RELAY = Path(outbox.relay.__file__).parent
FIELDS = {f.name for f in dataclasses.fields(Lane)}
MUTATORS = {"append", "remove", "pop", "clear", "add", "discard", "extend", "insert", "update"}


def _owner(path: Path) -> str:
    """The module that writes: a package of services (upkeep/) counts as one."""
    parts = path.relative_to(RELAY).parts
    return parts[0] if len(parts) > 1 else path.stem


def _field_written(node: ast.expr) -> str | None:
    """The lane field an assignment target or a mutated receiver reaches (``lane.pace.cap``:
    pace), when it is rooted at a name other than the module's own object."""
    chain: list[str] = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if isinstance(node, ast.Subscript):
        return None
    if not isinstance(node, ast.Name) or node.id in ("self", "relay", "cls") or not chain:
        return None
    first = chain[-1]
    return first if first in FIELDS else None


def _writers() -> dict[str, set[str]]:
    writers: dict[str, set[str]] = defaultdict(set)
    for path in RELAY.rglob("*.py"):
        if path.name == "lanes.py":  # the lane's own methods
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS
            ):
                targets = [node.func.value]
            for target in targets:
                for each in target.elts if isinstance(target, ast.Tuple) else [target]:
                    field = _field_written(each)
                    if field is not None:
                        writers[field].add(_owner(path))
    return writers


def test_every_lane_field_is_written_by_one_part_of_the_relay() -> None:
    """A lane is the loop thread's, and each of its fields one part's to write: the others ask
    that part (ClaimScheduler.claimed, BatchRecorder.claim, WalIntake.table_news ...)."""
    writers = _writers()
    assert {"in_flight", "more_work", "retry_at", "wal", "upkept"} <= set(writers)  # the reader works
    shared = {field: sorted(parts) for field, parts in writers.items() if len(parts) > 1}
    assert shared == {}, f"lane fields written by more than one part: {shared}"


def test_no_part_of_the_relay_reaches_it_through_a_host_protocol() -> None:
    """Each part gets what it uses in its constructor (the relay, relay.py, is the composition
    root): a Protocol of the relay's members hid what a part depends on and let it grow."""
    hosts = [
        f"{path.relative_to(RELAY)}:{node.lineno}"
        for path in RELAY.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and any(ast.unparse(base) == "Protocol" for base in node.bases)
    ]
    assert hosts == []


ROOT = "relay"  # the composition root (relay.py): it builds every part
LOOP = "loop"


def _module(path: Path) -> str:
    parts = list(path.relative_to(RELAY).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """Each relay module and the relay modules it imports (type-only imports too: a part that
    names another in its annotations depends on it)."""
    modules = {_module(p): p for p in RELAY.rglob("*.py") if _module(p)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(
                        package[: len(package) - node.level + 1] + ([node.module] if node.module else [])
                    )
                elif (node.module or "").startswith("outbox.relay"):
                    base = (node.module or "").removeprefix("outbox.relay").lstrip(".")
                else:
                    continue
                for alias in node.names:
                    target = f"{base}.{alias.name}" if base else alias.name
                    found.add(target if target in modules else base)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _layers(graph: dict[str, set[str]]) -> dict[str, int]:
    layers: dict[str, int] = {}

    def layer(name: str) -> int:
        if name not in layers:
            layers[name] = 1 + max((layer(m) for m in graph[name]), default=0)
        return layers[name]

    for name in graph:
        layer(name)
    return layers


def test_each_part_of_the_relay_imports_at_most_five_others_and_the_loop_eight() -> None:
    """A part that needs more of its siblings does more than one thing; the loop sees the stages
    and the services, not how they work. Only the composition root builds them all."""
    graph = _imports()
    assert {"loop", "intake", "dispatch", "ledger", "finisher"} <= set(graph)  # the reader works
    over = {
        name: len(deps) for name, deps in graph.items() if name != ROOT and len(deps) > 5 and name != LOOP
    }
    assert over == {}
    assert len(graph[LOOP]) <= 8, sorted(graph[LOOP])


def test_the_relay_modules_import_graph_stays_shallow() -> None:
    """Each module one layer above the deepest relay module it imports: at most 8, the composition
    root on top. It was 12 before the stages (docs/decisions/0011-relay-stages.md); the fleet, the
    process's relays over several databases, is a package of its own above the relay."""
    layers = _layers(_imports())
    assert max(layers.values()) <= 8 and layers[ROOT] == max(layers.values()), sorted(
        layers.items(), key=lambda x: x[1]
    )
