"""Mutating calls need a credential: refused when none is configured, refused without it (a cross-origin form
post included), and a service that listens beyond loopback does not start without one."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from relayrl.common.control import require_credential
from relayrl.common.control_api import control_app
from relayrl.common.pb import rollout_pb2
from relayrl.config.typed import ConfigError
from tests.conftest import REPO

pytestmark = pytest.mark.security

TOKEN = "a-token-only-the-operator-has"


def _app(token: str) -> tuple[object, list[str]]:
    calls: list[str] = []

    async def pause() -> rollout_pb2.RolloutStatus:
        calls.append("pause")
        return rollout_pb2.RolloutStatus(paused=True)

    app = control_app("rollout", rollout_pb2.RolloutStatus, lambda: "", token, CollectorRegistry(), {"/pause": pause})
    return app, calls


async def _post(app: object, **kwargs: object) -> int:
    async def go() -> int:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://rollout") as client:
            return (await client.post("/pause", **kwargs)).status_code  # type: ignore[arg-type]

    return await go()


async def test_control_call_is_refused_when_no_token_is_configured() -> None:
    app, calls = _app(token="")

    assert await _post(app, headers={"Authorization": "Bearer "}) == 403
    assert calls == []


async def test_cross_origin_form_post_cannot_trigger_a_control_call() -> None:
    app, calls = _app(TOKEN)

    status = await _post(
        app,
        data={"authorization": f"Bearer {TOKEN}"},  # a form can send fields, not headers
        headers={"Origin": "http://evil.example", "Content-Type": "application/x-www-form-urlencoded"},
    )

    assert status == 401
    assert calls == []


async def test_control_call_with_the_token_is_granted() -> None:
    app, calls = _app(TOKEN)

    assert await _post(app, headers={"Authorization": f"Bearer {TOKEN}"}) == 200
    assert calls == ["pause"]


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_a_service_beyond_loopback_needs_its_credential(host: str) -> None:
    with pytest.raises(ConfigError, match="listening beyond loopback") as err:
        require_credential("", {"rollout.server.host": "127.0.0.1", "rollout.http.host": host}, "a control token")

    assert err.value.field == "rollout.http.host"
    require_credential("", {"rollout.server.host": "127.0.0.1"}, "a control token")  # loopback only: allowed
    require_credential(TOKEN, {"rollout.server.host": host}, "a control token")


def test_inference_beyond_loopback_without_a_weights_token_exits_2_before_loading_anything(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RELAYRL_WEIGHTS_TOKEN", "RELAYRL_CONTROL_TOKEN")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "serve",
            "inference",
            "examples/quickstart.yaml",
            "--set",
            "inference.server.host=0.0.0.0",
            "--set",
            f"model.path={tmp_path / 'none'}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert proc.returncode == 2
    assert "inference.server.host" in proc.stderr and "weights token" in proc.stderr


async def test_grpc_control_call_without_a_configured_token_is_permission_denied() -> None:
    from relayrl.common.control import require_token

    class _Context:
        def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
            return (("authorization", "Bearer "),)

        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise RuntimeError(code, details)

    with pytest.raises(RuntimeError) as err:
        await require_token(_Context(), "")  # type: ignore[arg-type]

    assert err.value.args[0] is grpc.StatusCode.PERMISSION_DENIED


def test_run_credentials_are_fresh_and_the_control_token_file_is_owner_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RELAYRL_WEIGHTS_TOKEN", raising=False)
    monkeypatch.delenv("RELAYRL_CONTROL_TOKEN", raising=False)
    monkeypatch.delenv("RELAYRL_CODE_TOKEN", raising=False)
    from relayrl.config import load_run_config
    from relayrl.launcher import CONTROL_TOKEN_FILE, Launcher

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = load_run_config(None, [f"model.path={model}", f"rollout.dataset={REPO / 'examples/data/arithmetic.jsonl'}"])
    launcher = Launcher(cfg, tmp_path / "run")
    (tmp_path / "run").mkdir()

    creds = launcher._credentials()

    path = tmp_path / "run" / CONTROL_TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() == creds["RELAYRL_CONTROL_TOKEN"]
    assert set(creds) == {"RELAYRL_CONTROL_TOKEN", "RELAYRL_WEIGHTS_TOKEN", "RELAYRL_CODE_TOKEN"}
    assert len(set(creds.values())) == 3 and all(len(v) >= 32 for v in creds.values())


@pytest.mark.integration
@pytest.mark.parametrize(
    ("token", "served_token", "code"),
    [
        (None, "trainer-only", grpc.StatusCode.UNAUTHENTICATED),
        ("guessed", "trainer-only", grpc.StatusCode.UNAUTHENTICATED),
        ("", "", grpc.StatusCode.PERMISSION_DENIED),  # no weights token configured: nobody may push
    ],
)
async def test_weight_update_without_the_weights_token_is_refused_and_nothing_changes(
    tiny_model_dir: Path, token: str | None, served_token: str, code: grpc.StatusCode
) -> None:
    from relayrl.common.grpc_utils import insecure_channel
    from relayrl.common.pb import inference_pb2 as pb
    from relayrl.common.pb import inference_pb2_grpc as pb_grpc
    from relayrl.common.weights import iter_update_messages
    from tests.integration.helpers import inference_server

    async def go() -> tuple[grpc.StatusCode, int, int]:
        async with inference_server(tiny_model_dir) as (_, service):
            service.weights_token = served_token
            params = {n: p.detach().clone() + 1.0 for n, p in service.engine.model.named_parameters()}
            messages = [*iter_update_messages(params, 1, 1 << 20, [])]
            sent_after_refusal = asyncio.Event()

            async def update() -> AsyncIterator[pb.WeightUpdateMessage]:
                await sent_after_refusal.wait()  # the refusal must come from the headers alone, before any data
                for m in messages:
                    yield m

            metadata = None if token is None else (("authorization", f"Bearer {token}"),)
            async with insecure_channel(service.weights_target) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pb_grpc.InferenceServiceStub(channel).UpdateWeights(update(), timeout=30, metadata=metadata)
                sent_after_refusal.set()
                status = await pb_grpc.InferenceServiceStub(channel).GetStatus(
                    pb.GetInferenceStatusRequest(), timeout=30
                )
            return err.value.code(), service.engine.version, int(status.weight_version)

    got, version, served = await go()

    assert got is code
    assert version == served == 0
