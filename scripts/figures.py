#!/usr/bin/env python3
"""Write every measured figure the docs quote from its one source, docs/figures.yaml.

A page quotes a figure as ``<!-- figure: ID -->VALUE<!-- /figure -->``; mkdocs and GitHub show VALUE alone.

    python scripts/figures.py          # rewrite each quoted VALUE from docs/figures.yaml
    python scripts/figures.py --check  # fail when a page's VALUE differs, or names an unknown ID (CI)

An entry holds `value` (the text quoted), `what` (what was measured), `command` (what reproduces it) and
`measured` (when, on what machine). Changing a figure is one edit to docs/figures.yaml and one run of this script.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "docs" / "figures.yaml"
FIELDS = ("value", "what", "command", "measured")
QUOTE = re.compile(r"<!-- figure: ([a-z0-9_]+) -->(.*?)<!-- /figure -->", re.S)


def figures() -> dict[str, dict[str, str]]:
    """The figures by id; an entry missing a field, or with one not a string, is an error naming both."""
    loaded = yaml.safe_load(SOURCE.read_text()) or {}
    for name, entry in loaded.items():
        for field in FIELDS:
            if not isinstance(entry.get(field), str) or not entry[field].strip():
                raise ValueError(f"{SOURCE.name}: figure {name!r} needs a non-empty string {field!r}")
    return loaded


def pages() -> list[Path]:
    return sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])


def render(text: str, known: dict[str, dict[str, str]], where: str) -> tuple[str, list[str]]:
    """The page with every quote set to its source value, and the problems found on the way."""
    problems: list[str] = []

    def one(match: re.Match[str]) -> str:
        name, quoted = match.group(1), match.group(2)
        if name not in known:
            problems.append(f"{where}: unknown figure {name!r} (not in {SOURCE.name})")
            return match.group(0)
        value = known[name]["value"].strip()
        if quoted != value:
            problems.append(f"{where}: figure {name!r} reads {quoted!r}, source says {value!r}")
        return f"<!-- figure: {name} -->{value}<!-- /figure -->"

    return QUOTE.sub(one, text), problems


def quoted_ids() -> dict[str, list[str]]:
    """Each figure id and the pages that quote it."""
    found: dict[str, list[str]] = {}
    for page in pages():
        for match in QUOTE.finditer(page.read_text()):
            found.setdefault(match.group(1), []).append(str(page.relative_to(ROOT)))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail on a stale or unknown quote; write nothing")
    args = parser.parse_args()
    known, problems = figures(), []
    for page in pages():
        text = page.read_text()
        new, found = render(text, known, str(page.relative_to(ROOT)))
        unknown = [p for p in found if "unknown figure" in p]
        problems += found if args.check else unknown
        if not args.check and new != text:
            page.write_text(new)
            print(f"wrote {page.relative_to(ROOT)}")
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems and args.check:
        print("run: python scripts/figures.py", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
