"""Experiment tracking: one narrow interface (``log(row, step)``, ``close()``) over several backends.

The trainer's rank 0 opens one :class:`Tracker` and logs one row per step. ``<output_dir>/metrics.jsonl`` is
always written, one JSON object per row exactly as given (``relayrl plot``, the launcher's progress and the
tests read it). The other backends are chosen in the ``tracking`` config section:

- TensorBoard (on by default): ``<output_dir>/tensorboard``, through ``torch.utils.tensorboard``.
- Weights & Biases (``pip install 'relayrl[wandb]'``): online or offline runs.
- MLflow (``pip install 'relayrl[mlflow]'``): any tracking URI; by default a SQLite store in
  ``<output_dir>/mlflow.db``.

Scalar backends see a row as scalars: nested mappings are flattened (``staleness_hist: {"0": 5}`` becomes
``staleness_hist/0``), booleans become 0/1, strings and other values are left out. A row with a ``phase``
other than ``rl`` (the supervised warm-up's ``sft``) is logged under that prefix (``sft/loss``) with its own
step axis, so warm-up and RL steps never mix. ``step`` is the x-axis; ``weight_version`` is a scalar like the
others. A backend that cannot start raises :class:`ConfigError` at start-up; one that fails to log a row later
is reported with a warning and training goes on (``metrics.jsonl`` excepted: its errors propagate).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Protocol

import google_crc32c

from relayrl.common.control import redact_url_password
from relayrl.config.tracking import MlflowConfig, TrackingConfig, WandbConfig
from relayrl.config.typed import ConfigError

log = logging.getLogger(__name__)


class Tracker(Protocol):
    def log(self, row: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


# -- rows as scalars ---------------------------------------------------------------------------------------
def flatten_scalars(row: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numbers of ``row`` by ``/``-joined key; nested mappings flattened; strings, None and lists left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_scalars(value, f"{name}/"))
        elif isinstance(value, bool | int | float):
            out[name] = float(value)
    return out


def namespace(row: Mapping[str, Any]) -> str:
    """Key prefix of a row: ``""`` for RL steps, ``"<phase>/"`` for another phase (``sft/``)."""
    phase = row.get("phase")
    return f"{phase}/" if isinstance(phase, str) and phase and phase != "rl" else ""


def scalars_of(row: Mapping[str, Any]) -> tuple[str, dict[str, float]]:
    """The row's step key (``step`` or ``sft/step``) and its scalars, without the step itself."""
    prefix = namespace(row)
    step_key = f"{prefix}step"
    values = flatten_scalars({k: v for k, v in row.items() if k != "phase"}, prefix)
    values.pop(step_key, None)
    return step_key, values


def redacted(value: Any) -> Any:
    """A plain-data config with passwords in URLs (redis://user:secret@host) replaced by ***."""
    if isinstance(value, Mapping):
        return {k: redacted(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redacted(v) for v in value]
    if isinstance(value, str):
        return redact_url_password(value)
    return value


# -- backends ----------------------------------------------------------------------------------------------
class JsonlTracker:
    """``metrics.jsonl``: each row as one JSON line, as given, flushed at once (appends across restarts)."""

    name = "metrics.jsonl"

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] = path.open("a")

    def log(self, row: Mapping[str, Any], step: int) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def use_c_crc32c() -> bool:
    """Give TensorBoard a CRC32C computed in C (google-crc32c) for its event records. Without TensorFlow, tensorboard
    computes it in a pure-Python loop: about 0.2 ms per 2 kB row, in its writer thread, holding the interpreter lock
    that the training loop and the compute thread wait for. Only that primitive is swapped: tensorboard's masking
    and record format stay its own. False (nothing changed) where google-crc32c has no C build."""
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow

    if google_crc32c.implementation != "c":
        return False
    pywrap_tensorflow.crc32c = google_crc32c.value  # what its masked_crc32c calls for every record
    return True


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, log_dir: Path, run_config: Mapping[str, Any], flush_s: int = 10) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                "tracking.tensorboard", True, f"needs the tensorboard package (pip install tensorboard): {exc}"
            ) from exc
        use_c_crc32c()
        try:
            self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=flush_s)
        except OSError as exc:
            raise ConfigError("tracking.tensorboard", True, f"cannot write to {log_dir}: {exc}") from exc
        self.log_dir = log_dir
        self.writer.add_text("config", "```json\n" + json.dumps(redacted(run_config), indent=1) + "\n```")

    def log(self, row: Mapping[str, Any], step: int) -> None:
        """The row's scalars as one event (one ``Summary`` holding every value, as ``add_scalar`` writes each):
        the event file is opened and appended to once per row, not once per scalar."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        _, values = scalars_of(row)
        summary = Summary(value=[Summary.Value(tag=key, simple_value=value) for key, value in values.items()])
        self.writer._get_file_writer().add_summary(summary, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run; each key is plotted against its row's step key (``step``, or ``sft/step`` for warm-up rows),
    so the warm-up and RL steps need no shared, monotonic step counter."""

    name = "wandb"

    def __init__(self, cfg: WandbConfig, output_dir: Path, run_name: str, run_config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(
                "tracking.wandb.enabled", True, f"needs the wandb package: pip install 'relayrl[wandb]' ({exc})"
            ) from exc
        output_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=cfg.project,
                entity=cfg.entity or None,
                name=cfg.run_name or run_name,
                group=cfg.group or None,
                tags=list(cfg.tags) or None,
                mode=cfg.mode,
                dir=None if os.environ.get("WANDB_DIR") else str(output_dir),
                config=dict(redacted(run_config)),
                settings=wandb.Settings(silent=True),
            )  # no banner or summary on stderr: one log line instead
        except Exception as exc:  # wandb raises its own error types (UsageError, CommError, ...)
            raise ConfigError(
                "tracking.wandb",
                f"mode={cfg.mode} project={cfg.project}",
                f"the W&B run did not start: {type(exc).__name__}: {exc}",
            ) from exc
        log.info("W&B run %s (%s): %s", self.run.id, cfg.mode, self.run.url if cfg.mode == "online" else self.run.dir)
        self._defined: set[str] = set()

    def log(self, row: Mapping[str, Any], step: int) -> None:
        step_key, values = scalars_of(row)
        for key in (step_key, *values):
            if key not in self._defined:
                if key == step_key:
                    self.run.define_metric(key)
                else:
                    self.run.define_metric(key, step_metric=step_key)
                self._defined.add(key)
        self.run.log({step_key: step, **values})

    def close(self) -> None:
        self.run.finish()


