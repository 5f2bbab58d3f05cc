"""`relayrl merge-lora`: a LoRA checkpoint's adapter merged into its base model (loads without peft)."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "merge-lora"
HELP = "merge a LoRA checkpoint's adapter into its base model: a full Hugging Face directory that loads without peft"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("adapter", type=Path, help="a checkpoint folder (or its model/ folder) holding the adapter")
    p.add_argument("--base", type=Path, required=True, help="the base model directory (the run's model.path)")
    p.add_argument("--out", type=Path, required=True, help="model directory to write")


def run(args: argparse.Namespace) -> int:
    from relayrl.common.logging import setup_logging
    from relayrl.common.lora import merge_adapter

    setup_logging("merge-lora")
    print(f"wrote {merge_adapter(args.adapter, args.base, args.out)}")
    return 0
