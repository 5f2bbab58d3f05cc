"""Configuration of the reward service."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from relayrl.config.endpoints import HttpConfig, ServerConfig, http_config, server_config
from relayrl.config.threads import ThreadsConfig
from relayrl.config.typed import ConfigError

UID_RANGE = 65536  # uids a root service hands out to sandboxed runs, from sandbox.uid_base


class SandboxBackend(StrEnum):
    BWRAP = "bwrap"
    PROCESS = "process"


@dataclass
class SandboxConfig:
    backend: SandboxBackend = field(
        default=SandboxBackend.BWRAP,
        metadata={
            "help": "bwrap: bubblewrap namespaces (network, PID, mount, read-only /usr, tmpfs /tmp); process: network "
            "namespace + limits only, for hosts without bubblewrap (no filesystem isolation beyond Unix "
            "permissions). If the chosen backend cannot be set up, code is never run and scoring it is an "
            "error."
        },
    )
    bwrap: str = field(default="bwrap", metadata={"help": "The bubblewrap binary (apt-get install bubblewrap)."})
    python: str = field(
        default="",
        metadata={
            "help": "Interpreter that runs Python programs; empty: the first of this Python's base interpreter, "
            "/usr/bin/python3, /usr/local/bin/python3 that the sandbox user can reach."
        },
    )
    wall_timeout_s: float = field(
        default=4.0,
        metadata={"help": "Wall-clock limit of one program run; then everything it started is killed.", "gt": 0},
    )
    total_timeout_s: float = field(
        default=8.0,
        metadata={
            "help": "Budget of one code verification over all its test runs; cases left when it is spent fail.",
            "gt": 0,
        },
    )
    cpu_s: int = field(default=4, metadata={"help": "RLIMIT_CPU of a run (CPU seconds).", "ge": 1})
    memory_mb: int = field(
        default=512, metadata={"help": "RLIMIT_AS of each process of a run (address space, MiB).", "ge": 64}
    )
    max_processes: int = field(
        default=8, metadata={"help": "RLIMIT_NPROC: processes (and threads) a run may have at once.", "ge": 2}
    )
    max_file_mb: int = field(default=8, metadata={"help": "RLIMIT_FSIZE: largest file a run may write (MiB).", "ge": 1})
    max_open_files: int = field(default=64, metadata={"help": "RLIMIT_NOFILE of a run.", "ge": 16})
    tmp_mb: int = field(default=64, metadata={"help": "Size of the run's private tmpfs /tmp (bwrap; MiB).", "ge": 1})
    max_output_bytes: int = field(
        default=64 * 1024,
        metadata={"help": "stdout + stderr a run may write; a run that writes more is killed.", "ge": 1024},
    )
    uid_base: int = field(
        default=200_000,
        metadata={
            "help": "When the service is root, each run gets a fresh uid in [uid_base, uid_base + 65536).",
            "ge": 1000,
            "le": 2**31 - UID_RANGE - 1,
        },
    )

    def validate(self) -> None:
        if self.total_timeout_s < self.wall_timeout_s:
            raise ConfigError(
                "total_timeout_s", self.total_timeout_s, f"must be >= wall_timeout_s ({self.wall_timeout_s})"
            )


class SelfReported(StrEnum):
    REFUSE = "refuse"
    TRUST = "trust"


@dataclass
class CodeVerifierConfig:
    """How the `code` verifier judges a row's `tests` (io_tests and hidden-answer tests are always judged outside
    the sandbox, against answers the program never sees)."""

    self_reported: SelfReported = field(
        default=SelfReported.REFUSE,
        metadata={
            "help": "Tests whose verdict only the harness inside the sandbox can report (any statement other than "
            "`assert <expr> == <literal>` / `assert <expr> is None|True|False`, e.g. `assert is_prime(7)`): "
            "the program shares that interpreter and can forge them. refuse: a row with one is a reward "
            "ERROR naming the test (never a score); trust: they count as the harness reports them, and the "
            "details say how many were self-reported."
        },
    )


@dataclass
class CodeRunsConfig:
    """Limits of RunCode, which runs one program for a tool in the sandbox above (its memory, output, process and
    file limits apply too)."""

    wall_timeout_s: float = field(
        default=4.0,
        metadata={
            "help": "Wall-clock limit of a run, and the most a request may ask for (more: RESOURCE_EXHAUSTED).",
            "gt": 0,
        },
    )
    max_code_bytes: int = field(
        default=64 * 1024,
        metadata={"help": "Largest program (UTF-8 bytes) accepted; a larger one is RESOURCE_EXHAUSTED.", "ge": 1},
    )
    max_stdin_bytes: int = field(
        default=64 * 1024, metadata={"help": "Largest stdin accepted; a larger one is RESOURCE_EXHAUSTED.", "ge": 0}
    )


@dataclass
class ComponentConfig:
    """One named, weighted part of a composite reward."""

    name: str = field(metadata={"help": "Name the component's score is reported under."})
    function: str = field(
        metadata={
            "help": "package.module:function or a registered reward name (math, exact_match, regex, format, code, "
            "arithmetic, or a plugin's entry point in group relayrl.rewards)."
        }
    )
    weight: float = field(default=1.0, metadata={"help": "Weight of this component in the total."})
    params: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "Keyword arguments passed to the function after the input: fn(inp, **params)."},
    )

    def validate(self) -> None:
        if not self.name:
            raise ConfigError("name", self.name, "must not be empty")
        if not math.isfinite(self.weight):
            raise ConfigError("weight", self.weight, "must be finite")


def _default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@dataclass
class RewardConfig:
    function: str = field(
        default="relayrl.tasks.arithmetic:reward",
        metadata={
            "help": "Reward function as package.module:function or a registered reward name (sync or async; see "
            "relayrl.reward.api). Ignored when `components` is set."
        },
    )
    params: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Keyword arguments for `function`: fn(inp, **params)."}
    )
    components: list[ComponentConfig] = field(
        default_factory=list,
        metadata={
            "help": "Composite reward: total = sum of weight x score over these; each score is reported by name."
        },
    )
    timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "Per-call verifier timeout: the worker that overruns is killed and replaced, and the call is a "
            "TIMEOUT result.",
            "gt": 0,
        },
    )
    workers: int = field(
        default_factory=_default_workers,
        metadata={"help": "Verifier worker processes (default: CPU count, at most 4).", "ge": 1},
    )
    chunk_size: int = field(
        default=32,
        metadata={"help": "Most requests sent to one worker at once (a batch is split across the workers).", "ge": 1},
    )
    worker_memory_mb: int = field(
        default=4096,
        metadata={
            "help": "RLIMIT_AS of each verifier worker process in MiB (0: unlimited); a verifier that allocates more "
            "gets MemoryError, which is an error result.",
            "ge": 0,
        },
    )
    start_method: Literal["forkserver", "spawn"] = field(
        default="forkserver",
        metadata={"help": "How worker processes start: forkserver (fast replacement; modules preloaded) or spawn."},
    )
    max_batch: int = field(
        default=1024, metadata={"help": "Largest ScoreBatch accepted; a larger one is RESOURCE_EXHAUSTED.", "ge": 1}
    )
    max_workers: int = field(
        default=0,
        metadata={
            "help": "Former number of verifier threads; when set (> 0) it is used as `workers`.",
            "ge": 0,
            "deprecated": "use workers (verifiers now run in worker processes)",
            "removed_in": "0.3",
        },
    )
    sandbox: SandboxConfig = field(
        default_factory=SandboxConfig,
        metadata={"help": "The sandbox that runs model-written code (the `code` verifier, RunCode)."},
    )
    code: CodeVerifierConfig = field(
        default_factory=CodeVerifierConfig, metadata={"help": "The `code` verifier: how it judges the row's tests."}
    )
    code_runs: CodeRunsConfig = field(
        default_factory=CodeRunsConfig,
        metadata={
            "help": "RunCode (a rollout tool running model-written code in the sandbox): its limits; it needs the code "
            "token (control.code_token_env)."
        },
    )
    threads: ThreadsConfig = field(
        default_factory=ThreadsConfig,
        metadata={"help": "Thread budget of this service (torch intra-op and inter-op threads; 0: automatic)."},
    )
    http: HttpConfig = field(
        default_factory=lambda: http_config(8002, max_body_mib=16),
        metadata={"help": "REST API (POST /score), /healthz and /metrics."},
    )
    # a ScoreBatch of max_batch completions with their references; rollout's Score calls may carry the code token
    server: ServerConfig = field(
        default_factory=lambda: server_config(
            50052,
            max_receive_mib=16,
            max_authenticated_rpcs=128,
            max_unauthenticated_rpcs=128,
            max_connection_age_s=30.0,  # clients re-resolve the replicas at least this often (docs/scaling.md)
        ),
        metadata={"help": "gRPC server of this service."},
    )

    def validate(self) -> None:
        if self.max_workers:
            self.workers = self.max_workers  # the deprecated spelling still takes effect
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ConfigError("components", names, "component names must be unique")
        if self.timeout_s < self.sandbox.total_timeout_s + 1:
            raise ConfigError(
                "timeout_s",
                self.timeout_s,
                f"must be >= sandbox.total_timeout_s + 1 ({self.sandbox.total_timeout_s + 1}): "
                "a code verification must finish before its call times out",
            )
        if self.timeout_s < self.code_runs.wall_timeout_s + 1:
            raise ConfigError(
                "timeout_s",
                self.timeout_s,
                f"must be >= code_runs.wall_timeout_s + 1 ({self.code_runs.wall_timeout_s + 1}): a "
                "code run must finish before the verifier pool times it out",
            )
