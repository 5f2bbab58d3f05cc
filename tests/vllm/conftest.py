"""The vLLM suite runs in its own virtual environment (scripts/setup_vllm_env.sh; `make test-vllm`)."""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vllm is not installed in this environment: the vllm suite runs in .venv-vllm "
                                   "(scripts/setup_vllm_env.sh, then `make test-vllm`)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
