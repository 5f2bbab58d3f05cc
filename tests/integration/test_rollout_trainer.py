"""rollout -> Redis -> trainer with every part real: gRPC services on port 0 and a redis-server."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.common.logging import setup_logging
from relayrl.common.metrics_row import SftRow, parse_row
from relayrl.trainer.runtime import Trainer
from tests.conftest import RedisServer
from tests.integration.helpers import inference_server
from tests.integration.stack import run_stack, stack_config

pytestmark = pytest.mark.integration

REQUIRED_METRICS = {
    "step",
    "weight_version",
    "reward_mean",
    "episodes",
    "tokens",
    "staleness_mean",
    "staleness_max",
    "time_s",
}


@pytest.mark.parametrize(("max_staleness", "sft_steps"), [(0, 0), (1, 0), (2, 2)])
async def test_episodes_flow_to_the_trainer_and_every_produced_episode_is_accounted_for(
    tmp_path: Path,
    tiny_model_dir: Path,
    dataset_path: Path,
    redis_server: RedisServer,
    max_staleness: int,
    sft_steps: int,
) -> None:
    cfg = stack_config(
        tmp_path / "run",
        tiny_model_dir,
        dataset_path,
        redis_server.url,
        f"rollout.max_staleness={max_staleness}",
        f"trainer.sft.warmup_steps={sft_steps}",
    )

    out = await run_stack(cfg, tiny_model_dir)

    rows = out["rows"]
    assert [r["sft_step"] for r in out["sft_rows"]] == list(range(1, sft_steps + 1))
    # versions come from the Redis counter: the initial weights get 1, the warm-up (if any) one more
    first_version = 2 if sft_steps else 1
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["weight_version"] for r in rows] == [first_version + i for i in (1, 2, 3, 4)]
    assert all(set(r) >= REQUIRED_METRICS for r in rows)
    # the trainer writes the typed row (relayrl.common.metrics_row): every line reads back as itself
    assert all(parse_row(r).to_json() == r for r in rows + out["sft_rows"])  # type: ignore[union-attr]
    assert all(isinstance(parse_row(r), SftRow) for r in out["sft_rows"])
    assert all(r["episodes"] == 2 * 4 for r in rows)
    assert all(r["staleness_max"] <= max_staleness for r in rows)
    assert all(sum(r["staleness_hist"].values()) == r["episodes"] for r in rows)
    assert all(
        r["queue_lag"] >= 0 and 0 <= r["queue_pending"] <= r["groups_trained"] + r["groups_dropped_stale"] for r in rows
    )
    assert out["inference_version"] == first_version + 4
    assert out["trained"] == 4 * 2  # groups
    assert rows[-1]["episodes_trained"] == 4 * 2 * 4
    # acknowledged entries are trimmed; unread and pending ones stay
    assert out["pending"] <= out["length"] < out["produced"]
    assert out["produced"] == out["trained"] + out["dropped"] + out["invalid"] + out["pending"]
    assert out["invalid"] == 0
    assert out["dropped_reward_error"] == out["episodes_reward_errors"] == 0
    assert (tmp_path / "run" / "checkpoints" / "step_000004" / "model" / "config.json").is_file()
    # the default TensorBoard backend got the same steps (x-axis) and values, warm-up steps under sft/
    tb = out["tensorboard"]
    assert [s for s, _ in tb["reward_mean"]] == [1, 2, 3, 4]
    assert [v for _, v in tb["reward_mean"]] == pytest.approx([r["reward_mean"] for r in rows], rel=1e-6, abs=1e-7)
    assert [v for _, v in tb["weight_version"]] == [float(r["weight_version"]) for r in rows]
    assert [s for s, _ in tb.get("sft/loss", [])] == list(range(1, sft_steps + 1))


async def test_the_service_trains_with_the_algorithm_registries_a_reference_model_and_packed_rows(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    cfg = stack_config(
        tmp_path / "run",
        tiny_model_dir,
        dataset_path,
        redis_server.url,
        "trainer.loss.advantage=reinforce_pp_baseline",
        "trainer.loss.policy_loss=gspo",
        "trainer.loss.loss_aggregation=sequence_mean",
        "trainer.loss.mismatch_mask=token",
        "trainer.loss.overlong_buffer_tokens=1",
        "trainer.loss.kl_coef=0.1",
        "trainer.micro_batch_layout=packed",
        "trainer.micro_batch_tokens=32",
    )

    out = await run_stack(cfg, tiny_model_dir)

    rows = out["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["ref_kl"] >= 0.0 for r in rows)  # k3 >= 0
    assert rows[0]["ref_kl"] == pytest.approx(0.0, abs=1e-6)  # step 1 trains the reference's own weights
    assert all(0.0 <= r["mismatch_masked_frac"] <= 1.0 for r in rows)
    assert out["produced"] == out["trained"] + out["dropped"] + out["invalid"] + out["pending"]


async def test_episodes_whose_scoring_failed_are_excluded_and_counted_and_their_groups_still_flow(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    cfg = stack_config(tmp_path / "run", tiny_model_dir, dataset_path, redis_server.url, "rollout.max_staleness=1")

    out = await run_stack(cfg, tiny_model_dir, "tests.reward_fns:flaky")

    rows = out["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert out["trained"] == 4 * 2
    # whole groups (prompts 1+x, 2+x) dropped and counted; partly failed groups trained on their valid episodes
    assert out["dropped_reward_error"] >= 1
    assert sum(r["reward_errors"] for r in rows) >= 1
    assert all(r["episodes"] + r["reward_errors"] == 2 * 4 for r in rows)
    assert out["produced"] == out["trained"] + out["dropped"] + out["dropped_reward_error"] + out["pending"]
    # every failed score the rollout appended is either excluded from a trained group or in a dropped group
    assert (
        out["episodes_dropped_reward_error"] == sum(r["reward_errors"] for r in rows) + 4 * out["dropped_reward_error"]
    )
    assert out["episodes_reward_errors"] >= out["episodes_dropped_reward_error"]
    assert rows[-1]["episodes_trained"] == sum(r["episodes"] for r in rows)


async def test_trainer_stops_on_a_failed_score_when_configured_to_fail(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    from relayrl.trainer.groups import RewardErrorStop

    cfg = stack_config(tmp_path / "run", tiny_model_dir, dataset_path, redis_server.url, "trainer.on_reward_error=fail")

    with pytest.raises(RewardErrorStop, match=r"status SCORE_STATUS_ERROR: ValueError: .*on_reward_error is fail"):
        await run_stack(cfg, tiny_model_dir, "tests.reward_fns:flaky")


async def test_trainer_restarted_from_an_older_checkpoint_publishes_greater_versions(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    first = await run_stack(
        stack_config(tmp_path / "a", tiny_model_dir, dataset_path, redis_server.url, "trainer.checkpoint.keep=5"),
        tiny_model_dir,
    )
    older = tmp_path / "a" / "checkpoints" / "step_000002" / "model"  # older than the last published version

    second = await run_stack(
        stack_config(tmp_path / "b", older, dataset_path, redis_server.url, "redis.stream=relayrl:episodes:b"), older
    )

    published_before = max(r["weight_version"] for r in first["rows"])
    assert min(r["weight_version"] for r in second["rows"]) > published_before
    assert second["inference_version"] > published_before


async def test_a_push_applied_but_answered_after_its_deadline_is_a_successful_publication(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inference applies the first update but answers past the trainer's deadline: the push landed, so the
    publication succeeds (verified by the same weights pushed again as a fresh version), never a stale-version
    stop."""
    from relayrl.common.weights import model_tensors
    from relayrl.inference.server import InferenceServicer
    from tests.conftest import free_port

    applied: list[int] = []
    update = InferenceServicer.UpdateWeights

    async def late(self: InferenceServicer, request_iterator: Any, context: Any) -> Any:
        response = await update(self, request_iterator, context)
        applied.append(response.version)
        if len(applied) == 1:  # swapped already; never answered: the call ends by the trainer's deadline
            await asyncio.Event().wait()  # gRPC cancels this handler once the client's deadline passes
        return response

    monkeypatch.setattr(InferenceServicer, "UpdateWeights", late)
    port, weights_port = free_port(), free_port()
    cfg = stack_config(
        tmp_path / "run",
        tiny_model_dir,
        dataset_path,
        redis_server.url,
        f"inference.server.port={port}",
        f"inference.weights_server.port={weights_port}",
        "trainer.publication.push_timeout_s=2",
    )

    async def go() -> tuple[int, int, bool, Any]:
        trainer = Trainer(cfg)
        try:
            async with inference_server(tiny_model_dir, port=port, weights_port=weights_port) as (_, inference):
                await trainer.stream.ensure_group()
                with torch.no_grad():
                    for p in trainer.model.parameters():
                        p.add_(0.01)  # the trainer's weights differ from the model on disk
                version = await trainer.publish(0)
                same = all(
                    torch.equal(v, model_tensors(trainer.model)[k])
                    for k, v in model_tensors(inference.engine.model).items()
                )
                return version, inference.engine.version, same, trainer.publication.last_push
        finally:
            await trainer.close()

    version, served, same, push = await go()

    assert served == version and same
    assert applied == [version - 1, version]  # the landed push, then the same weights again for the probe
    assert push.version == version and push.verified and push.probe_max_diff <= 1e-3


