"""The project's shape rules: every module (its tests too) under 400 lines and every function under 80 (generated
protobuf code excepted), and unit tests laid out like the package they test."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
CHECKED = ("src", "bench", "scripts", "tests")


def _modules() -> list[Path]:
    return sorted(p for d in CHECKED for p in (REPO / d).rglob("*.py") if "pb" not in p.relative_to(REPO).parts)


def test_every_module_is_under_the_line_limit() -> None:
    too_long = {
        str(p.relative_to(REPO)): n for p in _modules() if (n := len(p.read_text().splitlines())) >= MAX_FILE_LINES
    }

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


def test_unit_tests_mirror_the_package_layout() -> None:
    # tests/unit/<package>/ for relayrl.<package>; tests of a top-level module (relayrl/status.py, run_report.py, ...)
    # and of the repository as a whole stay in tests/unit/; bench/ holds the benchmark scripts' tests, data/ fixtures
    unit = REPO / "tests" / "unit"
    packages = {p.name for p in (REPO / "src" / "relayrl").iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in unit.iterdir() if p.is_dir() and p.name != "__pycache__"}

    assert folders - {"bench", "data"} <= packages, f"unit test folders that name no package: {folders - packages}"
    assert all((unit / f / "__init__.py").exists() for f in folders - {"data"})
