"""The run config: one section per component, composed from the components' own config classes."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from relayrl.config.control import ControlConfig
from relayrl.config.files import write_private
from relayrl.config.inference import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    EngineKind,
    InferenceConfig,
)
from relayrl.config.model import ModelConfig
from relayrl.config.publication import WeightTransport
from relayrl.config.redis import RedisConfig
from relayrl.config.reward import RewardConfig
from relayrl.config.rollout import RolloutConfig
from relayrl.config.sources import apply_override, load_yaml
from relayrl.config.tls import TlsConfig
from relayrl.config.tracking import TrackingConfig
from relayrl.config.trainer import TrainerConfig
from relayrl.config.typed import ConfigError, from_dict, to_dict

log = logging.getLogger(__name__)


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # part of the run's Redis keys
SCHEMA_VERSION = 1  # bump when a change needs a migration of existing configs (then add it to MIGRATIONS)

# schema version N -> function turning an N config (plain data) into an N+1 config
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


@dataclass
class RunConfig:
    schema_version: int = field(
        default=SCHEMA_VERSION,
        metadata={
            "help": "Version of the config schema this file was written for; older files are migrated on load, newer "
            "ones refused.",
            "ge": 1,
        },
    )
    name: str = field(
        default="run",
        metadata={
            "help": "The run's name: its Redis keys carry it (redis.stream, redis.version_key), so a new name on a "
            "shared Redis starts a new run from a clean state and the same name continues the run. Letters, digits, "
            "'.', '_' and '-' (at most 64).",
        },
    )
    output_dir: Path = field(
        default=Path("runs/latest"), metadata={"help": "Output root: metrics.jsonl, config.yaml, logs/, checkpoints/."}
    )
    output_dir_mode: str = field(
        default="0700",
        metadata={
            "help": "Permissions (octal) of the run folder of `relayrl run`; its files get the same without execute "
            "bits (the launcher's and its services' umask): 0700 (files 0600) keeps the Redis AOF (every "
            "episode), checkpoints, logs and metrics from other local users; 0750 shares them read-only with "
            "the group. The owner needs rwx; nobody else may write. Quote it in YAML ('0750'): unquoted, YAML "
            "reads an octal number."
        },
    )
    seed: int = field(default=0, metadata={"help": "Global seed."})
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = field(
        default="INFO", metadata={"help": "Log level of every service."}
    )
    log_format: Literal["text", "json"] = field(
        default="text",
        metadata={
            "help": "Log lines of every service: text (one readable line) or json (one JSON object a line: time, "
            "level, component, rank, logger, message, and group_id/episode_id/weight_version when set)."
        },
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(
        default_factory=TrackingConfig,
        metadata={"help": "Where the trainer's metrics go besides metrics.jsonl: TensorBoard, W&B, MLflow."},
    )
    control: ControlConfig = field(
        default_factory=ControlConfig,
        metadata={"help": "Control plane: the bearer token of mutating calls (pause/resume, checkpoint)."},
    )
    tls: TlsConfig = field(
        default_factory=TlsConfig,
        metadata={
            "help": "TLS and mutual TLS on every gRPC server and channel of the run, from PEM files (all empty: "
            "plaintext)."
        },
    )

    def validate(self) -> None:
        self.folder_mode()
        if not RUN_NAME.fullmatch(self.name):
            raise ConfigError(
                "name", self.name, "must be 1-64 letters, digits, '.', '_' or '-', the first a letter or digit"
            )
        self._check_placement()
        if self.trainer.eval.every_steps > 0 and self.trainer.eval.dataset is None and not self.rollout.held_out_rows:
            raise ConfigError(
                "trainer.eval.dataset",
                None,
                "must name a dataset when trainer.eval.every_steps > 0, or rollout.held_out_rows must hold rows out",
            )
        if self.trainer.eval.every_steps > 0 and self.rollout.multi_turn:
            raise ConfigError(
                "trainer.eval.every_steps",
                self.trainer.eval.every_steps,
                f"must be 0 with rollout.workflow={self.rollout.workflow}: the evaluation inside a run "
                "plays single-turn rows; evaluate multi-turn workflows with `relayrl eval`",
            )
        if self.rollout.max_new_tokens > self.inference.max_new_tokens_limit:
            raise ConfigError(
                "rollout.max_new_tokens",
                self.rollout.max_new_tokens,
                f"must be <= inference.max_new_tokens_limit ({self.inference.max_new_tokens_limit})",
            )
        if self.rollout.group_size > self.inference.max_batch_sequences:
            raise ConfigError(
                "rollout.group_size",
                self.rollout.group_size,
                f"must be <= inference.max_batch_sequences ({self.inference.max_batch_sequences}): "
                "a group's samples decode together",
            )
        if not MIN_TEMPERATURE <= self.rollout.temperature <= MAX_TEMPERATURE:
            raise ConfigError(
                "rollout.temperature",
                self.rollout.temperature,
                f"must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]: what inference accepts "
                "(relayrl.inference.sampling_limits)",
            )
        stop = self.rollout.stop
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise ConfigError(
                "rollout.stop",
                stop,
                f"at most {MAX_STOP_STRINGS} stop strings of at most "
                f"{MAX_STOP_CHARS} characters: what inference accepts",
            )
        pc = self.trainer.publication
        if pc.probe_sequences * pc.probe_tokens > self.inference.max_probe_tokens:
            raise ConfigError(
                "trainer.publication.probe_tokens",
                pc.probe_tokens,
                f"probe_sequences ({pc.probe_sequences}) x probe_tokens must be <= "
                f"inference.max_probe_tokens ({self.inference.max_probe_tokens}): inference refuses a "
                "larger probe",
            )
        if self.rollout.group_size > self.inference.max_samples_per_request:
            raise ConfigError(
                "rollout.group_size",
                self.rollout.group_size,
                f"must be <= inference.max_samples_per_request ({self.inference.max_samples_per_request})",
            )

    def _check_placement(self) -> None:
        """Where things run: the trainer's sharding, each replica's weight transport, a replica's GPUs."""
        if self.model.lora.enabled and self.trainer.distributed.dp_shard > 1:
            raise ConfigError(
                "trainer.distributed.dp_shard",
                self.trainer.distributed.dp_shard,
                "must be 1 with model.lora.enabled (the adapter is small: replicate it)",
            )
        own = [e.transport for e in self.inference.endpoints if e.transport is not None]
        shm = WeightTransport.SHARED_MEMORY
        if (
            self.trainer.distributed.dp_shard > 1
            and len({t is shm for t in [*own, self.trainer.publication.transport]}) > 1
        ):
            raise ConfigError(
                "inference.endpoints.transport",
                [t.value for t in own],
                "must not mix shared_memory with other transports when trainer.distributed.dp_shard > 1 (a sharded "
                "publication writes one file, hashed as its transport checks it)",
            )
        tp = self.inference.vllm.tensor_parallel_size
        if tp > 1 and (self.inference.engine is not EngineKind.VLLM or not self.model.device.startswith("cuda")):
            raise ConfigError(
                "inference.vllm.tensor_parallel_size",
                tp,
                "must be 1 unless inference.engine is vllm and model.device is cuda (tensor parallelism spreads a "
                "replica over GPUs)",
            )

    def folder_mode(self) -> int:
        """``output_dir_mode`` as mode bits (ConfigError when it is not octal, lacks the owner's rwx or lets group
        or others write)."""
        text = self.output_dir_mode
        if not re.fullmatch(r"0?[0-7]{3}", text):
            raise ConfigError("output_dir_mode", text, "must be three octal digits, e.g. 0700 or 0750")
        mode = int(text, 8)
        if mode & 0o700 != 0o700:
            raise ConfigError("output_dir_mode", text, "must give the owner rwx (7 as the first digit)")
        if mode & 0o022:
            raise ConfigError(
                "output_dir_mode", text, "must not let group or others write (no 2, 3, 6 or 7 after the first digit)"
            )
        return mode

    @property
    def weights_dir(self) -> Path:
        """Where the trainer writes weight files for the shared-path transport (inference reads only here)."""
        return self.output_dir / "weights"

    @property
    def metrics_path(self) -> Path:
        return self.output_dir / "metrics.jsonl"

    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoints"


def load_run_config(path: Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML run config, apply ``section.key=value`` overrides, validate. Raises ConfigError."""
    data: dict[str, Any] = load_yaml(path) if path is not None else {}
    for override in overrides or []:
        apply_override(data, override, RunConfig)
    return from_dict(RunConfig, migrate(data))


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    """Bring a config written for an older schema to the current one; refuse one written for a newer one."""
    version = data.get("schema_version", SCHEMA_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ConfigError("schema_version", version, "must be an integer >= 1")
    if version > SCHEMA_VERSION:
        raise ConfigError(
            "schema_version",
            version,
            f"this config was written for a newer relayrl; this one reads schema versions up to {SCHEMA_VERSION}",
        )
    while version < SCHEMA_VERSION:
        data = MIGRATIONS[version](dict(data))
        version += 1
        data["schema_version"] = version
        log.warning(
            "config migrated from schema version %d to %d; save the resolved config.yaml to keep it",
            version - 1,
            version,
        )
    return data


def dump_run_config(cfg: RunConfig, path: Path) -> None:
    """Write the resolved config readable by its owner only (0600): it may hold secrets (control token, Redis URL
    password)."""
    write_private(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
