"""How a prompt dataset is read: its file format, which of its fields hold the prompt, the conversation, the answer
and the id, what a bad row does, and how many rows are held out for evaluation (relayrl.common.dataset reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from relayrl.config.typed import ConfigError


class DatasetFormat(StrEnum):
    AUTO = "auto"  # by the path: .jsonl/.json/.parquet/.arrow files, a save_to_disk folder, a folder of shards
    JSONL = "jsonl"  # one JSON object per line
    PARQUET = "parquet"
    ARROW = "arrow"  # Arrow IPC, file or stream format (what `datasets` writes)
    HF_DISK = "hf_disk"  # a folder written by `datasets.Dataset.save_to_disk`


class BadRows(StrEnum):
    ERROR = "error"  # the first bad row stops the start with its file, row and field
    SKIP = "skip"  # bad rows are left out and counted (logged at start-up)


@dataclass
class DatasetFields:
    """The dataset's field names for what relayrl reads; a dotted name reaches into a nested object
    (``reward_model.ground_truth``). A row has exactly one of ``prompt`` and ``messages``; the fields not named here
    reach the reward function as the row's metadata."""

    prompt: str = field(default="prompt", metadata={"help": "Field of the text prompt."})
    messages: str = field(
        default="messages",
        metadata={"help": "Field of the conversation (a list of {role, content}), rendered with the chat template."},
    )
    answer: str = field(default="answer", metadata={"help": "Field of the reference answer the reward checks."})
    id: str = field(default="id", metadata={"help": "Field of the row's id (optional in a row; default its number)."})

    def validate(self) -> None:
        for name in ("prompt", "messages", "answer", "id"):
            value = getattr(self, name)
            if not value or any(not part for part in value.split(".")):
                raise ConfigError(name, value, "must be a field name, or names joined by '.' for a nested field")
        names = [self.prompt, self.messages, self.answer, self.id]
        if len(set(names)) != len(names):
            raise ConfigError("fields", names, "prompt, messages, answer and id must name different fields")


@dataclass(frozen=True)
class DatasetSpec:
    """Everything the reader needs: the path and the rollout section's reading settings."""

    path: Path
    format: DatasetFormat = DatasetFormat.AUTO
    fields: DatasetFields = field(default_factory=DatasetFields)
    bad_rows: BadRows = BadRows.ERROR
    held_out_rows: int = 0
    seed: int = 0
    field_name: str = "rollout.dataset"  # the config field the path came from, for errors
