"""The project's size rules, checked on every module it ships: files under 400 lines, functions under 80
(generated protobuf code excepted)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
CHECKED = ("src", "bench", "scripts")


def _modules() -> list[Path]:
    return sorted(p for d in CHECKED for p in (REPO / d).rglob("*.py") if "pb" not in p.relative_to(REPO).parts)


def test_every_module_is_under_the_line_limit() -> None:
    too_long = {str(p.relative_to(REPO)): n for p in _modules()
                if (n := len(p.read_text().splitlines())) >= MAX_FILE_LINES}

    assert not too_long, f"modules of {MAX_FILE_LINES} lines or more (split them): {too_long}"


def test_every_function_is_under_the_line_limit() -> None:
    too_long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines >= MAX_FUNCTION_LINES:
                    too_long[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = lines

    assert not too_long, f"functions of {MAX_FUNCTION_LINES} lines or more (split them): {too_long}"
