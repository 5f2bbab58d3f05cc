"""relayrl.rollout.joining: concurrent groups' ScoreBatch and Generate calls joined into one call each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest

from relayrl.common.pb import inference_pb2, reward_pb2
from relayrl.rollout.joining import JoinedInference, JoinedScorer


class GatedReward:
    """A reward client whose ScoreBatch waits for ``gate`` and scores each request by its completion's length."""

    def __init__(self, fail: Exception | None = None, short: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.timeouts: list[float] = []
        self.gate = asyncio.Event()
        self.fail, self.short = fail, short

    async def score_batch(
        self, requests: Sequence[reward_pb2.ScoreRequest], timeout_s: float = 60.0
    ) -> reward_pb2.ScoreBatchResponse:
        self.batches.append([r.episode_id for r in requests])
        self.timeouts.append(timeout_s)
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        scored = [
            reward_pb2.ScoreResponse(
                episode_id=r.episode_id, score=float(len(r.completion)), status=reward_pb2.SCORE_STATUS_OK
            )
            for r in requests
        ]
        return reward_pb2.ScoreBatchResponse(responses=scored[:-1] if self.short else scored)

    async def run_code(self, code: str) -> str:
        return f"ran {code}"


def requests(group: str, n: int) -> list[reward_pb2.ScoreRequest]:
    return [reward_pb2.ScoreRequest(episode_id=f"{group}{i}", completion="x" * (i + 1)) for i in range(n)]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_calls_made_while_one_is_on_the_wire_go_out_together_and_each_caller_gets_its_own_scores() -> None:
    async def go() -> tuple[GatedReward, JoinedScorer, list[reward_pb2.ScoreBatchResponse]]:
        reward = GatedReward()
        scorer = JoinedScorer(reward, max_items=1024)
        first = asyncio.create_task(scorer.score_batch(requests("a", 2)))
        await settle()  # a's call is on the wire
        rest = [
            asyncio.create_task(scorer.score_batch(requests(g, 3), timeout_s=t)) for g, t in (("b", 7.0), ("c", 5.0))
        ]
        await settle()
        reward.gate.set()
        return reward, scorer, await asyncio.gather(first, *rest)

    reward, scorer, (a, b, c) = await go()

    assert reward.batches == [["a0", "a1"], ["b0", "b1", "b2", "c0", "c1", "c2"]]
    assert reward.timeouts == [60.0, 5.0]  # a joined call keeps the shortest deadline of its callers
    assert [r.episode_id for r in b.responses] == ["b0", "b1", "b2"]
    assert [r.score for r in c.responses] == [1.0, 2.0, 3.0]
    assert [r.episode_id for r in a.responses] == ["a0", "a1"]
    assert (scorer.joiner.calls, scorer.joiner.callers) == (2, 3)


async def test_a_caller_that_calls_again_as_soon_as_its_answer_wakes_it_is_sent_and_answered() -> None:
    # the answer wakes the caller before the finished sender's task is reaped: a call made then must not wait for it
    reward = GatedReward()
    reward.gate.set()
    scorer = JoinedScorer(reward, max_items=1024)

    async def score_twice() -> list[reward_pb2.ScoreBatchResponse]:
        return [await scorer.score_batch(requests(g, 2)) for g in "ab"]

    first, second = await asyncio.wait_for(score_twice(), timeout=10)  # the old joiner never answered the second

    assert [r.episode_id for r in first.responses] == ["a0", "a1"]
    assert [r.episode_id for r in second.responses] == ["b0", "b1"]
    assert reward.batches == [["a0", "a1"], ["b0", "b1"]]


async def test_calls_of_the_same_loop_turn_join_the_first_call() -> None:
    async def go() -> GatedReward:
        reward = GatedReward()
        reward.gate.set()
        scorer = JoinedScorer(reward, max_items=1024)
        await asyncio.gather(*(scorer.score_batch(requests(g, 2)) for g in "abcd"))
        return reward

    assert [len(b) for b in (await go()).batches] == [8]


async def test_a_joined_call_holds_at_most_max_items_but_a_larger_caller_still_goes_alone() -> None:
    async def go() -> GatedReward:
        reward = GatedReward()
        reward.gate.set()
        scorer = JoinedScorer(reward, max_items=5)
        await asyncio.gather(
            scorer.score_batch(requests("a", 3)),
            scorer.score_batch(requests("b", 3)),
            scorer.score_batch(requests("c", 7)),
            scorer.score_batch(requests("d", 2)),
        )
        return reward

    assert [len(b) for b in (await go()).batches] == [3, 3, 7, 2]


async def test_a_failed_call_fails_every_caller_in_it_and_the_next_call_still_goes_out() -> None:
    async def go() -> tuple[list[BaseException | reward_pb2.ScoreBatchResponse], reward_pb2.ScoreBatchResponse]:
        reward = GatedReward(fail=RuntimeError("reward is down"))
        reward.gate.set()
        scorer = JoinedScorer(reward, max_items=1024)
        failed = await asyncio.gather(
            scorer.score_batch(requests("a", 1)), scorer.score_batch(requests("b", 1)), return_exceptions=True
        )
        reward.fail = None
        return failed, await scorer.score_batch(requests("c", 1))

    failed, later = await go()

    assert all(isinstance(f, RuntimeError) and "reward is down" in str(f) for f in failed)
    assert [r.episode_id for r in later.responses] == ["c0"]


async def test_a_short_answer_gives_every_joined_caller_no_scores_which_its_workflow_refuses() -> None:
    async def go() -> list[reward_pb2.ScoreBatchResponse]:
        reward = GatedReward(short=True)
        reward.gate.set()
        scorer = JoinedScorer(reward, max_items=1024)
        return list(await asyncio.gather(scorer.score_batch(requests("a", 2)), scorer.score_batch(requests("b", 2))))

    assert [len(r.responses) for r in await go()] == [0, 0]


async def test_a_caller_cancelled_while_waiting_is_left_out_of_the_next_call() -> None:
    async def go() -> tuple[GatedReward, reward_pb2.ScoreBatchResponse]:
        reward = GatedReward()
        scorer = JoinedScorer(reward, max_items=1024)
        first = asyncio.create_task(scorer.score_batch(requests("a", 1)))
        await settle()
        gone = asyncio.create_task(scorer.score_batch(requests("b", 1)))
        kept = asyncio.create_task(scorer.score_batch(requests("c", 1)))
        await settle()
        gone.cancel()
        reward.gate.set()
        await first
        with pytest.raises(asyncio.CancelledError):
            await gone
        return reward, await kept

    reward, kept = await go()

    assert reward.batches == [["a0"], ["c0"]]
    assert [r.episode_id for r in kept.responses] == ["c0"]


async def test_other_client_calls_and_empty_batches_pass_through() -> None:
    async def go() -> tuple[str, int, GatedReward]:
        reward = GatedReward()
        scorer = JoinedScorer(reward, max_items=4)
        return await scorer.run_code("print(1)"), len((await scorer.score_batch([])).responses), reward

    ran, empty, reward = await go()

    assert (ran, empty, reward.batches) == ("ran print(1)", 0, [])
    with pytest.raises(ValueError, match="max_items 0 must be >= 1"):
        JoinedScorer(reward, max_items=0)


class FakeCall:
    """A server-streaming call: ``items`` as they are given, or ``error`` raised when read."""

    def __init__(self, items: AsyncIterator[Any], error: grpc.StatusCode | None = None) -> None:
        self.items, self.error, self.cancelled = items, error, False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._read()

    async def _read(self) -> AsyncIterator[Any]:
        if self.error is not None:
            raise grpc.aio.AioRpcError(self.error, grpc.aio.Metadata(), grpc.aio.Metadata(), "stream refused")
        async for item in self.items:
            yield item

    def cancel(self) -> None:
        self.cancelled = True


async def _none() -> AsyncIterator[Any]:
    return
    yield


class FakeInference:
    """An inference client: GenerateBatch answers each request with its prompt reversed (or fails with ``code``);
    Generate alone refuses the prompt "bad"; GenerateBatchStream is UNIMPLEMENTED (an inference before it)."""

    def __init__(self, code: grpc.StatusCode | None = None) -> None:
        self.code = code
        self.batches: list[list[str]] = []
        self.alone: list[str] = []
        self.streams = 0

    def generate_batch_stream(self, requests: list[inference_pb2.GenerateRequest], timeout_s: float = 120.0) -> Any:
        self.streams += 1
        return FakeCall(_none(), grpc.StatusCode.UNIMPLEMENTED)

    async def generate_batch(
        self, requests: list[inference_pb2.GenerateRequest], timeout_s: float = 120.0
    ) -> inference_pb2.GenerateBatchResponse:
        self.batches.append([r.prompt_text for r in requests])
        if self.code is not None:
            raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), "refused")
        return inference_pb2.GenerateBatchResponse(responses=[self.answer(r) for r in requests])

    async def send_generate(
        self, request: inference_pb2.GenerateRequest, timeout_s: float = 120.0
    ) -> inference_pb2.GenerateResponse:
        self.alone.append(request.prompt_text)
        if request.prompt_text == "bad":
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), "prompt too long"
            )
        return self.answer(request)

    @staticmethod
    def answer(r: inference_pb2.GenerateRequest) -> inference_pb2.GenerateResponse:
        return inference_pb2.GenerateResponse(
            request_id=r.request_id, samples=[inference_pb2.Sample(text=r.prompt_text[::-1])]
        )


