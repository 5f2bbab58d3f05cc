"""The trainer's parallelism as one declared object (in the spirit of torchtitan's ``ParallelDims``).

:class:`ParallelDims` holds the degrees of data-parallel replication (``dp_replicate``), data-parallel sharding
(``dp_shard``, FSDP2), and, for later, tensor and context parallelism (``tp``, ``cp``: 1 for now). It checks
``world_size = dp_replicate x dp_shard x tp x cp`` with an error naming the fields, and builds the
``DeviceMesh`` once, explicitly, on the process group that already exists (nothing at import time).
:func:`apply_fsdp` shards a transformers causal LM over the mesh's data-parallel dimensions with
``fully_shard`` (each decoder layer, then the root), with the configured mixed precision; gradients are summed
(divide factor 1), because the trainer divides every rank's loss by the global normaliser itself.

The trainer service checkpoints sharded state with ``torch.distributed.checkpoint`` (relayrl.trainer.checkpoint)
and publishes weights by gathering full tensors one at a time as it streams them (relayrl.trainer.weight_sync).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from relayrl.config.distributed import DistributedConfig
from relayrl.config.typed import ConfigError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "cp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"trainer.distributed.{name}", getattr(self, name), "must be >= 1")
        for name in ("tp", "cp"):
            if getattr(self, name) != 1:
                raise ConfigError(f"trainer.distributed.{name}", getattr(self, name), "must be 1 (not supported yet)")
        if self.dp_replicate * self.dp_shard * self.tp * self.cp != self.world_size:
            raise ConfigError(
                "trainer.distributed.world_size",
                self.world_size,
                f"must equal dp_replicate ({self.dp_replicate}) x dp_shard ({self.dp_shard}) x tp "
                f"({self.tp}) x cp ({self.cp})",
            )

    @staticmethod
    def from_config(cfg: DistributedConfig, world_size: int) -> ParallelDims:
        """``dp_replicate = 0`` takes what the other dimensions leave of ``world_size``."""
        rest = cfg.dp_shard * cfg.tp * cfg.cp
        replicate = cfg.dp_replicate or max(world_size // rest, 1)
        return ParallelDims(replicate, cfg.dp_shard, cfg.tp, cfg.cp, world_size)

    @property
    def fsdp(self) -> bool:
        return self.dp_shard > 1

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The mesh's sizes and dimension names, outermost first (dimensions of size 1 included)."""
        return (self.dp_replicate, self.dp_shard), ("dp_replicate", "dp_shard")

    def build_mesh(self, device_type: str) -> Any:
        """The DeviceMesh over every rank (needs the default process group; call once)."""
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = self.mesh_shape()
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        log.info("device mesh %s: %s", dict(zip(names, shape, strict=True)), mesh)
        return mesh


def apply_fsdp(model: Any, mesh: Any, param_dtype: str = "float32", reduce_dtype: str = "float32") -> Any:
    """FSDP2 over the data-parallel dimensions of ``mesh`` (HSDP when dp_replicate > 1): each decoder layer,
    then the root. Returns the model (now an ``FSDPModule``) with gradients summed, not averaged."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    dp_mesh = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    for module in model.modules():  # the settings are per FSDP module (each layer and the root)
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # the loss is already divided by the global normaliser
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return model


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers causal LM (``model.model.layers``), the unit FSDP2 shards."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: cannot find its decoder layers to shard")
    return list(layers)


def is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def sync_gradients(model: Any, coll: Any, name: str) -> None:
    """Sum every trainable parameter's gradient over the data-parallel ranks: one coalesced all-reduce through
    the recorded ``Collectives`` for a replicated model; nothing for an FSDP2 model (its backward already
    reduce-scattered them, summed)."""
    if is_sharded(model):
        return
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    coll.all_reduce_coalesced([p.grad for p in params], dist.ReduceOp.SUM, name)


def full_norm(norm: torch.Tensor) -> float:
    """The total gradient norm as a float (a DTensor's full value under FSDP2)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)
