"""The teacher of on-policy distillation (``trainer.loss.policy_loss: reverse_kl``): an inference service serving
the teacher's weights scores the student's sampled tokens (its ScoreTokens RPC: logprobs of given ids), and the trainer
turns log pi - log pi_teacher into each token's penalty (relayrl.trainer.losses.policy.reverse_kl).

Why the trainer calls the teacher, not rollout: the episode contract (the stream) stays as it is; only groups that
are trained get scored (none of those dropped as stale, invalid or zero-advantage); and the call is part of
reading a batch, which the loop already overlaps with the previous step's publication and metrics. The cost: the
teacher's forward is on the trainer's critical path when the read-ahead does not hide it (rollout-side scoring
would overlap it with generation instead).

The same call gives a reference model served by an endpoint (see docs/algorithms.md).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

from relayrl.client import InferenceClient, RetryPolicy
from relayrl.common.pb.episode_pb2 import Episode
from relayrl.config.loss import TeacherConfig
from relayrl.config.tls import TlsConfig

SCORE_POLICY = RetryPolicy(attempts=3, backoff_s=0.5)  # ScoreTokens is read-only: safe to repeat


class TeacherError(RuntimeError):
    """The teacher answered something the trainer cannot train on (wrong lengths, non-finite logprobs)."""


class Teacher:
    """Scores episodes' completion tokens on an inference endpoint, ``sequences_per_call`` per ScoreTokens call."""

    def __init__(self, cfg: TeacherConfig, tls: TlsConfig | None = None) -> None:
        self.cfg = cfg
        self.client = InferenceClient(
            cfg.address, timeout_s=cfg.timeout_s, policies={"ScoreTokens": SCORE_POLICY}, tls=tls
        )
        self.last_version = 0  # the teacher's weight version of the last answer (it may be trained meanwhile)

    async def logprobs(self, episodes: Sequence[Episode]) -> list[list[float]]:
        """The teacher's logprob of every completion token of each episode (at the episode's temperature)."""
        n = self.cfg.sequences_per_call
        chunks = [episodes[i : i + n] for i in range(0, len(episodes), n)]
        replies = await asyncio.gather(
            *(
                self.client.score(
                    [(e.prompt_token_ids, e.completion_token_ids, e.sampling_temperature or 1.0) for e in chunk],
                    self.cfg.timeout_s,
                )
                for chunk in chunks
            )
        )
        out: list[list[float]] = []
        for chunk, reply in zip(chunks, replies, strict=True):
            if len(reply.scores) != len(chunk):
                raise TeacherError(f"the teacher scored {len(reply.scores)} of {len(chunk)} sequences")
            for ep, score in zip(chunk, reply.scores, strict=True):
                lps = list(score.logprobs)
                if len(lps) != len(ep.completion_token_ids) or not all(math.isfinite(v) for v in lps):
                    raise TeacherError(
                        f"the teacher's logprobs of episode {ep.episode_id} are malformed "
                        f"({len(lps)} for {len(ep.completion_token_ids)} tokens, or not finite)"
                    )
                out.append(lps)
            self.last_version = max(self.last_version, reply.weight_version)
        return out

    async def close(self) -> None:
        await self.client.close()
