"""The package's comments say why in a line or two: what was measured, and how much, is in
docs/decisions/0013-measured-choices.md and the run folders, not in a docstring. A comment that
names a measurement (a time a call or an event, a share of a core, a before -> after) points
there instead."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import outbox

PACKAGE = Path(outbox.__file__).parent
MEASUREMENT = re.compile(
    r"\bmeasured\b"
    r"|\d\s?(?:µs|us)\b"  # a time per call or per event
    r"|\d[\d.]*\s?ms (?:a|an|per|of CPU|where|against)\b"
    r"|\d\s?% of (?:the|its|a|one)\b"  # a share of the loop's time, of a core
    r"|\d[\d.]*\s?(?:->|→)\s?\d"  # before -> after
    r"|\bagainst \d[\d.,]*\s?(?:ms|s|%|us|µs)?\b",
    re.IGNORECASE,
)


def _texts(path: Path) -> Iterator[tuple[int, str]]:
    """Each comment and docstring of a module, with its line."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.body[0].lineno, doc


def measurements(path: Path) -> list[tuple[str, str]]:
    """Each measurement named in a comment or docstring of ``path``: where, and the words."""
    return [
        (f"{path.name}:{line}: {' '.join(text.split())[:160]!r}", m.group(0))
        for line, text in _texts(path)
        for m in MEASUREMENT.finditer(" ".join(text.split()))
    ]


def test_no_comment_of_the_package_keeps_a_measurement() -> None:
    found = [
        f"{words!r} in {where}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for where, words in measurements(path)
    ]
    assert not found, "\n".join(found)


def test_each_kind_of_measurement_is_found(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        '"""Measured first: 1,100 requests/s."""\n'
        "# parses keyword arguments (1.32 -> 0.87 per call)\n"
        "# decodes with surrogatepass, 5.4 against 1.0 us a message\n"
        "# took the page 640 ms at 1,000 outboxes; 150 ms a check\n"
        "# an isinstance walks its members: 6 % of the loop's time\n"
        "x = 1  # a 50 ms poll, every 60-120 s, 10 s not 60: reasons, not measurements\n"
    )
    words = sorted(w for _, w in measurements(module))
    assert words == ["1.32 -> 0", "150 ms a", "6 % of the", "Measured", "against 1.0 us"], words
