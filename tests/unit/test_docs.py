"""A fresh clone holds every document its README leads to: the README's and the docs'
links (markdown links and `docs/...` paths in code spans) all resolve to files inside the
repository, followed from page to page, and none points outside it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
SPAN_PATH = re.compile(r"`((?:\.\./)*(?:docs|shared)/[\w./-]+\.(?:md|png))`")
EXTERNAL = ("http://", "https://", "mailto:")


def _targets(page: Path) -> list[tuple[str, Path]]:
    """(target as written, where it leads): a markdown link is relative to its page, a path
    in a code span (`docs/x.md`) to the repository root, as the pages write them."""
    text = page.read_text()
    return [(t, (page.parent / t.split("#")[0]).resolve()) for t in LINK.findall(text)
            if not t.startswith(EXTERNAL + ("#",))] + \
        [(t, (ROOT / t).resolve()) for t in SPAN_PATH.findall(text)]


def broken_links(start: Path) -> list[str]:
    """Every link reachable from `start` that leaves the repository or leads nowhere."""
    seen, todo, broken = set(), [start.resolve()], []
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for target, where in _targets(page):
            if not where.is_relative_to(ROOT):
                broken.append(f"{page.relative_to(ROOT)}: {target} (outside the repository)")
            elif not where.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif where.suffix == ".md":
                todo.append(where)
    return broken


def test_every_page_the_readme_leads_to_is_in_the_repository():
    assert broken_links(ROOT / "README.md") == []


def test_every_docs_page_is_reached_from_the_readme_or_links_only_inside():
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert broken_links(page) == [], page.name


def test_the_check_sees_a_link_outside_and_a_missing_page(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("[b](b.md) and `docs/c.md`\n")
    (tmp_path / "docs" / "b.md").write_text("see `../shared/DESIGN.md` and [x](../../x.md)\n")
    (tmp_path / "README.md").write_text("[a](docs/a.md)\n")
    assert sorted(broken_links(tmp_path / "README.md")) == [
        "docs/a.md: docs/c.md (no such file)",
        "docs/b.md: ../../x.md (outside the repository)",
        "docs/b.md: ../shared/DESIGN.md (outside the repository)"]
