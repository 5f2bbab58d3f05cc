"""One row of ``metrics.jsonl``: the one definition the trainer writes and every reader parses.

The trainer's rank 0 writes one :class:`RlRow` per optimizer step and, during the supervised warm-up, one
:class:`SftRow` per warm-up step (``"phase": "sft"``), one :class:`EvalRow` per evaluation inside the run
(``"phase": "eval"``, ``trainer.eval``; an RL row carries no ``phase`` key, and a row without one
is an RL row). Readers (the launcher's progress line and summary, ``relayrl status``, the dashboard,
``relayrl plot``) parse each line with :func:`parse_row` and use the typed fields, never string keys.

Rows written by older or newer versions parse too: a field the row lacks (or gives as ``null``, or as something
that is not a number) takes its default and is listed in ``missing``; keys this version does not know are
ignored. Only a row's step is required: a line without it (or not a JSON object, or of an unknown phase) is not
a row. The JSON form (:meth:`RlRow.to_json`) is the file format, so ``parse_row(row.to_json()) == row``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from relayrl.common.books import OUTCOMES, PENDING_WORDS

REWARD_COMPONENT_PREFIX = "reward/"  # a reward component ``exact`` is written as the key ``reward/exact``


@dataclass
class RlRow:
    """One optimizer step (rank 0; counts are over every rank unless noted)."""

    phase: ClassVar[Literal["rl"]] = "rl"

    step: int  # optimizer steps done (the x-axis)
    weight_version: int = 0  # version published with this step's weights
    reward_mean: float = 0.0  # over the step's trained episodes
    reward_std: float = 0.0
    # mean of each named reward component over rank 0's episodes; written as ``reward/<name>`` keys
    reward_components: dict[str, float] = field(default_factory=dict)
    episodes: int = 0  # episodes trained in this step
    tokens: int = 0  # completion tokens in the loss (rank 0)
    staleness_mean: float = 0.0  # optimizer steps between the sample's weights and the trainer's
    staleness_max: int = 0
    staleness_hist: dict[str, int] = field(default_factory=dict)  # staleness (as a string) -> episodes
    episodes_dropped_stale: int = 0  # run totals: beyond rollout.max_staleness
    groups_dropped_stale: int = 0
    reward_errors: int = 0  # episodes of this step's groups whose scoring failed (excluded from the loss)
    episodes_dropped_reward_error: int = 0  # run totals
    groups_dropped_reward_error: int = 0
    episodes_invalid: int = 0  # run totals: entries moved to the dead-letter stream (undecodable or invalid)
    groups_invalid: int = 0
    episodes_dropped_zero_advantage: int = 0  # run totals: zero-advantage groups dropped (dynamic sampling)
    groups_dropped_zero_advantage: int = 0
    episodes_trained: int = 0  # run totals
    groups_trained: int = 0
    loss: float = 0.0
    grad_norm: float = 0.0
    clip_frac: float = 0.0  # fraction of tokens whose ratio was clipped
    ratio_mean: float = 0.0
    kl: float = 0.0
    lr: float = 0.0
    importance_mean: float = 0.0  # off-policy importance weights
    importance_max: float = 0.0
    logprob_diff_mean: float = 0.0  # trainer vs behaviour logprobs of the sampled tokens
    mismatch_masked_frac: float = 0.0  # tokens trainer.loss.mismatch_mask left out of the loss
    ref_kl: float = 0.0  # mean KL estimate against the reference model (trainer.loss.kl_coef > 0)
    teacher_kl: float = 0.0  # mean log pi - log pi_teacher of the trained tokens (on-policy distillation)
    completion_len_mean: float = 0.0
    episodes_per_s: float = 0.0  # since the previous step
    step_time_s: float = 0.0
    time_s: float = 0.0  # since the trainer started
    world_size: int = 1
    queue_lag: int | None = None  # stream entries not yet delivered (None: Redis cannot tell)
    queue_pending: int = 0  # delivered, not yet acknowledged
    # the last weight publication; absent (None) before the first
    weight_sync_s: float | None = None
    weight_sync_bytes: int | None = None
    probe_max_diff: float | None = None
    # Where this step's wall time went, in seconds (rank 0's own clock; see relayrl.trainer.steptime). The wall is
    # the time since the previous row was built; the seven parts add up to it. Absent from older rows (all 0.0,
    # listed in ``missing``).
    time_wall_s: float = 0.0
    time_data_s: float = 0.0  # reading the stream, assembling and checking groups, measuring their staleness
    time_fwd_bwd_s: float = 0.0  # forward and backward passes, incl. the gradient all-reduce
    time_optimizer_s: float = 0.0  # gradient clipping and the AdamW step
    time_publish_s: float = 0.0  # what the step waited for its publication (all of it without overlap)
    time_checkpoint_s: float = 0.0  # checkpoints saved and acknowledged since the previous row
    time_metrics_s: float = 0.0  # step statistics, counters, audit trail, writing the previous row, logging
    time_other_s: float = 0.0  # the rest: the wall less the parts above
    # the last verified publication's own parts (0.0 where not measured); without trainer.publication.overlap they
    # lie within time_publish_s; with it the push runs in the background and time_publish_s is what the step waited
    time_publish_serialise_s: float = 0.0  # snapshot of the parameters and the transport's messages/file
    time_publish_transfer_s: float = 0.0  # the UpdateWeights call less inference's own time
    time_publish_swap_s: float = 0.0  # inference's own time: assemble, validate, swap, score the probe (apply_s)
    time_publish_probe_s: float = 0.0  # the trainer's reference probe logprobs and their comparison
    # of time_publish_s, the wait for the previous step's push still in flight (with overlap; rank 0)
    time_publish_wait_s: float = 0.0
    # time_data_s split at the moment the batch's last group left rollout's workflow (its episodes' enqueued_at:
    # generated and scored): before it the trainer waited for generation, after it for the group in transit
    # (rollout's append, Redis, the trainer's read, decoding and checks). Host clocks: exact on one host. Both 0.0
    # where not measured (an episode without enqueued_at).
    time_data_generating_s: float = 0.0
    time_data_transit_s: float = 0.0
    # Multi-turn episodes (relayrl.rollout.workflows), over every rank's trained episodes; a single-turn episode
    # counts one turn and ends "single_turn". Absent from older rows (listed in ``missing``).
    turns_mean: float = 0.0  # model turns per episode
    tool_calls_mean: float = 0.0  # tool calls per episode
    tool_errors: int = 0  # failed tool calls in this step's episodes
    episodes_multi_version: int = 0  # episodes whose tokens came from more than one weight version
    episode_ends: dict[str, int] = field(default_factory=dict)  # how the step's episodes ended -> episodes
    missing: frozenset[str] = field(default=frozenset(), compare=False, repr=False)  # when parsed: see module

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in _fields(RlRow):
            value = getattr(self, f.name)
            if f.name == "reward_components":
                out |= {f"{REWARD_COMPONENT_PREFIX}{k}": v for k, v in sorted(value.items())}
            elif f.name in _OMITTED_WHEN_NONE and value is None:
                continue
            else:
                out[f.name] = dict(value) if isinstance(value, dict) else value
        return out


@dataclass
class SftRow:
    """One supervised warm-up step (``trainer.sft_warmup_steps``)."""

    phase: ClassVar[Literal["sft"]] = "sft"

    sft_step: int  # warm-up steps done (its own x-axis)
    loss: float = 0.0
    grad_norm: float = 0.0
    time_s: float = 0.0  # since the trainer started
    missing: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"phase": self.phase, **{f.name: getattr(self, f.name) for f in _fields(SftRow)}}


@dataclass
class EvalRow:
    """One held-out evaluation inside the run (``trainer.eval``), after optimizer step ``eval_step``."""

    phase: ClassVar[Literal["eval"]] = "eval"

    eval_step: int  # the training step after which it started (its x-axis, the same as the RL rows')
    weight_version: int = 0  # published at that step
    weight_version_min: int = 0  # oldest and newest version of any greedy token (weights may swap meanwhile)
    weight_version_max: int = 0
    greedy_accuracy: float = 0.0
    mean_reward: float = 0.0  # of the greedy completions
    sampled_mean_reward: float = 0.0  # with trainer.eval.k
    pass_at_k: float = 0.0  # with trainer.eval.k
    k: int = 0
    rows: int = 0
    reward_errors: int = 0
    seconds: float = 0.0
    skipped: int = 0  # evaluations due while another ran, so far
    time_s: float = 0.0  # since the trainer started, when it ended
    missing: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"phase": self.phase, **{f.name: getattr(self, f.name) for f in _fields(EvalRow)}}


MetricsRow = RlRow | SftRow | EvalRow
_OMITTED_WHEN_NONE = frozenset({"weight_sync_s", "weight_sync_bytes", "probe_max_diff"})
_STEP = {RlRow: "step", SftRow: "sft_step", EvalRow: "eval_step"}


def _fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.name != "missing"]


def _number(value: Any, kind: str) -> int | float | None:
    """``value`` as the field's number type, or None when it is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if "float" in kind:
        return float(value)
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value)


