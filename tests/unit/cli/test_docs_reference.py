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
        assert f"| {version} `{name}` |" in pages["migrations.md"], sql.name


def test_a_variable_set_in_the_environment_does_not_leak_into_the_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_BATCH_SIZE", "7")
    assert render() == {name: (ROOT / "docs" / "reference" / name).read_text() for name in render()}


def test_settings_are_by_command_and_the_tools_apart() -> None:
    """Each variable once; the bench's, the demo's and the fault suite's on their own page; the
    relay's under the headings of RELAY_GROUPS; a choice's values shown."""
    import re

    from outbox.cli.reference import RELAY_GROUPS

    pages = render()
    product, tools = pages["settings.md"], pages["settings-tools.md"]
    from outbox.cli.reference import commands, rows

    listed = re.findall(r"^\| `(OUTBOX_\w+)` \|", product, re.MULTILINE)
    listed_tools = re.findall(r"^\| `(OUTBOX_\w+)` \|", tools, re.MULTILINE)
    assert len(listed) == len(set(listed)) and len(listed_tools) == len(set(listed_tools))
    every = {r.env for _, parser, _ in commands() for r in rows(parser) if r.env}
    assert set(listed) | set(listed_tools) == every
    assert not [v for v in listed if v.startswith(("OUTBOX_BENCH_", "OUTBOX_DEMO_", "OUTBOX_DEV_"))]
    assert "| `OUTBOX_BENCH_EVENTS` |" in tools and "| `OUTBOX_DEV_PG_PORT` |" in tools
    for title in RELAY_GROUPS:
        assert f"\n### {title}\n" in product, title
    assert "| `OUTBOX_LOG_FORMAT` | log line format; one of: `text`, `json` |" in product
    assert "`yes` or `on`" in product  # the switches' syntax, said once
    assert (
        product.index("### Batching") < product.index("`OUTBOX_BATCH_SIZE`") < product.index("### Ordering")
    )


def test_a_relay_option_in_no_group_fails_the_render() -> None:
    from outbox.cli.reference import Row, _grouped

    with pytest.raises(ValueError, match="--brand-new"):
        _grouped([Row("--brand-new", "OUTBOX_BRAND_NEW", None, "a new option")])


def test_a_migration_says_its_release_and_the_hot_tables_it_locks() -> None:
    from outbox.cli.reference import hot_locks, since

    assert (since(1), since(4), since(5), since(18), since(19)) == (
        "0.1.0",
        "0.1.0",
        "0.2.0",
        "0.2.0",
        "unreleased",
    )
    sql = """
        CREATE INDEX events_key_idx ON {schema}.events (key, id);
        CREATE INDEX CONCURRENTLY delivered_x ON {schema}.delivered (x);
        ALTER TABLE {schema}.delivered ADD COLUMN p smallint GENERATED ALWAYS AS (1) STORED;
        ALTER TABLE {schema}.inbox ADD COLUMN y text;
        CREATE TRIGGER t AFTER INSERT ON {schema}.events FOR EACH ROW EXECUTE FUNCTION f();
    """
    assert hot_locks(sql) == [
        "`events`: SHARE until the index is built (inserts wait)",
        "`delivered`: ACCESS EXCLUSIVE, while it is rewritten (all wait)",
    ]
    assert hot_locks("ALTER TABLE {schema}.events ADD COLUMN t text;") == [
        "`events`: ACCESS EXCLUSIVE, brief (all wait)"
    ]
    page = render()["migrations.md"]
    assert "| 0012 `events_by_key` | A key's pending events, indexed. | 0.2.0 | `events`: SHARE" in page
