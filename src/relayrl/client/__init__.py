"""Typed Python clients of relayrl's services: what the CLI uses and how services call one another.

Every call has a deadline (per attempt: ``timeout_s`` of the call, else the client's) and a retry policy
(:class:`RetryPolicy`) chosen per method. By default only UNAVAILABLE (the server was not reached, or is
restarting) is retried, with exponential back-off; DEADLINE_EXCEEDED never is (the budget is spent and the server
may still be working on the call). Retrying is safe for every unary method relayrl has; the handlers show why:

- GetStatus, GetConfig: read-only. (WatchStatus, a stream, is read-only too; its caller re-subscribes.)
- Generate: no server-side state; a repeated call only samples again, and the caller uses one reply (its
  samples carry the weight versions that produced them, so an answer from either attempt is as good).
- GenerateBatch: several Generates in one call, each as above.
- ScoreTokens (inference): read-only, like Generate without sampling.
- Score, ScoreBatch: verifiers are pure functions of the request; only the service's counters see a repeat.
- Pause, Resume, RequestCheckpoint: set a state (paused or not, a checkpoint after the next step), so a repeat
  has the same effect as one call.

A client's default policy comes from ``retries`` and ``backoff_s``; ``policies`` overrides it per RPC name
(``{"Generate": RetryPolicy(attempts=3)}``, ``{"GetStatus": NO_RETRY}``). Mutating control calls send the
bearer token (``authorization`` metadata) when one is given (every call, with ``authenticate_all``: the server
then admits them in its budget of calls with a credential). With ``tls`` (the run config's ``tls`` section) the
channel is TLS, verifying the server against its CA and presenting its client certificate (mutual TLS).

    async with TrainerClient("localhost:50054", token="...") as trainer:
        status = await trainer.status()
        await trainer.request_checkpoint("before the upgrade")

One module per client, all re-exported here: ``relayrl.client.base`` (:class:`RetryPolicy`, ``NO_RETRY``,
:class:`ServiceClient`, the channel, deadline and retries every client shares), ``relayrl.client.inference``
(:class:`InferenceClient`, :func:`generate_request`, and the weight push's deadline), ``relayrl.client.reward``
(:class:`RewardClient`), ``relayrl.client.rollout`` (:class:`RolloutClient`) and ``relayrl.client.trainer``
(:class:`TrainerClient`). ``relayrl.client.evaluation`` evaluates a model through the inference and reward clients.
"""

from __future__ import annotations

from relayrl.client.base import NO_RETRY, RetryPolicy, ServiceClient
from relayrl.client.inference import InferenceClient, generate_request
from relayrl.client.reward import RewardClient
from relayrl.client.rollout import RolloutClient
from relayrl.client.trainer import TrainerClient

__all__ = [
    "NO_RETRY",
    "InferenceClient",
    "RetryPolicy",
    "RewardClient",
    "RolloutClient",
    "ServiceClient",
    "TrainerClient",
    "generate_request",
]
