"""Which service holds which credential: the one table `relayrl run`, docker-compose.yml and the Helm chart follow.

A service holds only the credentials its own calls need, so a compromised service (reward runs model-written
code) cannot use the others': inference checks the weights token; the trainer presents it (UpdateWeights), checks
the control token and reads Redis; rollout checks the control token, presents the code token (RunCode) and writes
Redis; reward checks the code token. A trainer that evaluates during the run also presents the code token
(its evaluation scores through reward). tests/security/test_least_privilege.py checks the launcher's children, the
compose file and the rendered chart against :data:`HELD`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType

from relayrl.config.control import ControlConfig
from relayrl.config.redis import RedisConfig


class Credential(StrEnum):
    CONTROL = "control"  # control.token_env: mutating control calls (pause/resume, checkpoint)
    WEIGHTS = "weights"  # control.weights_token_env: UpdateWeights (trainer -> inference)
    CODE = "code"  # control.code_token_env: RunCode (rollout -> reward)
    REDIS = "redis"  # redis.password_env and redis.url_env (a URL may hold a password)


HELD: Mapping[str, frozenset[Credential]] = MappingProxyType(
    {
        "inference": frozenset({Credential.WEIGHTS}),
        "reward": frozenset({Credential.CODE}),
        "rollout": frozenset({Credential.CONTROL, Credential.CODE, Credential.REDIS}),
        "trainer": frozenset({Credential.CONTROL, Credential.WEIGHTS, Credential.REDIS}),
    }
)


def held(service: str, in_run_eval: bool = False) -> frozenset[Credential]:
    """What ``service`` holds: :data:`HELD`, plus the code token for a trainer that evaluates during the run
    (``trainer.eval.every_steps > 0``): its evaluation scores through reward, where a reward that runs code needs
    the code token like rollout's scoring does."""
    if service == "trainer" and in_run_eval:
        return HELD[service] | {Credential.CODE}
    return HELD[service]


def variables(control: ControlConfig, redis: RedisConfig) -> dict[Credential, tuple[str, ...]]:
    """The environment variables that carry each credential in this config."""
    return {
        Credential.CONTROL: (control.token_env,),
        Credential.WEIGHTS: (control.weights_token_env,),
        Credential.CODE: (control.code_token_env,),
        Credential.REDIS: tuple(v for v in (redis.password_env, redis.url_env) if v),
    }


def service_environment(
    service: str,
    base: Mapping[str, str],
    values: Mapping[str, str],
    control: ControlConfig,
    redis: RedisConfig,
    in_run_eval: bool = False,
) -> dict[str, str]:
    """``base`` (the caller's environment) without any credential variable that ``service`` does not hold, plus
    those of ``values`` (variable -> value: the run's credentials) that it holds. A credential variable of the
    caller's that ``service`` holds and ``values`` lacks stays (e.g. an external Redis's $RELAYRL_REDIS_URL)."""
    carried = variables(control, redis)
    holds = {name for credential in held(service, in_run_eval) for name in carried[credential]}
    every = {name for names in carried.values() for name in names}
    env = {name: value for name, value in base.items() if name not in every or name in holds}
    env.update({name: value for name, value in values.items() if name in holds})
    return env
