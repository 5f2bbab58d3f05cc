"""`relayrl run`: the whole stack as local processes, with an embedded Redis, on free ports.

Starts redis-server (unless a Redis URL is configured: redis.url or $RELAYRL_REDIS_URL), with a password of
its own (the caller's $RELAYRL_REDIS_PASSWORD, else a fresh random one), then reward, inference, trainer and
rollout as child processes running `relayrl serve`, waits for their health, shows progress from metrics.jsonl, and stops
everything at the end, on Ctrl-C, SIGTERM or SIGHUP (exit code 128 + the signal), or as soon as any service dies
(exit code 1, naming the service). Every child dies with the launcher, also when it is SIGKILLed
(relayrl.common.lifecycle).
"""

from __future__ import annotations

import json
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

from relayrl.common.checkpoints import checkpoint_step, latest_checkpoint
from relayrl.common.credentials import service_environment
from relayrl.common.grpc_utils import check_health
from relayrl.common.lifecycle import (
    StopRequested,
    die_with_parent,
    ignore_stop_signals,
    raise_on_stop_signals,
    restore_signals,
)
from relayrl.common.metrics_row import MetricsRow, format_books, format_time_shares, parse_line, read_rows, rl_rows
from relayrl.common.redis_conn import sync_client
from relayrl.common.redis_keys import PROGRESS_APPENDED, RedisKeys
from relayrl.common.threads import automatic_cpus, automatic_division, pin_cpus, thread_env
from relayrl.config import RunConfig, dump_run_config
from relayrl.config.endpoints import HttpConfig, ServerConfig
from relayrl.config.files import write_private
from relayrl.config.model_fit import fit_to_model
from relayrl.config.trainer import STOP_MARGIN, PublicationConfig, WeightTransport, graceful_stop_s
from relayrl.config.typed import ConfigError
from relayrl.local_redis import REDIS_PASSWORD_FILE, RedisProcess, find_redis_server, free_ports
from relayrl.run_report import entries_added, progress_line, run_summary

log = logging.getLogger(__name__)

SERVICE_ORDER = ("reward", "inference", "trainer", "rollout")
RUN_FOLDERS = ("logs", "checkpoints", "redis", "weights", "tensorboard", "collectives")  # what a run writes
CONTROL_TOKEN_FILE = "control_token"  # <run folder>/control_token (0600): what `relayrl control RUN_DIR` presents
# shutdown in two stages: the trainer (its final checkpoint may settle a push to inference and acknowledges in
# Redis) and rollout first, then the servers they use; Redis last
STOP_STAGES = (("rollout", "trainer"), ("inference", "reward"))
SERVICE_STOP_S = 15.0  # the deadline of a service other than the trainer (their gRPC grace is 5 s)


def stop_deadline(rows: Sequence[MetricsRow], grace_s: float, max_s: float) -> tuple[float, str]:
    """How long to wait for the trainer to stop gracefully, and why: :func:`graceful_stop_s` of the longest
    step, push and checkpoint measured in ``rows``."""
    steps = rl_rows(rows)
    step = max((r.step_time_s for r in steps), default=0.0)
    push = max((r.weight_sync_s or 0.0 for r in steps), default=0.0)
    checkpoint = max((r.time_checkpoint_s for r in steps), default=0.0)
    budget = graceful_stop_s(step, push, checkpoint, grace_s, max_s)
    measured = (f"{STOP_MARGIN:g} x (longest step {step:.1f}s + push {push:.1f}s + checkpoint {checkpoint:.1f}s) = "
                f"{budget.need_s:.1f}s over {len(steps)} steps in metrics.jsonl" if steps else "no step measured yet")
    return budget.deadline_s, (f"{measured}; trainer.stop_grace_s {grace_s:g}s, trainer.stop_grace_max_s {max_s:g}s: "
                               f"{budget.bound}")


def local(server: ServerConfig, port: int) -> ServerConfig:
    """The same server settings on loopback and ``port`` (the launcher runs everything locally)."""
    return replace(server, host="127.0.0.1", port=port, address="")


def local_publication(pc: PublicationConfig) -> PublicationConfig:
    """``auto`` becomes ``shared_memory``: trainer and inference run on this host and share the run folder."""
    return replace(pc, transport=WeightTransport.SHARED_MEMORY) if pc.transport is WeightTransport.AUTO else pc


