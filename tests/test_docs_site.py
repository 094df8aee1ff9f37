"""The docs: README.md stays short and its links land, and docs/ builds as a site with
`mkdocs build --strict` (every page in the nav, no broken link or anchor). In-process: the fast
tier starts no process."""

from __future__ import annotations

import logging
import re
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT

DOCS = ROOT / "docs"
README = ROOT / "README.md"
SETUP_COMMANDS = ["bash tools/venv.sh && .venv/bin/python -m runner",
                  "bash tools/venv.sh test && .venv/bin/python -m pytest -q"]
FENCE = re.compile(r"^ {0,3}(```|~~~)")


def prose(text: str) -> str:
    """The text with fenced code blocks blanked (their lines kept, so line numbers hold)."""
    out, fence = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            fence = not fence
            out.append("")
        else:
            out.append("" if fence else line)
    return "\n".join(out)


def fenced_blocks(text: str) -> list[list[str]]:
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in text.split("\n"):
        if FENCE.match(line):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (what a link from README.md meets on GitHub): links reduced to
    their text, lower case, every character but letters, digits, spaces, hyphens and underscores
    dropped, spaces to hyphens. The site's anchors (Python-Markdown's toc) agree for these pages'
    headings; mkdocs checks those itself."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in a Markdown page, GitHub's numbering of repeats included."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(page.read_text()).split("\n"):
        match = re.match(r"^#{1,6} +(.*?)(?: +#+)?$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_readme_is_short_and_starts_with_the_two_setup_commands() -> None:
    text = README.read_text()
    lines = text.count("\n") + (0 if text.endswith("\n") else 1)
    assert lines <= 250, f"README.md has {lines} lines; the rest belongs in docs/ (at most 250)"
    blocks = fenced_blocks(text)
    assert blocks, "README.md has no code block"
    assert blocks[0] == SETUP_COMMANDS, f"README.md's first code block is {blocks[0]}, not the two set-up commands"


def test_readme_links_land() -> None:
    """Every relative link in README.md names a file that exists, and a heading of it when it
    names an anchor: the links work on GitHub, where docs/ is read as it is."""
    broken = []
    links = re.findall(r"\]\(([^)\s]+)\)", prose(README.read_text()))
    assert any(link.startswith("docs/") for link in links), "README.md links nowhere into docs/"
    for link in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = README.parent / path if path else README
        if not target.exists():
            broken.append(f"{link}: no file {path}")
        elif anchor and (target.suffix != ".md" or anchor not in anchors(target)):
            broken.append(f"{link}: {path or 'README.md'} has no heading with the anchor #{anchor}")
    assert not broken, "README.md's broken links:\n" + "\n".join(broken)


def nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    if isinstance(nav, list):
        return [page for item in nav for page in nav_pages(item)]
    return []


def test_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_pages(config["nav"])
    pages = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
    assert sorted(set(listed)) == sorted(listed), f"a page is in the nav twice: {listed}"
    assert not set(pages) - set(listed), f"pages missing from mkdocs.yml's nav: {sorted(set(pages) - set(listed))}"
    assert not set(listed) - set(pages), f"the nav names pages that do not exist: {sorted(set(listed) - set(pages))}"
    for name in ("config", "names", "exit-codes", "cli"):
        assert f"reference/{name}.md" in listed


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname}: {record.getMessage()}")


def test_site_builds_strict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mkdocs build --strict`: a broken link or anchor, a page outside the nav or a nav entry
    without a page is a warning, and strict mode makes any warning fail the build."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")  # Material's notice about MkDocs 2.0
    collect = Collect()
    logger = logging.getLogger("mkdocs")
    logger.addHandler(collect)
    try:
        config = load_config(str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site"))
        try:
            build(config)
        except Abort as error:
            pytest.fail(f"mkdocs build --strict failed ({error}):\n" + "\n".join(collect.messages))
    finally:
        logger.removeHandler(collect)
    assert not collect.messages, "\n".join(collect.messages)
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()
