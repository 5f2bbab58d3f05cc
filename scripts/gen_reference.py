#!/usr/bin/env python3
"""Generate the configuration and CLI reference and the config-schema snapshot from the code.

    python scripts/gen_reference.py          # write docs/reference/{config.md,cli.md,config-schema.json}
    python scripts/gen_reference.py --check  # fail when a committed file differs from the code (CI)

On --check, differences of the schema that break existing configs (removed field, changed type, narrowed
choices, tightened bound) are listed separately: such a change lands only with the snapshot updated in the same
change (which shows it in review), and with a deprecation or a migration where a user config could break.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "reference"


def cli_markdown() -> str:
    from relayrl.cli import parser as cli_parser

    parser = cli_parser()
    lines = [
        "# CLI reference",
        "",
        "Generated from the argument parser by `scripts/gen_reference.py`; do not edit.",
        "",
    ]

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        lines.extend([f"## `{name}`", "", "```text", p.format_help().rstrip(), "```", ""])
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(sub, f"{name} {sub_name}")

    walk(parser, "relayrl")
    return "\n".join(lines)


def generate() -> dict[Path, str]:
    from relayrl.config import SCHEMA_VERSION, RunConfig
    from relayrl.config.schema import markdown, schema

    snapshot = {"schema_version": SCHEMA_VERSION, "fields": schema(RunConfig)}
    return {
        OUT / "config.md": markdown(RunConfig, "Configuration reference") + "\n",
        OUT / "cli.md": cli_markdown() + "\n",
        OUT / "config-schema.json": json.dumps(snapshot, indent=1, sort_keys=True) + "\n",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    import os

    os.environ["COLUMNS"] = "100"  # argparse wraps help text at the terminal width: make it reproducible
    files = generate()
    if not args.check:
        OUT.mkdir(parents=True, exist_ok=True)
        for path, text in files.items():
            path.write_text(text)
        print(f"wrote {len(files)} files under {OUT.relative_to(ROOT)}")
        return 0
    from relayrl.config.schema import incompatible_changes

    stale = [p for p, text in files.items() if not p.is_file() or p.read_text() != text]
    snapshot_path = OUT / "config-schema.json"
    if snapshot_path.is_file():
        old = json.loads(snapshot_path.read_text())["fields"]
        new = json.loads(files[snapshot_path])["fields"]
        for problem in incompatible_changes(old, new):
            print(f"incompatible config change: {problem}", file=sys.stderr)
    for p in stale:
        print(f"stale: {p.relative_to(ROOT)} (run: python scripts/gen_reference.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
