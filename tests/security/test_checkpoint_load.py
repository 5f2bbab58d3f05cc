"""A checkpoint is data: restoring one never runs code that an attacker planted in its pickles."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from relayrl.common.checkpoints import STATE_FILE
from relayrl.trainer.checkpoint import load_trainer_state
from relayrl.trainer.collectives import Collectives

pytestmark = pytest.mark.security


class _PlantedCode:
    """Unpickling this object runs ``touch <marker>`` (what torch.load(weights_only=False) would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


def _checkpoint(path: Path, state: object) -> None:
    path.mkdir(parents=True)
    with (path / STATE_FILE).open("wb") as f:
        pickle.dump(state, f, protocol=2)  # torch.load reads plain pickles (protocol 2, its default)
    torch.save({"consumed_ids": [], "rng": None}, path / "rank0.pt")


def test_restoring_a_checkpoint_with_planted_code_refuses_it_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "step_000001"
    _checkpoint(ckpt, {"step": 1, "weight_version": 1, "optimizer": _PlantedCode(marker), "extra": {}})

    with pytest.raises(pickle.UnpicklingError):
        load_trainer_state(ckpt, _optimizer(), Collectives(None, timeout_s=10.0))

    assert not marker.exists()


def test_restoring_an_honest_checkpoint_gives_back_its_state(tmp_path: Path) -> None:
    ckpt = tmp_path / "step_000003"
    opt = _optimizer()
    ckpt.mkdir()
    torch.save({"step": 3, "weight_version": 7, "optimizer": opt.state_dict(), "extra": {"k": 1}}, ckpt / STATE_FILE)
    torch.save({"consumed_ids": ["g1"], "rng": None}, ckpt / "rank0.pt")

    state = load_trainer_state(ckpt, _optimizer(), Collectives(None, timeout_s=10.0))

    assert (state.step, state.weight_version, state.consumed_ids, state.extra) == (3, 7, {"g1"}, {"k": 1})
