"""The metadata a reward sees (``ScoreRequest.metadata``, a ``map<string, string>``): each value JSON-encoded by
whoever asks for a score (rollout's workflows, evaluation), decoded by the reward service. One contract, one module:
a value that is not JSON (an older or hand-written client) reaches the reward as the string it is."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def encode_metadata(values: Mapping[str, Any]) -> dict[str, str]:
    """``values`` (a dataset row's metadata, and what a workflow adds) as the request's string map."""
    return {key: json.dumps(value) for key, value in values.items()}


def decode_metadata(raw: Mapping[str, str]) -> dict[str, Any]:
    """The request's string map as the values the reward function gets."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
