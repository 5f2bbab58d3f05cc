"""Server-sent events of OpenAI's streamed completions, shared by both OpenAI-compatible endpoints (inference's
REST API and rollout's agent session endpoint): each chunk is one ``data: {json}`` event, and ``data: [DONE]``
ends the stream."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"


def sse(chunk: dict[str, Any]) -> str:
    """One event carrying ``chunk`` as JSON."""
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
