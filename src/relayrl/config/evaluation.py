"""Evaluation inside a run (``trainer.eval``): the figures of ``relayrl eval`` every N steps, logged under eval/."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from relayrl.config.typed import ConfigError


@dataclass
class InRunEvalConfig:
    """Held-out evaluation while training: greedy accuracy (and pass@k) through inference and reward."""

    every_steps: int = field(
        default=0,
        metadata={
            "help": "Evaluate after every N-th optimizer step and after the last (0: never). The trainer's rank 0 runs "
            "it in the background through the run's inference and reward services, one evaluation at a time "
            "(one due while another runs is skipped and counted); training never waits for it, except for the "
            "last one at the end of the run.",
            "ge": 0,
        },
    )
    dataset: Path | None = field(
        default=None,
        metadata={
            "help": "Held-out rows scored with the run's verifier, read like rollout.dataset (format, fields); "
            "empty: the rows rollout.held_out_rows holds out of the training dataset (one of the two is required "
            "when every_steps > 0)."
        },
    )
    limit: int = field(default=0, metadata={"help": "Evaluate the first N rows only (0: all).", "ge": 0})
    k: int = field(
        default=0,
        metadata={
            "help": "pass@k from `samples` sampled completions per row at the rollout's sampling settings (0: greedy "
            "only).",
            "ge": 0,
        },
    )
    samples: int = field(default=0, metadata={"help": "Sampled completions per row (0: k); at least k.", "ge": 0})
    correct_threshold: float = field(
        default=1.0, metadata={"help": "A completion is correct when its score is OK and at least this."}
    )
    concurrency: int = field(default=4, metadata={"help": "Rows evaluated at once.", "ge": 1, "le": 256})

    def validate(self) -> None:
        if self.k and self.samples and self.samples < self.k:
            raise ConfigError("samples", self.samples, f"must be >= k ({self.k})")

    def check_exists(self) -> None:
        if self.every_steps and self.dataset is not None and not self.dataset.exists():
            raise ConfigError("trainer.eval.dataset", str(self.dataset), "must be an existing dataset file or folder")