_MLFLOW_KEY = re.compile(r"[^\w./\- ]")


class MlflowTracker:
    """An MLflow run, through ``MlflowClient`` (no global active run); a row is one ``log_batch``."""

    name = "mlflow"

    def __init__(self, cfg: MlflowConfig, output_dir: Path, run_name: str, run_config: Mapping[str, Any]) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ConfigError(
                "tracking.mlflow.enabled", True, f"needs the mlflow package: pip install 'relayrl[mlflow]' ({exc})"
            ) from exc
        mlflow_log = logging.getLogger("mlflow")  # MLflow's own stderr handler would bypass our format
        for handler in list(mlflow_log.handlers):
            mlflow_log.removeHandler(handler)
        mlflow_log.propagate = True
        uri = cfg.tracking_uri
        artifacts: str | None = None
        if not uri:  # a local SQLite store, artifacts beside it (never under the working directory)
            output_dir.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(output_dir / 'mlflow.db').resolve()}"
            artifacts = (output_dir / "mlartifacts").resolve().as_uri()
        self.tracking_uri = uri
        try:
            self.client = MlflowClient(tracking_uri=uri)
            experiment = self.client.get_experiment_by_name(cfg.experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(cfg.experiment, artifact_location=artifacts)
            )
            self.run_id: str = self.client.create_run(experiment_id, run_name=cfg.run_name or run_name).info.run_id
            params = [
                Param(_MLFLOW_KEY.sub("_", k), str(v)[:6000]) for k, v in _flat_params(redacted(run_config)).items()
            ]
            for i in range(0, len(params), 100):  # MLflow's limit of params per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        except Exception as exc:  # MlflowException, SQLAlchemy and connection errors
            raise ConfigError(
                "tracking.mlflow",
                f"tracking_uri={uri} experiment={cfg.experiment}",
                f"the MLflow run did not start: {type(exc).__name__}: {exc}",
            ) from exc
        log.info("MLflow run %s in experiment %s at %s", self.run_id, cfg.experiment, uri)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        _, values = scalars_of(row)
        now = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_KEY.sub("_", k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit of metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat_params(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(_flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# -- composition -------------------------------------------------------------------------------------------
class CompositeTracker:
    """``metrics.jsonl`` first (its errors propagate), then the optional backends (a failure is a warning)."""

    def __init__(self, jsonl: JsonlTracker, others: list[TensorBoardTracker | WandbTracker | MlflowTracker]) -> None:
        self.jsonl = jsonl
        self.others = others

    @property
    def backends(self) -> list[str]:
        return [self.jsonl.name, *(b.name for b in self.others)]

    def log(self, row: Mapping[str, Any], step: int) -> None:
        self.jsonl.log(row, step)
        for backend in self.others:
            try:
                backend.log(row, step)
            except Exception as exc:  # a tracking server hiccup never stops training; metrics.jsonl has the row
                log.warning("%s: could not log step %d: %s: %s", backend.name, step, type(exc).__name__, exc)

    def close(self) -> None:
        for backend in self.others:
            try:
                backend.close()
            except Exception as exc:
                log.warning("%s: close failed: %s: %s", backend.name, type(exc).__name__, exc)
        self.jsonl.close()


def open_tracker(
    cfg: TrackingConfig, output_dir: Path, run_name: str, run_config: Mapping[str, Any] | None = None
) -> CompositeTracker:
    """Start every configured backend; raises ConfigError naming the one that cannot start (after closing the
    ones already started)."""
    run_config = run_config or {}
    jsonl = JsonlTracker(output_dir / "metrics.jsonl")
    others: list[TensorBoardTracker | WandbTracker | MlflowTracker] = []
    try:
        if cfg.tensorboard:
            others.append(TensorBoardTracker(output_dir / "tensorboard", run_config))
        if cfg.wandb.enabled:
            others.append(WandbTracker(cfg.wandb, output_dir, run_name, run_config))
        if cfg.mlflow.enabled:
            others.append(MlflowTracker(cfg.mlflow, output_dir, run_name, run_config))
    except BaseException:
        CompositeTracker(jsonl, others).close()
        raise
    tracker = CompositeTracker(jsonl, others)
    log.info("tracking metrics to %s", ", ".join(tracker.backends))
    return tracker
