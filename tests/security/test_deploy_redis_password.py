"""The Redis of docker compose and of the Helm chart requires a password, which is on no command line.

Each deployment's own start-up script (the compose entrypoint, the StatefulSet's command) runs here against the
real redis-server, with the arguments its file gives plus a free port, a private data folder and
`--set-proc-title no` (so /proc/<pid>/cmdline keeps the arguments redis-server was started with, instead of
the title it writes over them). The attacks: a client in the network without the password, and anyone who reads
the process list (`ps`) or the pod spec.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import yaml

from tests.conftest import REPO, free_port, wait_for_redis
from tests.deploy.chart import render, workload

pytestmark = pytest.mark.security

PASSWORD = "Zq3-pw_from.the~env+only/="  # every character the scripts accept


def _compose() -> tuple[list[str], list[str], str]:
    """(entrypoint, command, healthcheck shell line) of the compose file's redis, `$$` read as compose does."""
    service = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["redis"]
    entrypoint = [str(a).replace("$$", "$") for a in service["entrypoint"]]
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL"
    return entrypoint, [str(a) for a in service["command"]], str(test[1])


def _helm() -> tuple[list[str], list[str], str]:
    (container,) = workload(render({}), "redis")["spec"]["template"]["spec"]["containers"]
    probe = container["livenessProbe"]["exec"]["command"]
    assert probe[:2] == ["sh", "-c"]
    return list(container["command"]), list(container["args"]), str(probe[2])


DEPLOYMENTS = {"compose": _compose, "helm": _helm}


class Launched:
    def __init__(self, argv: list[str], health: str, env: dict[str, str], port: int) -> None:
        self.argv, self.health, self.env, self.port = argv, health, env, port
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        wait_for_redis(self.proc, redis.Redis(port=self.port, password=PASSWORD, socket_timeout=1.0))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def _launch(name: str, tmp_path: Path, password: str | None) -> Launched:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: scripts/ensure_system_deps.sh")
    command, args, health = DEPLOYMENTS[name]()
    port = free_port()
    env = {"PATH": os.environ["PATH"]}
    if password is not None:
        env["REDISCLI_AUTH"] = password
    args = list(args)
    for flag, value in (("--port", str(port)), ("--dir", str(tmp_path)), ("--set-proc-title", "no")):
        if flag in args:  # redis-server applies --dir as it parses it: replace, not override later
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return Launched([*command, *args], health, env, port)


@pytest.fixture(params=sorted(DEPLOYMENTS))
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Launched]:
    launched = _launch(request.param, tmp_path, PASSWORD)
    try:
        launched.wait_ready()
        yield launched
    finally:
        launched.stop()


def test_client_without_the_password_is_refused_and_with_it_is_served(server: Launched) -> None:
    anonymous = redis.Redis(port=server.port, socket_timeout=2.0)
    wrong = redis.Redis(port=server.port, password="not-" + PASSWORD, socket_timeout=2.0)
    right = redis.Redis(port=server.port, password=PASSWORD, socket_timeout=2.0)

    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.xadd("relayrl:episodes", {"forged": "1"})
    with pytest.raises(redis.exceptions.AuthenticationError):
        wrong.ping()
    assert right.ping() is True
    assert right.xlen("relayrl:episodes") == 0  # the anonymous write did not land


def test_password_is_in_no_argument_of_the_running_server(server: Launched) -> None:
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().split(b"\0")

    assert cmdline[0].endswith(b"redis-server") and cmdline[-2] == b"-"  # sh exec'd it: config from stdin
    assert not [a for a in cmdline if PASSWORD.encode() in a]
    assert PASSWORD not in " ".join(server.argv)
    assert redis.Redis(port=server.port, password=PASSWORD).config_get("requirepass") == {"requirepass": PASSWORD}


def test_data_files_are_readable_by_the_redis_user_only(server: Launched, tmp_path: Path) -> None:
    client = redis.Redis(port=server.port, password=PASSWORD)
    client.xadd("relayrl:episodes", {"group": "g1"})

    files = [p for p in tmp_path.rglob("*") if p.is_file()]

    assert files, "appendonly: the AOF is in the data folder"
    for path in [*files, *(p for p in tmp_path.rglob("*") if p.is_dir())]:
        assert path.stat().st_mode & 0o077 == 0, f"{path}: {oct(path.stat().st_mode)}"


def test_health_check_fails_without_the_password(server: Launched) -> None:
    line = (
        server.health.replace("redis-cli", f"redis-cli -p {server.port}", 1)
        if "-p " not in server.health
        else server.health.replace("-p 6379", f"-p {server.port}")
    )
    without = {"PATH": os.environ["PATH"]}

    healthy = subprocess.run(["sh", "-c", line], env=server.env, capture_output=True, timeout=10)
    anonymous = subprocess.run(["sh", "-c", line], env=without, capture_output=True, timeout=10)

    assert healthy.returncode == 0
    assert anonymous.returncode != 0  # NOAUTH is not PONG (redis-cli itself exits 0 on it)


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
@pytest.mark.parametrize("password", [None, "", 'with"quote', "with space", "back\\slash", "new\nline"])
def test_server_refuses_to_start_with_no_password_or_one_it_cannot_quote(
    name: str, password: str | None, tmp_path: Path
) -> None:
    launched = _launch(name, tmp_path, password)

    output, _ = launched.proc.communicate(timeout=15)

    assert launched.proc.returncode == 64
    assert b"redis:" in output
    if password:
        assert password.encode() not in output  # the refusal does not echo the secret
