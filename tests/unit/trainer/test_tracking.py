"""The tracker against the real backends: TensorBoard event files, an offline W&B run, a SQLite MLflow store."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from relayrl.config.tracking import MlflowConfig, TrackingConfig, WandbConfig
from relayrl.config.typed import ConfigError
from relayrl.trainer.tracking import flatten_scalars, open_tracker, redacted, scalars_of, use_c_crc32c

# two warm-up rows, then three RL rows shaped like the trainer's (a nested histogram, a reward component)
SFT_ROWS = [{"phase": "sft", "sft_step": i, "loss": 2.0 / i, "grad_norm": 0.5 * i, "time_s": 0.1 * i} for i in (1, 2)]
RL_ROWS = [
    {
        "step": s,
        "weight_version": s + 2,
        "reward_mean": 0.25 * s,
        "reward/exact": 0.1 * s,
        "staleness_hist": {"0": 10 - s, "1": s},
        "staleness_max": 1,
        "loss": -0.01 * s,
        "world_size": 1,
    }
    for s in (1, 2, 3)
]
RUN_CONFIG = {"name": "t", "trainer": {"lr": 0.001}, "redis": {"url": "redis://:hunter2@redis:6379/0"}}


def _log_all(cfg: TrackingConfig, out: Path) -> None:
    tracker = open_tracker(cfg, out, "t", RUN_CONFIG)
    for row in SFT_ROWS:
        tracker.log(row, row["sft_step"])
    for row in RL_ROWS:
        tracker.log(row, row["step"])
    tracker.close()


def _expected(key: str) -> list[tuple[int, float]]:
    """(step, value) of one scalar key over the rows above, as the scalar backends should log it."""
    if key.startswith("sft/"):
        return [(r["sft_step"], float(r[key[4:]])) for r in SFT_ROWS]
    if key.startswith("staleness_hist/"):
        return [(r["step"], float(r["staleness_hist"][key.split("/")[1]])) for r in RL_ROWS]
    return [(r["step"], float(r[key])) for r in RL_ROWS]


CHECKED = [
    "reward_mean",
    "weight_version",
    "reward/exact",
    "staleness_hist/0",
    "staleness_hist/1",
    "loss",
    "sft/loss",
    "sft/grad_norm",
]


def test_scalars_of_flattens_mappings_prefixes_other_phases_and_skips_strings_and_the_step() -> None:
    step_key, values = scalars_of(RL_ROWS[0])
    assert step_key == "step"
    assert values["staleness_hist/0"] == 9.0 and values["staleness_hist/1"] == 1.0
    assert "staleness_hist" not in values and "step" not in values
    step_key, values = scalars_of(SFT_ROWS[1])
    assert step_key == "sft/step"
    assert set(values) == {"sft/sft_step", "sft/loss", "sft/grad_norm", "sft/time_s"}  # no "phase" string
    assert flatten_scalars({"ok": True, "name": "x", "none": None, "list": [1], "n": 3}) == {"ok": 1.0, "n": 3.0}


def test_redacted_hides_url_passwords_and_keeps_everything_else() -> None:
    assert redacted(RUN_CONFIG) == {
        "name": "t",
        "trainer": {"lr": 0.001},
        "redis": {"url": "redis://:***@redis:6379/0"},
    }
    assert redacted({"u": "redis://user:pw@h:1/0", "v": "http://h:5000"}) == {
        "u": "redis://user:***@h:1/0",
        "v": "http://h:5000",
    }


def test_metrics_jsonl_always_holds_every_row_unchanged(tmp_path: Path) -> None:
    _log_all(TrackingConfig(tensorboard=False), tmp_path)

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == SFT_ROWS + RL_ROWS
    assert not (tmp_path / "tensorboard").exists()


def _pure_crc32c(data: bytes) -> int:
    """tensorboard's own CRC32C, the pure-Python loop."""
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as tf_stub

    return int(tf_stub.crc_finalize(tf_stub.crc_update(tf_stub.CRC_INIT, data)))


@pytest.mark.parametrize("size", [0, 1, 8, 13, 2048, 65537])
def test_the_c_crc32c_given_to_tensorboard_equals_its_pure_python_one(size: int) -> None:
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow

    data = bytes((7 * i + size) % 256 for i in range(size))  # deterministic, every byte value

    assert use_c_crc32c()  # google-crc32c's C build (a manylinux wheel) is what the tests install
    assert pywrap_tensorflow.crc32c(data) == _pure_crc32c(data)


