"""The metadata a reward sees travels JSON-encoded in a string map (relayrl.common.reward_metadata): what rollout
and evaluation encode, the reward service decodes to the same values."""

from __future__ import annotations

from relayrl.common.reward_metadata import decode_metadata, encode_metadata


def test_values_of_every_json_type_decode_to_what_was_encoded() -> None:
    values = {
        "answer": "42",
        "n": 3,
        "ratio": 0.5,
        "ok": True,
        "none": None,
        "tests": ["assert f(1) == 1"],
        "task": {"dataset": "basic_arithmetic", "seed": 0, "index": 7},
    }

    encoded = encode_metadata(values)

    assert all(isinstance(v, str) for v in encoded.values())
    assert decode_metadata(encoded) == values


def test_a_value_that_is_not_json_reaches_the_reward_as_its_string() -> None:
    assert decode_metadata({"hint": "plain text, not JSON", "n": "3"}) == {"hint": "plain text, not JSON", "n": 3}