SAMPLING = inference_pb2.SamplingParams(n=2, max_new_tokens=4)


async def generate_all(joined: JoinedInference, prompts: list[str]) -> list[BaseException | str]:
    got = await asyncio.gather(*(joined.generate(p, SAMPLING, request_id=p) for p in prompts), return_exceptions=True)
    return [g if isinstance(g, BaseException) else g.samples[0].text for g in got]


async def test_concurrent_generates_go_out_as_one_batch_and_each_caller_gets_its_own_response() -> None:
    fake = FakeInference()

    got = await generate_all(JoinedInference(fake, max_requests=64), ["ab", "cd", "ef"])

    assert got == ["ba", "dc", "fe"] and fake.batches == [["ab", "cd", "ef"]] and fake.alone == []
    assert fake.streams == 1  # asked for the streamed batch once (UNIMPLEMENTED), then GenerateBatch


async def test_a_batch_refused_for_one_request_is_sent_request_by_request_so_only_that_caller_fails() -> None:
    fake = FakeInference(code=grpc.StatusCode.INVALID_ARGUMENT)

    got = await generate_all(JoinedInference(fake, max_requests=64), ["ab", "bad", "ef"])

    assert got[0] == "ba" and got[2] == "fe"
    assert isinstance(got[1], grpc.aio.AioRpcError) and got[1].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fake.alone == ["ab", "bad", "ef"]


