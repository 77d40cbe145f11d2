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
    """Each part gets what it uses in its constructor (the relay, loop.py, is the composition
    root): a Protocol of the relay's members hid what a part depends on and let it grow."""
    hosts = [
        f"{path.relative_to(RELAY)}:{node.lineno}"
        for path in RELAY.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and any(ast.unparse(base) == "Protocol" for base in node.bases)
    ]
    assert hosts == []
