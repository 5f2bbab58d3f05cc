"""Borrowing generation's cores while inference is idle: the switch inside a pass, the watcher, the config rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from relayrl.common.threads import apply_threads
from relayrl.config import load_run_config
from relayrl.config.threads import TrainerThreadsConfig
from relayrl.config.typed import ConfigError
from relayrl.trainer.cores import CoreLoan, watch_inference_idle

TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="borrowing a core needs two usable CPUs")

# A fresh process: the loan pins every thread of its process, which must not be the test run. Three decoder layers;
# the watcher's decisions arrive between passes and must take effect inside the next one (at a layer).
SWITCH = """
import json, os, torch
from transformers import LlamaConfig, LlamaForCausalLM
from relayrl.common.threads import pin_cpus
from relayrl.trainer.cores import CoreLoan
a, b = sorted(os.sched_getaffinity(0))[:2]
pin_cpus([a], "trainer.threads.cpus")  # as the service's start-up does (apply_threads)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=2, num_key_value_heads=1))
loan = CoreLoan([a], [b], 1)
layers = loan.hook(model)
seen = {}
def record(name):  # a hook that returns nothing (a value would replace the output or the gradient)
    seen.setdefault(name, [torch.get_num_threads(), sorted(os.sched_getaffinity(0))])
model.model.layers[1].register_forward_hook(lambda m, i, o: record("forward"))
model.model.embed_tokens.weight.register_hook(lambda g: record("backward"))
loss = model(torch.randint(0, 64, (2, 8))).logits.float().pow(2).mean()
loan.want(True)  # inference fell idle during the forward
loss.backward()
loan.want(False)  # a request arrived
model(torch.randint(0, 64, (2, 8)))
print(json.dumps({"layers": layers, "cpus": [a, b], "borrows": loan.borrows, "held_s": loan.held_s(),
                  "after": [torch.get_num_threads(), sorted(os.sched_getaffinity(0))], **seen}))
"""


@TWO_CORES
def test_a_loan_takes_the_borrowed_core_inside_the_backward_and_returns_it_at_the_next_forward_layer() -> None:
    out = subprocess.run([sys.executable, "-c", SWITCH], capture_output=True, text=True, timeout=300, check=True)

    seen = json.loads(out.stdout.splitlines()[-1])
    a, b = seen["cpus"]
    assert seen["layers"] == 3
    assert seen["forward"] == [1, [a]]  # the first forward: own core, own thread count
    assert seen["backward"] == [2, [a, b]]  # switched at a layer's backward, before the embedding's gradient
    assert seen["after"] == [1, [a]]  # given back at the next forward's first layer
    assert seen["borrows"] == 1 and seen["held_s"] > 0


def test_a_model_without_a_layer_list_is_hooked_as_one_layer() -> None:
    import torch

    model = torch.nn.Linear(2, 2)

    assert CoreLoan([0], [1], 1).hook(model) == 1 and len(model._forward_pre_hooks) == 1


async def test_the_watcher_borrows_only_while_inference_runs_and_queues_nothing_and_never_when_unreachable() -> None:
    answers: list[object] = [
        SimpleNamespace(requests_running=2, requests_queued=0),
        SimpleNamespace(requests_running=0, requests_queued=0),
        SimpleNamespace(requests_running=0, requests_queued=1),
        SimpleNamespace(requests_running=0, requests_queued=0),
        ConnectionError("inference is gone"),
    ]
    loan, decisions = CoreLoan([0], [1], 1), []

    async def status() -> object:
        if decisions or answers[0] is not None:  # record what the previous answer decided
            decisions.append(loan.wanted)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    await watch_inference_idle(loan, status, 0.0, stopped=lambda: not answers)

    assert decisions == [False, False, True, False, True]
    assert loan.wanted is False  # the failed status (and the end of the watch) leave the cores with generation


async def test_the_watcher_asks_nothing_and_keeps_the_cores_apart_while_steps_are_too_short_to_gain() -> None:
    loan, asked, rounds = CoreLoan([0], [1], 1), [], iter(range(3))
    loan.want(True)

    async def status() -> object:
        asked.append(1)
        return SimpleNamespace(requests_running=0, requests_queued=0)

    await watch_inference_idle(loan, status, 0.0, stopped=lambda: next(rounds, None) is None, worth_it=lambda: False)

    assert asked == [] and loan.wanted is False


def test_relayrl_run_lends_generations_cores_to_a_one_rank_trainer_it_pinned_itself() -> None:
    from relayrl.launcher import with_thread_budget

    divided = with_thread_budget(load_run_config(None, []), cores=[0, 1])
    set_count = with_thread_budget(load_run_config(None, ["trainer.threads.intra_op=1"]), cores=[0, 1])
    two_ranks = with_thread_budget(load_run_config(None, ["trainer.distributed.world_size=2"]), cores=range(4))

    assert (divided.trainer.threads.cpus, divided.trainer.threads.borrow_cpus) == ([1], [0])
    assert set_count.trainer.threads.borrow_cpus == [] and two_ranks.trainer.threads.borrow_cpus == []


@pytest.mark.parametrize(
    ("overrides", "rule"),
    [
        (
            ["trainer.threads.cpus=[1]", "trainer.threads.intra_op=1", "trainer.threads.borrow_cpus=[1]"],
            "must not name one of cpus",
        ),
        (["trainer.threads.borrow_cpus=[0]"], "needs cpus and intra_op"),
        (
            [
                "trainer.threads.cpus=[1]",
                "trainer.threads.intra_op=1",
                "trainer.threads.borrow_cpus=[0]",
                "trainer.distributed.world_size=2",
            ],
            "needs distributed.world_size 1",
        ),
    ],
)
def test_borrow_cpus_are_refused_overlapping_without_an_own_share_or_with_several_ranks(
    overrides: list[str], rule: str
) -> None:
    with pytest.raises(ConfigError, match=rf"trainer\.threads\.borrow_cpus = .*{rule}"):
        load_run_config(None, overrides)


def test_a_trainer_refuses_at_start_up_borrow_cpus_it_may_not_use_before_pinning_anything() -> None:
    absent = max(os.sched_getaffinity(0)) + 1
    before = os.sched_getaffinity(0)

    with pytest.raises(ConfigError, match=rf"trainer\.threads\.borrow_cpus = \[{absent}\]: must be CPUs"):
        apply_threads(TrainerThreadsConfig(cpus=[min(before)], borrow_cpus=[absent]), "trainer")
    assert os.sched_getaffinity(0) == before
