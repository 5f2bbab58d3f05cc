"""The topology object: world size = product of the dimensions, checked with errors naming the field."""

from __future__ import annotations

import pytest

from relayrl.config import load_run_config
from relayrl.config.distributed import DistributedConfig
from relayrl.config.typed import ConfigError
from relayrl.trainer.parallel_dims import ParallelDims


def test_dp_replicate_zero_takes_what_the_shard_dimension_leaves() -> None:
    dims = ParallelDims.from_config(DistributedConfig(world_size=8, dp_shard=4), world_size=8)

    assert (dims.dp_replicate, dims.dp_shard, dims.fsdp) == (2, 4, True)
    assert dims.mesh_shape() == ((2, 4), ("dp_replicate", "dp_shard"))


def test_a_world_size_that_is_not_the_product_of_the_dimensions_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        ParallelDims(dp_replicate=2, dp_shard=2, tp=1, cp=1, world_size=6)

    assert info.value.field == "trainer.distributed.world_size" and "dp_shard (2)" in str(info.value)


def test_tensor_and_context_parallelism_are_refused_until_supported() -> None:
    with pytest.raises(ConfigError) as info:
        ParallelDims(dp_replicate=1, dp_shard=1, tp=2, cp=1, world_size=2)

    assert info.value.field == "trainer.distributed.tp"


def test_the_run_config_checks_the_product_at_start_up() -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(
            None,
            ["trainer.distributed.world_size=3", "trainer.distributed.dp_replicate=2", "trainer.groups_per_step=6"],
        )

    assert info.value.field == "trainer.distributed.world_size"
