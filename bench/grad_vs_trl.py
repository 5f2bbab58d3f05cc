"""One optimizer step's gradient, TRL's GRPOTrainer against relayrl's learner: the same weights, the same batch.

    python bench/grad_vs_trl.py [--task quickstart] [--out runs/grad_vs_trl] [--set k=v ...] [--seed 0]
                                [--answer-fraction 0.5]

bench/vs_trl.py compares whole runs, whose final rewards spread over several hundredths between seeds; this
checks the one thing both systems should share exactly, the update. It loads the task's random-init model (the
one bench/vs_trl.py makes) twice, builds one step's batch (``groups_per_step`` prompts of the task's dataset x
``group_size`` completions: the model's own samples, a fraction ``--answer-fraction`` of them replaced by the
reference answer so that groups score differently), scores it with the task's reward function, and computes the
gradient of that batch's loss with each system at ratio 1 (the behaviour logprobs are the model's own, as in a
synchronous step): TRL through ``GRPOTrainer._compute_loss`` with the arguments bench/vs_trl.py runs it with
(:func:`vs_trl.trl_kwargs`), and TRL's advantages (:func:`trl_advantages`); relayrl through
``Learner.rl_gradients`` with the task's trainer config. It prints, per parameter and overall, the cosine between
the two gradients and the ratio of their norms, and the ratio expected from the one documented difference: relayrl's
``grpo`` advantage divides by the group's population std, TRL's by the sample std (n - 1), a constant
sqrt(n / (n - 1)) for groups of n (1 for ``dr_grpo``), up to the two epsilons added to the std (TRL's 1e-4,
relayrl's ``advantage_eps``). Exit status 1 when a cosine or the ratio is off.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # the sibling bench script: tasks, model and TRL arguments)

COS_TOLERANCE = 1e-5  # float32 sums in a different order: cosines of identical gradients agree to ~1e-7
# the stds' epsilons differ too (TRL 1e-4, relayrl's advantage_eps 1e-6): about 1e-4 / std, a few 1e-4 here
RATIO_TOLERANCE = 1e-3


def trl_advantages(rewards: Sequence[float], group_size: int, scale_by_std: bool) -> list[float]:
    """TRL 1.16's group advantages (``GRPOTrainer._generate_and_score_completions``, ``scale_rewards="group"``
    or ``"none"``): reward - group mean, divided by the group's sample std (n - 1) + 1e-4 when scaling."""
    out = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1)) if len(group) > 1 else 0.0
        out += [(r - mean) / (std + 1e-4) if scale_by_std else r - mean for r in group]
    return out


def mix_answers(
    samples: Sequence[Sequence[int]], answer: Sequence[int], fraction: float, rng: random.Random
) -> list[list[int]]:
    """``samples`` with each one replaced by ``answer`` with probability ``fraction``."""
    return [list(answer) if rng.random() < fraction else list(s) for s in samples]