def _parse(cls: type[RlRow] | type[SftRow] | type[EvalRow], data: Mapping[str, Any]) -> MetricsRow | None:
    values: dict[str, Any] = {}
    missing: set[str] = set()
    for f in _fields(cls):
        kind = str(f.type)
        raw = data.get(f.name)
        if f.name == "reward_components":
            comps = {
                k.removeprefix(REWARD_COMPONENT_PREFIX): _number(v, "float")
                for k, v in data.items()
                if k.startswith(REWARD_COMPONENT_PREFIX)
            }
            values[f.name] = {k: v for k, v in comps.items() if v is not None}
        elif f.name in ("staleness_hist", "episode_ends"):
            if isinstance(raw, Mapping):
                hist = {str(k): _number(v, "int") for k, v in raw.items()}
                values[f.name] = {k: int(v) for k, v in hist.items() if v is not None}
            else:
                missing.add(f.name)
        else:
            number = _number(raw, kind)
            if number is None:
                missing.add(f.name)
            else:
                values[f.name] = number
    if _STEP[cls] in missing:
        return None
    return cls(**values, missing=frozenset(missing))


def parse_row(data: Any) -> MetricsRow | None:
    """A decoded line as a row; None when it is not one (not a JSON object, an unknown phase, no step)."""
    if not isinstance(data, Mapping):
        return None
    phase = data.get("phase", RlRow.phase)
    classes: dict[str, type[RlRow] | type[SftRow] | type[EvalRow]] = {
        RlRow.phase: RlRow,
        SftRow.phase: SftRow,
        EvalRow.phase: EvalRow,
    }
    cls = classes.get(phase) if isinstance(phase, str) else None
    return _parse(cls, data) if cls is not None else None


