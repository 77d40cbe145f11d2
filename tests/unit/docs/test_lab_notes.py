"""User pages are for users, not a lab notebook: no issue numbers, no clock times or dates of a
measurement in the prose, no "a faster hour", no "item 6 below" or "the issue's measurement".
Those belong to the run folders (benchmarks/runs/) and benchmarks/notes/. Code blocks and inline
code are left out (a log line or a command may show a time); so are link targets (a run folder is
named by its date) and the changelog's release headings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PHRASES = {
    "an issue number": r"\bissues? #?\d+",
    "the issue itself": r"\bthe issue'?s\b|\bthis issue\b",
    "an hour of the machine": r"\b(?:faster|slower|slow|quiet|busy|normal) hour\b",
    "a machine compared in passing": r"\b(?:a|the) (?:slower|faster) (?:machine|Intel|AMD|one)\b",
    "a run by its order": r"\b(?:first|second|third|latest) (?:full )?runs?\b(?! of)",
    "a raw run header": r"\bRun 20\d\d-\d\d-\d\dT",
    "a clock time": r"(?<![\w.:/-])\d{1,2}:\d{2}(?::\d{2})?(?![\w:])",
    "a date": r"(?<![\w/-])20\d\d-\d\d-\d\d(?![\w-])",
    "a note's cross-reference": r"\bitem \d+ (?:below|above)\b",
    "the developers' diary": r"\b(?:this|last|next) round\b|\bmy bar\b|\bour bar\b",
}


def prose(text: str) -> str:
    """The text a reader reads as sentences: without code, link targets, HTML comments, or
    release headings (``## [0.2.0] - 2026-11-28``)."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    text = re.sub(r"\]\([^)\s]*\)", "]", text)
    text = re.sub(r"!\[[^\]]*\]", "", text)
    return re.sub(r"^## \[[^\]]+\] - .*$", "", text, flags=re.MULTILINE)


def lab_notes(text: str, kinds: tuple[str, ...] = tuple(PHRASES)) -> list[str]:
    """Each phrase (of ``kinds``) found, with its surroundings; a phrase may span a line break."""
    flat = re.sub(r"\s+", " ", prose(text))
    found = []
    for what, pattern in ((k, PHRASES[k]) for k in kinds):
        for m in re.finditer(pattern, flat, re.IGNORECASE):
            found.append(f"{what}: {m.group(0)!r} in {flat[max(0, m.start() - 60) : m.end() + 40]!r}")
    return found


def _pages() -> list[Path]:
    docs = ROOT / "docs"
    pages = [p for p in docs.rglob("*.md") if "benchmarks" not in p.relative_to(docs).parts]
    return sorted([*pages, ROOT / "README.md", ROOT / "CHANGELOG.md"])


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_lab_notes_in_user_pages(page: Path) -> None:
    found = lab_notes(page.read_text())
    assert not found, "\n".join(found)


def test_the_runs_index_names_no_issue() -> None:
    """The benchmark runs' index is in the site's nav: its runs go by date, but not by issue."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    found = lab_notes(text, ("an issue number", "the issue itself"))
    assert not found, "\n".join(found)


def test_each_phrase_is_found_and_code_is_not() -> None:
    text = """A faster hour gave 12 ms (issue 45), as item 6 below says; the first run (07:47,
2026-11-24) was slower. Run 2026-11-25T05:52:21+00:00 on a slower Intel Xeon. My bar said so.
`outbox replay --since 2026-11-20T00:00` and [the run](runs/2026-11-22-faults/README.md).
```
  2  2026-11-24 15:02:11  cli  redrive
```
"""
    kinds = {line.split(":")[0] for line in lab_notes(text)}
    assert kinds == set(PHRASES) - {"the issue itself"}
    assert not [x for x in lab_notes(text) if "15:02" in x or "2026-11-20" in x or "2026-11-22" in x]
