"""The services rollout calls (inference, reward, trainer), each through its typed client with rollout's retry
policies."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from relayrl.client import NO_RETRY, InferenceClient, RetryPolicy, RewardClient, TrainerClient
from relayrl.client.inference_pool import InferencePool, connect_inference
from relayrl.config.tls import TlsConfig

# Generate(Batch) and ScoreBatch are safe to repeat (relayrl.client says why): a restarting server is retried briefly
# before the group counts as failed. The trainer's status is followed (WatchStatus) or polled anyway: no retry.
GENERATE_POLICY = RetryPolicy(attempts=3, backoff_s=0.5)
SCORE_POLICY = RetryPolicy(attempts=3, backoff_s=0.5)
TRAINER_STATUS_POLICY = NO_RETRY
# A tool's program runs once: a failed RunCode is a tool error the model reads, within the tool's own deadline.
RUN_CODE_POLICY = NO_RETRY
TRAINER_STATUS_TIMEOUT_S = 5.0


@dataclass
class RolloutClients:
    """The services rollout calls, each through its typed client with rollout's retry policies."""

    inference: InferenceClient | InferencePool
    reward: RewardClient
    trainer: TrainerClient

    @classmethod
    def connect(
        cls,
        inference: str | Sequence[str],
        reward: str,
        trainer: str,
        tls: TlsConfig | None = None,
        code_token: str = "",
        trainer_token: str = "",
    ) -> RolloutClients:
        """Clients of the services at these gRPC targets (host:port), over TLS when ``tls`` is on; ``inference``: one
        target, or the replicas' (relayrl.client.inference_pool spreads generation over them); ``code_token``:
        what reward's RunCode and, for a reward that runs code, its Score/ScoreBatch need (control.code_token_env),
        sent on reward calls only; ``trainer_token`` (the control token), sent on every trainer call so that its
        status calls count in the trainer's budget of calls with a credential (callers without one cannot starve
        rollout's admission)."""
        replicas = [inference] if isinstance(inference, str) else list(inference)
        return cls(
            connect_inference(replicas, tls, {"Generate": GENERATE_POLICY, "GenerateBatch": GENERATE_POLICY}),
            RewardClient(
                reward, token=code_token, policies={"ScoreBatch": SCORE_POLICY, "RunCode": RUN_CODE_POLICY}, tls=tls
            ),
            TrainerClient(
                trainer,
                timeout_s=TRAINER_STATUS_TIMEOUT_S,
                token=trainer_token,
                policies={"GetStatus": TRAINER_STATUS_POLICY},
                tls=tls,
                authenticate_all=True,
            ),
        )

    async def close(self) -> None:
        await asyncio.gather(self.inference.close(), self.reward.close(), self.trainer.close())

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