def local_http(http: HttpConfig, port: int) -> HttpConfig:
    """An HTTP API on loopback and ``port``."""
    return replace(http, host="127.0.0.1", port=port)


def with_thread_budget(cfg: RunConfig, cores: Sequence[int]) -> RunConfig:
    """``cfg`` with every automatic (0) thread count of reward, inference, trainer and rollout resolved by
    :func:`relayrl.common.threads.automatic_division` of ``cores`` (usable CPU ids; inter-op: 1); set counts stay.
    When inference's and the trainer's counts are both automatic and no service names its ``cpus``, the services
    are also pinned by :func:`relayrl.common.threads.automatic_cpus` (the trainer's cores apart from generation's)."""
    ranks = cfg.trainer.distributed.world_size
    auto = automatic_division(len(cores), ranks)
    sections = {name: getattr(cfg, name) for name in SERVICE_ORDER}
    divided = not any(sections[name].threads.intra_op for name in ("inference", "trainer")) \
        and not any(section.threads.cpus for section in sections.values())
    cpus = automatic_cpus(cores, ranks) if divided else {name: s.threads.cpus for name, s in sections.items()}
    for name, section in sections.items():
        threads = replace(section.threads, intra_op=section.threads.intra_op or auto[name],
                          interop=section.threads.interop or 1, cpus=list(cpus[name]))
        sections[name] = replace(section, threads=threads)
    return replace(cfg, **sections)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_file: IO[bytes]