def parse_line(line: str | bytes) -> MetricsRow | None:
    """One line of metrics.jsonl as a row; None for a blank, torn or invalid line, or one that is not a row."""
    try:
        return parse_row(json.loads(line))
    except ValueError:
        return None


def read_rows(path: Path) -> list[MetricsRow]:
    """Every row of a metrics.jsonl file (lines that are not rows, such as a torn last line, are skipped)."""
    rows = (parse_line(line) for line in path.read_text().splitlines() if line.strip())
    return [r for r in rows if r is not None]


def rl_rows(rows: Iterable[MetricsRow | None]) -> list[RlRow]:
    """The training steps among ``rows`` (warm-up rows left out)."""
    return [r for r in rows if isinstance(r, RlRow)]


# the shares of the trainer's wall time the launcher's summary reports: name -> the RlRow fields summed into it
TIME_SHARES: dict[str, tuple[str, ...]] = {
    "data_wait": ("time_data_s",),
    "compute": ("time_fwd_bwd_s", "time_optimizer_s"),
    "publication": ("time_publish_s",),
    "checkpoint_ack": ("time_checkpoint_s",),
    "metrics": ("time_metrics_s",),
    "other": ("time_other_s",),
}


def time_shares(rows: Iterable[MetricsRow | None]) -> dict[str, float]:
    """Shares (0..1) of the trainer's wall time over the training rows that carry a breakdown (rows of older
    versions lack it and are left out), per :data:`TIME_SHARES` name (they add up to 1), plus ``generation``: the
    part of the data wait spent before the batch's last group was generated and scored (``time_data_generating_s``;
    0 where not measured), ``plumbing``: everything that is neither forward/backward, the optimizer step nor that
    wait for generation (1 - compute - generation: the data in transit, publication, checkpoint and
    acknowledgement, metrics, other), and ``wall_s``: the seconds they cover. Empty when no row carries a
    breakdown."""
    timed = [r for r in rl_rows(rows) if "time_wall_s" not in r.missing and r.time_wall_s > 0]
    wall = sum(r.time_wall_s for r in timed)
    if not timed or wall <= 0:
        return {}
    shares = {name: sum(getattr(r, f) for r in timed for f in fields) / wall for name, fields in TIME_SHARES.items()}
    generation = sum(r.time_data_generating_s for r in timed) / wall
    return {**shares, "generation": generation, "plumbing": 1.0 - shares["compute"] - generation, "wall_s": wall}


def format_time_shares(shares: Mapping[str, float]) -> str:
    """One line of :func:`time_shares` (empty when there are none)."""
    if not shares:
        return ""
    parts = ", ".join(f"{name.replace('_', ' ')} {100 * shares[name]:.0f}%" for name in TIME_SHARES)
    return (
        f"trainer time over {shares['wall_s']:.1f}s: {parts}; of the data wait, generation "
        f"{100 * shares.get('generation', 0.0):.0f}%; plumbing {100 * shares['plumbing']:.0f}%"
    )


def row_fields(source: Any) -> dict[str, Any]:
    """The fields of the dataclass ``source`` that the metrics row has under the same names (a step's statistics,
    the learner's): each figure keeps one name from where it is computed to the row."""
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(source) if f.name in _RL_FIELDS}


# how a group that was produced left the books, in the order the summaries write them: summary key -> words
GROUP_OUTCOMES: tuple[tuple[str, str], ...] = (
    *((o.groups, o.words) for o in OUTCOMES),
    ("groups_pending", PENDING_WORDS),
)


def format_books(summary: Mapping[str, Any]) -> str:
    """The run's books of a ``summary.json`` in one line: groups produced = trained + each drop reason + invalid +
    pending (a key a summary of an older version lacks counts 0). Printed by ``relayrl run``, shown by the
    dashboard."""
    foreign = summary.get("groups_foreign", 0)
    return (
        f"groups produced {summary.get('groups_produced', 0)}"
        + (f" (+ {foreign} appended by others)" if foreign else "")
        + " = "
        + " + ".join(f"{words} {summary.get(key, 0)}" for key, words in GROUP_OUTCOMES)
    )


_RL_FIELDS = frozenset(f.name for f in dataclasses.fields(RlRow))
