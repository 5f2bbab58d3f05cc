"""Redis needs a password: the embedded server of `relayrl run` requires one of its own (never on its command line,
never in the run's config.yaml), every client built from the ``redis`` section presents the one from
``$RELAYRL_REDIS_PASSWORD`` (over a URL's), an ACL user is honoured, and a password cannot inject config lines."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.backoff import NoBackoff
from redis.retry import Retry

from relayrl.common.redis_conn import sync_client
from relayrl.config import dump_run_config, load_run_config
from relayrl.config.redis import RedisConfig
from relayrl.config.typed import ConfigError
from relayrl.launcher import Launcher
from relayrl.local_redis import REDIS_PASSWORD_FILE
from tests.conftest import REPO
from tests.security.redis_servers import password_server

pytestmark = pytest.mark.security

PASSWORD = "a-password-only-the-services-have"
ONCE = {"socket_timeout": 2.0, "retry": Retry(NoBackoff(), 0)}  # a refusal at once (redis-py retries it by default)


@pytest.fixture
def launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Launcher:
    """A launcher of a run with the embedded Redis (no Redis URL anywhere), not started."""
    for name in ("RELAYRL_REDIS_PASSWORD", "RELAYRL_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = load_run_config(None, [f"model.path={model}", f"rollout.dataset={REPO / 'examples/data/arithmetic.jsonl'}"])
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    return Launcher(cfg, out)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_embedded_redis_refuses_a_client_without_its_password(launcher: Launcher) -> None:
    launcher._start_redis()
    try:
        anonymous = sync_client(RedisConfig(url=launcher.cfg.redis.url), **ONCE)

        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.ping()
    finally:
        assert launcher.redis is not None
        launcher.redis.stop()


def test_embedded_redis_password_reaches_services_by_environment_only(
    launcher: Launcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher._start_redis()
    try:
        assert launcher.redis is not None
        password = launcher.redis_password
        cmdline = _cmdline(launcher.redis.proc.pid)
        creds = launcher._credentials()
        dump_run_config(launcher.cfg, launcher.out / "config.yaml")
        monkeypatch.setenv("RELAYRL_REDIS_PASSWORD", creds["RELAYRL_REDIS_PASSWORD"])  # what a service sees
        service_view = load_run_config(launcher.out / "config.yaml").redis

        answered = sync_client(service_view, **ONCE).ping()
    finally:
        assert launcher.redis is not None
        launcher.redis.stop()

    assert len(password) >= 32
    assert "redis-server" in cmdline and password not in cmdline
    assert password not in (launcher.out / "config.yaml").read_text()
    assert service_view.url.startswith("redis://127.0.0.1:") and "@" not in service_view.url
    assert answered is True
    password_file = launcher.out / REDIS_PASSWORD_FILE
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600 and password_file.read_text().strip() == password


def test_embedded_redis_takes_the_callers_password_from_the_environment(
    launcher: Launcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAYRL_REDIS_PASSWORD", PASSWORD)
    launcher._start_redis()
    try:
        with_password = redis.Redis(port=launcher.redis.port if launcher.redis else 0, password=PASSWORD, **ONCE).ping()
    finally:
        assert launcher.redis is not None
        launcher.redis.stop()

    assert launcher.redis_password == PASSWORD and with_password is True


def test_password_from_the_environment_wins_over_the_one_in_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    with password_server(PASSWORD) as (port, _):
        cfg = RedisConfig(url=f"redis://:stale-password@127.0.0.1:{port}/0")
        with pytest.raises(redis.exceptions.AuthenticationError):
            sync_client(cfg, **ONCE).ping()
        monkeypatch.setenv("RELAYRL_REDIS_PASSWORD", PASSWORD)

        answered = sync_client(cfg, **ONCE).ping()

    assert answered is True


def test_url_and_password_come_from_the_environment_when_the_config_has_no_url(monkeypatch: pytest.MonkeyPatch) -> None:
    with password_server(PASSWORD) as (port, proc):
        monkeypatch.setenv("RELAYRL_REDIS_URL", f"redis://127.0.0.1:{port}/0")
        monkeypatch.setenv("RELAYRL_REDIS_PASSWORD", PASSWORD)

        answered = sync_client(RedisConfig(), **ONCE).ping()
        cmdline = _cmdline(proc.pid)

    assert answered is True
    assert PASSWORD not in cmdline


def test_an_acl_user_authenticates_with_its_own_password_and_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    with password_server(PASSWORD) as (port, _):
        admin = redis.Redis(port=port, password=PASSWORD, **ONCE)
        admin.acl_setuser(
            "rollout", enabled=True, passwords=["+rollout-secret"], keys=["relayrl:*"], commands=["+@all"]
        )
        cfg = RedisConfig(url=f"redis://127.0.0.1:{port}/0", username="rollout")
        monkeypatch.setenv("RELAYRL_REDIS_PASSWORD", PASSWORD)  # the default user's password: not rollout's
        with pytest.raises(redis.exceptions.AuthenticationError):
            sync_client(cfg, **ONCE).ping()
        monkeypatch.setenv("RELAYRL_REDIS_PASSWORD", "rollout-secret")

        client = sync_client(cfg, **ONCE)
        client.set("relayrl:probe", b"1")
        with pytest.raises(redis.exceptions.NoPermissionError):  # the ACL limits it to relayrl:* keys
            client.set("other:probe", b"1")
        who = client.acl_whoami()

    assert who == "rollout"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    password=st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40)
    | st.sampled_from(['x"\nrequirepass ""', "x\nport 1", 'a\\" b', "pass word\n"])
)
def test_any_password_is_required_exactly_and_cannot_inject_config_lines(password: str) -> None:
    with password_server(password, extra=["--maxmemory", "10mb"]) as (port, _):
        refused_empty = _refused(port, None)
        refused_other = _refused(port, password + "x")
        admin = redis.Redis(port=port, password=password, **ONCE)
        requirepass = admin.config_get("requirepass")["requirepass"]
        maxmemory = admin.config_get("maxmemory")["maxmemory"]
        listening = admin.config_get("port")["port"]

    assert refused_empty and refused_other
    assert requirepass == password
    assert maxmemory == str(10 * 1024 * 1024) and listening == str(port)


def _refused(port: int, password: str | None) -> bool:
    try:
        redis.Redis(port=port, password=password, **ONCE).ping()
    except (redis.exceptions.AuthenticationError, redis.exceptions.ResponseError):
        return True
    return False


def test_a_malformed_url_from_the_environment_is_refused_without_echoing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAYRL_REDIS_URL", f"http://user:{PASSWORD}@redis:6379")

    with pytest.raises(ConfigError) as err:
        RedisConfig().require_url()

    assert "RELAYRL_REDIS_URL" in err.value.field
    assert PASSWORD not in str(err.value)
