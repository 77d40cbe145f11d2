"""The docs as a reader sees them: the site built strictly, every page opened in Chromium at
1280 px, failing on what a reader would trip over: the page or a code block or table wider than
its column (hidden behind a sideways scroll), a name in a table broken across lines, an image
that does not load, a link whose text is a file name rather than the name of what it leads to. A
canary page with each defect proves the checks see them. Screenshots of the reference pages are
saved (OUTBOX_TEST_SCREENSHOTS, else the test's own directory)."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, sync_playwright

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
WIDTH = 1280
SHOTS = ("reference/settings/", "reference/cli/", "reference/api/")

pytestmark = pytest.mark.timeout(600)

# Per page: how far the page scrolls sideways; each code block, table or scroll wrapper whose
# content is wider than it; each name in a table's code broken across lines (OUTBOX_AR|CHIVE; a
# long one, which docs/hooks.py lets wrap after its separators, aside);
# each image that did not load; each link whose text is a file name.
CHECK = r"""() => {
  const root = document.documentElement;
  const out = {page: root.scrollWidth - root.clientWidth, wide: [], broken: [], images: [], files: []};
  for (const el of document.querySelectorAll(
      '.md-typeset pre > code, .md-typeset table, .md-typeset__scrollwrap, .md-typeset__table')) {
    if (el.scrollWidth > el.clientWidth + 1) {
      out.wide.push(`${el.scrollWidth - el.clientWidth}px: ${el.textContent.trim().slice(0, 70)}`);
    }
  }
  for (const code of document.querySelectorAll('.md-typeset td code:not(.long), .md-typeset th code')) {
    if (code.getClientRects().length > 1) out.broken.push(code.textContent);
  }
  for (const img of document.querySelectorAll('img')) {
    if (!(img.complete && img.naturalWidth > 0)) out.images.push(img.getAttribute('src'));
  }
  for (const a of document.querySelectorAll('.md-content a[href]')) {
    const text = a.textContent.trim();
    if (/^[\w.\/-]+\.(md|py|sql|ya?ml|json|toml|txt|csv|png|html)$/.test(text)) {
      out.files.push(`${text} -> ${a.getAttribute('href')}`);
    }
  }
  return out;
}"""

CANARY = """<!doctype html><html><head><meta charset="utf-8"></head><body style="margin:0">
<div class="md-content"><article class="md-typeset" style="width:600px">
<pre><code style="display:block;overflow:auto;white-space:pre">{line}</code></pre>
<table><tr><td style="width:40px"><code style="overflow-wrap:anywhere">OUTBOX_ARCHIVE_SOMETHING_LONG</code></td></tr></table>
<img src="missing.png"><a href="../x/">reliability.md</a>
<div style="width:{width}px">wider than the page</div></article></div></body></html>"""


def _built(out: Path) -> None:
    """The site, strictly built into ``out``: scripts/test's own build when it made one
    (OUTBOX_DOCS_SITE, its exit code beside it once done), else built here."""
    given = os.environ.get("OUTBOX_DOCS_SITE")
    if given:
        rc = Path(f"{given}.rc")
        deadline = time.monotonic() + 300
        while not rc.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        if rc.exists() and rc.read_text().strip() == "0":
            shutil.copytree(given, out, dirs_exist_ok=True)
            return
    mkdocs = Path(sys.executable).with_name("mkdocs")
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    out = tmp_path_factory.mktemp("site")
    _built(out)
    (out / "canary").mkdir()
    (out / "canary" / "index.html").write_text(CANARY.format(line="x" * 400, width=WIDTH * 2))
    handler = functools.partial(_Quiet, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", out
    finally:
        server.shutdown()
        server.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def page() -> Iterator[Page]:
    with sync_playwright() as p:
        # Never `playwright install` (it downloads): the machine's chromium, as root without a sandbox.
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], timeout=60_000)
        page = browser.new_page(viewport={"width": WIDTH, "height": 900})
        # The search box's worker fetches and indexes the whole site on every page load: half the
        # test's CPU, and nothing it looks at.
        page.route("**/search/search_index.json", lambda route: route.abort())
        page.route("**/search/worker*.js", lambda route: route.abort())
        yield page
        browser.close()


def _look(page: Page, url: str) -> dict[str, Any]:
    page.goto(url, wait_until="load")
    return dict(page.evaluate(CHECK))


def test_the_checks_see_each_defect(site: tuple[str, Path], page: Page) -> None:
    base, _ = site
    seen = _look(page, base + "canary/")
    assert seen["page"] > 0 and seen["wide"] and seen["images"] == ["missing.png"]
    assert seen["broken"] == ["OUTBOX_ARCHIVE_SOMETHING_LONG"]
    assert seen["files"] == ["reliability.md -> ../x/"]


def test_every_page_reads_at_1280_px(site: tuple[str, Path], page: Page, tmp_path: Path) -> None:
    base, out = site
    pages = sorted(
        p.parent.relative_to(out).as_posix() + "/"
        for p in out.rglob("index.html")
        if not {"assets", "search", "canary"} & set(p.relative_to(out).parts)
    )
    assert len(pages) > 50 and "./" in pages
    shots = Path(os.environ.get("OUTBOX_TEST_SCREENSHOTS") or tmp_path)
    problems = []
    for rel in pages:
        rel = "" if rel == "./" else rel
        seen = _look(page, base + rel)
        if seen["page"] > 0:
            problems.append(f"{rel}: the page scrolls sideways by {seen['page']}px")
        problems += [f"{rel}: wider than its column by {w}" for w in seen["wide"]]
        problems += [f"{rel}: a name broken across lines: {name}" for name in seen["broken"]]
        problems += [f"{rel}: image does not load: {src}" for src in seen["images"]]
        problems += [f"{rel}: a link's text is a file name: {f}" for f in seen["files"]]
        if rel in SHOTS:
            shots.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shots / (rel.strip("/").replace("/", "-") + ".png")))
    assert not problems, "\n".join(problems)