def trl_inputs(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int, advantages: Sequence[float]
) -> dict[str, Any]:
    """``_compute_loss``'s inputs as TRL lays them out: prompts left-padded, completions right-padded, masks 1 on
    the real tokens, ``num_items_in_batch`` the completion tokens of the batch."""
    import torch

    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.full((len(prompts), width_p), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.full((len(completions), width_c), pad_id, dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        prompt_ids[i, width_p - len(p) :] = torch.tensor(p)
        prompt_mask[i, width_p - len(p) :] = 1
        completion_ids[i, : len(c)] = torch.tensor(c)
        completion_mask[i, : len(c)] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(advantages, dtype=torch.float32),
        "num_items_in_batch": completion_mask.sum().float(),
    }


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Per-parameter and overall cosine and norm ratio (b / a) of two gradients keyed by parameter name."""
    import torch

    if sorted(a) != sorted(b):
        raise ValueError(f"the gradients cover different parameters: {sorted(set(a) ^ set(b))}")
    cos = torch.nn.functional.cosine_similarity
    per = {
        k: (
            float(cos(a[k].flatten().double(), b[k].flatten().double(), 0)),
            float(b[k].double().norm() / a[k].double().norm()),
        )
        for k in sorted(a)
    }
    fa = torch.cat([a[k].flatten().double() for k in sorted(a)])
    fb = torch.cat([b[k].flatten().double() for k in sorted(a)])
    return {
        "per_parameter": per,
        "cosine": float(cos(fa, fb, 0)),
        "norm_ratio": float(fb.norm() / fa.norm()),
        "min_cosine": min(c for c, _ in per.values()),
    }


def build_batch(
    cfg: Any, model: Any, tokenizer: Any, answer_fraction: float, seed: int
) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """(prompt ids, completion ids, rewards) of one step: the first ``groups_per_step`` dataset rows, each with
    ``group_size`` samples of the model (cut after the end token) partly replaced by the reference answer."""
    import torch
    from trl_grpo import load_reward  # the sibling bench script: relayrl's reward function as TRL calls it

    from relayrl.common.dataset import load_jsonl

    rc, tc = cfg.rollout, cfg.trainer
    rows = load_jsonl(vs_trl.REPO / rc.dataset)[: tc.groups_per_step]
    eos = int(tokenizer.eos_token_id)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    prompts: list[list[int]] = []
    completions: list[list[int]] = []
    for row in rows:
        p = tokenizer(row.prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]),
                do_sample=True,
                max_new_tokens=rc.max_new_tokens,
                num_return_sequences=rc.group_size,
                temperature=rc.temperature,
                top_k=0,
                top_p=1.0,
                pad_token_id=tokenizer.pad_token_id,
            )
        samples = [_cut(s[len(p) :].tolist(), eos) for s in out]
        answer = [*tokenizer(row.answer, add_special_tokens=False)["input_ids"], eos][: rc.max_new_tokens]
        prompts += [p] * rc.group_size
        completions += mix_answers(samples, answer, answer_fraction, rng)
    score = load_reward(cfg.reward.function)
    rewards = score(
        prompts=[tokenizer.decode(p) for p in prompts],
        completions=[tokenizer.decode(c, skip_special_tokens=True) for c in completions],
        answer=[r.answer for r in rows for _ in range(rc.group_size)],
    )
    return prompts, completions, rewards


def _cut(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def trl_gradient(cfg: Any, model: Any, tokenizer: Any, batch: tuple[Any, Any, Any], out: Path) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts, completions, rewards = batch
    kwargs = vs_trl.trl_kwargs(cfg, 1, out / "trl")

    def no_reward(**_: Any) -> list[float | None]:  # never called: the batch comes scored
        return []

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=no_reward,
        args=GRPOConfig(**kwargs),
        train_dataset=Dataset.from_list([{"prompt": "x"}]),
        processing_class=tokenizer,
    )
    advantages = trl_advantages(rewards, cfg.rollout.group_size, kwargs["scale_rewards"] == "group")
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.training_step sets before compute_loss
    loss = trainer._compute_loss(model, trl_inputs(prompts, completions, tokenizer.pad_token_id, advantages))
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def relayrl_gradient(cfg: Any, model: Any, tokenizer: Any, batch: tuple[Any, Any, Any]) -> dict[str, Any]:
    import torch

    from relayrl.common.pb.episode_pb2 import Episode
    from relayrl.trainer.ingest import StepBatch
    from relayrl.trainer.learner import Learner

    prompts, completions, rewards = batch
    group_size = cfg.rollout.group_size
    with torch.no_grad():  # the behaviour logprobs: the model's own (ratio 1, a synchronous step)
        behaviour = []
        for p, c in zip(prompts, completions, strict=True):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : len(p) - 1 + len(c)].float()
            behaviour.append(
                torch.log_softmax(logits / cfg.rollout.temperature, -1)
                .gather(1, torch.tensor(c).unsqueeze(1))
                .squeeze(1)
                .tolist()
            )
    episodes = [
        Episode(
            episode_id=f"e{i}",
            group_id=f"g{i // group_size}",
            prompt_token_ids=p,
            completion_token_ids=c,
            behaviour_logprobs=lp,
            token_weight_versions=[1] * len(c),
            loss_mask=[1] * len(c),
            reward=r,
            sampling_temperature=cfg.rollout.temperature,
        )
        for i, (p, c, lp, r) in enumerate(zip(prompts, completions, behaviour, rewards, strict=True))
    ]
    learner = Learner(
        model,
        cfg.trainer,
        int(tokenizer.pad_token_id),
        torch.device("cpu"),
        max_completion_tokens=cfg.rollout.max_new_tokens,
    )
    learner.rl_gradients(StepBatch.of(episodes))
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def expected_ratio(cfg: Any) -> float:
    """relayrl's gradient over TRL's: population against sample std for ``grpo``, 1 otherwise."""
    from relayrl.config.loss import AdvantageEstimator

    n = cfg.rollout.group_size
    return math.sqrt(n / (n - 1)) if cfg.trainer.loss.advantage is AdvantageEstimator.GRPO else 1.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=sorted(vs_trl.TASKS), default="quickstart")
    ap.add_argument("--out", type=Path, default=vs_trl.REPO / "runs" / "grad_vs_trl")
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answer-fraction", type=float, default=0.5)
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relayrl.config.run import load_run_config

    task = vs_trl.TASKS[args.task]
    model_dir = args.out / args.task / "model"
    cfg_path = vs_trl.REPO / task.config
    vs_trl.ensure_inputs(task, cfg_path, model_dir)
    cfg = load_run_config(cfg_path, vs_trl.run_overrides(task, model_dir, 1, args.overrides))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    batch = build_batch(cfg, model, tokenizer, args.answer_fraction, args.seed)
    twin = copy.deepcopy(model)  # the same weights for the second system (tied embeddings stay tied)
    with tempfile.TemporaryDirectory() as tmp:
        g_trl = trl_gradient(cfg, model, tokenizer, batch, Path(tmp))
    g_relayrl = relayrl_gradient(cfg, twin, tokenizer, batch)
    result = compare(g_trl, g_relayrl)
    want = expected_ratio(cfg)
    _, _, rewards = batch
    print(f"{args.task}: {len(rewards)} completions, mean reward {sum(rewards) / len(rewards):.3f}")
    for name, (c, r) in result["per_parameter"].items():
        print(f"  {name:55s} cosine {c:.8f}  norm ratio relayrl/TRL {r:.6f}")
    print(
        f"overall: cosine {result['cosine']:.8f}, norm ratio {result['norm_ratio']:.6f} (expected {want:.6f}: "
        f"{'population vs sample std' if want != 1.0 else 'the same advantages'})"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.task}.json").write_text(json.dumps({**result, "expected_ratio": want}, indent=1))
    ok = result["min_cosine"] >= 1 - COS_TOLERANCE and abs(result["norm_ratio"] / want - 1) <= RATIO_TOLERANCE
    print("the same update up to the expected scale" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
