"""The launcher of `relayrl run` (:class:`Launcher`): the run folder, the embedded Redis, the four services as
child processes, their health, the progress lines and the staged stop (the package docstring says what a run does)."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

from relayrl.common.credentials import service_environment
from relayrl.common.grpc_utils import check_health
from relayrl.common.lifecycle import (
    StopRequested,
    die_with_parent,
    ignore_stop_signals,
    raise_on_stop_signals,
    restore_signals,
)
from relayrl.common.metrics_row import parse_line, read_rows
from relayrl.common.threads import pin_cpus, thread_env
from relayrl.config import RunConfig, dump_run_config
from relayrl.config.files import write_private
from relayrl.launcher.local_config import SERVICE_ORDER, local_run_config
from relayrl.launcher.stopping import SERVICE_STOP_S, STOP_STAGES, stop_deadline
from relayrl.launcher.summary import write_summary
from relayrl.local_redis import REDIS_PASSWORD_FILE, RedisProcess, find_redis_server, free_ports
from relayrl.run_report import progress_line

log = logging.getLogger(__name__)

RUN_FOLDERS = ("logs", "checkpoints", "redis", "weights", "tensorboard", "collectives")  # what a run writes
CONTROL_TOKEN_FILE = "control_token"  # <run folder>/control_token (0600): what `relayrl control RUN_DIR` presents


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_file: IO[bytes]
    config_path: Path
    extra: tuple[str, ...] = ()  # arguments after the config (an inference replica's ports)
    restarts: int = 0  # times the launcher started it again after it died


class Launcher:
    def __init__(
        self,
        cfg: RunConfig,
        out_dir: Path,
        startup_timeout_s: float = 120.0,
        progress: IO[str] | None = None,
        fresh: bool = True,
    ) -> None:
        self.fresh = fresh  # False (--resume auto): keep the run folder's Redis data, metrics and checkpoints
        self.out = out_dir
        self.startup_timeout_s = startup_timeout_s
        self.progress = progress if progress is not None else sys.stdout
        self.children: dict[str, Child] = {}
        self.redis: RedisProcess | None = None
        self.credentials: dict[str, str] = {}
        self.redis_password = ""  # of the embedded server ("" with an external Redis: the environment has it)
        self.cfg = local_run_config(cfg, self.out)

    def _target(self, name: str) -> str:
        """The gRPC target of child ``name`` (``inference-2``: the second inference replica's)."""
        service, _, replica = name.partition("-")
        if replica:
            return self.cfg.inference.replica_endpoints()[int(replica) - 1].address
        return str(getattr(self.cfg, service).server.target)

    def _children_of(self, service: str) -> list[tuple[str, list[str]]]:
        """The children that run ``service``: (name, extra arguments). Inference replicas after the first run the
        same config on their own ports (``--set``: ports only, never a secret)."""
        if service != "inference" or self.cfg.inference.replicas == 1:
            return [(service, [])]
        out: list[tuple[str, list[str]]] = [("inference", [])]
        for i, endpoint in enumerate(self.cfg.inference.replica_endpoints()[1:], start=2):
            grpc_port, weights_port = (e.rpartition(":")[2] for e in (endpoint.address, endpoint.weights_address))
            sets = {"server.port": grpc_port, "weights_server.port": weights_port, "http.port": str(free_ports(1)[0])}
            out.append((f"inference-{i}", [a for k, v in sets.items() for a in ("--set", f"inference.{k}={v}")]))
        return out

    def _credentials(self) -> dict[str, str]:
        """The run's credentials, given to the services through their environment (never a command line or a
        world-readable file): the caller's own when set in the environment, else fresh random ones. The control
        token is also written, readable by its owner only, to ``<run>/control_token`` for `relayrl control`."""
        control = self.cfg.control
        creds = {
            control.token_env: control.effective_token() or secrets.token_urlsafe(32),
            control.weights_token_env: control.effective_weights_token() or secrets.token_urlsafe(32),
            control.code_token_env: control.effective_code_token() or secrets.token_urlsafe(32),
        }
        write_private(self.out / CONTROL_TOKEN_FILE, creds[control.token_env] + "\n")
        if self.redis_password:
            creds[self.cfg.redis.password_env] = self.redis_password
            write_private(self.out / REDIS_PASSWORD_FILE, self.redis_password + "\n")
        return creds

    def _start_redis(self) -> None:
        """The embedded redis-server, its password the caller's ``$RELAYRL_REDIS_PASSWORD`` (``redis.password_env``)
        or a fresh random one; config.yaml gets its URL, which holds no password. It runs on rollout's CPUs when
        those are set (the automatic division: beside generation, off the trainer's cores)."""
        self.redis_password = self.cfg.redis.effective_password() or secrets.token_urlsafe(32)
        self.redis = RedisProcess(
            find_redis_server(self.cfg.redis.server_binary),
            self.out / "redis",
            self.out / "logs" / "redis.log",
            self.redis_password,
        )
        self.redis.wait_ready()
        pin_cpus(self.cfg.rollout.threads.cpus, "rollout.threads.cpus", self.redis.proc.pid)  # beside its writer
        self.cfg = replace(self.cfg, redis=replace(self.cfg.redis, url=self.redis.url))

    def _start_child(self, name: str, config_path: Path, extra: Sequence[str] = ()) -> None:
        service = name.partition("-")[0]
        log_file = (self.out / "logs" / f"{name}.log").open("ab")
        # only the credentials this service holds (relayrl.common.credentials.HELD); the caller's others removed
        env = {
            **service_environment(
                service,
                os.environ,
                self.credentials,
                self.cfg.control,
                self.cfg.redis,
                in_run_eval=self.cfg.trainer.eval.every_steps > 0,
            ),
            "PYTHONUNBUFFERED": "1",
            **thread_env(getattr(self.cfg, service).threads.intra_op),
        }
        command = [sys.executable, "-m", "relayrl.cli", "serve", service, str(config_path), *extra]
        world = self.cfg.trainer.distributed.world_size
        if name == "trainer" and world > 1:
            # torchrun SIGKILLs its ranks 30 s after SIGTERM by default: give them the longest graceful stop allowed
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={world}",
                f"--shutdown-timeout={int(self.cfg.trainer.stop_grace_max_s)}",
                *command[1:],
            ]
        proc = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        self.children[name] = Child(name, proc, log_file, config_path, tuple(extra))

    def _dead_child(self) -> Child | None:
        for child in self.children.values():
            code = child.proc.poll()
            if code is not None and not (child.name == "trainer" and code == 0):
                return child
        return None

    def _restart(self, child: Child) -> bool:
        """Start ``child`` again if it is an inference replica among several with restarts left (the others serve
        meanwhile; the trainer's watchdog sends it the current weights and rollout routes to it once it serves
        them). False: its death ends the run."""
        ic = self.cfg.inference
        if child.name.partition("-")[0] != "inference" or ic.replicas == 1 or child.restarts >= ic.replica_restarts:
            return False
        child.log_file.close()
        self._say(
            f"relayrl: {child.name} died with exit code {child.proc.returncode}; starting it again "
            f"(restart {child.restarts + 1} of inference.replica_restarts={ic.replica_restarts})"
        )
        self._start_child(child.name, child.config_path, child.extra)
        self.children[child.name].restarts = child.restarts + 1
        return True

    def _say(self, text: str) -> None:
        print(text, file=self.progress, flush=True)

    def _fail(self, child: Child) -> int:
        self._say(
            f"relayrl: service {child.name} died with exit code {child.proc.returncode}; "
            f"see {self.out / 'logs' / (child.name + '.log')}"
        )
        tail = (self.out / "logs" / f"{child.name}.log").read_text(errors="replace").splitlines()[-15:]
        for line in tail:
            self._say(f"  {child.name}| {line}")
        return 1

    def run(self) -> int:
        """The whole run with the umask of ``output_dir_mode`` (the launcher's, hence its children's and
        redis-server's: every file of the run folder readable by its owner only by default)."""
        umask = self._prepare_folder()
        try:
            return self._run()
        finally:
            os.umask(umask)

    def _prepare_folder(self) -> int:
        """Set the umask that ``output_dir_mode`` implies (returns the previous one), create the run folder and
        give it and the run's own folders that mode (a resumed or reused folder may be older and wider open; the
        folder's mode alone keeps others out of everything below it)."""
        mode = self.cfg.folder_mode()
        previous = os.umask(0o777 & ~mode)
        self.out.mkdir(parents=True, exist_ok=True)
        for folder in (self.out, *(self.out / name for name in RUN_FOLDERS)):
            if folder.is_dir() and not folder.is_symlink():
                folder.chmod(mode)
        return previous

    def _run(self) -> int:
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        (self.out / "checkpoints").mkdir(parents=True, exist_ok=True)
        if self.fresh:  # a new run never inherits an old stream, metrics or checkpoints
            for stale in (self.cfg.metrics_path, self.out / "summary.json", self.out / "rollout_state.json"):
                stale.unlink(missing_ok=True)
            for folder in (self.out / "redis", self.out / "checkpoints", self.out / "collectives"):
                shutil.rmtree(folder, ignore_errors=True)
            (self.out / "checkpoints").mkdir(parents=True, exist_ok=True)
        handlers = raise_on_stop_signals()  # SIGTERM and SIGHUP stop the stack as Ctrl-C does
        try:
            (self.out / REDIS_PASSWORD_FILE).unlink(missing_ok=True)
            if not self.cfg.redis.effective_url():
                self._start_redis()
            config_path = self.out / "config.yaml"
            dump_run_config(self.cfg, config_path)
            self.credentials = self._credentials()
            self._say(f"relayrl: run folder {self.out}")
            for service in SERVICE_ORDER:
                for name, extra in self._children_of(service):
                    self._start_child(name, config_path, extra)
            code = self._wait_healthy()
            if code is None:
                code = self._monitor()
            return code
        except (KeyboardInterrupt, StopRequested) as stop:
            ignore_stop_signals()
            name = str(stop) if isinstance(stop, StopRequested) else "SIGINT"
            self._say(f"relayrl: {name}; stopping services")
            return stop.exit_code if isinstance(stop, StopRequested) else 130
        finally:
            ignore_stop_signals()
            try:
                self.shutdown()
            finally:
                restore_signals(handlers)

    def _wait_healthy(self) -> int | None:
        pending = list(self.children)
        deadline = time.monotonic() + self.startup_timeout_s
        while pending:
            dead = self._dead_child()
            if dead is not None:
                return self._fail(dead)
            if time.monotonic() > deadline:
                self._say(f"relayrl: services not healthy after {self.startup_timeout_s:.0f}s: {', '.join(pending)}")
                return 1
            pending = [n for n in pending if not check_health(self._target(n), 1.0, tls=self.cfg.tls)]
            if pending:
                time.sleep(0.2)
        self._say("relayrl: all services healthy (" + ", ".join(f"{n}={self._target(n)}" for n in self.children) + ")")
        return None

    def _monitor(self) -> int:
        total = self.cfg.trainer.total_steps
        offset = 0
        while True:
            offset = self._show_progress(offset, total)
            dead = self._dead_child()
            if dead is not None and not self._restart(dead):
                return self._fail(dead)
            trainer = self.children["trainer"].proc
            if trainer.poll() == 0:
                self._show_progress(offset, total)
                self._say(f"relayrl: done; metrics in {self.cfg.metrics_path}")
                return 0
            time.sleep(0.5)

    def _show_progress(self, offset: int, total: int) -> int:
        path = self.cfg.metrics_path
        if not path.exists():
            return offset
        with path.open() as f:
            f.seek(offset)
            while True:
                line = f.readline()
                if not line or not line.endswith("\n"):
                    break
                offset += len(line.encode())
                text = progress_line(parse_line(line), total)
                if text is not None:
                    self._say(text)
        return offset

    def _summary(self) -> None:
        """After the services stopped: the accounting identity (relayrl.run_report.run_summary) and the children
        started again, written to summary.json and printed."""
        restarts = {c.name: c.restarts for c in self.children.values() if c.restarts}
        write_summary(self.cfg, self.out, self.redis_password, self._say, restarts)

    def _trainer_stop_deadline(self) -> float:
        """The trainer's stop deadline (:func:`stop_deadline` of the run's metrics), said in the log."""
        tc = self.cfg.trainer
        path = self.cfg.metrics_path
        rows = read_rows(path) if path.exists() else []
        deadline, why = stop_deadline(rows, tc.stop_grace_s, tc.stop_grace_max_s)
        self._say(f"relayrl: waiting up to {deadline:.0f}s for the trainer to stop gracefully ({why})")
        return deadline

    def _stop(self, names: Sequence[str], deadline_s: float) -> None:
        """SIGTERM to each of ``names`` still running, then wait up to ``deadline_s`` for all; SIGKILL the rest."""
        children = [c for c in self.children.values() if c.name.partition("-")[0] in names]  # replicas too
        for child in children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + deadline_s
        for child in children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing it", child.name, deadline_s)
                child.proc.kill()
                child.proc.wait()
            child.log_file.close()

    def shutdown(self) -> None:
        trainer = self.children.get("trainer")
        trainer_s = self._trainer_stop_deadline() if trainer and trainer.proc.poll() is None else 0.0
        for names in STOP_STAGES:
            self._stop(names, max(trainer_s, SERVICE_STOP_S) if "trainer" in names else SERVICE_STOP_S)
        if self.cfg.redis.effective_url() and self.children:
            self._summary()
        if self.redis is not None:
            self.redis.stop()
