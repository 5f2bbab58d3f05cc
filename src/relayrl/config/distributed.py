"""Configuration of the trainer's ranks (``trainer.distributed``): world size, the FSDP2 mesh and its mixed
precision, collective timeouts. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class DistributedConfig:
    world_size: int = field(
        default=1,
        metadata={
            "help": "Trainer ranks. `relayrl run` starts them with torchrun; `relayrl serve trainer` must run under "
            "torchrun with this many processes. groups_per_step must be divisible by it.",
            "ge": 1,
        },
    )
    collective_timeout_s: float = field(
        default=120.0,
        metadata={"help": "Timeout of every collective: a dead or diverged rank fails the others within it.", "gt": 0},
    )
    dp_shard: int = field(
        default=1,
        metadata={
            "help": "Data-parallel ranks that shard parameters, gradients and optimizer state (FSDP2 fully_shard; 1: "
            "every rank holds the whole model). With dp_shard > 1 every rank writes its shards of each "
            "checkpoint (torch.distributed.checkpoint under <checkpoint>/dcp, so the checkpoint directory must be "
            "shared by the ranks), rank 0 still exports the Hugging Face directory, and each publication gathers "
            "the full tensors one parameter at a time, rank 0 writing each into a file under the weights "
            "directory as it arrives (any transport). Not with model.lora.",
            "ge": 1,
        },
    )
    dp_replicate: int = field(
        default=0,
        metadata={
            "help": "Data-parallel replicas of the sharded model (0: world_size / dp_shard). world_size must equal "
            "dp_replicate x dp_shard x tp x cp.",
            "ge": 0,
        },
    )
    tp: int = field(default=1, metadata={"help": "Tensor-parallel degree (only 1 for now).", "ge": 1, "le": 1})
    cp: int = field(default=1, metadata={"help": "Context-parallel degree (only 1 for now).", "ge": 1, "le": 1})
    param_dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32",
        metadata={"help": "FSDP2 mixed precision: dtype of the unsharded parameters in forward and backward."},
    )
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata={"help": "FSDP2 mixed precision: dtype of the gradient reduction."}
    )
    record_collectives: bool = field(
        default=False,
        metadata={
            "help": "Debug: record every collective per rank under <output_dir>/collectives "
            "(read with: relayrl debug collectives RUN_DIR)."
        },
    )
