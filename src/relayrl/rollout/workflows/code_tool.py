"""The built-in ``python`` tool: model-written Python run in the reward service's code sandbox (RunCode), never in
rollout's process.

A tool function that declares a keyword-only parameter ``run_code`` gets a :class:`CodeRunner` from the tools
workflow (as a reward function that declares ``sandbox`` gets the reward service's sandbox): an async callable
that runs a program through the reward client's RunCode with the tool's deadline. ``run_code`` is not one of the
tool's arguments: it is left out of its JSON schema and a call that passes it is refused. The run's limits are the
reward service's (reward.code_runs, reward.sandbox); RunCode needs the code token (control.code_token_env), which
``relayrl run`` gives rollout and reward.

``python`` answers the program's stdout when it exits with status 0; anything else (an exception, a non-zero exit,
the wall-clock limit, too much output, a refused or failed call) is a :class:`CodeRunError`, which the tool set
shows to the model and counts as a tool error.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc

from relayrl.common.pb import reward_pb2

RUN_CODE = "run_code"  # the keyword-only parameter through which a tool gets the runner
MAX_STDERR_CHARS = 1500  # the tail of stderr a failed run shows (a traceback ends with its cause)


class CodeRunError(RuntimeError):
    """The program did not run to a clean exit (or could not run): the tool call failed."""


class CodeRunner:
    """Runs one program through ``reward.run_code`` (a :class:`relayrl.client.RewardClient` holding the code
    token) with the deadline ``timeout_s``; without a reward client every run fails saying so."""

    def __init__(self, reward: Any, timeout_s: float) -> None:
        self.reward = reward
        self.timeout_s = timeout_s

    async def __call__(self, code: str, stdin: str = "") -> reward_pb2.RunCodeResponse:
        if self.reward is None:
            raise CodeRunError("no reward service to run code in (this workflow was built without one)")
        try:
            response: reward_pb2.RunCodeResponse = await self.reward.run_code(
                code, stdin.encode(), timeout_s=self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise CodeRunError(f"the code sandbox did not run it ({exc.code().name}: {exc.details()})") from None
        return response


def takes_runner(fn: Callable[..., Any]) -> bool:
    """Whether the tool ``fn`` declares the keyword-only parameter ``run_code``."""
    try:
        param = inspect.signature(fn).parameters.get(RUN_CODE)
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind is inspect.Parameter.KEYWORD_ONLY


def outcome_text(response: reward_pb2.RunCodeResponse) -> str:
    """How a run ended, for the model: its stdout after a clean exit, else CodeRunError saying why."""
    stdout = response.stdout.decode(errors="replace")
    stderr = response.stderr.decode(errors="replace")[-MAX_STDERR_CHARS:]
    if response.status == reward_pb2.CODE_RUN_STATUS_EXITED and response.exit_code == 0:
        return stdout
    if response.status == reward_pb2.CODE_RUN_STATUS_EXITED:
        raise CodeRunError(f"exit code {response.exit_code}\n{stderr}".rstrip())
    why = {
        reward_pb2.CODE_RUN_STATUS_TIMEOUT: "timed out",
        reward_pb2.CODE_RUN_STATUS_OUTPUT_EXCEEDED: "wrote too much output",
    }.get(response.status, "did not run")
    raise CodeRunError(f"the program {why}: {response.error}\n{stderr}".rstrip())


async def python(code: str, *, run_code: CodeRunner) -> str:
    """Run a Python 3 program (standard library only, no network, no files kept) and return what it prints."""
    return outcome_text(await run_code(code))


python.schema = {  # type: ignore[attr-defined]
    "name": "python",
    "description": "Run a Python 3 program (standard library only, no network) in a sandbox and return its "
    "standard output. print() the values you need.",
    "parameters": {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The program."}},
        "required": ["code"],
    },
}