async def test_an_inference_without_generate_batch_is_called_request_by_request_from_then_on() -> None:
    fake = FakeInference(code=grpc.StatusCode.UNIMPLEMENTED)
    joined = JoinedInference(fake, max_requests=64)

    async def go() -> list[BaseException | str]:
        first = await generate_all(joined, ["ab", "cd"])
        return first + await generate_all(joined, ["ef", "gh"])

    assert await go() == ["ba", "dc", "fe", "hg"]
    assert fake.batches == [["ab", "cd"]] and not joined.batching  # asked once, then never again


async def test_other_failures_of_a_batch_fail_every_caller_in_it() -> None:
    fake = FakeInference(code=grpc.StatusCode.UNAVAILABLE)

    got = await generate_all(JoinedInference(fake, max_requests=64), ["ab", "cd"])

    assert all(isinstance(g, grpc.aio.AioRpcError) and g.code() == grpc.StatusCode.UNAVAILABLE for g in got)
    assert fake.alone == []  # as each would have failed alone: no second try outside the client's retry policy


async def test_a_lone_generate_is_sent_as_generate_and_other_calls_pass_through() -> None:
    fake = FakeInference()
    joined = JoinedInference(fake, max_requests=64)

    assert await generate_all(joined, ["ab"]) == ["ba"] and fake.batches == [] and fake.alone == ["ab"]
    assert joined.answer is fake.answer  # anything else is the wrapped client's


async def test_joined_generates_carry_at_most_max_samples_samples_and_max_requests_requests_a_batch() -> None:
    fake = FakeInference()  # SAMPLING asks n=2 a request
    prompts = [f"p{i}" for i in range(9)]

    got = await generate_all(JoinedInference(fake, max_requests=3, max_samples=5), prompts)

    assert got == [p[::-1] for p in prompts]
    assert [len(b) for b in fake.batches] == [2, 2, 2, 2] and fake.alone == ["p8"]  # 2 x n=2 <= 5 < 3 x n=2
    fake = FakeInference()
    await generate_all(JoinedInference(fake, max_requests=3, max_samples=100), prompts)
    assert [len(b) for b in fake.batches] == [3, 3, 3]


