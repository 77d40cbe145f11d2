"""The docs' reference pages are what the code says today: scripts/docs-reference writes them from
the parser, the settings, the metrics and the migrations, and this fails when they are stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from outbox.cli.reference import PAGES, render
from outbox.relay.metrics import RelayMetrics

ROOT = Path(__file__).resolve().parents[3]


def test_the_reference_pages_are_generated_from_todays_code() -> None:
    rendered = render()
    assert sorted(rendered) == sorted(f"{p}.md" for p in PAGES)
    stale = [
        name for name, text in rendered.items() if (ROOT / "docs" / "reference" / name).read_text() != text
    ]
    assert not stale, f"stale: docs/reference/{', '.join(stale)}; run scripts/docs-reference"


def test_they_cover_every_command_variable_metric_and_migration() -> None:
    pages = render()
    for command in ("outbox relay", "outbox dead redrive", "outbox inbox prune", "outbox bench explore"):
        assert f"## `{command}`" in pages["cli.md"], command
    for variable in ("OUTBOX_DSN", "OUTBOX_BATCH_SIZE", "OUTBOX_LIMITS", "OUTBOX_WEIGHTS", "OUTBOX_ROUTES"):
        assert f"| `{variable}` |" in pages["settings.md"], variable
    for metric in RelayMetrics()._all:
        assert f"| `{metric.name}` |" in pages["metrics.md"], metric.name
    for sql in sorted((ROOT / "migrations").glob("0*.sql")):
        version, name = sql.stem.split("_", 1)
        assert f"## {version} `{name}`" in pages["migrations.md"], sql.name


def test_a_variable_set_in_the_environment_does_not_leak_into_the_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_BATCH_SIZE", "7")
    assert render() == {name: (ROOT / "docs" / "reference" / name).read_text() for name in render()}
