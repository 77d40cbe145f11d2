"""MkDocs hook: relative links written for the repository, mapped to the site.

Pages are written to read on GitHub: docs/x.md links ``../benchmarks/runs/…/results.md``, and a
benchmark run's notes link ``../../docs/performance.md``. In the site the benchmarks lie under
``benchmarks/`` (docs/benchmarks links to ../benchmarks), so each relative link is resolved
from the file's real place in the repository and written again from its place in the site. A
link to anything else of the repository is left as it is, and the strict build refuses it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

LINK = re.compile(r"(\]\()([^)\s]+)(\))")
# Inline code of this many characters or more may wrap (docs/stylesheets/extra.css keeps shorter
# names whole): after the separators of a long test name, path, URL or metric, not mid-word.
LONG_CODE = 33
INLINE_CODE = re.compile(rf"<code>([^<]{{{LONG_CODE},}})</code>")
BREAK_AFTER = re.compile(r"([_/.,=?:])(?=[^_/.,=?:])")  # not &: it starts an entity (&amp;)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Repository folder -> its folder in the site (relative to docs/).
MOUNTS = {os.path.join(ROOT, "docs"): "", os.path.join(ROOT, "benchmarks"): "benchmarks"}


def _site_path(real: str) -> str | None:
    for folder, mount in MOUNTS.items():
        if real == folder or real.startswith(folder + os.sep):
            return os.path.join(mount, os.path.relpath(real, folder))
    return None


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    here_site = os.path.dirname(page.file.src_uri)
    here_real = os.path.dirname(os.path.realpath(page.file.abs_src_path))

    def fix(m: re.Match[str]) -> str:
        target = m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return m.group(0)
        path, hash_, fragment = target.partition("#")
        if not path:
            return m.group(0)
        site = _site_path(os.path.normpath(os.path.join(here_real, path)))
        if site is None:
            return m.group(0)
        new = os.path.relpath(site, here_site or ".")
        if path.endswith("/") and not new.endswith("/"):
            new += "/"
        return m.group(1) + new + hash_ + fragment + m.group(3)

    return LINK.sub(fix, markdown)


def on_pre_build(config: Any) -> None:
    """A public name of the Python API without a docstring is a warning: the strict build fails."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from api_docs import undocumented
    finally:
        sys.path.pop(0)
    for name in undocumented():
        logging.getLogger("mkdocs.hooks").warning("the Python API's %s has no docstring", name)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """A long inline code span (not a code block: its text holds the highlighter's tags) gets a
    break opportunity after each separator, and the class that lets it wrap there."""

    def breakable(m: re.Match[str]) -> str:
        return '<code class="long">' + BREAK_AFTER.sub(r"\1<wbr>", m.group(1)) + "</code>"

    return INLINE_CODE.sub(breakable, html)
