"""bench/episodes.py: its baseline and relayrl's single-turn episode building make the same episodes from the same
messages, and it prints the ratio."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import load_bench

episodes_bench = load_bench("episodes")


@pytest.mark.parametrize("components", [0, 2])
def test_the_baseline_and_relayrls_building_make_the_same_episodes_and_the_bench_prints_their_ratio(
    components: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    m = episodes_bench.messages(3, prompt=4, completion=2, components=components)
    argv = ["episodes.py", "--group-size", "3", "--components", str(components), "--repeats", "3"]
    monkeypatch.setattr(sys, "argv", argv)

    baseline, ours = episodes_bench.keywords(m), episodes_bench.copied(m)
    episodes_bench.main()

    assert [e.SerializeToString() for e in ours] == [e.SerializeToString() for e in baseline]
    assert [e.sample_index for e in ours] == [0, 1, 2] and len(ours[2].reward_components) == components
    out = capsys.readouterr().out
    assert f"a group of 3 single-turn episodes ({components} reward components)" in out and "ratio" in out
