"""TRL's GRPOTrainer on a relayrl task: the baseline process of bench/vs_trl.py (which writes its spec).

    python bench/trl_grpo.py SPEC.json

SPEC: ``model`` (a save_pretrained directory), ``dataset`` (relayrl JSONL: prompt or messages, answer; a row with
``messages`` is a conversation TRL renders with the model's chat template), ``reward`` ("module:function" or a
registered name, a relayrl reward function) with optional ``reward_params``, optional ``lora`` (peft ``LoraConfig``
arguments: the adapter TRL trains instead of every weight), ``rows`` (where to write one JSON line per optimizer
step) and ``kwargs`` (GRPOConfig arguments); optional ``scores``: a file that gets one JSON line per reward call
(one step's prompts, completions and scores; for bench/prompt_accuracy.py, off in timed runs). Torch threads are
left at their defaults, as TRL leaves them. Each row's ``time_s`` counts from ``on_train_begin`` (model, tokenizer,
dataset and TRL already loaded) to the step's ``on_log``; ``tokens`` is the step's generated tokens (TRL's
completions/mean_length x completions per step).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any


def text_of(sample: str | list[dict[str, str]]) -> str:
    """A prompt or completion as text: a conversation (TRL's conversational format) gives its last message."""
    return sample if isinstance(sample, str) else sample[-1]["content"]


def load_reward(spec: str, scores: Any = None, params: dict[str, Any] | None = None) -> Any:
    """TRL's reward function for a relayrl one (with its configured ``params``); ``scores`` (an open file, optional)
    gets each call's samples."""
    from relayrl.reward.api import RewardInput, RewardResult, bind_params, load_reward_function

    fn = bind_params(load_reward_function(spec), params or {})
    name = spec.split(":")[-1]

    def score(prompts: list[Any], completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        out = []
        for prompt, completion, reference in zip(prompts, completions, answer, strict=True):
            res = fn(RewardInput(prompt=text_of(prompt), completion=text_of(completion), reference=reference))
            if inspect.isawaitable(res):
                res = asyncio.run(res)  # type: ignore[arg-type]
            out.append(res.score if isinstance(res, RewardResult) else float(res))
        if scores is not None:
            scores.write(json.dumps({"prompts": prompts, "completions": completions, "scores": out}) + "\n")
        return out

    score.__name__ = name
    return score


def main(spec_path: str) -> int:
    try:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        print(f"TRL is not installed ({exc}): pip install -e '.[bench]'", file=sys.stderr)
        return 2
    spec = json.loads(Path(spec_path).read_text())
    rows = [json.loads(line) for line in Path(spec["dataset"]).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r.get("messages") or r["prompt"], "answer": r["answer"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype="float32")
    args = GRPOConfig(**spec["kwargs"])
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
    with contextlib.ExitStack() as files:
        scores = files.enter_context(Path(spec["scores"]).open("w")) if spec.get("scores") else None
        out = files.enter_context(Path(spec["rows"]).open("w"))
        _train(
            GRPOTrainer,
            model,
            load_reward(spec["reward"], scores, spec.get("reward_params")),
            args,
            dataset,
            tokenizer,
            per_step,
            out,
            TrainerCallback,
            spec.get("lora"),
        )
    return 0


def _train(
    trainer_cls: Any,
    model: Any,
    reward: Any,
    args: Any,
    dataset: Any,
    tokenizer: Any,
    per_step: int,
    out: Any,
    callback_cls: Any,
    lora: dict[str, Any] | None = None,
) -> None:
    class Clock(callback_cls):  # type: ignore[misc,valid-type]
        t0 = 0.0

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            Clock.t0 = time.perf_counter()

        def on_log(
            self, _args: Any, state: Any, _control: Any, logs: dict[str, float] | None = None, **__: Any
        ) -> None:
            if logs and "reward" in logs:
                row = {
                    "step": state.global_step,
                    "time_s": time.perf_counter() - Clock.t0,
                    "reward": logs["reward"],
                    "tokens": logs["completions/mean_length"] * per_step,
                }
                out.write(json.dumps(row) + "\n")
                out.flush()

    trainer = trainer_cls(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
        **({"peft_config": _peft_config(lora)} if lora else {}),
    )
    trainer.train()


def _peft_config(lora: dict[str, Any]) -> Any:
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", **lora)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
