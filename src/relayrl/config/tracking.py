"""The tracking section: where the trainer's metrics go besides metrics.jsonl."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class WandbConfig:
    enabled: bool = field(
        default=False, metadata={"help": "Log metrics to Weights & Biases (needs: pip install 'relayrl[wandb]')."}
    )
    project: str = field(default="relayrl", metadata={"help": "W&B project."})
    entity: str = field(default="", metadata={"help": "W&B entity (team or user; empty: your default)."})
    mode: Literal["online", "offline"] = field(
        default="online",
        metadata={
            "help": "online: stream to the W&B server (needs WANDB_API_KEY or `wandb login`); offline: write the run "
            "under <output_dir>/wandb (or $WANDB_DIR) for a later `wandb sync`."
        },
    )
    run_name: str = field(default="", metadata={"help": "W&B run name (empty: the run config's name)."})
    group: str = field(default="", metadata={"help": "W&B run group (empty: none)."})
    tags: list[str] = field(default_factory=list, metadata={"help": "W&B run tags."})


@dataclass
class MlflowConfig:
    enabled: bool = field(
        default=False, metadata={"help": "Log metrics to MLflow (needs: pip install 'relayrl[mlflow]')."}
    )
    tracking_uri: str = field(
        default="",
        metadata={
            "help": "MLflow tracking URI, e.g. http://mlflow:5000 (empty: a SQLite store at "
            "<output_dir>/mlflow.db, artifacts under <output_dir>/mlartifacts)."
        },
    )
    experiment: str = field(default="relayrl", metadata={"help": "MLflow experiment (created when missing)."})
    run_name: str = field(default="", metadata={"help": "MLflow run name (empty: the run config's name)."})


@dataclass
class TrackingConfig:
    tensorboard: bool = field(
        default=True,
        metadata={
            "help": "Write TensorBoard event files under <output_dir>/tensorboard (metrics.jsonl is always written)."
        },
    )
    wandb: WandbConfig = field(default_factory=WandbConfig, metadata={"help": "Weights & Biases."})
    mlflow: MlflowConfig = field(default_factory=MlflowConfig, metadata={"help": "MLflow."})
