"""RunCode over real gRPC: a program run in the reward service's code sandbox for a rollout tool, with its output,
exit status and kills reported, requests over a limit refused before anything runs, and the code token required;
then the ``tools`` workflow calling the built-in ``python`` tool through it, end to end."""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable

import grpc
import httpx
import pytest

from relayrl.client import RewardClient
from relayrl.common.dataset import Prompt
from relayrl.common.pb import reward_pb2 as pb
from relayrl.config.reward import CodeRunsConfig, SandboxConfig
from relayrl.config.rollout import RolloutConfig, ToolFormat
from relayrl.reward.server import RewardServicer
from relayrl.rollout.workflows.api import WorkflowContext
from relayrl.rollout.workflows.loader import build_workflow
from tests.integration.helpers import reward_http, reward_server
from tests.unit.rollout.test_workflows import ScriptedModel, ids

pytestmark = pytest.mark.integration

TOKEN = "c" * 32
SANDBOX = SandboxConfig(wall_timeout_s=2.0, total_timeout_s=2.0, max_output_bytes=4096)
LIMITS = CodeRunsConfig(wall_timeout_s=2.0, max_code_bytes=1024, max_stdin_bytes=64)


async def _with_reward(test: Callable[[RewardClient, RewardServicer], Awaitable[None]], token: str = TOKEN) -> None:
    async def go() -> None:
        async with (
            reward_server(
                "relayrl.tasks.calculator:reward",
                code_token=TOKEN,
                workers=1,
                timeout_s=5.0,
                sandbox=SANDBOX,
                code_runs=LIMITS,
            ) as (target, servicer),
            RewardClient(target, token=token, retries=0) as client,
        ):
            await test(client, servicer)

    await go()


async def test_run_code_returns_stdout_stderr_and_exit_status_from_inside_the_sandbox() -> None:
    os.environ["RELAYRL_TEST_SECRET"] = "not for the program"  # the service's environment, never the program's
    program = (
        "import os, sys\nprint(int(sys.stdin.read()) * 2)\nprint(os.getuid(), os.environ.get("
        "'RELAYRL_TEST_SECRET'))\nsys.stderr.write('warn')\nsys.exit(3)\n"
    )

    async def test(client: RewardClient, servicer: RewardServicer) -> None:
        response = await client.run_code(program, b"21", timeout_s=10)

        assert response.status == pb.CODE_RUN_STATUS_EXITED, response.error
        assert response.exit_code == 3
        doubled, ids_line = response.stdout.decode().splitlines()
        assert doubled == "42"
        uid, secret = ids_line.split()
        assert int(uid) != 0 and secret == "None"  # an unprivileged uid, and a scrubbed environment
        assert response.stderr == b"warn"
        assert servicer.metrics.code_runs.labels("exited")._value.get() == 1

    try:
        await _with_reward(test)
    finally:
        del os.environ["RELAYRL_TEST_SECRET"]


async def test_run_code_past_its_wall_time_or_output_cap_is_killed_and_says_so() -> None:
    async def test(client: RewardClient, servicer: RewardServicer) -> None:
        t0 = time.monotonic()
        looped = await client.run_code("while True:\n    pass\n", timeout_s=10, run_timeout_s=0.5)
        looped_s = time.monotonic() - t0
        flooded = await client.run_code("while True:\n    print('x' * 1000)\n", timeout_s=10)
        greedy = await client.run_code("b = bytearray(300 * 1024 * 1024)\n", timeout_s=10, memory_mb=128)

        assert looped.status == pb.CODE_RUN_STATUS_TIMEOUT and "wall-clock" in looped.error
        assert looped_s < 4.0  # killed at its own 0.5 s, not at the service's 2 s default or the pool's 5 s
        assert flooded.status == pb.CODE_RUN_STATUS_OUTPUT_EXCEEDED
        assert 0 < len(flooded.stdout) <= SANDBOX.max_output_bytes
        assert greedy.status == pb.CODE_RUN_STATUS_EXITED and greedy.exit_code != 0
        assert b"MemoryError" in greedy.stderr  # 300 MiB past its 128 MiB address-space limit
        assert servicer.metrics.code_runs.labels("timeout")._value.get() == 1
        assert sum(servicer.pool.restarts.values()) == 0  # the sandbox killed them, not the pool

    await _with_reward(test)


@pytest.mark.parametrize(
    ("code", "stdin", "run_timeout_s", "memory_mb", "limit"),
    [
        ("x" * 1025, b"", 0.0, 0, "max_code_bytes=1024"),
        ("print(1)", b"1" * 65, 0.0, 0, "max_stdin_bytes=64"),
        ("print(1)", b"", 2.5, 0, "wall_timeout_s=2"),
        ("print(1)", b"", 0.0, 513, "memory_mb=512"),
    ],
    ids=["code", "stdin", "wall-time", "memory"],
)
async def test_run_code_over_a_limit_is_resource_exhausted_before_anything_runs(
    code: str, stdin: bytes, run_timeout_s: float, memory_mb: int, limit: str
) -> None:
    async def test(client: RewardClient, servicer: RewardServicer) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.run_code(code, stdin, timeout_s=10, run_timeout_s=run_timeout_s, memory_mb=memory_mb)

        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert limit in (info.value.details() or "")
        assert servicer.metrics.code_runs.labels("refused")._value.get() == 1
        assert sum(servicer.metrics.code_runs.labels(s)._value.get() for s in ("exited", "timeout", "error")) == 0

    await _with_reward(test)


