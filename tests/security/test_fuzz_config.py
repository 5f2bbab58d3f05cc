"""Property tests of the config loader: whatever a file or an override holds, the answer is a valid config or a
ConfigError that names a field, never another exception (a traceback), and never a secret's value."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, get_type_hints

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from relayrl.config.run import RunConfig, load_run_config
from relayrl.config.typed import ConfigError, from_dict

pytestmark = pytest.mark.security

MARKER = "S3CRET-do-not-print"
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["0", "1e9", "-1", "native", "grpc_stream", "bwrap", ".inf", "redis://x:1/0", "a\x00b"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def _sections(cls: type) -> st.SearchStrategy[dict[str, Any]]:
    """Mappings over the real field names of ``cls`` (so that the fuzzing reaches nested sections and their
    validate hooks), with arbitrary values, secret values set to MARKER, and sometimes an unknown key."""
    hints = get_type_hints(cls)
    entries: dict[str, st.SearchStrategy[Any]] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            entries[f.name] = st.deferred(lambda tp=tp: _sections(tp)) | values
        elif f.metadata.get("secret") is True:
            entries[f.name] = st.just(MARKER)
        else:
            entries[f.name] = values
    known = st.fixed_dictionaries({}, optional=entries)
    unknown = st.dictionaries(st.text(min_size=1, max_size=8), st.just(MARKER), max_size=1)
    return st.tuples(known, unknown).map(lambda kv: {**kv[1], **kv[0]})


def _floats(obj: Any) -> list[float]:
    out: list[float] = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        out.extend(_floats(v) if dataclasses.is_dataclass(v) else [v] if isinstance(v, float) else [])
    return out


@SETTINGS
@given(data=_sections(RunConfig))
def test_any_config_mapping_gives_a_valid_config_or_a_config_error_without_secrets(data: dict[str, Any]) -> None:
    try:
        cfg = from_dict(RunConfig, data)
    except ConfigError as exc:
        assert MARKER not in str(exc)
        assert exc.field
        return
    assert all(math.isfinite(x) for x in _floats(cfg))


@SETTINGS
@given(
    text=st.text(max_size=200)
    | st.sampled_from(
        [
            "a: [1",
            "trainer: {lr: .nan}",
            "{",
            "- 1",
            "x: !!python/object/apply:os.system ['touch pwned']",
            "?",
            "trainer: {1: 2}",
        ]
    )
)
def test_any_config_file_text_gives_a_valid_config_or_a_config_error(
    tmp_path_factory: pytest.TempPathFactory, text: str
) -> None:
    path = Path(tmp_path_factory.mktemp("cfg")) / "run.yaml"
    path.write_text(text)

    try:
        load_run_config(path)
    except ConfigError as exc:
        assert exc.field


@SETTINGS
@given(
    override=st.text(max_size=60)
    | st.builds(
        lambda k, v: f"{k}={v}",
        st.sampled_from(
            ["trainer.total_steps", "control.token", "redis", "a..b", "inference.server.port", "trainer.optimizer.lr"]
        ),
        st.text(max_size=20),
    )
)
@example(override="conf")  # in the fixed wording `invalid config`, shown by no one (a CI failure before _echoes)
def test_any_command_line_override_gives_a_valid_config_or_a_config_error(override: str) -> None:
    try:
        load_run_config(None, [override])
    except ConfigError as exc:
        assert exc.field
        key, _, value = override.partition("=")
        if key.strip() == "control.token" or "=" not in override:  # a secret, or text that may hold one
            assert not _echoes(override, value or key, str(exc))


def _echoes(override: str, secret: str, message: str) -> bool:
    """Whether ``message`` shows ``secret``: it holds the text (4 characters or more), and the same override with
    other text in its place gives another message. Hypothesis draws text from the code's own string constants, so
    a secret such as ``conf`` may be part of the fixed wording (``invalid config``) without being shown."""
    if len(secret) < 4 or secret not in message:
        return False
    try:
        load_run_config(None, [override.replace(secret, "\u2603" * len(secret))])
    except ConfigError as other:
        return str(other) != message
    return True