async def test_a_batch_refused_as_too_large_is_sent_request_by_request() -> None:
    fake = FakeInference(code=grpc.StatusCode.RESOURCE_EXHAUSTED)

    got = await generate_all(JoinedInference(fake, max_requests=64), ["ab", "cd"])

    assert got == ["ba", "dc"] and fake.alone == ["ab", "cd"]


class StreamingInference(FakeInference):
    """GenerateBatchStream answers each request as its gate opens (``gates[prompt]``; ungated ones at once), then
    fails with ``fail_after`` if set."""

    def __init__(self, gates: dict[str, asyncio.Event], fail_after: grpc.StatusCode | None = None) -> None:
        super().__init__()
        self.gates, self.fail_after = gates, fail_after
        self.calls: list[FakeCall] = []

    def generate_batch_stream(self, requests: list[inference_pb2.GenerateRequest], timeout_s: float = 120.0) -> Any:
        self.batches.append([r.prompt_text for r in requests])

        async def items() -> AsyncIterator[inference_pb2.GenerateBatchItem]:
            for i, r in sorted(enumerate(requests), key=lambda ir: ir[1].prompt_text in self.gates):
                if r.prompt_text in self.gates:
                    await self.gates[r.prompt_text].wait()
                    if self.fail_after is not None:
                        raise grpc.aio.AioRpcError(self.fail_after, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
                yield inference_pb2.GenerateBatchItem(index=i, response=self.answer(r))

        call = FakeCall(items())
        self.calls.append(call)
        return call


async def test_a_streamed_batch_hands_each_caller_its_answer_as_it_arrives_without_waiting_for_the_rest() -> None:
    slow = asyncio.Event()
    fake = StreamingInference({"cd": slow})
    joined = JoinedInference(fake, max_requests=64)
    tasks = [asyncio.create_task(joined.generate(p, SAMPLING, request_id=p)) for p in ("ab", "cd", "ef")]

    done, pending = await asyncio.wait(tasks, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
    while len(done) < 2 and pending:  # "ab" and "ef" answer while "cd" is held
        more, pending = await asyncio.wait(pending, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
        done |= more
    assert {t.result().samples[0].text for t in done} == {"ba", "fe"} and pending == {tasks[1]}
    slow.set()
    assert (await tasks[1]).samples[0].text == "dc"
    assert fake.batches == [["ab", "cd", "ef"]] and fake.alone == [] and fake.calls[0].cancelled


async def test_a_streamed_batch_that_fails_after_some_answers_fails_only_the_callers_not_answered_yet() -> None:
    gone = asyncio.Event()
    gone.set()
    fake = StreamingInference({"cd": gone}, fail_after=grpc.StatusCode.UNAVAILABLE)

    got = await generate_all(JoinedInference(fake, max_requests=64), ["ab", "cd", "ef"])

    assert got[0] == "ba" and got[2] == "fe"  # answered before the call failed: theirs stand
    assert (
        isinstance(got[1], grpc.aio.AioRpcError) and got[1].code() == grpc.StatusCode.UNAVAILABLE
    )  # a pool fails over


@pytest.mark.parametrize("in_flight", [1, 2])
async def test_a_call_made_while_a_batch_is_on_the_wire_goes_at_once_only_while_calls_in_flight_allow(
    in_flight: int,
) -> None:
    held = asyncio.Event()
    fake = StreamingInference({"ab": held, "cd": held})
    joined = JoinedInference(fake, max_requests=64, max_in_flight=in_flight)
    first = [asyncio.create_task(joined.generate(p, SAMPLING, request_id=p)) for p in ("ab", "cd")]
    while not fake.batches:  # the first batch is on the wire, held
        await asyncio.sleep(0)
    late = asyncio.create_task(joined.generate("ef", SAMPLING, request_id="ef"))
    for _ in range(10):  # let every task run that can
        await asyncio.sleep(0)

    assert late.done() == (in_flight == 2)  # a second call of its own, or waiting for the first to end
    held.set()
    assert [t.samples[0].text for t in await asyncio.gather(*first, late)] == ["ba", "dc", "fe"]
