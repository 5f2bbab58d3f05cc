"""What the verifier pool and its verifier processes say to each other, and the one scoring status.

Messages are small frozen dataclasses, pickled over each verifier process's duplex pipe:

- verifier -> pool: :class:`Ready` once the reward is imported, or :class:`InitError` if it cannot be;
  :class:`Results` for a :class:`Batch`, in order, possibly in several messages (see verifier_process.py);
- pool -> verifier: :class:`Batch` (a job of inputs), :class:`Stop`.

:class:`Status` is the status of one scored request everywhere in the service: the pool's outcomes, the gRPC
``ScoreStatus`` (:attr:`Status.pb`), the REST ``status`` string (its value) and the metrics' label.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeAlias

from relayrl.common.pb import reward_pb2 as pb
from relayrl.reward.api import RewardInput, RewardResult
from relayrl.reward.sandbox_exec import SandboxRun


class Status(StrEnum):
    """The status of one scored request; its value is the REST ``status`` and the metrics label."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"

    @property
    def pb(self) -> pb.ScoreStatus:
        """The gRPC ``ScoreStatus`` of this status."""
        return _PB_STATUS[self]


_STATUS_BY_VALUE = {s.value: s for s in Status}
_PB_STATUS: dict[Status, pb.ScoreStatus] = {
    Status.OK: pb.SCORE_STATUS_OK,
    Status.ERROR: pb.SCORE_STATUS_ERROR,
    Status.TIMEOUT: pb.SCORE_STATUS_TIMEOUT,
}


@dataclass(frozen=True)
class CodeRun:
    """A job of RunCode: run ``code`` (Python) in the verifier process's sandbox, limits already checked."""

    code: str
    stdin: bytes
    wall_timeout_s: float
    memory_mb: int


Job: TypeAlias = RewardInput | CodeRun  # what the pool queues: a completion to score, or a program to run


@dataclass(frozen=True)
class Outcome:
    """The result of one request: a score (OK) or an explicit failure (ERROR / TIMEOUT) with a message. For a
    :class:`CodeRun`, OK means it ran: ``ran`` says how (exit code, output, whether it was killed)."""

    status: Status
    result: RewardResult | None = None
    error: str = ""
    seconds: float = 0.0
    ran: SandboxRun | None = None

    def __reduce__(
        self,
    ) -> tuple[Callable[..., Outcome], tuple[str, RewardResult | None, str, float, SandboxRun | None]]:
        # the status as its value: pickling an enum member costs ~7 us each way, more than the rest of a result
        return _outcome, (self.status.value, self.result, self.error, self.seconds, self.ran)


def _outcome(
    status: str, result: RewardResult | None, error: str, seconds: float, ran: SandboxRun | None = None
) -> Outcome:
    return Outcome(_STATUS_BY_VALUE[status], result, error, seconds, ran)


# -- verifier process -> pool ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The reward is imported: the verifier takes batches."""

    pid: int


@dataclass(frozen=True)
class InitError:
    """The reward (or the verifier's set-up) failed to load; the process exits."""

    message: str


@dataclass(frozen=True)
class Scored:
    """The outcome of input ``index`` of a batch."""

    index: int
    outcome: Outcome


@dataclass(frozen=True)
class Results:
    """Outcomes of consecutive inputs of batch ``job_id``, in order."""

    job_id: int
    scored: tuple[Scored, ...]


# -- pool -> verifier process ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    """Score these inputs (or run these programs), in order; results come back as :class:`Results` of the same
    ``job_id``."""

    job_id: int
    inputs: tuple[Job, ...]


@dataclass(frozen=True)
class Stop:
    """Close the scorer and exit."""


ToPool = Ready | InitError | Results
ToVerifier = Batch | Stop