def test_tensorboard_event_records_written_with_the_c_checksum_verify_with_the_pure_python_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import google_crc32c
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow

    _log_all(TrackingConfig(), tmp_path)

    assert pywrap_tensorflow.crc32c is google_crc32c.value  # the tracker gave TensorBoard the C checksum
    monkeypatch.setattr(pywrap_tensorflow, "crc32c", _pure_crc32c)  # verify with tensorboard's own loop
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    raw, records, at = events.read_bytes(), 0, 0
    while at < len(raw):  # TFRecord: length (u64), its masked CRC (u32), the data, the data's masked CRC (u32)
        header, (length,) = raw[at : at + 8], struct.unpack("<Q", raw[at : at + 8])
        data = raw[at + 12 : at + 12 + length]
        (header_crc,), (data_crc,) = (
            struct.unpack("<I", raw[at + 8 : at + 12]),
            struct.unpack("<I", raw[at + 12 + length : at + 16 + length]),
        )
        assert header_crc == pywrap_tensorflow.masked_crc32c(header)
        assert data_crc == pywrap_tensorflow.masked_crc32c(data)
        at, records = at + 16 + length, records + 1
    assert records >= len(RL_ROWS) + len(SFT_ROWS)  # one event per row, plus the file version and the config text


def test_tensorboard_event_file_holds_each_scalar_at_its_step(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_all(TrackingConfig(), tmp_path)

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "step" not in tags and "phase" not in tags and "sft/phase" not in tags
    for key in CHECKED:
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in _expected(key)], key
        assert [v for _, v in got] == pytest.approx([v for _, v in _expected(key)], rel=1e-6, abs=1e-7), key


def _wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a .wandb file (LevelDB log format: 32 KiB blocks of checksummed chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # no room for a chunk header: the rest of the block is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _history_value(item: Any) -> Any:
    kind = item.WhichOneof("value")
    if kind is not None and kind not in ("value_json", "json"):
        return getattr(item, kind)
    return json.loads(item.value_json or item.json)


def _wandb_history(path: Path, expected: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """The history records of an offline run file, once ``expected`` of them are there: wandb-core (a process of
    its own) may still be writing the file when ``run.finish()`` returns (seen here: header only, then complete
    within seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(path) if path.stat().st_size > 7 else []
        history = [
            {(i.key or "/".join(i.nested_key)): _history_value(i) for i in r.history.item}
            for r in records
            if r.WhichOneof("record_type") == "history"
        ]
        if len(history) >= expected or time.monotonic() > deadline:
            return history
        time.sleep(0.1)


def test_wandb_offline_run_holds_each_scalar_against_its_step_metric(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()

    _log_all(
        TrackingConfig(tensorboard=False, wandb=WandbConfig(enabled=True, mode="offline", project="test")),
        tmp_path / "run",
    )

    files = list((tmp_path / "wandb-dir").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history = _wandb_history(files[0], len(SFT_ROWS) + len(RL_ROWS))
    assert len(history) == len(SFT_ROWS) + len(RL_ROWS)
    records = _wandb_records(files[0])
    for key in CHECKED:
        step_key = "sft/step" if key.startswith("sft/") else "step"
        got = [(int(h[step_key]), float(h[key])) for h in history if key in h]
        assert [s for s, _ in got] == [s for s, _ in _expected(key)], key
        assert [v for _, v in got] == pytest.approx([v for _, v in _expected(key)], rel=1e-9), key
    step_metric = {r.metric.name: r.metric.step_metric for r in records if r.WhichOneof("record_type") == "metric"}
    assert step_metric["reward_mean"] == "step" and step_metric["weight_version"] == "step"
    assert step_metric["sft/loss"] == "sft/step"
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["trainer"] == {"lr": 0.001}
    assert config["redis"] == {"url": "redis://:***@redis:6379/0"}  # the run config, redacted


def test_mlflow_sqlite_store_holds_each_scalar_at_its_step_and_the_config_as_params(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    _log_all(TrackingConfig(tensorboard=False, mlflow=MlflowConfig(enabled=True, experiment="exp")), tmp_path)

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("exp")
    assert experiment is not None
    assert experiment.artifact_location == (tmp_path / "mlartifacts").resolve().as_uri()
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "t"
    for key in CHECKED:
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert [s for s, _ in got] == [s for s, _ in _expected(key)], key
        assert [v for _, v in got] == pytest.approx([v for _, v in _expected(key)], rel=1e-9), key
    assert run.data.params["trainer.lr"] == "0.001"
    assert run.data.params["redis.url"] == "redis://:***@redis:6379/0"
    assert "step" not in run.data.metrics


def test_a_backend_that_cannot_start_fails_at_start_up_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    cfg = TrackingConfig(mlflow=MlflowConfig(enabled=True, tracking_uri=f"sqlite:///{blocker}/mlflow.db"))

    with pytest.raises(ConfigError, match="the MLflow run did not start") as info:
        open_tracker(cfg, tmp_path / "run", "t")

    assert info.value.field == "tracking.mlflow"
    assert str(blocker) in str(info.value.value)