class Launcher:
    def __init__(self, cfg: RunConfig, out_dir: Path, startup_timeout_s: float = 120.0,
                 progress: IO[str] | None = None, fresh: bool = True) -> None:
        self.fresh = fresh  # False (--resume auto): keep the run folder's Redis data, metrics and checkpoints
        self.out = out_dir
        self.startup_timeout_s = startup_timeout_s
        self.progress = progress if progress is not None else sys.stdout
        self.children: dict[str, Child] = {}
        self.redis: RedisProcess | None = None
        self.credentials: dict[str, str] = {}
        self.redis_password = ""  # of the embedded server ("" with an external Redis: the environment has it)
        self.cfg = self._resolve(cfg)

    def _resolve(self, cfg: RunConfig) -> RunConfig:
        cfg.model.check_exists()
        cfg = fit_to_model(cfg)  # the length limits within the model's context and vocabulary, before any service
        if not cfg.rollout.dataset.is_file():
            raise ConfigError("rollout.dataset", str(cfg.rollout.dataset), "dataset file does not exist")
        cfg.tls.read()  # every TLS file present and PEM before any service starts (ConfigError naming the field)
        cfg = with_thread_budget(cfg, sorted(os.sched_getaffinity(0)))
        p = iter(free_ports(9))  # distinct: one per server of the stack
        return replace(
            cfg, output_dir=self.out, tls=cfg.tls.resolved(),
            model=replace(cfg.model, path=cfg.model.path.resolve()),
            rollout=replace(cfg.rollout, dataset=cfg.rollout.dataset.resolve(),
                            server=local(cfg.rollout.server, next(p)), http=local_http(cfg.rollout.http, next(p))),
            inference=replace(cfg.inference, server=local(cfg.inference.server, next(p)),
                              http=local_http(cfg.inference.http, next(p)),
                              weights_server=local(cfg.inference.weights_server, next(p))),
            reward=replace(cfg.reward, server=local(cfg.reward.server, next(p)),
                           http=local_http(cfg.reward.http, next(p))),
            trainer=replace(cfg.trainer, server=local(cfg.trainer.server, next(p)),
                            http=local_http(cfg.trainer.http, next(p)),
                            publication=local_publication(cfg.trainer.publication)),
        )

    def _target(self, name: str) -> str:
        return str(getattr(self.cfg, name).server.target)

    def _credentials(self) -> dict[str, str]:
        """The run's credentials, given to the services through their environment (never a command line or a
        world-readable file): the caller's own when set in the environment, else fresh random ones. The control
        token is also written, readable by its owner only, to ``<run>/control_token`` for `relayrl control`."""
        control = self.cfg.control
        creds = {control.token_env: control.effective_token() or secrets.token_urlsafe(32),
                 control.weights_token_env: control.effective_weights_token() or secrets.token_urlsafe(32),
                 control.code_token_env: control.effective_code_token() or secrets.token_urlsafe(32)}
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
        self.redis = RedisProcess(find_redis_server(self.cfg.redis.server_binary), self.out / "redis",
                                  self.out / "logs" / "redis.log", self.redis_password)
        self.redis.wait_ready()
        pin_cpus(self.cfg.rollout.threads.cpus, "rollout.threads.cpus", self.redis.proc.pid)  # beside its writer
        self.cfg = replace(self.cfg, redis=replace(self.cfg.redis, url=self.redis.url))

    def _start_child(self, name: str, config_path: Path) -> None:
        log_file = (self.out / "logs" / f"{name}.log").open("ab")
        # only the credentials this service holds (relayrl.common.credentials.HELD); the caller's others removed
        env = {**service_environment(name, os.environ, self.credentials, self.cfg.control, self.cfg.redis,
                                     in_run_eval=self.cfg.trainer.eval.every_steps > 0),
               "PYTHONUNBUFFERED": "1", **thread_env(getattr(self.cfg, name).threads.intra_op)}
        command = [sys.executable, "-m", "relayrl.cli", "serve", name, str(config_path)]
        world = self.cfg.trainer.distributed.world_size
        if name == "trainer" and world > 1:
            # torchrun SIGKILLs its ranks 30 s after SIGTERM by default: give them the longest graceful stop allowed
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                       f"--shutdown-timeout={int(self.cfg.trainer.stop_grace_max_s)}", *command[1:]]
        proc = subprocess.Popen(
            command,
            stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=die_with_parent())
        self.children[name] = Child(name, proc, log_file)

    def _dead_child(self) -> Child | None:
        for child in self.children.values():
            code = child.proc.poll()
            if code is not None and not (child.name == "trainer" and code == 0):
                return child
        return None

    def _say(self, text: str) -> None:
        print(text, file=self.progress, flush=True)

    def _fail(self, child: Child) -> int:
        self._say(f"relayrl: service {child.name} died with exit code {child.proc.returncode}; "
                  f"see {self.out / 'logs' / (child.name + '.log')}")
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
            for name in SERVICE_ORDER:
                self._start_child(name, config_path)
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
        pending = list(SERVICE_ORDER)
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
        self._say("relayrl: all services healthy (" + ", ".join(
            f"{n}={self._target(n)}" for n in SERVICE_ORDER) + ")")
        return None

    def _monitor(self) -> int:
        total = self.cfg.trainer.total_steps
        offset = 0
        while True:
            offset = self._show_progress(offset, total)
            dead = self._dead_child()
            if dead is not None:
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
        """After the services stopped: the accounting identity (relayrl.run_report.run_summary), written to
        summary.json and printed."""
        import redis

        keys = RedisKeys.from_config(self.cfg.redis)
        try:
            client = sync_client(self.cfg.redis, socket_timeout=5.0,
                                 **({"password": self.redis_password} if self.redis_password else {}))
            length = int(client.xlen(keys.stream))
            groups = {g["name"].decode() if isinstance(g["name"], bytes) else g["name"]: g
                      for g in client.xinfo_groups(keys.stream)} if length else {}
            appended = int(client.hget(keys.rollout_progress, PROGRESS_APPENDED) or 0)
            invalid = [int(v) for v in client.hvals(keys.invalid)]  # type: ignore[union-attr]
            added = entries_added(client, keys.stream, appended)
            client.close()
        except redis.exceptions.RedisError as exc:
            log.warning("could not read the stream for the run summary: %s", exc)
            return
        group = groups.get(keys.group, {})
        rows = read_rows(self.cfg.metrics_path) if self.cfg.metrics_path.exists() else []
        pending = int(group.get("pending", 0)) + int(group.get("lag", length) or 0)
        latest = latest_checkpoint(self.out / "checkpoints")
        summary = run_summary(rows, appended, length, pending, checkpoint_step(latest) if latest else 0,
                              (len(invalid), sum(invalid)), added - appended)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        after = summary["groups_after_checkpoint"]
        self._say(f"relayrl: {format_books(summary)}"
                  + (f" ({after} of them trained or dropped after the last checkpoint: a resumed run reads them "
                     "again)" if after else ""))
        if summary["trainer_time"]:
            self._say(f"relayrl: {format_time_shares(summary['trainer_time'])}")

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
        children = [self.children[n] for n in names if n in self.children]
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
