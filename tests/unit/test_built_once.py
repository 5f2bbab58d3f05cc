"""The suite's shared models (tests.conftest.built_once): however many xdist workers ask at the same moment, one
builds and the others read its result; a build that failed midway is redone, not read."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import cast

import pytest

from tests.conftest import built_once


class _Factory:
    """The one method of pytest.TempPathFactory that built_once reads."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


def _factory(base: Path) -> pytest.TempPathFactory:
    return cast(pytest.TempPathFactory, _Factory(base))


def test_workers_asking_at_once_build_once_and_all_get_the_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # a worker's basetemp is a folder of the run's own
    builds: list[Path] = []
    start = threading.Barrier(4)

    def build(folder: Path) -> Path:
        builds.append(folder)
        (folder / "weights").write_text("w")
        return folder / "weights"

    results: list[Path] = []

    def worker(n: int) -> None:
        (tmp_path / f"popen-gw{n}").mkdir()
        start.wait()
        results.append(built_once(_factory(tmp_path / f"popen-gw{n}"), "model", build))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)

    assert builds == [tmp_path / "once-model"]
    assert results == [tmp_path / "once-model" / "weights"] * 4


def test_a_build_that_failed_midway_is_redone_from_an_empty_folder(tmp_path: Path) -> None:
    def failing(folder: Path) -> None:
        (folder / "half-written").write_text("x")
        raise RuntimeError("killed while building")

    with pytest.raises(RuntimeError):
        built_once(_factory(tmp_path), "model", failing)

    assert built_once(_factory(tmp_path), "model", lambda folder: sorted(p.name for p in folder.iterdir())) == []
