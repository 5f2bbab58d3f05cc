"""The agent proxy's refusals: an unknown session, a body over rollout.agent.max_body_mib, malformed or
unsupported requests, each refused before anything reaches inference (no inference runs here), and session ids
never echoed."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.common.model import load_tokenizer
from relayrl.config.agents import AgentConfig
from relayrl.rollout.workflows.agent_proxy import Sampling
from relayrl.rollout.workflows.agent_session import Session

pytestmark = [pytest.mark.security, pytest.mark.integration]
SAMPLING = Sampling(temperature=0.9, generate_timeout_s=30)


async def test_proxy_refuses_unknown_sessions_oversized_bodies_and_unsupported_requests(chat_model_dir: Path) -> None:
    import httpx

    from relayrl.rollout.workflows.agent_chat import Renderer
    from relayrl.rollout.workflows.agent_proxy import SessionProxy
    from relayrl.rollout.workflows.agent_session import SessionLimits

    proxy = SessionProxy(AgentConfig(max_body_mib=1), Renderer(load_tokenizer(chat_model_dir)), SAMPLING)
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    async def go() -> dict[str, tuple[int, str]]:
        await proxy.start()
        try:
            session = Session(SessionLimits(4, 4, 16, 16), 60)
            _, url = proxy.open(session, None, "g")  # no inference: every request below is refused before it
            unknown = url.rsplit("/sessions/", 1)[0] + "/sessions/not-a-session/v1"
            async with httpx.AsyncClient(timeout=10) as http:
                cases = {
                    "unknown": await http.post(f"{unknown}/chat/completions", json=ok),
                    "too_large": await http.post(
                        f"{url}/chat/completions",
                        content=b"x" * (1024 * 1024 + 1),
                        headers={"content-type": "application/json"},
                    ),
                    "not_json": await http.post(f"{url}/chat/completions", content=b"{nope"),
                    "n": await http.post(f"{url}/chat/completions", json={**ok, "n": 2}),
                    "stream": await http.post(
                        f"{url}/chat/completions",  # stream_options need stream=true
                        json={**ok, "stream_options": {"include_usage": True}},
                    ),
                    "completion_n": await http.post(f"{url}/completions", json={"prompt": "hi", "n": 2}),
                    "completion_echo": await http.post(f"{url}/completions", json={"prompt": "hi", "echo": True}),
                    "unsupported": await http.post(f"{url}/chat/completions", json={**ok, "logit_bias": {"1": 5}}),
                    "tools": await http.post(
                        f"{url}/chat/completions",
                        json={  # this template renders no tools
                            **ok,
                            "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}],
                        },
                    ),
                    "models": await http.get(f"{url}/models"),
                }
            return {k: (r.status_code, r.text) for k, r in cases.items()}
        finally:
            await proxy.stop()

    got = await go()

    assert got["unknown"][0] == 404 and "session_not_found" in got["unknown"][1]
    assert "not-a-session" not in got["unknown"][1]  # ids are never echoed
    assert got["too_large"][0] == 413
    assert {
        got[k][0] for k in ("not_json", "n", "stream", "unsupported", "tools", "completion_n", "completion_echo")
    } == {400}
    assert "logit_bias" in got["unsupported"][1]
    assert got["models"][0] == 200
