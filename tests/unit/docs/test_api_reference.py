"""The Python API reference covers what users import, each public name with a docstring of its own
(docs/api_docs.py; the strict build fails on one without)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "docs"))
from api_docs import API, ROLE, _code, undocumented  # noqa: E402

sys.path.pop(0)


def test_every_public_name_of_the_api_has_a_docstring() -> None:
    assert undocumented() == []


def test_the_check_finds_a_module_without_a_public_list_and_a_name_without_a_docstring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert undocumented(("outbox.events",)) == ["outbox.events: no __all__ (which of its names are public?)"]
    import griffe

    real = griffe.load

    def stripped(*args: object, **kwargs: object) -> griffe.Object:
        package = real(*args, **kwargs)  # type: ignore[arg-type]
        package["inbox"]["prune"].docstring = None
        return package  # type: ignore[return-value]

    monkeypatch.setattr(griffe, "load", stripped)
    assert undocumented(("outbox.inbox",)) == ["outbox.inbox.prune"]


def test_the_page_renders_each_module_and_roles_read_as_code() -> None:
    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    assert all(f"::: {module}\n" in page for module in API)
    text = "raises :class:`~outbox.errors.NotMigrated` (see :func:`outbox.inbox.prune`)"
    assert ROLE.sub(_code, text) == "raises `NotMigrated` (see `outbox.inbox.prune`)"
