"""docs/hooks.py: a long inline code span may wrap after its separators, and nothing else changes
in it (an HTML entity stays whole)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "docs"))
from hooks import on_page_content  # noqa: E402

sys.path.pop(0)


def test_a_long_code_span_wraps_after_separators_and_keeps_its_entities() -> None:
    html = "<p><code>kinesis://faults?region=us-east-1&amp;endpoint=http_x</code> <code>short_name</code></p>"
    out = on_page_content(html, None, None, None)
    assert '<code class="long">' in out and "&amp;endpoint" in out and "&<wbr>" not in out
    assert "kinesis://<wbr>faults" in out and "<code>short_name</code>" in out
    assert out.replace("<wbr>", "").replace(' class="long"', "") == html


def test_a_code_block_is_left_alone() -> None:
    html = '<pre><span></span><code><span class="n">a_very_long_name_in_a_code_block_here</span></code></pre>'
    assert on_page_content(html, None, None, None) == html