async def test_restarted_inference_gets_the_trainers_current_weights_again(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    from relayrl.common.weights import model_tensors
    from tests.conftest import free_port

    port, weights_port = free_port(), free_port()
    cfg = stack_config(
        tmp_path / "run",
        tiny_model_dir,
        dataset_path,
        redis_server.url,
        f"inference.server.port={port}",
        f"inference.weights_server.port={weights_port}",
    )

    async def go() -> tuple[int, int, bool]:
        trainer = Trainer(cfg)
        async with inference_server(tiny_model_dir, port=port, weights_port=weights_port):
            await trainer.stream.ensure_group()
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.add_(0.01)  # the trainer's weights differ from the model on disk
            await trainer.publish(0)
        async with inference_server(
            tiny_model_dir,
            port=port,  # from disk: version 0
            weights_port=weights_port,
        ) as (_, restarted):
            watchdog = asyncio.create_task(trainer.watch_inference(interval_s=0.1))
            for _ in range(100):
                if restarted.engine.version > 0:
                    break
                await asyncio.sleep(0.1)
            watchdog.cancel()
            same = all(
                torch.equal(v, model_tensors(trainer.model)[k])
                for k, v in model_tensors(restarted.engine.model).items()
            )
            served = restarted.engine.version
        await trainer.close()
        return served, trainer.publication.weight_version, same

    served, trainer_version, same = await go()

    assert served > trainer_version  # a fresh version, never a reused one
    assert same


async def test_json_logs_follow_a_group_from_rollout_through_reward_to_the_trainer_by_its_context(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    cfg = stack_config(tmp_path / "run", tiny_model_dir, dataset_path, redis_server.url, "rollout.max_staleness=4")
    root, relayrl_logger = logging.getLogger(), logging.getLogger("relayrl")
    saved, level = list(root.handlers), root.level
    log_file = tmp_path / "all.log"
    setup_logging("all", 0, "INFO", log_file=log_file, fmt="json")
    relayrl_logger.setLevel(logging.DEBUG)
    try:  # some verifier calls fail (tests.reward_fns:flaky): each failure is logged by the reward service
        await run_stack(cfg, tiny_model_dir, "tests.reward_fns:flaky")
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in saved:
            root.addHandler(handler)
        root.setLevel(level)
        relayrl_logger.setLevel(logging.NOTSET)
    lines = [json.loads(line) for line in log_file.read_text().splitlines()]

    def where(logger: str, prefix: str) -> list[dict[str, Any]]:
        return [r for r in lines if r["logger"] == logger and r["message"].startswith(prefix)]

    # rollout names each group's episodes under the group's id
    scoring = where("relayrl.rollout.workflows.single_turn", "scoring group")
    episodes_of = {r["group_id"]: r["message"].split("episodes ")[1].split(", ") for r in scoring}
    assert len(episodes_of) == len(scoring) >= 8
    # each reward failure names its episode, which belongs to a group rollout scored
    failures = [r for r in lines if r["logger"] == "relayrl.reward.server" and r["message"].startswith("verifier ")]
    group_of = {ep: g for g, eps in episodes_of.items() for ep in eps}
    assert failures and all(r["episode_id"] in group_of for r in failures)
    # the trainer trains groups by the same ids, with the same episodes (errored ones kept in the group, out of
    # the loss)
    trained = where("relayrl.trainer.loop", "trained group")
    assert trained
    for r in trained:
        assert r["message"].split("episodes: ")[1].rstrip(")").split(", ") == episodes_of[r["group_id"]]
    # weight versions: every swap in inference and every trainer step line carries the version it names
    swaps = where("relayrl.inference.native", "weights swapped to version")
    assert len(swaps) == 5 and all(r["message"].endswith(f" {r['weight_version']}") for r in swaps)
    steps = where("relayrl.trainer.loop", "step ")
    assert [r["weight_version"] for r in steps] == [int(r["message"].split()[3]) for r in steps] != []


async def test_undecodable_and_invalid_entries_are_dead_lettered_counted_and_the_books_still_balance(
    tmp_path: Path, tiny_model_dir: Path, dataset_path: Path, redis_server: RedisServer
) -> None:
    from relayrl.common.pb.episode_pb2 import Episode, EpisodeGroup
    from relayrl.common.redis_keys import STREAM_FIELD

    cfg = stack_config(tmp_path / "run", tiny_model_dir, dataset_path, redis_server.url, "rollout.max_staleness=1")
    vocab = int(json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"])
    outside = EpisodeGroup(
        group_id="forged",
        episodes=[
            Episode(
                episode_id=f"forged-{i}",
                group_id="forged",
                sample_index=i,
                group_size=4,
                prompt_token_ids=[1],
                completion_token_ids=[vocab],
                behaviour_logprobs=[-1.0],
                token_weight_versions=[0],
                loss_mask=[1],
            )
            for i in range(4)
        ],
    )
    injected = [{STREAM_FIELD: b"\xff\xff"}, {STREAM_FIELD: outside.SerializeToString()}]

    out = await run_stack(cfg, tiny_model_dir, inject=injected)

    rows = out["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # the trainer went on
    assert (out["invalid"], out["episodes_invalid"]) == (2, 4)
    assert rows[-1]["groups_invalid"] == 2 and rows[-1]["episodes_invalid"] == 4
    assert [reason.split(":")[0] for reason in out["dead_letters"]] == [
        "'group' is not an EpisodeGroup",
        "episodes[0].completion_token_ids",
    ]
    # the books: every stream entry (produced by rollout or injected) is trained, dropped, invalid or pending
    assert out["produced"] + len(injected) == (
        out["trained"] + out["dropped"] + out["dropped_reward_error"] + out["invalid"] + out["pending"]
    )
