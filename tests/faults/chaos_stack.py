"""The stack the chaos test runs: redis-server and the four services as separate processes, each started the way
docker-compose starts them (`python -m relayrl.cli serve NAME config.yaml`, credentials in the environment), so
that one can be SIGKILLed and restarted while the others run on (`relayrl run` ends the run when a child dies).

The run folder, config.yaml, ports, thread budget, credentials and each child's command line and environment are
the launcher's own (:class:`relayrl.launcher.Launcher`: its ``_start_redis``, ``_credentials``, ``_start_child``
and ``_summary``), so what runs here is what `relayrl run` runs, less its stop-on-first-death monitor. Redis is
the launcher's embedded server (AOF everysec, noeviction, a password) with a ``maxmemory`` set at runtime so that
it can be filled.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from relayrl.common.grpc_utils import check_health
from relayrl.common.lifecycle import die_with_parent
from relayrl.common.pb import (
    inference_pb2,
    inference_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from relayrl.config import dump_run_config, load_run_config
from relayrl.launcher import SERVICE_ORDER, Launcher
from tests.conftest import REPO

FILLER_PREFIX = "chaos:filler:"
FILLER_BYTES = 1024 * 1024


@dataclass
class Death:
    """A service that exited without being killed by the test."""

    name: str
    code: int | None
    at_s: float
    log_tail: str


@dataclass
class ChaosStack:
    out: Path
    model: Path
    overrides: list[str]
    maxmemory_mib: int = 64
    t0: float = field(default_factory=time.monotonic)
    launcher: Launcher | None = None
    config_path: Path | None = None
    killed: set[str] = field(default_factory=set)  # children the test killed (not yet restarted)
    deaths: list[Death] = field(default_factory=list)
    holders: subprocess.Popen[bytes] | None = None
    log: list[str] = field(default_factory=list)
    filler_seq: int = 0  # filler keys written so far (their names)
    umask: int | None = None  # the test process's own, restored at the end

    # --- life cycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        cfg = load_run_config(
            REPO / "examples" / "quickstart.yaml",
            [
                f"model.path={self.model}",
                f"rollout.dataset={REPO / 'examples' / 'data' / 'arithmetic.jsonl'}",
                *self.overrides,
            ],
        )
        launcher = self.launcher = Launcher(cfg, self.out, progress=sys.stdout)
        self.umask = launcher._prepare_folder()  # output_dir_mode: the launcher's umask, for every child too
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        (self.out / "checkpoints").mkdir(parents=True, exist_ok=True)
        launcher._start_redis()
        self.redis().config_set("maxmemory", f"{self.maxmemory_mib}mb")
        self.config_path = self.out / "config.yaml"
        dump_run_config(launcher.cfg, self.config_path)
        launcher.credentials = launcher._credentials()
        for name in SERVICE_ORDER:
            launcher._start_child(name, self.config_path)
        for name in SERVICE_ORDER:
            assert self.wait_healthy(name, 180), f"{name} not healthy: {self.log_tail(name)}"

    def stop(self) -> None:
        """SIGTERM every child (reverse order), then SIGKILL what is left after 20 s; the holders too."""
        self.stop_holders()
        launcher = self.launcher
        if launcher is None:
            return
        for name in reversed(SERVICE_ORDER):
            child = launcher.children.get(name)
            if child is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for child in launcher.children.values():
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.note(f"{child.name} did not stop within 20 s of SIGTERM: killed")
                self._killpg(child.proc)
            child.log_file.close()

    def kill_everything(self) -> None:
        """The finally of the test: every process it started, by its process group (each child leads one)."""
        self.stop_holders()
        if self.launcher is None:
            return
        for child in self.launcher.children.values():
            self._killpg(child.proc)
            if not child.log_file.closed:
                child.log_file.close()
        if self.launcher.redis is not None:
            self.launcher.redis.stop()
        if self.umask is not None:
            os.umask(self.umask)

    @staticmethod
    def _killpg(proc: subprocess.Popen[Any]) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    # --- faults -------------------------------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, text: str) -> None:
        line = f"[chaos {self.now():6.1f}s] {text}"
        self.log.append(line)
        print(line, flush=True)

    def kill(self, name: str) -> None:
        """SIGKILL the service (its whole process group: a container dying) and start it again at once."""
        assert self.launcher is not None and self.config_path is not None
        child = self.launcher.children[name]
        if child.proc.poll() is not None:  # it died by itself first: a death, not a kill
            self.check_deaths()
            return
        self.killed.add(name)
        self._killpg(child.proc)
        child.log_file.close()
        self.note(f"SIGKILL {name} (pid {child.proc.pid}); restarting it")
        self.restart(name)

    def restart(self, name: str) -> None:
        assert self.launcher is not None and self.config_path is not None
        self.launcher._start_child(name, self.config_path)
        self.killed.discard(name)

    def check_deaths(self) -> list[Death]:
        """Children that exited by themselves since the last look: recorded, then restarted (the chaos goes on)."""
        assert self.launcher is not None
        found = []
        for name, child in list(self.launcher.children.items()):
            code = child.proc.poll()
            if code is None or name in self.killed:
                continue
            child.log_file.close()
            death = Death(name, code, self.now(), self.log_tail(name))
            self.deaths.append(death)
            found.append(death)
            self.note(f"{name} DIED by itself (exit code {code}); restarting it. Log tail:\n{death.log_tail}")
            self.restart(name)
        return found

    def log_tail(self, name: str, lines: int = 25) -> str:
        path = self.out / "logs" / f"{name}.log"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
        return "\n".join(f"    {name}| {line}" for line in text)

    def redis(self) -> Any:
        assert self.launcher is not None and self.launcher.redis is not None
        return self.launcher.redis.client(socket_timeout=5.0)

    def fill_redis(self) -> int:
        """Write 1 MiB filler keys, then 16 KiB ones, until Redis refuses one for lack of memory (bounded); the keys
        written. What the trainer's trims free meanwhile :meth:`top_up_redis` takes back."""
        written = self._fill(FILLER_BYTES, 4 * self.maxmemory_mib) + self.top_up_redis()
        client = self.redis()
        self.note(f"Redis full after {written} filler keys ({client.info('memory')['used_memory_human']})")
        client.close()
        return written

    def top_up_redis(self) -> int:
        """Keep Redis full: 16 KiB filler keys until one is refused (at most 200)."""
        return self._fill(16 * 1024, 200)

    def _fill(self, size: int, most: int) -> int:
        import redis

        client = self.redis()
        try:
            for n in range(most):
                client.set(f"{FILLER_PREFIX}{size}:{self.filler_seq + n}", b"x" * size)
        except redis.exceptions.OutOfMemoryError:
            self.filler_seq += n
            return n
        finally:
            client.close()
        raise AssertionError(f"Redis never refused a write (maxmemory {self.maxmemory_mib} MiB)")

    def empty_redis(self) -> None:
        client = self.redis()
        keys = list(client.scan_iter(match=f"{FILLER_PREFIX}*", count=1000))
        if keys:
            client.delete(*keys)
        self.note(f"Redis emptied ({len(keys)} filler keys deleted)")
        client.close()

    def start_holders(self, lifetime_s: float) -> Path:
        """The unauthenticated stream holders (tests/faults/chaos_clients.py) on every gRPC port of the stack."""
        assert self.launcher is not None
        cfg = self.launcher.cfg
        stats = self.out / "holders.json"
        stats.unlink(missing_ok=True)

        def slots(server: Any) -> int:
            return int(server.max_concurrent_rpcs) + 4

        targets = [  # the weights port first: its two slots are what the trainer's pushes need
            f"weights_update=update_weights@{cfg.inference.weights_server.target}#{slots(cfg.inference.weights_server)}",
            f"weights=health@{cfg.inference.weights_server.target}#4",
            f"trainer_watch=trainer_watch@{cfg.trainer.server.target}#{slots(cfg.trainer.server)}",
            f"trainer=health@{cfg.trainer.server.target}#4",
            f"reward=health@{cfg.reward.server.target}#{slots(cfg.reward.server)}",
            f"rollout=health@{cfg.rollout.server.target}#{slots(cfg.rollout.server)}",
            f"inference_generate=generate@{cfg.inference.server.target}#4",
            f"inference=health@{cfg.inference.server.target}#{slots(cfg.inference.server)}",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYRL_")}  # no credential at all
        self.holders = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.chaos_clients", str(stats), str(lifetime_s), *targets],
            cwd=REPO,
            env=env,
            stdout=(self.out / "logs" / "holders.log").open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGKILL),
        )
        self.note(f"unauthenticated stream holders started (pid {self.holders.pid})")
        return stats

    def stop_holders(self) -> None:
        if self.holders is not None:
            self._killpg(self.holders)
            self.note(f"stream holders stopped; {self.holder_stats()}")
            self.holders = None

    def holder_stats(self) -> str:
        """What the holders last reported, per target: held now / ever opened, refusals and ends by status."""
        try:
            data = json.loads((self.out / "holders.json").read_text())
        except (OSError, ValueError):
            return "no holder stats"
        return "; ".join(
            f"{name}: held {t['held']}/{t['slots']} (opened {t['opened']}) refused {t['refused']} ended {t['ended']}"
            for name, t in data.items()
        )

    # --- observation --------------------------------------------------------------------------------------------
    def target(self, name: str) -> str:
        assert self.launcher is not None
        return str(getattr(self.launcher.cfg, name).server.target)

    def wait_healthy(self, name: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check_health(self.target(name), 1.0):
                return True
            time.sleep(0.2)
        return False

    def _metadata(self) -> list[tuple[str, str]]:
        assert self.launcher is not None
        return [("authorization", f"Bearer {self.launcher.credentials[self.launcher.cfg.control.token_env]}")]

    def trainer_status(self) -> trainer_pb2.TrainerStatus | None:
        with grpc.insecure_channel(self.target("trainer")) as ch:
            try:
                return trainer_pb2_grpc.TrainerServiceStub(ch).GetStatus(
                    trainer_pb2.GetTrainerStatusRequest(), timeout=5.0, metadata=self._metadata()
                )
            except grpc.RpcError:
                return None

    def inference_status(self) -> inference_pb2.InferenceStatus | None:
        with grpc.insecure_channel(self.target("inference")) as ch:
            try:
                return inference_pb2_grpc.InferenceServiceStub(ch).GetStatus(
                    inference_pb2.GetInferenceStatusRequest(), timeout=5.0, metadata=self._metadata()
                )
            except grpc.RpcError:
                return None

    def pause_rollout(self) -> rollout_pb2.RolloutStatus:
        with grpc.insecure_channel(self.target("rollout")) as ch:
            return rollout_pb2_grpc.RolloutServiceStub(ch).Pause(
                rollout_pb2.PauseRequest(reason="chaos test: settle"), timeout=10.0, metadata=self._metadata()
            )

    def summary(self) -> None:
        """summary.json, as `relayrl run` writes it when its services stopped."""
        assert self.launcher is not None
        self.launcher._summary()
