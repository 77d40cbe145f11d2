"""Where the project lives, said once: pyproject's URLs and mkdocs.yml's agree, and every README
link is absolute on them (PyPI shows the README with no repository around it) and leads to a
page, a heading or a file that exists."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml
from markdown.extensions.toc import slugify

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest's own dependency before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[3]
URLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
SITE, REPO = URLS["Documentation"], URLS["Source"]
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def _mkdocs() -> dict[str, object]:
    class Loader(yaml.SafeLoader):  # mkdocs.yml's !!python tags, if any, are not ours to run
        pass

    Loader.add_multi_constructor("", lambda *_: None)
    return dict(yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader))


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


def _page(url: str) -> Path:
    """The source file of a page of the site."""
    path = url.removeprefix(SITE).strip("/")
    special = {"": ROOT / "docs" / "index.md", "benchmarks": ROOT / "benchmarks" / "README.md"}
    return special.get(path, ROOT / "docs" / f"{path}.md")


def test_pyproject_and_mkdocs_name_the_same_places() -> None:
    mkdocs = _mkdocs()
    assert mkdocs["site_url"] == SITE and SITE.endswith("/")
    assert mkdocs["repo_url"] == REPO
    assert URLS["Changelog"] == f"{SITE}changelog/" and URLS["Issues"] == f"{REPO}/issues"


def test_every_readme_link_is_absolute_and_leads_somewhere() -> None:
    links = LINK.findall((ROOT / "README.md").read_text())
    assert len(links) > 20
    for text, url in links:
        assert url.startswith("https://"), f"[{text}]({url}): relative, broken on PyPI"
        target, _, anchor = url.partition("#")
        if target.startswith(SITE):
            page = _page(target)
            assert page.is_file(), f"[{text}]({url}): no page {page.relative_to(ROOT)}"
            if anchor:
                assert anchor in _anchors(page), f"[{text}]({url}): no heading #{anchor}"
        elif target.startswith(f"{REPO}/blob/main/"):
            assert (ROOT / target.removeprefix(f"{REPO}/blob/main/")).is_file(), url
        assert not re.fullmatch(r"[\w./-]+\.(md|py|yml)", text), f"[{text}]: a file name, not a name"


def test_the_check_finds_a_broken_link() -> None:
    assert not _page(f"{SITE}no-such-page/").is_file()
    assert "the-flow-of-one-event" in _anchors(ROOT / "docs" / "architecture.md")
    assert "no-such-heading" not in _anchors(ROOT / "docs" / "architecture.md")
