"""Every example of docs/clients.md runs against real servers (inference with its REST API, reward), as a user
would paste it: Python blocks in a fresh interpreter, bash blocks in bash with ``-euo pipefail``."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import inference_server, reward_server

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "clients.md"
BLOCKS = re.findall(r"^```(python|bash)\n(.*?)^```", DOC.read_text(), flags=re.DOTALL | re.MULTILINE)


def test_the_page_has_examples_of_each_kind() -> None:
    kinds = [k for k, _ in BLOCKS]
    assert kinds.count("python") >= 2 and kinds.count("bash") >= 2


async def _run(kind: str, code: str, env: dict[str, str]) -> tuple[int, str]:
    argv = [sys.executable, "-c", code] if kind == "python" else ["bash", "-euo", "pipefail", "-c", code]
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
    return int(proc.returncode or 0), out.decode()


@pytest.mark.parametrize(("kind", "code"), BLOCKS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(BLOCKS)])
async def test_example_runs(tiny_model_dir: Path, kind: str, code: str) -> None:
    async def go() -> tuple[int, str]:
        async with (
            inference_server(tiny_model_dir, http=True) as (target, service),
            reward_server(workers=1) as (reward_target, _),
        ):
            bin_dir = str(Path(sys.executable).parent)  # the venv's grpcurl
            env = {
                **os.environ,
                "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
                "RELAYRL_INFERENCE": target,
                "RELAYRL_INFERENCE_HTTP": f"http://127.0.0.1:{service.http_port}",  # type: ignore[attr-defined]
                "RELAYRL_REWARD": reward_target,
            }
            return await _run(kind, code, env)

    rc, out = await go()
    assert rc == 0, out
    if kind == "bash" and "grpcurl" in code:
        assert "relayrl.v1.InferenceService" in out and '"SERVING"' in out and '"score": 1' in out
    if kind == "bash" and "curl" in code and "grpcurl" not in code:
        assert "data: [DONE]" in out and '"weight_version"' in out
    if kind == "python" and "openai" in code:
        assert "response_format" in out  # the refused field is named
