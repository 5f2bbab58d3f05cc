"""On-policy distillation against RL alone, per step, for the same student, in one process (quick, CPU).

The real Learner (the trainer's loss and AdamW) on the example's task (examples/data/arithmetic.jsonl, its reward
relayrl.tasks.arithmetic:reward): each arm is a copy of the same initial student; every step it samples
groups_per_step x group_size completions on-policy (temperature 1, up to 2 tokens, as examples/distill.yaml),
the teacher scores the sampled tokens (its logprobs of the same ids, computed in process like ScoreTokens does),
and the arm takes one optimizer step with its loss. The arms step in turn (interleaved), so they share the
machine's load. Prints each arm's mean reward and reverse KL to the teacher over 10-step windows, and the ratio
of each arm's reward to the first arm's (the baseline, RL alone) at the same step. No services, no staleness:
this isolates the loss and its coefficients; examples/distill.yaml measures the whole pipeline. Usage:

    python bench/distill.py --teacher runs/teacher/checkpoints/step_000400/model --student models/student
    python bench/distill.py ... --arms rl,distill --steps 150 --lr 5e-4
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from relayrl.common.model import end_token_ids, load_model, load_tokenizer
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.config.loss import DistillBaseline, LossConfig, PolicyLoss
from relayrl.config.model import ModelConfig
from relayrl.config.trainer import OptimizerConfig, TrainerConfig
from relayrl.reward.api import RewardInput
from relayrl.tasks.arithmetic import reward
from relayrl.trainer.batching import pack
from relayrl.trainer.ingest import StepBatch
from relayrl.trainer.learner import Learner
from relayrl.trainer.logprobs import token_logprobs

# name -> (trainer.loss fields, whether the task's reward reaches the loss)
ARMS: dict[str, tuple[dict[str, Any], bool]] = {
    "rl": ({"policy_loss": PolicyLoss.PPO_CLIP}, True),
    "distill": ({"policy_loss": PolicyLoss.REVERSE_KL, "distill_baseline": DistillBaseline.GROUP}, True),
    "distill_raw": ({"policy_loss": PolicyLoss.REVERSE_KL, "distill_baseline": DistillBaseline.NONE}, True),
    "distill_only": ({"policy_loss": PolicyLoss.REVERSE_KL, "distill_baseline": DistillBaseline.GROUP}, False),
}


@dataclass
class Arm:
    name: str
    learner: Learner
    use_reward: bool
    gen: torch.Generator
    rewards: list[float] = field(default_factory=list)
    kls: list[float] = field(default_factory=list)
    seconds: float = 0.0


def sample(
    model: Any, prompt_ids: list[list[int]], max_new: int, eos: set[int], gen: torch.Generator
) -> tuple[list[list[int]], list[list[float]]]:
    """Completions (up to the first end token, included) and their logprobs at temperature 1, one per prompt."""
    ids = torch.tensor(prompt_ids)  # every prompt of the task has the same length: no padding
    done = torch.zeros(len(prompt_ids), dtype=torch.bool)
    toks, lps = [], []
    with torch.no_grad():
        for _ in range(max_new):
            logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), -1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            toks.append(nxt)
            lps.append(logp.gather(1, nxt.unsqueeze(1)).squeeze(1))
            ids = torch.cat([ids, nxt.unsqueeze(1)], 1)
            done = done | torch.tensor([int(t) in eos for t in nxt])
            if bool(done.all()):
                break
    comps, comp_lps = [], []
    for i in range(len(prompt_ids)):
        c, lp = [], []
        for t, v in zip(toks, lps, strict=True):
            c.append(int(t[i]))
            lp.append(float(v[i]))
            if int(t[i]) in eos:
                break
        comps.append(c)
        comp_lps.append(lp)
    return comps, comp_lps


def teacher_logprobs(teacher: Any, prompts: list[list[int]], comps: list[list[int]]) -> list[list[float]]:
    """The teacher's logprob of each completion token (what ScoreTokens answers), at temperature 1."""
    batch = pack(prompts, comps, None, None, [1.0] * len(prompts), pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        logp = token_logprobs(
            teacher(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
            batch.targets,
            batch.temperature,
        )
    pairs = enumerate(zip(prompts, comps, strict=True))
    return [logp[i, len(p) - 1 : len(p) - 1 + len(c)].tolist() for i, (p, c) in pairs]


def arm_step(
    arm: Arm, rows: list[dict[str, str]], tokenizer: Any, teacher: Any, args: argparse.Namespace, eos: set[int]
) -> None:
    t0 = time.perf_counter()
    picks = torch.randint(len(rows), (args.groups,), generator=arm.gen).tolist()
    prompts = [
        tokenizer(rows[i]["prompt"], add_special_tokens=False)["input_ids"]
        for i in picks
        for _ in range(args.group_size)
    ]
    comps, lps = sample(arm.learner.model, prompts, args.max_new_tokens, eos, arm.gen)
    refs = [rows[i]["answer"] for i in picks for _ in range(args.group_size)]
    scores = []
    for p, c, ref in zip(prompts, comps, refs, strict=True):
        text = tokenizer.decode([t for t in c if t not in eos], skip_special_tokens=True)
        out = reward(RewardInput(prompt=tokenizer.decode(p), completion=text, reference=ref))
        scores.append(out.score)
    t_lps = teacher_logprobs(teacher, prompts, comps)
    kl = [a - b for ep_lp, ep_t in zip(lps, t_lps, strict=True) for a, b in zip(ep_lp, ep_t, strict=True)]
    episodes = [
        Episode(
            episode_id=str(i),
            group_id=f"g{i // args.group_size}",
            group_size=args.group_size,
            prompt_token_ids=p,
            completion_token_ids=c,
            behaviour_logprobs=lp,
            token_weight_versions=[1] * len(c),
            loss_mask=[1] * len(c),
            reward=s if arm.use_reward else 0.0,
            sampling_temperature=1.0,
        )
        for i, (p, c, lp, s) in enumerate(zip(prompts, comps, lps, scores, strict=True))
    ]
    arm.learner.rl_step(StepBatch.of(episodes, teacher=t_lps))
    arm.rewards.append(statistics.fmean(scores))
    arm.kls.append(statistics.fmean(kl))
    arm.seconds += time.perf_counter() - t0


def make_arms(names: list[str], student: Any, args: argparse.Namespace, pad_id: int) -> list[Arm]:
    arms = []
    for name in names:
        spec, use_reward = ARMS[name.split("@")[0]]
        loss = replace(LossConfig(), **spec)
        for extra in name.split("@")[1:]:  # e.g. distill@distill_coef=0.1
            key, value = extra.split("=")
            loss = replace(loss, **{key: type(getattr(loss, key))(value)})
        cfg = TrainerConfig(loss=loss, optimizer=OptimizerConfig(lr=args.lr), micro_batch_size=256)
        learner = Learner(
            copy.deepcopy(student), cfg, pad_id, torch.device("cpu"), max_completion_tokens=args.max_new_tokens
        )
        arms.append(Arm(name, learner, use_reward, torch.Generator().manual_seed(args.seed)))
    return arms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", type=Path, required=True)
    ap.add_argument("--student", type=Path, required=True)
    ap.add_argument("--dataset", type=Path, default=Path("examples/data/arithmetic.jsonl"))
    ap.add_argument(
        "--arms",
        default="rl,distill,distill_raw",
        help="comma-separated; the first is the baseline; name@field=value sets a trainer.loss field",
    )
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write every arm's per-step reward and KL here")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.student)
    eos = set(end_token_ids(tokenizer))
    teacher = load_model(ModelConfig(path=args.teacher)).eval()
    student = load_model(ModelConfig(path=args.student))
    rows = [json.loads(line) for line in args.dataset.read_text().splitlines() if line.strip()]
    arms = make_arms(args.arms.split(","), student, args, int(tokenizer.pad_token_id or 0))
    for _ in range(args.steps):
        for arm in arms:  # interleaved: every arm sees the same load
            arm_step(arm, rows, tokenizer, teacher, args, eos)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    base = arms[0]
    print(f"{args.steps} steps of {args.groups} x {args.group_size} episodes, lr {args.lr}, load average {load}")
    print(
        "step  " + "  ".join(f"{a.name:>26}" for a in arms) + "   (reward / reverse KL, means over 10 steps; "
        "ratio: reward / the first arm's)"
    )
    for end in sorted({10, 25, 50, 75, 100, 125, 150, args.steps} & set(range(10, args.steps + 1))):
        cells = []
        for a in arms:
            r, k = statistics.fmean(a.rewards[end - 10 : end]), statistics.fmean(a.kls[end - 10 : end])
            ratio = r / max(statistics.fmean(base.rewards[end - 10 : end]), 1e-9)
            cells.append(f"{r:.3f} / {k:5.2f} (x{ratio:4.2f})")
        print(f"{end:>4}  " + "  ".join(f"{c:>26}" for c in cells))
    print("s/step " + "  ".join(f"{a.name}={a.seconds / args.steps:.3f}" for a in arms))
    if args.json:
        args.json.write_text(json.dumps({a.name: {"reward": a.rewards, "kl": a.kls} for a in arms}))


if __name__ == "__main__":
    main()