@pytest.mark.parametrize(
    ("server_token", "client_token", "code"),
    [
        ("", TOKEN, grpc.StatusCode.PERMISSION_DENIED),
        (TOKEN, "", grpc.StatusCode.UNAUTHENTICATED),
        (TOKEN, "wrong" * 8, grpc.StatusCode.UNAUTHENTICATED),
    ],
    ids=["service-without-token", "no-token", "wrong-token"],
)
async def test_run_code_without_the_code_token_is_refused(
    server_token: str, client_token: str, code: grpc.StatusCode
) -> None:
    async def go() -> None:
        async with (
            reward_server(code_token=server_token, workers=1) as (target, _),
            RewardClient(target, token=client_token, retries=0) as client,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.run_code("print(1)", timeout_s=10)

            assert info.value.code() == code
            assert TOKEN not in (info.value.details() or "")

    await go()


async def test_run_code_over_rest_runs_in_the_sandbox_with_the_code_token_and_refuses_without_it_or_over_a_limit() -> (
    None
):
    async def go() -> dict[str, httpx.Response]:
        async with (
            reward_server(
                "relayrl.tasks.calculator:reward",
                code_token=TOKEN,
                workers=1,
                timeout_s=5.0,
                sandbox=SANDBOX,
                code_runs=LIMITS,
            ) as (_, servicer),
            reward_http(servicer) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            auth = {"authorization": f"Bearer {TOKEN}"}
            body = {"code": "import sys\nprint(int(sys.stdin.read()) + 1)\nsys.exit(2)\n", "stdin": "41"}
            answers = {
                "ran": await client.post("/run_code", json=body, headers=auth),
                "no-token": await client.post("/run_code", json=body),
                "wrong-token": await client.post("/run_code", json=body, headers={"authorization": "Bearer x" * 4}),
                "stdin-over": await client.post("/run_code", json={**body, "stdin": "1" * 65}, headers=auth),
                "negative-time": await client.post("/run_code", json={**body, "timeout_s": -1}, headers=auth),
            }
            assert servicer.metrics.code_runs.labels("exited")._value.get() == 1  # only the first one ran
            assert servicer.metrics.code_runs.labels("refused")._value.get() == 2
            return answers

    answers = await go()

    ran = answers["ran"]
    assert ran.status_code == 200, ran.text
    assert ran.json() | {"wall_s": 0} == {
        "status": "exited",
        "exit_code": 2,
        "stdout": "42\n",
        "stderr": "",
        "wall_s": 0,
        "error": "",
    }
    assert answers["no-token"].status_code == answers["wrong-token"].status_code == 401
    assert TOKEN not in answers["no-token"].text
    assert answers["stdin-over"].status_code == 413 and "max_stdin_bytes=64" in answers["stdin-over"].text
    assert answers["negative-time"].status_code == 400


async def test_run_code_over_rest_is_403_when_the_service_has_no_code_token() -> None:
    async def go() -> httpx.Response:
        async with (
            reward_server(workers=1) as (_, servicer),
            reward_http(servicer) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            return await client.post(
                "/run_code", json={"code": "print(1)"}, headers={"authorization": f"Bearer {TOKEN}"}
            )

    assert (await go()).status_code == 403


async def test_tools_workflow_runs_the_python_tool_in_the_reward_sandbox_and_counts_its_failures() -> None:
    turns = ["<python>print(1/0)</python>", "<python>print(12+35)</python>", "47"]
    cfg = RolloutConfig(
        workflow="tools",
        tools=["python"],
        tool_format=ToolFormat.TAGGED,
        max_new_tokens=40,
        max_episode_tokens=400,
        max_turns=4,
        group_size=1,
        tool_timeout_s=10.0,
    )
    cfg.validate()
    model = ScriptedModel(turns)

    async def test(client: RewardClient, servicer: RewardServicer) -> None:
        workflow, env = build_workflow(cfg, reward=client)
        ctx = WorkflowContext(
            inference=model,
            reward=client,
            group_id="g",
            group_size=1,
            producer_id="test",
            created_at=time.time(),
            config=cfg,
            environment=env,
        )
        (episode,) = await workflow(Prompt("p", "12+35=", "47"), ctx)  # type: ignore[arg-type]

        assert (episode.turns, episode.tool_calls, episode.tool_errors) == (3, 2, 1)
        text = episode.completion_text
        assert "<r>error: CodeRunError: exit code 1" in text and "ZeroDivisionError" in text
        assert "<python>print(12+35)</python><r>47\n</r>47" in text
        # the tool's output went into the sequence as observation tokens (loss mask 0)
        obs = ids("<r>47\n</r>")
        at = next(
            i
            for i in range(len(episode.completion_token_ids))
            if list(episode.completion_token_ids[i : i + len(obs)]) == obs
        )
        assert list(episode.loss_mask[at : at + len(obs)]) == [0] * len(obs)
        assert episode.reward_status == pb.SCORE_STATUS_OK  # the answer scored by the same reward service
        assert episode.reward_components["exact"] == 1.0
        assert servicer.metrics.code_runs.labels("exited")._value.get() == 2

    await _with_reward(test)
