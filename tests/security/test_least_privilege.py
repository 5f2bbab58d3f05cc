"""One table of who holds which credential (relayrl.common.credentials.HELD), followed by docker-compose.yml and the
rendered Helm chart as by `relayrl run` (whose children tests/security/test_run_exposure.py reads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from relayrl.common.credentials import HELD, Credential, service_environment, variables
from relayrl.config.control import ControlConfig
from relayrl.config.redis import RedisConfig
from tests.conftest import REPO
from tests.deploy.chart import VALUE_SETS, main_container, rendered, secret_env

pytestmark = pytest.mark.security

SERVICES = ("inference", "reward", "rollout", "trainer")
CARRIED = variables(ControlConfig(), RedisConfig())
EVERY = {name for names in CARRIED.values() for name in names}
# the Helm chart's Secret keys (templates/credentials.yaml) of each credential
SECRET_KEYS = {
    "control-token": Credential.CONTROL,
    "weights-token": Credential.WEIGHTS,
    "code-token": Credential.CODE,
    "redis-password": Credential.REDIS,
}


def _credentials_of(names: set[str]) -> set[Credential]:
    return {credential for credential, carried in CARRIED.items() if names & set(carried)}


def test_the_table_gives_each_service_what_its_calls_need_and_nothing_else() -> None:
    assert set(HELD) == set(SERVICES)
    assert [c for c in Credential if sum(c in held for held in HELD.values()) < 2] == []  # each: one checks, one calls
    assert Credential.REDIS not in HELD["reward"] | HELD["inference"]  # model-written code runs in reward


def test_compose_gives_each_service_the_credentials_of_the_table() -> None:
    compose: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    for service in SERVICES:
        environment = compose["services"][service].get("environment", {})
        assert _credentials_of(set(environment) & EVERY) == HELD[service], service


@pytest.mark.parametrize("values", VALUE_SETS)
def test_the_helm_chart_gives_each_pod_the_credentials_of_the_table(values: str) -> None:
    docs = rendered(values)
    for service in SERVICES:
        secrets = secret_env(main_container(docs, service))
        by_variable = _credentials_of(set(secrets) & EVERY)
        by_key = {SECRET_KEYS[key] for _, key in secrets.values() if key in SECRET_KEYS}
        assert by_variable == HELD[service], (values, service, sorted(secrets))
        assert by_key <= HELD[service], (values, service, sorted(secrets))


def test_a_child_environment_drops_the_callers_credentials_it_does_not_hold() -> None:
    caller = {
        "PATH": "/bin",
        "RELAYRL_CONTROL_TOKEN": "c0",
        "RELAYRL_WEIGHTS_TOKEN": "w0",
        "RELAYRL_CODE_TOKEN": "k0",
        "RELAYRL_REDIS_PASSWORD": "p0",
        "RELAYRL_REDIS_URL": "redis://r:6379/0",
    }
    run = {"RELAYRL_CONTROL_TOKEN": "c1", "RELAYRL_WEIGHTS_TOKEN": "w1", "RELAYRL_CODE_TOKEN": "k1"}

    envs = {s: service_environment(s, caller, run, ControlConfig(), RedisConfig()) for s in SERVICES}

    assert envs["reward"] == {"PATH": "/bin", "RELAYRL_CODE_TOKEN": "k1"}
    assert envs["inference"] == {"PATH": "/bin", "RELAYRL_WEIGHTS_TOKEN": "w1"}
    assert envs["rollout"] == {
        "PATH": "/bin",
        "RELAYRL_CONTROL_TOKEN": "c1",
        "RELAYRL_CODE_TOKEN": "k1",
        "RELAYRL_REDIS_PASSWORD": "p0",
        "RELAYRL_REDIS_URL": "redis://r:6379/0",
    }
    assert envs["trainer"] == {
        "PATH": "/bin",
        "RELAYRL_CONTROL_TOKEN": "c1",
        "RELAYRL_WEIGHTS_TOKEN": "w1",
        "RELAYRL_REDIS_PASSWORD": "p0",
        "RELAYRL_REDIS_URL": "redis://r:6379/0",
    }


def test_renamed_credential_variables_are_the_ones_separated() -> None:
    control = ControlConfig(token_env="MY_CONTROL", weights_token_env="MY_WEIGHTS", code_token_env="MY_CODE")
    caller = {"MY_CONTROL": "c", "MY_WEIGHTS": "w", "MY_CODE": "k", "RELAYRL_WEIGHTS_TOKEN": "unrelated"}

    env = service_environment("reward", caller, {}, control, RedisConfig(password_env="MY_REDIS"))

    assert env == {"MY_CODE": "k", "RELAYRL_WEIGHTS_TOKEN": "unrelated"}


def test_a_trainer_that_evaluates_during_the_run_holds_the_code_token_and_no_other_service_gains_one() -> None:
    run = {"RELAYRL_CONTROL_TOKEN": "c1", "RELAYRL_WEIGHTS_TOKEN": "w1", "RELAYRL_CODE_TOKEN": "k1"}

    envs = {s: service_environment(s, {}, run, ControlConfig(), RedisConfig(), in_run_eval=True) for s in SERVICES}

    assert envs["trainer"] == run  # its in-run eval scores through reward, where a code reward needs the code token
    assert envs["inference"] == {"RELAYRL_WEIGHTS_TOKEN": "w1"}
    assert envs["reward"] == {"RELAYRL_CODE_TOKEN": "k1"}


def test_the_embedded_redis_server_is_started_with_none_of_the_callers_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # redis-server overwrites its own /proc/PID/environ (its process title), so the environment it is given is what
    # a process of the same user could read from its memory: look at that one
    import subprocess

    from relayrl import local_redis

    monkeypatch.setenv("RELAYRL_WEIGHTS_TOKEN", "exported-weights-token")
    monkeypatch.setenv("RELAYRL_CODE_TOKEN", "exported-code-token")
    given: dict[str, Any] = {}
    real_popen = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> Any:
        given.update(kwargs)
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(local_redis.subprocess, "Popen", popen)
    binary = local_redis.find_redis_server("")
    server = local_redis.RedisProcess(binary, tmp_path / "redis", tmp_path / "redis.log", "pw-of-the-run")
    try:
        server.wait_ready()
    finally:
        server.stop()

    assert given.get("env") is not None  # None would be the launcher's whole environment
    assert not [name for name in given["env"] if name.startswith("RELAYRL_")]
    assert "pw-of-the-run" not in given["env"].values()  # the password reaches it on stdin only
