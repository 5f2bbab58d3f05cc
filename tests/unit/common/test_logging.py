"""Log lines: text by default (unchanged without context), JSON by option, context from contextvars."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from relayrl.common.logging import LogFormat, bind_log_context, log_context, records_held, setup_logging
from relayrl.config import load_run_config
from relayrl.config.typed import ConfigError

log = logging.getLogger("relayrl.test")

TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>[A-Z]+) \[reward rank=3\] relayrl\.test: "
    r"(?P<rest>.*)$"
)


Configure = Callable[[LogFormat], Callable[[], list[str]]]


@pytest.fixture
def log_lines(tmp_path: Path) -> Iterator[Configure]:
    """Configure logging for component ``reward`` rank 3 into a file; returns a reader of its lines. The root
    logger's handlers and level are restored afterwards."""
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    path = tmp_path / "logs" / "reward.log"

    def configure(fmt: LogFormat) -> Callable[[], list[str]]:
        setup_logging("reward", 3, "INFO", log_file=path, fmt=fmt)

        def read() -> list[str]:
            for handler in logging.getLogger().handlers:
                handler.flush()
            return path.read_text().splitlines()

        return read

    yield configure
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in saved:
        root.addHandler(handler)
    root.setLevel(level)


def test_text_lines_are_unchanged_without_context_and_end_with_the_context_when_set(log_lines: Configure) -> None:
    read = log_lines("text")
    log.info("plain %d", 1)
    with log_context(group_id="g1", weight_version=7):
        log.warning("in a group")
        with log_context(episode_id="e2"):
            log.info("in an episode")
    log.info("after")

    matches = [TEXT_LINE.match(line) for line in read()]
    assert all(matches), read()
    assert [(m["level"], m["rest"]) for m in matches if m] == [
        ("INFO", "plain 1"),
        ("WARNING", "in a group group=g1 version=7"),
        ("INFO", "in an episode group=g1 version=7 episode=e2"),
        ("INFO", "after"),
    ]


def test_json_lines_parse_and_carry_component_rank_level_message_and_context_only_when_set(
    log_lines: Configure,
) -> None:
    read = log_lines("json")
    log.info("plain")
    with log_context(group_id="g1", episode_id="e1", weight_version=7):
        log.warning("scored %s", "x")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")

    plain, scored, failed = (json.loads(line) for line in read())
    assert plain["component"] == "reward" and plain["rank"] == 3 and plain["level"] == "INFO"
    assert plain["message"] == "plain" and plain["logger"] == "relayrl.test"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", plain["time"])
    assert not {"group_id", "episode_id", "weight_version", "exc"} & set(plain)
    assert (scored["level"], scored["message"]) == ("WARNING", "scored x")
    assert (scored["group_id"], scored["episode_id"], scored["weight_version"]) == ("g1", "e1", 7)
    assert failed["level"] == "ERROR" and "ValueError: boom" in failed["exc"]
    assert "group_id" not in failed


async def test_context_follows_tasks_and_threads_and_a_task_binding_stays_in_its_task(log_lines: Configure) -> None:
    read = log_lines("json")

    async def episode(eid: str, delay: float) -> None:
        bind_log_context(episode_id=eid)  # as reward does: one task per episode
        await asyncio.sleep(delay)
        log.info("scored %s", eid)

    async def main() -> None:
        with log_context(weight_version=5):
            await asyncio.gather(episode("a", 0.02), episode("b", 0.0))
            await asyncio.to_thread(log.info, "in a thread")
        log.info("outside")

    await main()

    rows = [json.loads(line) for line in read()]
    assert [(r["message"], r.get("episode_id"), r.get("weight_version")) for r in rows] == [
        ("scored b", "b", 5),
        ("scored a", "a", 5),
        ("in a thread", None, 5),
        ("outside", None, None),
    ]


def test_records_held_while_loading_the_config_are_written_in_the_chosen_format(log_lines: Configure) -> None:
    with records_held():
        cfg = load_run_config(None, ["log_format=json"])
        log.warning("deprecated field")
    read = log_lines(cfg.log_format)
    log.info("started")

    assert [(r["message"], r["component"]) for r in map(json.loads, read())] == [
        ("deprecated field", "reward"),
        ("started", "reward"),
    ]


def test_records_held_are_written_to_stderr_at_once_when_loading_fails(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError), records_held():
        log.warning("deprecated field")
        load_run_config(None, ["log_format=xml"])

    assert "deprecated field" in capsys.readouterr().err
    assert not [h for h in logging.getLogger().handlers if type(h).__name__ == "_Held"]


def test_log_format_is_a_run_config_choice_defaulting_to_text() -> None:
    assert load_run_config(None).log_format == "text"
    assert load_run_config(None, ["log_format=json"]).log_format == "json"
    with pytest.raises(ConfigError, match="log_format"):
        load_run_config(None, ["log_format=xml"])
