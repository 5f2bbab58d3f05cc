"""The user documentation stays a set of user pages: docs/*.md within a word budget, without load-average or per-issue
bookkeeping (that goes to docs/dev/), every page reachable from the landing page, and every measured figure quoted
on a page from its one source, docs/figures.yaml (scripts/figures.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, load_bench

USER_PAGES = sorted((REPO / "docs").glob("*.md"))
WORD_BUDGET = 30_000
# what an engineering record says and a user page does not: the machine's load during a measurement, issue numbers
BOOKKEEPING = re.compile(r"load average|\bload \d|\bissue \d+|\bissues? #\d+", re.I)
FIGURES = load_bench("figures", folder="scripts")  # the quote's syntax and the source's reader, as the script has them
QUOTE = FIGURES.QUOTE


def test_user_pages_hold_at_most_the_word_budget() -> None:
    words = {p.name: len(QUOTE.sub(r"\2", p.read_text()).split()) for p in USER_PAGES}
    assert sum(words.values()) <= WORD_BUDGET, sorted(words.items(), key=lambda kv: -kv[1])


@pytest.mark.parametrize("page", [REPO / "README.md", *USER_PAGES], ids=lambda p: p.name)
def test_user_page_keeps_no_load_or_issue_bookkeeping(page: Path) -> None:
    found = [
        f"{page.name}:{n}: {line.strip()}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if BOOKKEEPING.search(line)
    ]
    assert not found, "move these to docs/dev/:\n" + "\n".join(found)


def test_landing_page_links_every_user_page() -> None:
    index = (REPO / "docs" / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w/-]+\.md)(?:#[\w-]*)?\)", index))
    missing = [p.name for p in USER_PAGES if p.name != "index.md" and p.name not in linked]
    assert not missing, missing


def test_every_quoted_figure_matches_its_source() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/figures.py", "--check"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_every_figure_is_quoted_and_says_how_to_reproduce_it() -> None:
    quoted = {m.group(1) for p in [REPO / "README.md", *USER_PAGES] for m in QUOTE.finditer(p.read_text())}
    for name, entry in FIGURES.figures().items():
        assert name in quoted, f"{name} is quoted on no page: remove it from docs/figures.yaml"
        command = entry["command"]
        scripts = re.findall(r"\b(bench/[\w/]+\.py)", command)
        assert scripts or command.startswith("make "), f"{name}: {command!r} names no bench script or make target"
        assert all((REPO / s).is_file() for s in scripts), f"{name}: {command!r}"


@pytest.mark.parametrize("page", [REPO / "README.md", *USER_PAGES], ids=lambda p: p.name)
def test_a_sourced_figure_is_never_restated_by_hand(page: Path) -> None:
    """A figure's value written outside its quote would not follow the source when the figure changes."""
    bare = QUOTE.sub("", page.read_text())
    restated = [name for name, entry in FIGURES.figures().items() if entry["value"] in bare]
    assert not restated, f"{page.name} states {restated} without a figure quote"
